//! `railover bench --failover`: what a collective keeps when one of N NICs fails.
//!
//! NCCL splits each collective equally over its channels and a step ends when the slowest
//! is done, so a job runs at the pace of its slowest comm. Two `fault-peer`s on the
//! namespace testbed (N tc-shaped rails) stream C comms of checksummed messages, the
//! sender holding them in lockstep (`--lockstep K`: no comm more than K messages past the
//! slowest) unless `--free`. After a steady phase rail 0 is cut on node A (link down on
//! its veth, as the fault tier does), stays down, and comes back. The slowest comm's
//! rate in steady windows before the cut, after failover settled and after fail-back
//! settled gives what is kept, beside the (N−1)/N ideal, NCCL native failover's 1/2
//! and `railover sim --lockstep`'s prediction.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use railover_testkit::fault_line::{self, Event, Summary};
use railover_testkit::kept::{self, CommPoint, DevPoint, Exclude, Kept, Phases, Windows};
use railover_testkit::testbed::proc::Proc;
use railover_testkit::testbed::{unix_ms, Side, Testbed};
use serde::Serialize;

use railover::conn::lane::{congested_limit, LINGER};

use crate::bench::{Machine, Output};
use crate::sim::{lockstep_kept, Placement};
use crate::size;

/// Tick interval of both endpoints.
pub(crate) const TICK_MS: u64 = 250;
/// The slowest comm in the time series: over this many ticks (1 s).
const SMOOTH_TICKS: usize = 4;
const GRACE_S: f64 = 5.0;
/// NCCL's native failover keeps this much of a collective's rate: the failed NIC's
/// share moves whole onto one survivor, which then carries twice its share.
pub const NATIVE: f64 = 0.5;
/// P3's bound on what the slowest comm keeps, as a share of (N−1)/N: reported, not
/// judged by the exit status (the fault tier asserts it).
pub const TARGET_SHARE: f64 = 0.85;
/// The text report lists each comm's rate up to this many comms.
const PER_COMM_SHOWN: usize = 64;
/// The default idle window after the traffic.
const IDLE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    pub rails: usize,
    pub comms: usize,
    /// `None`: free-running.
    pub lockstep: Option<usize>,
    pub rate_mbit: u64,
    pub size: usize,
    pub depth: usize,
    pub steady: f64,
    pub down: f64,
    pub after: f64,
    pub output: Output,
    pub plot: Option<PathBuf>,
    /// After the traffic, every comm open and idle for this long: what they cost then.
    pub idle: Duration,
    /// How long the link shapers queue a packet before dropping it.
    pub queue: Duration,
}

/// A queue that never drops what the comms have in flight, as a lossless link (RoCE
/// with PFC) pauses rather than drops: twice what all comms can have posted, spread over
/// the survivors of one cut, at the link's rate, and never below the fault tier's.
/// Behind a shallower, tail-dropping queue the sender's own shaper drops its lanes'
/// segments; TCP then holds those lanes back (a smaller window, and a probe timer of
/// 200 ms or more for a lane with nothing else in flight), and in lockstep every comm
/// waits for them, before the cut as after it.
pub fn lossless_queue(
    rails: usize,
    comms: usize,
    depth: usize,
    size: usize,
    mbit: u64,
) -> Duration {
    let in_flight = (comms * depth * size) as f64;
    let per_survivor = 2.0 * in_flight / rails.saturating_sub(1).max(1) as f64;
    let secs = per_survivor * 8.0 / (mbit.max(1) as f64 * 1e6);
    Duration::from_secs_f64(secs).max(railover_testkit::testbed::DEFAULT_QUEUE)
}

impl From<&crate::bench::Args> for Opts {
    fn from(a: &crate::bench::Args) -> Opts {
        Opts {
            rails: a.rails,
            comms: a.comms.unwrap_or(a.rails),
            lockstep: (!a.free).then_some(a.lockstep),
            rate_mbit: a.rate.map_or(200, |r| r as u64),
            size: a.size,
            depth: a.depth,
            steady: a.steady,
            down: a.down,
            after: a.after,
            output: Output::from_flags(a.json, a.markdown),
            plot: a.plot.clone(),
            idle: a.idle_seconds.unwrap_or(IDLE),
            queue: a.queue_ms.map_or_else(
                || {
                    let (rails, comms) = (a.rails, a.comms.unwrap_or(a.rails));
                    let mbit = a.rate.map_or(200, |r| r as u64);
                    lossless_queue(rails, comms, a.depth, a.size, mbit)
                },
                |ms| Duration::from_millis(ms as u64),
            ),
        }
    }
}

