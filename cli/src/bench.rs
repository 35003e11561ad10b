//! `railover bench`: a send/receive size sweep through the plugin ABI, shaped like
//! nccl-tests' `sendrecv_perf`, against raw TCP sockets with the same sizes, comms and
//! depth, measured in the same run. Two processes, as two NCCL ranks: a child sends, this
//! one receives. Plugin and baseline runs alternate at every size point (A, B, A, B …) so
//! machine drift lands on both; figures are medians of the repetitions and every ratio is
//! taken from the medians. Costs (CPU per GB, idle CPU, reactor wake-ups, memory) come
//! from `/proc` of both processes.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use railover::reactor::REACTOR_THREAD;
use railover_testkit::driver::{connect_pair, Buffer, Ctx, RecvComm, SendComm};
use railover_testkit::testbed::{Side, Testbed};
use serde::Serialize;

use crate::peer::{self, Peer};
use crate::size;

/// Registered receive memory one mode may hold per process at one size point: the depth
/// is lowered for the largest sizes so 256 MiB × depth × comms stays within it.
const MEM_BUDGET: usize = 512 << 20;

/// Targets from the issue: reported, never asserted.
const TARGET_BW: f64 = 0.9;
const TARGET_BW_FROM: usize = 1 << 20;
const TARGET_RTT: f64 = 1.5;
const TARGET_IDLE_PCT: f64 = 1.0;

#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub step: usize,
    pub comms: usize,
    pub depth: usize,
    pub reps: usize,
    pub testbed: Option<usize>,
    pub rate_mbit: u64,
    pub idle: Duration,
    pub quick: bool,
    pub output: Output,
    /// Set in the re-executed child inside namespace A: (rails, peer namespace).
    pub inside: Option<(usize, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
    Markdown,
}

impl Output {
    /// The output `--json` / `--markdown` ask for (they override each other).
    pub fn from_flags(json: bool, markdown: bool) -> Output {
        if json {
            Output::Json
        } else if markdown {
            Output::Markdown
        } else {
            Output::Text
        }
    }
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            min_bytes: 8,
            max_bytes: 256 << 20,
            step: 2,
            comms: 1,
            depth: 8,
            reps: 7,
            testbed: None,
            rate_mbit: 1000,
            idle: Duration::from_secs(10),
            quick: false,
            output: Output::Text,
            inside: None,
        }
    }
}

/// Options as given; `parse` applies `--quick`'s presets under them.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Sizes: bytes, or K, M, G (powers of 1024, also KiB, MiB, GiB) or KB, MB, GB \
(powers of 1000), as in 8, 64K, 1.5MiB.\n\
Exit status: 0 measured (targets are reported, not judged), 1 the run failed, 2 usage."
)]
pub struct Args {
    /// Smallest message, up to 1G [default: 8]
    #[arg(long, value_name = "N", value_parser = message_size)]
    pub min_bytes: Option<usize>,
    /// Largest message, up to 1G [default: 256M; with --quick 16M]
    #[arg(long, value_name = "N", value_parser = message_size)]
    pub max_bytes: Option<usize>,
    /// Size factor between points: 2, 4, 8 or 16 [default: 2; with --quick 8]
    #[arg(long, value_name = "F", value_parser = step)]
    pub step: Option<usize>,
    /// Comms (and raw sockets) used at once, 1 … 64; with --failover 1 … 4096
    /// [default: 1; with --failover: the rails]
    #[arg(long, value_name = "C", value_parser = int_in(1, MAX_FAILOVER_COMMS))]
    pub comms: Option<usize>,
    /// Messages in flight per comm, 1 … 32
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = int_in(1, 32))]
    pub depth: usize,
    /// Repetitions of each measurement, 5 … 1000 [default: 7; with --quick 5]
    #[arg(long, value_name = "R", value_parser = int_in(5, 1000))]
    pub reps: Option<usize>,
    /// As root: two namespaces joined by N tc-shaped veth pairs, 1 … 8
    #[arg(long, value_name = "N", value_parser = int_in(1, 8))]
    pub testbed: Option<usize>,
    /// Link rate on the testbed, Mbit/s, 1 … 100000 [default: 1000; with --failover: 200]
    #[arg(long, value_name = "MBIT", value_parser = int_in(1, 100_000))]
    pub rate: Option<usize>,
    /// Window of the idle-cost measurement, seconds in 0.5 … 600 [default: 10; with
    /// --quick 2; with --failover 5, after the traffic]
    #[arg(long, value_name = "S", value_parser = idle_seconds)]
    pub idle_seconds: Option<Duration>,
    /// A short smoke run: fewer sizes and bytes, 2 s idle window (options given
    /// explicitly still win)
    #[arg(long)]
    pub quick: bool,
    /// One JSON document on stdout (a row per size point)
    #[arg(long, overrides_with = "markdown")]
    pub json: bool,
    /// The README table on stdout
    #[arg(long, overrides_with = "json")]
    pub markdown: bool,
    /// As root, instead of the sweep: comms over --rails tc-shaped links between two
    /// namespaces, rail 0 cut on one node and restored; what the slowest comm (the pace
    /// of a collective) and the aggregate keep, per-NIC time series
    #[arg(long, conflicts_with_all = ["min_bytes", "max_bytes", "step", "reps", "testbed", "quick", "in_testbed"])]
    pub failover: bool,
    /// --failover: rails (one veth pair, one NIC per node each), 2 … 8
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = int_in(2, 8), requires = "failover")]
    pub rails: usize,
    /// --failover: lockstep window: no comm posts more than K messages past the slowest
    /// comm's completed count, as one collective's channels, 1 … 64
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = int_in(1, 64), requires = "failover")]
    pub lockstep: usize,
    /// --failover: free-running comms instead of lockstep
    #[arg(long, requires = "failover")]
    pub free: bool,
    /// --failover: message size, 32 bytes … 64M
    #[arg(long, value_name = "BYTES", default_value = "256K", value_parser = failover_size, requires = "failover")]
    pub size: usize,
    /// --failover: seconds of steady traffic before the cut, 2 … 600
    #[arg(long, value_name = "S", default_value_t = 6.0, value_parser = phase_seconds, requires = "failover")]
    pub steady: f64,
    /// --failover: seconds the link stays down, 2 … 600
    #[arg(long, value_name = "S", default_value_t = 9.0, value_parser = phase_seconds, requires = "failover")]
    pub down: f64,
    /// --failover: seconds of traffic after the link comes back, 2 … 600
    #[arg(long, value_name = "S", default_value_t = 9.0, value_parser = phase_seconds, requires = "failover")]
    pub after: f64,
    /// --failover: how long the link shapers queue a packet before they drop it, ms in
    /// 1 … 10000 [default: lossless, twice what the comms can have in flight on the
    /// survivors; 50 is a shallow tail-dropping port, as in the fault tier]
    #[arg(long, value_name = "MS", value_parser = int_in(1, 10_000), requires = "failover")]
    pub queue_ms: Option<usize>,
    /// --failover: draw the time series into this SVG file
    #[arg(long, value_name = "FILE.svg", requires = "failover")]
    pub plot: Option<std::path::PathBuf>,
    /// Runs this bench against another build's plugin `.so` too: whole runs alternate,
    /// this build then PATH, and every figure is compared with the run next to it
    #[arg(long, value_name = "PATH", conflicts_with_all = ["failover", "in_testbed"])]
    pub baseline_plugin: Option<std::path::PathBuf>,
    /// --baseline-plugin: A/B rounds, 1 … 50
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in(1, 50), requires = "baseline_plugin")]
    pub ab_rounds: usize,
    /// Set when the bench re-runs itself inside namespace A of its testbed.
    #[arg(long, hide = true, value_name = "RAILS:NAMESPACE", value_parser = in_testbed)]
    pub in_testbed: Option<(usize, String)>,
}

