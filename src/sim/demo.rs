//! `railover demo`: a live failover. As root on a namespace testbed; otherwise on
//! loopback with the cut injected inside the plugin (see `failover_demo`).

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// How long the traffic runs, in seconds, up to 3600 (at least 12 are used: the cut
    /// and the heal need them)
    #[arg(long, value_name = "N", default_value = "15", value_parser = seconds, allow_negative_numbers = true)]
    pub seconds: f64,
    /// Comms streaming at once, spread over the four NICs in turn and held in lockstep
    /// (no comm more than 8 messages past the slowest), 1 … 256
    #[arg(long, value_name = "N", default_value_t = DEFAULT_COMMS, value_parser = crate::bench::int_in(1, MAX_COMMS))]
    pub comms: usize,
}

/// Four per NIC: the cut NIC's four comms do not divide over the three survivors, so
/// moving each whole would leave the slowest comm 4/6 of its rate; spread, (N−1)/N.
pub const DEFAULT_COMMS: usize = 16;
pub const MAX_COMMS: usize = 256;

fn seconds(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 3600.0 => Ok(s),
        _ => Err("expected a number of seconds in (0, 3600]".into()),
    }
}

pub fn run(a: &Args) -> i32 {
    use crate::failover_demo::Mode;
    let seconds = a.seconds.max(12.0);
    match railover_testkit::testbed::unavailable() {
        None => crate::failover_demo::run(seconds, a.comms, Mode::Namespaces),
        Some(why) => {
            println!("railover demo: LOOPBACK VARIANT with in-process fault injection ({why})");
            crate::failover_demo::run(seconds, a.comms, Mode::Loopback)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Cli, Command};
    use clap::Parser;

    fn args(argv: &[&str]) -> Result<super::Args, clap::Error> {
        let argv = ["railover", "demo"].iter().chain(argv);
        match Cli::try_parse_from(argv)?.command {
            Command::Demo(a) => Ok(a),
            c => panic!("parsed as {c:?}"),
        }
    }

    fn seconds(argv: &[&str]) -> Result<f64, clap::Error> {
        args(argv).map(|a| a.seconds)
    }

    #[test]
    fn seconds_default_and_bounds() {
        assert_eq!(seconds(&[]).unwrap(), 15.0);
        assert_eq!(seconds(&["--seconds", "30"]).unwrap(), 30.0);
        for bad in ["0", "-1", "3601", "nan", "soon"] {
            let e = seconds(&["--seconds", bad]).unwrap_err().to_string();
            assert!(e.contains("--seconds") && e.contains("(0, 3600]"), "{e}");
        }
    }

    #[test]
    fn comms_default_to_four_per_nic_and_are_bounded() {
        assert_eq!(args(&[]).unwrap().comms, 16);
        assert_eq!(args(&["--comms", "1"]).unwrap().comms, 1);
        assert_eq!(args(&["--comms", "256"]).unwrap().comms, 256);
        for bad in ["0", "257", "many"] {
            let e = args(&["--comms", bad]).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            let e = e.to_string();
            assert!(
                e.contains("--comms") && e.contains(bad) && e.contains("1 … 256"),
                "{e}"
            );
        }
    }
}
