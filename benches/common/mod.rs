//! Shared by the hand-off and wake-up benchmarks: a comm connected to this same process
//! on loopback, driven through the exported v12 table as NCCL's proxy drives it.

use std::time::{Duration, Instant};

use railover_testkit::driver::{Buffer, Ctx, RecvComm, Request, SendComm};

/// Loopback only, no metrics endpoint; `spin_us` is the reactor's busy-poll budget.
pub fn init(spin_us: u32) -> Ctx {
    // Read once, at the first init of this process: set before it.
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_PORT", "off");
    std::env::set_var("RAILOVER_SPIN_US", spin_us.to_string());
    Ctx::init().expect("railover init")
}

/// A send comm and its receive comm, both ends in this process.
pub fn pair(ctx: &Ctx) -> (SendComm, RecvComm) {
    let (mut h, l) = ctx.listen(0).expect("listen");
    let (mut s, mut r) = (None, None);
    let end = Instant::now() + Duration::from_secs(30);
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < end, "self-connect timed out");
        if s.is_none() {
            s = ctx.connect(0, &mut h).expect("connect");
        }
        if r.is_none() {
            r = l.accept().expect("accept");
        }
        std::thread::yield_now();
    }
    (s.unwrap(), r.unwrap())
}

fn spin(q: &mut Request) {
    let end = Instant::now() + Duration::from_secs(30);
    while q.test().expect("test").is_none() {
        assert!(Instant::now() < end, "request never completed");
        // As NCCL's proxy thread does between idle turns: leave the core to the reactor
        // when this machine has fewer cores than runnable threads.
        std::thread::yield_now();
    }
}

/// One 0-byte message: irecv and isend queued to the reactor, then `test` until both
/// report done (the send completes on the receiver's ack).
pub fn round(s: &SendComm, r: &RecvComm, sb: &Buffer, rb: &mut Buffer) {
    let mut rq = r.irecv(rb, 8).expect("irecv").expect("slot");
    let mut sq = s.isend(sb, 0).expect("isend").expect("slot");
    spin(&mut rq);
    spin(&mut sq);
}
