//! Grouped receives through a failover, in one process on loopback: two NICs
//! (`RAILOVER_LOOPBACK_NICS`), groups of 8 in flight while NIC 0 is cut by injection.
//! Every buffer must get exactly its send's bytes and size, once.

use std::time::{Duration, Instant};

use railover_testkit::driver::{self, pattern, Buffer, Ctx, Request};

fn wait_all(req: &mut Request, what: &str) -> Vec<usize> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(sizes) = req.test_all().unwrap_or_else(|e| panic!("{what}: {e:?}")) {
            return sizes;
        }
        assert!(Instant::now() < end, "{what} did not complete");
        std::thread::yield_now();
    }
}

#[test]
fn grouped_receives_survive_a_cut_nic() {
    std::env::set_var("RAILOVER_LOOPBACK_NICS", "2");
    std::env::remove_var("RAILOVER_IFNAME");
    std::env::set_var("RAILOVER_METRICS_PORT", "off");
    let ctx = Ctx::init().expect("init");
    assert!(ctx.devices().unwrap() >= 2);
    let (mut handle, listener) = ctx.listen(0).expect("listen");
    let (s, r) = driver::connect_pair(&ctx, 0, &mut handle, &listener, Duration::from_secs(30))
        .expect("connect_pair");
    const GROUPS: u64 = 24;
    const SIZE: usize = 64 << 10;
    let len = |g: u64, k: usize| (g as usize * 977 + k * 4099) % SIZE;
    // Two groups in flight at a time; NIC 0 is cut after a third of them.
    let mut inflight = std::collections::VecDeque::new();
    for g in 0..GROUPS {
        if g == GROUPS / 3 {
            railover::plugin::inject_link(0, false).unwrap();
        }
        let mut rbufs: Vec<Buffer> = (0..8).map(|_| r.register(SIZE).unwrap()).collect();
        let mut group: Vec<(&mut Buffer, usize, i32)> = (rbufs.iter_mut())
            .zip(0..)
            .map(|(b, k)| (b, SIZE, 7 * k))
            .collect();
        let rr = r.irecv_group(&mut group).unwrap().expect("slot");
        drop(group);
        let mut sends = Vec::new();
        for k in (0..8).rev() {
            let mut b = s.register(SIZE).unwrap();
            b.bytes_mut().unwrap()[..len(g, k)]
                .copy_from_slice(&pattern(g * 8 + k as u64, len(g, k)));
            let q = s
                .isend_patiently(&b, len(g, k), 7 * k as i32)
                .unwrap()
                .expect("taken");
            sends.push((b, q));
        }
        inflight.push_back((g, rbufs, rr, sends));
        while inflight.len() > 2 || (g + 1 == GROUPS && !inflight.is_empty()) {
            let (g, rbufs, mut rr, mut sends) = inflight.pop_front().unwrap();
            let sizes = wait_all(&mut rr, &format!("group {g}"));
            assert_eq!(
                sizes,
                (0..8).map(|k| len(g, k)).collect::<Vec<_>>(),
                "group {g}"
            );
            for (k, b) in rbufs.iter().enumerate() {
                assert!(
                    b.bytes().unwrap()[..len(g, k)] == pattern(g * 8 + k as u64, len(g, k))[..],
                    "group {g}: buffer {k} holds other bytes"
                );
            }
            for (_, q) in &mut sends {
                wait_all(q, "send");
            }
        }
    }
    let rt = railover::plugin::runtime().unwrap();
    let st = rt.stats();
    let lost = st.lane_failures.load(std::sync::atomic::Ordering::Relaxed);
    let replayed = st.replayed_bytes.load(std::sync::atomic::Ordering::Relaxed);
    println!("lanes lost {lost}, bytes replayed {replayed}");
    assert!(
        lost > 0,
        "the cut took no lane down: the test moved nothing"
    );
    railover::plugin::inject_link(0, true).unwrap();
    drop((s, r, listener));
    ctx.finalize().unwrap();
}