/// Comms the size sweep opens at most: each holds its own buffers of up to 256 MiB.
const MAX_SWEEP_COMMS: usize = 64;
/// Comms `--failover` opens at most: as many as an all-to-all job opens per process.
pub const MAX_FAILOVER_COMMS: usize = 4096;

fn message_size(v: &str) -> Result<usize, String> {
    let n = crate::size::parse_within(v, 1, 1 << 30)?;
    usize::try_from(n).map_err(|e| e.to_string())
}

pub(crate) fn int_in(lo: usize, hi: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |v| match v.parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("expected an integer in {lo} … {hi}")),
    }
}

fn step(v: &str) -> Result<usize, String> {
    match v {
        "2" | "4" | "8" | "16" => v.parse().map_err(|_| unreachable!("matched digits")),
        _ => Err("expected 2, 4, 8 or 16".into()),
    }
}

fn idle_seconds(v: &str) -> Result<Duration, String> {
    match v.parse::<f64>() {
        Ok(s) if (0.5..=600.0).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err("expected seconds in 0.5 … 600".into()),
    }
}

fn failover_size(v: &str) -> Result<usize, String> {
    let n = crate::size::parse_within(v, 32, 64 << 20)?;
    usize::try_from(n).map_err(|e| e.to_string())
}

fn phase_seconds(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(s) if (2.0..=600.0).contains(&s) => Ok(s),
        _ => Err("expected seconds in 2 … 600".into()),
    }
}

fn in_testbed(v: &str) -> Result<(usize, String), String> {
    let (n, ns) = v.split_once(':').ok_or("expected RAILS:NAMESPACE")?;
    Ok((int_in(1, 8)(n)?, ns.to_string()))
}

/// The options with `--quick`'s presets applied under the ones given.
pub fn parse(a: Args) -> Result<Opts, String> {
    let d = Opts::default();
    // Eight points from 8 B to 16 MiB, two of them at or above 1 MiB for the target.
    let (max, step, reps, idle) = if a.quick {
        (16 << 20, 8, 5, Duration::from_secs(2))
    } else {
        (d.max_bytes, d.step, d.reps, d.idle)
    };
    let o = Opts {
        min_bytes: a.min_bytes.unwrap_or(d.min_bytes),
        max_bytes: a.max_bytes.unwrap_or(max),
        step: a.step.unwrap_or(step),
        comms: a.comms.unwrap_or(d.comms),
        depth: a.depth,
        reps: a.reps.unwrap_or(reps),
        testbed: a.testbed,
        rate_mbit: a.rate.map_or(d.rate_mbit, |r| r as u64),
        idle: a.idle_seconds.unwrap_or(idle),
        quick: a.quick,
        output: Output::from_flags(a.json, a.markdown),
        inside: a.in_testbed,
    };
    if o.comms > MAX_SWEEP_COMMS {
        return Err(format!(
            "railover bench: --comms {} is above {MAX_SWEEP_COMMS} for the sweep (only --failover takes up to {MAX_FAILOVER_COMMS})",
            o.comms
        ));
    }
    if o.min_bytes > o.max_bytes {
        return Err(format!(
            "railover bench: --min-bytes {} is above --max-bytes {}",
            size::format(o.min_bytes as u64),
            size::format(o.max_bytes as u64)
        ));
    }
    Ok(o)
}

/// The sweep: `min`, `min × step`, … up to `max`, and `max` itself.
pub fn sizes(min: usize, max: usize, step: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    while s < max {
        v.push(s);
        s = s.saturating_mul(step);
    }
    v.push(max);
    v
}

/// Median, quartiles and range of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| {
            if v.is_empty() {
                return f64::NAN;
            }
            let x = p * (v.len() - 1) as f64;
            let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
        };
        Summary {
            median: q(0.5),
            q1: q(0.25),
            q3: q(0.75),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// (max − min) / median, in percent.
    pub fn range_pct(&self) -> f64 {
        (self.max - self.min) / self.median * 100.0
    }
}

/// Messages per comm in one run, and the depth used at this size.
pub fn plan(size: usize, comms: usize, depth: usize, quick: bool) -> (u64, usize) {
    let (run_bytes, max_msgs) = if quick {
        (64usize << 20, 5_000usize)
    } else {
        (512 << 20, 20_000)
    };
    let depth = (MEM_BUDGET / size.max(1) / comms).clamp(1, depth);
    let total = (run_bytes / size.max(1)).clamp(1, max_msgs);
    (total.div_ceil(comms).max(2) as u64, depth)
}

// ---- /proc readers -----------------------------------------------------------------

/// CPU time (ns) of every live thread of `pid` (`schedstat`: nanosecond resolution).
fn cpu_ns(pid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU ns of each live thread of `pid`: (tid, name, ns).
fn thread_cpu(pid: u32) -> Vec<(u32, String, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|t| {
            let tid = t.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let ns = std::fs::read_to_string(t.path().join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some((tid, name.trim().to_string(), ns))
        })
        .collect()
}

/// Per thread of both processes, CPU ns summed over timed runs: (process, tid) -> (name,
/// ns). A thread that came and went between snapshots counts from its first one.
#[derive(Debug, Default)]
struct ThreadTally(BTreeMap<(&'static str, u32), (String, u64)>);

impl ThreadTally {
    /// Adds what each thread used between snapshots `before` and `after` of `process`.
    fn add(
        &mut self,
        process: &'static str,
        before: &[(u32, String, u64)],
        after: &[(u32, String, u64)],
    ) {
        for (tid, name, ns) in after {
            let was = before
                .iter()
                .find(|(t, _, _)| t == tid)
                .map_or(*ns, |b| b.2);
            let e = self.0.entry((process, *tid)).or_insert((name.clone(), 0));
            e.1 += ns.saturating_sub(was);
        }
    }

    /// Threads that ran at least half of `wall_s`, and every thread's CPU per GB of
    /// `gb` moved (those that used any), busiest first.
    fn figures(&self, wall_s: f64, gb: f64) -> (usize, Vec<ThreadCpu>) {
        let busy = (self.0.values())
            .filter(|(_, ns)| *ns as f64 / 1e9 >= BUSY_SHARE * wall_s)
            .count();
        let mut threads: Vec<ThreadCpu> = (self.0.iter())
            .filter(|(_, (_, ns))| *ns > 0)
            .map(|((process, _), (name, ns))| ThreadCpu {
                process,
                name: name.clone(),
                cpu_s_per_gb: *ns as f64 / 1e9 / gb,
                busy_pct: *ns as f64 / 1e9 / wall_s * 100.0,
            })
            .collect();
        threads.sort_by(|a, b| b.cpu_s_per_gb.total_cmp(&a.cpu_s_per_gb));
        (busy, threads)
    }
}

/// The share of a run's wall time a thread must have run to count as busy: a spinning
/// thread runs nearly all of it, one that wakes per message far less.
const BUSY_SHARE: f64 = 0.5;

/// The reactor thread of `pid`: (voluntary context switches, CPU ns).
fn reactor(pid: u32) -> Option<(u64, u64)> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != REACTOR_THREAD {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).ok()?;
        let vol = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
            .trim()
            .parse()
            .ok()?;
        let cpu = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        return Some((vol, cpu));
    }
    None
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub build: &'static str,
    pub network: String,
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn machine(network: String) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model: cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".into(), |(_, m)| m.trim().to_string()),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        loadavg_start: loadavg(),
        loadavg_end: String::new(),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        network,
    }
}

