//! A flood of connections that never authenticate, against a plugin process limited to
//! 1024 descriptors: the handshake caps hold, the deadline closes what is left, real
//! connects keep working meanwhile, and descriptors and memory come back afterwards.
//!
//! The receiver runs in a child process (this test binary again, running the ignored
//! `flood_receiver` test) so that only it gets `ulimit -n 1024`; the parent floods.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railover::conn::auth::Initiator;
use railover::conn::wire::NicAddr;
use railover::reactor::HANDSHAKES_IDLE_TOTAL;
use railover_testkit::driver::{connect_pair, Ctx, Listener, Request};

const FLOOD: usize = 3000;

fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn wait(req: &mut Request, end: Instant) -> usize {
    loop {
        if let Some(n) = req.test().expect("request failed") {
            return n;
        }
        assert!(Instant::now() < end, "request did not complete");
        std::thread::yield_now();
    }
}

/// A real connect/accept on `listener` (whose handle is `handle`) and one checked
/// message; `Err` when the connect failed, as NCCL's communicator setup would.
fn legit_pair(ctx: &Ctx, listener: &Listener, handle: &[u8; 128], seed: u8) -> Result<(), String> {
    let mut handle = *handle;
    let limit = Duration::from_secs(40);
    let end = Instant::now() + limit;
    let (s, r) = connect_pair(ctx, 0, &mut handle, listener, limit)
        .map_err(|e| format!("connect_pair: {e:?}"))?;
    let len = 1 << 20;
    let mut sb = s.register(len).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ seed).collect();
    sb.bytes_mut().unwrap().copy_from_slice(&data);
    let mut rb = r.register(len).unwrap();
    let mut rr = r.irecv(&mut rb, len).unwrap().unwrap();
    let mut sr = s.isend_patiently(&sb, len, 0).unwrap().expect("taken");
    assert_eq!(wait(&mut rr, end), len);
    wait(&mut sr, end);
    assert!(rb.bytes().unwrap() == &data[..], "payload corrupted");
    Ok(())
}

/// The receiver: answers the parent's commands on stdin, one line each.
#[test]
#[ignore = "run by a_flood_of_idle_connections_is_bounded_and_leaves_nothing_behind"]
fn flood_receiver() {
    if std::env::var_os("RAILOVER_FLOOD_CHILD").is_none() {
        eprintln!("skipped: only runs as the flood test's child process");
        return;
    }
    std::env::set_var("RAILOVER_IFNAME", "lo");
    let ctx = Ctx::init().expect("init");
    let rt = railover::plugin::runtime().unwrap();
    // The listener the flood targets is the one the real connects use.
    let (handle, listener) = ctx.listen(0).expect("listen");
    let nccl = railover::plugin::NetHandle::decode(&handle).unwrap().addr;
    // Warm up: one real comm, so the baseline includes what any comm costs.
    legit_pair(&ctx, &listener, &handle, 1).expect("a connect before any flood");
    let (fds0, rss0) = (open_fds(), status_kb("VmRSS:"));
    println!(
        "ready nccl={nccl} failover={} fds={fds0} rss={rss0}",
        rt.reactor.wire_nics[0].addr
    );
    let st = rt.stats();
    let (tx, commands) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    while let Ok(cmd) = commands.recv() {
        match cmd.as_str() {
            "legit" => {
                // Real connects, one after another, until the flood is over.
                let (mut pairs, mut failed) = (0u32, 0u32);
                while commands.try_recv().as_deref() != Ok("stop") {
                    match legit_pair(&ctx, &listener, &handle, (pairs as u8) | 1) {
                        Ok(()) => pairs += 1,
                        Err(e) => {
                            failed += 1;
                            eprintln!("a real connect failed: {e}");
                        }
                    }
                }
                println!("legit ok pairs={pairs} failed={failed}");
            }
            "settle" => {
                // Until the deadline has closed every stranger's connection.
                let end = Instant::now() + Duration::from_secs(15);
                while st.handshakes_pending.load(Ordering::Relaxed) > 0 && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(50));
                }
                println!(
                    "settled pending={} peak={} evicted={} rejected={} fds={} rss={}",
                    st.handshakes_pending.load(Ordering::Relaxed),
                    st.handshakes_peak.load(Ordering::Relaxed),
                    st.evicted_handshakes.load(Ordering::Relaxed),
                    st.rejected_connections.load(Ordering::Relaxed),
                    open_fds(),
                    status_kb("VmRSS:"),
                );
            }
            _ => break,
        }
    }
}

