//! The `railover` command: see `railover help`.

mod bench;
mod demo;
mod doctor;
mod failover_demo;
mod fault_peer;
mod peer;
mod sim;

const USAGE: &str = "\
usage: railover <command> [options]

commands:
  demo     as root: two network namespaces joined by four shaped links; checksummed
           traffic through the plugin, a link taken down and brought back, per-NIC
           throughput live, failover and fail-back times, a summary table.
           Without root: the same stream on loopback, without the failover.
  bench    send/receive sweep (8 B .. 256 MiB) and 8-byte round trip through the
           plugin ABI, interleaved with raw TCP sockets in the same run; CPU, idle
           and memory costs (--help for more)
  doctor   NICs, rails, PCI distances and backup candidates of this node (--help for more)
  sim      predicted all-reduce slowdown after a NIC failure (--help for more)
  help     this text
";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let code = match args.get(1).map(String::as_str) {
        Some("demo") => demo::run(&args[2..]),
        Some("bench") => bench::run(&args[2..]),
        Some("doctor") => doctor::run(&args[2..]),
        Some("sim") => sim::run(&args[2..]),
        Some("fault-peer") => fault_peer::run(&args[2..]),
        Some(peer::PEER_COMMAND) => peer::serve(&args[2..]),
        Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            0
        }
        _ => {
            eprint!("{USAGE}");
            2
        }
    };
    std::process::exit(code);
}
