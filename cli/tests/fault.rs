//! The fault tier (`docs/design.md` §6): two network namespaces joined by one shaped veth pair
//! per rail, the plugin driven through its v12 table by `railover fault-peer` in each,
//! and link faults injected while checksummed streams run; comms are also set up at the
//! scale jobs open them, between one process pair and all-to-all between many (`setup_*`,
//! no fault: nothing may be turned away). Needs root: every test is
//! `#[ignore]`d and `scripts/fault-tier.sh` runs them with `--ignored` when it can (each
//! also prints `SKIP: <why>` and returns if run without root).
//!
//! Scenarios that need the failover engine are named `failover_*`; they run only with
//! RAILOVER_FAULT_EXPECT_FAILOVER=1, which the script sets when it is unset (set to
//! anything else, the script filters them out, so they are not reported as passed; run
//! by hand without the variable, they print `SKIP: needs the failover engine`).
//! The testbed self-checks and the killed-peer scenarios hold without it.

mod testbed;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use railover_testkit::fault_line::Event;
use railover_testkit::kept;
use testbed::flow::{
    assert_delivered_exactly_once, assert_no_corruption, check_lane_balance, is, is_tick,
    lane_placement, Flow, FlowOpts, Report,
};
use testbed::mesh::{
    assert_every_comm_delivered, assert_none_turned_away, log_digest, Mesh, MeshOpts, TURNED_AWAY,
};
use testbed::proc::Proc;
use testbed::{unix_ms, Side, Testbed, DEFAULT_RATE_MBIT};

