//! A receive comm under attack, for the stateful fuzz target (`fuzz/`, feature
//! `fuzz-harness`) and its bounded run in the unit tests: a real engine, past a real
//! handshake over an in-memory TCP-like lane, fed arbitrary frames by whoever holds the
//! comm's other end.
//!
//! [`receiver_session`] reads a plan out of arbitrary bytes: receives NCCL posts (grouped
//! or not), `Data` frames with payloads, `Data` frames that claim to be written in place,
//! any header with any body, garbage, and time passing. After every step it checks what
//! NCCL would see: a receive completes only with the bytes of the first `Data` sent for
//! it, never reports more than its buffer holds, and writes nothing past what it
//! reports; and nothing panics.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{self, Read};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use mio::{Poll, Token, Waker};
use parking_lot::Mutex;

use super::{Engine, Io, LocalNic, Setup};
use crate::conn::wire::{Header, Kind, NicAddr, DATA_PLACED, HEADER_LEN};
use crate::handoff::{
    CommShared, CommandQueue, ListenShared, PendingConnect, Request, Rescue, Status,
};
use crate::routing::RouterConfig;
use crate::telemetry::exporter::ExporterConfig;
use crate::telemetry::metrics::Telemetry;
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use crate::transport::memory::SimMem;
use crate::transport::LaneProgress;

/// Lanes as byte buffers, as a TCP fabric would carry them (nothing is placed).
#[derive(Default)]
struct Wire {
    open: HashSet<usize>,
    rx: HashMap<usize, Vec<u8>>,
    tx: HashMap<usize, Vec<u8>>,
}

/// What a lane has to read; empty means "would block", as a non-blocking socket's.
pub(crate) struct Pending<'a>(pub(crate) &'a mut Vec<u8>);

impl Read for Pending<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.0.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.0.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0.drain(..n);
        Ok(n)
    }
}

impl Io for Wire {
    fn connect(&mut self, k: usize, _nic: usize, _to: SocketAddr) -> io::Result<()> {
        self.open.insert(k);
        Ok(())
    }
    fn read(&mut self, k: usize, reader: &mut FrameReader) -> Result<Option<Inbound>, ReadError> {
        reader.next(&mut Pending(self.rx.entry(k).or_default()))
    }
    fn write(&mut self, k: usize, writer: &mut FrameWriter) -> io::Result<()> {
        writer.flush(self.tx.entry(k).or_default())
    }
    fn progress(&self, _k: usize) -> LaneProgress {
        LaneProgress::default()
    }
    fn ready(&self, _k: usize) -> bool {
        true
    }
    fn set_pacing(&mut self, _k: usize, _rate: Option<u64>) -> io::Result<()> {
        Ok(())
    }
    fn fence(&mut self, _k: usize) {}
    fn seal(&mut self, _k: usize) {}
    fn close(&mut self, k: usize) {
        self.open.remove(&k);
    }
    fn bury(&mut self, k: usize) {
        self.open.remove(&k);
    }
    fn unbury(&mut self) {}
}

fn engine(host: u8, now: Instant) -> (Engine, Poll) {
    static TELEMETRY: OnceLock<Arc<Telemetry>> = OnceLock::new();
    let telemetry = TELEMETRY
        .get_or_init(|| Arc::new(Telemetry::start(&ExporterConfig::off(), None)))
        .clone();
    let addr = SocketAddr::from(([127, 0, 0, host], 4000));
    let setup = Setup {
        nics: vec![LocalNic {
            name: format!("eth{host}"),
            ip: addr.ip(),
            rail: Some(0),
            speed_mbps: None,
        }],
        distance: vec![vec![None]],
        spin: Duration::ZERO,
        completion_timeout: Duration::from_secs(1),
        probe_timeout: Duration::from_millis(200),
        probe_bytes: 4096,
        fair_share: false,
        stripes: None,
        router: RouterConfig {
            seed: 1,
            ..RouterConfig::default()
        },
        telemetry,
        unmatched_warn: Duration::from_secs(10),
        entropy_seed: Some(u64::from(host)),
    };
    let poll = Poll::new().expect("an epoll instance");
    let waker = Waker::new(poll.registry(), Token(0)).expect("a waker");
    let wire = vec![NicAddr {
        addr,
        rail: Some(0),
        mbps: None,
    }];
    let e = Engine::new(setup, Arc::new(CommandQueue::new(waker)), wire, now);
    (e, poll)
}

