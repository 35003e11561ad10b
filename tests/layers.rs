//! The library's modules import one way only (`docs/design.md` §2): a top-level
//! module of `src/` may name through `crate::` only the modules listed below it in
//! [`LAYERS`]. And `unsafe` is allowed only in `src/ffi/` and a fabric's own
//! `src/transport/*/sys.rs`, each operation in its own `unsafe` block. A text scan, so it needs no build of its own and fails on the
//! line that breaks the rule.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Top-down: each module may import only those after it. `sim` drives the reactor in
/// virtual time and nothing in the library imports it.
const LAYERS: &[&str] = &[
    "ffi",
    "plugin",
    "control",
    "sim",
    "reactor",
    "engine",
    "handoff",
    "transport",
    "conn",
    "telemetry",
    "routing",
    "config",
    "topology",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`None` for `lib.rs`).
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    match first.strip_suffix(".rs") {
        Some("lib") => None,
        Some(m) => Some(m.to_string()),
        None => Some(first),
    }
}

/// The code of a file without its `//` comments (doc links are not imports).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The top-level modules `code` names as `crate::m` or in `crate::{m, n::…}`.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.insert(ident_at(rest));
            continue;
        };
        // The first name of each item at the group's top level.
        let mut depth = 1;
        let mut item_start = true;
        for (j, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 1 => break,
                '}' => depth -= 1,
                ',' if depth == 1 => item_start = true,
                c if item_start && depth == 1 && (c.is_ascii_alphabetic() || c == '_') => {
                    found.insert(ident_at(&group[j..]));
                    item_start = false;
                }
                _ => {}
            }
        }
    }
    found.retain(|m| !m.is_empty());
    found
}

#[test]
fn the_scan_finds_paths_and_groups_and_skips_comments() {
    let text = "use crate::{a, b::{c, d}, e as f};\n\
                use crate::{\n    g::h,\n    i,\n};\n\
                // see crate::z\n\
                let x = crate::j::k(); // crate::y\n\
                macro_rules! m { () => { $crate::w } }\n";
    let got: Vec<_> = imports(&code(text)).into_iter().collect();
    assert_eq!(got, ["a", "b", "e", "g", "i", "j"]);
}

#[test]
fn modules_import_only_the_layers_below_them() {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let mut bad = Vec::new();
    let mut edges = 0;
    for path in &files {
        let rel = path.strip_prefix(&root).unwrap();
        let Some(module) = module_of(rel) else {
            continue;
        };
        let Some(mine) = rank(&module) else {
            bad.push(format!(
                "src/{} is in module `{module}`, which LAYERS does not place",
                rel.display()
            ));
            continue;
        };
        let text = fs::read_to_string(path).unwrap();
        for target in imports(&code(&text)) {
            if target == module {
                continue;
            }
            edges += 1;
            match rank(&target) {
                Some(theirs) if theirs > mine => {}
                Some(_) => bad.push(format!(
                    "src/{} (`{module}`) imports `{target}`, which is not below it",
                    rel.display()
                )),
                None => bad.push(format!(
                    "src/{} imports `crate::{target}`, which LAYERS does not place",
                    rel.display()
                )),
            }
        }
    }
    assert!(
        edges > 0,
        "the scan found no imports at all in {}",
        root.display()
    );
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn unsafe_is_allowed_only_in_ffi_and_fabric_sys_modules() {
    let root = src();
    let lib = fs::read_to_string(root.join("lib.rs")).unwrap();
    assert!(
        lib.contains("#![deny(unsafe_code, unsafe_op_in_unsafe_fn)]"),
        "src/lib.rs must deny unsafe_code and unsafe_op_in_unsafe_fn crate-wide"
    );
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut bad = Vec::new();
    for path in &files {
        let rel = path.strip_prefix(&root).unwrap();
        let parts: Vec<_> = rel.iter().map(|p| p.to_str().unwrap()).collect();
        let allowed = parts[0] == "ffi"
            || (parts.len() == 3 && parts[0] == "transport" && parts[2] == "sys.rs");
        let text = code(&fs::read_to_string(path).unwrap());
        if !allowed && text.contains("allow(unsafe_code)") {
            bad.push(format!("src/{} allows unsafe_code", rel.display()));
        }
        if text.contains("allow(unsafe_op_in_unsafe_fn)") {
            bad.push(format!(
                "src/{} allows unsafe_op_in_unsafe_fn",
                rel.display()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "unsafe outside ffi and transport/*/sys.rs: {bad:?}"
    );
}
