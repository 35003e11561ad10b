//! railover's Prometheus metrics: the one table of names ([`METRICS`]), the events the
//! data path reports, and [`Telemetry`], which records them through the `metrics` facade
//! and serves them over HTTP (see [`exporter`](super::exporter)).
//!
//! Only this module knows the `railover_*` names and their labels (`docs/design.md` §7.2):
//! `conn`, `routing` and the reactor keep plain counters, and the reactor hands them here in
//! batches — once per reporting interval (about 100 ms) or per turn, as deltas — never
//! once per message. Each call costs a few hash lookups and small allocations.
//!
//! Labels are bounded: `nic` (a local NIC name), `rail`, `direction` (`tx`/`rx`) and
//! `reason` (the four [`FailReason`]s). Nothing is labelled per request, comm or peer
//! address.
//!
//! The same events also give the one-line log messages of a failover, a fail-back and a
//! give-up ([`Failover`], [`Failback`] and [`GiveUp`] implement `Display`), so the log and
//! the counters cannot disagree about what happened.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use parking_lot::Mutex;

use super::exporter::{Exporter, ExporterConfig};
use crate::routing::{CommRoutes, FailReason, LaneStatus, Pair, Routes};

/// `railover_bytes_total{nic,direction}`.
pub const BYTES_TOTAL: &str = "railover_bytes_total";
/// `railover_messages_total{nic,direction}`.
pub const MESSAGES_TOTAL: &str = "railover_messages_total";
/// `railover_placed_bytes_total{nic}`.
pub const PLACED_BYTES_TOTAL: &str = "railover_placed_bytes_total";
/// `railover_lanes{nic}`.
pub const LANES: &str = "railover_lanes";
/// `railover_paced_lanes{nic}`.
pub const PACED_LANES: &str = "railover_paced_lanes";
/// `railover_nic_up{nic}`.
pub const NIC_UP: &str = "railover_nic_up";
/// `railover_nic_drained{nic}`.
pub const NIC_DRAINED: &str = "railover_nic_drained";
/// `railover_drain_moves_total{nic}`.
pub const DRAIN_MOVES_TOTAL: &str = "railover_drain_moves_total";
/// `railover_rebalance_moves_total{nic}`.
pub const REBALANCE_MOVES_TOTAL: &str = "railover_rebalance_moves_total";
/// `railover_nic_capacity_bytes_per_second{nic}`.
pub const NIC_CAPACITY: &str = "railover_nic_capacity_bytes_per_second";
/// `railover_nic_down_seconds_total{nic}`.
pub const NIC_DOWN_SECONDS_TOTAL: &str = "railover_nic_down_seconds_total";
/// `railover_nic_info{nic,rail}`.
pub const NIC_INFO: &str = "railover_nic_info";
/// `railover_failovers_total{nic,reason}`.
pub const FAILOVERS_TOTAL: &str = "railover_failovers_total";
/// `railover_failover_seconds` (histogram).
pub const FAILOVER_SECONDS: &str = "railover_failover_seconds";
/// `railover_detection_seconds` (histogram).
pub const DETECTION_SECONDS: &str = "railover_detection_seconds";
/// `railover_replayed_bytes_total`.
pub const REPLAYED_BYTES_TOTAL: &str = "railover_replayed_bytes_total";
/// `railover_duplicates_total`.
pub const DUPLICATES_TOTAL: &str = "railover_duplicates_total";
/// `railover_failbacks_total{nic}`.
pub const FAILBACKS_TOTAL: &str = "railover_failbacks_total";
/// `railover_probe_failures_total{nic}`.
pub const PROBE_FAILURES_TOTAL: &str = "railover_probe_failures_total";
/// `railover_comms_without_backup`.
pub const COMMS_WITHOUT_BACKUP: &str = "railover_comms_without_backup";
/// `railover_no_eligible_pair_total`.
pub const NO_ELIGIBLE_PAIR_TOTAL: &str = "railover_no_eligible_pair_total";
/// `railover_reactor_busy_ratio`.
pub const REACTOR_BUSY_RATIO: &str = "railover_reactor_busy_ratio";
/// `railover_rejected_connections_total`.
pub const REJECTED_CONNECTIONS_TOTAL: &str = "railover_rejected_connections_total";
/// `railover_handshakes_refused_total`.
pub const HANDSHAKES_REFUSED_TOTAL: &str = "railover_handshakes_refused_total";
/// `railover_handshakes_pending`.
pub const HANDSHAKES_PENDING: &str = "railover_handshakes_pending";
/// `railover_protocol_errors_total`.
pub const PROTOCOL_ERRORS_TOTAL: &str = "railover_protocol_errors_total";
/// `railover_lane_failures_total`.
pub const LANE_FAILURES_TOTAL: &str = "railover_lane_failures_total";
/// `railover_comm_spread` (histogram).
pub const COMM_SPREAD: &str = "railover_comm_spread";
/// `railover_unmatched_sends_total`.
pub const UNMATCHED_SENDS_TOTAL: &str = "railover_unmatched_sends_total";
/// `railover_memory_exclusions_total{nic}`.
pub const MEMORY_EXCLUSIONS_TOTAL: &str = "railover_memory_exclusions_total";
/// `railover_comms_given_up_total`.
pub const COMMS_GIVEN_UP_TOTAL: &str = "railover_comms_given_up_total";
/// `railover_link_events_total`.
pub const LINK_EVENTS_TOTAL: &str = "railover_link_events_total";
/// `railover_memory_registrations_total`.
pub const MEMORY_REGISTRATIONS_TOTAL: &str = "railover_memory_registrations_total";

/// `railover_comm_displaced_seconds_total`.
pub const COMM_DISPLACED_SECONDS_TOTAL: &str = "railover_comm_displaced_seconds_total";
/// `railover_comms_displaced`.
pub const COMMS_DISPLACED: &str = "railover_comms_displaced";
/// `railover_degraded`.
pub const DEGRADED: &str = "railover_degraded";

/// Histogram bucket bounds, in seconds, for [`FAILOVER_SECONDS`] and [`DETECTION_SECONDS`]:
/// fine below the default 1 s completion timeout (P1), coarse up to NCCL's own ~30 s.
pub const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
    30.0, 60.0,
];

/// Histogram bucket bounds, in NIC pairs, for [`COMM_SPREAD`]: 1 is a comm moved whole onto
/// one survivor (NCCL's native failover), N−1 a comm spread over every survivor of an
/// N-NIC node, for nodes of up to 17 NICs.
pub const SPREAD_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0];

