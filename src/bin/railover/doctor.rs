//! `railover doctor`: what this node looks like to railover, and what is misconfigured.
//!
//! The only place in the topology work that reads the environment:
//! * `RAILOVER_SYSFS_ROOT` (default `/sys`; `--sysfs-root` overrides): where to discover;
//! * `NCCL_TOPO_FILE` (`--topo-file` overrides): a topology XML to take distances from, as
//!   NCCL would; link states then still come from sysfs, matched by NIC name;
//! * `RAILOVER_RAILS`, `RAILOVER_RAIL_RULE` (`same`|`any`, default `same`),
//!   `RAILOVER_DISTANCE_LIMIT` (`PIX`|`PXB`|`PHB`|`SYS`, default `PHB`).
//!
//! Exit codes: 0 healthy; 1 when a NIC has no possible backup (or there is no NIC); 2 on a
//! bad argument, a bad setting or an unreadable topology.

use std::path::PathBuf;

use railover::topology::report::{DoctorReport, DoctorSettings};
use railover::topology::{PathType, RailRule, Topology};

const USAGE: &str = "usage: railover doctor [--json] [--sysfs-root DIR] [--topo-file XML]
  --json            print the report as JSON
  --sysfs-root DIR  sysfs to read (default: $RAILOVER_SYSFS_ROOT, else /sys)
  --topo-file XML   NCCL topology XML to take distances from (default: $NCCL_TOPO_FILE)
settings: RAILOVER_RAILS=NIC:RAIL,...  RAILOVER_RAIL_RULE=same|any  \
RAILOVER_DISTANCE_LIMIT=PIX|PXB|PHB|SYS";

/// Runs `railover doctor` with the arguments after `doctor`; returns the exit code.
pub fn run(args: &[String]) -> i32 {
    let env = |k: &str| std::env::var(k).ok();
    match report(args, &env) {
        Ok(Output::Help) => {
            emit(&format!("{USAGE}\n"));
            0
        }
        Ok(Output::Report { report, json }) => {
            if json {
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

enum Output {
    Help,
    Report {
        report: Box<DoctorReport>,
        json: bool,
    },
}

/// Everything but the printing: arguments and settings in, report out.
fn report(args: &[String], env: &dyn Fn(&str) -> Option<String>) -> Result<Output, String> {
    let mut json = false;
    let mut sysfs_root = env("RAILOVER_SYSFS_ROOT").filter(|s| !s.is_empty());
    let mut topo_file = env("NCCL_TOPO_FILE").filter(|s| !s.is_empty());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "-h" | "--help" => return Ok(Output::Help),
            "--sysfs-root" | "--topo-file" => {
                let v = it
                    .next()
                    .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))?
                    .clone();
                if a == "--sysfs-root" {
                    sysfs_root = Some(v);
                } else {
                    topo_file = Some(v);
                }
            }
            _ => return Err(format!("unknown argument {a:?}\n{USAGE}")),
        }
    }
    let settings = DoctorSettings {
        rail_rule: match env("RAILOVER_RAIL_RULE") {
            Some(v) => {
                RailRule::from_setting("RAILOVER_RAIL_RULE", &v).map_err(|e| e.to_string())?
            }
            None => RailRule::Same,
        },
        distance_limit: match env("RAILOVER_DISTANCE_LIMIT") {
            Some(v) => {
                PathType::from_setting("RAILOVER_DISTANCE_LIMIT", &v).map_err(|e| e.to_string())?
            }
            None => PathType::Phb,
        },
    };
    let root = PathBuf::from(sysfs_root.unwrap_or_else(|| "/sys".to_string()));
    let live = Topology::discover(&root).map_err(|e| e.to_string())?;
    let mut topo = match topo_file {
        Some(f) => {
            let text = std::fs::read_to_string(&f)
                .map_err(|e| format!("cannot read topology XML {f}: {e}"))?;
            let mut t = Topology::from_xml(&text, &f).map_err(|e| format!("{f}: {e}"))?;
            t.merge_live_state(&live);
            t
        }
        None => live,
    };
    topo.apply_rail_env(env("RAILOVER_RAILS").as_deref())
        .map_err(|e| e.to_string())?;
    Ok(Output::Report {
        report: Box::new(DoctorReport::build(&topo, settings)),
        json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use railover::topology::fixture::machines;

    fn run_with(root: &std::path::Path, vars: &[(&str, &str)]) -> Result<Output, String> {
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
        report(&[], &env)
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
        let Ok(Output::Report { report, .. }) = run_with(
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
}
