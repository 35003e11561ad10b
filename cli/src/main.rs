//! The `railover` command: see `railover --help`.
//!
//! Exit codes: 2 for a usage error (clap's, or a value a subcommand refuses after parsing);
//! otherwise each subcommand's own, as its help says.

use clap::{Parser, Subcommand};

mod bench;
mod bench_ab;
mod control;
mod demo;
mod doctor;
mod failover_bench;
mod failover_demo;
mod fault_peer;
mod peer;
mod plot;
mod sim;
mod size;
mod verbs_check;
mod weighted;

/// Tools around the railover NCCL network plugin: a live failover demo, a benchmark
/// against raw TCP, a node check, a failure-cost model, and draining NICs in and asking
/// the state of the railover processes running on this node.
#[derive(Debug, Parser)]
#[command(name = "railover", version, arg_required_else_help = true)]
// As the hand-written parsers did: a repeated option takes its last value.
#[command(args_override_self = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Live failover under checksummed traffic: per-NIC throughput, failover and
    /// fail-back times, a summary table, what the slowest comm and the aggregate kept
    ///
    /// As root: two network namespaces joined by four shaped links; traffic through the
    /// plugin, one link taken down and brought back. Without root: the same stream on
    /// loopback, with the cut injected inside the sending plugin.
    Demo(demo::Args),
    /// Send/receive sweep and 8-byte round trip through the plugin ABI against raw TCP,
    /// interleaved in one run; CPU, idle and memory costs
    Bench(bench::Args),
    /// NICs, rails, PCI distances and backup candidates of this node, and what is
    /// misconfigured
    Doctor(doctor::Args),
    /// Predicted all-reduce slowdown after one NIC failure (a cost model, no traffic)
    Sim(sim::Args),
    /// Drain a NIC in the railover processes on this node: their traffic leaves it for
    /// the other NICs until it is undrained
    Drain(control::DrainArgs),
    /// Undrain a NIC drained with `railover drain`: the processes may use it again
    Undrain(control::DrainArgs),
    /// The live state of the railover processes on this node: NICs, comms, failovers,
    /// fail-backs, degraded comms
    Status(control::StatusArgs),
    /// One endpoint of the fault-injection tier (test machinery)
    #[command(hide = true)]
    FaultPeer(fault_peer::Args),
    /// Verbs NICs found, and RC QP traffic over each rail between two hosts (test
    /// machinery of the Soft-RoCE tier)
    #[command(hide = true)]
    VerbsCheck(verbs_check::Args),
    /// The bench's child endpoint, driven over stdin (internal)
    #[command(name = peer::PEER_COMMAND, hide = true)]
    Peer,
}

fn main() {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Bench(_) | Command::Peer) {
        // A baseline run of `bench --baseline-plugin`, or its peer: another build's plugin.
        match railover_testkit::driver::use_plugin_from_env() {
            Ok(Some(p)) => eprintln!("railover: driving the plugin {}", p.display()),
            Ok(None) => {}
            Err(e) => {
                eprintln!("railover: {e}");
                std::process::exit(1);
            }
        }
    }
    let code = match cli.command {
        Command::Demo(a) => demo::run(&a),
        // No global options, so the subcommand is always the first argument.
        Command::Bench(a) => bench::run(a, std::env::args_os().skip(2).collect()),
        Command::Doctor(a) => doctor::run(&a),
        Command::Sim(a) => sim::run(&a),
        Command::Drain(a) => control::drain(&a, true),
        Command::Undrain(a) => control::drain(&a, false),
        Command::Status(a) => control::status(&a),
        Command::FaultPeer(a) => fault_peer::run(&a),
        Command::VerbsCheck(a) => verbs_check::run(&a),
        Command::Peer => peer::serve(),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_lists_user_commands_and_hides_test_machinery() {
        let help = Cli::command().render_help().to_string();
        for c in [
            "demo", "bench", "doctor", "sim", "drain", "undrain", "status",
        ] {
            assert!(help.contains(c), "{c} missing from:\n{help}");
        }
        assert!(!help.contains("fault-peer"), "{help}");
        assert!(!help.contains(peer::PEER_COMMAND), "{help}");
        // Hidden, not gone.
        assert!(Cli::try_parse_from(["railover", "fault-peer", "recv"]).is_ok());
        assert!(Cli::try_parse_from(["railover", peer::PEER_COMMAND]).is_ok());
    }

    #[test]
    fn usage_errors_exit_2() {
        for argv in [
            &["railover"][..],
            &["railover", "frobnicate"],
            &["railover", "sim", "--bogus"],
            &["railover", "bench", "--comms"],
            &["railover", "drain"],
            &["railover", "drain", "eth0 eth1"],
            &["railover", "status", "--count", "2"],
            &["railover", "status", "--watch", "0"],
        ] {
            let e = Cli::try_parse_from(argv).expect_err(&argv.join(" "));
            assert_eq!(e.exit_code(), 2, "{argv:?}: {e}");
        }
        let e = Cli::try_parse_from(["railover", "--version"]).unwrap_err();
        assert_eq!(e.exit_code(), 0);
    }
}
