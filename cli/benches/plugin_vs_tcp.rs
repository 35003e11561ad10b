//! `cargo bench`: runs `railover bench` (the send/receive sweep against raw TCP in the
//! same run); `cargo bench --bench plugin_vs_tcp -- --quick` for the short one.

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_railover"));
    cmd.arg("bench");
    if quick {
        cmd.arg("--quick");
    }
    let status = cmd.status().expect("run railover bench");
    std::process::exit(status.code().unwrap_or(1));
}
