//! Observability (P9) against real tools: the `/metrics` endpoint over real TCP on
//! 127.0.0.1, `promtool` on the alert rules and on the rendered exposition text, the
//! Grafana dashboard and the docs against the one metric table, and a real Prometheus
//! server scraping the endpoint.
//!
//! promtool and prometheus come from Debian's `prometheus` package:
//! `scripts/install-prometheus.sh` installs it when run as root (as CI runs). Without it
//! and without root, those tests print "SKIP: <why>" and return.
//!
//! All tests of this binary share one process-wide recorder, so each uses its own NIC
//! names and checks only its own series (or lower bounds on shared ones).

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railover::config::ConfigError;
use railover::routing::FailReason;
use railover::telemetry::exporter::ExporterConfig;
use railover::telemetry::metrics::{
    self, Failback, Failover, GiveUp, NicPair, NicSample, Telemetry, METRICS,
};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn exporter_cfg(pairs: &[(&str, &str)]) -> Result<ExporterConfig, ConfigError> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ExporterConfig::from_lookup(|k| map.get(k).cloned())
}

/// An endpoint on 127.0.0.1 at a port the kernel picks.
fn loopback_any_port() -> ExporterConfig {
    exporter_cfg(&[
        ("RAILOVER_METRICS_PORT", "0"),
        ("RAILOVER_METRICS_ADDR", "127.0.0.1"),
    ])
    .unwrap()
}

/// A one-shot HTTP/1.1 GET; returns the status code and body.
fn http_get(addr: SocketAddr, target: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {text:?}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    Ok((status, body.to_owned()))
}

/// Records a value for every metric in [`METRICS`], on NIC names starting with `nic`.
fn record_all(t: &Telemetry, nic: &str) {
    let other = format!("{nic}b");
    for (name, up, lanes) in [(nic, false, 0), (other.as_str(), true, 4)] {
        t.record_nic(&NicSample {
            nic: name,
            rail: Some(1),
            up,
            lanes,
            paced_lanes: lanes / 2,
            tx_bytes: 1 << 20,
            rx_bytes: 1 << 19,
            tx_messages: 16,
            rx_messages: 8,
            placed_bytes: 3 << 18,
            down_seconds: u64::from(!up) * 90,
            drained: !up,
            capacity: up.then_some(25_000_000),
        });
    }
    t.record_drain_move(nic);
    t.record_rebalance_move(nic);
    let from = NicPair {
        local: nic,
        remote: "peer/eth0",
    };
    let to = NicPair {
        local: &other,
        remote: "peer/eth1",
    };
    for (i, reason) in FailReason::ALL.into_iter().enumerate() {
        t.record_failover(&Failover {
            comm: i as u64,
            from,
            to,
            reason,
            detection: Duration::from_millis(1000 + i as u64),
            resume: Duration::from_millis(5 * (i as u64 + 1)),
        });
    }
    t.record_failback(&Failback {
        comm: 0,
        from: to,
        to: from,
        away: Duration::from_secs(3),
    });
    t.record_give_up(&GiveUp {
        comm: 9,
        failed: from,
        reason: FailReason::LinkDown,
        candidates: 2,
    });
    // 7 only: the Prometheus test checks the buckets up to 4 for its own observation.
    t.record_comm_spread(7);
    t.record_probe_failures(nic, 3);
    t.record_replayed(4096);
    t.record_duplicates(2);
    t.set_comms_without_backup(1);
    t.record_reactor_busy(0.25);
    t.record_rejected(1);
    t.record_protocol_errors(1);
    t.record_lane_failures(2);
    t.record_unmatched_sends(1);
    t.record_memory_exclusion(nic);
    t.record_comms_given_up(1);
    t.record_link_events(2);
    t.set_memory_registrations(5);
    t.record_comm_displaced(12);
    t.set_comms_displaced(2);
    t.set_degraded(true);
}

