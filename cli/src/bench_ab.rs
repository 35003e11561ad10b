//! `railover bench --baseline-plugin PATH`: this build against another build's plugin
//! `.so`, in one run. Whole bench runs alternate, this build then the baseline (A, B, A,
//! B …), each with its own same-run raw-TCP figures, so drift of a shared machine lands on
//! both; every A/B figure is the median over rounds of A's value over the B run next to it.
//!
//! The baseline run is this same program with the driver pointed at the other `.so`
//! ([`driver::PLUGIN_ENV`]): bench code, peer and raw-TCP baseline are identical, only
//! the plugin differs.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};

use railover_testkit::driver;
use serde::Serialize;
use serde_json::Value;

use crate::bench::{Output, Summary};
use crate::size;

/// One build's figures at one size point, from one run.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    gbps: f64,
    vs_tcp: f64,
    cpu_vs_tcp: f64,
    busy_threads: f64,
}

/// One run's report, reduced to what the comparison reads.
#[derive(Debug, Clone, Default)]
struct Run {
    points: Vec<(u64, Sample)>,
    /// 8-byte round trip, quiet and with a core kept busy: (µs, ratio to raw TCP).
    rtt: [(f64, f64); 2],
}

impl Run {
    fn parse(json: &str) -> Result<Run, String> {
        let v: Value = serde_json::from_str(json).map_err(|e| format!("bench report: {e}"))?;
        let f = |v: &Value, path: &[&str]| -> Result<f64, String> {
            path.iter()
                .try_fold(v, |v, k| v.get(k))
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("bench report has no {}", path.join(".")))
        };
        let mut points = Vec::new();
        for p in v["points"].as_array().ok_or("bench report has no points")? {
            let size = p["size"].as_u64().ok_or("bench point has no size")?;
            points.push((
                size,
                Sample {
                    gbps: f(p, &["plugin", "algbw", "median"])?,
                    vs_tcp: f(p, &["ratio"])?,
                    cpu_vs_tcp: f(p, &["cpu_ratio"])?,
                    busy_threads: f(p, &["plugin", "busy_threads"])?,
                },
            ));
        }
        let rtt = |k: &str| -> Result<(f64, f64), String> {
            Ok((f(&v, &[k, "plugin_us", "median"])?, f(&v, &[k, "ratio"])?))
        };
        Ok(Run {
            points,
            rtt: [rtt("round_trip_8b")?, rtt("round_trip_8b_busy")?],
        })
    }
}

/// The comparison at one size point: medians over rounds.
#[derive(Debug, Clone, Serialize)]
pub struct AbPoint {
    pub size: u64,
    /// This build's throughput over the baseline's, run next to each other.
    pub a_over_b: Summary,
    pub a_vs_tcp: f64,
    pub b_vs_tcp: f64,
    pub a_cpu_vs_tcp: f64,
    pub b_cpu_vs_tcp: f64,
    pub a_busy_threads: f64,
    pub b_busy_threads: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AbRoundTrip {
    pub a_us: f64,
    pub b_us: f64,
    pub a_vs_tcp: f64,
    pub b_vs_tcp: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AbReport {
    pub baseline: String,
    pub rounds: usize,
    pub args: Vec<String>,
    pub points: Vec<AbPoint>,
    pub round_trip_8b: AbRoundTrip,
    pub round_trip_8b_busy: AbRoundTrip,
}

/// The bench's own arguments, less those that only this comparison reads and the output
/// format (the runs report in JSON).
pub fn child_args(raw: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut it = raw.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--baseline-plugin" || s == "--ab-rounds" {
            it.next();
        } else if s.starts_with("--baseline-plugin=")
            || s.starts_with("--ab-rounds=")
            || s == "--json"
            || s == "--markdown"
        {
        } else {
            out.push(a.clone());
        }
    }
    out
}

fn one_run(args: &[OsString], plugin: Option<&Path>) -> Result<Run, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.arg("bench").args(args).arg("--json");
    match plugin {
        Some(p) => cmd.env(driver::PLUGIN_ENV, p),
        None => cmd.env_remove(driver::PLUGIN_ENV),
    };
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start a bench run: {e}"))?;
    if !out.status.success() {
        return Err(format!("a bench run failed ({})", out.status));
    }
    Run::parse(&String::from_utf8_lossy(&out.stdout))
}

