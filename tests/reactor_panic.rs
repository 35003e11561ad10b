//! A panic on the reactor thread fails loudly and never hangs (P5): requests in flight
//! fail with ncclInternalError, every later call on the context fails, closes return,
//! one WARN gives the panic's message, and `finalize` still joins the thread. In its own
//! test binary: the panic poisons the process's one plugin until it is finalised.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use railover::telemetry::log::{self, Severity};
use railover_testkit::driver::{connect_pair, Code, Ctx, Listener, RecvComm, Request, SendComm};

/// ncclInternalError.
const INTERNAL: Code = Code(3);
const MESSAGE: &str = "injected by tests/reactor_panic.rs";

fn reactor_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim() == railover::reactor::REACTOR_THREAD)
        .count()
}

/// Connects one pair of comms through `l`, for at most 30 s.
fn pair(ctx: &Ctx, handle: &[u8; 128], l: &Listener) -> (SendComm, RecvComm) {
    let mut h = *handle;
    connect_pair(ctx, 0, &mut h, l, Duration::from_secs(30)).expect("connect_pair")
}

/// Tests `req` until it finishes, for at most 10 s.
fn outcome(req: &mut Request) -> Result<usize, Code> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(n) = req.test()? {
            return Ok(n);
        }
        assert!(Instant::now() < end, "request still pending after 10 s");
        std::thread::yield_now();
    }
}

/// Runs `f` on another thread; fails the test if it does not return within 30 s.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what} did not return within 30 s"))
}

fn warns_naming(text: &str) -> Vec<String> {
    log::captured()
        .into_iter()
        .filter(|(sev, line)| *sev == Severity::Warn && line.contains(text))
        .map(|(_, line)| line)
        .collect()
}

#[test]
fn a_reactor_panic_fails_every_caller_and_never_hangs() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
    std::env::set_var("RAILOVER_METRICS_PORT", "0");
    log::capture();
    let ctx = Ctx::init().unwrap();
    let (handle, l) = ctx.listen(0).unwrap();
    let (s1, r1) = pair(&ctx, &handle, &l);
    let (s2, r2) = pair(&ctx, &handle, &l);

    // The path works: one message round trip before the panic.
    let sbuf = s1.register(64).unwrap();
    let mut rbuf = r1.register(64).unwrap();
    let mut rq = r1.irecv(&mut rbuf, 64).unwrap().expect("a request slot");
    let mut sq = s1.isend_patiently(&sbuf, 64, 0).unwrap().expect("taken");
    assert_eq!(outcome(&mut sq), Ok(64));
    assert_eq!(outcome(&mut rq), Ok(64));

    // In flight at the panic: a receive nobody sends to, and a connect that has not
    // completed. (A send is taken only once its receive is posted, and then completes.)
    let pending_send_buf = s1.register(64).unwrap();
    let mut pending_recv_buf = r2.register(64).unwrap();
    let mut pending_recv = r2
        .irecv(&mut pending_recv_buf, 64)
        .unwrap()
        .expect("a request slot");
    let mut connecting = handle;
    assert!(ctx.connect(0, &mut connecting).unwrap().is_none());
    assert_eq!(pending_recv.test(), Ok(None));
    assert!(warns_naming(MESSAGE).is_empty());

    railover::plugin::inject_reactor_panic(MESSAGE).unwrap();

    // Requests in flight fail instead of waiting forever.
    assert_eq!(outcome(&mut pending_recv), Err(INTERNAL));

    // Every later call on the context fails.
    let more = s1.register(64);
    assert_eq!(
        more.as_ref().err(),
        Some(&INTERNAL),
        "regMr after the panic"
    );
    assert_eq!(
        s1.isend(&pending_send_buf, 8).err(),
        Some(INTERNAL),
        "isend after the panic"
    );
    let mut rbuf2 = rbuf;
    assert_eq!(
        r1.irecv(&mut rbuf2, 8).err(),
        Some(INTERNAL),
        "irecv after the panic"
    );
    assert_eq!(
        ctx.connect(0, &mut connecting).err(),
        Some(INTERNAL),
        "the pending connect"
    );
    let mut fresh = handle;
    assert_eq!(
        ctx.connect(0, &mut fresh).err(),
        Some(INTERNAL),
        "a new connect"
    );
    assert_eq!(l.accept().err(), Some(INTERNAL), "accept");
    assert_eq!(ctx.listen(0).err(), Some(INTERNAL), "listen");

    // Closes return at once (a close the reactor never confirms fails after 10 s).
    bounded("closing the comms", move || {
        for s in [s1, s2] {
            s.close().unwrap();
        }
        for r in [r1, r2] {
            r.close().unwrap();
        }
    });
    drop(l);

    let warns = warns_naming(MESSAGE);
    assert_eq!(
        warns.len(),
        1,
        "one WARN with the panic's message: {warns:?}"
    );
    assert!(warns[0].contains("reactor panicked"), "{}", warns[0]);

    // `finalize` still joins the thread, and a new context starts a healthy reactor.
    bounded("finalize", move || ctx.finalize()).unwrap();
    assert_eq!(reactor_threads(), 0, "the reactor thread was joined");
    let ctx = Ctx::init().unwrap();
    let (handle, l) = ctx.listen(0).unwrap();
    let (s, r) = pair(&ctx, &handle, &l);
    let sbuf = s.register(16).unwrap();
    let mut rbuf = r.register(16).unwrap();
    let mut rq = r.irecv(&mut rbuf, 16).unwrap().expect("a request slot");
    let mut sq = s.isend_patiently(&sbuf, 16, 0).unwrap().expect("taken");
    assert_eq!(outcome(&mut sq), Ok(16));
    assert_eq!(outcome(&mut rq), Ok(16));
    drop((sbuf, rbuf, s, r, l));
    bounded("finalize", move || ctx.finalize()).unwrap();
    assert_eq!(warns_naming(MESSAGE).len(), 1, "no second WARN");
}