/// A Prometheus metric type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl MetricKind {
    /// The name Prometheus uses in `# TYPE` lines.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One exported metric: what the docs table, the dashboard check and `# HELP` all read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricSpec {
    pub name: &'static str,
    pub kind: MetricKind,
    pub labels: &'static [&'static str],
    /// Base unit of the value (`bytes`, `seconds`, or what is counted).
    pub unit: &'static str,
    /// One sentence, used as the `# HELP` text and in `docs/metrics.md`.
    pub help: &'static str,
}

impl MetricSpec {
    /// A histogram's bucket bounds: [`SPREAD_BUCKETS`] for [`COMM_SPREAD`],
    /// [`DURATION_BUCKETS`] for the others. `None` for counters and gauges.
    pub fn buckets(&self) -> Option<&'static [f64]> {
        match (self.kind, self.name) {
            (MetricKind::Histogram, COMM_SPREAD) => Some(SPREAD_BUCKETS),
            (MetricKind::Histogram, _) => Some(DURATION_BUCKETS),
            _ => None,
        }
    }
}

/// Every metric railover exports. `docs/metrics.md` holds [`markdown_table`] of it, and the
/// dashboard and alert rules may only use these names (both checked by tests).
pub const METRICS: &[MetricSpec] = &[
    MetricSpec {
        name: BYTES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic", "direction"],
        unit: "bytes",
        help: "Payload bytes carried by the local NIC (direction tx: sent, rx: received), replays included.",
    },
    MetricSpec {
        name: MESSAGES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic", "direction"],
        unit: "messages",
        help: "Messages (NCCL sends or receives) completed over the local NIC, by direction.",
    },
    MetricSpec {
        name: PLACED_BYTES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "bytes",
        help: "Payload bytes the local NIC wrote straight into the peer's receive buffer (verbs zero copy: RDMA WRITE from NCCL's send buffer, no ring copy at either end), counted when posted; part of the NIC's tx railover_bytes_total, always 0 on TCP.",
    },
    MetricSpec {
        name: LANES,
        kind: MetricKind::Gauge,
        labels: &["nic"],
        unit: "lanes",
        help: "Running lanes on the local NIC, across all comms; drops to 0 when its traffic moved away.",
    },
    MetricSpec {
        name: PACED_LANES,
        kind: MetricKind::Gauge,
        labels: &["nic"],
        unit: "lanes",
        help: "Lanes of the local NIC held to an even share of it by a TCP pacing cap (busy lanes contending for one NIC, e.g. after a failover).",
    },
    MetricSpec {
        name: NIC_UP,
        kind: MetricKind::Gauge,
        labels: &["nic"],
        unit: "boolean",
        help: "1 while the local NIC has carrier and no fatal error, 0 while it is down.",
    },
    MetricSpec {
        name: NIC_DRAINED,
        kind: MetricKind::Gauge,
        labels: &["nic"],
        unit: "boolean",
        help: "1 while an operator has the local NIC drained (railover drain, or the watched drain file), 0 otherwise.",
    },
    MetricSpec {
        name: DRAIN_MOVES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "moves",
        help: "Planned moves of a comm's stripes off a pair because one of its NICs was drained, here or at the peer (one per comm each time its stripes settle elsewhere); nic is the local NIC they left.",
    },
    MetricSpec {
        name: REBALANCE_MOVES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "moves",
        help: "Planned moves of a comm's stripes off a backup they had failed over onto, because it showed it carries less than it was weighed by (one per comm each time its stripes settle elsewhere); nic is the local NIC they left.",
    },
    MetricSpec {
        name: NIC_CAPACITY,
        kind: MetricKind::Gauge,
        labels: &["nic"],
        unit: "bytes/s",
        help: "What the local NIC can carry as backup selection weighs it: its link speed, or the lower rate it delivered while backed up. Absent while neither is known.",
    },
    MetricSpec {
        name: NIC_DOWN_SECONDS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "seconds",
        help: "Time the local NIC spent down (carrier lost, or cut by fault injection), from when railover marked it down until it was up again; an outage under way adds to it at every sample, not only when it ends. Whole seconds, the fraction carried to the next sample.",
    },
    MetricSpec {
        name: NIC_INFO,
        kind: MetricKind::Gauge,
        labels: &["nic", "rail"],
        unit: "boolean",
        help: "Always 1; its rail label names the NIC's rail (none when unknown), for joins.",
    },
    MetricSpec {
        name: FAILOVERS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic", "reason"],
        unit: "moves",
        help: "Comm failovers off a pair whose local NIC is nic, by why the pair failed (timeout, nic_error, link_down, probe): one per comm, when every stripe it moved runs again, or when a fail-back overtakes it.",
    },
    MetricSpec {
        name: FAILOVER_SECONDS,
        kind: MetricKind::Histogram,
        labels: &[],
        unit: "seconds",
        help: "Time from detecting a failed lane to its traffic resuming on a backup pair.",
    },
    MetricSpec {
        name: DETECTION_SECONDS,
        kind: MetricKind::Histogram,
        labels: &[],
        unit: "seconds",
        help: "Time from a lane's last progress to the failure being detected (completion timeout or NIC error).",
    },
    MetricSpec {
        name: COMM_SPREAD,
        kind: MetricKind::Histogram,
        labels: &[],
        unit: "pairs",
        help: "Distinct NIC pairs a comm runs over once its failover completes: 1 when moved whole onto one survivor, N-1 when spread over every survivor of N NICs.",
    },
    MetricSpec {
        name: REPLAYED_BYTES_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "bytes",
        help: "Bytes sent again after a failover because the receiver had not acknowledged them.",
    },
    MetricSpec {
        name: DUPLICATES_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "messages",
        help: "Replayed messages the receiver had already delivered and dropped.",
    },
    MetricSpec {
        name: FAILBACKS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "moves",
        help: "Comm fail-backs to their original pair, whose local NIC is nic: one per comm, when every stripe is home.",
    },
    MetricSpec {
        name: PROBE_FAILURES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "probes",
        help: "Health probes from the local NIC that failed or came too late.",
    },
    MetricSpec {
        name: COMMS_WITHOUT_BACKUP,
        kind: MetricKind::Gauge,
        labels: &[],
        unit: "comms",
        help: "Comms with a failed lane and no eligible backup pair right now (their requests fail).",
    },
    MetricSpec {
        name: COMM_DISPLACED_SECONDS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "seconds",
        help: "Time the process's send comms spent displaced, summed over them: a comm counts while a lane of it is off its own NIC pair (failed over, being moved, or with no eligible pair) until it has failed back, and adds at every sample while that lasts. Whole seconds, the fraction carried to the next sample.",
    },
    MetricSpec {
        name: COMMS_DISPLACED,
        kind: MetricKind::Gauge,
        labels: &[],
        unit: "comms",
        help: "Send comms displaced now: a lane of theirs is off its own NIC pair (failed over, being moved, or with no eligible pair).",
    },
    MetricSpec {
        name: DEGRADED,
        kind: MetricKind::Gauge,
        labels: &[],
        unit: "boolean",
        help: "1 while any comm of the process is displaced or any of its local NICs is down, else 0: for schedulers.",
    },
    MetricSpec {
        name: NO_ELIGIBLE_PAIR_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "events",
        help: "Times a failed lane found no eligible backup pair and railover gave up on its comm.",
    },
    MetricSpec {
        name: REACTOR_BUSY_RATIO,
        kind: MetricKind::Gauge,
        labels: &[],
        unit: "ratio",
        help: "Fraction (0 to 1) of the last reporting interval the reactor thread spent working rather than parked.",
    },
    MetricSpec {
        name: REJECTED_CONNECTIONS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "connections",
        help: "Incoming connections dropped before they authenticated (garbage, a failed handshake, the 2 s deadline or the handshake caps).",
    },
    MetricSpec {
        name: HANDSHAKES_REFUSED_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "handshakes",
        help: "Incoming lanes whose handshake failed to authenticate (wrong key, unknown comm, replayed, altered, or a replacement older than the lane in use).",
    },
    MetricSpec {
        name: HANDSHAKES_PENDING,
        kind: MetricKind::Gauge,
        labels: &[],
        unit: "connections",
        help: "Incoming connections in their handshake now (capped per listener and in total).",
    },
    MetricSpec {
        name: PROTOCOL_ERRORS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "lanes",
        help: "Lanes closed because the peer broke the wire protocol.",
    },
    MetricSpec {
        name: LANE_FAILURES_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "lanes",
        help: "Lanes lost to socket errors or an unexpected close.",
    },
    MetricSpec {
        name: UNMATCHED_SENDS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "comms",
        help: "Comms whose sends found no buffer for their tags in the peer's oldest posted receive for RAILOVER_UNMATCHED_WARN_MS (one WARN each): a tag mismatch between the two ranks' NCCL calls. The comm stays open.",
    },
    MetricSpec {
        name: MEMORY_EXCLUSIONS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["nic"],
        unit: "exclusions",
        help: "A NIC left out of a comm's candidate pairs because it could not register the comm's GPU memory (too far from the GPU, or no peer memory): ours by name, or the peer's as peer<i>/nic<j>. The comm moves to the next pair.",
    },
    MetricSpec {
        name: COMMS_GIVEN_UP_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "comms",
        help: "Comms whose requests railover failed because no NIC pair could carry them any more: the sender found no eligible backup pair, or a receiver's replacement lane did not arrive in time.",
    },
    MetricSpec {
        name: LINK_EVENTS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "events",
        help: "Carrier changes (down or up) seen on the local NICs; a steady rise is a flapping link.",
    },
    MetricSpec {
        name: MEMORY_REGISTRATIONS_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        unit: "registrations",
        help: "Registrations of NCCL's memory (regMr ranges) with an RDMA device, each made the first time a lane on that device needs the range; a rise after a failover is the backup NIC registering.",
    },
];