/// Throughput is measured: one scenario at a time (2 cores).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The plugin's completion timeout, as it will read it (P1).
fn timeout_ms() -> u128 {
    std::env::var("RAILOVER_COMPLETION_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Fail-back: re-test interval × passing probes needed (P7; defaults 1000 ms × 3).
fn failback_ms() -> u128 {
    let get = |k: &str, d: u128| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    get("RAILOVER_FAILBACK_INTERVAL_MS", 1000) * get("RAILOVER_FAILBACK_PROBES", 3)
}

/// Bytes/s of one link at the testbed rate.
fn link_bytes_per_s(tb: &Testbed) -> f64 {
    tb.rate_mbit() as f64 * 1e6 / 8.0
}

fn needs_failover() -> bool {
    if std::env::var("RAILOVER_FAULT_EXPECT_FAILOVER").as_deref() == Ok("1") {
        false
    } else {
        println!("SKIP: needs the failover engine (set RAILOVER_FAULT_EXPECT_FAILOVER=1)");
        true
    }
}

fn bed(rails: usize) -> Testbed {
    Testbed::new(rails, DEFAULT_RATE_MBIT).unwrap_or_else(|e| panic!("testbed: {e}"))
}

macro_rules! fault_test {
    ($(#[$m:meta])* fn $name:ident() $body:block) => {
        $(#[$m])*
        #[test]
        #[ignore = "fault tier: needs root; run with --ignored"]
        fn $name() {
            if testbed::skip_unless_available() {
                return;
            }
            let _g = serial();
            $body
        }
    };
}

// ---- testbed self-checks (hold today) ----------------------------------------------

fault_test! {
    fn testbed_is_built_shaped_and_torn_down() {
        for rails in [2, 4] {
            let tb = bed(rails);
            let names = tb.names();
            for n in &names {
                assert!(Testbed::exists(n), "namespace {n} missing");
            }
            for side in [Side::A, Side::B] {
                let ifs = tb.interfaces(side);
                assert!(ifs.iter().any(|l| l.starts_with("lo 127.0.0.1/8")), "{ifs:?}");
                for r in 0..rails {
                    let want = format!("rv{r} {}/24", Testbed::addr(side, r));
                    assert!(ifs.contains(&want), "{want} not in {ifs:?}");
                    assert!(tb.link_is_up(side, r));
                    let q = tb.qdisc(side, r);
                    assert!(
                        q.contains("tbf") && q.contains(&format!("rate {}Mbit", tb.rate_mbit())),
                        "rv{r} not shaped: {q}"
                    );
                }
                assert_eq!(ifs.len(), rails + 1, "only lo and the rails: {ifs:?}");
            }
            drop(tb);
            for n in &names {
                assert!(!Testbed::exists(n), "namespace {n} left behind");
            }
        }
    }
}

fault_test! {
    fn testbed_is_torn_down_when_a_test_panics() {
        let names = std::sync::Mutex::new(None);
        let r = std::panic::catch_unwind(|| {
            let tb = bed(2);
            *names.lock().unwrap() = Some(tb.names());
            panic!("deliberate panic: the testbed must still be torn down");
        });
        assert!(r.is_err());
        let names = names.into_inner().unwrap().expect("testbed was built");
        for n in &names {
            assert!(!Testbed::exists(n), "namespace {n} left behind after a panic");
        }
    }
}

fault_test! {
    fn testbed_removes_stale_namespaces_of_a_dead_run() {
        // A pid above pid_max cannot be alive.
        let max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4_194_304);
        let stale = format!("{}A-{}-0", testbed::PREFIX, max + 1);
        testbed::sh("ip", &["netns", "add", &stale]).unwrap();
        let tb = bed(2);
        let gone = !Testbed::exists(&stale);
        let _ = testbed::sh("ip", &["netns", "del", &stale]);
        drop(tb);
        assert!(gone, "stale namespace {stale} survived a new testbed");
    }
}

/// A plain TCP stream from A to B on `rail`, reporting bytes every 100 ms.
struct TcpStream {
    recv: Proc,
    send: Proc,
}

impl TcpStream {
    fn start(tb: &Testbed, rail: usize, seconds: f64) -> TcpStream {
        let addr = format!("{}:{}", Testbed::addr(Side::B, rail), 5201 + rail);
        let mut c = tb.command(Side::B, testbed::flow::EXE);
        c.args(["fault-peer", "tcp-recv", "--bind", &addr, "--seconds"])
            .arg((seconds + 2.0).to_string());
        let recv = Proc::spawn(c, "tcp-recv").unwrap();
        assert!(
            recv.wait_line(Duration::from_secs(10), |l| is(l, |e| matches!(
                e,
                Event::TcpListening { .. }
            )))
            .is_some(),
            "tcp-recv: {}",
            recv.stderr_tail(5)
        );
        let mut c = tb.command(Side::A, testbed::flow::EXE);
        c.args(["fault-peer", "tcp-send", "--to", &addr, "--seconds"])
            .arg(seconds.to_string());
        let send = Proc::spawn(c, "tcp-send").unwrap();
        for p in [&recv, &send] {
            assert!(
                p.wait_line(Duration::from_secs(10), |l| is(l, |e| matches!(
                    e,
                    Event::Connected { .. }
                )))
                .is_some(),
                "{} did not connect: {}",
                p.name,
                p.stderr_tail(5)
            );
        }
        TcpStream { recv, send }
    }

    fn finish(mut self, bound: Duration) -> Report {
        let st = self.send.wait_exit(bound);
        assert!(st.is_some(), "tcp-send hung");
        let st = self.recv.wait_exit(bound);
        assert!(st.is_some(), "tcp-recv hung");
        Report::parse(&self.recv, st.and_then(|s| s.code()))
    }
}

fault_test! {
    fn testbed_one_stream_runs_at_the_tc_rate_and_four_together_too() {
        let tb = bed(4);
        let link = link_bytes_per_s(&tb);
        // One stream alone.
        let s = TcpStream::start(&tb, 0, 3.0);
        let r = s.finish(Duration::from_secs(15));
        let (a, b) = (r.ticks[5].t, r.ticks[r.ticks.len().saturating_sub(5)].t);
        let one = r.rate(&[0], a, b);
        println!(
            "measured: one stream {:.0} Mbit/s on a {} Mbit/s link",
            one * 8.0 / 1e6,
            tb.rate_mbit()
        );
        assert!(
            one > 0.7 * link && one < 1.1 * link,
            "single stream {one:.0} B/s vs link {link:.0} B/s"
        );
        // All four at once: the CPU must not be what limits them.
        let streams: Vec<TcpStream> = (0..4).map(|r| TcpStream::start(&tb, r, 3.0)).collect();
        let reports: Vec<Report> = streams
            .into_iter()
            .map(|s| s.finish(Duration::from_secs(15)))
            .collect();
        let mut total = 0.0;
        for (rail, r) in reports.iter().enumerate() {
            let (a, b) = (r.ticks[5].t, r.ticks[r.ticks.len().saturating_sub(5)].t);
            let x = r.rate(&[0], a, b);
            println!("measured: rail {rail} {:.0} Mbit/s with all four busy", x * 8.0 / 1e6);
            assert!(x > 0.7 * link, "rail {rail}: {x:.0} B/s with four streams");
            total += x;
        }
        println!("measured: aggregate {:.0} Mbit/s over 4 links", total * 8.0 / 1e6);
    }
}

fault_test! {
    fn testbed_link_down_stops_a_rail_and_link_up_restores_it() {
        let tb = bed(2);
        let s0 = TcpStream::start(&tb, 0, 7.0);
        let s1 = TcpStream::start(&tb, 1, 7.0);
        assert!(s0.recv.wait_count(Duration::from_secs(10), 10, is_tick));
        let down = unix_ms();
        tb.link_down(Side::A, 0);
        assert!(!tb.link_is_up(Side::A, 0) && !tb.link_is_up(Side::B, 0));
        // Hold the fault for 2 s, watching ticks arrive (bounded by the wait).
        assert!(s0.recv.wait_count(Duration::from_secs(10), 30, is_tick));
        let up = unix_ms();
        tb.link_up(Side::A, 0);
        tb.wait_carrier(Duration::from_secs(5)).unwrap();
        let r0 = s0.finish(Duration::from_secs(20));
        let r1 = s1.finish(Duration::from_secs(20));
        let link = link_bytes_per_s(&tb);
        let during0 = r0.rate(&[0], down + 300, up);
        let during1 = r1.rate(&[0], down + 300, up);
        println!(
            "rail 0 while down: {during0:.0} B/s; rail 1 meanwhile: {:.0} Mbit/s",
            during1 * 8.0 / 1e6
        );
        assert_eq!(during0, 0.0, "traffic crossed a downed link");
        assert!(during1 > 0.7 * link, "the other rail slowed: {during1:.0} B/s");
        // TCP retransmission backoff decides when it comes back: allow 6 s.
        let back = r0
            .ticks
            .iter()
            .find(|t| t.t > up && t.bytes[0] > 0)
            .map(|t| t.t - up);
        println!("rail 0 resumed {back:?} ms after link up");
        assert!(back.is_some_and(|ms| ms < 6000), "rail 0 did not resume: {back:?}");
    }
}

// ---- the plugin over the testbed -----------------------------------------------------

fault_test! {
    fn plugin_streams_intact_on_every_rail_at_link_rate() {
        let tb = bed(4);
        let flow = Flow::start(&tb, FlowOpts { seconds: 4.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let dev_of = flow.dev_of.clone();
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        let (a, b) = (recv.ticks[5].t, recv.ticks[recv.ticks.len() - 5].t);
        let link = link_bytes_per_s(&tb);
        let all: Vec<usize> = (0..comms).collect();
        let agg = recv.rate(&all, a, b);
        println!("plugin: aggregate {:.0} Mbit/s over 4 links", agg * 8.0 / 1e6);
        for rail in 0..4 {
            let on: Vec<usize> = (0..comms).filter(|&c| dev_of[c] == rail).collect();
            let x = recv.rate(&on, a, b);
            println!("plugin: rail {rail} {:.0} Mbit/s", x * 8.0 / 1e6);
            assert!(x > 0.6 * link, "rail {rail} at {x:.0} B/s");
        }
    }
}

/// A job's setup at scale over 4 rails: `senders` processes in A, `receivers` in B,
/// `per_pair` comms between each sender and each receiver (device = comm mod 4), every
/// pair connecting at the same moment. Every comm must then carry a few checksummed
/// messages intact, no listener may turn a connection away, and every process must exit
/// cleanly.
fn setup_at_scale(senders: usize, receivers: usize, per_pair: usize) {
    const RAILS: usize = 4;
    const MESSAGES: usize = 4;
    let tb = bed(RAILS);
    let opts = MeshOpts {
        senders,
        receivers,
        per_pair,
        flow: FlowOpts {
            // Light traffic: 1,024 lanes per link must not queue behind each other long
            // enough to look dead; setup is what is judged here.
            messages: Some(MESSAGES),
            size: 4 << 10,
            depth: 1,
            tick_ms: 250,
            // Bounds only: the senders stop after their messages. The grace is long so
            // that no sender closes before the slowest receiver has its summary.
            seconds: 20.0,
            grace: 10.0,
            // Info: a connect the listener dropped and that is tried again says so.
            env: vec![
                ("RAILOVER_LOG", "info".into()),
                ("RAILOVER_METRICS_PORT", "off".into()),
                (
                    "RAILOVER_COMPLETION_TIMEOUT_MS",
                    completion_timeout_ms(senders + receivers),
                ),
            ],
            ..FlowOpts::default()
        },
    };
    let comms = senders * receivers * per_pair;
    let started = Instant::now();
    let (mesh, setup) = Mesh::start(&tb, opts.clone());
    let per_rail = mesh.per_rail.clone();
    let (recvs, sends) = mesh.finish();
    let slowest = |role: &str| {
        setup
            .iter()
            .filter(|s| s.name.starts_with(role))
            .max_by_key(|s| s.ms)
            .map_or_else(|| "-".into(), |s| format!("{} {} ms", s.name, s.ms))
    };
    let all: Vec<Report> = recvs.iter().chain(&sends).cloned().collect();
    let sum = |f: fn(&Report) -> u64| all.iter().map(f).sum::<u64>();
    let peaks: Vec<u64> = recvs.iter().map(|r| r.summary.handshakes_peak).collect();
    println!(
        "setup at scale: {senders} x {receivers} processes, {comms} comms ({per_pair} per pair), \
         per rail {per_rail:?}; from `go` to connected: slowest receiver {}, slowest sender {}; \
         {:?} in all",
        slowest("recv"),
        slowest("send"),
        started.elapsed()
    );
    println!(
        "setup at scale: {} messages verified; connections turned away {} (evicted by the gate {}, \
         refused {}); connects tried again {}; lanes failed with no fault injected {}; \
         handshakes in flight at most {peaks:?} per receiver",
        recvs.iter().map(|r| r.summary.msgs).sum::<u64>(),
        sum(|r| r.summary.rejected_connections),
        sum(|r| r.summary.evicted_handshakes),
        sum(|r| r.summary.refused_handshakes),
        sum(|r| r.stderr.matches("; trying again").count() as u64),
        sum(|r| r.stderr.matches(" failed (").count() as u64),
    );
    for r in &all {
        // Thousands of comms log thousands of lines: what went wrong, in a few.
        let wrong: Vec<(usize, String)> = log_digest(&r.stderr)
            .into_iter()
            .filter(|(_, k)| k.contains(" WARN ") || TURNED_AWAY.iter().any(|w| k.contains(w)))
            .take(6)
            .collect();
        for (n, kind) in wrong {
            println!("  {}: {n:>5} x {kind}", r.role);
        }
    }
    assert_eq!(per_rail, vec![comms / RAILS; RAILS], "comms per rail");
    assert_every_comm_delivered(&opts, &recvs, &sends);
    assert_none_turned_away(&all);
}

/// The completion timeout for `processes` railover processes on this machine: the default
/// 1 s while there are no more processes than cores. Sixteen processes setting up
/// thousands of comms on 2 cores wait their turn for the CPU for longer than that, and a
/// lane whose peer was not scheduled would be failed for silence: setup is judged here,
/// not detection (the failover scenarios judge that at the default).
fn completion_timeout_ms(processes: usize) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (1000 * processes.div_ceil(cores).clamp(1, 4)).to_string()
}

fault_test! {
    /// 4,096 comms between one process pair, 1,024 per NIC.
    fn setup_of_4096_comms_between_one_pair() {
        setup_at_scale(1, 1, 4096);
    }
}

fault_test! {
    /// All-to-all is not one pair: 8 senders and 8 receivers, 64 comms between each of
    /// the 64 process pairs, 4,096 in all.
    fn setup_all_to_all_of_8_by_8_processes() {
        setup_at_scale(8, 8, 64);
    }
}

fault_test! {
    fn killed_receiver_gives_the_sender_errors_not_a_hang() {
        killed_peer(true);
    }
}

fault_test! {
    fn killed_sender_gives_the_receiver_errors_not_a_hang() {
        killed_peer(false);
    }
}

fn killed_peer(kill_receiver: bool) {
    let tb = bed(2);
    let mut flow = Flow::start(
        &tb,
        FlowOpts {
            seconds: 10.0,
            ..FlowOpts::default()
        },
    );
    let comms = flow.dev_of.len();
    flow.wait_ticks(15);
    let t0 = unix_ms();
    if kill_receiver {
        flow.recv.kill();
    } else {
        flow.send.kill();
    }
    let started = Instant::now();
    let (recv, send) = flow.finish();
    let survivor = if kill_receiver { &send } else { &recv };
    println!(
        "survivor exited after {:?}: {}",
        started.elapsed(),
        survivor.brief()
    );
    assert_no_corruption(&recv, &send);
    assert!(survivor.exit.is_some(), "hung\n{}", survivor.brief());
    assert_eq!(
        survivor.summary.failed as usize,
        comms,
        "{}",
        survivor.brief()
    );
    assert_eq!(survivor.summary.stalled, 0, "{}", survivor.brief());
    assert_error_codes(survivor, t0, timeout_ms() + 2000);
}

/// Every error is ncclSystemError(2) or ncclRemoteError(6), the last within `bound_ms`
/// of the fault.
fn assert_error_codes(r: &Report, fault: u128, bound_ms: u128) {
    assert!(!r.errors.is_empty(), "no error reported\n{}", r.brief());
    for e in &r.errors {
        assert!(matches!(e.code, 2 | 6), "unexpected ncclResult {e:?}");
    }
    let last = r.errors.iter().map(|e| e.t).max().unwrap();
    println!(
        "{}: {} errors, last {} ms after the fault",
        r.role,
        r.errors.len(),
        last.saturating_sub(fault)
    );
    assert!(
        last <= fault + bound_ms,
        "errors took {} ms > {bound_ms} ms\n{}",
        last - fault,
        r.brief()
    );
}

// ---- failover scenarios (need the failover engine) ---------------------------------

/// Checks traffic on `comms` came back within timeout + 1 s of `fault`.
fn assert_resumed(recv: &Report, comms: &[usize], fault: u128, what: &str) {
    let limit = timeout_ms() + 1000;
    let took = recv.resume_after(comms, fault);
    println!("{what}: comms {comms:?} resumed after {took:?} ms (limit {limit})");
    assert!(
        took.is_some_and(|ms| ms <= limit),
        "{what}: traffic did not resume within {limit} ms: {took:?}\n{}",
        recv.brief()
    );
}

/// One failure with N links: aggregate ≥ 0.6 × (N−1)/N of before (P3).
fn assert_kept_bandwidth(recv: &Report, fault: u128, n: usize, failed: usize) {
    let all: Vec<usize> = (0..recv.ticks.first().map_or(0, |t| t.bytes.len())).collect();
    let before = recv.rate(&all, fault - 1500, fault);
    let settle = timeout_ms() + 1500;
    let after = recv.rate(&all, fault + settle, fault + settle + 3000);
    let want = 0.6 * (n - failed) as f64 / n as f64;
    println!(
        "aggregate {:.0} -> {:.0} Mbit/s ({:.2} of before, need {want:.2})",
        before * 8.0 / 1e6,
        after * 8.0 / 1e6,
        after / before
    );
    assert!(
        after >= want * before,
        "kept {:.2} of the bandwidth",
        after / before
    );
}

fault_test! {
    /// Comms NCCL opens on a drained NIC run on another pair from their first message
    /// (`docs/design.md` §5.8): rv0 is named in the drain file of both processes before
    /// any comm opens, then 4 comms connect, two of them on rv0, and send 512 KiB
    /// messages. Their handshakes cross rv0 (it still works); their data must not: rv0
    /// carries less than one message's worth from A while every byte arrives once. The
    /// first comm finds no pair known healthy yet, so its messages also wait for the
    /// probe of rv1's pair.
    fn comms_opened_on_a_drained_nic_send_nothing_over_it() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("drain");
        std::fs::write(&file, "rv0\n").unwrap();
        let before = tb.tx_bytes(Side::A);
        let size = 512 << 10;
        let flow = Flow::start(
            &tb,
            FlowOpts {
                per_dev: 2,
                size,
                seconds: 4.0,
                env: vec![
                    ("RAILOVER_CONTROL_DIR", dir.path().to_str().unwrap().to_owned()),
                    ("RAILOVER_DRAIN_FILE", file.to_str().unwrap().to_owned()),
                ],
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        let on_rv0 = flow.dev_of.iter().filter(|&&d| d == 0).count();
        let (recv, send) = flow.finish();
        let after = tb.tx_bytes(Side::A);
        assert_delivered_exactly_once(&recv, &send, comms);
        assert!(!send.stderr.contains(" failover comm="), "{}", send.stderr_tail);
        let moved = send.stderr.matches("railover: drain comm=").count();
        assert!(moved >= on_rv0, "{moved} drain moves for {on_rv0} comms opened on rv0");
        let (rv0, rv1) = (after[0] - before[0], after[1] - before[1]);
        println!("bytes sent from A: rv0 {rv0}, rv1 {rv1}");
        assert!(
            rv0 < size as u64,
            "rv0 carried {rv0} B, at least a {size} B message, while drained; rv1 {rv1} B"
        );
        assert!(rv1 > 8 * size as u64, "rv1 carried only {rv1} B");
    }
}

fault_test! {
    fn comms_opened_while_a_nic_is_down_connect_over_another_rail_and_move_home_when_it_heals() {
        if needs_failover() {
            return;
        }
        // B's end down: A's rv0 has no carrier when the sender starts, so no link event
        // will say so; the sender knows it from sysfs and goes over rv1 at once.
        connect_while_down(
            |tb| tb.link_down(Side::B, 0),
            |tb| tb.link_up(Side::B, 0),
            "rv0 without carrier",
        );
    }
}

fault_test! {
    fn comms_opened_while_a_peer_nic_is_silent_connect_over_another_rail_and_move_home_when_it_heals() {
        if needs_failover() {
            return;
        }
        // Carrier up, no error, no answer: what B sends on rv0 vanishes, so the connects
        // on rv0 hear nothing back, and move to rv1 after the reach limit.
        connect_while_down(
            |tb| tb.blackhole(Side::B, 0),
            |tb| tb.unblackhole(Side::B, 0),
            "B's rv0 blackholed",
        );
    }
}

/// NCCL connects lazily, and communicators are made mid-job: comms opened on a NIC that
/// is down (`fault`, after the receiver listens and before the sender connects) must
/// connect, deliver everything once, and return to that NIC when it heals (`heal`).
fn connect_while_down(fault: impl Fn(&Testbed), heal: impl Fn(&Testbed), what: &str) {
    let tb = bed(2);
    let size = 256 << 10;
    let flow = Flow::start_after(
        &tb,
        FlowOpts {
            size,
            seconds: 14.0,
            ..FlowOpts::default()
        },
        || fault(&tb),
    );
    let comms = flow.dev_of.len();
    let on_rv0 = flow.comms_on(&[0]);
    flow.wait_ticks(20);
    heal(&tb);
    let healed = unix_ms();
    // Fail-back waits for K good probes a second apart: give it that and a margin, then
    // see rv0 carry the comms again.
    flow.wait_more_ticks(60);
    let per_nic = nic_rates(&tb, Duration::from_secs(2));
    let (recv, send) = flow.finish();
    println!(
        "{what}: per-NIC after the heal (Mbit/s): {:?}",
        per_nic
            .iter()
            .map(|x| (x * 8.0 / 1e6) as u64)
            .collect::<Vec<_>>()
    );
    assert_delivered_exactly_once(&recv, &send, comms);
    let over = (send.stderr.lines())
        .filter(|l| l.contains("railover: comm ") && l.contains(" connected to "))
        .count();
    assert_eq!(
        over,
        on_rv0.len(),
        "{what}: {over} comms connected over another pair, {} were opened on rv0\n{}",
        on_rv0.len(),
        send.stderr_tail
    );
    let failovers = send.stderr.matches("railover: failover comm=").count();
    let failbacks = send.stderr.matches("railover: failback comm=").count();
    println!("{what}: {failovers} failover and {failbacks} failback lines; healed at {healed}");
    for l in send.stderr.lines().filter(|l| {
        l.contains(" connected to ") || l.contains("railover: fail") || l.contains("trying NIC")
    }) {
        println!("  sender: {l}");
    }
    // One failover per comm, off NCCL's pair: the move the router made at the connect.
    let from_rv0 = (send.stderr.lines())
        .filter(|l| l.contains("railover: failover comm=") && l.contains(" rv0->"))
        .count();
    assert_eq!(
        (failovers, from_rv0),
        (on_rv0.len(), on_rv0.len()),
        "{what}: {failovers} failover lines, {from_rv0} from rv0, for {} comms opened on rv0\n{}",
        on_rv0.len(),
        send.stderr_tail
    );
    assert!(
        failbacks >= on_rv0.len(),
        "{what}: {failbacks} fail-backs for {} comms opened on rv0\n{}",
        on_rv0.len(),
        send.stderr_tail
    );
    let link = link_bytes_per_s(&tb);
    assert!(
        per_nic[0] > 0.25 * link,
        "{what}: rv0 carries only {:.0} B/s after the heal (link {link:.0} B/s)",
        per_nic[0]
    );
}

/// Per-NIC load after failover, from the interface counters: every surviving NIC
/// carries a real share (a stand-in for the lane rule until lanes are exposed).
fn nic_rates(tb: &Testbed, window: Duration) -> Vec<f64> {
    let a = tb.tx_bytes(Side::A);
    let t = Instant::now();
    // Polling interface counters over a measured window: the window is the measurement.
    std::thread::sleep(window);
    let b = tb.tx_bytes(Side::A);
    let s = t.elapsed().as_secs_f64();
    a.iter().zip(&b).map(|(x, y)| (y - x) as f64 / s).collect()
}

/// P3's lane rule at time `at`, from the placement the sender's plugin published.
fn check_lanes(send: &Report, failed: &[usize], at: u128) {
    match lane_placement(send, at) {
        Some(p) => {
            println!("lanes per NIC at the measurement: {p:?}");
            check_lane_balance(&p, failed).unwrap_or_else(|e| panic!("lane balance: {e}"));
        }
        None => println!(
            "TODO(lane placement): the plugin published no lanes per NIC; \
             ⌈lanes/(N−1)⌉+1 not asserted"
        ),
    }
}

fault_test! {
    fn failover_link_down_on_a_side_moves_traffic_to_the_other_rails() {
        if needs_failover() {
            return;
        }
        let tb = bed(4);
        let flow = Flow::start(&tb, FlowOpts { seconds: 10.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 0);
        // Let failover settle (the receiver's ticks are the clock), then measure each NIC.
        flow.wait_more_ticks((timeout_ms() / 100 + 15) as usize);
        let per_nic = nic_rates(&tb, Duration::from_secs(2));
        let measured = unix_ms();
        let (recv, send) = flow.finish();
        for i in -1..8i64 {
            let a = (t0 as i64 + i * 500) as u128;
            println!("  t0{:+.1}s: hit {:.1} Mbit/s", i as f64 / 2.0, recv.rate(&hit, a, a + 500) * 8.0 / 1e6);
        }
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "A-side link down");
        assert_kept_bandwidth(&recv, t0, 4, 1);
        let link = link_bytes_per_s(&tb);
        println!("per-NIC after failover (Mbit/s): {:?}", per_nic.iter().map(|x| (x * 8.0 / 1e6) as u64).collect::<Vec<_>>());
        for (nic, &x) in per_nic.iter().enumerate().skip(1) {
            assert!(x > 0.5 * link, "surviving NIC {nic} carries only {x:.0} B/s");
        }
        check_lanes(&send, &[0], measured);
        // P6: each move registered the comm's memory on the backup NIC, then and there.
        let moves: Vec<&str> = send.stderr_tail.lines().filter(|l| l.contains(" failover comm=")).collect();
        assert!(!moves.is_empty(), "no failover line in the sender's log:\n{}", send.stderr_tail);
        for l in moves {
            let n: usize = l
                .split("registered_on_backup=")
                .nth(1)
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0);
            assert!(n > 0, "a move registered nothing on its backup NIC: {l}");
        }
    }
}

/// What the slowest comm and the aggregate kept: steady windows before `cut` and after
/// failover settled, of a lockstep flow that sent for `seconds`.
fn kept_in_lockstep(recv: &Report, send: &Report, cut: u64, seconds: f64) -> kept::Kept {
    let start = recv.intervals.first().map_or(cut, |i| i.from);
    let sent_from = send.intervals.first().map_or(start, |i| i.from);
    let phases = kept::Phases {
        start,
        cut,
        up: None,
        end: sent_from + (seconds * 1000.0) as u64,
    };
    let w = kept::windows(
        phases,
        kept::Exclude {
            warmup: 1500,
            settle: timeout_ms() as u64 + 1500,
            failback: 0,
            guard: 250,
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    kept::kept(&recv.intervals, w.before, w.after, true).expect("ticks in both windows")
}

fault_test! {
    /// P3 as a collective feels it: 4 comms, one per rail, in lockstep (no comm more than
    /// 8 messages past the slowest, as NCCL's channels of one collective), rail 0 cut
    /// on A. The slowest comm must keep ≥ 0.85 × (N−1)/N of its rate; a failed NIC's
    /// comm moved whole onto one survivor halves that survivor's comms, and with them
    /// every comm (0.5).
    fn failover_lockstep_keeps_share() {
        if needs_failover() {
            return;
        }
        const N: usize = 4;
        const K: usize = 8;
        let tb = bed(N);
        let seconds = 12.0;
        let flow = Flow::start(
            &tb,
            FlowOpts {
                comms: Some(N),
                lockstep: Some(K),
                tick_ms: 250,
                seconds,
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        // 5 s of steady traffic (the receiver's ticks are the clock), then the cut.
        flow.wait_ticks(20);
        let cut = unix_ms() as u64;
        tb.link_down(Side::A, 0);
        let (recv, send) = flow.finish();
        let k = kept_in_lockstep(&recv, &send, cut, seconds);
        let mbit = |v: &[f64]| v.iter().map(|x| (x * 8.0 / 1e6).round() as u64).collect::<Vec<_>>();
        println!(
            "lockstep N={N} C={comms} K={K}: per comm {:?} -> {:?} Mbit/s (windows {} / {} ms)",
            mbit(&k.before.per_comm),
            mbit(&k.after.per_comm),
            k.before.covered_ms,
            k.after.covered_ms
        );
        let want = 0.85 * kept::ideal(N);
        println!(
            "kept: slowest comm {:.2} (need {want:.2}; ideal {:.2}, NCCL native 0.50), aggregate {:.2}",
            k.slowest,
            kept::ideal(N),
            k.aggregate
        );
        assert_delivered_exactly_once(&recv, &send, comms);
        // The sender held the comms together: their message counts end within K.
        let msgs: Vec<u64> = recv.ends.iter().map(|e| e.1).collect();
        let spread = msgs.iter().max().unwrap() - msgs.iter().min().unwrap();
        println!("messages per comm at END: {msgs:?}");
        // How the failed NIC's comm was spread, for a failure to be read.
        for l in send.stderr.lines().filter(|l| l.contains(" failover comm=")) {
            println!("  {l}");
        }
        assert!(spread <= K as u64, "comms drifted {spread} > {K} messages apart: {msgs:?}");
        assert!(
            k.slowest >= want,
            "the slowest comm kept {:.2} of its rate, need {want:.2}",
            k.slowest
        );
    }
}

/// One lockstep run for weighted striping: the rails at `mbit` Mbit/s (both ends; rail 0
/// is cut on A after 5 s), `comms` comms (K = 8), `RAILOVER_STRIPE_WEIGHTS=weights`.
/// Returns what the slowest comm kept.
fn kept_at_rates(mbit: &[u64], comms: usize, weights: &str) -> f64 {
    let tb = bed(mbit.len());
    for (rail, &m) in mbit.iter().enumerate() {
        if m != DEFAULT_RATE_MBIT {
            for side in [Side::A, Side::B] {
                tb.set_rate_kbit(side, rail, m * 1000);
            }
        }
    }
    let seconds = 12.0;
    let flow = Flow::start(
        &tb,
        FlowOpts {
            comms: Some(comms),
            lockstep: Some(8),
            tick_ms: 250,
            seconds,
            env: vec![("RAILOVER_STRIPE_WEIGHTS", weights.to_string())],
            ..FlowOpts::default()
        },
    );
    flow.wait_ticks(20);
    let cut = unix_ms() as u64;
    tb.link_down(Side::A, 0);
    let (recv, send) = flow.finish();
    assert_delivered_exactly_once(&recv, &send, comms);
    let k = kept_in_lockstep(&recv, &send, cut, seconds);
    let mbit = |v: &[f64]| {
        v.iter()
            .map(|x| (x * 8.0 / 1e6).round() as u64)
            .collect::<Vec<_>>()
    };
    println!(
        "  {weights:>8}: per comm {:?} -> {:?} Mbit/s; slowest kept {:.2}",
        mbit(&k.before.per_comm),
        mbit(&k.after.per_comm),
        k.slowest
    );
    let moved = |l: &&str| l.contains(" failover comm=") || l.contains(" rebalance comm=");
    for l in send.stderr.lines().filter(moved) {
        println!("    {l}");
    }
    k.slowest
}

fault_test! {
    /// Striping weighted by what survivors carry (`docs/design.md` §5.3): rails at
    /// unequal rates, C = 4 and 8 comms in lockstep, rail 0 cut on A. The shapers are
    /// invisible to sysfs (every veth says 10 Gb/s), so the weights come from measured
    /// rates: the NICs that pace the collective back up and show what they carry. The
    /// target is that the slowest comm keeps ≥ 0.9 × the capacity-optimal share that
    /// `railover sim --lockstep --speeds` computes (printed); the optimum runs the 200
    /// Mbit/s survivor at 100 % of its link, which TCP through tbf reaches in most runs
    /// and misses by a few per cent in some (0.90–1.04 measured), so the test asserts
    /// ≥ 0.85 × optimal and within 0.15 of that model's own placement. Equal striping
    /// (`RAILOVER_STRIPE_WEIGHTS=equal`) runs beside it for the record, and must fall
    /// short of 0.9 × optimal, or the case would not tell weights from none.
    fn failover_weighted_striping_keeps_the_capacity_optimal_share() {
        if needs_failover() {
            return;
        }
        let mut failed = Vec::new();
        // The example (the 200 survivor takes it all), and three speeds, where the failed
        // NIC's stripes split unevenly over a 200 and a 150.
        for mbit in [[200u64, 200, 100, 100], [200, 200, 150, 100]] {
            for comms in [4usize, 8] {
                let speeds = mbit.map(|m| m.to_string()).join(",");
                let (code, json) = railover(&[
                    "sim", "--lockstep", "--speeds", &speeds, "--comms", &comms.to_string(), "--json",
                ]);
                assert_eq!(code, 0);
                let rows: serde_json::Value = serde_json::from_str(&json).expect("sim JSON");
                let model = |k: &str| rows[0][k].as_f64().unwrap_or_else(|| panic!("{k} in {json}"));
                let (optimal, predicted) = (model("optimal"), model("weighted"));
                println!("{speeds} Mbit/s, C = {comms}: optimal {optimal:.2}, model {predicted:.2}, equal model {:.2}", model("equal"));
                let weighted = kept_at_rates(&mbit, comms, "capacity");
                let equal = kept_at_rates(&mbit, comms, "equal");
                println!(
                    "{speeds} C={comms}: capacity-weighted kept {weighted:.2} (need {:.2}), equal striping {equal:.2}",
                    0.9 * optimal
                );
                if weighted < 0.85 * optimal
                    || (weighted - predicted).abs() > 0.15
                    || equal > 0.9 * optimal
                {
                    failed.push(format!(
                        "{speeds} C={comms}: weighted {weighted:.2}, equal {equal:.2}, optimal {optimal:.2}, model {predicted:.2}"
                    ));
                }
            }
        }
        assert!(failed.is_empty(), "weighted striping fell short:\n{}", failed.join("\n"));
    }
}

fault_test! {
    /// Weights that adapt after the cut (`docs/design.md` §5.2): rails at 200, 200, 200
    /// and 100 Mbit/s, C = 3 comms in lockstep on rails 0–2 (rail 3 idle, so nothing has
    /// shown it is slow), rail 0 cut on A. The failed NIC's stripes first go to the idle
    /// rail 3, which backs up at 100 Mbit/s; they then move on to rails 1 and 2 in planned
    /// moves (`rebalance` lines), and rails 1 and 2 backing up in turn hand some back.
    /// Nothing may be lost, and the slowest comm must keep more than equal weights give and
    /// at least 0.8 × the capacity-optimal share (measured 2026-12-07: 0.75 of an optimal
    /// 0.83; equal weights 0.50).
    fn failover_a_backup_found_slow_hands_on_its_stripes() {
        if needs_failover() {
            return;
        }
        let mbit = [200u64, 200, 200, 100];
        let weighted = kept_at_rates(&mbit, 3, "capacity");
        let equal = kept_at_rates(&mbit, 3, "equal");
        let (code, json) = railover(&["sim", "--lockstep", "--speeds", "200,200,200,100", "--comms", "3", "--json"]);
        assert_eq!(code, 0);
        let rows: serde_json::Value = serde_json::from_str(&json).expect("sim JSON");
        let optimal = rows[0]["optimal"].as_f64().expect("optimal");
        println!("200,200,200,100 C=3: capacity-weighted kept {weighted:.2}, equal {equal:.2}, optimal {optimal:.2}");
        // Without the hand-on every comm would stay paced by rail 3, as with equal weights.
        assert!(weighted > equal + 0.05, "weighted {weighted:.2} vs equal {equal:.2}");
        assert!(weighted >= 0.8 * optimal, "weighted {weighted:.2} < 0.8 x optimal {optimal:.2}");
    }
}

fault_test! {
    /// A storm at the scale jobs open comms: 1,024 comms (256 per NIC over 4 rails) in
    /// lockstep, rail 0 cut on A. Every one of the 256 displaced comms opens lanes to the
    /// three survivors at once, behind queues that already fill the links. None may be
    /// lost, each must resume within detection + 1 s, nothing may arrive twice, and the
    /// slowest comm must keep ≥ 0.85 × (N−1)/N, over windows in which every comm completes
    /// at least 50 messages.
    fn failover_storm_of_1024_comms_loses_none() {
        if needs_failover() {
            return;
        }
        const N: usize = 4;
        const C: usize = 1024;
        const K: usize = 8;
        const SIZE: usize = 8 << 10;
        let tb = bed(N);
        let seconds = 36.0;
        let flow = Flow::start(
            &tb,
            FlowOpts {
                comms: Some(C),
                lockstep: Some(K),
                tick_ms: 250,
                size: SIZE,
                depth: 4,
                seconds,
                grace: 10.0,
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        assert_eq!((comms, hit.len()), (C, C / N));
        // 12 s of steady traffic (the receiver's ticks are the clock), then the cut.
        flow.wait_ticks(48);
        let cut = unix_ms();
        tb.link_down(Side::A, 0);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        // Each displaced comm's first message on its new path, after detection: the
        // sender's failover line for it says when (`resume=`).
        let mut resumed: Vec<(usize, f64)> = send
            .stderr
            .lines()
            .filter(|l| l.contains(" failover comm="))
            .filter_map(|l| {
                let field = |k: &str| l.split(k).nth(1)?.split(|c: char| !c.is_ascii_digit() && c != '.').next();
                Some((field("comm=")?.parse().ok()?, field("resume=")?.parse().ok()?))
            })
            .collect();
        resumed.sort_by(|a, b| a.1.total_cmp(&b.1));
        let moved: std::collections::BTreeSet<usize> = resumed.iter().map(|&(c, _)| c).collect();
        let slowest = resumed.last().copied();
        println!(
            "storm: {} failover lines for {} comms; the slowest first message on a new path {slowest:?} ms after detection; \
             every displaced comm flowing steadily again after {:?} ms",
            resumed.len(),
            moved.len(),
            recv.resume_after(&hit, cut)
        );
        // The plugin numbers its comms itself: count them.
        assert_eq!(moved.len(), hit.len(), "not every displaced comm moved (or others did too)");
        let limit = 1000.0;
        assert!(
            slowest.is_some_and(|(_, ms)| ms <= limit),
            "a comm resumed {slowest:?} ms after detection, limit {limit} ms"
        );
        let k = kept_in_lockstep(&recv, &send, cut as u64, seconds);
        // The least a comm completed in a window: its least rate over the window.
        let fewest = |r: &kept::Rates| r.least * r.covered_ms as f64 / 1000.0 / SIZE as f64;
        let (before, after) = (fewest(&k.before), fewest(&k.after));
        let want = 0.85 * kept::ideal(N);
        println!(
            "storm N={N} C={comms} K={K}: slowest comm kept {:.2} (need {want:.2}), aggregate {:.2}; \
             fewest messages per comm in a window: {before:.0} before, {after:.0} after ({} / {} ms)",
            k.slowest, k.aggregate, k.before.covered_ms, k.after.covered_ms
        );
        assert!(
            before >= 50.0 && after >= 50.0,
            "windows too short to judge: a comm completed only {before:.0} / {after:.0} messages"
        );
        assert!(
            k.slowest >= want,
            "the slowest comm kept {:.2} of its rate, need {want:.2}",
            k.slowest
        );
    }
}

fault_test! {
    fn failover_link_down_on_b_side_moves_traffic() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 8.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::B, 0);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "B-side link down");
    }
}

fault_test! {
    fn failover_link_down_on_both_sides_of_a_pair_moves_traffic() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 8.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 0);
        tb.link_down(Side::B, 0);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "both ends of a pair down");
    }
}

/// A rate cut to 1 % on A's end of rail 0, with `env` for both plugins.
fn brownout(env: Vec<(&'static str, String)>, what: &str) {
    let tb = bed(4);
    let flow = Flow::start(
        &tb,
        FlowOpts {
            seconds: 10.0,
            env,
            ..FlowOpts::default()
        },
    );
    let comms = flow.dev_of.len();
    let hit = flow.comms_on(&[0]);
    flow.wait_ticks(20);
    let t0 = unix_ms();
    tb.set_rate_kbit(Side::A, 0, tb.rate_mbit() * 10);
    let (recv, send) = flow.finish();
    let before = recv.rate(&hit, t0 - 1500, t0);
    let from = t0 + timeout_ms() + 1000;
    let after = recv.rate(&hit, from, from + 3000);
    println!(
        "browned-out comms: {:.1} -> {:.1} Mbit/s",
        before * 8.0 / 1e6,
        after * 8.0 / 1e6
    );
    for i in -2..12i64 {
        let a = (t0 as i64 + i * 500) as u128;
        let all: Vec<usize> = (0..comms).collect();
        println!(
            "  t0{:+.1}s: hit {:.1} Mbit/s, all {:.1} Mbit/s",
            i as f64 / 2.0,
            recv.rate(&hit, a, a + 500) * 8.0 / 1e6,
            recv.rate(&all, a, a + 500) * 8.0 / 1e6
        );
    }
    assert_no_corruption(&recv, &send);
    // The bounds: the browned-out comms move (traffic on them resumes within
    // timeout + 1 s, the detector needing one full timeout of slow progress) and the
    // aggregate keeps (N-1)/N.
    assert_resumed(&recv, &hit, t0, what);
    // The probes of the browned-out pair keep failing: it never gets the traffic back.
    assert!(
        !send.stderr_tail.contains("failback"),
        "traffic moved back onto the browned-out pair:\n{}",
        send.stderr_tail
    );
    assert_delivered_exactly_once(&recv, &send, comms);
    assert_kept_bandwidth(&recv, t0, 4, 1);
    // The moved comms share their new NICs evenly with the incumbents (pacing caps),
    // rather than starving behind them: at least a third of what they had.
    assert!(
        after >= before / 3.0,
        "the moved comms run at {:.1} Mbit/s, against {:.1} before",
        after * 8.0 / 1e6,
        before * 8.0 / 1e6
    );
}

fault_test! {
    fn failover_brownout_to_one_percent_moves_traffic() {
        if needs_failover() {
            return;
        }
        brownout(Vec::new(), "1 % brown-out");
    }
}

fault_test! {
    fn failover_brownout_probes_must_show_the_rate_not_just_answer() {
        if needs_failover() {
            return;
        }
        // A probe deadline long enough for the 256 KiB probe to cross the 1 % link: only
        // the probe's measured rate keeps the traffic off the browned-out pair.
        brownout(
            vec![("RAILOVER_PROBE_TIMEOUT_MS", "5000".into())],
            "1 % brown-out, 5 s probe deadline",
        );
    }
}

fault_test! {
    fn pacing_gives_way_when_a_lane_is_held_back_elsewhere() {
        // Two comms share rail 0. One lane then meets a bottleneck of its own (10 % of
        // the link, as when its far end is congested by other senders); the other must
        // get the rest of the link. Pacing caps of half the link each would hold it to
        // 1.15 / 2 of it: the caps must notice the idle NIC and give way.
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 14.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let on_rail0 = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        let ports = tb.tcp_ports(Side::A, 0);
        assert_eq!(ports.len(), 2, "one lane per comm on rail 0: {ports:?}");
        let t0 = unix_ms();
        tb.squeeze_flow(Side::A, 0, ports[0], tb.rate_mbit() * 100);
        flow.wait_more_ticks(100);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        let (from, to) = (t0 + 2000, t0 + 10000);
        let mut rates: Vec<f64> = on_rail0.iter().map(|&c| recv.rate(&[c], from, to)).collect();
        rates.sort_by(f64::total_cmp);
        let (slow, fast) = (rates[0], rates[1]);
        let link = link_bytes_per_s(&tb);
        println!(
            "rail 0: squeezed lane {:.1} Mbit/s, the other {:.1} Mbit/s (link {:.0})",
            slow * 8.0 / 1e6,
            fast * 8.0 / 1e6,
            link * 8.0 / 1e6
        );
        assert!(slow < 0.15 * link, "the squeeze did not take: {slow:.0} B/s");
        assert!(
            fast >= 0.75 * (link - slow),
            "the free lane got {:.1} Mbit/s of the {:.1} left",
            fast * 8.0 / 1e6,
            (link - slow) * 8.0 / 1e6
        );
    }
}

fault_test! {
    fn failover_silent_blackhole_both_ways_is_caught_by_the_completion_timeout() {
        if needs_failover() {
            return;
        }
        blackhole(&[Side::A, Side::B]);
    }
}

fault_test! {
    fn failover_silent_blackhole_one_way_is_caught_by_the_completion_timeout() {
        if needs_failover() {
            return;
        }
        blackhole(&[Side::A]);
    }
}

/// Carrier stays up, packets vanish (sent by `sides` on rail 0): no socket error, no
/// netlink event; only the completion timeout (P1) can notice.
fn blackhole(sides: &[Side]) {
    let tb = bed(2);
    let flow = Flow::start(
        &tb,
        FlowOpts {
            seconds: 8.0,
            ..FlowOpts::default()
        },
    );
    let comms = flow.dev_of.len();
    let hit = flow.comms_on(&[0]);
    flow.wait_ticks(20);
    let t0 = unix_ms();
    for &s in sides {
        tb.blackhole(s, 0);
    }
    let (recv, send) = flow.finish();
    let took = recv.resume_after(&hit, t0);
    println!("blackhole {sides:?}: hit comms resumed after {took:?} ms");
    assert_no_corruption(&recv, &send);
    assert_delivered_exactly_once(&recv, &send, comms);
    assert_resumed(&recv, &hit, t0, "silent blackhole");
}

fault_test! {
    fn failover_flapping_link_loses_nothing() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 12.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        tb.flap(Side::A, 0, Duration::from_millis(300), 10);
        let t_end = unix_ms();
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t_end, "after flapping");
    }
}

fault_test! {
    fn failover_two_nics_down_one_after_the_other() {
        if needs_failover() {
            return;
        }
        let tb = bed(4);
        let flow = Flow::start(&tb, FlowOpts { seconds: 11.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 0);
        flow.wait_more_ticks(30);
        let t1 = unix_ms();
        tb.link_down(Side::A, 1);
        let first = flow.comms_on(&[0]);
        let both = flow.comms_on(&[0, 1]);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &first, t0, "first NIC down");
        assert_resumed(&recv, &both, t1, "second NIC down");
        check_lanes(&send, &[0], t1 - 100);
        check_lanes(&send, &[0, 1], t1 + timeout_ms() + 1500);
    }
}

fault_test! {
    fn failover_backup_fails_during_migration() {
        if needs_failover() {
            return;
        }
        // Three rails: rail 0 fails, and 300 ms later (while rail 0's comms are still
        // being detected/probed/replayed) rail 1, one of the two backups, fails too.
        let tb = bed(3);
        let flow = Flow::start(&tb, FlowOpts { seconds: 9.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0, 1]);
        flow.wait_ticks(20);
        tb.link_down(Side::A, 0);
        flow.wait_more_ticks(3);
        let t1 = unix_ms();
        tb.link_down(Side::A, 1);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t1, "backup failed during migration");
        check_lanes(&send, &[0, 1], t1 + timeout_ms() + 1500);
    }
}

fault_test! {
    fn failover_two_nics_down_at_once() {
        if needs_failover() {
            return;
        }
        let tb = bed(4);
        let flow = Flow::start(&tb, FlowOpts { seconds: 9.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0, 1]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 0);
        tb.link_down(Side::A, 1);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "two NICs down");
        assert_kept_bandwidth(&recv, t0, 4, 2);
        check_lanes(&send, &[0, 1], t0 + timeout_ms() + 1500);
    }
}

fault_test! {
    fn failover_all_but_one_nic_down() {
        if needs_failover() {
            return;
        }
        let tb = bed(4);
        let flow = Flow::start(&tb, FlowOpts { seconds: 9.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0, 1, 2]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        for r in 0..3 {
            tb.link_down(Side::A, r);
        }
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "all but one NIC down");
        assert_kept_bandwidth(&recv, t0, 4, 3);
        check_lanes(&send, &[0, 1, 2], t0 + timeout_ms() + 1500);
    }
}

fault_test! {
    fn failover_all_nics_down_fails_every_request_promptly() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 8.0, grace: 5.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        flow.wait_ticks(20);
        tb.link_down(Side::A, 0);
        // No pair is left once the last NIC is down: the bound runs from there (taking a
        // loaded veth down can itself take about a second).
        let t_last = unix_ms();
        tb.link_down(Side::A, 1);
        let (recv, send) = flow.finish();
        assert_no_corruption(&recv, &send);
        for r in [&recv, &send] {
            assert!(r.exit.is_some(), "{} hung", r.role);
            assert_eq!(r.summary.failed as usize, comms, "every comm fails\n{}", r.brief());
            assert_eq!(r.summary.stalled, 0, "a request never completed\n{}", r.brief());
            assert_error_codes(r, t_last, timeout_ms() + 2000);
        }
    }
}

