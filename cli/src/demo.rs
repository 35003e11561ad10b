//! `railover demo`: a live failover. As root on a namespace testbed; otherwise on
//! loopback with the cut injected inside the plugin (see `failover_demo`).

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// How long the traffic runs, in seconds, up to 3600 (at least 12 are used: the cut
    /// and the heal need them)
    #[arg(long, value_name = "N", default_value = "15", value_parser = seconds, allow_negative_numbers = true)]
    pub seconds: f64,
}

fn seconds(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 3600.0 => Ok(s),
        _ => Err("expected a number of seconds in (0, 3600]".into()),
    }
}

pub fn run(a: &Args) -> i32 {
    let seconds = a.seconds;
    match railover_testkit::testbed::unavailable() {
        None => {
            crate::failover_demo::run(seconds.max(12.0), crate::failover_demo::Mode::Namespaces)
        }
        Some(why) => {
            println!("railover demo: LOOPBACK VARIANT with in-process fault injection ({why})");
            crate::failover_demo::run(seconds.max(12.0), crate::failover_demo::Mode::Loopback)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Cli, Command};
    use clap::Parser;

    fn seconds(argv: &[&str]) -> Result<f64, clap::Error> {
        let argv = ["railover", "demo"].iter().chain(argv);
        match Cli::try_parse_from(argv)?.command {
            Command::Demo(a) => Ok(a.seconds),
            c => panic!("parsed as {c:?}"),
        }
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
}