/// The spec of an exported metric, by name. A histogram's `_bucket`, `_sum` and `_count`
/// series resolve to the histogram.
pub fn spec(series: &str) -> Option<&'static MetricSpec> {
    METRICS.iter().find(|m| m.name == series).or_else(|| {
        ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = series.strip_suffix(suffix)?;
            METRICS
                .iter()
                .find(|m| m.name == base && m.kind == MetricKind::Histogram)
        })
    })
}

/// The metrics table of `docs/metrics.md`, generated from [`METRICS`] (a test checks the
/// file holds exactly this).
pub fn markdown_table() -> String {
    let mut out =
        String::from("| name | type | labels | unit | meaning |\n|---|---|---|---|---|\n");
    for m in METRICS {
        let labels = if m.labels.is_empty() {
            "—".to_string()
        } else {
            m.labels.join(", ")
        };
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            m.name,
            m.kind.as_str(),
            labels,
            m.unit,
            m.help
        ));
    }
    out
}

/// Which way bytes or messages went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Tx,
    Rx,
}

impl Direction {
    /// The `direction` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Tx => "tx",
            Direction::Rx => "rx",
        }
    }
}

/// One local NIC's state and traffic since the previous sample, for [`Telemetry::record_nic`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NicSample<'a> {
    /// The NIC's name (`eth0`, `mlx5_0`): the `nic` label.
    pub nic: &'a str,
    /// Its rail, when topology knows it.
    pub rail: Option<u32>,
    /// Carrier and no fatal error (`routing::LocalNicRoutes::up`).
    pub up: bool,
    /// Running lanes on it now (`routing::LocalNicRoutes::lanes`).
    pub lanes: u64,
    /// Of those, lanes under a pacing cap (`transport::fair`).
    pub paced_lanes: u64,
    /// Bytes sent since the previous sample.
    pub tx_bytes: u64,
    /// Bytes received since the previous sample.
    pub rx_bytes: u64,
    /// Messages sent since the previous sample.
    pub tx_messages: u64,
    /// Messages received since the previous sample.
    pub rx_messages: u64,
    /// Payload bytes written in place since the previous sample: a part of what
    /// `tx_bytes` counts, taken when posted (`transport::LaneProgress::placed` deltas).
    pub placed_bytes: u64,
    /// Whole seconds it was down since the previous sample (`sampler::Accrual`).
    pub down_seconds: u64,
    /// An operator drained it.
    pub drained: bool,
    /// What it can carry (bytes/s) as backup selection weighs it, when known
    /// (`routing::Router::capacity`).
    pub capacity: Option<u64>,
}

/// Turns one cumulative counter (`ReactorStats`, `conn::Stats`, `routing::Stats`) into the
/// deltas the `record_*` methods take. Keep one per counter next to the last value read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delta {
    last: u64,
}