/// Seconds since the start of traffic at which the run changed.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Timeline {
    /// The start of traffic (node B's first tick began), Unix-epoch ms.
    pub start_ms: u64,
    pub cut_s: f64,
    pub up_s: f64,
    pub end_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Series {
    pub devs: Vec<String>,
    /// Bytes each of node A's NICs sent per tick, as Mbit/s.
    pub dev_mbit: Vec<DevPoint>,
    /// The slowest comm and the aggregate as node B verified them, Mbit/s, each over
    /// the trailing second.
    pub comms: Vec<CommPoint>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    /// The plugin build measured (it is linked into this command): version, commit.
    pub plugin: String,
    pub rails: usize,
    pub comms: usize,
    pub lockstep: Option<usize>,
    pub rate_mbit: u64,
    /// How long the link shapers queued a packet before dropping it, ms.
    pub queue_ms: u64,
    /// Packets the receiver's and the sender's shapers dropped over the run.
    pub shaper_drops: [u64; 2],
    pub size: usize,
    pub depth: usize,
    pub timeline: Timeline,
    pub windows: Windows,
    /// Steady before the cut against steady after failover.
    pub kept: Kept,
    /// Steady before the cut against steady after fail-back.
    pub back: Option<Kept>,
    /// (N−1)/N.
    pub ideal: f64,
    pub native: f64,
    /// 0.85 × (N−1)/N, and whether the slowest comm kept that much.
    pub target: f64,
    pub target_met: bool,
    /// `railover sim --lockstep`: whole-comm moves and striped.
    pub sim_whole: Option<f64>,
    pub sim_striped: Option<f64>,
    /// From `go` until every comm was connected at both ends.
    pub setup_ms: u64,
    /// CPU time (user + system) of the receiver and the sender over the whole run.
    pub cpu_s: [Option<f64>; 2],
    /// After the traffic, every comm open and idle: the receiver's and the sender's CPU
    /// as a share of one core, over `idle_s`.
    pub idle_s: f64,
    pub idle_cpu_pct: [Option<f64>; 2],
    /// Resident memory each peer gained from just before the comms connected to the idle
    /// window, per comm, KiB (the receiver's listening comms came before: not counted).
    pub rss_kib_per_comm: [Option<f64>; 2],
    /// From the cut to the first failover line in node A's log.
    pub failover_ms: Option<u64>,
    /// Moved comms' first message on their new path, ms after detection (the failover
    /// lines' `resume=`): the median and the slowest.
    pub resume_ms: Option<[f64; 2]>,
    pub failovers: usize,
    /// From link up to the first fail-back line.
    pub failback_ms: Option<u64>,
    pub failbacks: usize,
    /// Exactly once: nothing lost, duplicated, reordered or corrupted, no request error,
    /// every comm ran to its end.
    pub intact: bool,
    pub problems: Vec<String>,
    pub messages: u64,
    pub series: Series,
}

/// Prints progress on stderr, so stdout stays the report.
macro_rules! note {
    ($($t:tt)*) => {{ eprintln!($($t)*); }};
}

pub fn run(o: &Opts) -> i32 {
    let r = match measure(o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("railover bench --failover: {e}");
            return 1;
        }
    };
    let text = match o.output {
        Output::Json => serde_json::to_string_pretty(&r).expect("plain data") + "\n",
        Output::Markdown => markdown(&r),
        Output::Text => text(&r),
    };
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if let Some(path) = &o.plot {
        match crate::plot::failover_svg(path, &r) {
            Ok(()) => note!(
                "railover bench --failover: plot written to {}",
                path.display()
            ),
            Err(e) => {
                eprintln!("railover bench --failover: plot {}: {e}", path.display());
                return 1;
            }
        }
    }
    if r.intact {
        0
    } else {
        eprintln!(
            "railover bench --failover: data not delivered exactly once: {}",
            r.problems.join("; ")
        );
        1
    }
}

fn env_ms(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This build's version and commit (`git` in the working directory, when there is one).
fn plugin_build() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    match git(&["describe", "--always", "--dirty"]) {
        Some(c) => format!(
            "railover {} ({build}), {} commit {c}",
            env!("CARGO_PKG_VERSION"),
            git(&["rev-parse", "--abbrev-ref", "HEAD"]).unwrap_or_default()
        ),
        None => format!("railover {} ({build})", env!("CARGO_PKG_VERSION")),
    }
}