struct Receiver {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    /// Its log, drained as it comes so that it never blocks on a full pipe.
    log: Arc<Mutex<String>>,
}

impl Receiver {
    fn spawn() -> Receiver {
        let exe = std::env::current_exe().unwrap();
        // `ulimit` in a shell that then becomes the test binary: only the child is limited.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("ulimit -n 1024 && exec \"$0\" \"$@\"")
            .arg(exe)
            .args(["flood_receiver", "--exact", "--ignored", "--nocapture"])
            .env("RAILOVER_FLOOD_CHILD", "1")
            .env("RAILOVER_METRICS_PORT", "off")
            .env("RAILOVER_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the receiver");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let log = Arc::new(Mutex::new(String::new()));
        let (mut err, sink) = (child.stderr.take().unwrap(), Arc::clone(&log));
        std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut b) {
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&b[..n]));
            }
        });
        Receiver {
            child,
            stdin,
            out,
            log,
        }
    }

    /// The next line starting with `prefix` (test harness chatter is skipped).
    fn line(&mut self, prefix: &str) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            if self.out.read_line(&mut l).unwrap() == 0 {
                let _ = self.child.wait();
                panic!(
                    "receiver ended before {prefix:?}:\n{}",
                    self.log.lock().unwrap()
                );
            }
            if l.starts_with(prefix) {
                return l.trim().to_string();
            }
        }
    }

    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
    }
}

fn field<T: std::str::FromStr>(line: &str, key: &str) -> T {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

#[test]
fn a_flood_of_idle_connections_is_bounded_and_leaves_nothing_behind() {
    let mut rx = Receiver::spawn();
    let ready = rx.line("ready");
    let nccl: SocketAddr = field(&ready, "nccl");
    let failover: SocketAddr = field(&ready, "failover");
    let (fds0, rss0): (usize, u64) = (field(&ready, "fds"), field(&ready, "rss"));

    // Real connects run in the receiver while the flood is under way.
    rx.send("legit");
    let start = Instant::now();
    let flooders: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for i in 0..FLOOD / 4 {
                    let to = if i % 3 == 0 { failover } else { nccl };
                    if let Ok(mut s) = TcpStream::connect_timeout(&to, Duration::from_secs(5)) {
                        // Some idle, some stuck half-way through a header.
                        if (i + t) % 3 == 0 {
                            let _ = s.write_all(b"RO\x02\x01");
                        }
                        held.push(s);
                    }
                }
                held
            })
        })
        .collect();
    let mut held: Vec<TcpStream> = flooders
        .into_iter()
        .flat_map(|f| f.join().unwrap())
        .collect();
    let flooded = start.elapsed();
    assert!(
        held.len() >= FLOOD * 9 / 10,
        "only {} connected",
        held.len()
    );
    rx.send("stop");
    let legit = rx.line("legit ok");
    assert!(field::<u32>(&legit, "pairs") >= 1, "{legit}");
    assert_eq!(field::<u32>(&legit, "failed"), 0, "{legit}");

    // Every flood connection is closed by the receiver: by eviction, or at the deadline.
    for s in &held {
        s.set_nonblocking(true).unwrap();
    }
    let end = Instant::now() + Duration::from_secs(15);
    let mut open = held.len();
    while open > 0 {
        assert!(
            Instant::now() < end,
            "{open} flood connections still open 15 s after the flood"
        );
        let mut b = [0u8; 64];
        held.retain_mut(
            |s| matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        );
        open = held.len();
        std::thread::sleep(Duration::from_millis(20));
    }
    let closed_after = start.elapsed();

    rx.send("settle");
    let settled = rx.line("settled");
    rx.send("quit");
    let _ = rx.child.wait();
    let (pending, peak): (u64, u64) = (field(&settled, "pending"), field(&settled, "peak"));
    let (fds, rss): (usize, u64) = (field(&settled, "fds"), field(&settled, "rss"));
    eprintln!(
        "flood of {FLOOD} in {flooded:?} ({legit}), all closed after {closed_after:?}; \
         before fds={fds0} rss={rss0} kB; after {settled}"
    );
    assert_eq!(pending, 0);
    // Idle strangers within their cap, plus the few real handshakes, which are never
    // dropped for them.
    assert!(
        peak as usize <= HANDSHAKES_IDLE_TOTAL + 16,
        "peak {peak} in handshake"
    );
    assert!(
        field::<u64>(&settled, "evicted") > 0,
        "the caps never acted: {settled}"
    );
    assert!(fds <= fds0 + 8, "descriptors: {fds0} -> {fds}");
    assert!(
        rss <= rss0 + 32 * 1024,
        "memory did not come back: {rss0} kB -> {rss} kB"
    );
    // Thousands of strangers, a line or two of log: the first, and at most a summary.
    let log = rx.log.lock().unwrap().clone();
    eprintln!("receiver log:\n{log}");
    let lines = log.lines().filter(|l| l.contains("turned away")).count();
    assert!((1..=2).contains(&lines), "{lines} log lines:\n{log}");
}

