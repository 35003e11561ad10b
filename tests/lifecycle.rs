//! Process-wide behaviour, in its own test binary because it changes the environment:
//! bad `RAILOVER_*` values, the reactor thread's life from first `init` to last
//! `finalize`, and request slots running out.

use std::time::{Duration, Instant};

use railover_testkit::driver::{connect_pair, Buffer, Code, Ctx};

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

fn reactor_threads() -> usize {
    thread_names()
        .iter()
        .filter(|n| *n == railover::reactor::REACTOR_THREAD)
        .count()
}

/// Every thread the plugin starts is named `rlvr-…`.
fn plugin_threads() -> usize {
    thread_names()
        .iter()
        .filter(|n| n.starts_with("rlvr-"))
        .count()
}

/// Plugin threads once the ones just joined are gone: the kernel lists a thread in
/// /proc/self/task until it has reaped it, a moment after `join` returned (the joiner is
/// woken when the thread clears its tid, before it is released). Bounded wait.
fn gone_plugin_threads() -> usize {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let n = plugin_threads();
        if n == 0 || Instant::now() > end {
            return n;
        }
        std::thread::yield_now();
    }
}

/// A new thread names itself once it runs: wait (bounded) for the name to appear.
fn settled_reactor_threads() -> usize {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let n = reactor_threads();
        if n > 0 || Instant::now() > end {
            return n;
        }
        std::thread::yield_now();
    }
}

/// The tests of this binary change the environment and start and stop the one plugin of
/// the process: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// One init … finalize cycle as a job that ends without closing anything: a listener, a
/// connected pair of comms with a send and a receive that meet, a receive nobody sends to
/// (pending at finalize), and every handle left to NCCL's forgetting.
fn cycle_leaving_everything_open() {
    let ctx = Ctx::init().unwrap();
    let (mut h, l) = ctx.listen(0).unwrap();
    let (s, r) = connect_pair(&ctx, 0, &mut h, &l, Duration::from_secs(30)).unwrap();
    let mut rbufs = [r.register(64).unwrap(), r.register(64).unwrap()];
    let sbuf = s.register(64).unwrap();
    let recvs: Vec<_> = (rbufs.iter_mut())
        .map(|b| r.irecv(b, 64).unwrap().expect("a request slot"))
        .collect();
    let send = s.isend_patiently(&sbuf, 64, 0).unwrap().expect("taken");
    ctx.finalize().unwrap();
    // NCCL never closes these: the driver's handles must not close them on drop either.
    std::mem::forget((s, r, l, recvs, send, rbufs, sbuf));
    use railover::ffi::handle::{COMMS, LISTENS, MRS, REQUESTS};
    assert_eq!(
        (COMMS.len(), LISTENS.len(), MRS.len(), REQUESTS.len()),
        (0, 0, 0, 0),
        "the last finalize forgets the handles NCCL left open"
    );
}

/// 100 cycles with comms left open leave no file descriptor and no memory behind: the
/// count of /proc/self/fd after them is the count after a warm-up (one leaked eventfd per
/// cycle was 100 more), every handle registry is empty after each cycle, and VmRSS stays
/// within a fixed slack. VmRSS moves by a few hundred KiB from run to run as thread stacks
/// and allocator arenas come and go, so it only resolves leaks of some 10 KiB per cycle;
/// the registries catch the objects themselves.
#[test]
fn cycles_with_comms_left_open_leak_nothing() {
    let _serial = serial();
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
    std::env::set_var("RAILOVER_METRICS_PORT", "0");
    // Warm-up: allocator arenas, thread-stack caches and lazily built tables settle.
    for _ in 0..10 {
        cycle_leaving_everything_open();
    }
    let (fds0, rss0) = (open_fds(), rss_kib());
    let mut mid = (0, 0);
    for i in 0..100 {
        cycle_leaving_everything_open();
        if i == 49 {
            mid = (open_fds(), rss_kib());
        }
    }
    let (fds1, rss1) = (open_fds(), rss_kib());
    println!(
        "fds: {fds0} -> {} -> {fds1}; VmRSS: {rss0} -> {} -> {rss1} KiB over 100 cycles",
        mid.0, mid.1
    );
    assert_eq!(gone_plugin_threads(), 0, "{:?}", thread_names());
    assert!(
        fds1 <= fds0 + 2 && fds1 <= mid.0 + 2,
        "file descriptors grew from {fds0} to {fds1} over 100 cycles ({} after 50)",
        mid.0
    );
    // The second half must not grow as the first did: a per-cycle leak of a few KiB
    // shows there too.
    assert!(
        rss1 <= rss0 + 2048 && rss1 <= mid.1 + 1024,
        "VmRSS grew from {rss0} KiB to {rss1} KiB over 100 cycles ({} KiB after 50)",
        mid.1
    );
}