impl Delta {
    /// The increase since the previous call. A total below the previous one means the
    /// counter started again from zero (a new reactor after finalize and init), so all of
    /// it is new.
    pub fn take(&mut self, total: u64) -> u64 {
        let d = if total >= self.last {
            total - self.last
        } else {
            total
        };
        self.last = total;
        d
    }
}

/// Comms with at least one stranded lane (failed, no eligible backup pair) in a route
/// snapshot: the value for [`Telemetry::set_comms_without_backup`].
pub fn comms_without_backup(routes: &Routes) -> u64 {
    routes
        .comms
        .iter()
        .filter(|c| c.lanes.iter().any(|l| l.status == LaneStatus::Stranded))
        .count() as u64
}

/// The distinct NIC pairs a comm's running lanes are on in a route snapshot: the value for
/// [`Telemetry::record_comm_spread`] once none of its lanes is
/// [`Moving`](LaneStatus::Moving) any more.
pub fn comm_pairs(comm: &CommRoutes) -> usize {
    comm.lanes
        .iter()
        .filter(|l| l.status == LaneStatus::Active)
        .map(|l| l.current)
        .collect::<BTreeSet<Pair>>()
        .len()
}

/// A NIC pair as logs show it: `local->remote`. The remote side may carry the peer's name
/// (`host/mlx5_1`); only the local name becomes a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NicPair<'a> {
    pub local: &'a str,
    pub remote: &'a str,
}

impl fmt::Display for NicPair<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}->{}", self.local, self.remote)
    }
}

/// A lane moved to a backup pair. `Display` gives its WARN line:
///
/// `railover: failover comm=7 eth0->10.0.0.2/eth0 => eth1->10.0.0.2/eth1 reason=timeout detect=1000.0ms resume=3.2ms`
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failover<'a> {
    /// The comm (the id the reactor logs it by).
    pub comm: u64,
    /// The pair that failed.
    pub from: NicPair<'a>,
    /// The backup pair the lane now runs on.
    pub to: NicPair<'a>,
    pub reason: FailReason,
    /// Last progress on the lane → failure detected.
    pub detection: Duration,
    /// Failure detected → traffic resumed on `to`.
    pub resume: Duration,
}

impl fmt::Display for Failover<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "railover: failover comm={} {} => {} reason={} detect={} resume={}",
            self.comm,
            self.from,
            self.to,
            self.reason.as_str(),
            Millis(self.detection),
            Millis(self.resume)
        )
    }
}

/// A lane moved back to its original pair. `Display` gives its INFO line:
///
/// `railover: failback comm=7 eth1->10.0.0.2/eth1 => eth0->10.0.0.2/eth0 away=12.5s`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failback<'a> {
    pub comm: u64,
    /// The backup pair it leaves.
    pub from: NicPair<'a>,
    /// The original pair it returns to.
    pub to: NicPair<'a>,
    /// How long it ran away from `to`.
    pub away: Duration,
}

impl fmt::Display for Failback<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "railover: failback comm={} {} => {} away={:.1}s",
            self.comm,
            self.from,
            self.to,
            self.away.as_secs_f64()
        )
    }
}

/// A failed lane with no eligible backup pair: railover gives up on the comm (P5).
/// `Display` gives its WARN line:
///
/// `railover: giving up comm=7 eth0->10.0.0.2/eth0 reason=link_down: no eligible backup pair among 3 candidates; the comm's requests fail`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveUp<'a> {
    pub comm: u64,
    /// The pair that failed.
    pub failed: NicPair<'a>,
    pub reason: FailReason,
    /// Pairs considered (all rejected by the rail rule, probe or distance limit).
    pub candidates: usize,
}

impl fmt::Display for GiveUp<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "railover: giving up comm={} {} reason={}: no eligible backup pair among {} candidate{}; the comm's requests fail",
            self.comm,
            self.failed,
            self.reason.as_str(),
            self.candidates,
            if self.candidates == 1 { "" } else { "s" }
        )
    }
}

/// A duration as milliseconds with one decimal.
struct Millis(Duration);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1}ms", self.0.as_secs_f64() * 1e3)
    }
}

/// The process's metrics, and its `/metrics` endpoint when one is configured.
///
/// Recording methods take `&self` and may be called from any thread; the reactor calls them
/// in batches (see the module doc). All recorders in the process share one global registry,
/// so a second `Telemetry` (after a finalize and a new init) continues the same counters.
///
/// [`shutdown`](Telemetry::shutdown) (or drop) stops and joins the endpoint's thread: call
/// it from the last `finalize`, because NCCL may unload the library right after.
#[derive(Debug)]
pub struct Telemetry {
    exporter: Mutex<Option<Exporter>>,
    addr: Option<SocketAddr>,
}

impl Telemetry {
    /// Installs the recorder (once per process) and starts the endpoint when `cfg` enables
    /// one. The port is `cfg`'s base port plus the local rank, else `device_ordinal`, else 0.
    /// Never fails: a port in use or any bind error is one WARN, and the job carries on
    /// without an endpoint (metrics are still recorded and [`render`](Self::render)able).
    pub fn start(cfg: &ExporterConfig, device_ordinal: Option<u32>) -> Telemetry {
        Telemetry::start_with_nics(cfg, device_ordinal, &[])
    }

    /// [`start`](Self::start), after creating every series of [`METRICS`] (for each of
    /// `nics`, each direction and each [`FailReason`]) at its idle value: counters and
    /// histograms at 0, `railover_nic_up` and `railover_nic_info` at 1. The first scrape
    /// then holds every series a dashboard or alert reads, so panels show 0 rather than "No
    /// data" and `rate()`/`increase()` see the first failover.
    pub fn start_with_nics(
        cfg: &ExporterConfig,
        device_ordinal: Option<u32>,
        nics: &[(&str, Option<u32>)],
    ) -> Telemetry {
        let handle = handle();
        declare(nics);
        let exporter = match cfg.socket_addr(device_ordinal) {
            Ok(None) => None,
            Ok(Some(addr)) => match Exporter::start(addr, handle.clone()) {
                Ok(e) => {
                    tracing::info!("railover: metrics at http://{}/metrics", e.local_addr());
                    Some(e)
                }
                Err(e) => {
                    tracing::warn!(
                        "railover: metrics endpoint {addr} not started ({e}); the job carries on without it"
                    );
                    None
                }
            },
            Err(why) => {
                tracing::warn!("railover: metrics endpoint not started: {why}");
                None
            }
        };
        Telemetry {
            addr: exporter.as_ref().map(Exporter::local_addr),
            exporter: Mutex::new(exporter),
        }
    }

