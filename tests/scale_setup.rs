//! A job's all-to-all connects thousands of comms at once. 1,024 comms connect at the
//! same moment over loopback, in a process started with a soft open-file limit of 1,024
//! (the usual default, far too few): the plugin raises the limit, the receiver's
//! handshake gate admits every connect (no drop, no refusal, no redial), and every comm
//! then carries a checked message. It then reports what the open, idle comms cost: CPU
//! and resident memory per comm (both ends live in this one process).
//!
//! `RAILOVER_SCALE_COMMS=4096 cargo test --release --test scale_setup -- --nocapture`
//! runs it at an all-to-all job's count.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use railover::conn::lane::congested_limit;
use railover_testkit::driver::{pattern, Ctx, Request};

/// Comms by default (`RAILOVER_SCALE_COMMS` sets another count, 1 … 8192).
const DEFAULT_COMMS: usize = 1024;
/// How long the child then holds every comm open and idle, to report what that costs.
const IDLE: Duration = Duration::from_secs(3);
const LEN: usize = 4096;
/// Bound on the whole setup and exchange: seconds here, a generous margin for a loaded
/// 2-core CI machine.
const LIMIT: Duration = Duration::from_secs(120);

fn soft_nofile() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .parse()
        .unwrap()
}

fn comms() -> usize {
    match std::env::var("RAILOVER_SCALE_COMMS") {
        Err(_) => DEFAULT_COMMS,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=8192).contains(&n) => n,
            _ => panic!("RAILOVER_SCALE_COMMS={v:?}: expected a count in 1 … 8192"),
        },
    }
}

/// This process's resident memory, KiB (`statm` counts 4 KiB pages).
fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 4
}

fn finish(req: &mut Request, end: Instant) -> usize {
    loop {
        if let Some(n) = req.test().expect("request failed") {
            return n;
        }
        assert!(Instant::now() < end, "a request did not complete in time");
        std::thread::yield_now();
    }
}

/// The workload, in the child the test starts with a low soft limit.
#[test]
#[ignore = "run by a_thousand_comms_connect_at_once_and_none_is_refused"]
fn thousand_comms_child() {
    if std::env::var_os("RAILOVER_SCALE_CHILD").is_none() {
        eprintln!("skipped: only runs as the scale test's child process");
        return;
    }
    std::env::set_var("RAILOVER_IFNAME", "lo");
    let comms = comms();
    let soft_before = soft_nofile();
    let rss0 = rss_kib();
    let start = Instant::now();
    let end = start + LIMIT;
    let ctx = Ctx::init().expect("init");
    let rt = railover::plugin::runtime().unwrap();
    let mut listeners = Vec::with_capacity(comms);
    for _ in 0..comms {
        listeners.push(ctx.listen(0).expect("listen"));
    }
    // Every connect and accept in flight at once, as NCCL's init of an all-to-all.
    let (mut sends, mut recvs): (Vec<_>, Vec<_>) = (
        (0..comms).map(|_| None).collect(),
        (0..comms).map(|_| None).collect(),
    );
    let mut left = 2 * comms;
    while left > 0 {
        for i in 0..comms {
            let (handle, listener) = &mut listeners[i];
            if sends[i].is_none() {
                sends[i] = ctx.connect(0, handle).expect("connect failed");
                left -= usize::from(sends[i].is_some());
            }
            if recvs[i].is_none() {
                recvs[i] = listener.accept().expect("accept failed");
                left -= usize::from(recvs[i].is_some());
            }
        }
        assert!(
            Instant::now() < end,
            "{left} connects/accepts still pending"
        );
        std::thread::yield_now();
    }
    let setup = start.elapsed();
    let sends: Vec<_> = sends.into_iter().map(Option::unwrap).collect();
    let recvs: Vec<_> = recvs.into_iter().map(Option::unwrap).collect();
    // One checked message on every comm.
    let mut posted = Vec::with_capacity(comms);
    for (i, (s, r)) in sends.iter().zip(&recvs).enumerate() {
        let mut sb = s.register(LEN).unwrap();
        sb.bytes_mut()
            .unwrap()
            .copy_from_slice(&pattern(i as u64, LEN));
        let mut rb = r.register(LEN).unwrap();
        let rr = r.irecv(&mut rb, LEN).unwrap().expect("a receive slot");
        let sr = s.isend_patiently(&sb, LEN, 0).unwrap().expect("taken");
        posted.push((sb, rb, sr, rr));
    }
    let mut intact = 0;
    for (i, (_sb, rb, sr, rr)) in posted.iter_mut().enumerate() {
        assert_eq!(finish(rr, end), LEN);
        finish(sr, end);
        intact += usize::from(rb.bytes().unwrap() == &pattern(i as u64, LEN)[..]);
    }
    // What the comms cost while open and idle: this process's CPU time over a window
    // (reported, not judged: a timing).
    let cpu = || {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let f: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    };
    // A lane that moved data keeps itself alive for a while after (see
    // `conn::lane::CONGESTED_SILENCE`); idle means past that, when only each path's
    // keeper sends keepalives.
    let busy = congested_limit(railover::config::Config::default().completion_timeout);
    std::thread::sleep(busy + Duration::from_millis(500));
    let (c0, t0) = (cpu(), Instant::now());
    std::thread::sleep(IDLE);
    let ticks = 100.0; // USER_HZ on Linux
    let idle_pct = (cpu() - c0) as f64 / ticks / t0.elapsed().as_secs_f64() * 100.0;
    // Both ends of every comm, with its buffers registered: per comm.
    let rss_per_comm = rss_kib().saturating_sub(rss0) / comms as u64;
    let st = rt.stats();
    println!(
        "scale comms={comms} intact={intact} setup_ms={} idle_cpu_pct={idle_pct:.2} rss_kib_per_comm={rss_per_comm} rejected={} evicted={} peak={} nofile_before={soft_before} nofile_after={}",
        setup.as_millis(),
        st.rejected_connections.load(Ordering::Relaxed),
        st.evicted_handshakes.load(Ordering::Relaxed),
        st.handshakes_peak.load(Ordering::Relaxed),
        soft_nofile(),
    );
}

