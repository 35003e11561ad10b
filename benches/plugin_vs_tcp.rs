//! `cargo bench`: runs `railover bench`, which measures throughput (4 KiB … 64 MiB) and
//! the 8-byte round trip through the plugin ABI against plain TCP in the same run.

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