fault_test! {
    fn failover_traffic_fails_back_when_the_link_returns() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 12.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 0);
        flow.wait_more_ticks(30);
        let up = Instant::now();
        tb.link_up(Side::A, 0);
        tb.wait_carrier(Duration::from_secs(5)).unwrap();
        // Poll rail 0's counter until it carries a real share again, bounded by
        // the fail-back limit.
        let limit = Duration::from_millis((failback_ms() + 1000) as u64);
        let link = link_bytes_per_s(&tb);
        let mut back = None;
        while up.elapsed() < limit + Duration::from_millis(500) {
            if nic_rates(&tb, Duration::from_millis(250))[0] > 0.25 * link {
                back = Some(up.elapsed());
                break;
            }
        }
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &hit, t0, "link down before fail-back");
        println!("fail-back after {back:?} (limit {limit:?})");
        assert!(back.is_some_and(|b| b <= limit), "no fail-back within {limit:?}: {back:?}");
    }
}

fault_test! {
    fn failover_a_watched_original_pair_takes_traffic_when_its_backup_fails() {
        if needs_failover() {
            return;
        }
        // Rail 0 is cut and restored: its comms wait on rail 1 while rail 0 serves its
        // fail-back test. Rail 1 is cut before that test is over: rail 0 is up, so every
        // comm must go there rather than be given up.
        let tb = bed(2);
        let flow = Flow::start(&tb, FlowOpts { seconds: 9.0, ..FlowOpts::default() });
        let comms = flow.dev_of.len();
        let all: Vec<usize> = (0..comms).collect();
        flow.wait_ticks(20);
        tb.link_down(Side::A, 0);
        flow.wait_more_ticks(8);
        tb.link_up(Side::A, 0);
        tb.wait_carrier(Duration::from_secs(5)).unwrap();
        flow.wait_more_ticks(8);
        let t1 = unix_ms();
        tb.link_down(Side::A, 1);
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert_resumed(&recv, &all, t1, "backup cut while the original pair was watched");
        check_lanes(&send, &[1], t1 + timeout_ms() + 1500);
    }
}