fn median(v: impl Iterator<Item = f64>) -> f64 {
    Summary::of(&v.collect::<Vec<_>>()).median
}

fn compare(baseline: &Path, args: &[OsString], runs: &[(Run, Run)]) -> Result<AbReport, String> {
    let sizes: Vec<u64> = runs[0].0.points.iter().map(|p| p.0).collect();
    for (a, b) in runs {
        let same = |r: &Run| r.points.iter().map(|p| p.0).eq(sizes.iter().copied());
        if !same(a) || !same(b) {
            return Err("the runs measured different size points".into());
        }
    }
    let points = (0..sizes.len())
        .map(|i| {
            let a = || runs.iter().map(move |r| r.0.points[i].1);
            let b = || runs.iter().map(move |r| r.1.points[i].1);
            AbPoint {
                size: sizes[i],
                a_over_b: Summary::of(
                    &runs
                        .iter()
                        .map(|r| r.0.points[i].1.gbps / r.1.points[i].1.gbps)
                        .collect::<Vec<_>>(),
                ),
                a_vs_tcp: median(a().map(|s| s.vs_tcp)),
                b_vs_tcp: median(b().map(|s| s.vs_tcp)),
                a_cpu_vs_tcp: median(a().map(|s| s.cpu_vs_tcp)),
                b_cpu_vs_tcp: median(b().map(|s| s.cpu_vs_tcp)),
                a_busy_threads: median(a().map(|s| s.busy_threads)),
                b_busy_threads: median(b().map(|s| s.busy_threads)),
            }
        })
        .collect();
    let rtt = |k: usize| AbRoundTrip {
        a_us: median(runs.iter().map(|r| r.0.rtt[k].0)),
        b_us: median(runs.iter().map(|r| r.1.rtt[k].0)),
        a_vs_tcp: median(runs.iter().map(|r| r.0.rtt[k].1)),
        b_vs_tcp: median(runs.iter().map(|r| r.1.rtt[k].1)),
    };
    Ok(AbReport {
        baseline: baseline.display().to_string(),
        rounds: runs.len(),
        args: args.iter().map(|a| a.to_string_lossy().into()).collect(),
        points,
        round_trip_8b: rtt(0),
        round_trip_8b_busy: rtt(1),
    })
}

/// Runs `rounds` A/B pairs of the bench with `raw` (the command line after `bench`) and
/// prints the comparison. Exit status as the bench's.
pub fn run(baseline: &Path, rounds: usize, raw: &[OsString], output: Output) -> i32 {
    if let Err(e) = std::fs::metadata(baseline) {
        eprintln!(
            "railover bench: --baseline-plugin {}: {e}",
            baseline.display()
        );
        return 2;
    }
    let args = child_args(raw);
    let mut runs = Vec::new();
    for round in 1..=rounds {
        eprintln!("railover bench: A/B round {round} of {rounds}: this build");
        let a = one_run(&args, None);
        eprintln!(
            "railover bench: A/B round {round} of {rounds}: baseline {}",
            baseline.display()
        );
        let b = one_run(&args, Some(baseline));
        match (a, b) {
            (Ok(a), Ok(b)) => runs.push((a, b)),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("railover bench: {e}");
                return 1;
            }
        }
    }
    match compare(baseline, &args, &runs) {
        Ok(r) => {
            let text = match output {
                Output::Json => serde_json::to_string_pretty(&r).expect("plain data") + "\n",
                Output::Markdown | Output::Text => text(&r),
            };
            print!("{text}");
            0
        }
        Err(e) => {
            eprintln!("railover bench: {e}");
            1
        }
    }
}