// ---- results -----------------------------------------------------------------------

/// One mode's figures at one size point.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    /// Median time per round (one message on every comm), microseconds.
    pub time_us: f64,
    /// Aggregate algorithm bandwidth, GB/s (10^9 B/s), over the repetitions.
    pub algbw: Summary,
    /// For send/receive, bus bandwidth equals algorithm bandwidth (as in nccl-tests).
    pub busbw: f64,
    /// CPU seconds of both processes per GB moved, summed over the repetitions.
    pub cpu_s_per_gb: f64,
    /// Threads of both processes that ran at least half of the timed runs' wall time
    /// (a socket transport keeps one per process busy at most).
    pub busy_threads: usize,
    /// Each thread's CPU per GB, busiest first.
    pub threads: Vec<ThreadCpu>,
}

/// One thread's share of a mode's CPU at one size point.
#[derive(Debug, Clone, Serialize)]
pub struct ThreadCpu {
    /// `recv` (this process) or `send` (the peer).
    pub process: &'static str,
    pub name: String,
    pub cpu_s_per_gb: f64,
    /// CPU time as a share of the timed runs' wall time, %.
    pub busy_pct: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub size: usize,
    pub count: u64,
    pub comms: usize,
    pub depth: usize,
    pub plugin: Figures,
    pub tcp: Figures,
    /// plugin median algbw / raw TCP median algbw.
    pub ratio: f64,
    pub cpu_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoundTrip {
    pub plugin_us: Summary,
    pub tcp_us: Summary,
    pub ratio: f64,
    pub pings: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Idle {
    pub seconds: f64,
    /// % of one core, each process (receiver, sender), all threads.
    pub cpu_pct: [f64; 2],
    /// Reactor wake-ups (voluntary context switches) per second, each process.
    pub reactor_wakeups_per_s: [f64; 2],
}

#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// Resident memory per comm (send and receive ends averaged; lanes, machines, buffers
    /// the plugin keeps), KiB.
    pub per_comm_kib: f64,
    /// Resident memory per posted receive request in flight, bytes.
    pub per_request_bytes: f64,
    pub comms_opened: usize,
    pub requests_posted: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    pub value: Option<f64>,
    pub limit: f64,
    pub met: Option<bool>,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub comms: usize,
    pub depth: usize,
    pub reps: usize,
    pub points: Vec<Point>,
    pub round_trip_8b: RoundTrip,
    /// The same with one core kept busy by a spinning process the bench started: what
    /// a wake-up costs when the CPU is contended.
    pub round_trip_8b_busy: RoundTrip,
    /// Plain iperf3 over the same path, GB/s, as a reference line (None: not installed).
    pub iperf3_gbps: Option<f64>,
    pub iperf3_note: String,
    pub idle: Idle,
    pub memory: Memory,
    pub targets: Vec<Target>,
}

// ---- the run -----------------------------------------------------------------------

/// `raw` is what followed `bench` on the command line, passed on as given to the bench
/// re-run inside the testbed.
pub fn run(a: Args, raw: Vec<OsString>) -> i32 {
    if a.failover {
        return crate::failover_bench::run(&crate::failover_bench::Opts::from(&a));
    }
    if let Some(b) = &a.baseline_plugin {
        let out = Output::from_flags(a.json, a.markdown);
        return crate::bench_ab::run(b, a.ab_rounds, &raw, out);
    }
    let o = match parse(a) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    if let Some(n) = o.testbed {
        return on_testbed(n, &o, &raw);
    }
    match measure(&o) {
        Ok(r) => {
            print_report(&r, o.output);
            0
        }
        Err(e) => {
            eprintln!("railover bench: {e}");
            1
        }
    }
}

/// Builds the testbed and runs the bench again inside namespace A, with its peer in B.
fn on_testbed(rails: usize, o: &Opts, args: &[OsString]) -> i32 {
    if let Some(why) = railover_testkit::testbed::unavailable() {
        eprintln!("railover bench: --testbed needs root and iproute2: {why}");
        return 1;
    }
    let tb = match Testbed::new(rails, o.rate_mbit) {
        Ok(tb) => tb,
        Err(e) => {
            eprintln!("railover bench: cannot build the testbed: {e}");
            return 1;
        }
    };
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("railover bench: cannot find this executable");
        return 1;
    };
    let mut inner: Vec<OsString> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--testbed" {
            it.next();
        } else if !a.to_str().is_some_and(|a| a.starts_with("--testbed=")) {
            inner.push(a.clone());
        }
    }
    let mut cmd = tb.command(Side::A, exe.to_str().unwrap_or("railover"));
    cmd.arg("bench")
        .args(&inner)
        .arg("--in-testbed")
        .arg(format!("{rails}:{}", tb.ns(Side::B)))
        .env("RAILOVER_IFNAME", "rv");
    match cmd.status() {
        Ok(st) => st.code().unwrap_or(1),
        Err(e) => {
            eprintln!("railover bench: cannot start the bench in the testbed: {e}");
            1
        }
    }
}

/// Prints progress on stderr, so stdout stays the report.
macro_rules! note {
    ($($t:tt)*) => {{ eprintln!($($t)*); }};
}

struct Rig {
    peer: Peer,
    peer_pid: u32,
    me: u32,
    ctx: Ctx,
    recv: Vec<RecvComm>,
    back: SendComm,
    raw: Vec<TcpStream>,
}

