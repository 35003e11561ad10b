//! Helpers shared by the ABI tests (`abi_layout`, `abi_symbols`, `abi`): compiling the C
//! programs in `tests/abi/` with the system C compiler and finding the built
//! `librailover.so`. Included with `#[path]`, so each test binary uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

/// `tests/abi/` in the source tree.
pub fn abi_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("abi")
}

/// Where the compiled C programs go: a per-crate scratch directory inside the target dir.
pub fn build_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("abi");
    std::fs::create_dir_all(&dir).expect("create the C build directory");
    dir
}

/// Compiles `tests/abi/<source>` into `<build_dir>/<output>` with `$CC` (default `cc`).
/// `flags` go before the source, `libs` after it. Panics with the compiler's output on
/// failure: a test that cannot build its C side has nothing to say.
///
/// The compiler writes a name private to this process and call, then the file is renamed
/// into place, so tests running in parallel never execute a half-written program.
pub fn compile_c(source: &str, output: &str, flags: &[&str], libs: &[&str]) -> PathBuf {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let src = abi_dir().join(source);
    let out = build_dir().join(output);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let tmp = build_dir().join(format!("{output}.{}.{call}.tmp", std::process::id()));
    let result = Command::new(&cc)
        .args(flags)
        .arg("-I")
        .arg(abi_dir())
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .args(libs)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(
        result.status.success(),
        "`{cc}` failed on {}:\n{}{}",
        src.display(),
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    let warnings = String::from_utf8_lossy(&result.stderr);
    assert!(
        !warnings.contains("warning:"),
        "`{cc}` warned on {}:\n{warnings}",
        src.display()
    );
    std::fs::rename(&tmp, &out).expect("move the compiled program into place");
    out
}

/// The `librailover.so` that cargo built for this test run.
///
/// Cargo compiles the library once with both crate types (`cdylib` and `rlib`) when it
/// builds integration tests, and leaves the `.so` next to the `.rlib` in
/// `target/<profile>/deps/`; `cargo build` also copies it to `target/<profile>/`. The
/// test executable itself lives in `deps/`, so both places are found from it. If neither
/// holds the library (e.g. the tests were built by another tool), `cargo build --lib` is
/// run for the same profile and target directory.
///
/// `RAILOVER_ABI_PLUGIN=/path/to/lib.so` overrides all this (e.g. to check an installed
/// build or another NCCL plugin against the same driver).
pub fn plugin_so() -> PathBuf {
    if let Some(path) = std::env::var_os("RAILOVER_ABI_PLUGIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("path of the test executable");
    let deps = exe.parent().expect("test executable has a directory");
    let profile_dir = deps.parent().expect("deps/ has a parent");
    let candidates = [
        deps.join("librailover.so"),
        profile_dir.join("librailover.so"),
    ];
    if let Some(found) = newest(&candidates) {
        return found;
    }
    build_lib(profile_dir);
    newest(&candidates).unwrap_or_else(|| {
        panic!(
            "librailover.so not found in {} or {} even after `cargo build --lib`",
            deps.display(),
            profile_dir.display()
        )
    })
}

fn newest(paths: &[PathBuf]) -> Option<PathBuf> {
    paths
        .iter()
        .filter_map(|p| {
            let modified = std::fs::metadata(p).and_then(|m| m.modified()).ok()?;
            Some((modified, p))
        })
        .max_by_key(|(modified, _): &(SystemTime, _)| *modified)
        .map(|(_, p)| p.clone())
}

/// Runs `cargo build --lib` into the same target directory and profile as this test.
fn build_lib(profile_dir: &Path) {
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_owned(),
        Some(other) => other.to_owned(),
        None => panic!("unexpected target layout: {}", profile_dir.display()),
    };
    let mut target_dir = profile_dir.parent().expect("profile dir has a parent");
    let mut triple = None;
    // `target/<triple>/<profile>/deps` when built with `--target`.
    if !target_dir.join("CACHEDIR.TAG").exists() {
        if let (Some(parent), Some(name)) = (target_dir.parent(), target_dir.file_name()) {
            if parent.join("CACHEDIR.TAG").exists() {
                triple = Some(name.to_owned());
                target_dir = parent;
            }
        }
    }
    let cargo = option_env!("CARGO").unwrap_or("cargo");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--lib", "--profile", &profile, "--target-dir"])
        .arg(target_dir);
    if let Some(triple) = triple {
        cmd.arg("--target").arg(triple);
    }
    eprintln!("librailover.so not built yet; running {cmd:?}");
    let status = cmd.status().expect("run cargo build --lib");
    assert!(status.success(), "cargo build --lib failed: {status}");
}

/// Whether `tool --version` runs at all.
pub fn have_tool(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}