fault_test! {
    fn failover_a_missed_probe_on_a_busy_link_is_retried_not_final() {
        if needs_failover() {
            return;
        }
        // Another job keeps rail 0 full. The comm under test runs on rail 1, whose only
        // backup is rail 0, and its probes get 10 ms: 256 KiB needs 10.5 ms on an idle
        // 200 Mbit/s link, so the first probe always misses. Retries, each with a
        // doubled deadline, must carry it over.
        let tb = bed(2);
        let quiet = ("RAILOVER_METRICS_PORT", "0".to_string());
        let busy = Flow::start(
            &tb,
            FlowOpts {
                seconds: 14.0,
                devs: Some(vec![0]),
                env: vec![quiet.clone()],
                ..FlowOpts::default()
            },
        );
        let flow = Flow::start(
            &tb,
            FlowOpts {
                seconds: 12.0,
                per_dev: 1,
                devs: Some(vec![1]),
                env: vec![quiet, ("RAILOVER_PROBE_TIMEOUT_MS", "10".to_string())],
                ..FlowOpts::default()
            },
        );
        flow.wait_ticks(20);
        let t0 = unix_ms();
        tb.link_down(Side::A, 1);
        let (recv, send) = flow.finish();
        let (brecv, bsend) = busy.finish();
        assert_delivered_exactly_once(&recv, &send, 1);
        assert_delivered_exactly_once(&brecv, &bsend, bsend.summary.comms as usize);
        let missed = send.summary.probes_failed;
        // First delivery after the cut. The moved comm then competes with the other job's
        // full queues (TCP between processes, no shared pacing), so its rate is not judged.
        let first = recv.ticks.iter().find(|t| t.t > t0 && t.bytes[0] > 0).map(|t| t.t - t0);
        println!("probe misses before a pass: {missed}; first delivery {first:?} ms after the cut");
        assert!(missed >= 1, "a 10 ms probe passed on a loaded link?\n{}", send.brief());
        // Misses at 10, 20, 40 … 320 ms with 100 ms … 1 s between them: about 4.5 s here.
        assert!(
            first.is_some_and(|ms| ms <= 8000),
            "no delivery within 8 s of the cut: {first:?}\n{}",
            recv.brief()
        );
    }
}

