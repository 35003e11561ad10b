//! The engine against an in-memory `Io`: two engines handshake through byte buffers,
//! and the effects they ask of the sockets come in the order the contract promises.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use mio::{Poll, Token, Waker};
use parking_lot::Mutex;

use super::harness::Pending;
use super::*;
use crate::telemetry::exporter::ExporterConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Connect(usize),
    Fence(usize),
    Seal(usize),
    Close(usize),
    Bury(usize),
    Unbury,
}

/// Lanes as byte buffers: what the engine wrote, what it will read.
#[derive(Default)]
struct Mem {
    open: BTreeSet<usize>,
    rx: HashMap<usize, Vec<u8>>,
    tx: HashMap<usize, Vec<u8>>,
    broken: HashSet<usize>,
    /// Lanes the peer closed: once their bytes are read, the end of the stream.
    eof: HashSet<usize>,
    /// Lanes whose NIC cannot register the memory of the comm's next message.
    unreachable: HashSet<usize>,
    /// Lanes whose NIC cannot register receive buffers: each offer fails the write, as
    /// a verbs lane's does for GPU memory out of its reach.
    refuses_offers: HashSet<usize>,
    refuse_connect: bool,
    /// Lanes the fabric is still setting up (not [`Io::ready`]).
    setting_up: BTreeSet<usize>,
    /// Payload bytes each lane wrote in place, as its fabric counts them while it is open.
    placed: HashMap<usize, u64>,
    /// The address every lane's peer has, as `Fabric::peer` reports it.
    peer: Option<IpAddr>,
    ops: Vec<Op>,
    /// Where each connect went: (local NIC, address).
    dialled: Vec<(usize, SocketAddr)>,
}

impl Io for Mem {
    fn connect(&mut self, k: usize, nic: usize, to: SocketAddr) -> io::Result<()> {
        if self.refuse_connect {
            return Err(io::ErrorKind::ConnectionRefused.into());
        }
        self.dialled.push((nic, to));
        self.ops.push(Op::Connect(k));
        self.open.insert(k);
        Ok(())
    }
    fn peer(&self, _k: usize) -> Option<IpAddr> {
        self.peer
    }
    fn read(&mut self, k: usize, reader: &mut FrameReader) -> Result<Option<Inbound>, ReadError> {
        assert!(
            self.open.contains(&k),
            "read from lane {k}, which is not open"
        );
        if self.broken.contains(&k) {
            return Err(ReadError::Io(io::ErrorKind::TimedOut.into()));
        }
        if self.unreachable.contains(&k) {
            let e = crate::conn::MemoryUnreachable(format!("lane {k}'s NIC cannot register it"));
            return Err(ReadError::Io(io::Error::other(e)));
        }
        let rx = self.rx.entry(k).or_default();
        if rx.is_empty() && self.eof.contains(&k) {
            return reader.next(&mut std::io::empty());
        }
        reader.next(&mut Pending(rx))
    }
    fn write(&mut self, k: usize, writer: &mut FrameWriter) -> io::Result<()> {
        assert!(
            self.open.contains(&k),
            "write to lane {k}, which is not open"
        );
        let out = self.tx.entry(k).or_default();
        if self.refuses_offers.contains(&k) {
            return writer.flush_placing(&mut Refusing(out));
        }
        writer.flush(out)
    }
    fn progress(&self, k: usize) -> LaneProgress {
        // A closed lane's counts are gone with it, as in the reactor.
        match (self.open.contains(&k), self.placed.get(&k)) {
            (true, Some(&placed)) => LaneProgress {
                placed,
                ..LaneProgress::default()
            },
            _ => LaneProgress::default(),
        }
    }
    fn ready(&self, k: usize) -> bool {
        !self.setting_up.contains(&k)
    }
    fn set_pacing(&mut self, _k: usize, _rate: Option<u64>) -> io::Result<()> {
        Ok(())
    }
    fn fence(&mut self, k: usize) {
        self.ops.push(Op::Fence(k));
    }
    fn seal(&mut self, k: usize) {
        self.ops.push(Op::Seal(k));
    }
    fn close(&mut self, k: usize) {
        assert!(self.open.remove(&k), "closed lane {k} twice");
        self.ops.push(Op::Close(k));
    }
    fn bury(&mut self, k: usize) {
        assert!(self.open.remove(&k), "buried lane {k}, which is not open");
        self.ops.push(Op::Bury(k));
    }
    fn unbury(&mut self) {
        self.ops.push(Op::Unbury);
    }
}

/// A lane whose NIC refuses to register any receive buffer it is asked to offer.
struct Refusing<'a>(&'a mut Vec<u8>);

impl std::io::Write for Refusing<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl crate::transport::frames::Placer for Refusing<'_> {
    fn advertise(
        &mut self,
        seq: u64,
        _: &crate::transport::memory::LentBuf,
        _: u64,
        _: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        let e = crate::conn::MemoryUnreachable(format!("receive {seq}: not registrable here"));
        Err(io::Error::other(e))
    }
}

fn addr(host: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, host], 4000))
}

fn engine(host: u8, now: Instant) -> Engine {
    engine_with_nics(host, 1, now)
}

/// NIC `i`'s failover listener on `host`: NIC 0's is [`addr`].
fn nic_addr(host: u8, i: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, i, host], 4000))
}

