//! `railover sim`: what one NIC failure costs an all-reduce, by a simple model.
//!
//! # The model
//! P nodes, N NICs per node, each NIC at rate r (bytes/s), so a node's network bandwidth is
//! B = N·r. An all-reduce of S bytes takes, per NCCL's usual cost model:
//!
//! * ring: `2(P−1)/P · S/B · f + 2(P−1)·α`
//! * tree (double binary tree, pipelined; wins for small messages through its log-depth
//!   latency): `2 · S/B · f + 2⌈log2 P⌉·α`
//!
//! where α is the per-step latency and `f` the load factor of the busiest NIC relative to
//! its healthy share S/N. The algorithm is the one faster in the healthy state: NCCL tunes
//! once at start-up and does not re-tune after a failure. The three states differ only in f:
//!
//! * healthy: f = 1, every NIC carries 1/N of the data;
//! * NCCL native failover: the failed member's whole share moves to one survivor, which
//!   carries 2/N: f = 2;
//! * railover spread: the share is split over the N−1 survivors, each carrying 1/(N−1):
//!   f = N/(N−1).
//!
//! With N = 1 there is no survivor: the job fails in both failure states.
//!
//! # Lockstep: what a collective keeps (`--lockstep`)
//! C comms over N NICs (comm c on NIC c mod N), every comm moving equal shares in
//! lockstep, so each runs at r / (the most comms any NIC carries). When NIC 0 fails its
//! comms move, and the kept rate is healthy busiest load / busiest load after:
//!
//! * whole-comm moves (railover before striping): each comm of the failed NIC moves
//!   whole onto the least loaded survivor; with one comm per NIC a survivor carries two
//!   and the collective keeps 1/2, as NCCL's native failover;
//! * striped (railover's promise, P3): the failed NIC's share is split evenly over the
//!   survivors; with C a multiple of N the collective keeps (N−1)/N.
//!
//! # Assumptions
//! The network is the bottleneck (not PCIe, NVLink or the GPU reduction); links are
//! full-duplex and uncongested; all NICs run at the same rate; one NIC of one node fails,
//! and since every collective step waits for the slowest node, that node's busiest NIC sets
//! the pace for everyone; α is the same on every path; failure detection and migration time
//! are not counted (this is the steady state after failover).

use std::fmt::Write as _;

use serde::Serialize;

/// The inputs of the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// NICs per node (N ≥ 1).
    pub nics: u32,
    /// Nodes (P ≥ 2).
    pub nodes: u32,
    /// Message size S, bytes.
    pub bytes: f64,
    /// Rate of one NIC, Gb/s.
    pub nic_gbps: f64,
    /// Per-step latency α, seconds.
    pub latency_s: f64,
}

/// The three states the model compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Healthy,
    NativeFailover,
    Spread,
}

impl State {
    pub const ALL: [State; 3] = [State::Healthy, State::NativeFailover, State::Spread];

    fn label(self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::NativeFailover => "NCCL native failover",
            State::Spread => "railover spread",
        }
    }

    /// The busiest NIC's load relative to its healthy share; `None` when no NIC survives.
    pub fn load_factor(self, nics: u32) -> Option<f64> {
        let n = f64::from(nics);
        match self {
            State::Healthy => Some(1.0),
            _ if nics < 2 => None,
            State::NativeFailover => Some(2.0),
            State::Spread => Some(n / (n - 1.0)),
        }
    }
}

/// The all-reduce algorithm the model picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Ring,
    Tree,
}

impl Algorithm {
    fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
        }
    }
}

impl Params {
    fn node_bytes_per_s(&self) -> f64 {
        f64::from(self.nics) * self.nic_gbps * 1e9 / 8.0
    }

    /// Ring all-reduce time with load factor `f`, seconds.
    pub fn ring_time(&self, f: f64) -> f64 {
        let p = f64::from(self.nodes);
        2.0 * (p - 1.0) / p * self.bytes / self.node_bytes_per_s() * f
            + 2.0 * (p - 1.0) * self.latency_s
    }

    /// Tree all-reduce time with load factor `f`, seconds.
    pub fn tree_time(&self, f: f64) -> f64 {
        let depth = f64::from(self.nodes).log2().ceil();
        2.0 * self.bytes / self.node_bytes_per_s() * f + 2.0 * depth * self.latency_s
    }

    /// The algorithm faster in the healthy state.
    pub fn algorithm(&self) -> Algorithm {
        if self.tree_time(1.0) < self.ring_time(1.0) {
            Algorithm::Tree
        } else {
            Algorithm::Ring
        }
    }

