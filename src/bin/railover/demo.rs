//! `railover demo`: two processes, one stream through the plugin, every byte checked,
//! throughput printed as it happens, a summary at the end.

use std::time::{Duration, Instant};

use railover::ffi::driver::{Buffer, Ctx, Request};

use crate::peer::{self, Peer};

const SIZE: usize = 4 << 20;
const DEPTH: usize = 8;
const BATCH: u64 = 64;

pub fn run(args: &[String]) -> i32 {
    let mut seconds = 5.0f64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.clone().next()) {
            ("--seconds", Some(v)) => {
                seconds = match v.parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= 3600.0 => s,
                    _ => {
                        eprintln!("railover demo: --seconds {v:?} is not valid: expected a number of seconds in (0, 3600]");
                        return 2;
                    }
                };
                it.next();
            }
            _ => {
                eprintln!("railover demo: unknown option {a:?} (accepted: --seconds N)");
                return 2;
            }
        }
    }
    match railover::testbed::unavailable() {
        None => return crate::failover_demo::run(seconds.max(12.0)),
        Some(why) => {
            println!("railover demo: LOOPBACK VARIANT: no failover shown ({why}).");
            println!("railover demo: as root, `railover demo` builds two network namespaces joined by four");
            println!(
                "railover demo: shaped links, takes one down and brings it back while data flows."
            );
        }
    }
    // Self-contained: loopback only.
    std::env::set_var("RAILOVER_IFNAME", "lo");
    // Two processes of one run would both try the default metrics port: unless asked
    // for, no endpoint.
    if std::env::var_os("RAILOVER_METRICS_PORT").is_none() {
        std::env::set_var("RAILOVER_METRICS_PORT", "off");
    }
    println!("railover demo: two processes on loopback, {}-MiB messages, {DEPTH} in flight, every byte verified", SIZE >> 20);
    let mut p = match Peer::spawn() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("railover demo: cannot start the peer process: {e}");
            return 1;
        }
    };
    let ctx = match Ctx::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("railover demo: plugin init failed: {e}");
            return 1;
        }
    };
    let props = ctx.properties(0).expect("properties");
    println!(
        "plugin {:?}, NIC {} ({} Mbps)",
        railover::ffi::driver::name(),
        props.name,
        props.speed_mbps
    );
    let (h, listener) = ctx.listen(0).expect("listen");
    p.send(&format!("plugin {}", peer::hex(&h)));
    let reply = p.recv();
    let mut ph = peer::unhex(reply.strip_prefix("handle ").expect("peer handle"));
    let recv = peer::accept(&listener).expect("accept");
    let _send = peer::connect(&ctx, &mut ph).expect("connect");
    assert_eq!(p.recv(), "ok");

    let mut bufs: Vec<Buffer> = (0..DEPTH).map(|_| recv.register(SIZE).unwrap()).collect();
    let start = Instant::now();
    let (mut total_bytes, mut msgs, mut bad) = (0u64, 0u64, 0u64);
    let mut last_print = start;
    let mut last_bytes = 0u64;
    let mut peak = 0f64;
    println!("{:>8} {:>12} {:>12}", "time s", "GB/s", "verified");
    while start.elapsed().as_secs_f64() < seconds {
        p.send(&format!("stream {SIZE} {BATCH} {DEPTH} 1 {msgs}"));
        let mut reqs: Vec<Option<Request>> = (0..DEPTH).map(|_| None).collect();
        let (mut posted, mut done) = (0u64, 0u64);
        while done < BATCH {
            let slot = (posted % DEPTH as u64) as usize;
            if posted < BATCH && reqs[slot].is_none() {
                if let Some(r) = recv.irecv(&mut bufs[slot], SIZE).expect("irecv") {
                    reqs[slot] = Some(r);
                    posted += 1;
                    continue;
                }
            }
            let oldest = (done % DEPTH as u64) as usize;
            if let Some(n) = reqs[oldest]
                .as_mut()
                .and_then(|r| r.test().expect("receive failed"))
            {
                reqs[oldest] = None;
                if n != SIZE
                    || !peer::check_pattern(&bufs[oldest].bytes().unwrap()[..n], msgs + done)
                {
                    bad += 1;
                }
                done += 1;
                total_bytes += n as u64;
                let now = Instant::now();
                if now - last_print >= Duration::from_millis(500) {
                    let r =
                        (total_bytes - last_bytes) as f64 / (now - last_print).as_secs_f64() / 1e9;
                    peak = peak.max(r);
                    println!(
                        "{:>8.1} {:>12.2} {:>12}",
                        (now - start).as_secs_f64(),
                        r,
                        msgs + done
                    );
                    last_print = now;
                    last_bytes = total_bytes;
                }
                continue;
            }
            std::thread::yield_now();
        }
        msgs += BATCH;
        assert_eq!(p.recv(), "ok");
    }
    let dt = start.elapsed().as_secs_f64();
    drop((recv, _send, listener, bufs));
    let _ = ctx.finalize();
    let peer_ok = p.finish();
    println!();
    println!("summary");
    println!("  messages      {msgs}");
    println!("  bytes         {total_bytes}");
    println!("  corrupted     {bad}");
    println!("  mean GB/s     {:.2}", total_bytes as f64 / dt / 1e9);
    println!("  peak GB/s     {peak:.2}");
    if bad == 0 && peer_ok {
        0
    } else {
        1
    }
}