/// An engine with `n` NICs, one per rail, NIC `i` at [`nic_addr`]`(host, i)`.
fn engine_with_nics(host: u8, n: u8, now: Instant) -> Engine {
    // One waker per poll: each engine has its own.
    let poll = Poll::new().unwrap();
    let setup = Setup {
        nics: (0..n)
            .map(|i| LocalNic {
                name: match i {
                    0 => format!("eth{host}"),
                    _ => format!("eth{host}.{i}"),
                },
                ip: nic_addr(host, i).ip(),
                rail: Some(u32::from(i)),
                speed_mbps: None,
            })
            .collect(),
        distance: vec![vec![None; usize::from(n)]; usize::from(n)],
        spin: Duration::ZERO,
        completion_timeout: Duration::from_secs(2),
        probe_timeout: Duration::from_millis(200),
        probe_bytes: 4096,
        fair_share: false,
        stripes: None,
        router: RouterConfig::default(),
        telemetry: Arc::new(Telemetry::start(&ExporterConfig::default(), None)),
        unmatched_warn: Duration::from_secs(10),
        entropy_seed: Some(u64::from(host)),
    };
    let queue = Arc::new(CommandQueue::new(
        Waker::new(poll.registry(), Token(usize::from(host))).unwrap(),
    ));
    let wire = (0..n)
        .map(|i| NicAddr {
            addr: nic_addr(host, i),
            rail: Some(u32::from(i)),
            mbps: None,
        })
        .collect();
    Engine::new(setup, queue, wire, now)
}

/// Engine `a` (connector, lane `ka`) and `b` (listener, lane `kb`) exchange what they
/// wrote, a bounded number of rounds.
fn shuttle(a: (&mut Engine, &mut Mem, usize), b: (&mut Engine, &mut Mem, usize), now: Instant) {
    let ((ea, ma, ka), (eb, mb, kb)) = (a, b);
    for _ in 0..8 {
        let bytes = std::mem::take(ma.tx.entry(ka).or_default());
        mb.rx.entry(kb).or_default().extend(bytes);
        eb.service_lane(kb, now, mb);
        eb.drive(now, mb);
        let bytes = std::mem::take(mb.tx.entry(kb).or_default());
        ma.rx.entry(ka).or_default().extend(bytes);
        ea.service_lane(ka, now, ma);
        ea.drive(now, ma);
    }
}

struct Pair {
    a: Engine,
    ma: Mem,
    b: Engine,
    mb: Mem,
    pending: Arc<PendingConnect>,
    listen: Arc<ListenShared>,
}

/// `b` opens NCCL listener 9, whose token is `[3; 16]`.
fn listen_on(b: &mut Engine) -> Arc<ListenShared> {
    let listen = Arc::new(ListenShared {
        id: 9,
        token: [3; 16],
        nic: 0,
        ready: Mutex::new(VecDeque::new()),
        queue: b.queue.clone(),
    });
    b.listening(listen.clone());
    listen
}

/// `e` connects from NIC 0 to NCCL listener 9 at [`addr`]`(2)`, with token `[3; 16]`
/// and no failover NICs in the handle.
fn connect_to_listener(
    e: &mut Engine,
    pending: &Arc<PendingConnect>,
    now: Instant,
    io: &mut dyn Io,
) {
    e.connect(0, addr(2), &[3; 16], Rescue::default(), pending, now, io);
}

/// `a` connects to `b`'s NCCL listener; both sides' lane is 0.
fn connected(now: Instant) -> Pair {
    connected_after(now, |_| {})
}

/// As [`connected`], with `b` set up by `prepare` before it accepts.
fn connected_after(now: Instant, prepare: impl FnOnce(&mut Engine)) -> Pair {
    let (mut a, mut b) = (engine(1, now), engine(2, now));
    prepare(&mut b);
    let (mut ma, mut mb) = (Mem::default(), Mem::default());
    let listen = listen_on(&mut b);
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &pending, now, &mut ma);
    a.drive(now, &mut ma);
    assert_eq!(ma.ops, [Op::Connect(0)]);
    let kb = b.next_lane();
    mb.open.insert(kb);
    b.accepted(kb, 0, Some(9), Some(0), now, &mut mb);
    shuttle((&mut a, &mut ma, 0), (&mut b, &mut mb, kb), now);
    Pair {
        a,
        ma,
        b,
        mb,
        pending,
        listen,
    }
}

#[test]
fn a_connect_through_the_io_seam_becomes_a_comm_on_both_sides() {
    let now = Instant::now();
    let p = connected(now);
    let sent = p.pending.result.lock().take();
    let send = sent.expect("the connect finished").expect("it succeeded");
    assert_eq!(send.side, Side::Send);
    assert_eq!(
        p.listen.ready.lock().len(),
        1,
        "the listener has the comm to accept"
    );
    assert_eq!(p.a.comms.len(), 1);
    assert_eq!(p.b.comms.len(), 1);
    assert_eq!(p.b.stats.rejected_connections.load(Ordering::Relaxed), 0);
    assert!(
        p.mb.ops.is_empty(),
        "the listener closed nothing: {:?}",
        p.mb.ops
    );
}

#[test]
fn bytes_waiting_unread_when_a_lane_is_judged_silent_are_read_and_save_it() {
    let t0 = Instant::now();
    let mut p = connected(t0);
    let kb = *p.mb.open.iter().next().unwrap();
    // Past the completion timeout (2 s here).
    let late = t0 + Duration::from_millis(2100);
    // The sender's keepalive reached b's socket, but b's reactor fell behind and has
    // not read it when the lane's silence deadline comes.
    let mut ka = Vec::new();
    ka.extend_from_slice(&Header::new(Kind::Keepalive, 0, 0).encode());
    p.mb.rx.entry(kb).or_default().extend(ka);
    p.b.handle_timeout(late, &mut p.mb);
    assert!(
        p.b.lanes.contains(kb),
        "failed with its proof of life unread"
    );
    assert!(p.mb.rx[&kb].is_empty(), "read before it was judged");
    assert!(
        !p.mb.ops.iter().any(|o| matches!(o, Op::Close(_))),
        "{:?}",
        p.mb.ops
    );
    // Nothing arrives for another timeout: now it is silent, and fails.
    p.b.handle_timeout(late + Duration::from_millis(2000), &mut p.mb);
    assert!(!p.b.lanes.contains(kb), "a silent lane is failed");
}