    /// Predicted time in `state`, seconds; `None` when the job cannot survive it.
    pub fn time(&self, state: State) -> Option<f64> {
        let f = state.load_factor(self.nics)?;
        Some(match self.algorithm() {
            Algorithm::Ring => self.ring_time(f),
            Algorithm::Tree => self.tree_time(f),
        })
    }

    /// `time(state) / time(Healthy)`.
    pub fn slowdown(&self, state: State) -> Option<f64> {
        Some(self.time(state)? / self.time(State::Healthy)?)
    }
}

/// How a failed NIC's comms are placed on the survivors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Each comm moves whole onto the least loaded survivor.
    Whole,
    /// The failed NIC's load is split evenly over every survivor.
    Striped,
}

/// What a lockstep collective over `comms` comms on `nics` NICs keeps of its rate when
/// NIC 0 fails; `None` when no NIC survives or there are no comms.
pub fn lockstep_kept(nics: u32, comms: u32, placement: Placement) -> Option<f64> {
    if nics < 2 || comms == 0 {
        return None;
    }
    let n = nics as usize;
    let mut load = vec![0.0f64; n];
    for c in 0..comms as usize {
        load[c % n] += 1.0;
    }
    let healthy = load.iter().copied().fold(0.0, f64::max);
    let moved = load[0];
    let mut after = load[1..].to_vec();
    match placement {
        Placement::Whole => {
            for _ in 0..moved as usize {
                let least = (0..after.len())
                    .min_by(|&a, &b| after[a].total_cmp(&after[b]))
                    .expect("a survivor");
                after[least] += 1.0;
            }
        }
        Placement::Striped => after.iter_mut().for_each(|l| *l += moved / (n - 1) as f64),
    }
    Some(healthy / after.iter().copied().fold(0.0, f64::max))
}

/// One row of `railover sim --lockstep`.
#[derive(Debug, Clone, Serialize)]
pub struct KeptRow {
    pub nics: u32,
    pub comms: u32,
    /// NCCL's native failover: the failed NIC's share onto one survivor.
    pub native: f64,
    pub whole: Option<f64>,
    pub striped: Option<f64>,
    /// (N−1)/N.
    pub ideal: f64,
}

/// The lockstep table: N = 2, 4, 8 with C = N and C = 2N.
pub fn kept_table() -> Vec<KeptRow> {
    [2u32, 4, 8]
        .iter()
        .flat_map(|&n| [n, 2 * n].map(|c| (n, c)))
        .map(|(nics, comms)| KeptRow {
            nics,
            comms,
            native: 0.5,
            whole: lockstep_kept(nics, comms, Placement::Whole),
            striped: lockstep_kept(nics, comms, Placement::Striped),
            ideal: (f64::from(nics) - 1.0) / f64::from(nics),
        })
        .collect()
}

fn render_kept(rows: &[KeptRow]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "lockstep collective after one of N NICs fails: share of its rate kept\n\
         (C comms, comm c on NIC c mod N, equal messages, each comm at link rate / the most\n\
         comms one NIC carries; detection and migration time excluded)\n"
    );
    let _ = writeln!(
        o,
        "{:>3} {:>3}  {:>12}  {:>24}  {:>14}  {:>7}",
        "N", "C", "NCCL native", "whole-comm moves (today)", "striped (P3)", "(N-1)/N"
    );
    let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.3}"));
    for r in rows {
        let _ = writeln!(
            o,
            "{:>3} {:>3}  {:>12.3}  {:>24}  {:>14}  {:>7.3}",
            r.nics,
            r.comms,
            r.native,
            f(r.whole),
            f(r.striped),
            r.ideal
        );
    }
    o
}

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// NICs per node, at least 1
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = count_from(1))]
    pub nics: u32,
    /// Nodes, at least 2
    #[arg(long, value_name = "P", default_value_t = 16, value_parser = count_from(2))]
    pub nodes: u32,
    /// All-reduce message size: bytes, or K, M, G, T (powers of 1024, also KiB …) or KB,
    /// MB, GB, TB (powers of 1000)
    #[arg(long, value_name = "BYTES", default_value = "1G", value_parser = message_size)]
    pub size: u64,
    /// Rate of one NIC in Gb/s, above 0
    #[arg(long, value_name = "GBPS", default_value_t = 400.0, value_parser = rate, allow_negative_numbers = true)]
    pub rate: f64,
    /// Per-step latency in microseconds, 0 or more
    #[arg(long, value_name = "US", default_value_t = 5.0, value_parser = latency_us, allow_negative_numbers = true)]
    pub latency_us: f64,
    /// Print the table as JSON
    #[arg(long)]
    pub json: bool,
    /// Instead: the share of its rate a lockstep collective keeps after one NIC fails,
    /// for N = 2, 4, 8 and C = N, 2N, with whole-comm moves and striped
    #[arg(long)]
    pub lockstep: bool,
    /// With --lockstep: NICs at these rates (Mbit/s, comma-separated; NIC 0 fails), the
    /// failed NIC's stripes placed by railover's router weighted by capacity and equally,
    /// beside the capacity-optimal share
    #[arg(long, value_name = "MBIT,MBIT,...", requires = "lockstep", value_parser = crate::weighted::parse_speeds)]
    pub speeds: Option<crate::weighted::Speeds>,
    /// With --speeds: only this many comms (default: N and 2N)
    #[arg(long, value_name = "C", requires = "speeds", value_parser = count_from(1))]
    pub comms: Option<u32>,
}

