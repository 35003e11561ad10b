//! The request hand-off from an NCCL thread to the reactor and back: `irecv` + `isend` of
//! a 0-byte message on a comm connected to this process, `test` until both are done. The
//! reactor busy-polls between rounds (default `RAILOVER_SPIN_US`), so no wake-up is paid.

mod common;

use criterion::{criterion_group, criterion_main, Criterion};

fn handoff(c: &mut Criterion) {
    let ctx = common::init(200);
    let (s, r) = common::pair(&ctx);
    let sb = s.register(8).expect("reg");
    let mut rb = r.register(8).expect("reg");
    c.bench_function("handoff/isend_irecv_test_0B_spinning_reactor", |b| {
        b.iter(|| common::round(&s, &r, &sb, &mut rb))
    });
}

criterion_group!(benches, handoff);
criterion_main!(benches);