#[test]
fn a_receive_lane_that_fails_tells_the_sender_then_is_sealed_not_fenced() {
    let now = Instant::now();
    let mut p = connected(now);
    let kb = *p.mb.open.iter().next().unwrap();
    p.mb.broken.insert(kb);
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    let told = p.mb.tx.get(&kb).cloned().unwrap_or_default();
    let stalled = Header::new(Kind::Stalled, 0, 0).encode();
    assert!(
        told.windows(stalled.len()).any(|w| w == stalled),
        "the sender is told first"
    );
    // Sealed, so that no write in place still on its way lands after a replay, but not
    // fenced, which could drop the Stalled before it is out.
    let seal = p.mb.ops.iter().position(|&o| o == Op::Seal(kb));
    let close = p.mb.ops.iter().position(|&o| o == Op::Close(kb));
    assert!(
        matches!((seal, close), (Some(s), Some(c)) if s < c),
        "seal then close, got {:?}",
        p.mb.ops
    );
    assert!(!p.mb.ops.contains(&Op::Fence(kb)), "{:?}", p.mb.ops);
}

#[test]
fn a_send_lane_that_fails_is_fenced_before_it_is_closed() {
    let now = Instant::now();
    let mut p = connected(now);
    p.ma.broken.insert(0);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    let fence = p.ma.ops.iter().position(|&o| o == Op::Fence(0));
    let close = p.ma.ops.iter().position(|&o| o == Op::Close(0));
    assert!(
        matches!((fence, close), (Some(f), Some(c)) if f < c),
        "fence then close, got {:?}",
        p.ma.ops
    );
    assert_eq!(p.a.stats.lane_failures.load(Ordering::Relaxed), 1);
    assert_eq!(
        p.a.comms.len(),
        1,
        "the comm survives its lane: it fails over"
    );
}

#[test]
fn a_send_lane_given_up_is_remembered_for_the_fence_every_lane_sends_first() {
    let now = Instant::now();
    let mut p = connected(now);
    p.ma.broken.insert(0);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    assert_eq!(p.a.comms[0].fenced, [0], "the first lane's epoch is 0");
}

#[test]
fn a_fence_from_the_sender_fences_and_drops_the_lane_it_names_and_no_other() {
    let now = Instant::now();
    let mut p = connected(now);
    // A second lane of the receive comm: the sender's replacement, attempt 1.
    let kb2 = p.b.next_lane();
    p.mb.open.insert(kb2);
    p.b.accepted(kb2, 0, None, Some(0), now, &mut p.mb);
    p.b.attach_replacement(0, kb2, 1, now, &mut p.mb);
    assert_eq!(p.b.comms[0].path.lanes().count(), 2);
    p.mb.ops.clear();
    // A Fence for the lane it comes on changes nothing.
    let kb = p.b.comms[0]
        .path
        .lanes()
        .map(|(k, _)| k)
        .find(|&k| k != kb2)
        .unwrap();
    let f = Header::new(Kind::Fence, 0, 0).encode();
    p.mb.rx.entry(kb).or_default().extend_from_slice(&f);
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    assert!(p.mb.ops.is_empty(), "{:?}", p.mb.ops);
    let f = Header::new(Kind::Fence, 1, 0).encode();
    p.mb.rx.entry(kb).or_default().extend_from_slice(&f);
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    assert_eq!(p.mb.ops, [Op::Fence(kb2), Op::Seal(kb2), Op::Close(kb2)]);
    let left: Vec<usize> = p.b.comms[0].path.lanes().map(|(k, _)| k).collect();
    assert_eq!(
        left,
        [kb],
        "the comm goes on over the lane the Fence came on"
    );
    assert!(p.b.comms[0].shared.failure().is_none());
}

#[test]
fn a_data_claiming_to_be_placed_on_a_lane_that_offered_nothing_completes_nothing() {
    let now = Instant::now();
    let mut p = connected(now);
    let kb = *p.mb.open.iter().next().unwrap();
    let shared = p.b.comms[0].shared.clone();
    let req = Arc::new(Request::new(shared.clone()));
    let buf = UserBuf::of_slice(Vec::leak(vec![0xEEu8; 4096]));
    p.b.post_recv(&shared, &req, vec![(buf, 0)], &mut p.mb);
    p.b.drive(now, &mut p.mb);
    let before = p.b.stats.protocol_errors.load(Ordering::Relaxed);
    // On a TCP lane, which offers nothing, a Data for receive 0 flagged placed: no byte
    // of it arrived, so it must not complete the receive.
    let mut h = Header::new(Kind::Data, 0, 4096);
    h.aux = crate::conn::wire::DATA_PLACED;
    p.mb.rx
        .entry(kb)
        .or_default()
        .extend_from_slice(&h.encode());
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    assert_eq!(
        p.b.stats.protocol_errors.load(Ordering::Relaxed),
        before + 1
    );
    match req.status() {
        Err(e) => assert!(e.to_string().contains("offered no buffer"), "{e}"),
        other => panic!("the receive must fail, not {other:?}"),
    }
}

