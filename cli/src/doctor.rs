//! `railover doctor`: what this node looks like to railover, and what is misconfigured.
//! For each NIC it also shows the spread railover would use if that NIC failed: the
//! survivors its comms would be striped over and the share of bandwidth a collective keeps
//! (`report::Spread`).
//!
//! The only place in the topology work that reads the environment:
//! * `RAILOVER_SYSFS_ROOT` (default `/sys`; `--sysfs-root` overrides): where to discover;
//! * `NCCL_TOPO_FILE` (`--topo-file` overrides): a topology XML to take distances from, as
//!   NCCL would; link states then still come from sysfs, matched by NIC name;
//! * `RAILOVER_RAILS`, `RAILOVER_RAIL_RULE` (`same`|`any`, default `same`),
//!   `RAILOVER_DISTANCE_LIMIT` (`PIX`|`PXB`|`PHB`|`SYS`, default `PHB`); all three go
//!   through [`Config`] as in the plugin, so every `RAILOVER_*` value is checked once.
//!
//! Exit codes: 0 healthy; 1 when a NIC has no possible backup (or there is no NIC); 2 on a
//! bad argument, a bad setting or an unreadable topology.

use std::path::PathBuf;

use railover::config::Config;
use railover::topology::report::{DoctorReport, DoctorSettings};
use railover::topology::{RailSource, Topology};

#[derive(Debug, Clone, Default, clap::Args)]
#[command(
    after_help = "Settings read from the environment: RAILOVER_RAILS=NIC:RAIL,...  \
RAILOVER_RAIL_RULE=same|any  RAILOVER_DISTANCE_LIMIT=PIX|PXB|PHB|SYS\n\
Exit status: 0 healthy; 1 when a NIC has no possible backup (or there is no NIC); 2 on a \
bad argument, a bad setting or an unreadable topology."
)]
pub struct Args {
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
    /// sysfs to read [default: $RAILOVER_SYSFS_ROOT, else /sys]
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,
    /// NCCL topology XML to take distances from [default: $NCCL_TOPO_FILE]
    #[arg(long, value_name = "XML")]
    pub topo_file: Option<PathBuf>,
}

/// Runs `railover doctor`; returns the exit code.
pub fn run(args: &Args) -> i32 {
    let env = |k: &str| std::env::var(k).ok();
    match report(args, &env) {
        Ok(report) => {
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(s) => emit(&format!("{s}\n")),
                    Err(e) => {
                        eprintln!("railover doctor: cannot encode JSON: {e}");
                        return 2;
                    }
                }
            } else {
                emit(&report.render_text());
            }
            report.exit_code()
        }
        Err(e) => {
            eprintln!("railover doctor: {e}");
            2
        }
    }
}

/// Writes to stdout; a closed pipe (`railover doctor | head`) is not an error worth a panic.
fn emit(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// Everything but the printing: arguments and settings in, report out.
fn report(args: &Args, env: &dyn Fn(&str) -> Option<String>) -> Result<Box<DoctorReport>, String> {
    let from_env = |k: &str| env(k).filter(|s| !s.is_empty()).map(PathBuf::from);
    let sysfs_root = args
        .sysfs_root
        .clone()
        .or_else(|| from_env("RAILOVER_SYSFS_ROOT"));
    let topo_file = args
        .topo_file
        .clone()
        .or_else(|| from_env("NCCL_TOPO_FILE"));
    // The plugin's own parser, so the doctor applies the settings the router would.
    let config = Config::from_lookup(env).map_err(|e| e.to_string())?;
    let settings = DoctorSettings {
        rail_rule: config.router.rail_rule,
        distance_limit: config.router.distance_limit,
    };
    let root = sysfs_root.unwrap_or_else(|| PathBuf::from("/sys"));
    let live = Topology::discover(&root).map_err(|e| e.to_string())?;
    let mut topo = match topo_file {
        Some(path) => {
            let f = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read topology XML {f}: {e}"))?;
            let mut t = Topology::from_xml(&text, &f).map_err(|e| format!("{f}: {e}"))?;
            t.merge_live_state(&live);
            t
        }
        None => live,
    };
    // `Config` parsed `RAILOVER_RAILS` already (and checked it); a blank value is `None`.
    if let Some(map) = &config.rails {
        topo.apply_rails(map, RailSource::Env)
            .map_err(|e| e.to_string())?;
    }
    Ok(Box::new(DoctorReport::build(&topo, settings)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use railover::topology::{PathType, RailRule};
    use railover_testkit::fixture::machines;

    fn run_with(
        root: &std::path::Path,
        vars: &[(&str, &str)],
    ) -> Result<Box<DoctorReport>, String> {
        let root = root.to_string_lossy().to_string();
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = move |k: &str| {
            if k == "RAILOVER_SYSFS_ROOT" {
                return Some(root.clone());
            }
            vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        report(&Args::default(), &env)
    }

    #[test]
    fn bad_settings_name_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let Err(e) = run_with(dir.path(), &[("RAILOVER_DISTANCE_LIMIT", "far")]) else {
            panic!("accepted a bad limit")
        };
        assert!(
            e.contains("RAILOVER_DISTANCE_LIMIT") && e.contains("\"far\""),
            "{e}"
        );
        let Err(e) = run_with(dir.path(), &[("RAILOVER_RAIL_RULE", "rail")]) else {
            panic!("accepted a bad rule")
        };
        assert!(
            e.contains("RAILOVER_RAIL_RULE") && e.contains("same"),
            "{e}"
        );
    }

    #[test]
    fn settings_reach_the_report() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let Ok(report) = run_with(
            dir.path(),
            &[
                ("RAILOVER_DISTANCE_LIMIT", "sys"),
                ("RAILOVER_RAIL_RULE", "any"),
            ],
        ) else {
            panic!("no report")
        };
        assert_eq!(report.settings.distance_limit, PathType::Sys);
        assert_eq!(report.settings.rail_rule, RailRule::Any);
        assert!(report.healthy);
    }

    #[test]
    fn the_rail_map_is_the_one_config_parsed() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let report = |rails: &str| run_with(dir.path(), &[("RAILOVER_RAILS", rails)]);
        let r = report("mlx5_0:1,mlx5_1:0").unwrap();
        assert_eq!(r.rail_source, RailSource::Env);
        let rails: Vec<_> = r.nics.iter().map(|n| (n.name.as_str(), n.rail)).collect();
        assert_eq!(rails, [("mlx5_0", Some(1)), ("mlx5_1", Some(0))]);
        // Blank is unset, as in the plugin.
        assert_eq!(report(" ").unwrap().rail_source, RailSource::Automatic);
        let e = report("mlx5_0").unwrap_err();
        assert!(
            e.contains("RAILOVER_RAILS") && e.contains("NIC:RAIL"),
            "{e}"
        );
    }
}