#[test]
fn a_thousand_comms_connect_at_once_and_none_is_refused() {
    let exe = std::env::current_exe().unwrap();
    let comms = comms();
    // A soft limit of 1,024 (the usual default); the hard one stays as it is.
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -S -n 1024 && exec \"$0\" \"$@\"")
        .arg(exe)
        .args([
            "thousand_comms_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("RAILOVER_SCALE_CHILD", "1")
        .env("RAILOVER_METRICS_PORT", "off")
        .env("RAILOVER_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run the child");
    let log = String::from_utf8_lossy(&out.stderr);
    let line = BufReader::new(&out.stdout[..])
        .lines()
        .map(Result::unwrap)
        .find(|l| l.starts_with("scale "));
    let Some(line) = line else {
        panic!("the child reported nothing ({}):\n{log}", out.status);
    };
    eprintln!("{line}");
    let hard: u64 = String::from_utf8_lossy(
        &Command::new("sh")
            .args(["-c", "ulimit -H -n"])
            .output()
            .unwrap()
            .stdout,
    )
    .trim()
    .parse()
    .unwrap_or(u64::MAX);
    assert_eq!(field(&line, "nofile_before"), 1024);
    if hard <= 4 * comms as u64 {
        eprintln!("skipped: the hard open-file limit ({hard}) is too low for {comms} comms");
        return;
    }
    assert!(
        field(&line, "nofile_after") > 4 * comms as u64,
        "the open-file limit was not raised: {line}"
    );
    assert!(
        log.contains("raised the open-file limit from 1024"),
        "no log line says the limit was raised:\n{log}"
    );
    assert_eq!(field(&line, "intact"), comms as u64, "{line}");
    assert_eq!(
        field(&line, "rejected"),
        0,
        "a real connect was turned away: {line}"
    );
    assert_eq!(field(&line, "evicted"), 0, "{line}");
    let redials = log.lines().filter(|l| l.contains("trying again")).count();
    assert_eq!(redials, 0, "connects were dropped and redialled:\n{log}");
}