impl Args {
    pub fn params(&self) -> Params {
        Params {
            nics: self.nics,
            nodes: self.nodes,
            bytes: self.size as f64,
            nic_gbps: self.rate,
            latency_s: self.latency_us / 1e6,
        }
    }
}

fn count_from(lo: u32) -> impl Fn(&str) -> Result<u32, String> + Clone {
    move |v| match v.parse::<u32>() {
        Ok(n) if n >= lo => Ok(n),
        _ => Err(format!("expected an integer from {lo}")),
    }
}

fn message_size(v: &str) -> Result<u64, String> {
    crate::size::parse_within(v, 1, u64::MAX)
}

fn rate(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|r| r.is_finite() && *r > 0.0)
        .ok_or_else(|| "expected Gb/s above 0".into())
}

fn latency_us(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|l| l.is_finite() && *l >= 0.0)
        .ok_or_else(|| "expected microseconds, 0 or more".into())
}

/// Runs `railover sim`; returns the exit code (0: usage errors end in clap).
pub fn run(a: &Args) -> i32 {
    let p = a.params();
    if let Some(speeds) = &a.speeds {
        let rows = crate::weighted::table(&speeds.0, a.comms);
        if a.json {
            emit(&(serde_json::to_string_pretty(&rows).expect("plain data") + "\n"));
        } else {
            emit(&crate::weighted::render(&rows));
        }
        return 0;
    }
    if a.lockstep {
        let rows = kept_table();
        if a.json {
            emit(&(serde_json::to_string_pretty(&rows).expect("plain data") + "\n"));
        } else {
            emit(&render_kept(&rows));
        }
        return 0;
    }
    if a.json {
        match serde_json::to_string_pretty(&Report::of(&p)) {
            Ok(s) => emit(&format!("{s}\n")),
            Err(e) => {
                eprintln!("railover sim: cannot encode JSON: {e}");
                return 1;
            }
        }
    } else {
        emit(&render(&p));
    }
    0
}