fn measure(o: &Opts) -> Result<Report, String> {
    // Two processes of one run would both try the default metrics port: unless asked
    // for, no endpoint.
    if std::env::var_os("RAILOVER_METRICS_PORT").is_none() {
        std::env::set_var("RAILOVER_METRICS_PORT", "off");
    }
    let (network, raw_addr, peer_cmd): (String, Box<dyn Fn(usize) -> Ipv4Addr>, Command) =
        match &o.inside {
            None => {
                std::env::set_var("RAILOVER_IFNAME", "lo");
                let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                (
                    "loopback (two processes, one NIC: lo)".into(),
                    Box::new(|_| Ipv4Addr::LOCALHOST),
                    Command::new(exe),
                )
            }
            Some((rails, ns)) => {
                let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(exe);
                let rails = *rails;
                (
                    format!(
                        "namespace testbed: {rails} veth pairs, tc tbf {} Mbit/s each",
                        o.rate_mbit
                    ),
                    Box::new(move |c| Testbed::addr(Side::A, c % rails)),
                    c,
                )
            }
        };
    let mut mach = machine(network);
    let sizes = sizes(o.min_bytes, o.max_bytes, o.step);
    note!(
        "railover bench: {} sizes {}..{}, {} comm(s), depth {}, {} reps, {} build, {}",
        sizes.len(),
        size::format(o.min_bytes as u64),
        size::format(o.max_bytes as u64),
        o.comms,
        o.depth,
        o.reps,
        mach.build,
        mach.network
    );

    let ctx = Ctx::init().map_err(|e| format!("railover init: {e}"))?;
    let ndev = ctx.devices().map_err(|e| format!("devices: {e}"))?.max(1);
    let memory = memory_cost(&ctx)?;

    let mut peer = Peer::spawn(peer_cmd).map_err(|e| format!("cannot start the peer: {e}"))?;
    let peer_pid = peer.pid();
    // Raw baseline: one socket per comm, on the same NIC the comm uses.
    let mut raw = Vec::new();
    for c in 0..o.comms {
        let l = TcpListener::bind(SocketAddr::new(raw_addr(c).into(), 0))
            .map_err(|e| format!("bind {}: {e}", raw_addr(c)))?;
        peer.send(&format!(
            "raw {}",
            l.local_addr().map_err(|e| e.to_string())?
        ))?;
        let (s, _) = l.accept().map_err(|e| format!("raw accept: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        expect_ok(&mut peer)?;
        raw.push(s);
    }
    // The plugin: comm c on device c mod ndev; one more back for the round trip.
    let mut recv = Vec::new();
    for c in 0..o.comms {
        let dev = (c % ndev as usize) as i32;
        let (h, l) = ctx.listen(dev).map_err(|e| format!("listen: {e}"))?;
        peer.send(&format!("fwd {dev} {}", peer::hex(&h)))?;
        recv.push(peer::accept(&l)?);
        expect_ok(&mut peer)?;
    }
    peer.send("back 0")?;
    let reply = peer.recv()?;
    let mut h = peer::unhex(
        reply
            .strip_prefix("handle ")
            .ok_or_else(|| format!("peer answered {reply:?}"))?,
    )?;
    let back = peer::connect(&ctx, 0, &mut h)?;
    expect_ok(&mut peer)?;
    let mut rig = Rig {
        peer,
        peer_pid,
        me: std::process::id(),
        ctx,
        recv,
        back,
        raw,
    };

    let mut points = Vec::new();
    for &size in &sizes {
        let p = rig.point(size, o)?;
        note!(
            "  {:>9}  railover {:>7.3} GB/s  TCP {:>7.3} GB/s  ratio {:.2}  (spread {:.0}% / {:.0}%)",
            size::format(size as u64),
            p.plugin.algbw.median,
            p.tcp.algbw.median,
            p.ratio,
            p.plugin.algbw.range_pct(),
            p.tcp.algbw.range_pct()
        );
        points.push(p);
    }
    let rtt = rig.round_trip(o)?;
    note!(
        "  8 B round trip: railover {:.1} us, TCP {:.1} us, ratio {:.2}",
        rtt.plugin_us.median,
        rtt.tcp_us.median,
        rtt.ratio
    );
    let rtt_busy = {
        let _spin = Spinner::start()?;
        rig.round_trip(o)?
    };
    note!(
        "  8 B round trip, one core kept busy: railover {:.1} us, TCP {:.1} us, ratio {:.2}",
        rtt_busy.plugin_us.median,
        rtt_busy.tcp_us.median,
        rtt_busy.ratio
    );
    let idle = rig.idle(o.idle);
    note!(
        "  idle: {:.2}% / {:.2}% of a core, reactor wake-ups {:.1}/s / {:.1}/s",
        idle.cpu_pct[0],
        idle.cpu_pct[1],
        idle.reactor_wakeups_per_s[0],
        idle.reactor_wakeups_per_s[1]
    );
    let Rig {
        peer,
        ctx,
        recv,
        back,
        raw,
        ..
    } = rig;
    drop((recv, back, raw));
    let _ = ctx.finalize();
    if !peer.finish() {
        return Err("the peer process failed".into());
    }
    let (iperf3_gbps, iperf3_note) = iperf3(o, &*raw_addr);
    mach.loadavg_end = loadavg();
    let targets = targets(&points, &rtt, &idle);
    Ok(Report {
        machine: mach,
        comms: o.comms,
        depth: o.depth,
        reps: o.reps,
        points,
        round_trip_8b: rtt,
        round_trip_8b_busy: rtt_busy,
        iperf3_gbps,
        iperf3_note,
        idle,
        memory,
        targets,
    })
}

/// A process that keeps one core busy (a shell loop) until dropped: the "busy machine"
/// of the round-trip figures, as a data loader or another rank would.
struct Spinner(std::process::Child);

impl Spinner {
    fn start() -> Result<Spinner, String> {
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .map(Spinner)
            .map_err(|e| format!("cannot start the spinning process: {e}"))
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn expect_ok(p: &mut Peer) -> Result<(), String> {
    match p.recv()? {
        r if r == "ok" => Ok(()),
        r => Err(format!("peer: {r}")),
    }
}

impl Rig {
    fn cpu(&self) -> u64 {
        cpu_ns(self.me) + cpu_ns(self.peer_pid)
    }

    /// Each thread's CPU so far: this process (receiving), then the peer (sending).
    fn threads(&self) -> [Vec<(u32, String, u64)>; 2] {
        [thread_cpu(self.me), thread_cpu(self.peer_pid)]
    }

    fn point(&mut self, size: usize, o: &Opts) -> Result<Point, String> {
        let (count, depth) = plan(size, o.comms, o.depth, o.quick);
        let e = |e: railover_testkit::driver::Code| e.to_string();
        let mut pbufs: Vec<Vec<Buffer>> = Vec::new();
        for r in &self.recv {
            let mut v = Vec::new();
            for _ in 0..depth {
                let mut b = r.register(size).map_err(e)?;
                b.bytes_mut().expect("idle buffer").fill(1);
                v.push(b);
            }
            pbufs.push(v);
        }
        let mut rbufs: Vec<Vec<Vec<u8>>> = (0..o.comms)
            .map(|_| (0..depth).map(|_| vec![1u8; size]).collect())
            .collect();
        self.peer.call(&format!("prep {size} {depth}"))?;
        // Warm-up of both paths (socket windows, page tables), not counted.
        let warm = (count / 8).max(1);
        self.plugin_run(&mut pbufs, size, warm)?;
        self.raw_run(&mut rbufs, warm)?;
        let (mut pa, mut ta) = (Vec::new(), Vec::new());
        let (mut pcpu, mut tcpu) = (0u64, 0u64);
        let (mut pthreads, mut tthreads) = (ThreadTally::default(), ThreadTally::default());
        for _ in 0..o.reps {
            let (c0, t0) = (self.cpu(), self.threads());
            pa.push(self.plugin_run(&mut pbufs, size, count)?);
            let (c1, t1) = (self.cpu(), self.threads());
            ta.push(self.raw_run(&mut rbufs, count)?);
            let t2 = self.threads();
            pcpu += c1 - c0;
            tcpu += self.cpu() - c1;
            for (k, process) in ["recv", "send"].into_iter().enumerate() {
                pthreads.add(process, &t0[k], &t1[k]);
                tthreads.add(process, &t1[k], &t2[k]);
            }
        }
        let bytes = (size * o.comms) as f64 * count as f64;
        let side = |secs: &[f64], cpu: u64, threads: &ThreadTally| {
            let bw: Vec<f64> = secs.iter().map(|s| bytes / s / 1e9).collect();
            let algbw = Summary::of(&bw);
            let t = Summary::of(secs).median;
            let gb = bytes * o.reps as f64 / 1e9;
            let (busy_threads, threads) = threads.figures(secs.iter().sum(), gb);
            Figures {
                time_us: t / count as f64 * 1e6,
                algbw,
                busbw: algbw.median,
                cpu_s_per_gb: cpu as f64 / 1e9 / gb,
                busy_threads,
                threads,
            }
        };
        let plugin = side(&pa, pcpu, &pthreads);
        let tcp = side(&ta, tcpu, &tthreads);
        Ok(Point {
            size,
            count,
            comms: o.comms,
            depth,
            ratio: plugin.algbw.median / tcp.algbw.median,
            cpu_ratio: plugin.cpu_s_per_gb / tcp.cpu_s_per_gb,
            plugin,
            tcp,
        })
    }

    /// One timed plugin run: every receive of every comm posted as slots free up; the
    /// clock runs from the command to the peer until the last message is in.
    fn plugin_run(
        &mut self,
        bufs: &mut [Vec<Buffer>],
        size: usize,
        count: u64,
    ) -> Result<f64, String> {
        let depth = bufs[0].len();
        let t0 = Instant::now();
        self.peer.send(&format!("xstream {count}"))?;
        let recv = &self.recv;
        peer::drive(recv.len(), depth, count, |c, k| {
            recv[c].irecv(&mut bufs[c][k], size)
        })?;
        let dt = t0.elapsed().as_secs_f64();
        expect_ok(&mut self.peer)?;
        Ok(dt)
    }

    fn raw_run(&mut self, bufs: &mut [Vec<Vec<u8>>], count: u64) -> Result<f64, String> {
        let t0 = Instant::now();
        self.peer.send(&format!("xraw {count}"))?;
        peer::raw_recv(&mut self.raw, bufs, count).map_err(|e| format!("raw receive: {e}"))?;
        let dt = t0.elapsed().as_secs_f64();
        expect_ok(&mut self.peer)?;
        Ok(dt)
    }

    fn round_trip(&mut self, o: &Opts) -> Result<RoundTrip, String> {
        let pings: u64 = if o.quick { 500 } else { 5_000 };
        let e = |e: railover_testkit::driver::Code| e.to_string();
        let sb = self.back.register(8).map_err(e)?;
        let mut rbs = [
            self.recv[0].register(8).map_err(e)?,
            self.recv[0].register(8).map_err(e)?,
        ];
        let (mut p, mut t) = (Vec::new(), Vec::new());
        // One warm-up pair, then interleaved repetitions.
        for rep in 0..=o.reps {
            self.peer.send(&format!("pong {pings}"))?;
            let t0 = Instant::now();
            let mut next = peer::post_recv(&self.recv[0], &mut rbs[0], 8)?;
            for i in 0..pings {
                let mut sr = peer::post_send(&self.back, &sb, 8)?;
                peer::wait(&mut next)?;
                if i + 1 < pings {
                    next = peer::post_recv(&self.recv[0], &mut rbs[((i + 1) % 2) as usize], 8)?;
                }
                peer::wait(&mut sr)?;
            }
            let plugin = t0.elapsed().as_secs_f64() / pings as f64 * 1e6;
            expect_ok(&mut self.peer)?;

            self.peer.send(&format!("raw-pong {pings}"))?;
            let s = &mut self.raw[0];
            let mut b = [0u8; 8];
            let t0 = Instant::now();
            for _ in 0..pings {
                std::io::Write::write_all(s, &b).map_err(|e| e.to_string())?;
                std::io::Read::read_exact(s, &mut b).map_err(|e| e.to_string())?;
            }
            let tcp = t0.elapsed().as_secs_f64() / pings as f64 * 1e6;
            expect_ok(&mut self.peer)?;
            if rep > 0 {
                p.push(plugin);
                t.push(tcp);
            }
        }
        let (plugin_us, tcp_us) = (Summary::of(&p), Summary::of(&t));
        Ok(RoundTrip {
            ratio: plugin_us.median / tcp_us.median,
            plugin_us,
            tcp_us,
            pings,
        })
    }

    /// CPU and reactor wake-ups of both processes with every comm open and nothing in
    /// flight. The sleeps here are the measurement window, not synchronisation.
    fn idle(&self, window: Duration) -> Idle {
        std::thread::sleep(Duration::from_millis(500)); // let the spin budget run out
        let pids = [self.me, self.peer_pid];
        let c0 = pids.map(cpu_ns);
        let r0 = pids.map(|p| reactor(p).map_or(0, |r| r.0));
        let t0 = Instant::now();
        std::thread::sleep(window);
        let dt = t0.elapsed().as_secs_f64();
        let c1 = pids.map(cpu_ns);
        let r1 = pids.map(|p| reactor(p).map_or(0, |r| r.0));
        Idle {
            seconds: dt,
            cpu_pct: [0, 1].map(|i| (c1[i] - c0[i]) as f64 / 1e9 / dt * 100.0),
            reactor_wakeups_per_s: [0, 1].map(|i| (r1[i] - r0[i]) as f64 / dt),
        }
    }
}

/// Resident memory per comm and per posted request, in this process alone: comms
/// connected to this same process, so both ends are counted here.
fn memory_cost(ctx: &Ctx) -> Result<Memory, String> {
    const PAIRS: usize = 64;
    const PER_COMM: usize = 16;
    let me = std::process::id();
    let e = |e: railover_testkit::driver::Code| e.to_string();
    let pair = || -> Result<(SendComm, RecvComm), String> {
        let (mut h, l) = ctx.listen(0).map_err(e)?;
        connect_pair(ctx, 0, &mut h, &l, peer::PATIENCE).map_err(|e| format!("self-connect: {e}"))
    };
    let warm = pair()?;
    let before = rss_kib(me);
    let mut pairs = Vec::new();
    for _ in 0..PAIRS {
        pairs.push(pair()?);
    }
    let settle = || std::thread::sleep(Duration::from_millis(200));
    settle();
    let with_comms = rss_kib(me);
    let mut rbufs: Vec<Vec<Buffer>> = Vec::new();
    let mut sbufs: Vec<Vec<Buffer>> = Vec::new();
    for (s, r) in &pairs {
        rbufs.push(
            (0..PER_COMM)
                .map(|_| r.register(8))
                .collect::<Result<_, _>>()
                .map_err(e)?,
        );
        sbufs.push(
            (0..PER_COMM)
                .map(|_| s.register(8))
                .collect::<Result<_, _>>()
                .map_err(e)?,
        );
    }
    settle();
    let before_reqs = rss_kib(me);
    let mut reqs = Vec::new();
    for ((_, r), bufs) in pairs.iter().zip(rbufs.iter_mut()) {
        for b in bufs.iter_mut() {
            reqs.push(peer::post_recv(r, b, 8)?);
        }
    }
    settle();
    let with_reqs = rss_kib(me);
    let mut sreqs = Vec::new();
    for ((s, _), bufs) in pairs.iter().zip(sbufs.iter()) {
        for b in bufs {
            sreqs.push(peer::post_send(s, b, 8)?);
        }
    }
    for q in reqs.iter_mut().chain(sreqs.iter_mut()) {
        peer::wait(q)?;
    }
    drop((reqs, sreqs, rbufs, sbufs, pairs, warm));
    let n = PAIRS * PER_COMM;
    Ok(Memory {
        per_comm_kib: with_comms.saturating_sub(before) as f64 / (2 * PAIRS) as f64,
        per_request_bytes: with_reqs.saturating_sub(before_reqs) as f64 * 1024.0 / n as f64,
        comms_opened: 2 * PAIRS,
        requests_posted: n,
    })
}

/// Plain iperf3 over the same path with as many streams as comms, when installed.
fn iperf3(o: &Opts, addr: &dyn Fn(usize) -> Ipv4Addr) -> (Option<f64>, String) {
    if Command::new("iperf3").arg("--version").output().is_err() {
        return (
            None,
            "iperf3 not installed (scripts/bench.sh installs it as root)".into(),
        );
    }
    let secs = if o.quick { 1 } else { 5 };
    let (server_ip, server_cmd) = match &o.inside {
        None => (addr(0), Command::new("iperf3")),
        Some((_, ns)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "iperf3"]);
            (Testbed::addr(Side::B, 0), c)
        }
    };
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_or(5201, |a| a.port());
    let mut server_cmd = server_cmd;
    let Ok(mut server) = server_cmd
        .args([
            "-s",
            "-1",
            "-B",
            &server_ip.to_string(),
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return (None, "iperf3 server did not start".into());
    };
    let mut result = (None, "iperf3 client failed".to_string());
    // The server needs a moment to listen; a refused client is simply retried.
    for _ in 0..20 {
        let out = Command::new("timeout")
            .arg((secs + 20).to_string())
            .arg("iperf3")
            .args(["-c", &server_ip.to_string(), "-p", &port.to_string()])
            .args(["-t", &secs.to_string(), "-P", &o.comms.to_string(), "-J"])
            .output();
        let Ok(out) = out else { break };
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            result = (
                Some(bps / 8e9),
                format!("iperf3 -P {} -t {secs} to {server_ip}", o.comms),
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = server.kill();
    let _ = server.wait();
    result
}

pub fn targets(points: &[Point], rtt: &RoundTrip, idle: &Idle) -> Vec<Target> {
    let big = points
        .iter()
        .filter(|p| p.size >= TARGET_BW_FROM)
        .min_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let idle_max = idle.cpu_pct.iter().cloned().fold(0.0, f64::max);
    vec![
        match big {
            Some(p) => Target {
                name: format!("throughput >= {TARGET_BW:.2}x raw TCP at >= 1 MiB"),
                value: Some(p.ratio),
                limit: TARGET_BW,
                met: Some(p.ratio >= TARGET_BW),
                detail: format!("worst {:.2}x at {}", p.ratio, size::format(p.size as u64)),
            },
            None => Target {
                name: format!("throughput >= {TARGET_BW:.2}x raw TCP at >= 1 MiB"),
                value: None,
                limit: TARGET_BW,
                met: None,
                detail: "no size point at or above 1 MiB in this sweep".into(),
            },
        },
        Target {
            name: format!("8 B round trip <= {TARGET_RTT:.1}x raw TCP"),
            value: Some(rtt.ratio),
            limit: TARGET_RTT,
            met: Some(rtt.ratio <= TARGET_RTT),
            detail: format!(
                "{:.2}x ({:.1} us vs {:.1} us)",
                rtt.ratio, rtt.plugin_us.median, rtt.tcp_us.median
            ),
        },
        Target {
            name: format!("idle CPU < {TARGET_IDLE_PCT:.0}% of a core"),
            value: Some(idle_max),
            limit: TARGET_IDLE_PCT,
            met: Some(idle_max < TARGET_IDLE_PCT),
            detail: format!(
                "{:.2}% (busier of the two processes, over {:.0} s)",
                idle_max, idle.seconds
            ),
        },
    ]
}

// ---- output ------------------------------------------------------------------------

fn verdict(t: &Target) -> &'static str {
    match t.met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    }
}

pub fn print_report(r: &Report, out: Output) {
    let mut s = std::io::stdout().lock();
    let text = match out {
        Output::Json => serde_json::to_string_pretty(r).expect("plain data") + "\n",
        Output::Markdown => markdown(r),
        Output::Text => text(r),
    };
    let _ = s.write_all(text.as_bytes());
}

fn text(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    s += &format!(
        "# railover bench: send/receive, {} comm(s), depth {}, {} interleaved reps per point, {}\n",
        r.comms, r.depth, r.reps, m.network
    );
    s += &format!(
        "# {} CPUs ({}), kernel {}, {} build, load {} -> {}\n",
        m.cpus, m.cpu_model, m.kernel, m.build, m.loadavg_start, m.loadavg_end
    );
    s += "# time: median us per round (one message on each comm); algbw = busbw = size x comms / time (GB/s = 1e9 B/s)\n";
    s += &format!(
        "#{:>11} {:>8} {:>5} | {:>10} {:>8} {:>8} {:>7} | {:>10} {:>8} {:>8} {:>7} | {:>6} {:>8} {:>7}\n",
        "size",
        "count",
        "depth",
        "time",
        "algbw",
        "busbw",
        "range",
        "time",
        "algbw",
        "busbw",
        "range",
        "ratio",
        "cpu/GB",
        "busy"
    );
    s += &format!(
        "#{:>11} {:>8} {:>5} | {:^36} | {:^36} | {:>6} {:>8} {:>7}\n",
        "(B)", "", "", "railover", "raw TCP", "", "ratio", "threads"
    );
    for p in &r.points {
        s += &format!(
            "{:>12} {:>8} {:>5} | {:>10.2} {:>8} {:>8} {:>6.0}% | {:>10.2} {:>8} {:>8} {:>6.0}% | {:>6.2} {:>8.2} {:>3}/{:<3}\n",
            p.size,
            p.count,
            p.depth,
            p.plugin.time_us,
            bw(p.plugin.algbw.median),
            bw(p.plugin.busbw),
            p.plugin.algbw.range_pct(),
            p.tcp.time_us,
            bw(p.tcp.algbw.median),
            bw(p.tcp.busbw),
            p.tcp.algbw.range_pct(),
            p.ratio,
            p.cpu_ratio,
            p.plugin.busy_threads,
            p.tcp.busy_threads
        );
    }
    s += "# busy threads: railover/raw TCP, both processes, that ran at least half of the timed runs\n";
    s += &summary_lines(r).join("\n");
    s += "\n";
    s
}

fn round_trip_line(what: &str, rt: &RoundTrip) -> String {
    format!(
        "{what}: railover {:.1} us [{:.1}-{:.1}], raw TCP {:.1} us [{:.1}-{:.1}], ratio {:.2}",
        rt.plugin_us.median,
        rt.plugin_us.min,
        rt.plugin_us.max,
        rt.tcp_us.median,
        rt.tcp_us.min,
        rt.tcp_us.max,
        rt.ratio
    )
}

fn summary_lines(r: &Report) -> Vec<String> {
    let rt = &r.round_trip_8b;
    let mut v = vec![
        round_trip_line("8 B round trip", rt),
        round_trip_line(
            "8 B round trip, one core kept busy",
            &r.round_trip_8b_busy,
        ),
        match r.iperf3_gbps {
            Some(g) => format!("reference: {} = {g:.3} GB/s", r.iperf3_note),
            None => format!("reference: {}", r.iperf3_note),
        },
        format!(
            "idle (comms open, nothing in flight, {:.0} s): CPU {:.2}% / {:.2}% of a core, reactor wake-ups {:.1}/s / {:.1}/s (receiver / sender)",
            r.idle.seconds,
            r.idle.cpu_pct[0],
            r.idle.cpu_pct[1],
            r.idle.reactor_wakeups_per_s[0],
            r.idle.reactor_wakeups_per_s[1]
        ),
        format!(
            "memory: {:.1} KiB resident per comm ({} comms), {:.0} B per receive in flight ({} posted)",
            r.memory.per_comm_kib,
            r.memory.comms_opened,
            r.memory.per_request_bytes,
            r.memory.requests_posted
        ),
    ];
    let big: Vec<&Point> = r
        .points
        .iter()
        .filter(|p| p.size >= TARGET_BW_FROM)
        .collect();
    if !big.is_empty() {
        let c = Summary::of(
            &big.iter()
                .map(|p| p.plugin.cpu_s_per_gb)
                .collect::<Vec<_>>(),
        );
        let t = Summary::of(&big.iter().map(|p| p.tcp.cpu_s_per_gb).collect::<Vec<_>>());
        v.push(format!(
            "CPU per GB moved at >= 1 MiB (both processes): railover {:.3} s, raw TCP {:.3} s, ratio {:.2}",
            c.median,
            t.median,
            c.median / t.median
        ));
    }
    for t in &r.targets {
        v.push(format!("target: {}: {} ({})", t.name, verdict(t), t.detail));
    }
    v
}

fn markdown(r: &Report) -> String {
    let m = &r.machine;
    let mut s = format!(
        "Send/receive through the plugin ABI against raw TCP sockets with the same sizes, \
         comms ({}) and depth ({}, lowered at the largest sizes to bound buffer memory), {}; {} interleaved repetitions per point, medians, \
         range = (max − min) / median. Machine: {} CPUs ({}), kernel {}, {} build, \
         load average {} at the start, {} at the end.\n\n",
        r.comms,
        r.depth,
        m.network,
        r.reps,
        m.cpus,
        m.cpu_model,
        m.kernel,
        m.build,
        m.loadavg_start,
        m.loadavg_end
    );
    s += "| size | count | depth | railover time (µs) | railover algbw (GB/s) | busbw | range | TCP time (µs) | TCP algbw (GB/s) | busbw | range | ratio | CPU/GB ratio |\n";
    s += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in &r.points {
        s += &format!(
            "| {} | {} | {} | {:.1} | {} | {} | {:.0}% | {:.1} | {} | {} | {:.0}% | {:.2} | {:.2} |\n",
            size::format(p.size as u64),
            p.count,
            p.depth,
            p.plugin.time_us,
            bw(p.plugin.algbw.median),
            bw(p.plugin.busbw),
            p.plugin.algbw.range_pct(),
            p.tcp.time_us,
            bw(p.tcp.algbw.median),
            bw(p.tcp.busbw),
            p.tcp.algbw.range_pct(),
            p.ratio,
            p.cpu_ratio
        );
    }
    s += "\n";
    for l in summary_lines(r) {
        s += &format!("* {l}\n");
    }
    s
}

/// GB/s with enough digits that small messages do not read as zero.
fn bw(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.2}")
    } else if x >= 0.01 {
        format!("{x:.3}")
    } else {
        format!("{x:.5}")
    }
}

/// `railover bench ARGS` through the real command line, for tests.
#[cfg(test)]
pub(crate) fn bench_args(s: &str) -> Result<Args, String> {
    use clap::Parser;
    let argv = ["railover", "bench"]
        .into_iter()
        .chain(s.split_whitespace());
    match crate::Cli::try_parse_from(argv)
        .map_err(|e| e.to_string())?
        .command
    {
        crate::Command::Bench(a) => Ok(a),
        c => panic!("parsed as {c:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options as `railover bench ARGS` gives them, through the real command line.
    fn parse_args(s: &str) -> Result<Opts, String> {
        parse(bench_args(s)?)
    }

    #[test]
    fn default_sweep_is_8_bytes_to_256_mib_doubling() {
        let o = parse_args("").unwrap();
        let s = sizes(o.min_bytes, o.max_bytes, o.step);
        assert_eq!(s.first(), Some(&8));
        assert_eq!(s.last(), Some(&(256 << 20)));
        assert_eq!(s.len(), 26);
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
    }

    #[test]
    fn sweep_ends_at_max_even_off_the_grid() {
        assert_eq!(sizes(8, 100, 4), vec![8, 32, 100]);
        assert_eq!(sizes(64, 64, 2), vec![64]);
    }

    #[test]
    fn quick_keeps_points_at_or_above_1_mib_and_given_options_win() {
        let o = parse_args("--quick").unwrap();
        let s = sizes(o.min_bytes, o.max_bytes, o.step);
        assert!(s.iter().filter(|&&x| x >= 1 << 20).count() >= 2);
        assert_eq!((o.step, o.reps, o.idle), (8, 5, Duration::from_secs(2)));
        let o = parse_args("--quick --max-bytes 64K --step 2 --reps 9").unwrap();
        assert_eq!((o.max_bytes, o.step, o.reps), (64 << 10, 2, 9));
        let o = parse_args("--max-bytes 1.5MiB --min-bytes 1KB").unwrap();
        assert_eq!((o.min_bytes, o.max_bytes), (1000, 1536 << 10));
    }

    #[test]
    fn output_flags_and_testbed_re_entry() {
        assert_eq!(parse_args("").unwrap().output, Output::Text);
        assert_eq!(parse_args("--json").unwrap().output, Output::Json);
        // As before clap: the last of the two wins.
        assert_eq!(
            parse_args("--json --markdown").unwrap().output,
            Output::Markdown
        );
        assert_eq!(
            parse_args("--markdown --json").unwrap().output,
            Output::Json
        );
        let o = parse_args("--in-testbed 4:rv-b --testbed 2 --rate 200").unwrap();
        assert_eq!(o.inside, Some((4, "rv-b".to_string())));
        assert_eq!((o.testbed, o.rate_mbit), (Some(2), 200));
        assert!(parse_args("--in-testbed 4").is_err());
    }

    #[test]
    fn bad_values_name_the_option_the_value_and_what_is_accepted() {
        let e = parse_args("--reps 3").unwrap_err();
        assert!(
            e.contains("--reps") && e.contains("'3'") && e.contains("5 … 1000"),
            "{e}"
        );
        let e = parse_args("--step 3").unwrap_err();
        assert!(e.contains("--step") && e.contains("2, 4, 8 or 16"), "{e}");
        let e = parse_args("--max-bytes 2G").unwrap_err();
        assert!(e.contains("--max-bytes") && e.contains("1 GiB"), "{e}");
        let e = parse_args("--min-bytes lots").unwrap_err();
        assert!(e.contains("--min-bytes") && e.contains("K, M, G"), "{e}");
        let e = parse_args("--idle-seconds 0.1").unwrap_err();
        assert!(
            e.contains("--idle-seconds") && e.contains("0.5 … 600"),
            "{e}"
        );
        let e = parse_args("--min-bytes 1M --max-bytes 4K").unwrap_err();
        assert!(
            e.contains("--min-bytes 1 MiB is above --max-bytes 4 KiB"),
            "{e}"
        );
        let e = parse_args("--comms").unwrap_err();
        assert!(e.contains("--comms") && e.contains("value"), "{e}");
        let e = parse_args("--comms 65").unwrap_err();
        assert!(e.contains("--comms 65") && e.contains("--failover"), "{e}");
        let e = parse_args("--comms 4097").unwrap_err();
        assert!(e.contains("1 … 4096"), "{e}");
        let e = parse_args("--frobnicate").unwrap_err();
        assert!(e.contains("--frobnicate"), "{e}");
    }

    #[test]
    fn summary_medians_and_quartiles() {
        let s = Summary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(
            (s.median, s.min, s.max, s.q1, s.q3),
            (3.0, 1.0, 5.0, 2.0, 4.0)
        );
        let s = Summary::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.median, 2.5);
        assert!((s.range_pct() - 120.0).abs() < 1e-9);
    }

    #[test]
    fn plan_caps_memory_and_keeps_at_least_two_messages() {
        let (count, depth) = plan(256 << 20, 1, 8, false);
        assert_eq!(depth, 2);
        assert_eq!(count, 2);
        let (count, depth) = plan(8, 4, 8, false);
        assert_eq!(depth, 8);
        assert_eq!(count, 5_000, "20000 messages over 4 comms");
        let (_, depth) = plan(256 << 20, 4, 8, true);
        assert_eq!(depth, 1);
    }

    #[test]
    fn busy_threads_are_those_that_ran_half_the_wall_time() {
        let t = |tid, name: &str, ns| (tid, name.to_string(), ns);
        let mut tally = ThreadTally::default();
        // 2 s of runs: the reactor spins through 1.8 s, NCCL's thread 1.2 s; a thread
        // gone by the second snapshot is not counted.
        let before = [
            t(1, "main", 0),
            t(2, "railover-reactor", 0),
            t(3, "gone", 5),
        ];
        let after = [
            t(1, "main", 1_200_000_000),
            t(2, "railover-reactor", 1_800_000_000),
        ];
        tally.add("recv", &before, &after);
        tally.add("send", &[], &[t(7, "helper", 100_000_000)]);
        let (busy, threads) = tally.figures(2.0, 4.0);
        assert_eq!(busy, 2, "{threads:?}");
        assert_eq!(
            threads.len(),
            2,
            "threads that used CPU in the runs: {threads:?}"
        );
        assert_eq!(threads[0].name, "railover-reactor");
        assert!((threads[0].cpu_s_per_gb - 0.45).abs() < 1e-9);
        assert!((threads[0].busy_pct - 90.0).abs() < 1e-9);
        // A thread first seen in the later snapshot counts from there, not from zero.
        assert!(threads.iter().all(|x| x.name != "helper"), "{threads:?}");
    }

    fn point(size: usize, ratio: f64) -> Point {
        let s = Summary::of(&[1.0]);
        let side = Figures {
            time_us: 1.0,
            algbw: s,
            busbw: 1.0,
            cpu_s_per_gb: 1.0,
            busy_threads: 1,
            threads: Vec::new(),
        };
        Point {
            size,
            count: 1,
            comms: 1,
            depth: 1,
            plugin: side.clone(),
            tcp: side,
            ratio,
            cpu_ratio: 1.0,
        }
    }

    #[test]
    fn targets_judge_the_worst_large_point_and_say_when_unmeasured() {
        let rtt = RoundTrip {
            plugin_us: Summary::of(&[30.0]),
            tcp_us: Summary::of(&[20.0]),
            ratio: 1.5,
            pings: 1,
        };
        let idle = Idle {
            seconds: 10.0,
            cpu_pct: [0.2, 1.4],
            reactor_wakeups_per_s: [4.0, 4.0],
        };
        let t = targets(
            &[point(4096, 0.5), point(1 << 20, 0.95), point(4 << 20, 0.85)],
            &rtt,
            &idle,
        );
        assert_eq!(t[0].met, Some(false));
        assert_eq!(t[0].value, Some(0.85));
        assert!(t[0].detail.contains("4 MiB"));
        assert_eq!(t[1].met, Some(true), "1.5x is within <= 1.5x");
        assert_eq!(t[2].met, Some(false), "the busier process counts");
        let t = targets(&[point(4096, 0.5)], &rtt, &idle);
        assert_eq!(t[0].met, None);
        assert_eq!(verdict(&t[0]), "not measured");
    }
}
