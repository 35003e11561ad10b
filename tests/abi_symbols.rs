//! What NCCL's loader sees in `librailover.so`, checked with binutils.
//!
//! * NCCL `dlsym`s `ncclNetPlugin_v12` … `_v8` and casts the result to `ncclNet_vN_t*`, so
//!   each must be a *data object whose storage is the table itself* (`docs/design.md`
//!   §8.1), not a function and not a pointer, and its size must be the table's size.
//! * The plugin must load on hosts without rdma-core: no undefined `ibv_*`, `rdma_*` or
//!   `mlx5dv_*` symbol and no `DT_NEEDED` on their libraries (verbs are opened at run time).
//!
//! `nm` symbol letters for data (ELF): `D` initialised data, `B` BSS, `R` read-only data,
//! `G`/`S` small initialised/uninitialised data, `V` weak object. Lowercase would be a local
//! symbol, which `dlsym` cannot find. `T`/`t` (text) or `i` (ifunc) would mean a function.

#[path = "abi/support.rs"]
mod support;

use std::path::Path;
use std::process::Command;

const DATA_LETTERS: [char; 6] = ['D', 'B', 'R', 'G', 'S', 'V'];

/// `(symbol, sizeof(ncclNet_vN_t))` for every version we export.
const TABLES: [(&str, u64); 5] = [
    ("ncclNetPlugin_v12", 176),
    ("ncclNetPlugin_v11", 176),
    ("ncclNetPlugin_v10", 160),
    ("ncclNetPlugin_v9", 160),
    ("ncclNetPlugin_v8", 152),
];

const FORBIDDEN_PREFIXES: [&str; 3] = ["ibv_", "rdma_", "mlx5dv_"];
const FORBIDDEN_LIBS: [&str; 3] = ["libibverbs", "librdmacm", "libmlx5"];

/// A dynamic symbol as `nm -D -S` prints it.
#[derive(Debug)]
struct Symbol {
    name: String,
    kind: char,
    size: Option<u64>,
}

/// Runs `nm` with `args` on `so`; `None` (after saying why) when `nm` is unavailable.
fn nm(so: &Path, args: &[&str]) -> Option<Vec<Symbol>> {
    if !support::have_tool("nm") {
        eprintln!(
            "SKIP: `nm` (binutils) is not installed; cannot inspect {}",
            so.display()
        );
        return None;
    }
    let out = Command::new("nm")
        .args(args)
        .arg(so)
        .output()
        .expect("run nm");
    assert!(
        out.status.success(),
        "nm {args:?} {} failed: {}",
        so.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    Some(text.lines().filter_map(parse_nm_line).collect())
}

/// Parses `[value] [size] letter name`; the name loses its `@VERSION` suffix.
fn parse_nm_line(line: &str) -> Option<Symbol> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let (kind_at, name) = (words.len().checked_sub(2)?, *words.last()?);
    let mut letters = words[kind_at].chars();
    let kind = letters.next()?;
    if letters.next().is_some() {
        return None;
    }
    let size = if kind_at == 2 {
        u64::from_str_radix(words[1], 16).ok()
    } else {
        None
    };
    let name = name.split('@').next().unwrap_or(name).to_owned();
    Some(Symbol { name, kind, size })
}

#[test]
fn plugin_tables_are_exported_data_objects() {
    let so = support::plugin_so();
    println!("inspecting {}", so.display());
    let Some(defined) = nm(&so, &["-D", "--defined-only", "-S"]) else {
        return;
    };
    let mut errors = Vec::new();
    for (name, size) in TABLES {
        match defined.iter().find(|s| s.name == name) {
            None => errors.push(format!("{name}: not a defined dynamic symbol")),
            Some(sym) => {
                println!("{name}: nm type {} size {:?}", sym.kind, sym.size);
                if !DATA_LETTERS.contains(&sym.kind) {
                    errors.push(format!(
                        "{name}: nm type `{}` is not a global data object (want one of {:?})",
                        sym.kind, DATA_LETTERS
                    ));
                }
                if sym.size != Some(size) {
                    errors.push(format!(
                        "{name}: symbol size {:?}, sizeof(ncclNet_vN_t) is {size}",
                        sym.size
                    ));
                }
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn no_hard_dependency_on_rdma_core() {
    let so = support::plugin_so();
    let Some(undefined) = nm(&so, &["-D", "--undefined-only"]) else {
        return;
    };
    let bad: Vec<&str> = undefined
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| FORBIDDEN_PREFIXES.iter().any(|p| n.starts_with(p)))
        .collect();
    assert!(
        bad.is_empty(),
        "{} links rdma-core symbols at load time: {bad:?}",
        so.display()
    );

    if !support::have_tool("readelf") {
        eprintln!("SKIP DT_NEEDED check: `readelf` is not installed");
        return;
    }
    let out = Command::new("readelf")
        .arg("-d")
        .arg(&so)
        .output()
        .expect("run readelf");
    assert!(out.status.success(), "readelf -d failed");
    let dynamic = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = dynamic
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter(|l| FORBIDDEN_LIBS.iter().any(|lib| l.contains(lib)))
        .collect();
    assert!(
        needed.is_empty(),
        "{} needs rdma-core libraries at load time: {needed:?}",
        so.display()
    );
}

#[test]
fn nm_line_parser() {
    let s = parse_nm_line("0000000000012340 00000000000000b0 D ncclNetPlugin_v12").unwrap();
    assert_eq!(
        (s.name.as_str(), s.kind, s.size),
        ("ncclNetPlugin_v12", 'D', Some(176))
    );
    let s = parse_nm_line("                 U memcpy@GLIBC_2.14").unwrap();
    assert_eq!((s.name.as_str(), s.kind, s.size), ("memcpy", 'U', None));
    let s = parse_nm_line("                 w __gmon_start__").unwrap();
    assert_eq!((s.name.as_str(), s.kind), ("__gmon_start__", 'w'));
}
