//! ABI conformance: `tests/abi/driver.c` loads the built `librailover.so` with `dlopen`
//! in two processes and drives `ncclNetPlugin_vN` the way NCCL's proxy does (see the
//! comment at the top of driver.c and `docs/design.md` §3.1 and §8.1).
//! One test per exported version; each runs the driver once and requires exit status 0.
//!
//! The driver uses only the loopback interface (`RAILOVER_IFNAME=lo`). Set
//! `RAILOVER_ABI_SEED=0x…` to replay the random message sizes of an earlier run (the seed
//! is printed), and `RAILOVER_ABI_VERBOSE=1` to see the plugin's TRACE lines.

#[path = "abi/support.rs"]
mod support;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// Longer than the driver's own alarm (280 s), so the driver normally reports first.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(330);

fn driver() -> &'static PathBuf {
    static DRIVER: OnceLock<PathBuf> = OnceLock::new();
    DRIVER.get_or_init(|| {
        support::compile_c(
            "driver.c",
            "driver",
            &["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-pthread"],
            &["-ldl"],
        )
    })
}

/// Runs the driver for one version and fails the test unless it exits 0.
fn conformance(version: u32) {
    // Each run forks two processes that move ~100 MiB through loopback and verify every
    // byte; on a small machine, running the versions one after another is faster and
    // keeps the connection deadlines meaningful.
    static SERIAL: Mutex<()> = Mutex::new(());
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());

    let so = support::plugin_so();
    let driver = driver();
    let mut cmd = Command::new(driver);
    cmd.arg(&so)
        .arg(version.to_string())
        .env("RAILOVER_IFNAME", "lo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    println!("running {cmd:?}");
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", driver.display()));
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));

    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the driver") {
            break Some(status);
        }
        if start.elapsed() > DRIVER_TIMEOUT {
            // The driver kills its own child on the way out; this is the last resort.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(100));
    };
    let out = stdout.join().expect("stdout reader");
    let err = stderr.join().expect("stderr reader");
    println!("{out}");
    if !err.is_empty() {
        println!("--- driver stderr ---\n{err}");
    }
    println!(
        "driver v{version} finished in {:.1} s",
        start.elapsed().as_secs_f64()
    );

    let failures: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL")).collect();
    match status {
        None => panic!(
            "driver v{version} did not finish within {DRIVER_TIMEOUT:?}; failures so far:\n{}",
            failures.join("\n")
        ),
        Some(status) => assert!(
            status.success(),
            "driver v{version} exited with {status}; failed checks:\n{}",
            failures.join("\n")
        ),
    }
    assert!(
        failures.is_empty(),
        "driver v{version} exited 0 but printed failures:\n{}",
        failures.join("\n")
    );
    assert!(
        out.contains("grouped receive of 8 buffers")
            && out
                .lines()
                .any(|l| l.starts_with("PASS recv.grouped_receive")),
        "driver v{version} did not run a grouped receive of maxRecvs=8 buffers"
    );
    assert!(
        out.lines().any(|l| l.starts_with("PASS recv.data"))
            && out.lines().any(|l| l.starts_with("PASS send.data")),
        "driver v{version} never reached the data phase"
    );
}

/// Reads a pipe to the end on its own thread, so a chatty driver never blocks on it.
fn drain(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

#[test]
fn abi_v12() {
    conformance(12);
}

#[test]
fn abi_v11() {
    conformance(11);
}

#[test]
fn abi_v10() {
    conformance(10);
}

#[test]
fn abi_v9() {
    conformance(9);
}

#[test]
fn abi_v8() {
    conformance(8);
}

/// Bad `RAILOVER_*` values, non-UTF-8 ones included, fail `init` with one WARN through
/// the logger NCCL hands in; a filter that matches no interface warns too
/// (`tests/abi/env_warn.c`).
#[test]
fn bad_environment_values_warn_through_nccls_logger() {
    let prog = support::compile_c(
        "env_warn.c",
        "env_warn",
        &["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra"],
        &["-ldl"],
    );
    let out = Command::new(&prog)
        .arg(support::plugin_so())
        .env_remove("RAILOVER_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", prog.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    let failures: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(
        out.status.success() && failures.is_empty(),
        "env_warn exited with {}:\n{}",
        out.status,
        failures.join("\n")
    );
    assert!(text.contains("PASS ifname.matches_nothing"), "{text}");
}

/// `env_warn.c` lists the variables it attacks by hand: every variable the plugin reads
/// must be on that list, so a new one cannot go untested.
#[test]
fn env_warn_attacks_every_variable_the_plugin_reads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let c = std::fs::read_to_string(root.join("tests/abi/env_warn.c")).expect("env_warn.c");
    let mut read = std::collections::BTreeSet::new();
    for src in [
        "src/config/mod.rs",
        "src/config/verbs.rs",
        "src/telemetry/exporter.rs",
    ] {
        let text = std::fs::read_to_string(root.join(src)).expect(src);
        for (i, _) in text.match_indices("\"RAILOVER_") {
            let name: String = text[i + 1..]
                .chars()
                .take_while(|ch| ch.is_ascii_uppercase() || *ch == '_')
                .collect();
            read.insert(name);
        }
    }
    assert!(read.len() >= 15, "found only {read:?}");
    let missing: Vec<&String> = read
        .iter()
        .filter(|v| !c.contains(&format!("\"{v}\"")))
        .collect();
    assert!(missing.is_empty(), "env_warn.c does not attack {missing:?}");
}