/// One fault of the endurance schedule: which ends of which rails go down, for how long,
/// and how long everything then stays up.
#[derive(Debug)]
struct Flap {
    ends: Vec<(Side, usize)>,
    down: Duration,
    up: Duration,
}

/// A seeded schedule of flaps over `rails` rails lasting about `total`: one side of a
/// rail, both ends of a rail, or two rails at once; never every rail.
fn flap_schedule(seed: u64, rails: usize, total: Duration) -> Vec<Flap> {
    assert!(rails >= 3, "two rails at once must leave one up");
    let mut x = seed | 1;
    let mut next = move |n: u64| {
        // xorshift64*: small, seedable, good enough to pick faults.
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % n
    };
    let mut out = Vec::new();
    let mut t = Duration::ZERO;
    while t < total {
        let r = next(rails as u64) as usize;
        let side = if next(2) == 0 { Side::A } else { Side::B };
        let ends = match next(3) {
            0 => vec![(side, r)],
            1 => vec![(Side::A, r), (Side::B, r)],
            _ => {
                let r2 = (r + 1 + next(rails as u64 - 1) as usize) % rails;
                vec![(side, r), (Testbed::other(side), r2)]
            }
        };
        let down = Duration::from_millis(1000 + next(2001));
        let up = Duration::from_millis(2000 + next(3001));
        t += down + up;
        out.push(Flap { ends, down, up });
    }
    out
}

