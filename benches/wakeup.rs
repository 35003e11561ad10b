//! A push to a parked reactor: the same 0-byte round as `handoff`, with the busy-poll
//! budget at zero (`RAILOVER_SPIN_US=0`), so the reactor parks in epoll after every turn
//! and each command pays the `eventfd` wake. The difference from `handoff` is the price
//! of the wake-ups.

mod common;

use criterion::{criterion_group, criterion_main, Criterion};

fn wakeup(c: &mut Criterion) {
    let ctx = common::init(0);
    let (s, r) = common::pair(&ctx);
    let sb = s.register(8).expect("reg");
    let mut rb = r.register(8).expect("reg");
    c.bench_function("wakeup/isend_irecv_test_0B_parked_reactor", |b| {
        b.iter(|| common::round(&s, &r, &sb, &mut rb))
    });
}

criterion_group!(benches, wakeup);
criterion_main!(benches);