    /// Where the endpoint listens, if it runs.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// The exposition text a scrape would get now (works with the endpoint off too).
    pub fn render(&self) -> String {
        let h = handle();
        h.run_upkeep();
        h.render()
    }

    /// Stops the endpoint and joins its thread. Idempotent; recording still works after it.
    pub fn shutdown(&self) {
        if let Some(e) = self.exporter.lock().take() {
            e.shutdown();
        }
    }

    /// One NIC's state and traffic since its previous sample. Also creates the NIC's series
    /// at zero on the first call, so `rate()` has a start.
    pub fn record_nic(&self, s: &NicSample<'_>) {
        let nic = s.nic.to_owned();
        for (dir, bytes, msgs) in [
            (Direction::Tx, s.tx_bytes, s.tx_messages),
            (Direction::Rx, s.rx_bytes, s.rx_messages),
        ] {
            let labels = [("nic", nic.clone()), ("direction", dir.as_str().to_owned())];
            metrics::counter!(BYTES_TOTAL, &labels).increment(bytes);
            metrics::counter!(MESSAGES_TOTAL, &labels).increment(msgs);
        }
        metrics::counter!(PLACED_BYTES_TOTAL, "nic" => nic.clone()).increment(s.placed_bytes);
        metrics::gauge!(LANES, "nic" => nic.clone()).set(s.lanes as f64);
        metrics::gauge!(PACED_LANES, "nic" => nic.clone()).set(s.paced_lanes as f64);
        metrics::gauge!(NIC_UP, "nic" => nic.clone()).set(if s.up { 1.0 } else { 0.0 });
        metrics::gauge!(NIC_DRAINED, "nic" => nic.clone()).set(if s.drained { 1.0 } else { 0.0 });
        metrics::counter!(NIC_DOWN_SECONDS_TOTAL, "nic" => nic.clone()).increment(s.down_seconds);
        if let Some(c) = s.capacity {
            metrics::gauge!(NIC_CAPACITY, "nic" => nic.clone()).set(c as f64);
        }
        let rail = s.rail.map_or_else(|| "none".to_owned(), |r| r.to_string());
        metrics::gauge!(NIC_INFO, "nic" => nic, "rail" => rail).set(1.0);
    }

    /// A lane moved to a backup pair: counts it under its failed local NIC and reason, and
    /// records both durations. Log the same event with `tracing::warn!("{f}")`.
    pub fn record_failover(&self, f: &Failover<'_>) {
        metrics::counter!(
            FAILOVERS_TOTAL,
            "nic" => f.from.local.to_owned(),
            "reason" => f.reason.as_str()
        )
        .increment(1);
        metrics::histogram!(DETECTION_SECONDS).record(f.detection.as_secs_f64());
        metrics::histogram!(FAILOVER_SECONDS).record(f.resume.as_secs_f64());
    }

    /// A comm's stripes left a pair in a planned move (a drain) and settled elsewhere:
    /// counts it under the pair's local NIC.
    pub fn record_drain_move(&self, nic: &str) {
        metrics::counter!(DRAIN_MOVES_TOTAL, "nic" => nic.to_owned()).increment(1);
    }

    /// A comm's stripes moved on from a backup that carries less than it was weighed by
    /// (a rebalance) and settled: counts it under the backup's local NIC.
    pub fn record_rebalance_move(&self, nic: &str) {
        metrics::counter!(REBALANCE_MOVES_TOTAL, "nic" => nic.to_owned()).increment(1);
    }

    /// A lane moved back to its original pair: counts it under that pair's local NIC.
    pub fn record_failback(&self, f: &Failback<'_>) {
        metrics::counter!(FAILBACKS_TOTAL, "nic" => f.to.local.to_owned()).increment(1);
    }

    /// A comm's failover completed and the comm now runs over `pairs` distinct NIC pairs
    /// (local NIC, remote NIC), counting every lane of the comm, moved or not: observes
    /// [`COMM_SPREAD`]. Call it once per comm per failover, when the last of its moved
    /// lanes runs again (not per lane, and not on fail-back). 1 means the comm's failed
    /// share went whole onto one pair; N−1 on an N-NIC node, that it is striped over every
    /// survivor. 0 (nothing left to run on) is a give-up, counted by
    /// [`record_give_up`](Self::record_give_up), and is not observed here.
    pub fn record_comm_spread(&self, pairs: usize) {
        if pairs > 0 {
            metrics::histogram!(COMM_SPREAD).record(pairs as f64);
        }
    }

    /// A failed lane found no eligible backup pair (counts [`NO_ELIGIBLE_PAIR_TOTAL`]). Keep
    /// [`set_comms_without_backup`](Self::set_comms_without_backup) current as well.
    pub fn record_give_up(&self, _g: &GiveUp<'_>) {
        metrics::counter!(NO_ELIGIBLE_PAIR_TOTAL).increment(1);
    }

    /// `n` health probes from local NIC `nic` failed since the last call.
    pub fn record_probe_failures(&self, nic: &str, n: u64) {
        metrics::counter!(PROBE_FAILURES_TOTAL, "nic" => nic.to_owned()).increment(n);
    }

    /// Bytes replayed after failovers since the last call (sum of `conn::Stats::replayed_bytes`
    /// deltas).
    pub fn record_replayed(&self, bytes: u64) {
        metrics::counter!(REPLAYED_BYTES_TOTAL).increment(bytes);
    }

    /// Duplicate messages dropped by receivers since the last call (`conn::Stats::duplicates`).
    pub fn record_duplicates(&self, n: u64) {
        metrics::counter!(DUPLICATES_TOTAL).increment(n);
    }

    /// Comms that now have a stranded lane (`routing::LaneStatus::Stranded`).
    pub fn set_comms_without_backup(&self, n: u64) {
        metrics::gauge!(COMMS_WITHOUT_BACKUP).set(n as f64);
    }

    /// Whole seconds comms spent displaced since the last call, summed over them.
    pub fn record_comm_displaced(&self, secs: u64) {
        metrics::counter!(COMM_DISPLACED_SECONDS_TOTAL).increment(secs);
    }

    /// Comms displaced now.
    pub fn set_comms_displaced(&self, n: u64) {
        metrics::gauge!(COMMS_DISPLACED).set(n as f64);
    }