fn spawn(tb: &Testbed, side: Side, role: &str, o: &Opts) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = tb.command(side, exe.to_str().unwrap_or("railover"));
    let seconds = o.steady + o.down + o.after;
    c.args(["fault-peer", role])
        .args(["--comms", &o.comms.to_string()])
        .args(["--size", &o.size.to_string()])
        .args(["--depth", &o.depth.to_string()])
        .args(["--seconds", &seconds.to_string()])
        // Both ends keep their comms open, after the traffic, for at most the grace:
        // long enough to measure them idle.
        .args([
            "--grace",
            &GRACE_S.max(hold(o).as_secs_f64() + 2.0).to_string(),
        ])
        .args(["--tick-ms", &TICK_MS.to_string()]);
    if let (Some(k), "send") = (o.lockstep, role) {
        c.args(["--lockstep", &k.to_string()]);
    }
    if role == "recv" {
        // It keeps its comms until told: the sender's last acknowledgements arrive.
        c.arg("--linger");
    }
    // Only the testbed's rails; info for the failover and fail-back lines, or the level
    // the bench was given (debug shows each probe's fate).
    let log = std::env::var("RAILOVER_LOG").unwrap_or_else(|_| "info".into());
    c.env("RAILOVER_IFNAME", "rv")
        .env("RAILOVER_METRICS_PORT", "off")
        .env("RAILOVER_LOG", log);
    Proc::spawn(c, role).map_err(|e| format!("cannot start fault-peer {role}: {e}"))
}

fn is(line: &str, pred: impl Fn(&Event) -> bool) -> bool {
    Event::parse(line).is_some_and(|e| pred(&e))
}

/// Waits for `ok` (or a setup failure) from `p`.
fn wait_for(p: &Proc, what: &str, ok: impl Fn(&Event) -> bool) -> Result<(), String> {
    let line = p.wait_line(Duration::from_secs(30), |l| {
        is(l, |e| ok(e) || matches!(e, Event::SetupFailed { .. }))
    });
    match line {
        Some(l) if is(&l, &ok) => Ok(()),
        l => Err(format!(
            "fault-peer {} did not {what}: {l:?}\n{}",
            p.name,
            p.stderr_tail(10)
        )),
    }
}

/// CPU seconds (user + system) process `pid` has used, from /proc.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0) // USER_HZ
}

/// How long the comms are held after the traffic: until lanes that failed back have
/// lingered out and those that moved data no longer keep themselves alive (only each
/// path's keeper does), then the idle window.
fn hold(o: &Opts) -> Duration {
    let timeout = Duration::from_millis(env_ms("RAILOVER_COMPLETION_TIMEOUT_MS", 1000));
    congested_limit(timeout).max(LINGER) + Duration::from_millis(500) + o.idle
}

/// Resident memory of process `pid`, KiB, from /proc (`statm` counts 4 KiB pages).
fn rss_kib(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4)
}

/// Sleeps until Unix-epoch ms `t`: the experiment's schedule, not synchronisation.
fn sleep_until(t: u64) {
    let now = unix_ms() as u64;
    if t > now {
        std::thread::sleep(Duration::from_millis(t - now));
    }
}