#[test]
fn a_fence_of_a_lane_never_opened_is_a_protocol_error() {
    let now = Instant::now();
    let mut p = connected(now);
    let kb = *p.mb.open.iter().next().unwrap();
    let before = p.b.stats.protocol_errors.load(Ordering::Relaxed);
    // Only attempt 0 was ever opened: a Fence of attempt 2^64-1 names nothing.
    let f = Header::new(Kind::Fence, u64::MAX, 0).encode();
    p.mb.rx.entry(kb).or_default().extend_from_slice(&f);
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    assert_eq!(
        p.b.stats.protocol_errors.load(Ordering::Relaxed),
        before + 1
    );
    let e = p.b.comms[0].shared.failure().expect("the comm fails");
    assert!(e.to_string().contains("Fence of lane attempt"), "{e}");
    assert!(p.b.comms[0].heard.is_empty(), "nothing was recorded for it");
}

#[test]
fn an_injected_cut_buries_its_lanes_and_the_restore_closes_them() {
    let now = Instant::now();
    let mut a = engine(1, now);
    let mut io = Mem::default();
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &pending, now, &mut io);
    a.drive(now, &mut io);
    a.inject_link(0, false, now, &mut io);
    assert!(a.nic_cut(0));
    assert_eq!(io.ops, [Op::Connect(0), Op::Bury(0)], "no fence, no close");
    assert!(matches!(*pending.result.lock(), Some(Err(_))));
    a.inject_link(0, true, now, &mut io);
    assert_eq!(io.ops.last(), Some(&Op::Unbury));
    assert!(!a.nic_cut(0));
}

#[test]
fn a_nic_counts_as_down_from_the_engines_clock_by_carrier_or_cut() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut a = engine(1, t0);
    let mut io = Mem::default();
    a.carrier(0, false, t0 + s(1), &mut io);
    assert_eq!(a.metrics.down_pending(t0 + s(2)), [s(1)], "under way");
    a.carrier(0, true, t0 + s(4), &mut io);
    assert_eq!(a.metrics.down_pending(t0 + s(10)), [s(3)]);
    a.inject_link(0, false, t0 + s(20), &mut io);
    a.inject_link(0, true, t0 + s(22), &mut io);
    assert_eq!(a.metrics.down_pending(t0 + s(30)), [s(5)]);
}

#[test]
fn a_comm_is_displaced_from_its_failure_until_it_is_gone() {
    let t0 = Instant::now();
    let mut p = connected(t0);
    assert_eq!(p.a.metrics.displaced_comms(), 0);
    p.ma.broken.insert(0);
    p.a.service_lane(0, t0, &mut p.ma);
    p.a.drive(t0, &mut p.ma);
    assert_eq!(p.a.comms.len(), 1, "the comm waits for a pair");
    assert_eq!(p.a.metrics.displaced_comms(), 1);
    let later = t0 + Duration::from_secs(2);
    assert_eq!(p.a.metrics.displaced_pending(later), Duration::from_secs(2));
    // The receiver has no route of its own: its sender counts the comm.
    assert_eq!(p.b.metrics.displaced_comms(), 0);
    let shared = p.a.comms[0].shared.clone();
    p.a.close_comm(&shared, later, &mut p.ma);
    p.a.drive(later, &mut p.ma);
    assert_eq!(p.a.metrics.displaced_comms(), 0);
    let much_later = later + Duration::from_secs(60);
    assert_eq!(
        p.a.metrics.displaced_pending(much_later),
        Duration::from_secs(2),
        "a closed comm counts no more"
    );
}

#[test]
fn a_refused_connect_fails_the_pending_connect_and_keeps_no_lane() {
    let now = Instant::now();
    let mut a = engine(1, now);
    let mut io = Mem {
        refuse_connect: true,
        ..Mem::default()
    };
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &pending, now, &mut io);
    assert!(matches!(*pending.result.lock(), Some(Err(_))));
    assert!(a.lanes.is_empty());
    assert!(io.ops.is_empty());
}

#[test]
fn garbage_on_an_accepted_lane_closes_it_and_is_counted() {
    let now = Instant::now();
    let mut b = engine(2, now);
    let mut io = Mem::default();
    let k = b.next_lane();
    io.open.insert(k);
    io.rx.insert(k, vec![0xAB; 64]);
    b.accepted(k, 0, None, Some(0), now, &mut io);
    b.drive(now, &mut io);
    assert_eq!(io.ops, [Op::Close(k)]);
    assert_eq!(b.stats.rejected_connections.load(Ordering::Relaxed), 1);
    assert_eq!(b.stats.handshakes_pending.load(Ordering::Relaxed), 0);
}

#[test]
fn an_accepted_lane_has_until_its_fabric_is_ready_and_then_the_preauth_window() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut b = engine(2, t0);
    let mut io = Mem::default();
    let k = b.next_lane();
    io.open.insert(k);
    io.setting_up.insert(k);
    b.accepted(k, 0, None, Some(0), t0, &mut io);
    // 2 x the 2 s completion timeout would have dropped a ready lane at 4 s.
    b.handle_timeout(t0 + 10 * s, &mut io);
    assert!(
        io.ops.is_empty(),
        "dropped while being set up: {:?}",
        io.ops
    );
    io.setting_up.remove(&k);
    b.service_lane(k, t0 + 12 * s, &mut io);
    b.handle_timeout(t0 + 12 * s + 3999 * Duration::from_millis(1), &mut io);
    assert!(io.ops.is_empty(), "the window starts when it is ready");
    b.handle_timeout(t0 + 16 * s, &mut io);
    assert_eq!(io.ops, [Op::Close(k)], "no Hello within the window");
    assert_eq!(b.stats.rejected_connections.load(Ordering::Relaxed), 1);

    // One that never becomes ready goes when our own connects would give up.
    let k = b.next_lane();
    io.open.insert(k);
    io.setting_up.insert(k);
    b.accepted(k, 0, None, Some(0), t0 + 20 * s, &mut io);
    b.handle_timeout(t0 + 49 * s, &mut io);
    assert_eq!(io.ops.len(), 1);
    b.handle_timeout(t0 + 50 * s, &mut io);
    assert_eq!(io.ops.last(), Some(&Op::Close(k)));
}

