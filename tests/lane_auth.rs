//! Strangers against a live comm on loopback: one who saw the comm's handshake on the
//! wire replays it, one who holds the NCCL handle tries to migrate the comm onto its
//! own connection, one attaches and stays silent. Each is refused and counted, and the
//! comm keeps delivering intact messages.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railover::conn::auth;
use railover::conn::wire::{Header, Hello, Kind, Proof, Purpose, HEADER_LEN};
use railover::plugin::NetHandle;
use railover_testkit::driver::{self, connect_pair, Ctx, RecvComm, Request, SendComm};

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
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

/// Sends `n` messages of distinct patterns and checks each arrives intact.
fn traffic(s: &SendComm, r: &RecvComm, seed: u8, n: usize) {
    let len = 100_000;
    let mut sb = s.register(len).unwrap();
    let mut rb = r.register(len).unwrap();
    for i in 0..n {
        let fill = seed.wrapping_add(i as u8);
        let data: Vec<u8> = (0..len).map(|j| (j as u8) ^ fill).collect();
        sb.bytes_mut().unwrap().copy_from_slice(&data);
        let mut rr = r.irecv(&mut rb, len).unwrap().expect("slot");
        let mut sr = s.isend_patiently(&sb, len, 0).unwrap().expect("taken");
        assert_eq!(wait(&mut rr).unwrap(), len);
        wait(&mut sr).unwrap();
        assert!(rb.bytes().unwrap() == &data[..], "message {i} corrupted");
    }
}

/// Copies bytes both ways between the plugin's connector and the real listener,
/// keeping what went each way: an observer of the comm's first handshake.
struct Tap {
    addr: SocketAddr,
    up: Arc<Mutex<Vec<u8>>>,
    down: Arc<Mutex<Vec<u8>>>,
}

fn tap(to: SocketAddr) -> Tap {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (up, down) = (Arc::default(), Arc::default());
    let (u, d) = (Arc::clone(&up), Arc::clone(&down));
    std::thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let server = TcpStream::connect(to).unwrap();
        let pipe = |mut from: TcpStream, mut to: TcpStream, seen: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut b = [0u8; 65536];
                while let Ok(n) = from.read(&mut b) {
                    if n == 0 || to.write_all(&b[..n]).is_err() {
                        break;
                    }
                    let mut seen = seen.lock().unwrap();
                    if seen.len() < 4096 {
                        seen.extend_from_slice(&b[..n]);
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
            })
        };
        pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), u);
        pipe(server, client, d);
    });
    Tap { addr, up, down }
}

/// The handshake frames at the start of a recorded stream: (header, whole frame).
fn frames(bytes: &[u8], n: usize) -> Vec<(Header, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while out.len() < n {
        let h = Header::decode(&bytes[at..]).expect("a handshake frame");
        let end = at + HEADER_LEN + h.body_len() as usize;
        out.push((h, bytes[at..end].to_vec()));
        at = end;
    }
    out
}

fn read_frame(s: &mut TcpStream) -> Option<Header> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).ok()?;
    let h = Header::decode(&b).ok()?;
    let mut body = vec![0u8; h.body_len() as usize];
    s.read_exact(&mut body).ok()?;
    Some(h)
}

/// What a refused stranger sees after its handshake: a Refuse, then the end.
fn assert_refused(s: &mut TcpStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut kinds = Vec::new();
    while let Some(h) = read_frame(s) {
        kinds.push(h.kind);
    }
    assert_eq!(
        kinds.last(),
        Some(&Kind::Refuse),
        "{what}: expected a Refuse, got {kinds:?}"
    );
    assert!(!kinds.contains(&Kind::Welcome), "{what}: welcomed");
}