fn measure(o: &Opts) -> Result<Report, String> {
    if let Some(why) = railover_testkit::testbed::unavailable() {
        return Err(format!("needs root and iproute2: {why}"));
    }
    let mode = match o.lockstep {
        Some(k) => format!("lockstep K={k}"),
        None => "free-running".into(),
    };
    let mut machine = crate::bench::machine(format!(
        "namespace testbed: {} veth pairs, tc tbf {} Mbit/s each",
        o.rails, o.rate_mbit
    ));
    let plugin = plugin_build();
    let tb =
        Testbed::with_queue(o.rails, o.rate_mbit, o.queue).map_err(|e| format!("testbed: {e}"))?;
    note!(
        "railover bench --failover: {} rails x {} Mbit/s, {} comms, {mode}, {} messages, depth {}; {plugin}",
        o.rails,
        o.rate_mbit,
        o.comms,
        size::format(o.size as u64),
        o.depth
    );
    let recv = spawn(&tb, Side::B, "recv", o)?;
    wait_for(&recv, "listen", |e| matches!(e, Event::Listening { .. }))?;
    let mut send = spawn(&tb, Side::A, "send", o)?;
    for l in recv.lines() {
        if let Some(Event::Handle(h)) = Event::parse(&l) {
            send.send(&fault_line::Command::Handle(h).to_line());
        }
    }
    let rss0 = [rss_kib(recv.pid()), rss_kib(send.pid())];
    let go = std::time::Instant::now();
    send.send(&fault_line::Command::Go.to_line());
    for p in [&recv, &send] {
        wait_for(p, "connect", |e| matches!(e, Event::Connected { .. }))?;
    }
    let setup_ms = go.elapsed().as_millis() as u64;
    let start = unix_ms() as u64;
    note!("  steady for {} s, then rail 0 down on node A", o.steady);
    sleep_until(start + (o.steady * 1000.0) as u64);
    tb.link_down(Side::A, 0);
    let cut = unix_ms() as u64;
    note!("  rv0 down; back up in {} s", o.down);
    sleep_until(cut + (o.down * 1000.0) as u64);
    tb.link_up(Side::A, 0);
    let up = unix_ms() as u64;
    note!("  rv0 up; traffic for {} s more", o.after);
    let seconds = o.steady + o.down + o.after;
    let bound = Duration::from_secs_f64(seconds + 3.0 * GRACE_S + 10.0);
    let mut recv = recv;
    // Both ends say how it went before either closes.
    for p in [&recv, &send] {
        p.wait_line(bound, |l| is(l, |e| matches!(e, Event::Summary(_))));
    }
    // CPU each peer used over the run (both still open: their comms linger).
    let cpu_s = [cpu_seconds(recv.pid()), cpu_seconds(send.pid())];
    let shaper_drops = [tb.shaper_drops(Side::B), tb.shaper_drops(Side::A)];
    let secs = |c: Option<f64>| c.map_or("?".into(), |c| format!("{c:.1} s"));
    note!(
        "  setup {setup_ms} ms; CPU over the run: receiver {}, sender {}",
        secs(cpu_s[0]),
        secs(cpu_s[1])
    );
    // Then every comm open and idle: what holding them costs, once the lanes that
    // failed back have lingered out and those that moved data no longer keep themselves
    // alive (only each path's keeper does).
    std::thread::sleep(hold(o) - o.idle);
    let idle_from = [cpu_seconds(recv.pid()), cpu_seconds(send.pid())];
    let t_idle = std::time::Instant::now();
    std::thread::sleep(o.idle);
    let idle_s = t_idle.elapsed().as_secs_f64();
    let idle_to = [cpu_seconds(recv.pid()), cpu_seconds(send.pid())];
    let idle_cpu_pct: [Option<f64>; 2] =
        std::array::from_fn(|i| Some((idle_to[i]? - idle_from[i]?) / idle_s.max(1e-3) * 100.0));
    let rss1 = [rss_kib(recv.pid()), rss_kib(send.pid())];
    let rss_kib_per_comm: [Option<f64>; 2] =
        std::array::from_fn(|i| Some((rss1[i]? as f64 - rss0[i]? as f64) / o.comms as f64));
    let pct = |c: Option<f64>| c.map_or("?".into(), |c| format!("{c:.2}%"));
    note!(
        "  idle {idle_s:.1} s with {} comms open: CPU receiver {}, sender {} of a core",
        o.comms,
        pct(idle_cpu_pct[0]),
        pct(idle_cpu_pct[1])
    );
    recv.send(&fault_line::Command::Close.to_line());
    recv.close_stdin();
    let recv_exit = recv.wait_exit(bound).and_then(|s| s.code());
    send.send(&fault_line::Command::Close.to_line());
    send.close_stdin();
    let send_exit = send.wait_exit(bound).and_then(|s| s.code());
    machine.loadavg_end = crate::bench::loadavg();

    let events =
        |p: &Proc| -> Vec<Event> { p.lines().iter().filter_map(|l| Event::parse(l)).collect() };
    let (rev, sev) = (events(&recv), events(&send));
    let riv = kept::intervals(&rev);
    let siv = kept::intervals(&sev);
    let summary = |ev: &[Event]| {
        ev.iter().rev().find_map(|e| match e {
            Event::Summary(s) => Some(s.clone()),
            _ => None,
        })
    };
    let (rs, ss) = (summary(&rev), summary(&sev));
    let problems = check_intact(o.comms, [(&rs, recv_exit), (&ss, send_exit)]);

    let t0 = riv.first().map_or(start, |i| i.from);
    let end = siv.first().map_or(start, |i| i.from) + (seconds * 1000.0) as u64;
    let phases = Phases {
        start: t0,
        cut,
        up: Some(up),
        end,
    };
    // RAILOVER_BENCH_LOGS=DIR keeps both peers' whole stderr, for a run to be examined.
    if let Some(dir) = std::env::var_os("RAILOVER_BENCH_LOGS") {
        let dir = PathBuf::from(dir);
        for (p, name) in [(&recv, "recv"), (&send, "send")] {
            let path = dir.join(format!("fault-peer-{name}.log"));
            if let Err(e) = std::fs::write(&path, p.stderr_tail(usize::MAX)) {
                note!("cannot keep {}: {e}", path.display());
            }
        }
    }
    let tails = || {
        format!(
            "{}\n--- fault-peer recv (last lines) ---\n{}\n--- fault-peer send (last lines) ---\n{}",
            problems.join("; "),
            recv.stderr_tail(15),
            send.stderr_tail(15)
        )
    };
    let windows = kept::windows(phases, exclude()).map_err(|e| format!("{e}: {}", tails()))?;
    let k = kept::kept(&riv, windows.before, windows.after, o.lockstep.is_some())
        .ok_or_else(|| format!("no traffic in the steady windows: {}", tails()))?;
    let back = windows
        .back
        .and_then(|w| kept::kept(&riv, windows.before, w, o.lockstep.is_some()));

    let log = send.stderr_tail(usize::MAX);
    let first = |what: &str, base: u64| {
        let stamps: Vec<u128> = log
            .lines()
            .filter(|l| l.contains(what))
            .filter_map(crate::failover_demo::stamp)
            .collect();
        let at = stamps
            .iter()
            .min()
            .map(|&t| (t as u64).saturating_sub(base));
        (at, stamps.len())
    };
    let (failover_ms, failovers) = first(" failover comm=", cut);
    let resume_ms = resumes(&log);
    let (failback_ms, failbacks) = first(" failback comm=", up);
    let devs = rev
        .iter()
        .find_map(|e| match e {
            Event::Devices { names, .. } => Some(names.clone()),
            _ => None,
        })
        .unwrap_or_default();
    let secs = |t: u64| (t as f64 - t0 as f64) / 1000.0;
    let target = TARGET_SHARE * kept::ideal(o.rails);
    let slowest = k.slowest;
    Ok(Report {
        machine,
        plugin,
        rails: o.rails,
        comms: o.comms,
        lockstep: o.lockstep,
        rate_mbit: o.rate_mbit,
        queue_ms: o.queue.as_millis() as u64,
        shaper_drops,
        size: o.size,
        depth: o.depth,
        timeline: Timeline {
            start_ms: t0,
            cut_s: secs(cut),
            up_s: secs(up),
            end_s: secs(end),
        },
        windows,
        kept: k,
        back,
        ideal: kept::ideal(o.rails),
        native: NATIVE,
        target,
        target_met: slowest >= target,
        sim_whole: lockstep_kept(o.rails as u32, o.comms as u32, Placement::Whole),
        sim_striped: lockstep_kept(o.rails as u32, o.comms as u32, Placement::Striped),
        setup_ms,
        cpu_s,
        idle_s,
        idle_cpu_pct,
        rss_kib_per_comm,
        failover_ms,
        resume_ms,
        failovers,
        failback_ms,
        failbacks,
        intact: problems.is_empty(),
        problems,
        messages: rs.map_or(0, |s| s.msgs),
        series: Series {
            devs,
            dev_mbit: kept::dev_series(&siv, t0),
            comms: kept::comm_series(&riv, t0, SMOOTH_TICKS),
        },
    })
}

