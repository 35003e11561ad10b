//! The `railover` command line as a user meets it: help, version, usage errors, and the
//! test machinery kept out of sight but still callable.

use std::process::{Command, Output};

fn railover(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_railover"))
        .args(args)
        .output()
        .expect("run railover")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_lists_the_user_commands_and_not_the_test_machinery() {
    let o = railover(&["--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let help = stdout(&o);
    for c in ["demo", "bench", "doctor", "sim"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(c)),
            "{c} not listed:\n{help}"
        );
    }
    assert!(!help.contains("fault-peer"), "{help}");
    assert!(!help.contains("__peer"), "{help}");
    // `help` as a command says the same.
    assert_eq!(stdout(&railover(&["help"])), help);
}

#[test]
fn every_user_command_has_help_with_its_options() {
    for (cmd, opts) in [
        ("demo", &["--seconds", "--comms"][..]),
        ("bench", &["--min-bytes", "--quick", "--json", "--markdown"]),
        ("doctor", &["--json", "--sysfs-root", "--topo-file"]),
        ("sim", &["--nics", "--size", "--json"]),
    ] {
        let o = railover(&[cmd, "--help"]);
        assert_eq!(o.status.code(), Some(0), "{cmd}: {}", stderr(&o));
        let help = stdout(&o);
        for opt in opts {
            assert!(help.contains(opt), "{cmd} --help lacks {opt}:\n{help}");
        }
    }
}

#[test]
fn version_is_the_crate_version() {
    let o = railover(&["--version"]);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        stdout(&o).trim(),
        format!("railover {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn usage_errors_exit_2_and_name_the_problem() {
    let o = railover(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("frobnicate"), "{}", stderr(&o));
    let o = railover(&["sim", "--size", "1X"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("--size") && e.contains("'1X'") && e.contains("KB"),
        "{e}"
    );
    let o = railover(&["demo", "--seconds", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--seconds"), "{}", stderr(&o));
}

#[test]
fn hidden_commands_are_still_callable() {
    let o = railover(&["fault-peer", "--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for opt in [
        "--per-dev",
        "--devs",
        "--size",
        "--tick-ms",
        "--bind",
        "--to",
    ] {
        assert!(stdout(&o).contains(opt), "{opt} missing");
    }
    let o = railover(&["fault-peer", "recv", "--size", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--size"), "{}", stderr(&o));
}

#[test]
fn sim_json_is_the_table() {
    let o = railover(&[
        "sim", "--nics", "8", "--nodes", "4", "--size", "1G", "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON document");
    assert_eq!(v["bytes"], 1073741824.0);
    let states = v["states"].as_array().unwrap();
    let names: Vec<&str> = states
        .iter()
        .map(|s| s["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["healthy", "NCCL native failover", "railover spread"]
    );
    assert_eq!(states[0]["slowdown"], 1.0);
    // The spread's busiest NIC carries 1/7 of the node's traffic.
    let share = states[2]["busiest_nic_share"].as_f64().unwrap();
    assert!((share - 1.0 / 7.0).abs() < 1e-12, "{share}");
}