#[test]
fn a_lane_that_named_our_secret_has_only_the_preauth_deadline_to_prove_it() {
    let now = Instant::now();
    let s = Duration::from_secs(1);
    let (mut a, mut b) = (engine(1, now), engine(2, now));
    let (mut ma, mut mb) = (Mem::default(), Mem::default());
    listen_on(&mut b);
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &pending, now, &mut ma);
    a.drive(now, &mut ma);
    // Its Hello arrives; the Challenge goes out, and no Proof ever comes back. Anyone
    // may name the listener's comm in a Hello: it earns no longer deadline.
    let hello = std::mem::take(ma.tx.entry(0).or_default());
    let named = b.next_lane();
    mb.open.insert(named);
    mb.rx.insert(named, hello);
    b.accepted(named, 0, Some(9), Some(0), now, &mut mb);
    b.drive(now, &mut mb);
    assert!(!mb.tx[&named].is_empty(), "a Challenge was sent");
    // A connection that says nothing at all, beside it.
    let idle = b.next_lane();
    mb.open.insert(idle);
    b.accepted(idle, 0, Some(9), Some(0), now, &mut mb);
    b.handle_timeout(now + 4 * s - Duration::from_millis(1), &mut mb);
    assert!(mb.ops.is_empty(), "{:?}", mb.ops);
    b.handle_timeout(now + 4 * s, &mut mb);
    let closed: BTreeSet<Op> = mb.ops.iter().copied().collect();
    assert_eq!(closed, BTreeSet::from([Op::Close(named), Op::Close(idle)]));
}

#[test]
fn a_hello_over_a_path_our_peer_keeps_talking_on_waits_longer_for_its_proof() {
    // A failover storm behind a deep queue: the sender's Proof waits behind megabytes of
    // its own data on the same path. While that path keeps delivering the peer's bytes, a
    // handshake that named our comm is given its preauth time again, a bounded number of
    // times; a connection that never said Hello is not.
    let t0 = Instant::now();
    let half = Duration::from_millis(500);
    let (mut a, mut b) = (engine(1, t0), engine(2, t0));
    let (mut ma, mut mb) = (Mem::default(), Mem::default());
    mb.peer = Some(addr(1).ip());
    let listen = listen_on(&mut b);
    let first = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &first, t0, &mut ma);
    a.drive(t0, &mut ma);
    let carrier = b.next_lane();
    mb.open.insert(carrier);
    b.accepted(carrier, 0, Some(9), Some(0), t0, &mut mb);
    shuttle((&mut a, &mut ma, 0), (&mut b, &mut mb, carrier), t0);
    assert_eq!(listen.ready.lock().len(), 1, "the first comm is up");
    // Two more connects over the same path: their Hellos arrive, their Proofs do not.
    let mut named = Vec::new();
    for _ in 0..2 {
        let pending = Arc::new(PendingConnect::default());
        let ka = a.next_lane();
        connect_to_listener(&mut a, &pending, t0, &mut ma);
        a.drive(t0, &mut ma);
        let kb = b.next_lane();
        mb.open.insert(kb);
        mb.rx
            .insert(kb, std::mem::take(ma.tx.entry(ka).or_default()));
        b.accepted(kb, 0, Some(9), Some(0), t0, &mut mb);
        b.drive(t0, &mut mb);
        assert!(!mb.tx[&kb].is_empty(), "a Challenge was sent");
        named.push((ka, kb, pending));
    }
    let silent = b.next_lane();
    mb.open.insert(silent);
    b.accepted(silent, 0, Some(9), Some(0), t0, &mut mb);
    let closed = |mb: &Mem, k: usize| mb.ops.contains(&Op::Close(k));
    // The first comm's keepalives keep the path heard.
    let mut now = t0;
    let step = |now: Instant, a: &mut Engine, ma: &mut Mem, b: &mut Engine, mb: &mut Mem| {
        a.handle_timeout(now, ma);
        b.handle_timeout(now, mb);
        shuttle((a, ma, 0), (b, mb, carrier), now);
    };
    // Past the preauth deadline (4 s here) that a quiet path would hold it to.
    while now < t0 + Duration::from_secs(6) {
        now += half;
        step(now, &mut a, &mut ma, &mut b, &mut mb);
    }
    assert!(closed(&mb, silent), "a connection that never said Hello");
    assert!(!closed(&mb, named[0].1) && !closed(&mb, named[1].1));
    assert!(!closed(&mb, carrier), "{:?}", mb.ops);
    // One Proof arrives late, and its comm is made.
    let (ka, kb, pending) = &named[0];
    shuttle((&mut a, &mut ma, *ka), (&mut b, &mut mb, *kb), now);
    assert_eq!(listen.ready.lock().len(), 2, "the late Proof made its comm");
    assert!(matches!(*pending.result.lock(), Some(Ok(_))));
    // The other never comes: its patience runs out, with the path still heard.
    let limit = t0 + lanes::preauth_deadline(Duration::from_secs(2)) * 10;
    while !closed(&mb, named[1].1) && now < limit {
        now += half;
        step(now, &mut a, &mut ma, &mut b, &mut mb);
    }
    assert!(closed(&mb, named[1].1), "patience is bounded");
    assert!(
        now >= t0 + lanes::preauth_deadline(Duration::from_secs(2)) * 8,
        "closed at {:?}, before its patience ran out",
        now - t0
    );
    assert!(!closed(&mb, carrier), "{:?}", mb.ops);
}