#[test]
fn process_lifecycle() {
    let _serial = serial();
    // 1. Bad values: init fails, naming the variable, the value and what is accepted.
    for (var, value) in [
        ("RAILOVER_SPIN_US", "fast"),
        ("RAILOVER_LOG", "loud"),
        ("RAILOVER_IFNAME", "^"),
    ] {
        std::env::set_var(var, value);
        let err = railover::plugin::init_context(-1).unwrap_err().to_string();
        assert!(
            err.contains(var) && err.contains(value) && err.contains("expected"),
            "{err}"
        );
        assert_eq!(
            Ctx::init().unwrap_err(),
            Code(4),
            "ncclInvalidArgument for {var}"
        );
        std::env::remove_var(var);
    }
    assert_eq!(
        reactor_threads(),
        0,
        "a failed init leaves no thread behind"
    );

    // 2. One reactor per process, joined when the last context is finalised. The metrics
    // endpoint (on loopback, a free port) and the control socket's thread are plugin
    // threads too.
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_ADDR", "127.0.0.1");
    std::env::set_var("RAILOVER_METRICS_PORT", "0");
    let control = tempfile::tempdir().unwrap();
    std::env::set_var("RAILOVER_CONTROL_DIR", control.path());
    let a = Ctx::init().unwrap();
    let b = Ctx::init().unwrap();
    assert_eq!(settled_reactor_threads(), 1);
    let end = Instant::now() + Duration::from_secs(10);
    while plugin_threads() < 3 && Instant::now() < end {
        std::thread::yield_now();
    }
    assert_eq!(
        plugin_threads(),
        3,
        "reactor, metrics endpoint and control socket: {:?}",
        thread_names()
    );
    a.finalize().unwrap();
    assert_eq!(reactor_threads(), 1, "another context is still alive");

    // 3. Out of request slots: *request = NULL ("call again"), not an error. A receive
    // comm takes 32 requests; a send comm 32 x maxRecvs, as many sends as 32 grouped
    // receives of 8 buffers hold.
    let (mut h, l) = b.listen(0).unwrap();
    let (s, r) = connect_pair(&b, 0, &mut h, &l, Duration::from_secs(30)).unwrap();
    let bufs: Vec<_> = (0..257).map(|_| s.register(4).unwrap()).collect();
    let mut rbufs: Vec<_> = (0..257).map(|_| r.register(4).unwrap()).collect();
    let mut reqs = Vec::new();
    for group in rbufs[..256].chunks_mut(8) {
        let mut group: Vec<(&mut Buffer, usize, i32)> =
            group.iter_mut().map(|b| (b, 4, 0)).collect();
        reqs.push(
            r.irecv_group(&mut group)
                .unwrap()
                .expect("32 receive requests per comm are supported"),
        );
    }
    assert!(
        r.irecv(&mut rbufs[256], 4).unwrap().is_none(),
        "the 33rd receive gets a NULL request"
    );
    for buf in &bufs[..256] {
        // Nothing is tested: the slots stay taken.
        reqs.push(
            s.isend_patiently(buf, 4, 0)
                .unwrap()
                .expect("32 x 8 send requests per comm are supported"),
        );
    }
    assert!(
        s.isend(&bufs[256], 4).unwrap().is_none(),
        "the 257th send, with every posted buffer taken, gets a NULL request"
    );
    drop((reqs, s, r, l));

    b.finalize().unwrap();
    assert_eq!(
        gone_plugin_threads(),
        0,
        "the last finalize joins every plugin thread: {:?}",
        thread_names()
    );

    // 4. And the plugin starts again afterwards, as after a dlclose/dlopen cycle. A
    // connection attempt abandoned before it completed does not outlive it.
    let c = Ctx::init().unwrap();
    assert_eq!(settled_reactor_threads(), 1);
    let (mut h, l) = c.listen(0).unwrap();
    assert!(
        c.connect(0, &mut h).unwrap().is_none(),
        "the first call never completes"
    );
    assert_eq!(railover::plugin::pending_connects(), 1);
    drop(l);
    c.finalize().unwrap();
    assert_eq!(railover::plugin::pending_connects(), 0);
    assert_eq!(gone_plugin_threads(), 0, "{:?}", thread_names());
}

/// The last `finalize` forgets every handle of the stopped runtime. A context started on
/// another thread meanwhile must keep its own: two threads cycling init, listen, accept
/// and finalize over each other never see their listener called unknown.
#[test]
fn concurrent_init_and_finalize_keep_each_others_handles() {
    let _g = serial();
    std::env::set_var("RAILOVER_IFNAME", "lo");
    let cycle = || {
        for i in 0..1000 {
            let ctx = Ctx::init().expect("init");
            let (_handle, listener) = ctx.listen(0).expect("listen");
            match listener.accept() {
                Ok(None) => {}
                other => panic!("cycle {i}: accept on a live listener gave {other:?}"),
            }
            drop(listener);
            drop(ctx);
        }
    };
    let t = std::thread::spawn(cycle);
    cycle();
    t.join().expect("the other thread's cycles");
}