fault_test! {
    fn failover_endurance_random_flapping_never_all_rails() {
        if needs_failover() {
            return;
        }
        // RAILOVER_ENDURANCE_S (default 60; 180 or more for the full run) and
        // RAILOVER_ENDURANCE_SEED (default: from the clock, printed to replay).
        let secs: u64 = std::env::var("RAILOVER_ENDURANCE_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60);
        let seed: u64 = std::env::var("RAILOVER_ENDURANCE_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| unix_ms() as u64);
        let rails = 3;
        let plan = flap_schedule(seed, rails, Duration::from_secs(secs));
        let span: Duration = plan.iter().map(|f| f.down + f.up).sum();
        println!(
            "endurance: seed {seed} (RAILOVER_ENDURANCE_SEED={seed} replays it), {} flaps over {span:?}",
            plan.len()
        );
        let tb = bed(rails);
        let flow = Flow::start(
            &tb,
            FlowOpts { seconds: span.as_secs_f64() + 3.0, ..FlowOpts::default() },
        );
        let comms = flow.dev_of.len();
        flow.wait_ticks(20);
        for (i, f) in plan.iter().enumerate() {
            println!(
                "flap {i} at t={}: {:?} down for {:?}, then up for {:?}",
                unix_ms(),
                f.ends,
                f.down,
                f.up
            );
            for &(side, r) in &f.ends {
                tb.link_down(side, r);
            }
            // Fault pacing, not synchronisation: the timing is the fault.
            std::thread::sleep(f.down);
            for &(side, r) in &f.ends {
                tb.link_up(side, r);
            }
            std::thread::sleep(f.up);
        }
        let (recv, send) = flow.finish();
        println!(
            "endurance: {} messages, receiver probes failed {}, sender probes failed {}",
            recv.summary.msgs,
            recv.summary.probes_failed,
            send.summary.probes_failed
        );
        if recv.summary.req_errors + send.summary.req_errors > 0 || recv.exit != Some(0) {
            // A long run is worth its whole story when it fails.
            println!("--- receiver log ---\n{}\n--- sender log ---\n{}", recv.stderr, send.stderr);
        }
        assert_delivered_exactly_once(&recv, &send, comms);
    }
}

#[test]
fn flap_schedule_is_seeded_and_never_cuts_every_rail() {
    let total = Duration::from_secs(180);
    let a = flap_schedule(7, 3, total);
    let b = flap_schedule(7, 3, total);
    assert_eq!(
        format!("{a:?}"),
        format!("{b:?}"),
        "same seed, same schedule"
    );
    assert_ne!(
        format!("{a:?}"),
        format!("{:?}", flap_schedule(8, 3, total))
    );
    let span: Duration = a.iter().map(|f| f.down + f.up).sum();
    assert!(span >= total && span < total + Duration::from_secs(8));
    let mut kinds = [0; 3];
    for f in &a {
        let rails: std::collections::BTreeSet<usize> = f.ends.iter().map(|e| e.1).collect();
        assert!(rails.len() < 3, "{f:?} cuts every rail");
        assert!((1000..=3000).contains(&f.down.as_millis()), "{f:?}");
        assert!((2000..=5000).contains(&f.up.as_millis()), "{f:?}");
        kinds[match (f.ends.len(), rails.len()) {
            (1, _) => 0,
            (2, 1) => 1,
            _ => 2,
        }] += 1;
    }
    assert!(
        kinds.iter().all(|&k| k > 0),
        "every kind of flap occurs: {kinds:?}"
    );
}

#[test]
fn lane_balance_rule() {
    assert!(check_lane_balance(&[0, 3, 3, 2], &[0]).is_ok());
    assert!(check_lane_balance(&[0, 4, 2, 2], &[0]).is_ok());
    assert!(check_lane_balance(&[0, 5, 2, 1], &[0]).is_err());
    assert!(check_lane_balance(&[1, 3, 2, 2], &[0]).is_err());
    assert!(check_lane_balance(&[0, 0], &[0, 1]).is_err());
}

/// One instant query through `promtool`, run inside `side`'s namespace (where Prometheus
/// and the plugin's endpoint live on that namespace's loopback): the first value, if any.
fn prom_value(tb: &Testbed, prom: &str, expr: &str) -> Option<f64> {
    let out = tb
        .command(Side::A, "promtool")
        .args(["query", "instant", prom, expr])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| {
        l.split(" => ")
            .nth(1)?
            .split(" @")
            .next()?
            .trim()
            .parse()
            .ok()
    })
}

/// Polls `expr` until `ok` holds for its value, for at most `limit`.
fn prom_wait(
    tb: &Testbed,
    prom: &str,
    expr: &str,
    limit: Duration,
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let end = Instant::now() + limit;
    let mut last = None;
    while Instant::now() < end {
        last = prom_value(tb, prom, expr);
        if let Some(v) = last.filter(|v| ok(*v)) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("Prometheus: {expr} never reached the expected value (last {last:?})");
}

fault_test! {
    /// Real Prometheus scrapes the sending plugin while a link fails and comes back; its
    /// query API shows the bytes, the NIC going 1 -> 0 -> 1, the failover and the fail-back,
    /// and the NIC's downtime growing while it is down, its comms displaced and the process
    /// degraded until they are home.
    fn failover_prometheus_sees_the_failover_and_the_failback() {
        if needs_failover() {
            return;
        }
        let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let installed = std::process::Command::new("bash")
            .arg(root.join("scripts/install-prometheus.sh"))
            .status()
            .is_ok_and(|s| s.success());
        assert!(installed, "prometheus/promtool could not be installed (scripts/install-prometheus.sh)");
        let tb = bed(2);
        let dir = std::env::temp_dir().join(format!("railover-prom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let endpoint = "127.0.0.1:19464";
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\nscrape_configs:\n  - job_name: railover\n    static_configs:\n      - targets: ['{endpoint}']\n"
            ),
        )
        .unwrap();
        let mut cmd = tb.command(Side::A, "prometheus");
        cmd.arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .args(["--web.listen-address=127.0.0.1:19090", "--log.level=warn"]);
        let _prom = Proc::spawn(cmd, "prometheus").expect("start prometheus");
        let prom = "http://127.0.0.1:19090";
        // The plugin processes inherit these: each binds the endpoint on its namespace's
        // loopback (node A's is the one Prometheus scrapes).
        std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
        std::env::set_var("RAILOVER_METRICS_PORT", "19464");
        let flow = Flow::start(&tb, FlowOpts { seconds: 14.0, ..FlowOpts::default() });
        std::env::remove_var("RAILOVER_METRICS_ADDR");
        std::env::remove_var("RAILOVER_METRICS_PORT");
        let comms = flow.dev_of.len();
        let t = Duration::from_secs(15);
        let sent = "sum(railover_bytes_total{direction=\"tx\"})";
        let b1 = prom_wait(&tb, prom, sent, t, |v| v > 0.0);
        prom_wait(&tb, prom, "railover_nic_up{nic=\"rv0\"}", t, |v| v == 1.0);
        tb.link_down(Side::A, 0);
        prom_wait(&tb, prom, "railover_nic_up{nic=\"rv0\"}", t, |v| v == 0.0);
        let moved = prom_wait(&tb, prom, "sum(railover_failovers_total{nic=\"rv0\"})", t, |v| v >= 1.0);
        prom_wait(&tb, prom, "railover_lanes{nic=\"rv0\"}", t, |v| v == 0.0);
        // rv1 now carries every comm's lane: they share it under pacing caps.
        let paced = prom_wait(&tb, prom, "railover_paced_lanes{nic=\"rv1\"}", t, |v| v >= 2.0);
        let b2 = prom_wait(&tb, prom, sent, t, |v| v > b1);
        // While rv0 is still down its downtime grows, its comms count as displaced and the
        // process as degraded.
        let down = "railover_nic_down_seconds_total{nic=\"rv0\"}";
        let down1 = prom_wait(&tb, prom, down, t, |v| v >= 1.0);
        prom_wait(&tb, prom, down, t, |v| v > down1);
        let displaced = prom_wait(&tb, prom, "railover_comms_displaced", t, |v| v >= 1.0);
        prom_wait(&tb, prom, "railover_degraded", t, |v| v == 1.0);
        tb.link_up(Side::A, 0);
        prom_wait(&tb, prom, "railover_nic_up{nic=\"rv0\"}", t, |v| v == 1.0);
        let back = prom_wait(&tb, prom, "sum(railover_failbacks_total)", t, |v| v >= 1.0);
        prom_wait(&tb, prom, sent, t, |v| v > b2);
        // Every comm home again: no longer degraded; the time away stays counted.
        prom_wait(&tb, prom, "railover_degraded", t, |v| v == 0.0);
        prom_wait(&tb, prom, "railover_comms_displaced", t, |v| v == 0.0);
        let away = prom_wait(&tb, prom, "railover_comm_displaced_seconds_total", t, |v| v >= 1.0);
        let down2 = prom_wait(&tb, prom, down, t, |v| v > down1);
        println!("Prometheus saw: bytes {b1:.0} -> {b2:.0}, failovers {moved}, paced lanes on rv1 {paced}, failbacks {back}, rv0 down {down2:.0} s, {displaced:.0} comms displaced for {away:.0} comm-seconds");
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_log_digest_counts_lines_by_their_shape() {
    let log = "railover WARN 17: comm 3: lane on nic1 failed\n\
               railover WARN 18: comm 40: lane on nic0 failed\n\
               railover INFO 19: finalised";
    assert_eq!(
        log_digest(log),
        vec![
            (
                2,
                "railover WARN N: comm N: lane on nicN failed".to_string()
            ),
            (1, "railover INFO N: finalised".to_string()),
        ]
    );
}

// ---- drains (`docs/design.md` §5.8) --------------------------------------------------

/// Runs the `railover` command; its exit code and stdout.
fn railover(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_railover"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("railover {args:?}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!(
        "$ railover {}\n{text}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Per comm, the longest wait between two completions in the receiver's ticks ending in
/// `[from, to)` (milliseconds).
fn longest_gaps(r: &Report, comms: usize, from: u128, to: u128) -> Vec<u32> {
    let mut most = vec![0; comms];
    for t in r.ticks.iter().filter(|t| t.t >= from && t.t < to) {
        for (m, &g) in most.iter_mut().zip(&t.gaps) {
            *m = (*m).max(g);
        }
    }
    most
}

/// Running lanes on each of the sender's NICs over `[from, to)`, as the sender printed
/// them.
fn lanes_between(send: &Report, from: u128, to: u128) -> Vec<Vec<usize>> {
    (send.lanes.iter())
        .filter(|(t, _)| *t >= from && *t < to)
        .map(|(_, c)| c.clone())
        .collect()
}

fault_test! {
    /// An operator drains rv0 on both nodes with one command (two processes found in one
    /// control directory) while 8 comms run in lockstep, then undrains it. The drained
    /// comms move in planned moves: nothing is lost, sent twice or failed over, each comm
    /// pauses little beyond its usual gap between completions, no lane stays on rv0, and
    /// after the undrain the comms come home through the fail-back probes.
    fn drain_and_undrain_under_lockstep_traffic_lose_nothing() {
        if needs_failover() {
            return;
        }
        const N: usize = 4;
        const K: usize = 8;
        let tb = bed(N);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let flow = Flow::start(
            &tb,
            FlowOpts {
                comms: Some(2 * N),
                lockstep: Some(K),
                tick_ms: 100,
                size: 64 << 10,
                seconds: 14.0,
                env: vec![("RAILOVER_CONTROL_DIR", d.clone())],
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        let hit = flow.comms_on(&[0]);
        flow.wait_ticks(30);
        let drained_at = unix_ms();
        let (code, out) = railover(&["drain", "rv0", "--dir", &d]);
        assert_eq!(code, 0, "{out}");
        assert_eq!(out.matches("drained rv0").count(), 2, "both processes: {out}");
        flow.wait_more_ticks(40);
        let (code, out) = railover(&["status", "--dir", &d, "--json"]);
        assert_eq!(code, 0, "{out}");
        let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
        let procs = status.as_array().expect("an array of processes");
        assert_eq!(procs.len(), 2, "{status}");
        for p in procs {
            let r = p.get("result").unwrap_or(p);
            let rv0 = &r["nics"][0];
            assert_eq!(rv0["name"], "rv0", "{p}");
            assert_eq!(rv0["drained"], true, "{p}");
            assert_eq!(rv0["comms"], 0, "a comm still runs on rv0: {p}");
        }
        let undrained_at = unix_ms();
        let (code, out) = railover(&["undrain", "rv0", "--dir", &d]);
        assert_eq!(code, 0, "{out}");
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert!(
            !send.stderr.contains(" failover comm="),
            "a drain is not a failover:\n{}",
            send.stderr_tail
        );
        let moves = send.stderr.matches("railover: drain comm=").count();
        assert!(moves >= hit.len(), "{moves} drain moves for {} comms on rv0", hit.len());
        // No lane on rv0 once the moves settled, until the undrain.
        for c in lanes_between(&send, drained_at + 1_000, undrained_at) {
            assert_eq!(c[0], 0, "lanes per NIC while rv0 was drained: {c:?}");
        }
        // Home again through the fail-back probes.
        let back = lanes_between(&send, undrained_at, u128::MAX);
        assert!(
            back.last().is_some_and(|c| c[0] > 0),
            "nothing came back to rv0 after the undrain: {:?}",
            back.last()
        );
        // The pause a drain costs each comm, beyond its longest wait before it.
        let before = longest_gaps(&recv, comms, drained_at - 2_500, drained_at - 100);
        let during = longest_gaps(&recv, comms, drained_at, drained_at + 2_000);
        let extra: Vec<i64> = (before.iter().zip(&during))
            .map(|(&b, &d)| i64::from(d) - i64::from(b))
            .collect();
        println!("longest gap per comm before the drain {before:?} ms, after it {during:?} ms");
        let worst = extra.iter().copied().max().unwrap_or(0);
        println!("drain pause beyond the usual gap: worst comm {worst} ms (target < 50 ms)");
        assert!(
            worst < 200,
            "a comm paused {worst} ms beyond its usual gap: before {before:?}, after {during:?}"
        );
    }
}

fault_test! {
    /// With two rails and rv1 drained on both nodes, draining rv0 too is refused, saying
    /// why, and changes nothing; the traffic runs on untouched.
    fn draining_the_last_rail_is_refused_saying_why() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let flow = Flow::start(
            &tb,
            FlowOpts {
                per_dev: 1,
                size: 64 << 10,
                seconds: 8.0,
                env: vec![("RAILOVER_CONTROL_DIR", d.clone())],
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        flow.wait_ticks(20);
        let (code, out) = railover(&["drain", "rv1", "--dir", &d]);
        assert_eq!(code, 0, "{out}");
        flow.wait_more_ticks(10);
        let (code, out) = railover(&["drain", "rv0", "--dir", &d]);
        assert_ne!(code, 0, "draining the last rail was accepted: {out}");
        assert_eq!(out.matches("refused").count(), 2, "{out}");
        assert!(out.contains("last NIC"), "the refusal says why: {out}");
        let (_, out) = railover(&["status", "--dir", &d, "--json"]);
        let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
        for p in status.as_array().expect("an array") {
            let r = p.get("result").unwrap_or(p);
            assert_eq!(r["nics"][0]["drained"], false, "{p}");
            assert_eq!(r["nics"][1]["drained"], true, "{p}");
        }
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
    }
}

fault_test! {
    /// The watched drain file drains as the socket does: naming rv1 in it moves the
    /// sender's traffic off rv1, and taking the name out brings it back.
    fn a_drain_file_drains_and_undrains_like_the_socket() {
        if needs_failover() {
            return;
        }
        let tb = bed(2);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("drain");
        let flow = Flow::start(
            &tb,
            FlowOpts {
                per_dev: 2,
                size: 64 << 10,
                seconds: 12.0,
                env: vec![
                    ("RAILOVER_CONTROL_DIR", dir.path().to_str().unwrap().to_owned()),
                    ("RAILOVER_DRAIN_FILE", file.to_str().unwrap().to_owned()),
                ],
                ..FlowOpts::default()
            },
        );
        let comms = flow.dev_of.len();
        flow.wait_ticks(20);
        std::fs::write(&file, "# maintenance on rail 1\nrv1\n").unwrap();
        let drained_at = unix_ms();
        flow.wait_more_ticks(35);
        std::fs::write(&file, "").unwrap();
        let undrained_at = unix_ms();
        let (recv, send) = flow.finish();
        assert_delivered_exactly_once(&recv, &send, comms);
        assert!(!send.stderr.contains(" failover comm="), "{}", send.stderr_tail);
        let during = lanes_between(&send, drained_at + 2_500, undrained_at);
        assert!(!during.is_empty(), "no lanes printed while drained");
        for c in &during {
            assert_eq!(c[1], 0, "lanes per NIC while rv1 was drained by the file: {c:?}");
        }
        let back = lanes_between(&send, undrained_at, u128::MAX);
        assert!(
            back.last().is_some_and(|c| c[1] > 0),
            "nothing came back to rv1: {:?}",
            back.last()
        );
    }
}

fault_test! {
    /// Two processes on one node drained by one command: two senders on A share a control
    /// directory (with the receiver on B), `railover drain rv0` reaches all three, and
    /// each sender moves its own lanes off rv0; every message arrives once and both come
    /// back after the undrain.
    fn two_processes_on_a_node_are_drained_by_one_command() {
        if needs_failover() {
            return;
        }
        let tb = bed(4);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let opts = MeshOpts {
            senders: 2,
            receivers: 1,
            per_pair: 4,
            flow: FlowOpts {
                messages: Some(2_000),
                size: 64 << 10,
                depth: 4,
                tick_ms: 100,
                seconds: 40.0,
                env: vec![("RAILOVER_CONTROL_DIR", d.clone())],
                ..FlowOpts::default()
            },
        };
        let (mesh, _) = Mesh::start(&tb, opts.clone());
        let ticks = |n| {
            assert!(
                mesh.recvs[0].wait_count(Duration::from_secs(30), n, is_tick),
                "the receiver stopped ticking"
            );
        };
        ticks(20);
        let drained_at = unix_ms();
        let (code, out) = railover(&["drain", "rv0", "--dir", &d]);
        assert_eq!(code, 0, "{out}");
        assert_eq!(out.matches("drained rv0").count(), 3, "three processes: {out}");
        ticks(50);
        let (code, out) = railover(&["status", "--dir", &d, "--json"]);
        assert_eq!(code, 0, "{out}");
        let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
        let procs = status.as_array().expect("an array of processes");
        assert_eq!(procs.len(), 3, "{status}");
        let senders = procs
            .iter()
            .map(|p| p.get("result").unwrap_or(p))
            .filter(|r| r["comms"]["send"].as_u64() > Some(0))
            .count();
        assert_eq!(senders, 2, "{status}");
        for p in procs {
            let r = p.get("result").unwrap_or(p);
            assert_eq!(r["nics"][0]["drained"], true, "{p}");
            assert_eq!(r["nics"][0]["comms"], 0, "a comm still runs on rv0: {p}");
        }
        let undrained_at = unix_ms();
        let (code, out) = railover(&["undrain", "rv0", "--dir", &d]);
        assert_eq!(code, 0, "{out}");
        let (recvs, sends) = mesh.finish();
        assert_every_comm_delivered(&opts, &recvs, &sends);
        for s in &sends {
            assert!(!s.stderr.contains(" failover comm="), "{}", s.stderr_tail);
            for c in lanes_between(s, drained_at + 1_000, undrained_at) {
                assert_eq!(c[0], 0, "{}: lanes per NIC while rv0 was drained: {c:?}", s.role);
            }
        }
    }
}