/// One buffer of a completed receive: the size `test` reports, its capacity, its bytes.
pub type Filled = (u64, usize, Vec<u8>);

/// A receive NCCL posted: its request and the capacity and memory of each buffer.
struct Posted {
    first: u64,
    req: Arc<Request>,
    bufs: Vec<(usize, Arc<SimMem>)>,
}

/// The receive end of one comm, and what NCCL has posted on it.
pub struct Receiver {
    // Dropped first: the engine holds views of the memory below.
    engine: Engine,
    wire: Wire,
    lane: usize,
    comm: Arc<CommShared>,
    now: Instant,
    posted: VecDeque<Posted>,
    next_seq: u64,
    _poll: Poll,
}

impl Receiver {
    /// A comm whose first lane completed a real handshake; the sender is then gone and
    /// whatever comes on the lane is the caller's.
    pub fn new() -> Receiver {
        let now = Instant::now();
        let ((mut a, poll_a), (mut b, poll_b)) = (engine(1, now), engine(2, now));
        let (mut wa, mut wb) = (Wire::default(), Wire::default());
        let token = [7u8; 16];
        let listen = Arc::new(ListenShared {
            id: 1,
            token,
            nic: 0,
            ready: Mutex::new(VecDeque::new()),
            queue: b.queue.clone(),
        });
        b.listening(listen.clone());
        let pending = Arc::new(PendingConnect::default());
        let to = SocketAddr::from(([127, 0, 0, 2], 4000));
        a.connect(0, to, &token, Rescue::default(), &pending, now, &mut wa);
        a.drive(now, &mut wa);
        let lane = b.next_lane();
        wb.open.insert(lane);
        b.accepted(lane, 0, Some(1), Some(0), now, &mut wb);
        for _ in 0..8 {
            let bytes = std::mem::take(wa.tx.entry(0).or_default());
            wb.rx.entry(lane).or_default().extend(bytes);
            b.service_lane(lane, now, &mut wb);
            b.drive(now, &mut wb);
            let bytes = std::mem::take(wb.tx.entry(lane).or_default());
            wa.rx.entry(0).or_default().extend(bytes);
            a.service_lane(0, now, &mut wa);
            a.drive(now, &mut wa);
        }
        let comm = listen
            .ready
            .lock()
            .pop_front()
            .expect("the handshake made a comm");
        drop((a, poll_a));
        wb.tx.clear();
        Receiver {
            engine: b,
            wire: wb,
            lane,
            comm,
            now,
            posted: VecDeque::new(),
            next_seq: 0,
            _poll: poll_b,
        }
    }

    /// NCCL posts a receive of one buffer per capacity (a grouped receive when several),
    /// each filled with `0xEE`. Returns its first sequence number.
    pub fn post(&mut self, caps: &[usize]) -> u64 {
        let first = self.next_seq;
        self.next_seq += caps.len() as u64;
        let req = Arc::new(Request::group(self.comm.clone(), caps.len()));
        let bufs: Vec<(usize, Arc<SimMem>)> = (caps.iter())
            .map(|&cap| (cap, Arc::new(SimMem::new(vec![0xEE; cap]))))
            .collect();
        let user = (bufs.iter()).map(|(_, m)| (m.user_buf(), 0)).collect();
        self.engine.start_turn();
        self.engine
            .post_recv(&self.comm, &req, user, &mut self.wire);
        self.engine.drive(self.now, &mut self.wire);
        self.posted.push_back(Posted { first, req, bufs });
        first
    }

    /// Receives posted so far (the next one's sequence number).
    pub fn posted(&self) -> u64 {
        self.next_seq
    }

    /// The capacity of receive `seq`, if it is posted and not yet finished.
    pub fn capacity(&self, seq: u64) -> Option<usize> {
        (self.posted.iter())
            .find(|p| (p.first..p.first + p.bufs.len() as u64).contains(&seq))
            .map(|p| p.bufs[(seq - p.first) as usize].0)
    }