/// The sample value of the series whose name-and-labels text is exactly `series`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn endpoint_serves_recorded_series_over_tcp() {
    let t = Telemetry::start(&loopback_any_port(), None);
    let addr = t.local_addr().expect("endpoint on 127.0.0.1");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    record_all(&t, "fetch0");

    let (status, body) = http_get(addr, "/metrics").unwrap();
    assert_eq!(status, 200, "{body}");
    for (series, want) in [
        (
            r#"railover_bytes_total{nic="fetch0",direction="tx"}"#,
            1048576.0,
        ),
        (
            r#"railover_bytes_total{nic="fetch0",direction="rx"}"#,
            524288.0,
        ),
        (
            r#"railover_messages_total{nic="fetch0b",direction="tx"}"#,
            16.0,
        ),
        (r#"railover_lanes{nic="fetch0b"}"#, 4.0),
        (r#"railover_nic_up{nic="fetch0"}"#, 0.0),
        (r#"railover_nic_up{nic="fetch0b"}"#, 1.0),
        (r#"railover_nic_info{nic="fetch0",rail="1"}"#, 1.0),
        (
            r#"railover_failovers_total{nic="fetch0",reason="timeout"}"#,
            1.0,
        ),
        (
            r#"railover_failovers_total{nic="fetch0",reason="probe"}"#,
            1.0,
        ),
        (r#"railover_failbacks_total{nic="fetch0"}"#, 1.0),
        (r#"railover_nic_drained{nic="fetch0"}"#, 1.0),
        (r#"railover_nic_drained{nic="fetch0b"}"#, 0.0),
        (r#"railover_drain_moves_total{nic="fetch0"}"#, 1.0),
        (r#"railover_rebalance_moves_total{nic="fetch0"}"#, 1.0),
        (r#"railover_probe_failures_total{nic="fetch0"}"#, 3.0),
        (r#"railover_placed_bytes_total{nic="fetch0b"}"#, 786432.0),
        (r#"railover_memory_exclusions_total{nic="fetch0"}"#, 1.0),
    ] {
        assert_eq!(value(&body, series), Some(want), "{series} in\n{body}");
    }
    // Unlabelled counters are shared with the other tests of this binary: lower bounds.
    for (series, least) in [
        ("railover_unmatched_sends_total", 1.0),
        ("railover_comms_given_up_total", 1.0),
        ("railover_link_events_total", 2.0),
        ("railover_memory_registrations_total", 5.0),
    ] {
        let got = value(&body, series).unwrap_or_else(|| panic!("no {series} in\n{body}"));
        assert!(got >= least, "{series} {got} in\n{body}");
    }
    // Every metric says what it means, in the words of the table.
    for m in METRICS {
        let help = format!("# HELP {} {}\n", m.name, m.help);
        assert!(body.contains(&help), "no {help:?} in\n{body}");
    }
    let count = value(&body, "railover_failover_seconds_count").unwrap();
    assert!(count >= 4.0, "{body}");
    assert!(
        body.contains("# HELP railover_bytes_total Payload bytes"),
        "{body}"
    );

    // Counters accumulate deltas between scrapes.
    t.record_nic(&NicSample {
        nic: "fetch0",
        tx_bytes: 100,
        ..Default::default()
    });
    let (_, body) = http_get(addr, "/metrics?x=1").unwrap();
    assert_eq!(
        value(
            &body,
            r#"railover_bytes_total{nic="fetch0",direction="tx"}"#
        ),
        Some(1048676.0)
    );
    assert_eq!(http_get(addr, "/nope").unwrap().0, 404);

    // Joins the server thread (which owns, and so closes, the listener). Whether the port
    // is closed is not asserted: a parallel test may be handed the same port at once.
    t.shutdown();
    // Recording and rendering keep working without the endpoint.
    t.record_replayed(1);
    assert!(t.render().contains("railover_replayed_bytes_total"));
}

/// Reads until the server closes the connection (or `limit` passes); whether it did.
fn closed_by_server(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// 1,000 clients that connect and say nothing do not hold up a scrape: the endpoint
/// serves connections concurrently, keeps a bounded number open (closing the longest idle
/// to admit new ones) and closes idle ones after its deadline.
#[test]
fn a_thousand_idle_connections_do_not_delay_a_scrape() {
    use railover::telemetry::exporter::{CONNECTION_DEADLINE, MAX_CONNECTIONS};
    let t = Telemetry::start(&loopback_any_port(), None);
    let addr = t.local_addr().expect("endpoint on 127.0.0.1");
    t.record_probe_failures("idle0", 7);
    let series = r#"railover_probe_failures_total{nic="idle0"}"#;
    let started = Instant::now();
    let (_, body) = http_get(addr, "/metrics").unwrap();
    let alone = started.elapsed();
    assert_eq!(value(&body, series), Some(7.0), "{body}");

    let mut idle: Vec<TcpStream> = (0..1000)
        .map(|i| {
            TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("idle connection {i}: {e}"))
        })
        .collect();
    let started = Instant::now();
    let (status, body) = http_get(addr, "/metrics").unwrap();
    let crowded = started.elapsed();
    println!("scrape alone {alone:?}, with 1000 idle connections open {crowded:?}");
    assert_eq!(status, 200, "{body}");
    assert_eq!(value(&body, series), Some(7.0), "{body}");
    // The bound the endpoint must meet is 1 s of delay; the margin is for a loaded host.
    assert!(
        crowded < alone + Duration::from_secs(1),
        "a scrape took {crowded:?} with 1000 idle connections open (alone: {alone:?})"
    );

    // The oldest were closed to make room at once; the newest when their deadline passed.
    assert!(
        closed_by_server(&mut idle[0], Duration::from_secs(10)),
        "the oldest idle connection is still open"
    );
    let newest = idle.len() - 1;
    assert!(
        closed_by_server(
            &mut idle[newest],
            CONNECTION_DEADLINE + Duration::from_secs(10)
        ),
        "an idle connection stayed open past {CONNECTION_DEADLINE:?}"
    );
    const { assert!(MAX_CONNECTIONS < 1000, "the test must exceed the limit") };
    drop(idle);
    t.shutdown();
}

/// Collects what `tracing` events the closure emits on this thread.
fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let r = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (r, text)
}

#[test]
fn port_in_use_is_a_warning_and_the_job_carries_on() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let cfg = exporter_cfg(&[
        ("RAILOVER_METRICS_PORT", &port.to_string()),
        ("RAILOVER_METRICS_ADDR", "127.0.0.1"),
        ("LOCAL_RANK", "0"),
    ])
    .unwrap();
    let (t, logs) = capture_logs(|| Telemetry::start(&cfg, None));
    assert_eq!(t.local_addr(), None);
    assert!(
        logs.contains("WARN") && logs.contains(&format!("127.0.0.1:{port}")),
        "no warning naming the address: {logs:?}"
    );
    assert!(logs.contains("carries on"), "{logs:?}");
    t.record_probe_failures("inuse0", 1);
    assert!(t
        .render()
        .contains(r#"railover_probe_failures_total{nic="inuse0"} 1"#));
    t.shutdown();
}

#[test]
fn off_disables_the_endpoint_but_not_the_metrics() {
    let cfg = exporter_cfg(&[("RAILOVER_METRICS_PORT", "off"), ("LOCAL_RANK", "3")]).unwrap();
    // No endpoint, but the rank is still known (`railover status` shows it).
    assert_eq!(cfg.endpoint, ExporterConfig::off().endpoint);
    assert_eq!(cfg.local_rank, Some(3));
    let (t, logs) = capture_logs(|| Telemetry::start(&cfg, Some(1)));
    assert_eq!(t.local_addr(), None);
    assert!(!logs.contains("WARN"), "{logs:?}");
    t.record_nic(&NicSample {
        nic: "off0",
        up: true,
        lanes: 1,
        ..Default::default()
    });
    assert!(t.render().contains(r#"railover_lanes{nic="off0"} 1"#));
}

#[test]
fn bad_environment_values_are_clear_errors() {
    for (var, value, says) in [
        ("RAILOVER_METRICS_PORT", "ninety", "off, or a base port"),
        ("RAILOVER_METRICS_PORT", "-1", "0 to 65535"),
        ("RAILOVER_METRICS_ADDR", "everywhere", "IPv4 or IPv6"),
        ("LOCAL_RANK", "first", "local rank"),
    ] {
        let e = exporter_cfg(&[(var, value)]).unwrap_err();
        let msg = e.to_string();
        assert_eq!((e.var, e.value.as_str()), (var, value));
        assert!(
            msg.contains(var) && msg.contains(value) && msg.contains(says),
            "{msg}"
        );
    }
}

/// Every `railover_*` name in `text`.
fn railover_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("railover_") {
        let before = rest[..i].chars().next_back();
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    out
}

/// Every string in the JSON tree under one of `keys`.
fn strings_under(v: &serde_json::Value, keys: &[&str], out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                if let (true, Some(s)) = (keys.contains(&k.as_str()), v.as_str()) {
                    out.push(s.to_owned());
                }
                strings_under(v, keys, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| strings_under(v, keys, out)),
        _ => {}
    }
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("dashboards/railover.json")).unwrap();
    serde_json::from_str(&text).expect("dashboards/railover.json is JSON")
}

fn dashboard_exprs() -> Vec<String> {
    let mut exprs = Vec::new();
    strings_under(&dashboard()["panels"], &["expr"], &mut exprs);
    exprs
}

#[test]
fn dashboard_queries_use_only_exported_metrics() {
    let d = dashboard();
    let exprs = dashboard_exprs();
    let mut queries = exprs.clone();
    strings_under(&d["templating"], &["query", "definition"], &mut queries);
    let used: BTreeSet<String> = queries.iter().flat_map(|q| railover_names(q)).collect();
    for name in &used {
        assert!(
            metrics::spec(name).is_some(),
            "dashboard uses {name}, which railover does not export"
        );
    }
    // The panels the issue asks for, by the series they plot.
    let all = exprs.join("\n");
    for needed in [
        "rate(railover_bytes_total",
        "railover_nic_up",
        "sum by (reason) (increase(railover_failovers_total",
        "histogram_quantile(0.5, sum by (le) (rate(railover_failover_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(railover_failover_seconds_bucket",
        "railover_lanes",
        "sum by (le) (increase(railover_comm_spread_bucket",
        "railover_replayed_bytes_total",
        "railover_failbacks_total",
        "railover_placed_bytes_total",
        "railover_memory_registrations_total",
        "railover_comms_given_up_total",
        "railover_unmatched_sends_total",
        "railover_link_events_total",
        "railover_memory_exclusions_total",
        "increase(railover_nic_down_seconds_total",
        "increase(railover_comm_displaced_seconds_total",
        "railover_comms_displaced",
        "railover_degraded",
        "railover_nic_capacity_bytes_per_second",
        "railover_rebalance_moves_total",
    ] {
        assert!(all.contains(needed), "no panel query contains {needed:?}");
    }
}

/// The zero copy panel divides each NIC's bytes written in place by the bytes it sent,
/// NIC by NIC, and shows a share.
#[test]
fn zero_copy_panel_is_placed_over_sent_bytes_per_nic() {
    let p = panel(&dashboard(), "Zero copy share per NIC");
    let targets = p["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 1);
    let expr = targets[0]["expr"].as_str().unwrap();
    let (placed, sent) = expr.split_once(" / ").expect("a ratio");
    assert!(
        placed.starts_with("sum by (instance, nic) (rate(railover_placed_bytes_total{"),
        "{expr}"
    );
    assert!(
        sent.contains("sum by (instance, nic) (rate(railover_bytes_total{")
            && sent.contains(r#"direction="tx""#),
        "{expr}"
    );
    let spec = |n| metrics::spec(n).unwrap();
    assert_eq!(spec("railover_placed_bytes_total").labels, ["nic"]);
    assert!(spec("railover_bytes_total").labels.contains(&"direction"));
    assert_eq!(p["fieldConfig"]["defaults"]["unit"], "percentunit");
    assert_eq!(p["fieldConfig"]["defaults"]["max"], 1);
    panel(&dashboard(), "Memory registrations");
}

/// The downtime panels sum each NIC's downtime over the dashboard's range per process and
/// NIC (every rank of a node reports the node's NICs, so adding across them would
/// multiply), and the degraded timeline shows each process's flag.
#[test]
fn downtime_panels_read_cumulative_downtime_per_process_and_nic() {
    let d = dashboard();
    let per_nic = panel(&d, "Downtime per NIC (range)");
    let expr = per_nic["targets"][0]["expr"].as_str().unwrap();
    assert!(
        expr.starts_with("sum by (instance, nic) (increase(railover_nic_down_seconds_total{")
            && expr.ends_with("[$__range]))"),
        "{expr}"
    );
    assert_eq!(per_nic["fieldConfig"]["defaults"]["unit"], "s");
    let longest = panel(&d, "Longest NIC downtime (range)");
    let expr = longest["targets"][0]["expr"].as_str().unwrap();
    assert!(expr.starts_with("max(sum by (instance, nic) ("), "{expr}");
    let spec = |n| metrics::spec(n).unwrap();
    assert_eq!(
        (
            spec(metrics::NIC_DOWN_SECONDS_TOTAL).kind,
            spec(metrics::NIC_DOWN_SECONDS_TOTAL).labels
        ),
        (metrics::MetricKind::Counter, &["nic"][..])
    );
    for name in [
        metrics::COMM_DISPLACED_SECONDS_TOTAL,
        metrics::COMMS_DISPLACED,
        metrics::DEGRADED,
    ] {
        assert!(spec(name).labels.is_empty(), "{name}: no per-comm label");
    }
    let degraded = panel(&d, "Degraded");
    assert_eq!(degraded["type"], "state-timeline");
    let expr = degraded["targets"][0]["expr"].as_str().unwrap();
    assert!(
        expr.starts_with("max by (instance) (railover_degraded{"),
        "{expr}"
    );
    panel(&d, "Comm time displaced (range)");
    panel(&d, "Comms displaced over time");
}

/// The panel titled `title`.
fn panel(d: &serde_json::Value, title: &str) -> serde_json::Value {
    d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["title"] == title)
        .unwrap_or_else(|| panic!("no panel {title:?}"))
        .clone()
}

/// The two panels that show where a failed NIC's load went read exported metrics of the
/// right kind and labels, and are drawn so that the spread shows.
#[test]
fn spread_panels_plot_lanes_per_nic_and_the_spread_histogram() {
    let d = dashboard();

    let lanes = panel(&d, "Lanes per NIC");
    let targets = lanes["targets"].as_array().unwrap();
    let lanes_target = targets
        .iter()
        .find(|t| railover_names(t["expr"].as_str().unwrap()).contains("railover_lanes"))
        .expect("a target plots railover_lanes");
    let expr = lanes_target["expr"].as_str().unwrap();
    assert!(expr.contains("by (instance, nic)"), "{expr}");
    let spec = metrics::spec("railover_lanes").unwrap();
    assert_eq!(
        (spec.kind, spec.labels),
        (metrics::MetricKind::Gauge, &["nic"][..])
    );
    let stacking = &lanes["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"];
    assert_eq!(stacking, "normal", "lanes per NIC must be stacked");
    // The paced lanes are a subset of the lanes: stacking them on top would count twice.
    for t in targets
        .iter()
        .filter(|t| railover_names(t["expr"].as_str().unwrap()).contains("railover_paced_lanes"))
    {
        let r = t["refId"].as_str().unwrap();
        let unstacked = lanes["fieldConfig"]["overrides"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["matcher"]["id"] == "byFrameRefID" && o["matcher"]["options"] == r)
            .flat_map(|o| o["properties"].as_array().unwrap())
            .any(|p| p["id"] == "custom.stacking" && p["value"]["mode"] == "none");
        assert!(
            unstacked,
            "paced lanes (refId {r}) are stacked on the lanes"
        );
    }

    let spread = panel(&d, "Comm spread at failover");
    let targets = spread["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 1);
    let expr = targets[0]["expr"].as_str().unwrap();
    assert!(
        expr.starts_with("sum by (le) (increase(railover_comm_spread_bucket{"),
        "{expr}"
    );
    let spec = metrics::spec("railover_comm_spread_bucket").unwrap();
    assert_eq!(spec.name, metrics::COMM_SPREAD);
    assert_eq!(spec.kind, metrics::MetricKind::Histogram);
    assert_eq!(spec.buckets(), Some(metrics::SPREAD_BUCKETS));
    assert_eq!(
        metrics::SPREAD_BUCKETS.first(),
        Some(&1.0),
        "a bar of its own for comms moved whole onto one pair"
    );
    // Grafana turns cumulative buckets into per-bucket counts only in heatmap format.
    assert_eq!(targets[0]["format"], "heatmap");
    assert_eq!(targets[0]["legendFormat"], "{{le}}");
}

#[test]
fn dashboard_imports_as_is() {
    let d = dashboard();
    assert!(
        d["id"].is_null(),
        "an exported dashboard carries no database id"
    );
    assert!(d["uid"]
        .as_str()
        .is_some_and(|u| !u.is_empty() && u.len() <= 40));
    let vars = d["templating"]["list"].as_array().unwrap();
    let var = |n: &str| {
        vars.iter()
            .find(|v| v["name"] == n)
            .unwrap_or_else(|| panic!("no {n} variable"))
    };
    let ds = var("datasource");
    assert_eq!(
        (ds["type"].as_str(), ds["query"].as_str()),
        (Some("datasource"), Some("prometheus"))
    );
    for n in ["job", "instance", "nic"] {
        let v = var(n);
        assert_eq!(v["type"], "query", "{n}");
        assert!(
            v["definition"]
                .as_str()
                .unwrap()
                .starts_with("label_values("),
            "{n}"
        );
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{n}");
    }
    // Every panel and target queries through the datasource variable, and panel ids and
    // target refIds are unique.
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().unwrap();
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "duplicate id on {title}"
        );
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let mut refs = BTreeSet::new();
        for t in p["targets"].as_array().unwrap() {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            assert!(refs.insert(t["refId"].as_str().unwrap()), "{title}");
            let expr = t["expr"].as_str().unwrap();
            assert!(
                !expr.contains("railover_") || expr.contains(r#"instance=~"$instance""#),
                "{title}: {expr} ignores the instance variable"
            );
        }
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{title}"
        );
    }
}

#[test]
fn alert_rules_use_only_exported_metrics() {
    let text = std::fs::read_to_string(root().join("dashboards/alerts.yml")).unwrap();
    let used = railover_names(&text);
    let in_exprs: BTreeSet<String> = alert_exprs()
        .iter()
        .flat_map(|e| railover_names(e))
        .collect();
    assert!(
        in_exprs.is_subset(&used) && in_exprs.len() >= 5,
        "{in_exprs:?}"
    );
    for name in &used {
        assert!(
            metrics::spec(name).is_some(),
            "alerts.yml uses {name}, which railover does not export"
        );
    }
    for needed in [
        "railover_nic_up",
        "railover_comms_without_backup",
        "railover_failbacks_total",
        "railover_failovers_total",
        "railover_nic_down_seconds_total",
    ] {
        assert!(used.contains(needed), "no alert on {needed}");
    }
    assert!(text.contains("absent("), "no alert for absent metrics");
}

/// The `expr` of every rule in `dashboards/alerts.yml`, folded block scalars joined into
/// one line.
fn alert_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("dashboards/alerts.yml")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut exprs = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let rest = rest.trim();
        if rest.starts_with('>') || rest.starts_with('|') {
            let mut block = Vec::new();
            while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > indent(line))
            {
                block.push(lines[i].trim());
                i += 1;
            }
            exprs.push(block.join(" "));
        } else {
            exprs.push(rest.trim_matches(|c| c == '"' || c == '\'').to_owned());
        }
    }
    let rules = lines
        .iter()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(exprs.len(), rules, "one expr per alert rule: {exprs:?}");
    exprs
}

/// One sample of an exposition text: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("name and value");
            let value = value.parse().unwrap_or_else(|_| panic!("value of {l}"));
            let (name, labels) = match series.split_once('{') {
                None => (series, Vec::new()),
                Some((name, rest)) => {
                    let inner = rest.strip_suffix('}').expect("closing brace");
                    let labels = inner
                        .split(',')
                        .filter(|kv| !kv.is_empty())
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("label=value");
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name, labels)
                }
            };
            (name.to_owned(), labels, value)
        })
        .collect()
}

/// The plugin, started with two loopback NICs, serves every series the dashboard and the
/// alert rules read from its first scrape, at 0 for each NIC and failure reason, before
/// anything has happened. Runs the check in a process of its own, so that no other test's
/// series are in the recorder.
#[test]
fn idle_scrape_serves_every_dashboard_and_alert_series() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--exact", "idle_scrape_child", "--ignored", "--nocapture"])
        .env_remove("RAILOVER_IFNAME")
        .env_remove("LOCAL_RANK")
        .env_remove("OMPI_COMM_WORLD_LOCAL_RANK")
        .env_remove("SLURM_LOCALID")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "idle scrape check failed:\n{text}");
    assert!(
        text.contains("idle scrape: checked"),
        "the check did not run:\n{text}"
    );
}

#[test]
#[ignore = "run by idle_scrape_serves_every_dashboard_and_alert_series, in a process of its own"]
fn idle_scrape_child() {
    std::env::set_var("RAILOVER_LOOPBACK_NICS", "2");
    std::env::set_var("RAILOVER_METRICS_PORT", "0");
    std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
    let ctx = railover_testkit::driver::Ctx::init().expect("init");
    let addr = railover::plugin::runtime()
        .unwrap()
        .telemetry
        .local_addr()
        .expect("endpoint");
    let (status, body) = http_get(addr, "/metrics").unwrap();
    assert_eq!(status, 200, "{body}");
    let got = samples(&body);
    let nics = ["lo.0", "lo.1"];
    let directions = ["tx", "rx"];
    let reasons: Vec<&str> = FailReason::ALL.iter().map(|r| r.as_str()).collect();

    let mut used: BTreeSet<String> = dashboard_exprs()
        .iter()
        .chain(alert_exprs().iter())
        .flat_map(|e| railover_names(e))
        .collect();
    let mut queries = Vec::new();
    strings_under(
        &dashboard()["templating"],
        &["query", "definition"],
        &mut queries,
    );
    used.extend(queries.iter().flat_map(|q| railover_names(q)));
    assert!(used.len() >= 10, "too few names found: {used:?}");

    let find = |name: &str, want: &[(&str, &str)]| {
        got.iter().find(|(n, labels, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
    };
    let mut checked = 0;
    for name in &used {
        let spec = metrics::spec(name).unwrap_or_else(|| panic!("{name} is not exported"));
        // Every label set the metric takes on an idle node with these NICs.
        let mut sets: Vec<Vec<(&str, &str)>> = vec![Vec::new()];
        for &label in spec.labels {
            let values: Vec<&str> = match label {
                "nic" => nics.to_vec(),
                "direction" => directions.to_vec(),
                "reason" => reasons.clone(),
                "rail" => continue, // whatever rail the NIC has; the nic label finds it
                other => panic!("{} has an unexpected label {other}", spec.name),
            };
            sets = sets
                .iter()
                .flat_map(|s| {
                    values.iter().map(move |v| {
                        let mut s = s.clone();
                        s.push((label, *v));
                        s
                    })
                })
                .collect();
        }
        for set in &sets {
            let series: Vec<String> = match spec.kind {
                metrics::MetricKind::Histogram => ["_count", "_sum"]
                    .iter()
                    .map(|sfx| format!("{}{sfx}", spec.name))
                    .collect(),
                _ => vec![spec.name.to_owned()],
            };
            for s in &series {
                let (_, _, v) = find(s, set).unwrap_or_else(|| {
                    panic!("the first scrape lacks {s}{set:?}, which the dashboard or an alert reads:\n{body}")
                });
                if spec.kind != metrics::MetricKind::Gauge {
                    assert_eq!(*v, 0.0, "{s}{set:?} on an idle node");
                }
                checked += 1;
            }
            if spec.kind == metrics::MetricKind::Histogram {
                let mut inf = set.clone();
                inf.push(("le", "+Inf"));
                let bucket = format!("{}_bucket", spec.name);
                assert!(find(&bucket, &inf).is_some(), "no {bucket}{inf:?}:\n{body}");
            }
        }
    }
    // Bounded cardinality: no label value beyond the NICs, directions and reasons.
    for (name, labels, _) in got.iter().filter(|(n, _, _)| n.starts_with("railover_")) {
        for (k, v) in labels {
            let ok = match k.as_str() {
                "nic" => nics.contains(&v.as_str()),
                "direction" => directions.contains(&v.as_str()),
                "reason" => reasons.contains(&v.as_str()),
                "rail" | "le" => true,
                _ => false,
            };
            assert!(ok, "{name} has label {k}={v:?}");
        }
    }
    ctx.finalize().unwrap();
    println!(
        "idle scrape: checked {checked} series of {} names",
        used.len()
    );
}

#[test]
fn docs_table_lists_every_metric() {
    let doc = std::fs::read_to_string(root().join("docs/metrics.md")).unwrap();
    let table = metrics::markdown_table();
    assert!(
        doc.contains(&table),
        "docs/metrics.md must contain the table generated from METRICS:\n\n{table}"
    );
}

/// promtool's path, installing Debian's `prometheus` package when root. `None` (after
/// printing SKIP) when it is missing and cannot be installed here.
fn tool(name: &str) -> Option<PathBuf> {
    let find = || {
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
    };
    if let Some(p) = find() {
        return Some(p);
    }
    let root_user = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root_user {
        println!("SKIP: {name} is not installed and we are not root to install it (scripts/install-prometheus.sh)");
        return None;
    }
    // Tests run in parallel; one install at a time.
    static INSTALL: Mutex<()> = Mutex::new(());
    let _one = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = find() {
        return Some(p);
    }
    let status = Command::new("bash")
        .arg(root().join("scripts/install-prometheus.sh"))
        .status()
        .expect("run scripts/install-prometheus.sh");
    assert!(status.success(), "scripts/install-prometheus.sh failed");
    Some(find().unwrap_or_else(|| panic!("{name} still missing after the install script")))
}

fn run_with_stdin(cmd: &mut Command, stdin: &str) -> (bool, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn promtool_accepts_the_rules_and_the_exposition_text() {
    let Some(promtool) = tool("promtool") else {
        return;
    };
    let (ok, out) = run_with_stdin(
        Command::new(&promtool)
            .args(["check", "rules"])
            .arg(root().join("dashboards/alerts.yml")),
        "",
    );
    assert!(ok, "promtool check rules:\n{out}");

    let t = Telemetry::start(&ExporterConfig::off(), None);
    record_all(&t, "promtool0");
    let text = t.render();
    for m in METRICS {
        assert!(
            text.contains(&format!("# TYPE {} {}\n", m.name, m.kind.as_str())),
            "{} ({}) not rendered:\n{text}",
            m.name,
            m.kind.as_str()
        );
    }
    let (ok, out) = run_with_stdin(Command::new(&promtool).args(["check", "metrics"]), &text);
    assert!(ok, "promtool check metrics:\n{out}\non:\n{text}");
}

#[test]
fn alert_rules_fire_as_intended() {
    let Some(promtool) = tool("promtool") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let rules = root().join("dashboards/alerts.yml");
    let test = dir.path().join("alerts_test.yml");
    // Series are sampled every minute; `_x5` repeats a value five more times.
    let body = format!(
        r#"rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'railover_nic_up{{job="railover",instance="n1:9464",nic="eth0"}}'
        values: '1 1 0 0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'railover_lanes{{job="railover",instance="n1:9464",nic="eth0"}}'
        values: '4 4 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0'
      - series: 'railover_failovers_total{{job="railover",instance="n1:9464",nic="eth0",reason="link_down"}}'
        values: '0 0 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4'
      - series: 'railover_comms_without_backup{{job="railover",instance="n1:9464"}}'
        values: '0 0 0 1 1 0'
      - series: 'up{{job="railover",instance="n1:9464"}}'
        values: '1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
    alert_rule_test:
      - eval_time: 2m
        alertname: RailoverNicDown
        exp_alerts: []
      - eval_time: 4m
        alertname: RailoverNicDown
        exp_alerts:
          - exp_labels: {{severity: warning, job: railover, instance: "n1:9464", nic: eth0}}
            exp_annotations:
              summary: 'railover NIC eth0 on n1:9464 is down'
              description: 'NIC eth0 has been down for over a minute. railover moved its lanes to other NIC pairs, so the job runs at reduced bandwidth; check the port, cable and switch link.'
      - eval_time: 3m
        alertname: RailoverCommWithoutBackup
        exp_alerts:
          - exp_labels: {{severity: critical, job: railover, instance: "n1:9464"}}
            exp_annotations:
              summary: 'railover on n1:9464: a comm lost its path and no backup NIC pair is eligible'
              description: 'railover found no healthy NIC pair that passes the rail rule, the probe and the distance limit, and returned an error to NCCL: the job is failing or about to. See the "giving up" WARN line in the NCCL log.'
      - eval_time: 10m
        alertname: RailoverNoFailback
        exp_alerts: []
      - eval_time: 25m
        alertname: RailoverNoFailback
        exp_alerts:
          - exp_labels: {{severity: warning, job: railover, instance: "n1:9464", nic: eth0}}
            exp_annotations:
              summary: 'railover NIC eth0 on n1:9464 is up but its lanes have not failed back'
              description: 'The NIC has been up without lanes for 15 minutes after failovers moved them away. Probes of its pairs may still fail (check railover_probe_failures_total) or the peer''s NIC may be down.'
      - eval_time: 25m
        alertname: RailoverTargetDown
        exp_alerts: []
      - eval_time: 25m
        alertname: RailoverMetricsAbsent
        exp_alerts: []
"#,
        rules = rules.display()
    );
    std::fs::write(&test, body).unwrap();
    let (ok, out) = run_with_stdin(
        Command::new(&promtool).args(["test", "rules"]).arg(&test),
        "",
    );
    assert!(ok, "promtool test rules:\n{out}");
}

/// `dashboards/alerts_test.yml`, the rules' unit tests that operators can run beside
/// alerts.yml when they tune a threshold, passes; and it still holds cases where the
/// downtime alert fires and where it must not.
#[test]
fn alert_rule_unit_tests_pass() {
    let test = root().join("dashboards/alerts_test.yml");
    let text = std::fs::read_to_string(&test).unwrap();
    let downtime = text.matches("alertname: RailoverNicDowntime").count();
    let quiet = text.matches("exp_alerts: []").count();
    let firing = text.matches("exp_alerts:\n").count();
    assert!(
        downtime >= 4 && quiet >= 2 && firing >= 2,
        "alerts_test.yml lost its downtime cases ({downtime} tests, {quiet} quiet, {firing} firing)"
    );
    let Some(promtool) = tool("promtool") else {
        return;
    };
    let (ok, out) = run_with_stdin(
        Command::new(&promtool).args(["test", "rules"]).arg(&test),
        "",
    );
    assert!(ok, "promtool test rules {}:\n{out}", test.display());
    assert!(out.contains("SUCCESS"), "{out}");
}

/// Kills and reaps a child process on drop, so a failing assertion leaves nothing running.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `f` until it returns `Some`, or panics after `limit`.
fn poll_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `/api/v1/query` of a real Prometheus server; the result vector.
fn prom_query(prom: SocketAddr, query: &str) -> Option<Vec<serde_json::Value>> {
    let mut enc = String::new();
    for b in query.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            enc.push(b as char);
        } else {
            enc.push_str(&format!("%{b:02X}"));
        }
    }
    let (status, body) = http_get(prom, &format!("/api/v1/query?query={enc}")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    assert_eq!(status, 200, "query {query:?}: {body}");
    assert_eq!(v["status"], "success", "query {query:?}: {body}");
    v["data"]["result"].as_array().cloned()
}

fn first_value(result: &[serde_json::Value]) -> Option<f64> {
    result.first()?["value"][1].as_str()?.parse().ok()
}

#[test]
fn prometheus_scrapes_the_endpoint_and_runs_the_dashboard_queries() {
    let Some(prometheus) = tool("prometheus") else {
        return;
    };
    let t = Telemetry::start(&loopback_any_port(), None);
    let target = t.local_addr().expect("endpoint on 127.0.0.1");
    let sample = |bytes| NicSample {
        nic: "prom0",
        rail: Some(0),
        up: true,
        lanes: 2,
        tx_bytes: bytes,
        placed_bytes: bytes / 4,
        ..Default::default()
    };
    t.record_nic(&sample(1000));

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: railover\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let web = {
        // The port is free when probed; a race with another process only fails this test.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _server = Reaped(
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start prometheus"),
    );
    let series = r#"railover_bytes_total{job="railover",nic="prom0",direction="tx"}"#;
    let logs = || std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    let first = poll_until(Duration::from_secs(60), "the first scrape", || {
        first_value(&prom_query(web, series)?)
    });
    assert!(first >= 1000.0, "{first}\n{}", logs());

    t.record_nic(&sample(5000));
    let later = poll_until(Duration::from_secs(30), "a scrape after more bytes", || {
        first_value(&prom_query(web, series)?).filter(|&v| v > first)
    });
    assert_eq!(later, first + 5000.0);
    let up = prom_query(web, r#"up{job="railover"}"#).unwrap();
    assert_eq!(first_value(&up), Some(1.0));

    // A quarter of prom0's bytes were written in place, from its first sample on: the
    // zero copy panel says 0.25.
    let share = panel(&dashboard(), "Zero copy share per NIC")["targets"][0]["expr"]
        .as_str()
        .unwrap()
        .replace("$__rate_interval", "1m")
        .replace("$job", "railover")
        .replace("$instance", ".*")
        .replace("$nic", "prom0");
    let share = poll_until(Duration::from_secs(30), "the zero copy share", || {
        first_value(&prom_query(web, &share)?)
    });
    assert!((share - 0.25).abs() < 1e-9, "zero copy share {share}");

    // A comm spread over 3 pairs shows in the spread panel's buckets 3 and up, not below.
    // (Other tests of this binary observe 7 only.)
    t.record_comm_spread(3);
    let spread_query = |le: &str| {
        let q = format!(
            "{} or vector(0)",
            panel(&dashboard(), "Comm spread at failover")["targets"][0]["expr"]
                .as_str()
                .unwrap()
                .replace("$__range", "1h")
                .replace("$job", "railover")
                .replace("$instance", ".*")
                .replace("sum by (le) (", "sum(") // one bucket at a time
                .replace("_bucket{", &format!("_bucket{{le=\"{le}\","))
        );
        first_value(&prom_query(web, &q)?)
    };
    let at3 = poll_until(Duration::from_secs(30), "the spread in Prometheus", || {
        spread_query("3").filter(|&v| v > 0.0)
    });
    assert!(at3 > 0.0);
    assert_eq!(spread_query("2"), Some(0.0));

    // Every dashboard query, with Grafana's variables filled in, is valid PromQL that
    // Prometheus evaluates (prom_query asserts status success).
    for expr in dashboard_exprs() {
        let q = expr
            .replace("$__rate_interval", "1m")
            .replace("$__range", "1h")
            .replace("$job", "railover")
            .replace("$instance", ".*")
            .replace("$nic", ".*");
        prom_query(web, &q).unwrap_or_else(|| panic!("no answer for {q}"));
    }
    t.shutdown();
}
