//! The `railover` command: `doctor` (what this node looks like to railover) and `sim` (what a
//! NIC failure costs an all-reduce).

mod doctor;
mod sim;

const USAGE: &str = "usage: railover <command> [options]
commands:
  doctor   NICs, rails, PCI distances and backup candidates of this node (--help for more)
  sim      predicted all-reduce slowdown after a NIC failure (--help for more)";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let code = match args.get(1).map(String::as_str) {
        Some("doctor") => doctor::run(&args[2..]),
        Some("sim") => sim::run(&args[2..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            0
        }
        _ => {
            eprintln!("{USAGE}");
            2
        }
    };
    std::process::exit(code);
}