#[test]
fn strangers_with_the_handle_or_a_recording_cannot_take_a_comm() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    let ctx = Ctx::init().expect("init");
    let rt = railover::plugin::runtime().unwrap();
    let stats = rt.stats();
    let (handle, listener) = ctx.listen(0).expect("listen");
    let real = NetHandle::decode(&handle).unwrap();

    // Connect through the tap so the test sees the comm's handshake.
    let t = tap(real.addr);
    let mut via_tap = NetHandle {
        addr: t.addr,
        ..real
    }
    .encode();
    let (s, r) = connect_pair(&ctx, 0, &mut via_tap, &listener, Duration::from_secs(30))
        .expect("connect_pair");
    traffic(&s, &r, 1, 3);

    let up = t.up.lock().unwrap().clone();
    let down = t.down.lock().unwrap().clone();
    let sent = frames(&up, 2);
    let got = frames(&down, 1);
    assert_eq!(
        (sent[0].0.kind, got[0].0.kind, sent[1].0.kind),
        (Kind::Hello, Kind::Challenge, Kind::Proof)
    );
    // The handle's token is nowhere on the wire.
    for bytes in [&up, &down] {
        assert!(
            !bytes.windows(16).any(|w| w == real.token),
            "the token crossed the wire"
        );
    }
    let id = auth::observed_comm_id(&sent[0].1[HEADER_LEN..], &got[0].1[HEADER_LEN..]).unwrap();

    let refused = || stats.refused_handshakes.load(Ordering::Relaxed);
    let rejected = || stats.rejected_connections.load(Ordering::Relaxed);
    let (before, rejected_before) = (refused(), rejected());

    // 1. Replay of the recorded Hello and Proof at the NCCL listener.
    let mut replay = TcpStream::connect(real.addr).unwrap();
    replay.write_all(&sent[0].1).unwrap();
    replay.write_all(&sent[1].1).unwrap();
    assert_refused(&mut replay, "replayed handshake");
    assert!(
        listener.accept().unwrap().is_none(),
        "a replay opened a comm"
    );

    // 2. A silent stranger on the failover listener, and one that tries to migrate the
    // comm knowing its id and the handle's token (but not the session).
    let failover = rt.reactor.wire_nics[0].addr;
    let mut silent = TcpStream::connect(failover).unwrap();
    let migrate = |nonce: u8| Hello {
        purpose: Purpose::Migrate,
        comm: id.0,
        nonce: [nonce; 32],
        eph: [0; 32],
        epoch: 1,
        nics: vec![],
    };
    silent.write_all(&migrate(1).encode()).unwrap();
    let mut hijack = TcpStream::connect(failover).unwrap();
    hijack.write_all(&migrate(2).encode()).unwrap();
    hijack
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(
        read_frame(&mut hijack).map(|h| h.kind),
        Some(Kind::Challenge),
        "the comm's id is known here"
    );
    // The best a handle holder can do is guess the proof.
    for guess in [[0u8; 32], real.token.repeat(2).try_into().unwrap()] {
        let mut again = TcpStream::connect(failover).unwrap();
        again.write_all(&migrate(3).encode()).unwrap();
        again.write_all(&Proof { mac: guess }.encode()).unwrap();
        assert_refused(&mut again, "migration with a guessed proof");
    }
    // Forged data on the would-be lane is not a frame the comm ever sees.
    hijack
        .write_all(&Header::new(Kind::Data, 0, 4).encode())
        .unwrap();
    hijack.write_all(b"evil").unwrap();
    let mut b = [0u8; 64];
    let end = deadline();
    loop {
        match hijack.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(_) => assert!(Instant::now() < end, "hijacker kept"),
        }
    }

    // Replay and two guesses refused; the hijacker dropped for its forged frame.
    assert!(
        refused() >= before + 3 && rejected() >= rejected_before + 4,
        "refusals counted: {before} -> {}, rejections {rejected_before} -> {}",
        refused(),
        rejected()
    );
    // Operators see the refusals: the reactor reports them to the metrics registry
    // within its sampling interval.
    let exported = || {
        rt.telemetry
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("railover_handshakes_refused_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let end = deadline();
    while exported() < (before + 3) as f64 {
        assert!(
            Instant::now() < end,
            "railover_handshakes_refused_total stayed at {}",
            exported()
        );
        std::thread::yield_now();
    }
    // The comm keeps working, while the silent stranger is still attached.
    traffic(&s, &r, 50, 5);
    drop(silent);
    traffic(&s, &r, 90, 2);
}

#[test]
fn connect_completes_before_accept_and_outlives_the_handshake_deadline() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    let ctx = Ctx::init().expect("init");
    let (mut handle, listener) = ctx.listen(0).expect("listen");
    // The connector gets its comm once the listener's reactor has authenticated it,
    // whether or not NCCL has called accept.
    let end = deadline();
    let s = loop {
        if let Some(s) = ctx.connect(0, &mut handle).expect("connect") {
            break s;
        }
        assert!(
            Instant::now() < end,
            "connect did not finish without accept"
        );
        std::thread::yield_now();
    };
    // NCCL calls accept late, after the 2 s a connection has to authenticate: the
    // authenticated comm is not subject to it. (The sleep is the scenario, not a wait.)
    std::thread::sleep(Duration::from_millis(2500));
    let r = loop {
        if let Some(r) = listener.accept().expect("accept") {
            break r;
        }
        assert!(Instant::now() < end, "accept did not finish");
        std::thread::yield_now();
    };
    traffic(&s, &r, 7, 2);
}
