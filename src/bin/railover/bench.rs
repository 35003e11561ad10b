//! `railover bench`: throughput and latency through the plugin ABI, against plain TCP
//! sockets on the same loopback path, measured in the same run. Two processes, as two
//! NCCL ranks: this one receives, a child sends.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use railover::ffi::driver::{Buffer, Ctx, Request};

use crate::peer::{self, Peer};

const DEPTH: usize = 8;
/// Bytes per size point: enough for a stable figure, small enough for a quick run.
const BYTES_PER_POINT: u64 = 512 << 20;
const PINGS: u64 = 20_000;

struct Row {
    size: usize,
    plugin: f64,
    raw: f64,
}

fn count_for(size: usize) -> u64 {
    (BYTES_PER_POINT / size as u64).clamp(64, 100_000)
}

pub fn run(args: &[String]) -> i32 {
    let mut sizes: Vec<usize> = (12..=26).step_by(2).map(|p| 1usize << p).collect(); // 4 KiB … 64 MiB
    let mut quick = false;
    for a in args {
        match a.as_str() {
            "--quick" => quick = true,
            other => {
                eprintln!("railover bench: unknown option {other:?} (accepted: --quick)");
                return 2;
            }
        }
    }
    if quick {
        sizes = vec![4 << 10, 1 << 20, 16 << 20];
    }
    // The benchmark runs on loopback only.
    std::env::set_var("RAILOVER_IFNAME", "lo");
    // Two processes of one run would both try the default metrics port: unless asked
    // for, no endpoint.
    if std::env::var_os("RAILOVER_METRICS_PORT").is_none() {
        std::env::set_var("RAILOVER_METRICS_PORT", "off");
    }
    let scale = if quick { 8 } else { 1 };
    let mut p = match Peer::spawn() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("railover bench: cannot start the peer process: {e}");
            return 1;
        }
    };

    // Baseline: one TCP connection, same sizes, same process pair.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    p.send(&format!("raw {}", l.local_addr().unwrap()));
    let (mut sock, _) = l.accept().expect("raw accept");
    sock.set_nodelay(true).unwrap();
    assert_eq!(p.recv(), "ok");
    let mut raw_rates = Vec::new();
    for &size in &sizes {
        let count = (count_for(size) / scale).max(16);
        p.send(&format!("raw-stream {size} {count}"));
        // Whole messages into rotating, pre-touched buffers, as the plugin side does.
        let mut bufs: Vec<Vec<u8>> = (0..DEPTH).map(|_| vec![1u8; size]).collect();
        let total = size as u64 * count;
        let mut first: Option<(Instant, u64)> = None;
        for m in 0..count as usize {
            let buf = &mut bufs[m % DEPTH];
            let mut off = 0;
            while off < size {
                let n = sock.read(&mut buf[off..]).expect("raw read");
                assert!(n > 0, "raw peer closed");
                off += n;
                if first.is_none() {
                    first = Some((Instant::now(), n as u64));
                }
            }
        }
        let (t0, b0) = first.unwrap();
        raw_rates.push(rate(total - b0, t0.elapsed()));
        sock.write_all(&[1]).unwrap();
        assert_eq!(p.recv(), "ok");
    }
    let pings = PINGS / scale;
    p.send(&format!("raw-pong {pings}"));
    let mut b = [0u8; 8];
    let t0 = Instant::now();
    for _ in 0..pings {
        sock.write_all(&b).unwrap();
        sock.read_exact(&mut b).unwrap();
    }
    let raw_rtt = t0.elapsed() / pings as u32;
    assert_eq!(p.recv(), "ok");

    // The plugin: this process receives on `back`, answers pings on `fwd`.
    let ctx = Ctx::init().expect("railover init");
    let (h, listener) = ctx.listen(0).expect("listen");
    p.send(&format!("plugin {}", peer::hex(&h)));
    let reply = p.recv();
    let mut ph = peer::unhex(reply.strip_prefix("handle ").expect("peer handle"));
    let recv = peer::accept(&listener).expect("accept");
    let send = peer::connect(&ctx, &mut ph).expect("connect");
    assert_eq!(p.recv(), "ok");
    let mut rows = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        let count = (count_for(size) / scale).max(16);
        let mut bufs: Vec<Buffer> = (0..DEPTH).map(|_| recv.register(size).unwrap()).collect();
        for b in &mut bufs {
            b.bytes_mut().unwrap().fill(1);
        }
        p.send(&format!("stream {size} {count} {DEPTH}"));
        let (bytes, dt) = receive_stream(&recv, &mut bufs, size, count);
        assert_eq!(p.recv(), "ok");
        rows.push(Row {
            size,
            plugin: rate(bytes, dt),
            raw: raw_rates[k],
        });
    }
    p.send(&format!("pong {pings}"));
    let sb = send.register(8).unwrap();
    let mut rbs = [recv.register(8).unwrap(), recv.register(8).unwrap()];
    let t0 = Instant::now();
    let mut next = recv.irecv(&mut rbs[0], 8).unwrap().expect("slot");
    for i in 0..pings {
        let mut sr = send.isend(&sb, 8).unwrap().expect("slot");
        peer::wait(&mut next).unwrap();
        if i + 1 < pings {
            next = recv
                .irecv(&mut rbs[((i + 1) % 2) as usize], 8)
                .unwrap()
                .expect("slot");
        }
        peer::wait(&mut sr).unwrap();
    }
    let plugin_rtt = t0.elapsed() / pings as u32;
    assert_eq!(p.recv(), "ok");
    drop((send, recv, listener, sb, rbs));
    let _ = ctx.finalize();
    let peer_ok = p.finish();

    println!("railover bench: loopback, {DEPTH} messages in flight, plugin (two processes, v12 ABI) vs plain TCP");
    println!(
        "{:>10} {:>14} {:>14} {:>8}",
        "size", "plugin GB/s", "TCP GB/s", "ratio"
    );
    for r in &rows {
        println!(
            "{:>10} {:>14.2} {:>14.2} {:>8.2}",
            human(r.size),
            r.plugin,
            r.raw,
            r.plugin / r.raw
        );
    }
    let ratio = plugin_rtt.as_secs_f64() / raw_rtt.as_secs_f64();
    println!(
        "8 B round trip: plugin {:.1} us, TCP {:.1} us, ratio {:.2}",
        plugin_rtt.as_secs_f64() * 1e6,
        raw_rtt.as_secs_f64() * 1e6,
        ratio
    );
    let big: Vec<f64> = rows
        .iter()
        .filter(|r| r.size >= 1 << 20)
        .map(|r| r.plugin / r.raw)
        .collect();
    let worst = big.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "targets: throughput >= 0.80x at >= 1 MiB (worst {worst:.2}x: {}), 8 B round trip <= 2x ({ratio:.2}x: {})",
        if worst >= 0.8 { "met" } else { "MISSED" },
        if ratio <= 2.0 { "met" } else { "MISSED" }
    );
    if peer_ok {
        0
    } else {
        1
    }
}

