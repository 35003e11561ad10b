//! End-to-end through the exported v12 table on loopback: connect/accept, data of every
//! interesting size verified byte for byte, bad input, and a stranger on the listener.

use std::io::Write;
use std::time::{Duration, Instant};

use railover_testkit::driver::{self, pattern, Buffer, Ctx, RecvComm, Request, SendComm};

fn setup() -> Ctx {
    // Tests touch only loopback.
    std::env::set_var("RAILOVER_IFNAME", "lo");
    Ctx::init().expect("init")
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn pair(ctx: &Ctx) -> (SendComm, RecvComm, driver::Listener) {
    let (mut handle, listener) = ctx.listen(0).expect("listen");
    let (s, r) = driver::connect_pair(ctx, 0, &mut handle, &listener, Duration::from_secs(30))
        .expect("connect_pair");
    (s, r, listener)
}

fn wait(req: &mut Request) -> Result<usize, driver::Code> {
    let end = deadline();
    loop {
        if let Some(n) = req.test()? {
            return Ok(n);
        }
        assert!(Instant::now() < end, "request did not complete");
        std::thread::yield_now();
    }
}

/// A grouped receive's sizes, buffer by buffer, once done.
fn wait_all(req: &mut Request) -> Result<Vec<usize>, driver::Code> {
    let end = deadline();
    loop {
        if let Some(sizes) = req.test_all()? {
            return Ok(sizes);
        }
        assert!(Instant::now() < end, "grouped receive did not complete");
        std::thread::yield_now();
    }
}

fn fill(buf: &mut Buffer, data: &[u8]) {
    buf.bytes_mut().unwrap()[..data.len()].copy_from_slice(data);
}

#[test]
fn sizes_from_zero_to_64_mib_arrive_intact() {
    let ctx = setup();
    assert!(ctx.devices().unwrap() >= 1);
    let props = ctx.properties(0).unwrap();
    assert_eq!(props.name, "lo");
    assert_eq!(props.max_recvs, 8);
    let (s, r, _l) = pair(&ctx);
    for (i, &len) in [0usize, 1, 4095, 4096, 65537, 1 << 20, 64 << 20]
        .iter()
        .enumerate()
    {
        let data = pattern(i as u64, len);
        let mut sb = s.register(len.max(1)).unwrap();
        fill(&mut sb, &data);
        let mut rb = r.register(len + 100).unwrap();
        let mut rr = r.irecv(&mut rb, len + 100).unwrap().expect("slot");
        let mut sr = s.isend_patiently(&sb, len, 0).unwrap().expect("taken");
        assert_eq!(wait(&mut rr).unwrap(), len, "reported size");
        assert_eq!(wait(&mut sr).unwrap(), len);
        assert!(
            rb.bytes().unwrap()[..len] == data[..],
            "payload of {len} bytes corrupted"
        );
    }
}

#[test]
fn eight_in_flight_keep_order() {
    let ctx = setup();
    let (s, r, _l) = pair(&ctx);
    let n = 8;
    let sizes: Vec<usize> = (0..n).map(|i| 1000 * (i + 1) + i).collect();
    let mut sbufs: Vec<Buffer> = sizes.iter().map(|&l| s.register(l).unwrap()).collect();
    let mut rbufs: Vec<Buffer> = sizes.iter().map(|_| r.register(16384).unwrap()).collect();
    for (i, b) in sbufs.iter_mut().enumerate() {
        fill(b, &pattern(100 + i as u64, sizes[i]));
    }
    let mut rreqs: Vec<Request> = rbufs
        .iter_mut()
        .map(|b| r.irecv(b, 16384).unwrap().unwrap())
        .collect();
    let mut sreqs: Vec<Request> = sbufs
        .iter()
        .zip(&sizes)
        .map(|(b, &l)| s.isend_patiently(b, l, 0).unwrap().expect("taken"))
        .collect();
    for (i, rq) in rreqs.iter_mut().enumerate() {
        assert_eq!(wait(rq).unwrap(), sizes[i]);
    }
    for sq in &mut sreqs {
        wait(sq).unwrap();
    }
    for (i, b) in rbufs.iter().enumerate() {
        assert!(b.bytes().unwrap()[..sizes[i]] == pattern(100 + i as u64, sizes[i])[..]);
    }
}

#[test]
fn a_grouped_receive_of_eight_takes_each_send_by_tag() {
    let ctx = setup();
    let (s, r, _l) = pair(&ctx);
    // Twice, so the second group follows the first on the same comm.
    for round in 0..2u64 {
        let tags: Vec<i32> = (0..8).map(|k| 40 + k).collect();
        // Buffer k gets tag 40+k and a size of its own; one is zero bytes.
        let len = |k: usize| {
            if k == 3 {
                0
            } else {
                1000 * k + 17 * round as usize + 1
            }
        };
        let mut rbufs: Vec<Buffer> = (0..8).map(|_| r.register(16384).unwrap()).collect();
        for b in &mut rbufs {
            fill(b, &[0xEE; 16384]);
        }
        let mut group: Vec<(&mut Buffer, usize, i32)> = (rbufs.iter_mut())
            .zip(&tags)
            .map(|(b, &t)| (b, 16384, t))
            .collect();
        let mut rr = r.irecv_group(&mut group).unwrap().expect("slot");
        drop(group);
        // The sends come in another order than the buffers.
        let order = [5usize, 0, 7, 3, 1, 6, 2, 4];
        let mut sends = Vec::new();
        for &k in &order {
            let mut b = s.register(len(k).max(1)).unwrap();
            fill(&mut b, &pattern(round * 8 + k as u64, len(k)));
            let q = (s.isend_patiently(&b, len(k), tags[k]).unwrap()).expect("taken");
            sends.push((b, q));
        }
        let sizes = wait_all(&mut rr).unwrap();
        assert_eq!(
            sizes,
            (0..8).map(len).collect::<Vec<_>>(),
            "sizes by buffer"
        );
        for (k, b) in rbufs.iter().enumerate() {
            let got = b.bytes().unwrap();
            assert!(
                got[..len(k)] == pattern(round * 8 + k as u64, len(k))[..],
                "round {round}: buffer {k} holds another send's bytes"
            );
            assert!(
                got[len(k)..].iter().all(|&x| x == 0xEE),
                "buffer {k} overrun"
            );
        }
        for (_, q) in &mut sends {
            wait(q).unwrap();
        }
    }
}

#[test]
fn a_send_whose_tag_no_free_buffer_has_waits_and_the_comm_goes_on() {
    let ctx = setup();
    let (s, r, _l) = pair(&ctx);
    let mut a = r.register(64).unwrap();
    let mut b = r.register(64).unwrap();
    let mut rr = r
        .irecv_group(&mut [(&mut a, 64, 1), (&mut b, 64, 2)])
        .unwrap()
        .expect("slot");
    let (sb, sb2, sb3) = (
        s.register(8).unwrap(),
        s.register(8).unwrap(),
        s.register(8).unwrap(),
    );
    let mut one = s.isend_patiently(&sb, 8, 1).unwrap().expect("taken");
    // The group is heard of; no buffer of it has tag 3: "not now", as often as asked.
    for _ in 0..1000 {
        assert!(s.isend_tagged(&sb2, 8, 3).unwrap().is_none());
    }
    let mut two = s.isend_patiently(&sb3, 8, 2).unwrap().expect("taken");
    assert_eq!(wait_all(&mut rr).unwrap(), vec![8, 8]);
    assert_eq!((wait(&mut one), wait(&mut two)), (Ok(8), Ok(8)));
    // The comm goes on: the tag-3 send takes the next receive that has it.
    let mut c = r.register(64).unwrap();
    let mut rr = r
        .irecv_group(&mut [(&mut c, 64, 3)])
        .unwrap()
        .expect("slot");
    let mut three = s.isend_patiently(&sb2, 8, 3).unwrap().expect("taken");
    assert_eq!(wait_all(&mut rr).unwrap(), vec![8]);
    assert_eq!(wait(&mut three), Ok(8));
}

#[test]
fn a_send_larger_than_its_receive_is_cut_to_it_on_both_sides() {
    let ctx = setup();
    let (s, r, _l) = pair(&ctx);
    let mut sb = s.register(200).unwrap();
    let data = pattern(7, 150);
    fill(&mut sb, &data);
    let mut rb = r.register(200).unwrap();
    fill(&mut rb, &[0xEE; 200]);
    let mut rr = r.irecv(&mut rb, 100).unwrap().unwrap();
    let mut sr = s.isend_patiently(&sb, 150, 0).unwrap().expect("taken");
    // As NCCL's IB transport: the send is cut to the receive, and both report 100 bytes.
    assert_eq!(wait(&mut rr), Ok(100));
    assert_eq!(wait(&mut sr), Ok(100));
    let got = rb.bytes().unwrap();
    assert!(
        got[..100] == data[..100],
        "the receive holds the send's first 100 bytes"
    );
    assert!(
        got[100..].iter().all(|&b| b == 0xEE),
        "nothing past the receive"
    );
}

#[test]
fn bad_handles_are_invalid_argument_not_crashes() {
    let ctx = setup();
    let junk = [0u64; 4];
    let bogus = junk.as_ptr() as usize;
    assert_eq!(driver::test_raw(0), 4);
    assert_eq!(driver::test_raw(bogus), 4);
    assert_eq!(driver::close_send_raw(0), 4);
    assert_eq!(driver::close_recv_raw(bogus), 4);
    let (r, req) = driver::isend_raw(bogus);
    assert_eq!(r, 4);
    assert_eq!(req, 0, "*request must be written even on error");
    let (s, rc, _l) = pair(&ctx);
    let raw = s.raw();
    s.close().unwrap();
    assert_eq!(driver::close_send_raw(raw), 4, "double close");
    drop(rc);
}

#[test]
fn a_stranger_with_garbage_is_dropped_and_the_listener_keeps_serving() {
    let ctx = setup();
    let (mut handle, listener) = ctx.listen(0).unwrap();
    let h = railover::plugin::NetHandle::decode(&handle).unwrap();
    let rt = railover::plugin::runtime().unwrap();
    let before = rt
        .stats()
        .rejected_connections
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut stranger = std::net::TcpStream::connect(h.addr).unwrap();
    stranger
        .write_all(b"GET / HTTP/1.1\r\nHost: railover\r\n\r\n")
        .unwrap();
    // A peer with the right address but the wrong comm token.
    let mut forged = handle;
    forged[24] ^= 0xFF;
    let mut forged_comm = None;
    let mut refused = false;
    let (mut s, mut r) = (None, None);
    let end = deadline();
    while s.is_none() || r.is_none() || !refused {
        assert!(Instant::now() < end, "listener stopped serving");
        if s.is_none() {
            s = ctx.connect(0, &mut handle).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
        if !refused {
            match ctx.connect(0, &mut forged) {
                Ok(Some(c)) => forged_comm = Some(c),
                Ok(None) => {}
                Err(_) => refused = true,
            }
        }
    }
    assert!(forged_comm.is_none(), "a wrong token must not get a comm");
    // The connector hears the refusal before the listener's side may have let the
    // stranger's lane go (both are the reactor's to count, in its own time): wait for it.
    let rejected = || {
        rt.stats()
            .rejected_connections
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let end = deadline();
    while rejected() < before + 2 && Instant::now() < end {
        std::thread::yield_now();
    }
    let after = rejected();
    assert!(
        after >= before + 2,
        "garbage and wrong token are counted: {before} -> {after}"
    );
    assert!(
        listener.accept().unwrap().is_none(),
        "no comm for the stranger"
    );
    // The real pair still works.
    let (s, r) = (s.unwrap(), r.unwrap());
    let sb = s.register(10).unwrap();
    let mut rb = r.register(10).unwrap();
    let mut rr = r.irecv(&mut rb, 10).unwrap().unwrap();
    let mut sr = s.isend_patiently(&sb, 10, 0).unwrap().expect("taken");
    assert_eq!(wait(&mut rr).unwrap(), 10);
    wait(&mut sr).unwrap();
}

#[test]
fn metrics_count_the_bytes_that_moved() {
    let ctx = setup();
    let (s, r, _l) = pair(&ctx);
    let len = 1 << 20;
    let sb = s.register(len).unwrap();
    let mut rb = r.register(len).unwrap();
    let mut rr = r.irecv(&mut rb, len).unwrap().unwrap();
    let mut sr = s.isend_patiently(&sb, len, 0).unwrap().expect("taken");
    wait(&mut rr).unwrap();
    wait(&mut sr).unwrap();
    // The reactor hands counters to the registry every 100 ms: poll the rendered text.
    let rt = railover::plugin::runtime().unwrap();
    let value = |text: &str, series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    let end = deadline();
    loop {
        let text = rt.telemetry.render();
        let tx = value(&text, "railover_bytes_total{nic=\"lo\",direction=\"tx\"}");
        let rx = value(&text, "railover_bytes_total{nic=\"lo\",direction=\"rx\"}");
        if tx >= len as f64 && rx >= len as f64 {
            break;
        }
        assert!(
            Instant::now() < end,
            "bytes not counted: tx {tx} rx {rx}\n{text}"
        );
        std::thread::yield_now();
    }
}
