//! The fuzz targets of `fuzz/` as bounded property tests, so every `cargo test` builds
//! them and runs each on its seeds (in code and in `fuzz/seeds/`) and on a few thousand
//! inputs mutated from them by a fixed-seed generator. `scripts/fuzz.sh` runs the same
//! functions coverage-guided under libFuzzer.

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::panic::{self, AssertUnwindSafe};
use std::path::Path;

/// Generated inputs per target: a few seconds for all targets in a debug build.
const CASES: usize = 3000;

/// xorshift64*: deterministic, so a failure reproduces from the test name alone.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seed_files(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// One to eight edits of the kinds that break parsers: bit flips, boundary bytes,
/// insertions, deletions, truncation, splices of another seed.
fn mutate(base: &[u8], other: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + rng.below(8) {
        let at = rng.below(v.len() + 1);
        match rng.below(7) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] = [0, 1, 0x7f, 0x80, 0xff, b'<', b'"', b','][rng.below(8)];
            }
            2 => {
                let n = rng.below(16);
                let ins: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, ins);
            }
            3 => {
                let end = (at + rng.below(16)).min(v.len());
                v.drain(at..end);
            }
            4 => v.truncate(at),
            5 if !other.is_empty() => {
                let from = rng.below(other.len());
                let n = rng.below(other.len() - from + 1);
                v.splice(at..at, other[from..from + n].iter().copied());
            }
            _ => {
                if let Some(i) = v.len().checked_sub(1).map(|m| at.min(m)) {
                    v[i] = rng.next() as u8;
                }
            }
        }
    }
    v
}

fn run(name: &str) {
    let (_, target) = targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"));
    let mut bases = targets::seeds(name);
    bases.extend(seed_files(name));
    assert!(!bases.is_empty(), "{name} has no seeds");
    let check = |input: &[u8]| {
        if let Err(e) = panic::catch_unwind(AssertUnwindSafe(|| target(input))) {
            eprintln!("{name} failed on input (hex): {}", hex(input));
            panic::resume_unwind(e);
        }
    };
    for b in &bases {
        check(b);
    }
    let mut rng = Rng(name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }));
    for i in 0..CASES {
        let input = if i % 5 == 0 {
            (0..rng.below(600)).map(|_| rng.next() as u8).collect()
        } else {
            let base = &bases[rng.below(bases.len())];
            let other = &bases[rng.below(bases.len())];
            mutate(base, other, &mut rng)
        };
        check(&input);
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn fuzz_wire_header() {
    run("wire_header");
}

#[test]
fn fuzz_wire_body() {
    run("wire_body");
}

#[test]
fn fuzz_frame_reader() {
    run("frame_reader");
}

#[test]
fn fuzz_handshake() {
    run("handshake");
}

#[test]
fn fuzz_netlink() {
    run("netlink");
}

#[test]
fn fuzz_topology_xml() {
    run("topology_xml");
}

#[test]
fn fuzz_config() {
    run("config");
}

#[test]
fn every_target_has_a_test_and_seed_files() {
    let names: Vec<&str> = targets::TARGETS.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "wire_header",
            "wire_body",
            "frame_reader",
            "handshake",
            "netlink",
            "topology_xml",
            "config"
        ]
    );
    for n in names {
        assert!(!seed_files(n).is_empty(), "fuzz/seeds/{n} is empty");
    }
}

/// The stateful target runs in the harness's unit tests here (the harness is a feature
/// the plugin's tests build only for the library's own tests); its seed files are the
/// in-code ones.
#[test]
fn the_stateful_target_has_its_seed_files() {
    let name = "receiver_session";
    assert_eq!(seed_files(name), targets::seeds(name), "fuzz/seeds/{name}");
}

/// Writes the in-code seeds to `fuzz/seeds/` (run by hand after a format change:
/// `cargo test --test fuzz_targets -- --ignored write_seed_files`).
#[test]
#[ignore]
fn write_seed_files() {
    let stateful = ("receiver_session", targets::TARGETS[0].1);
    for (name, _) in targets::TARGETS.iter().chain([&stateful]) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/seeds")
            .join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in targets::seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), s).unwrap();
        }
    }
}