    /// Bytes arrive on the comm's lane (nothing, once the receiver closed it).
    pub fn feed(&mut self, bytes: &[u8]) {
        if !self.wire.open.contains(&self.lane) {
            return;
        }
        self.wire
            .rx
            .entry(self.lane)
            .or_default()
            .extend_from_slice(bytes);
        self.engine.start_turn();
        self.engine
            .service_lane(self.lane, self.now, &mut self.wire);
        self.engine.drive(self.now, &mut self.wire);
        self.wire.tx.clear();
    }

    /// Time passes: the engine's timers run.
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.engine.start_turn();
        self.engine.handle_timeout(self.now, &mut self.wire);
        self.engine.drive(self.now, &mut self.wire);
        self.wire.tx.clear();
    }

    /// The receives that finished since the last call, oldest first: for each, its first
    /// sequence number and, when it completed, each buffer's reported size, capacity and
    /// bytes.
    pub fn finished(&mut self) -> Vec<(u64, Option<Vec<Filled>>)> {
        let mut out = Vec::new();
        let mut left = VecDeque::new();
        for p in std::mem::take(&mut self.posted) {
            match p.req.status() {
                Ok(Status::Pending) => left.push_back(p),
                Ok(Status::Done(_)) => {
                    let bufs = (p.req.sizes().zip(&p.bufs))
                        .map(|(n, (cap, m))| (n, *cap, m.bytes()))
                        .collect();
                    out.push((p.first, Some(bufs)));
                }
                Err(_) => out.push((p.first, None)),
            }
        }
        self.posted = left;
        out
    }
}

impl Default for Receiver {
    fn default() -> Self {
        Receiver::new()
    }
}

/// Reads a plan out of fuzz bytes; past the end every read is zero.
struct Plan<'a>(&'a [u8]);

impl Plan<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn byte(&mut self) -> u8 {
        self.u8().unwrap_or(0)
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |v, i| v | u64::from(self.byte()) << (8 * i))
    }
    /// A payload length: mostly one that fits receive `seq`'s buffer (so that frames
    /// get past the size check), sometimes anything.
    fn len(&mut self, r: &Receiver, seq: u64) -> usize {
        let any = usize::from(self.u16() % 2048);
        match r.capacity(seq) {
            Some(cap) if self.byte() % 4 != 0 => any % (cap + 1),
            _ => any,
        }
    }

    /// A sequence number: mostly near the receives posted, sometimes anything.
    fn seq(&mut self, posted: u64) -> u64 {
        match self.byte() % 8 {
            0 => self.u64(),
            1 => u64::MAX,
            n => posted.saturating_sub(u64::from(n)) + u64::from(self.byte() % 4),
        }
    }
}

/// The bytes of a `Data` payload: from the plan while it lasts, then a pattern.
fn payload(plan: &mut Plan, len: usize, salt: u64) -> Vec<u8> {
    (0..len)
        .map(|i| plan.u8().unwrap_or((i as u64 ^ salt) as u8))
        .collect()
}

/// What arrived for each receive, by a parse of the whole stream that knows nothing of
/// the engine: the payload of the first `Data` (in the stream, not claiming a placement)
/// for each sequence number, up to the first bytes that are not a frame.
fn arrived(stream: &[u8]) -> BTreeMap<u64, &[u8]> {
    let mut out = BTreeMap::new();
    let mut at = 0;
    while let Ok(h) = Header::decode(&stream[at..]) {
        let body = usize::try_from(h.body_len()).unwrap_or(usize::MAX);
        let Some(end) = (at + HEADER_LEN)
            .checked_add(body)
            .filter(|&e| e <= stream.len())
        else {
            break;
        };
        if h.kind == Kind::Data && !h.placed() {
            out.entry(h.seq).or_insert(&stream[at + HEADER_LEN..end]);
        }
        at = end;
    }
    out
}