    /// Whether the process runs degraded now: a comm displaced or a local NIC down.
    pub fn set_degraded(&self, degraded: bool) {
        metrics::gauge!(DEGRADED).set(if degraded { 1.0 } else { 0.0 });
    }

    /// Fraction of the last interval the reactor worked; clamped to 0..=1, NaN ignored.
    pub fn record_reactor_busy(&self, ratio: f64) {
        if !ratio.is_nan() {
            metrics::gauge!(REACTOR_BUSY_RATIO).set(ratio.clamp(0.0, 1.0));
        }
    }

    /// Connections refused since the last call (`ReactorStats::rejected_connections` delta).
    pub fn record_rejected(&self, n: u64) {
        metrics::counter!(REJECTED_CONNECTIONS_TOTAL).increment(n);
    }

    /// Failed handshakes since the last call (`ReactorStats::refused_handshakes` delta).
    pub fn record_refused_handshakes(&self, n: u64) {
        metrics::counter!(HANDSHAKES_REFUSED_TOTAL).increment(n);
    }

    /// Connections in their handshake now.
    pub fn set_handshakes_pending(&self, n: u64) {
        metrics::gauge!(HANDSHAKES_PENDING).set(n as f64);
    }

    /// Lanes closed for protocol errors since the last call (`ReactorStats::protocol_errors`).
    pub fn record_protocol_errors(&self, n: u64) {
        metrics::counter!(PROTOCOL_ERRORS_TOTAL).increment(n);
    }

    /// Lanes lost to socket errors since the last call (`ReactorStats::lane_failures`).
    pub fn record_lane_failures(&self, n: u64) {
        metrics::counter!(LANE_FAILURES_TOTAL).increment(n);
    }

    /// Comms whose sends found no receive for their tags for too long, since the last call
    /// (`handoff::comm::UNMATCHED_SENDS`).
    pub fn record_unmatched_sends(&self, n: u64) {
        metrics::counter!(UNMATCHED_SENDS_TOTAL).increment(n);
    }

    /// A NIC excluded for a comm because it could not register the comm's memory.
    pub fn record_memory_exclusion(&self, nic: &str) {
        metrics::counter!(MEMORY_EXCLUSIONS_TOTAL, "nic" => nic.to_string()).increment(1);
    }

    /// Comms given up since the last call (`ReactorStats::gave_up`).
    pub fn record_comms_given_up(&self, n: u64) {
        metrics::counter!(COMMS_GIVEN_UP_TOTAL).increment(n);
    }

    /// Carrier changes since the last call (`ReactorStats::link_events`).
    pub fn record_link_events(&self, n: u64) {
        metrics::counter!(LINK_EVENTS_TOTAL).increment(n);
    }