/// A Hello that names the NCCL listener's comm (anyone may send one: it needs no
/// secret), from a stranger who then never answers the Challenge.
fn stranger_hello(i: u64) -> Vec<u8> {
    let mut random = [0u8; 64];
    random[..8].copy_from_slice(&i.to_le_bytes());
    random[8] = 1;
    let nics = vec![NicAddr {
        addr: "127.0.0.1:9".parse().unwrap(),
        rail: Some(0),
        mbps: None,
    }];
    Initiator::connect(&[0x5A; 16], 0, nics, &random).1
}

#[test]
fn a_flood_of_hellos_fails_no_real_connect_and_holds_no_slot_past_the_deadline() {
    let mut rx = Receiver::spawn();
    let ready = rx.line("ready");
    let nccl: SocketAddr = field(&ready, "nccl");
    rx.send("legit");
    // As fast as four threads can: connect, a Hello naming the comm, then silence.
    let start = Instant::now();
    let flood = Duration::from_secs(4);
    let flooders: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                let mut sent = 0u64;
                while start.elapsed() < flood {
                    if let Ok(mut s) = TcpStream::connect_timeout(&nccl, Duration::from_secs(5)) {
                        if s.write_all(&stranger_hello(t << 32 | sent)).is_ok() {
                            sent += 1;
                        }
                        held.push_back(s);
                        // Hold at most 200 per thread: the descriptors of this process.
                        if held.len() > 200 {
                            held.pop_front();
                        }
                    }
                }
                (sent, held)
            })
        })
        .collect();
    let mut hellos = 0;
    let mut held = Vec::new();
    for f in flooders {
        let (n, h) = f.join().unwrap();
        hellos += n;
        held.extend(h);
    }
    rx.send("stop");
    let legit = rx.line("legit ok");
    eprintln!(
        "{hellos} Hellos in {flood:?} ({:.0}/s); {legit}",
        hellos as f64 / flood.as_secs_f64()
    );
    assert!(hellos >= 1000, "only {hellos} Hellos: not a flood");
    assert!(field::<u32>(&legit, "pairs") >= 1, "{legit}");
    assert_eq!(
        field::<u32>(&legit, "failed"),
        0,
        "a Hello flood failed real connects: {legit}"
    );
    // Every stranger's connection is closed at the pre-authentication deadline (2 s),
    // not held for the 30 s a connect of our own may take.
    for s in &held {
        s.set_nonblocking(true).unwrap();
    }
    let end = Instant::now() + Duration::from_secs(6);
    while !held.is_empty() {
        assert!(
            Instant::now() < end,
            "{} stranger connections still open 6 s after the flood",
            held.len()
        );
        let mut b = [0u8; 256];
        held.retain_mut(|s| loop {
            match s.read(&mut b) {
                Ok(0) => break false,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break true,
                Err(_) => break false,
            }
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    rx.send("quit");
    let _ = rx.child.wait();
}