/// Receives `count` messages with all buffers posted; returns the bytes and time from
/// the first completion to the last (so the peer's start-up is not counted).
fn receive_stream(
    recv: &railover::ffi::driver::RecvComm,
    bufs: &mut [Buffer],
    size: usize,
    count: u64,
) -> (u64, Duration) {
    let depth = bufs.len();
    let mut reqs: Vec<Option<Request>> = (0..depth).map(|_| None).collect();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut first: Option<Instant> = None;
    let end = Instant::now() + peer::PATIENCE;
    let mut backoff = peer::Backoff::default();
    while done < count {
        assert!(Instant::now() < end, "receive stream stalled");
        let slot = (posted % depth as u64) as usize;
        if posted < count && reqs[slot].is_none() {
            if let Some(r) = recv.irecv(&mut bufs[slot], size).unwrap() {
                reqs[slot] = Some(r);
                posted += 1;
                backoff.reset();
                continue;
            }
        }
        let oldest = (done % depth as u64) as usize;
        if let Some(r) = reqs[oldest].as_mut() {
            if let Some(n) = r.test().unwrap() {
                assert_eq!(n, size);
                reqs[oldest] = None;
                done += 1;
                first.get_or_insert_with(Instant::now);
                backoff.reset();
                continue;
            }
        }
        backoff.idle();
    }
    let t0 = first.unwrap();
    ((count - 1) * size as u64, t0.elapsed())
}

fn rate(bytes: u64, dt: Duration) -> f64 {
    bytes as f64 / dt.as_secs_f64() / 1e9
}

pub fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}