/// Writes to stdout; a closed pipe (`railover sim | head`) is not an error worth a panic.
fn emit(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// The table of `render`, for `--json`.
#[derive(Debug, Serialize)]
struct Report {
    nics: u32,
    nodes: u32,
    bytes: f64,
    nic_gbps: f64,
    latency_us: f64,
    algorithm: &'static str,
    healthy_ring_s: f64,
    healthy_tree_s: f64,
    states: Vec<Row>,
}

/// One state; the figures are `null` when no NIC survives (the job fails).
#[derive(Debug, Serialize)]
struct Row {
    state: &'static str,
    time_s: Option<f64>,
    slowdown: Option<f64>,
    /// Share of the node's traffic the busiest NIC carries.
    busiest_nic_share: Option<f64>,
}

impl Report {
    fn of(p: &Params) -> Report {
        Report {
            nics: p.nics,
            nodes: p.nodes,
            bytes: p.bytes,
            nic_gbps: p.nic_gbps,
            latency_us: p.latency_s * 1e6,
            algorithm: p.algorithm().name(),
            healthy_ring_s: p.ring_time(1.0),
            healthy_tree_s: p.tree_time(1.0),
            states: State::ALL
                .iter()
                .map(|&s| Row {
                    state: s.label(),
                    time_s: p.time(s),
                    slowdown: p.slowdown(s),
                    busiest_nic_share: s.load_factor(p.nics).map(|f| f / f64::from(p.nics)),
                })
                .collect(),
        }
    }
}

fn render(p: &Params) -> String {
    let mut o = String::new();
    let algo = p.algorithm().name();
    let _ = writeln!(
        o,
        "all-reduce of {} over {} nodes x {} NICs at {} Gb/s per NIC, per-step latency {} us",
        crate::size::format(p.bytes as u64),
        p.nodes,
        p.nics,
        p.nic_gbps,
        p.latency_s * 1e6
    );
    let _ = writeln!(
        o,
        "algorithm: {algo} (healthy: ring {}, tree {})\n",
        fmt_time(p.ring_time(1.0)),
        fmt_time(p.tree_time(1.0))
    );
    let _ = writeln!(
        o,
        "{:<22} {:>12} {:>10}  busiest NIC carries",
        "state", "time", "slowdown"
    );
    for s in State::ALL {
        match (p.time(s), p.slowdown(s), s.load_factor(p.nics)) {
            (Some(t), Some(x), Some(f)) => {
                let _ = writeln!(
                    o,
                    "{:<22} {:>12} {:>9.3}x  {:.3} of the node's traffic",
                    s.label(),
                    fmt_time(t),
                    x,
                    f / f64::from(p.nics)
                );
            }
            _ => {
                let _ = writeln!(
                    o,
                    "{:<22} {:>12} {:>10}  no surviving NIC: the job fails",
                    s.label(),
                    "-",
                    "-"
                );
            }
        }
    }
    let _ = writeln!(
        o,
        "\nmodel: ring 2(P-1)/P*S/B*f + 2(P-1)*a, tree 2*S/B*f + 2*ceil(log2 P)*a, B = N x rate,\n\
         f = busiest NIC's load / healthy share (healthy 1, native 2, spread N/(N-1)); the\n\
         algorithm is fixed by the healthy state. Assumes the network is the bottleneck, equal\n\
         uncongested full-duplex NICs, one failed NIC on one node pacing every step, and\n\
         excludes detection and migration time."
    );
    o
}

fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.2} us", s * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-12), "{a} != {b}");
    }

    /// N=4, P=4, S=1e9 B, 100 Gb/s, α=5 µs. B = 4 × 12.5e9 = 5e10 B/s.
    /// ring: 1.5 × 1e9/5e10 = 0.03 s, + 6α = 30 µs → 0.03003 s.
    /// tree: 2 × 0.02 = 0.04 s + 4α → 0.04002 s. Ring wins.
    #[test]
    fn large_message_ring_by_hand() {
        let p = Params {
            nics: 4,
            nodes: 4,
            bytes: 1e9,
            nic_gbps: 100.0,
            latency_s: 5e-6,
        };
        assert_eq!(p.algorithm(), Algorithm::Ring);
        close(p.time(State::Healthy).unwrap(), 0.03003);
        close(p.tree_time(1.0), 0.04002);
        close(p.time(State::NativeFailover).unwrap(), 0.06003);
        close(p.time(State::Spread).unwrap(), 0.04003);
        close(
            p.slowdown(State::NativeFailover).unwrap(),
            0.06003 / 0.03003,
        );
        close(p.slowdown(State::Spread).unwrap(), 0.04003 / 0.03003);
    }

    /// N=8, P=16, S=8192 B, 400 Gb/s, α=5 µs. B = 4e11 B/s.
    /// ring: 1.875 × 2.048e-8 + 30α = 1.500384e-4 s; tree: 4.096e-8 + 8α = 4.004096e-5 s.
    #[test]
    fn small_message_tree_by_hand() {
        let p = Params {
            nics: 8,
            nodes: 16,
            bytes: 8192.0,
            nic_gbps: 400.0,
            latency_s: 5e-6,
        };
        close(p.ring_time(1.0), 1.500384e-4);
        assert_eq!(p.algorithm(), Algorithm::Tree);
        close(p.time(State::Healthy).unwrap(), 4.004096e-5);
        close(p.time(State::NativeFailover).unwrap(), 4.008192e-5);
        close(p.time(State::Spread).unwrap(), 4.096e-8 * 8.0 / 7.0 + 4e-5);
    }

    /// With no latency the slowdowns are exactly the load factors: 2 and N/(N−1).
    #[test]
    fn bandwidth_bound_slowdowns_are_the_load_factors() {
        let p = Params {
            nics: 8,
            nodes: 2,
            bytes: 1e9,
            nic_gbps: 400.0,
            latency_s: 0.0,
        };
        close(p.slowdown(State::NativeFailover).unwrap(), 2.0);
        close(p.slowdown(State::Spread).unwrap(), 8.0 / 7.0);
        // P=2 ring: 2 × 1/2 × 1e9 / 4e11 = 2.5 ms.
        close(p.time(State::Healthy).unwrap(), 2.5e-3);
    }

    #[test]
    fn a_single_nic_has_no_survivor() {
        let p = Params {
            nics: 1,
            nodes: 2,
            bytes: 1e6,
            nic_gbps: 100.0,
            latency_s: 5e-6,
        };
        assert!(p.time(State::Healthy).is_some());
        assert_eq!(p.time(State::NativeFailover), None);
        assert_eq!(p.time(State::Spread), None);
        assert!(render(&p).contains("the job fails"));
    }

    #[test]
    fn lockstep_kept_by_hand() {
        use Placement::*;
        // One comm per NIC: the moved comm doubles one survivor's load.
        for n in [2, 4, 8] {
            close(lockstep_kept(n, n, Whole).unwrap(), 0.5);
            close(
                lockstep_kept(n, n, Striped).unwrap(),
                (f64::from(n) - 1.0) / f64::from(n),
            );
        }
        // Two per NIC, N = 4: NIC 0's two comms go to two survivors (3, 3, 2): 2/3.
        close(lockstep_kept(4, 8, Whole).unwrap(), 2.0 / 3.0);
        // N = 2: both onto the one survivor (4): 1/2, striped or not.
        close(lockstep_kept(2, 4, Whole).unwrap(), 0.5);
        close(lockstep_kept(2, 4, Striped).unwrap(), 0.5);
        // Uneven: 5 comms on 4 NICs (2, 1, 1, 1); NIC 0's two go to two survivors (2, 2,
        // 1): the busiest stays at 2.
        close(lockstep_kept(4, 5, Whole).unwrap(), 1.0);
        assert_eq!(lockstep_kept(1, 4, Whole), None);
        assert_eq!(lockstep_kept(4, 0, Striped), None);
        let t = kept_table();
        assert_eq!(t.len(), 6);
        assert_eq!((t[3].nics, t[3].comms), (4, 8));
        assert!(render_kept(&t).contains("whole-comm moves"));
    }

    fn parse_args(argv: &[&str]) -> Result<Args, String> {
        let argv = ["railover", "sim"].iter().chain(argv);
        match crate::Cli::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .command
        {
            crate::Command::Sim(a) => Ok(a),
            c => panic!("parsed as {c:?}"),
        }
    }

    #[test]
    fn defaults_sizes_and_argument_errors() {
        let p = parse_args(&[]).unwrap().params();
        assert_eq!((p.nics, p.nodes, p.bytes), (8, 16, (1u64 << 30) as f64));
        assert_eq!((p.nic_gbps, p.latency_s), (400.0, 5e-6));
        let e = parse_args(&["--nodes", "1"]).unwrap_err();
        assert!(
            e.contains("--nodes") && e.contains("'1'") && e.contains("from 2"),
            "{e}"
        );
        for (flag, bad) in [
            ("--size", "0"),
            ("--size", "1X"),
            ("--rate", "0"),
            ("--rate", "inf"),
            ("--latency-us", "-1"),
            ("--nics", "0"),
        ] {
            let e = parse_args(&[flag, bad]).unwrap_err();
            assert!(e.contains(flag) && e.contains(&format!("'{bad}'")), "{e}");
        }
        assert!(parse_args(&["--bogus", "1"]).is_err());
        let p = parse_args(&["--nics", "4", "--size", "1M", "--rate", "200"])
            .unwrap()
            .params();
        assert_eq!((p.nics, p.bytes, p.nic_gbps), (4, 1048576.0, 200.0));
        let p = parse_args(&["--size", "1GB"]).unwrap().params();
        assert_eq!(p.bytes, 1e9);
    }

    #[test]
    fn json_carries_the_table() {
        let p = Params {
            nics: 4,
            nodes: 4,
            bytes: 1e9,
            nic_gbps: 100.0,
            latency_s: 5e-6,
        };
        let v = serde_json::to_value(Report::of(&p)).unwrap();
        assert_eq!(v["algorithm"], "ring");
        let states = v["states"].as_array().unwrap();
        assert_eq!(states.len(), 3);
        assert_eq!(states[2]["state"], "railover spread");
        close(states[1]["time_s"].as_f64().unwrap(), 0.06003);
        close(states[2]["slowdown"].as_f64().unwrap(), 0.04003 / 0.03003);
        close(states[2]["busiest_nic_share"].as_f64().unwrap(), 1.0 / 3.0);
        let one = Params { nics: 1, ..p };
        let v = serde_json::to_value(Report::of(&one)).unwrap();
        assert!(v["states"][1]["time_s"].is_null());
        assert!(v["states"][0]["time_s"].as_f64().unwrap() > 0.0);
    }
}
