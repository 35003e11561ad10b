//! `railover bench` as users and CI drive it: the JSON report's shape and arithmetic, and
//! clear errors for bad options. A narrow, short sweep on loopback.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_railover"))
        .arg("bench")
        .args(args)
        .env_remove("RAILOVER_IFNAME")
        .output()
        .expect("run railover bench")
}

#[test]
fn json_has_one_row_per_size_with_medians_spread_and_ratio() {
    let out = bench(&[
        "--quick",
        "--min-bytes",
        "8",
        "--max-bytes",
        "4K",
        "--idle-seconds",
        "0.5",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}):\n{stderr}"));
    let points = v["points"].as_array().expect("points");
    let sizes: Vec<u64> = points.iter().map(|p| p["size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, vec![8, 64, 512, 4096]);
    for p in points {
        for side in ["plugin", "tcp"] {
            let s = &p[side]["algbw"];
            let (min, q1, med, q3, max) = (
                s["min"].as_f64().unwrap(),
                s["q1"].as_f64().unwrap(),
                s["median"].as_f64().unwrap(),
                s["q3"].as_f64().unwrap(),
                s["max"].as_f64().unwrap(),
            );
            assert!(
                min > 0.0 && min <= q1 && q1 <= med && med <= q3 && q3 <= max,
                "{p}"
            );
            assert_eq!(p[side]["busbw"], s["median"], "sendrecv: busbw = algbw");
            assert!(p[side]["cpu_s_per_gb"].as_f64().unwrap() > 0.0, "{p}");
        }
        let ratio = p["plugin"]["algbw"]["median"].as_f64().unwrap()
            / p["tcp"]["algbw"]["median"].as_f64().unwrap();
        assert!((p["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{p}");
    }
    assert_eq!(v["reps"], 5);
    let rt = &v["round_trip_8b"];
    assert!(rt["plugin_us"]["median"].as_f64().unwrap() > 0.0);
    assert!(rt["tcp_us"]["median"].as_f64().unwrap() > 0.0);
    assert!(v["idle"]["cpu_pct"].as_array().unwrap().len() == 2);
    assert!(
        v["memory"]["per_comm_kib"].as_f64().unwrap() > 0.0,
        "{}",
        v["memory"]
    );
    let targets = v["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 3);
    // No point at or above 1 MiB in this sweep: the throughput target says so.
    assert!(targets[0]["met"].is_null(), "{}", targets[0]);
}

#[test]
fn bad_options_are_named_with_what_is_accepted() {
    let out = bench(&["--depth", "0"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("--depth") && e.contains("'0'") && e.contains("1 … 32"),
        "{e}"
    );
    let out = bench(&["--max-bytes", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("K, M, G"));
}