    /// The process's registrations of NCCL memory so far: a process-wide total, not a
    /// delta. The counter keeps the largest total it was given, so every reactor of the
    /// process (one after each finalize and init) may report it without counting twice.
    pub fn set_memory_registrations(&self, total: u64) {
        metrics::counter!(MEMORY_REGISTRATIONS_TOTAL).absolute(total);
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Creates every series of [`METRICS`] at its idle value (see
/// [`Telemetry::start_with_nics`]). Counters only ever add 0 here, so declaring again after
/// a finalize and a new init keeps their totals.
fn declare(nics: &[(&str, Option<u32>)]) {
    let rail_of = |nic: &str| {
        nics.iter()
            .find(|(n, _)| *n == nic)
            .and_then(|(_, r)| *r)
            .map_or_else(|| "none".to_owned(), |r| r.to_string())
    };
    'metrics: for m in METRICS {
        // Every combination of the metric's label values: bounded by the NIC count, the
        // two directions and the failure reasons.
        let mut sets: Vec<Vec<(&'static str, String)>> = vec![Vec::new()];
        for &label in m.labels {
            let values = |set: &Vec<(&'static str, String)>| -> Vec<String> {
                match label {
                    "nic" => nics.iter().map(|(n, _)| (*n).to_owned()).collect(),
                    // The rail of the set's NIC (`nic` comes before `rail`).
                    "rail" => set
                        .iter()
                        .filter(|(k, _)| *k == "nic")
                        .map(|(_, n)| rail_of(n))
                        .collect(),
                    "direction" => [Direction::Tx, Direction::Rx]
                        .map(|d| d.as_str().to_owned())
                        .to_vec(),
                    "reason" => FailReason::ALL.map(|r| r.as_str().to_owned()).to_vec(),
                    _ => Vec::new(),
                }
            };
            if !["nic", "rail", "direction", "reason"].contains(&label) {
                // A label this function does not know: better no early series than a
                // series without it.
                continue 'metrics;
            }
            sets = sets
                .iter()
                .flat_map(|set| {
                    values(set).into_iter().map(move |v| {
                        let mut set = set.clone();
                        set.push((label, v));
                        set
                    })
                })
                .collect();
        }
        for set in sets {
            let labels: Vec<metrics::Label> = set
                .into_iter()
                .map(|(k, v)| metrics::Label::new(k, v))
                .collect();
            match m.kind {
                MetricKind::Counter => metrics::counter!(m.name, labels).increment(0),
                // Registering is enough: an empty histogram renders with zero counts.
                MetricKind::Histogram => drop(metrics::histogram!(m.name, labels)),
                MetricKind::Gauge => {
                    // A NIC counts as up until the reactor hears otherwise, as it does.
                    let idle = if m.name == NIC_UP || m.name == NIC_INFO {
                        1.0
                    } else {
                        0.0
                    };
                    metrics::gauge!(m.name, labels).set(idle);
                }
            }
        }
    }
}

/// The process-wide recorder's handle; the first call builds the recorder, installs it as
/// this library's global `metrics` recorder (the cdylib carries its own copy of `metrics`,
/// so the host's recorder is untouched) and describes every metric.
fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let mut builder = PrometheusBuilder::new();
        for m in METRICS {
            if let Some(buckets) = m.buckets() {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full(m.name.to_owned()), buckets)
                    // Only an empty bucket list is refused, and neither list is empty.
                    .expect("non-empty buckets");
            }
        }
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "railover: a metrics recorder was already installed; railover_* metrics go there"
            );
        }
        for m in METRICS {
            match m.kind {
                MetricKind::Counter => metrics::describe_counter!(m.name, m.help),
                MetricKind::Gauge => metrics::describe_gauge!(m.name, m.help),
                MetricKind::Histogram => metrics::describe_histogram!(m.name, m.help),
            }
        }
        handle
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair<'a>(local: &'a str, remote: &'a str) -> NicPair<'a> {
        NicPair { local, remote }
    }

    #[test]
    fn failover_line_names_comm_pairs_reason_and_times() {
        let f = Failover {
            comm: 7,
            from: pair("eth0", "10.0.0.2/eth0"),
            to: pair("eth1", "10.0.0.2/eth1"),
            reason: FailReason::Timeout,
            detection: Duration::from_millis(1000),
            resume: Duration::from_micros(3250),
        };
        assert_eq!(
            f.to_string(),
            "railover: failover comm=7 eth0->10.0.0.2/eth0 => eth1->10.0.0.2/eth1 reason=timeout detect=1000.0ms resume=3.2ms"
        );
    }

    #[test]
    fn failback_line_names_both_pairs_and_time_away() {
        let f = Failback {
            comm: 3,
            from: pair("mlx5_1", "peer/mlx5_1"),
            to: pair("mlx5_0", "peer/mlx5_0"),
            away: Duration::from_millis(12_480),
        };
        assert_eq!(
            f.to_string(),
            "railover: failback comm=3 mlx5_1->peer/mlx5_1 => mlx5_0->peer/mlx5_0 away=12.5s"
        );
    }

    #[test]
    fn give_up_line_says_why_and_what_happens() {
        let mut g = GiveUp {
            comm: 9,
            failed: pair("eth0", "h2/eth0"),
            reason: FailReason::LinkDown,
            candidates: 1,
        };
        assert_eq!(
            g.to_string(),
            "railover: giving up comm=9 eth0->h2/eth0 reason=link_down: no eligible backup pair among 1 candidate; the comm's requests fail"
        );
        g.candidates = 0;
        assert!(g.to_string().contains("among 0 candidates;"));
    }

    #[test]
    fn names_are_unique_prefixed_and_suffixed_by_type() {
        for (i, m) in METRICS.iter().enumerate() {
            assert!(m.name.starts_with("railover_"), "{}", m.name);
            assert!(
                m.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{}",
                m.name
            );
            assert_eq!(
                m.kind == MetricKind::Counter,
                m.name.ends_with("_total"),
                "{}: counters, and only counters, end in _total",
                m.name
            );
            assert!(
                METRICS[i + 1..].iter().all(|o| o.name != m.name),
                "{} twice",
                m.name
            );
            for l in m.labels {
                assert!(["nic", "rail", "direction", "reason"].contains(l), "{l}");
            }
        }
    }

    #[test]
    fn delta_counts_increases_and_survives_a_restart() {
        let mut d = Delta::default();
        assert_eq!(d.take(10), 10);
        assert_eq!(d.take(10), 0);
        assert_eq!(d.take(15), 5);
        assert_eq!(d.take(3), 3, "a restarted counter's whole value is new");
        assert_eq!(d.take(4), 1);
    }

    #[test]
    fn comms_without_backup_counts_comms_with_a_stranded_lane() {
        use crate::routing::{CommId, CommRoutes, LaneId, LaneRoute, NicId, Pair, PeerId};
        let pair = Pair {
            local: NicId(0),
            peer: PeerId(0),
            remote: NicId(0),
        };
        let lane = |i, status| LaneRoute {
            lane: LaneId(i),
            original: pair,
            current: pair,
            status,
        };
        let comm = |id, lanes| CommRoutes {
            comm: CommId(id),
            peer: PeerId(0),
            lanes,
        };
        let routes = Routes {
            comms: vec![
                comm(
                    0,
                    vec![lane(0, LaneStatus::Active), lane(1, LaneStatus::Stranded)],
                ),
                comm(1, vec![lane(0, LaneStatus::Moving)]),
                comm(
                    2,
                    vec![lane(0, LaneStatus::Stranded), lane(1, LaneStatus::Stranded)],
                ),
            ],
            ..Default::default()
        };
        assert_eq!(comms_without_backup(&routes), 2);
        assert_eq!(comms_without_backup(&Routes::default()), 0);
    }

    #[test]
    fn comm_pairs_counts_distinct_pairs_of_running_lanes() {
        use crate::routing::{CommId, LaneId, LaneRoute, NicId, PeerId};
        let pair = |l, r| Pair {
            local: NicId(l),
            peer: PeerId(1),
            remote: NicId(r),
        };
        let lane = |i, current, status| LaneRoute {
            lane: LaneId(i),
            original: pair(0, 0),
            current,
            status,
        };
        // NIC 0 failed; its four lanes went to pairs 1, 2, 3 and 1 again; one more waits.
        let mut comm = CommRoutes {
            comm: CommId(4),
            peer: PeerId(1),
            lanes: vec![
                lane(0, pair(1, 1), LaneStatus::Active),
                lane(1, pair(2, 2), LaneStatus::Active),
                lane(2, pair(3, 3), LaneStatus::Active),
                lane(3, pair(1, 1), LaneStatus::Active),
                lane(4, pair(0, 0), LaneStatus::Moving),
            ],
        };
        assert_eq!(comm_pairs(&comm), 3);
        // Same local NIC, another remote NIC: another pair.
        comm.lanes[4] = lane(4, pair(1, 2), LaneStatus::Active);
        assert_eq!(comm_pairs(&comm), 4);
        for l in &mut comm.lanes {
            l.status = LaneStatus::Stranded;
        }
        assert_eq!(comm_pairs(&comm), 0);
    }

    #[test]
    fn only_histograms_have_buckets_and_spread_counts_pairs() {
        for m in METRICS {
            let b = m.buckets();
            assert_eq!(b.is_some(), m.kind == MetricKind::Histogram, "{}", m.name);
            if let Some(b) = b {
                assert!(b.windows(2).all(|w| w[0] < w[1]), "{}", m.name);
            }
        }
        assert_eq!(spec(COMM_SPREAD).unwrap().buckets(), Some(SPREAD_BUCKETS));
        assert_eq!(
            spec(FAILOVER_SECONDS).unwrap().buckets(),
            Some(DURATION_BUCKETS)
        );
    }

    #[test]
    fn telemetry_is_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Telemetry>();
    }

    #[test]
    fn histogram_series_resolve_to_their_spec() {
        assert_eq!(
            spec("railover_failover_seconds_bucket").unwrap().name,
            FAILOVER_SECONDS
        );
        assert_eq!(
            spec("railover_detection_seconds_count").unwrap().name,
            DETECTION_SECONDS
        );
        assert!(spec("railover_bytes_total_sum").is_none());
        assert!(spec("railover_nope").is_none());
    }

    #[test]
    fn every_nic_and_reason_series_exists_before_anything_happens() {
        let t = Telemetry::start_with_nics(
            &ExporterConfig::off(),
            None,
            &[("unit_decl0", Some(3)), ("unit_decl1", None)],
        );
        let text = t.render();
        let mut want = vec![
            r#"railover_nic_info{nic="unit_decl0",rail="3"} 1"#.to_owned(),
            r#"railover_nic_info{nic="unit_decl1",rail="none"} 1"#.to_owned(),
            r#"railover_nic_up{nic="unit_decl1"} 1"#.to_owned(),
            r#"railover_lanes{nic="unit_decl1"} 0"#.to_owned(),
            r#"railover_failbacks_total{nic="unit_decl0"} 0"#.to_owned(),
            r#"railover_probe_failures_total{nic="unit_decl1"} 0"#.to_owned(),
            r#"railover_messages_total{nic="unit_decl0",direction="rx"} 0"#.to_owned(),
            r#"railover_placed_bytes_total{nic="unit_decl1"} 0"#.to_owned(),
            r#"railover_nic_down_seconds_total{nic="unit_decl0"} 0"#.to_owned(),
        ];
        for r in FailReason::ALL {
            want.push(format!(
                r#"railover_failovers_total{{nic="unit_decl1",reason="{}"}} 0"#,
                r.as_str()
            ));
        }
        for line in &want {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.contains("railover_detection_seconds_count "), "{text}");
        assert!(text.contains("railover_no_eligible_pair_total "), "{text}");
        for name in [
            UNMATCHED_SENDS_TOTAL,
            COMMS_GIVEN_UP_TOTAL,
            LINK_EVENTS_TOTAL,
            MEMORY_REGISTRATIONS_TOTAL,
            COMM_DISPLACED_SECONDS_TOTAL,
            COMMS_DISPLACED,
            DEGRADED,
        ] {
            assert!(text.contains(&format!("\n{name} ")), "no {name} in\n{text}");
        }
    }

    #[test]
    fn memory_registrations_keep_the_largest_process_total() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let value = || -> u64 {
            let text = t.render();
            let series = format!("{MEMORY_REGISTRATIONS_TOTAL} ");
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .unwrap_or_else(|| panic!("no {series}in\n{text}"))
                .parse()
                .unwrap()
        };
        t.set_memory_registrations(0);
        // Far above what any reactor of this test binary registers for real.
        let base = value() + (1 << 40);
        t.set_memory_registrations(base + 3);
        assert_eq!(value(), base + 3);
        t.set_memory_registrations(base + 3);
        assert_eq!(value(), base + 3, "the same total again adds nothing");
        t.set_memory_registrations(base + 1);
        assert_eq!(
            value(),
            base + 3,
            "a reactor that sampled earlier lowers nothing"
        );
        t.set_memory_registrations(base + 5);
        assert_eq!(value(), base + 5);
    }

    #[test]
    fn recorded_values_render_with_their_labels() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        assert_eq!(t.local_addr(), None);
        t.record_nic(&NicSample {
            nic: "unit_nic0",
            rail: Some(2),
            up: true,
            lanes: 3,
            paced_lanes: 2,
            tx_bytes: 4096,
            rx_bytes: 1024,
            tx_messages: 2,
            rx_messages: 1,
            placed_bytes: 3072,
            down_seconds: 7,
            drained: false,
            capacity: Some(25_000_000),
        });
        t.record_failover(&Failover {
            comm: 1,
            from: pair("unit_nic0", "r/unit_nic0"),
            to: pair("unit_nic1", "r/unit_nic1"),
            reason: FailReason::NicError,
            detection: Duration::from_millis(2),
            resume: Duration::from_millis(4),
        });
        let text = t.render();
        for line in [
            r#"railover_bytes_total{nic="unit_nic0",direction="tx"} 4096"#,
            r#"railover_bytes_total{nic="unit_nic0",direction="rx"} 1024"#,
            r#"railover_messages_total{nic="unit_nic0",direction="tx"} 2"#,
            r#"railover_placed_bytes_total{nic="unit_nic0"} 3072"#,
            r#"railover_lanes{nic="unit_nic0"} 3"#,
            r#"railover_paced_lanes{nic="unit_nic0"} 2"#,
            r#"railover_nic_up{nic="unit_nic0"} 1"#,
            r#"railover_nic_info{nic="unit_nic0",rail="2"} 1"#,
            r#"railover_nic_down_seconds_total{nic="unit_nic0"} 7"#,
            r#"railover_nic_capacity_bytes_per_second{nic="unit_nic0"} 25000000"#,
            r#"railover_failovers_total{nic="unit_nic0",reason="nic_error"} 1"#,
            "# TYPE railover_failover_seconds histogram",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            text.contains(r#"railover_failover_seconds_bucket{le="0.005"}"#),
            "{text}"
        );
    }

    #[test]
    fn comm_spread_renders_on_pair_buckets() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        // Other tests of this binary share the registry: compare before and after.
        let bucket = |text: &str, le: &str| -> f64 {
            let series = format!("railover_comm_spread_bucket{{le=\"{le}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .unwrap_or_else(|| panic!("no {series}in\n{text}"))
                .parse()
                .unwrap()
        };
        // The simulation's reactors, in this binary too, record spreads of their own: take
        // a round that no other test's recording interleaved with (+Inf grew by exactly 3).
        let (before, after) = (0..50)
            .map(|_| {
                let before = t.render();
                for pairs in [1, 3, 7, 0] {
                    t.record_comm_spread(pairs);
                }
                (before, t.render())
            })
            .find(|(b, a)| bucket(a, "+Inf") - bucket(b, "+Inf") == 3.0)
            .expect("a round without another test's spreads");
        assert!(
            after.contains("# TYPE railover_comm_spread histogram"),
            "{after}"
        );
        for (le, added) in [
            ("1", 1.0),
            ("2", 1.0),
            ("3", 2.0),
            ("6", 2.0),
            ("8", 3.0),
            ("+Inf", 3.0),
        ] {
            assert_eq!(bucket(&after, le) - bucket(&before, le), added, "le={le}");
        }
        assert!(!after.contains(r#"railover_comm_spread_bucket{le="0.005"}"#));
    }
}
