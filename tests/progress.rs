//! Who runs the reactor's turns (`RAILOVER_PROGRESS`, `reactor::owner`): NCCL's own
//! thread while it calls in, the reactor thread while it does not. In its own test binary
//! because it changes the environment and starts and stops the process's one plugin.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use railover_testkit::driver::{connect_pair, pattern, Ctx, RecvComm, Request, SendComm};

/// Completion timeout of these runs: short, so a silence NCCL leaves is many of them.
const TIMEOUT_MS: u64 = 250;

fn turns() -> (u64, u64) {
    let rt = railover::plugin::runtime().unwrap();
    let s = rt.stats();
    (
        s.caller_turns.load(Ordering::Relaxed),
        s.thread_turns.load(Ordering::Relaxed),
    )
}

fn lane_failures() -> u64 {
    let rt = railover::plugin::runtime().unwrap();
    rt.stats().lane_failures.load(Ordering::Relaxed)
}

/// Calls `test` until the request finishes, for at most 30 s, as NCCL's proxy does.
fn finish(req: &mut Request, what: &str) -> usize {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match req.test() {
            Ok(Some(n)) => return n,
            Ok(None) if Instant::now() < end => std::thread::yield_now(),
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// `rounds` messages of `len` bytes, each checked byte for byte.
fn traffic(s: &SendComm, r: &RecvComm, rounds: u64, len: usize) {
    let mut sbuf = s.register(len).unwrap();
    let mut rbuf = r.register(len).unwrap();
    for i in 0..rounds {
        let data = pattern(i, len);
        sbuf.bytes_mut().unwrap().copy_from_slice(&data);
        let mut rq = r.irecv(&mut rbuf, len).unwrap().expect("a request slot");
        let mut sq = s.isend_patiently(&sbuf, len, 0).unwrap().expect("taken");
        assert_eq!(finish(&mut sq, "send"), len);
        assert_eq!(finish(&mut rq, "receive"), len);
        assert_eq!(rbuf.bytes().unwrap(), &data[..], "message {i}");
    }
}

fn pair(ctx: &Ctx) -> (SendComm, RecvComm) {
    let (mut h, l) = ctx.listen(0).unwrap();
    connect_pair(ctx, 0, &mut h, &l, Duration::from_secs(30)).unwrap()
}

/// One test function: the two modes must not share the process's plugin at once.
#[test]
fn callers_drive_the_reactor_and_the_thread_covers_their_silence() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
    std::env::set_var("RAILOVER_METRICS_PORT", "0");
    std::env::set_var("RAILOVER_COMPLETION_TIMEOUT_MS", TIMEOUT_MS.to_string());

    // `thread`: every turn is the reactor thread's, none a caller's.
    std::env::set_var("RAILOVER_PROGRESS", "thread");
    let ctx = Ctx::init().unwrap();
    let (s, r) = pair(&ctx);
    traffic(&s, &r, 50, 4096);
    let (callers, thread) = turns();
    assert_eq!(
        callers, 0,
        "RAILOVER_PROGRESS=thread: no caller runs a turn"
    );
    assert!(thread > 0);
    s.close().unwrap();
    r.close().unwrap();
    ctx.finalize().unwrap();

    // `caller` (the default): NCCL's calls run the turns.
    std::env::remove_var("RAILOVER_PROGRESS");
    let ctx = Ctx::init().unwrap();
    let (s, r) = pair(&ctx);
    let before = turns();
    traffic(&s, &r, 200, 4096);
    let after = turns();
    assert!(
        after.0 - before.0 >= 400,
        "every send and receive went through a caller's turn: {before:?} -> {after:?}"
    );

    // Several of NCCL's threads call in at once (the proxy threads of several
    // communicators), each driving its own comms: a caller that finds the reactor taken
    // goes on and the holder serves what it queued. Every message still arrives intact.
    let pairs: Vec<_> = (0..4).map(|_| pair(&ctx)).collect();
    let before = turns();
    let pairs: Vec<_> = pairs
        .into_iter()
        .map(|(s, r)| {
            std::thread::spawn(move || {
                traffic(&s, &r, 100, 4096);
                (s, r)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("a caller thread's traffic"))
        .collect();
    let after = turns();
    assert!(
        after.0 > before.0,
        "the callers ran turns: {before:?} -> {after:?}"
    );
    for (s, r) in pairs {
        s.close().unwrap();
        r.close().unwrap();
    }

    // NCCL stops calling (a long kernel, the next step's data loading) for many
    // completion timeouts. Nobody but the reactor thread can keep the lanes' keepalives
    // going; without it both ends would judge the path silent when calls resume.
    let failures = lane_failures();
    let quiet = turns();
    std::thread::sleep(Duration::from_millis(10 * TIMEOUT_MS));
    let resumed = turns();
    assert!(
        resumed.1 > quiet.1,
        "the reactor thread ran while no caller did: {quiet:?} -> {resumed:?}"
    );
    assert_eq!(resumed.0, quiet.0, "no caller ran a turn while none called");
    traffic(&s, &r, 20, 4096);
    assert_eq!(
        lane_failures(),
        failures,
        "no lane was judged dead across the silence"
    );
    s.close().unwrap();
    r.close().unwrap();
    ctx.finalize().unwrap();
}