/// The median and the slowest `resume=` of the failover lines in `log`.
fn resumes(log: &str) -> Option<[f64; 2]> {
    let mut v: Vec<f64> = log
        .lines()
        .filter(|l| l.contains(" failover comm="))
        .filter_map(|l| {
            let rest = l.split(" resume=").nth(1)?;
            rest.split(|c: char| !c.is_ascii_digit() && c != '.')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    Some([*v.get(v.len() / 2)?, *v.last()?])
}

/// What the steady windows leave out, from the plugin's own knobs as it reads them.
pub(crate) fn exclude() -> Exclude {
    let timeout = env_ms("RAILOVER_COMPLETION_TIMEOUT_MS", 1000);
    let failback =
        env_ms("RAILOVER_FAILBACK_INTERVAL_MS", 1000) * env_ms("RAILOVER_FAILBACK_PROBES", 3);
    Exclude {
        warmup: 1500,
        // Detection (a silent path takes the completion timeout), the move and the moved
        // lanes' ramp-up.
        settle: timeout + 1500,
        failback: failback + 1500,
        guard: TICK_MS,
    }
}

/// Why the run was not exactly once (empty: it was), from each end's summary and exit.
pub(crate) fn check_intact(
    comms: usize,
    ends: [(&Option<Summary>, Option<i32>); 2],
) -> Vec<String> {
    let mut v = Vec::new();
    let names = ["receiver", "sender"];
    for ((s, exit), name) in ends.iter().zip(names) {
        let Some(s) = s else {
            v.push(format!("the {name} printed no summary (exit {exit:?})"));
            continue;
        };
        if *exit != Some(0) {
            v.push(format!("the {name} exited {exit:?}"));
        }
        if s.bad > 0 {
            v.push(format!("the {name} saw {} damaged messages", s.bad));
        }
        if s.req_errors > 0 {
            v.push(format!("the {name} had {} request errors", s.req_errors));
        }
        if s.ended as usize != comms {
            v.push(format!("the {name} ended {} of {comms} comms", s.ended));
        }
    }
    if let (Some(r), Some(s)) = (ends[0].0, ends[1].0) {
        if r.msgs != s.msgs {
            v.push(format!(
                "the receiver verified {} messages, the sender completed {}",
                r.msgs, s.msgs
            ));
        }
    }
    v
}

fn mbit(bytes_per_s: f64) -> f64 {
    bytes_per_s * 8.0 / 1e6
}

fn mode(r: &Report) -> String {
    match r.lockstep {
        Some(k) => format!("lockstep K={k}"),
        None => "free-running".into(),
    }
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn ms(x: Option<u64>) -> String {
    x.map_or("not seen".into(), |v| format!("{v} ms"))
}

pub fn text(r: &Report) -> String {
    let m = &r.machine;
    let mut s = format!(
        "# railover bench --failover: {} rails x {} Mbit/s (tc tbf), {} comms, {}, {} messages, depth {}\n",
        r.rails,
        r.rate_mbit,
        r.comms,
        mode(r),
        size::format(r.size as u64),
        r.depth
    );
    s += &format!("# plugin: {}\n", r.plugin);
    s += &format!(
        "# shapers queue up to {} ms; they dropped {} packets at the receiver, {} at the sender\n",
        r.queue_ms, r.shaper_drops[0], r.shaper_drops[1]
    );
    s += &format!(
        "# {} CPUs ({}), kernel {}, load {} -> {}\n",
        m.cpus, m.cpu_model, m.kernel, m.loadavg_start, m.loadavg_end
    );
    let t = &r.timeline;
    s += &format!(
        "# rv0 cut on node A at {:.1} s, restored at {:.1} s, traffic until {:.1} s; steady windows {:.1}-{:.1} s, {:.1}-{:.1} s{}\n",
        t.cut_s,
        t.up_s,
        t.end_s,
        rel(r, r.windows.before.from),
        rel(r, r.windows.before.to),
        rel(r, r.windows.after.from),
        rel(r, r.windows.after.to),
        r.windows
            .back
            .map_or(String::new(), |w| format!(", {:.1}-{:.1} s", rel(r, w.from), rel(r, w.to)))
    );
    s += &format!(
        "{:<22} {:>10} {:>22} {:>22}\n",
        "Mbit/s", "before", "after failover", "after fail-back"
    );
    let back = |f: fn(&Kept) -> (f64, f64)| {
        r.back.as_ref().map_or("-".into(), |b| {
            let (x, k) = f(b);
            format!("{:.1} ({k:.2})", mbit(x))
        })
    };
    s += &format!(
        "{:<22} {:>10.1} {:>22} {:>22}\n",
        "slowest comm",
        mbit(r.kept.before.slowest),
        format!("{:.1} ({:.2})", mbit(r.kept.after.slowest), r.kept.slowest),
        back(|b| (b.after.slowest, b.slowest))
    );
    s += &format!(
        "{:<22} {:>10.1} {:>22} {:>22}\n",
        "aggregate",
        mbit(r.kept.before.aggregate),
        format!(
            "{:.1} ({:.2})",
            mbit(r.kept.after.aggregate),
            r.kept.aggregate
        ),
        back(|b| (b.after.aggregate, b.aggregate))
    );
    let per = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{:.0}", mbit(*x)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if r.comms <= PER_COMM_SHOWN {
        s += &format!(
            "per comm: before [{}], after failover [{}]\n",
            per(&r.kept.before.per_comm),
            per(&r.kept.after.per_comm)
        );
    }
    s += &format!(
        "kept by the slowest comm: {:.2}; ideal (N-1)/N {:.2}; NCCL native {:.2}; sim: whole-comm moves {}, striped {}\n",
        r.kept.slowest,
        r.ideal,
        r.native,
        opt(r.sim_whole, 2),
        opt(r.sim_striped, 2)
    );
    s += &format!(
        "target: the slowest comm keeps >= {TARGET_SHARE} x (N-1)/N = {:.2}: {}\n",
        r.target,
        if r.target_met { "met" } else { "MISSED" }
    );
    s += &format!(
        "failover: first move {} after the cut ({} moves); first message on the new path {} after detection; fail-back: first {} after link up ({} moves)\n",
        ms(r.failover_ms),
        r.failovers,
        r.resume_ms.map_or("not seen".into(), |[p50, max]| format!(
            "{p50:.0} ms (median), {max:.0} ms (slowest)"
        )),
        ms(r.failback_ms),
        r.failbacks
    );
    let both = |v: [Option<f64>; 2], f: &dyn Fn(f64) -> String| {
        v.map(|x| x.map_or("?".into(), f)).join(" / ")
    };
    s += &format!(
        "setup {} ms; CPU over the run {} s; idle with every comm open ({:.0} s): {} of a core; memory per comm {} KiB (receiver / sender)\n",
        r.setup_ms,
        both(r.cpu_s, &|c| format!("{c:.1}")),
        r.idle_s,
        both(r.idle_cpu_pct, &|c| format!("{c:.2}%")),
        both(r.rss_kib_per_comm, &|c| format!("{c:.0}")),
    );
    s += &if r.intact {
        format!(
            "data: {} messages verified by node B, none lost, duplicated, reordered or corrupted\n",
            r.messages
        )
    } else {
        format!("data: NOT exactly once: {}\n", r.problems.join("; "))
    };
    s +=
        "\ntime series, Mbit/s (node A's NICs sent per tick; slowest comm over the last second):\n";
    s += &format!("{:>6}", "t (s)");
    for d in &r.series.devs {
        s += &format!(" {d:>6}");
    }
    s += &format!(" {:>8}\n", "slowest");
    // Every other tick: half-second rows.
    for d in r.series.dev_mbit.iter().step_by(2) {
        s += &format!("{:>6.2}", d.t);
        for x in &d.mbit {
            s += &format!(" {x:>6.0}");
        }
        let slowest = r
            .series
            .comms
            .iter()
            .min_by(|a, b| (a.t - d.t).abs().total_cmp(&(b.t - d.t).abs()))
            .map_or(f64::NAN, |c| c.slowest);
        s += &format!(" {slowest:>8.1}\n");
    }
    s
}

/// Unix-epoch ms `t` as seconds since the start of traffic.
fn rel(r: &Report, t: u64) -> f64 {
    (t as f64 - r.timeline.start_ms as f64) / 1000.0
}

/// The header of the README table.
pub const MARKDOWN_HEADER: &str = "| N | C | mode | link (Mbit/s) | slowest comm before → after (Mbit/s) | kept, measured | (N−1)/N | NCCL native | sim: whole-comm moves | sim: striped | aggregate kept | after fail-back | first move / fail-back | exactly once |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";

/// The table header and this run's row.
pub fn markdown(r: &Report) -> String {
    format!("{MARKDOWN_HEADER}{}\n", markdown_row(r))
}

pub fn markdown_row(r: &Report) -> String {
    format!(
        "| {} | {} | {} | {} | {:.0} → {:.0} | **{:.2}** | {:.2} | {:.2} | {} | {} | {:.2} | {} | {} / {} | {} |",
        r.rails,
        r.comms,
        mode(r),
        r.rate_mbit,
        mbit(r.kept.before.slowest),
        mbit(r.kept.after.slowest),
        r.kept.slowest,
        r.ideal,
        r.native,
        opt(r.sim_whole, 2),
        opt(r.sim_striped, 2),
        r.kept.aggregate,
        opt(r.back.as_ref().map(|b| b.slowest), 2),
        r.failover_ms.map_or("-".into(), |v| format!("{v} ms")),
        r.failback_ms
            .map_or("-".into(), |v| format!("{:.1} s", v as f64 / 1000.0)),
        if r.intact { "yes" } else { "**no**" }
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn resumes_are_read_from_the_failover_lines() {
        let log = "railover WARN 1: railover: failover comm=3 rv0->a => rv1->b reason=timeout detect=1001.0ms resume=120.5ms spread_over=3\n\
                   railover WARN 2: railover: failback comm=3 rv1->b => rv0->a away=5.0s\n\
                   railover WARN 3: railover: failover comm=4 rv0->a => rv2->c reason=timeout detect=1001.0ms resume=300.0ms spread_over=3\n\
                   railover WARN 4: railover: failover comm=5 rv0->a => rv3->d reason=timeout detect=1001.0ms resume=80.0ms spread_over=3\n";
        assert_eq!(super::resumes(log), Some([120.5, 300.0]));
        assert_eq!(super::resumes("nothing moved\n"), None);
    }

    use super::*;

    fn opts(s: &str) -> Result<Opts, String> {
        crate::bench::bench_args(s).map(|a| Opts::from(&a))
    }

    #[test]
    fn failover_options_default_to_one_comm_per_rail_in_lockstep() {
        let o = opts("--failover").unwrap();
        assert_eq!((o.rails, o.comms, o.lockstep), (4, 4, Some(8)));
        assert_eq!((o.rate_mbit, o.size, o.depth), (200, 256 << 10, 8));
        assert_eq!((o.steady, o.down, o.after), (6.0, 9.0, 9.0));
        let o =
            opts("--failover --rails 8 --comms 16 --rate 100 --lockstep 4 --plot x.svg --markdown")
                .unwrap();
        assert_eq!(
            (o.rails, o.comms, o.lockstep, o.rate_mbit),
            (8, 16, Some(4), 100)
        );
        assert_eq!(o.plot, Some(PathBuf::from("x.svg")));
        assert_eq!(o.output, Output::Markdown);
        assert_eq!(opts("--failover --free").unwrap().lockstep, None);
    }

    #[test]
    fn the_default_queue_holds_all_in_flight_and_an_explicit_one_wins() {
        // 256 comms x 4 x 8 KiB = 8 MiB in flight, over 3 survivors, twice, at 200
        // Mbit/s: 5.59 MB take 224 ms.
        let q = opts("--failover --comms 256 --size 8K --depth 4")
            .unwrap()
            .queue;
        assert_eq!(q.as_millis(), 223);
        // Little in flight: the fault tier's queue, not less.
        let q = opts("--failover --comms 4 --size 32 --depth 1")
            .unwrap()
            .queue;
        assert_eq!(q, railover_testkit::testbed::DEFAULT_QUEUE);
        let q = opts("--failover --comms 256 --queue-ms 50").unwrap().queue;
        assert_eq!(q, Duration::from_millis(50));
        assert!(opts("--queue-ms 50").unwrap_err().contains("--failover"));
        assert!(opts("--failover --queue-ms 0")
            .unwrap_err()
            .contains("--queue-ms"));
    }

    #[test]
    fn failover_options_are_refused_by_name() {
        for (args, name) in [
            ("--failover --rails 1", "--rails"),
            ("--failover --rails 9", "--rails"),
            ("--failover --lockstep 0", "--lockstep"),
            ("--failover --down 1", "--down"),
            ("--failover --size 8", "--size"),
            // Sweep options do not apply, and failover options need --failover.
            ("--failover --quick", "--quick"),
            ("--failover --testbed 2", "--testbed"),
            ("--rails 4", "--failover"),
            ("--plot x.svg", "--failover"),
        ] {
            let e = opts(args).unwrap_err();
            assert!(e.contains(name), "{args}: {e}");
        }
    }

    #[test]
    fn intact_needs_both_summaries_clean_and_equal_counts() {
        let ok = Summary {
            msgs: 10,
            ended: 4,
            ..Summary::default()
        };
        assert!(check_intact(
            4,
            [(&Some(ok.clone()), Some(0)), (&Some(ok.clone()), Some(0))]
        )
        .is_empty());
        let short = Summary {
            msgs: 9,
            bad: 1,
            ..ok.clone()
        };
        let p = check_intact(4, [(&Some(short), Some(1)), (&Some(ok.clone()), Some(0))]);
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p.iter().any(|x| x.contains("damaged")));
        assert!(p.iter().any(|x| x.contains("verified 9")));
        let p = check_intact(4, [(&None, None), (&Some(ok), Some(0))]);
        assert!(p[0].contains("no summary"), "{p:?}");
    }
}