/// One fuzz input: a plan of receives and hostile frames against one receive comm.
/// Panics only when NCCL would be handed something wrong.
pub fn receiver_session(data: &[u8]) {
    let mut plan = Plan(data);
    let mut r = Receiver::new();
    // Everything that came on the lane.
    let mut stream = Vec::new();
    while let Some(op) = plan.u8() {
        let mut frame = Vec::new();
        match op % 8 {
            0 if r.posted() < 512 => {
                // Mostly single receives: a grouped one finishes only once all of it has.
                let b = plan.byte();
                let n = if b < 160 { 1 } else { 1 + usize::from(b % 8) };
                let caps: Vec<usize> = (0..n).map(|_| usize::from(plan.u16() % 2048)).collect();
                r.post(&caps);
            }
            1 | 2 => {
                let seq = plan.seq(r.posted());
                let len = plan.len(&r, seq);
                frame = Header::new(Kind::Data, seq, len as u64).encode().to_vec();
                frame.extend(payload(&mut plan, len, seq));
            }
            3 => {
                // A payload that claims the sender's NIC already wrote it in place.
                let seq = plan.seq(r.posted());
                let mut h = Header::new(Kind::Data, seq, plan.len(&r, seq) as u64);
                h.aux = DATA_PLACED;
                frame = h.encode().to_vec();
            }
            4 => {
                let kind = Kind::ALL[usize::from(plan.byte()) % Kind::ALL.len()];
                let mut h = Header::new(kind, plan.seq(r.posted()), u64::from(plan.u16()));
                h.aux = u32::from(plan.byte()) * 0x0101_0101;
                frame = h.encode().to_vec();
                let body = h.body_len().min(4096) as usize;
                frame.extend(payload(&mut plan, body, 0x5A));
            }
            5 => {
                let n = usize::from(plan.byte() % 64);
                frame = payload(&mut plan, n, 0xA5);
            }
            6 => r.advance(Duration::from_millis(u64::from(plan.u16() % 3000))),
            _ => {}
        }
        if !frame.is_empty() {
            stream.extend_from_slice(&frame);
            r.feed(&frame);
        }
        let sent = arrived(&stream);
        for (first, outcome) in r.finished() {
            let Some(bufs) = outcome else { continue };
            for (i, (size, cap, bytes)) in bufs.into_iter().enumerate() {
                let seq = first + i as u64;
                let size = usize::try_from(size).unwrap_or(usize::MAX);
                assert!(size <= cap, "receive {seq} reports {size} bytes of {cap}");
                let want = sent.get(&seq).unwrap_or_else(|| {
                    panic!("receive {seq} completed with {size} bytes, but none were sent for it")
                });
                assert_eq!(size, want.len(), "receive {seq}'s size");
                assert!(bytes[..size] == want[..], "receive {seq} holds other bytes");
                assert!(
                    bytes[size..].iter().all(|&b| b == 0xEE),
                    "receive {seq} written past its {size} bytes"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::rng::SplitMix64;

    #[test]
    fn a_placed_data_on_a_lane_that_offered_nothing_completes_nothing() {
        // The receive fails rather than complete with bytes that never arrived.
        let mut r = Receiver::new();
        r.post(&[4096]);
        let mut h = Header::new(Kind::Data, 0, 4096);
        h.aux = DATA_PLACED;
        r.feed(&h.encode());
        let done = r.finished();
        assert!(matches!(done[..], [(0, None)]), "{:?}", done.len());
    }

    #[test]
    fn a_receive_completes_with_the_bytes_sent_for_it() {
        let mut r = Receiver::new();
        r.post(&[8, 8]);
        let mut f = Header::new(Kind::Data, 1, 3).encode().to_vec();
        f.extend_from_slice(b"abc");
        f.extend_from_slice(&Header::new(Kind::Data, 0, 0).encode());
        r.feed(&f);
        let done = r.finished();
        let [(0, Some(bufs))] = &done[..] else {
            panic!("not finished: {}", done.len());
        };
        assert_eq!((bufs[0].0, bufs[1].0), (0, 3));
        assert_eq!(&bufs[1].2[..4], b"abc\xEE");
    }

    /// The fuzz target over generated plans, as `cargo test` runs it (libFuzzer explores
    /// further under `scripts/fuzz.sh`).
    #[test]
    fn hostile_frame_sequences_complete_nothing_wrongly() {
        let mut rng = SplitMix64::new(26);
        for _ in 0..2000 {
            let len = rng.below(200);
            let mut plan: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            // Start with a receive posted, so that frames meet something.
            plan.splice(0..0, [0, 0, 0, 1, 0, 0, 0, 2]);
            receiver_session(&plan);
        }
    }
}