#[test]
fn a_connect_the_listener_drops_before_it_authenticates_tries_again() {
    let now = Instant::now();
    let ms = Duration::from_millis(1);
    let mut a = engine(1, now);
    let mut io = Mem::default();
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut a, &pending, now, &mut io);
    a.drive(now, &mut io);
    // The listener closes the connection unanswered (its handshake caps were full).
    io.eof.insert(0);
    a.service_lane(0, now, &mut io);
    a.drive(now, &mut io);
    assert!(pending.result.lock().is_none(), "NCCL's connect goes on");
    assert_eq!(io.ops, [Op::Connect(0), Op::Close(0)]);
    // A second attempt after a short wait, on a lane of its own.
    a.handle_timeout(now + 19 * ms, &mut io);
    assert_eq!(io.ops.len(), 2, "not yet: {:?}", io.ops);
    assert!(a.poll_timeout().is_some_and(|t| t <= now + 20 * ms));
    a.handle_timeout(now + 20 * ms, &mut io);
    assert!(matches!(io.ops[..], [_, _, Op::Connect(_)]), "{:?}", io.ops);
    assert!(pending.result.lock().is_none());
    // Refused outright (nothing listens there): NCCL hears of it at once.
    let mut b = engine(3, now);
    let mut io = Mem {
        refuse_connect: true,
        ..Mem::default()
    };
    let pending = Arc::new(PendingConnect::default());
    connect_to_listener(&mut b, &pending, now, &mut io);
    assert!(matches!(*pending.result.lock(), Some(Err(_))));
}

#[test]
fn bytes_written_in_place_count_per_nic_and_a_closed_lane_counts_its_last_ones() {
    let now = Instant::now();
    let mut p = connected(now);
    p.ma.placed.insert(0, 5000);
    p.a.tick(now, &mut p.ma);
    assert_eq!(p.a.metrics.placed_pending(), [5000]);
    p.a.tick(now, &mut p.ma);
    assert_eq!(
        p.a.metrics.placed_pending(),
        [5000],
        "a second look adds nothing"
    );
    // 4000 more, then the lane fails before the next tick: its close takes them.
    p.ma.placed.insert(0, 9000);
    p.ma.broken.insert(0);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    assert!(p.ma.ops.contains(&Op::Close(0)), "{:?}", p.ma.ops);
    assert_eq!(p.a.metrics.placed_pending(), [9000]);
    p.a.tick(now, &mut p.ma);
    assert_eq!(p.a.metrics.placed_pending(), [9000]);
}

#[test]
fn a_lane_buried_by_a_cut_counts_what_it_wrote_in_place() {
    let now = Instant::now();
    let mut p = connected(now);
    p.ma.placed.insert(0, 7000);
    p.a.inject_link(0, false, now, &mut p.ma);
    assert_eq!(p.ma.ops.last(), Some(&Op::Bury(0)));
    assert_eq!(p.a.metrics.placed_pending(), [7000]);
}

#[test]
fn a_nic_that_cannot_register_the_memory_is_excluded_for_the_comm_and_counted() {
    let now = Instant::now();
    let mut p = connected(now);
    p.ma.unreachable.insert(0);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    assert_eq!(p.a.stats.memory_exclusions.load(Ordering::Relaxed), 1);
    // Its one NIC left out, the comm has no pair left and gives up at once, naming why.
    let failure = p.a.comms[0].shared.failure().map(|e| e.to_string());
    assert!(
        failure.is_some(),
        "the comm failed: no pair can reach its memory"
    );
}

#[test]
fn a_receiver_whose_nic_cannot_register_its_buffer_tells_the_sender_which_excludes_it() {
    let now = Instant::now();
    let mut p = connected(now);
    let kb = *p.mb.open.iter().next().unwrap();
    p.mb.unreachable.insert(kb);
    p.b.service_lane(kb, now, &mut p.mb);
    p.b.drive(now, &mut p.mb);
    assert_eq!(
        p.b.stats.memory_exclusions.load(Ordering::Relaxed),
        0,
        "the receiver does not choose pairs"
    );
    // The receiver's Stalled, flagged for memory, reaches the sender.
    let told = std::mem::take(p.mb.tx.entry(kb).or_default());
    let stalled = Header::new(Kind::Stalled, 0, crate::conn::wire::STALLED_MEMORY).encode();
    assert!(
        told.windows(stalled.len()).any(|w| w == stalled),
        "no Stalled(memory) among {} bytes",
        told.len()
    );
    p.ma.rx.entry(0).or_default().extend(told);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    assert_eq!(p.a.stats.memory_exclusions.load(Ordering::Relaxed), 1);
    assert!(
        p.a.comms[0].shared.failure().is_some(),
        "no other remote NIC"
    );
}