fn text(r: &AbReport) -> String {
    let mut s = format!(
        "# railover bench A/B: this build (A) against {} (B), {} interleaved rounds of `bench {}`\n",
        r.baseline,
        r.rounds,
        r.args.join(" ")
    );
    s += "# A/B: median over rounds of A's throughput over the B run next to it [min-max]; vs TCP and CPU: medians of each run's same-run ratio\n";
    s += &format!(
        "#{:>11} | {:>6} {:>13} | {:>6} {:>6} | {:>6} {:>6} | {:>4} {:>4}\n",
        "size", "A/B", "range", "A/tcp", "B/tcp", "A cpu", "B cpu", "A bz", "B bz"
    );
    for p in &r.points {
        s += &format!(
            "{:>12} | {:>6.2} {:>13} | {:>6.2} {:>6.2} | {:>6.2} {:>6.2} | {:>4} {:>4}\n",
            size::format(p.size),
            p.a_over_b.median,
            format!("[{:.2}-{:.2}]", p.a_over_b.min, p.a_over_b.max),
            p.a_vs_tcp,
            p.b_vs_tcp,
            p.a_cpu_vs_tcp,
            p.b_cpu_vs_tcp,
            p.a_busy_threads,
            p.b_busy_threads
        );
    }
    for (what, t) in [
        ("8 B round trip", &r.round_trip_8b),
        ("8 B round trip, one core kept busy", &r.round_trip_8b_busy),
    ] {
        s += &format!(
            "{what}: A {:.1} us ({:.2}x raw TCP), B {:.1} us ({:.2}x raw TCP)\n",
            t.a_us, t.a_vs_tcp, t.b_us, t.b_vs_tcp
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_json(sizes: &[(u64, f64)], rtt_us: f64) -> String {
        let points: Vec<Value> = sizes
            .iter()
            .map(|(s, g)| {
                serde_json::json!({
                    "size": s, "ratio": g / 2.0, "cpu_ratio": 1.5,
                    "plugin": {"algbw": {"median": g}, "busy_threads": 2}
                })
            })
            .collect();
        serde_json::json!({
            "points": points,
            "round_trip_8b": {"plugin_us": {"median": rtt_us}, "ratio": 1.1},
            "round_trip_8b_busy": {"plugin_us": {"median": rtt_us * 3.0}, "ratio": 2.0},
        })
        .to_string()
    }

    #[test]
    fn the_comparison_pairs_each_a_run_with_the_b_run_next_to_it() {
        // Round 2 ran on a slower machine: both builds slowed, A/B still reads 2.
        let runs: Vec<(Run, Run)> = [(4.0, 2.0), (1.0, 0.5), (6.0, 3.0)]
            .iter()
            .map(|(a, b)| {
                (
                    Run::parse(&run_json(&[(8, *a), (1024, *a)], 10.0)).unwrap(),
                    Run::parse(&run_json(&[(8, *b), (1024, *b)], 20.0)).unwrap(),
                )
            })
            .collect();
        let r = compare(Path::new("b.so"), &[], &runs).unwrap();
        assert_eq!(r.points.len(), 2);
        assert_eq!(r.points[0].a_over_b.median, 2.0);
        assert_eq!(r.points[0].a_over_b.min, 2.0);
        assert_eq!(r.points[1].a_vs_tcp, 2.0);
        assert_eq!(r.points[1].b_vs_tcp, 1.0);
        assert_eq!(r.round_trip_8b.a_us, 10.0);
        assert_eq!(r.round_trip_8b_busy.b_us, 60.0);
        assert!(text(&r).contains("A 10.0 us"), "{}", text(&r));
    }

    #[test]
    fn runs_over_other_sizes_are_refused_and_a_bad_report_named() {
        let a = Run::parse(&run_json(&[(8, 1.0)], 1.0)).unwrap();
        let b = Run::parse(&run_json(&[(16, 1.0)], 1.0)).unwrap();
        assert!(compare(Path::new("b.so"), &[], &[(a, b)]).is_err());
        let e = Run::parse(r#"{"points": []}"#).unwrap_err();
        assert!(e.contains("round_trip_8b"), "{e}");
    }

    #[test]
    fn the_runs_get_the_bench_arguments_less_the_comparisons_own() {
        let raw: Vec<OsString> = [
            "--quick",
            "--baseline-plugin",
            "/x.so",
            "--ab-rounds=3",
            "--markdown",
            "--comms",
            "8",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert_eq!(child_args(&raw), ["--quick", "--comms", "8"]);
    }
}