#[test]
fn a_receiver_whose_nic_refuses_its_queued_offers_still_gets_its_stalled_out() {
    let now = Instant::now();
    let mut p = connected(now);
    let kb = *p.mb.open.iter().next().unwrap();
    p.mb.refuses_offers.insert(kb);
    let shared = p.b.comms[0].shared.clone();
    // Two receives: an offer and a Cts each, queued before the first offer fails.
    for tag in 0..2 {
        let req = Arc::new(Request::new(shared.clone()));
        let buf = UserBuf::of_slice(Vec::leak(vec![0u8; 8192]));
        p.b.post_recv(&shared, &req, vec![(buf, tag)], &mut p.mb);
    }
    p.b.drive(now, &mut p.mb);
    assert!(p.mb.ops.contains(&Op::Close(kb)), "{:?}", p.mb.ops);
    let told = std::mem::take(p.mb.tx.entry(kb).or_default());
    let stalled = Header::new(Kind::Stalled, 0, crate::conn::wire::STALLED_MEMORY).encode();
    assert!(
        told.windows(stalled.len()).any(|w| w == stalled),
        "the Stalled(memory) stayed behind the second offer ({} bytes out)",
        told.len()
    );
    // The sender hears why and leaves the receiver's NIC out, rather than take the
    // lane's close for the comm's.
    p.ma.rx.entry(0).or_default().extend(told);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    assert_eq!(p.a.stats.memory_exclusions.load(Ordering::Relaxed), 1);
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn shared_state_is_thread_safe() {
    assert_send_sync::<CommandQueue>();
    assert_send_sync::<ReactorStats>();
    assert_send_sync::<CommShared>();
    assert_send_sync::<Request>();
    assert_send_sync::<ListenShared>();
}

#[test]
fn draining_the_last_nic_up_is_refused_and_changes_nothing() {
    use crate::handoff::DrainSource;
    let now = Instant::now();
    let mut p = connected(now);
    let refused = p.a.drain(0, true, DrainSource::Socket, now).unwrap_err();
    assert!(
        refused.contains("eth1") && refused.contains("last NIC"),
        "{refused}"
    );
    assert!(!p.a.status(now).nics[0].drained);
    assert_eq!(p.a.drained_mask(), 0);
    let unknown = p.a.drain(3, true, DrainSource::Socket, now).unwrap_err();
    assert!(unknown.contains("no NIC 3"), "{unknown}");
    // Undraining what is not drained is no error.
    let said = p.a.drain(0, false, DrainSource::File, now).unwrap();
    assert!(said.contains("already not drained"), "{said}");
}

#[test]
fn a_peers_drained_frame_leaves_its_nic_out_and_with_nowhere_else_the_comm_stays() {
    let now = Instant::now();
    let mut p = connected(now);
    let drained = Header {
        aux: 1,
        ..Header::new(Kind::Drained, 0, 0)
    }
    .encode();
    p.ma.rx.entry(0).or_default().extend(drained);
    p.a.service_lane(0, now, &mut p.ma);
    p.a.drive(now, &mut p.ma);
    let pair = routing::Pair {
        local: routing::NicId(0),
        peer: p.a.comms[0].route.unwrap().peer,
        remote: routing::NicId(0),
    };
    assert!(p.a.router.drained(pair));
    // A planned move never fails a comm (the router's tests show it waits past the
    // give-up window): with no other pair it stays where it is.
    assert!(p.a.comms[0].shared.failure().is_none());
    assert_eq!(p.a.router.stats().no_eligible_pair, 0);
    assert_eq!(
        p.a.router
            .current_pair(routing::CommId(0), routing::LaneId(0)),
        Some(pair)
    );
    assert!(
        !p.ma.ops.iter().any(|op| matches!(op, Op::Close(_))),
        "{:?}",
        p.ma.ops
    );
    // A Drained frame is for senders: a receive comm takes it as a protocol error.
    assert!(matches!(
        p.b.comms[0]
            .machine
            .handle_frame(&Header::new(Kind::Drained, 0, 0)),
        Err(ConnError::Protocol(_))
    ));
}

#[test]
fn a_comm_connecting_to_a_drained_nic_hears_so_with_its_welcome() {
    let now = Instant::now();
    let p = connected_after(now, |b| b.drained[0] = super::drain::DrainHold::SOCKET);
    let pair = routing::Pair {
        local: routing::NicId(0),
        peer: p.a.comms[0].route.expect("routed").peer,
        remote: routing::NicId(0),
    };
    assert!(
        p.a.router.drained(pair),
        "the Welcome's Drained frame was not heard"
    );
    assert!(p.a.comms[0].shared.failure().is_none());
    // Without the drain, nothing is said.
    let p = connected(now);
    let peer = p.a.comms[0].route.expect("routed").peer;
    assert!(!p.a.router.drained(routing::Pair { peer, ..pair }));
}

#[test]
fn status_counts_each_sides_comms_and_the_nics_they_run_on() {
    let now = Instant::now();
    let p = connected(now);
    let a = p.a.status(now);
    assert_eq!((a.comms.send, a.comms.recv), (1, 0));
    assert_eq!(a.nics.len(), 1);
    assert_eq!(a.nics[0].name, "eth1");
    assert_eq!(a.nics[0].comms, 1);
    assert!(a.nics[0].up && !a.nics[0].drained);
    assert!(a.degraded.is_empty());
    let b = p.b.status(now);
    assert_eq!((b.comms.send, b.comms.recv), (0, 1));
}

/// `b` with two NICs (one per rail) opens NCCL listener 9 on NIC 0; `a`, with two NICs
/// too, connects from NIC 0 with the handle's failover NICs to go to instead.
fn rescue_pair(now: Instant) -> (Engine, Mem, Engine, Arc<ListenShared>, Rescue) {
    let (a, mut b) = (engine_with_nics(1, 2, now), engine_with_nics(2, 2, now));
    let listen = listen_on(&mut b);
    let rescue = Rescue {
        listen_id: listen.id,
        nics: b.wire().to_vec(),
    };
    (a, Mem::default(), b, listen, rescue)
}

/// `a`'s NIC 0 has no carrier when it connects to listener 9 with `rescue` and `token`;
/// whatever `a` dials, `b` takes on its failover listener of NIC 1 (reactor listener
/// 1, no NCCL id), and the two handshake. Returns the connect and `b`'s side.
fn connect_without_carrier(
    (a, ma, b): (&mut Engine, &mut Mem, &mut Engine),
    rescue: Rescue,
    token: [u8; 16],
    t0: Instant,
) -> (Arc<PendingConnect>, Mem) {
    a.carrier(0, false, t0, ma);
    let pending = Arc::new(PendingConnect::default());
    a.connect(0, nic_addr(2, 0), &token, rescue, &pending, t0, ma);
    a.drive(t0, ma);
    let ka = *ma.open.iter().next().unwrap();
    let mut mb = Mem::default();
    let kb = b.next_lane();
    mb.open.insert(kb);
    b.accepted(kb, 1, None, Some(1), t0, &mut mb);
    shuttle((a, ma, ka), (b, &mut mb, kb), t0);
    (pending, mb)
}

#[test]
fn a_connect_from_a_nic_without_carrier_goes_to_the_failover_listener_of_a_same_rail_pair() {
    let t0 = Instant::now();
    let (mut a, mut ma, mut b, listen, rescue) = rescue_pair(t0);
    let (pending, _mb) = connect_without_carrier((&mut a, &mut ma, &mut b), rescue, [3; 16], t0);
    // Not NCCL's pair (NIC 0 to the listener): NIC 1 to b's NIC 1's failover listener.
    assert_eq!(ma.dialled[0], (1, nic_addr(2, 1)));
    let send = (pending.result.lock().take())
        .expect("the connect finished")
        .expect("it succeeded");
    assert_eq!(send.nic(), 0, "the send comm keeps NCCL's device");
    let recv = listen
        .ready
        .lock()
        .pop_front()
        .expect("NCCL's listener has the comm");
    assert_eq!(
        recv.nic(),
        0,
        "the receive comm keeps the listener's device"
    );
    assert_eq!(b.stats.rejected_connections.load(Ordering::Relaxed), 0);
    // The comm is away from NCCL's pair from the start (the router probes NIC 1's pair
    // and moves it there), and nothing more is dialled from NIC 0.
    assert_eq!(a.router.displaced_comms(), 1);
    assert!(
        ma.dialled.len() > 1 && ma.dialled[1..].iter().all(|&d| d == (1, nic_addr(2, 1))),
        "{:?}",
        ma.dialled
    );
}

#[test]
fn a_failover_listener_serves_a_new_comm_only_for_an_nccl_listener_it_has_and_its_token() {
    let t0 = Instant::now();
    for (listen_id, token, ok) in [
        (9, [3; 16], true),
        (10, [3; 16], false),
        (9, [4; 16], false),
    ] {
        let (mut a, mut ma, mut b, listen, mut rescue) = rescue_pair(t0);
        rescue.listen_id = listen_id;
        let (pending, _mb) = connect_without_carrier((&mut a, &mut ma, &mut b), rescue, token, t0);
        // An unknown listener is refused by b; a wrong token fails the connector's own
        // check of b's Challenge, before any Proof.
        let accepted = listen.ready.lock().len();
        let refused = b.stats.refused_handshakes.load(Ordering::Relaxed);
        let connected = pending.result.lock().take().is_some_and(|r| r.is_ok());
        assert_eq!(
            (accepted, refused, connected),
            match (ok, listen_id) {
                (true, _) => (1, 0, true),
                (false, 9) => (0, 0, false),
                (false, _) => (0, 1, false),
            },
            "listen id {listen_id}, token {token:?}"
        );
    }
}

#[test]
fn a_connect_that_hears_nothing_moves_to_another_pair_at_the_reach_limit_but_a_busy_listener_keeps_it(
) {
    let t0 = Instant::now();
    for answered in [false, true] {
        let (mut a, mut ma, _b, _listen, rescue) = rescue_pair(t0);
        // The fabric connected (the listener's NIC answered) or not.
        ma.peer = answered.then(|| nic_addr(2, 0).ip());
        let pending = Arc::new(PendingConnect::default());
        a.connect(0, nic_addr(2, 0), &[3; 16], rescue, &pending, t0, &mut ma);
        a.drive(t0, &mut ma);
        assert_eq!(ma.dialled, [(0, nic_addr(2, 0))], "NCCL's pair first");
        // Twice the completion timeout (2 s here) is the reach limit: just before it,
        // nothing changes.
        let limit = t0 + Duration::from_secs(4);
        a.handle_timeout(limit - Duration::from_millis(1), &mut ma);
        assert_eq!(ma.dialled.len(), 1);
        a.handle_timeout(limit, &mut ma);
        a.drive(limit, &mut ma);
        if answered {
            assert_eq!(
                ma.dialled.len(),
                1,
                "a listener that answered is waited for"
            );
            assert!(ma.open.len() == 1 && pending.result.lock().is_none());
        } else {
            assert_eq!(
                ma.dialled[1..],
                [(1, nic_addr(2, 1))],
                "then the other rail's pair"
            );
            assert!(pending.result.lock().is_none(), "still connecting");
        }
    }
}
