//! One verbs lane: one or more RC QPs (`RAILOVER_QPS_PER_LANE`) carrying the lane's byte
//! stream through a ring of registered memory at each end, with a TCP connection beside
//! it for the QP handshake and for noticing that the peer closed.
//!
//! The stream starts on that TCP connection: the QPs and rings are set up only once the
//! peer is authenticated, and the stream moves to them then ([`super::bootstrap`]).
//!
//! The sender copies bytes into its staging region at the ring offset they will occupy
//! at the peer and RDMA-WRITEs them there with an immediate holding the length; the
//! receiver's completion says that many more bytes are in its ring. The receiver returns
//! credit (bytes it consumed) with zero-byte WRITE_WITH_IMMs whose immediate has the top
//! bit set, so the sender never overwrites unread bytes. Every WRITE_WITH_IMM consumes a
//! posted receive, which the receiver reposts as it reaps them.
//!
//! With several QPs, data write k goes on QP k mod q (so one lane can keep a fast port
//! busy); the receiver puts completed writes into the stream in that same order
//! ([`Ring`]). Credit returns use QP 0. Any QP's error fails the lane; the fence moves
//! them all to ERR.
//!
//! Payloads of [`PLACE_MIN`] bytes and more skip both copies, as NCCL's IB transport
//! does: before each clear-to-send the receiver sends a `Place` frame with the receive
//! buffer's address and key (the buffer registered on this lane's device the first time
//! the device needs it), and the sender RDMA-WRITEs the message from its own registered
//! buffer straight there, then sends the `Data` header flagged as placed through the ring
//! on the same QP, so the header's completion means the payload is in place. A message
//! sent again after a lane died goes in place only with an offer the receiver made after
//! it fenced every lane the sender gave up (the offer's generation, see `Fence`): before
//! that the dead lane might have delivered it, and a duplicate in the ring can be dropped
//! where one in the buffer could not. `RAILOVER_ZERO_COPY` sets the policy: from
//! [`PLACE_MIN`] bytes (`auto`), every payload, waiting for an offer (`always`), or none.
//!
//! GPU memory (`NCCL_PTR_CUDA`, `regMrDmaBuf`) is never touched by the CPU: a payload
//! from it, or into it (its `Cts` says so), is always written in place, whatever the
//! policy, waiting for the offer; and unless `RAILOVER_GDR=off` the receiver offers every
//! receive, so that a sender with GPU memory finds an offer for a small one too. A device
//! that cannot register such memory fails the lane with [`MemoryUnreachable`], and the
//! comm moves to another pair.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bootstrap::{Bootstrap, Want};
use super::device::VerbsNic;
use super::domain::Domain;
use super::gpu::GpuMemory;
use super::register::{register, Registration};
use super::sys::{
    wc, CompChannel, Completion, Cq, LocalPort, Mr, Qp, RawWrite, RemoteQp, Write as RdmaWrite,
    LINK_LAYER_ETHERNET, QPF_GRH_REQUIRED,
};
use super::{completion_error, qp_timing};
use crate::config::{Gdr, VerbsSettings, ZeroCopy};
use crate::transport::frames::{Placer, Placing};
use crate::transport::memory::LentBuf;
use crate::transport::memory::MemoryUnreachable;
use crate::transport::offers::{self, Offers, Pick};
pub use crate::transport::offers::{Offer, PLACE_MIN};

/// Bytes of each end's ring (and of the sender's staging region). Payloads of [`PLACE_MIN`]
/// bytes and more go around it, written in place, so it carries mostly frames: 1 MiB
/// keeps a fast port busy with what remains and keeps the memory a lane pins small.
pub const RING: usize = 1 << 20;
const MAX_SEND: u32 = 256;
const MAX_RECV: u32 = 512;
/// Send slots data may use; the rest are kept for credit returns.
const DATA_SLOTS: u32 = MAX_SEND - 4;
const CREDIT_FLAG: u32 = 1 << 31;
const WR_CREDIT: u64 = 1 << 63;
const WR_RECV: u64 = 1 << 62;
/// A payload written in place; the low bits are its length.
const WR_PLACED: u64 = 1 << 61;
/// Largest write in place one work request carries; a larger payload takes several.
const PLACE_MAX: u64 = 1 << 30;

/// Payload bytes written in place, and registrations of NCCL's memory made, process-wide.
pub static PLACED_BYTES: AtomicU64 = AtomicU64::new(0);

/// How long a graceful close waits for the peer to acknowledge what was posted.
const LINGER: Duration = Duration::from_millis(200);

/// The QP address block each end sends over the bootstrap connection (little endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpHello {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    /// `IBV_MTU_*` of the sender's port.
    pub mtu: u32,
    pub gid: [u8; 16],
    /// The region the peer writes into, and its key.
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

impl QpHello {
    pub const LEN: usize = 4 + 4 + 2 + 4 + 16 + 8 + 4 + 8;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        let mut w = &mut b[..];
        for part in [
            &self.qpn.to_le_bytes()[..],
            &self.psn.to_le_bytes(),
            &self.lid.to_le_bytes(),
            &self.mtu.to_le_bytes(),
            &self.gid,
            &self.addr.to_le_bytes(),
            &self.rkey.to_le_bytes(),
            &self.len.to_le_bytes(),
        ] {
            w.write_all(part).expect("the parts fill the block exactly");
        }
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> QpHello {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| (u64::from(u32_at(o + 4)) << 32) | u64::from(u32_at(o));
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[14..30]);
        QpHello {
            qpn: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_le_bytes([b[8], b[9]]),
            mtu: u32_at(10),
            gid,
            addr: u64_at(30),
            rkey: u32_at(38),
            len: u64_at(42),
        }
    }
}

/// A lane's hello: the number of QPs (one byte), then each QP's [`QpHello`].
pub fn encode_hellos(qps: &[QpHello]) -> Vec<u8> {
    let mut b = Vec::with_capacity(1 + qps.len() * QpHello::LEN);
    b.push(qps.len() as u8);
    for q in qps {
        b.extend_from_slice(&q.encode());
    }
    b
}

/// The bytes a lane hello with `qps` QPs takes.
pub fn hellos_len(qps: usize) -> usize {
    1 + qps * QpHello::LEN
}

/// Reads the count of a peer's hello: `Err` unless it opens `qps` QPs per lane, as we do.
pub fn check_hello_count(count: u8, qps: usize) -> Result<(), String> {
    if usize::from(count) == qps {
        return Ok(());
    }
    Err(format!(
        "the peer opens {count} QP(s) per verbs lane, this end {qps}: set RAILOVER_QPS_PER_LANE the same on both ends"
    ))
}

/// Decodes a peer's lane hello of `qps` QPs: one ring (address, key, size) for all.
pub fn decode_hellos(b: &[u8], qps: usize) -> Result<Vec<QpHello>, String> {
    let Some(&count) = b.first() else {
        return Err("an empty verbs hello".into());
    };
    check_hello_count(count, qps)?;
    if b.len() != hellos_len(qps) {
        return Err(format!(
            "a verbs hello of {} bytes, {} expected",
            b.len(),
            hellos_len(qps)
        ));
    }
    let hellos: Vec<QpHello> = b[1..]
        .chunks_exact(QpHello::LEN)
        .map(|c| QpHello::decode(c.try_into().expect("chunks of LEN")))
        .collect();
    let first = hellos[0];
    if hellos
        .iter()
        .any(|h| (h.addr, h.rkey, h.len) != (first.addr, first.rkey, first.len))
    {
        return Err("the peer's QPs name different rings".into());
    }
    Ok(hellos)
}

/// The local half of a QP's addressing, from discovery and the settings.
pub fn local_port(nic: &VerbsNic, settings: &VerbsSettings) -> LocalPort {
    LocalPort {
        port: nic.port,
        sgid_index: nic.gid_index.unwrap_or(0) as u8,
        traffic_class: settings.traffic_class,
        service_level: settings.service_level,
    }
}

/// Where our QP sends, from the peer's hello: by LID alone on an InfiniBand port that
/// needs no GRH, by GID (with a GRH) otherwise; the path MTU is the smaller of both ends.
pub fn remote_qp(peer: &QpHello, grh: bool, local_mtu: u32) -> RemoteQp {
    RemoteQp {
        qp_num: peer.qpn,
        psn: peer.psn,
        lid: peer.lid,
        gid: peer.gid,
        global: grh,
        mtu: local_mtu.min(peer.mtu),
    }
}

/// Whether paths from `nic` need a GRH (RoCE always; IB when the port says so).
pub fn needs_grh(nic: &VerbsNic) -> bool {
    nic.attr.link_layer == LINK_LAYER_ETHERNET || nic.attr.flags & QPF_GRH_REQUIRED != 0
}

/// The GID paths from `nic` use, or zeros.
pub fn local_gid(nic: &VerbsNic) -> [u8; 16] {
    let i = nic.gid_index.unwrap_or(0);
    nic.gids
        .iter()
        .find(|g| g.index == i)
        .map_or([0; 16], |g| g.gid)
}

/// A lane's ring accounting, both directions, without I/O: where the next bytes go at
/// the peer, how much the peer may still take, what arrived here and what credit is owed.
/// Offsets are positions in the stream; `% size` places them in a ring.
///
/// A lane may spread its writes over several QPs: data write k goes on QP k mod q, so
/// the receiver, which sees each QP's completions in order but not the QPs' relative
/// order, queues completed lengths per QP and adds them to the stream in the same
/// round-robin order. Credit returns go on QP 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    size: u64,
    /// Sender: bytes posted, bytes the peer acknowledged, bytes it freed.
    head: u64,
    acked: u64,
    credited: u64,
    /// Sender: payload bytes written in place (not through the ring).
    placed: u64,
    /// Sender: WRs in flight per QP, and the QP of the next data write.
    outstanding: Vec<u32>,
    next_send: usize,
    /// Receiver: bytes arrived (in stream order), read, and returned as credit.
    received: u64,
    consumed: u64,
    credit_sent: u64,
    /// Receiver: lengths of data writes completed per QP, not yet in the stream because
    /// an earlier write (on another QP) has not completed; the QP of the next write.
    landed: Vec<VecDeque<u32>>,
    next_recv: usize,
    /// Bytes in `landed`.
    waiting: u64,
}
/// What an immediate told the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Imm {
    Data(u32),
    Credit(u32),
}

impl Imm {
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data(n) => n & !CREDIT_FLAG,
            Imm::Credit(n) => CREDIT_FLAG | n,
        }
    }

    pub fn decode(imm: u32) -> Imm {
        if imm & CREDIT_FLAG != 0 {
            Imm::Credit(imm & !CREDIT_FLAG)
        } else {
            Imm::Data(imm)
        }
    }
}

impl Ring {
    /// A ring of `size` bytes (below 2^31, so lengths fit an immediate) on one QP.
    pub fn new(size: usize) -> Ring {
        Ring::with_qps(size, 1)
    }

    /// A ring of `size` bytes whose writes are spread over `qps` QPs.
    pub fn with_qps(size: usize, qps: usize) -> Ring {
        assert!(size > 0 && (size as u64) < u64::from(CREDIT_FLAG));
        assert!(qps > 0);
        Ring {
            size: size as u64,
            head: 0,
            acked: 0,
            credited: 0,
            placed: 0,
            outstanding: vec![0; qps],
            next_send: 0,
            received: 0,
            consumed: 0,
            credit_sent: 0,
            landed: vec![VecDeque::new(); qps],
            next_recv: 0,
            waiting: 0,
        }
    }

    pub fn qps(&self) -> usize {
        self.outstanding.len()
    }

    /// The QP the next data write must go on.
    pub fn send_qp(&self) -> usize {
        self.next_send
    }

    /// Where the next bytes go (ring offset) and how many fit there contiguously; 0 when
    /// the peer's ring is full or `slots` work requests are already in flight on the QP
    /// the next write goes on.
    pub fn send_window(&self, slots: u32) -> (usize, usize) {
        let off = self.head % self.size;
        if self.outstanding[self.next_send] >= slots {
            return (off as usize, 0);
        }
        let free = self.size - (self.head - self.credited);
        (off as usize, free.min(self.size - off) as usize)
    }

    /// `n` bytes were posted at the send window, on QP [`Ring::send_qp`].
    pub fn posted(&mut self, n: usize) {
        self.head += n as u64;
        self.outstanding[self.next_send] += 1;
        self.next_send = (self.next_send + 1) % self.qps();
    }

    /// Whether a payload may be written in place now with `writes` work requests: the
    /// QP the next ring write goes on (which must carry the payload's header after them)
    /// has that many free slots of `slots`.
    pub fn can_place(&self, slots: u32, writes: u32) -> bool {
        self.outstanding[self.next_send] + writes <= slots
    }

    /// `n` payload bytes were posted in place, on QP [`Ring::send_qp`], which also takes
    /// the next ring write (their header), so the header lands after them.
    pub fn posted_placed(&mut self, n: u64) {
        self.placed += n;
        self.outstanding[self.next_send] += 1;
    }

    /// A credit return was posted (on QP 0).
    pub fn posted_credit(&mut self) {
        self.outstanding[0] += 1;
        self.credit_sent = self.consumed;
    }

    /// A send on QP `qp` completed; `data` bytes of it were data.
    pub fn send_done(&mut self, qp: usize, data: u64) {
        if let Some(o) = self.outstanding.get_mut(qp) {
            *o = o.saturating_sub(1);
        }
        self.acked += data;
    }

    /// An immediate arrived on QP `qp`. `Err` when the peer broke the protocol (wrote
    /// past the space we gave, or freed more than we sent).
    pub fn arrived(&mut self, qp: usize, imm: Imm) -> Result<(), &'static str> {
        match imm {
            Imm::Data(n) => {
                let Some(q) = self.landed.get_mut(qp) else {
                    return Err("a write arrived on a QP the lane does not have");
                };
                q.push_back(n);
                self.waiting += u64::from(n);
                while let Some(n) = self.landed[self.next_recv].pop_front() {
                    self.waiting -= u64::from(n);
                    self.received += u64::from(n);
                    self.next_recv = (self.next_recv + 1) % self.landed.len();
                }
                if self.received + self.waiting - self.consumed > self.size {
                    return Err("the peer wrote past the free space of our ring");
                }
            }
            Imm::Credit(n) => {
                self.credited += u64::from(n);
                if self.credited > self.head {
                    return Err("the peer returned credit for bytes we never sent");
                }
            }
        }
        Ok(())
    }

    /// Where the next unread bytes are and how many are contiguous there.
    pub fn readable(&self) -> (usize, usize) {
        let off = self.consumed % self.size;
        let avail = self.received - self.consumed;
        (off as usize, avail.min(self.size - off) as usize)
    }

    /// `n` readable bytes were read.
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n as u64 <= self.received - self.consumed);
        self.consumed += n as u64;
    }

    /// Credit to return now, if any: in batches of a quarter ring, or all of it once
    /// everything that arrived was read (so a sender waiting on a full ring moves on).
    pub fn credit_due(&self, max_send: u32) -> Option<u32> {
        let owed = self.consumed - self.credit_sent;
        let drained = self.consumed == self.received;
        if owed == 0 || (owed < self.size / 4 && !drained) || self.outstanding[0] >= max_send {
            return None;
        }
        Some(owed as u32)
    }

    /// (bytes posted, bytes the peer acknowledged), through the ring and in place.
    pub fn progress(&self) -> (u64, u64) {
        (self.head + self.placed, self.acked)
    }

    pub fn unacked(&self) -> u64 {
        self.head + self.placed - self.acked
    }

    /// Payload bytes posted in place so far (a share of [`Ring::progress`]'s posted bytes).
    pub fn placed(&self) -> u64 {
        self.placed
    }
}

/// Bytes of lane rings registered now, process-wide: each lane's staging region and ring,
/// from when its peer is authenticated until the lane is torn down.
pub static RING_BYTES: AtomicU64 = AtomicU64::new(0);

/// A lane's two registered regions: the staging region its writes come from, and the
/// ring the peer writes into.
#[derive(Debug)]
struct Rings {
    send: Mr,
    recv: Mr,
}

impl Rings {
    fn new(pd: &Arc<super::sys::Pd>) -> io::Result<Rings> {
        let rings = Rings {
            send: Mr::new(pd, RING)?,
            recv: Mr::new(pd, RING)?,
        };
        RING_BYTES.fetch_add(2 * RING as u64, Ordering::Relaxed);
        Ok(rings)
    }
}

impl Drop for Rings {
    fn drop(&mut self) {
        RING_BYTES.fetch_sub(2 * RING as u64, Ordering::Relaxed);
    }
}

/// A lane of the verbs fabric.
///
/// Until its peer is authenticated it is a socket, a completion channel and small
/// buffers; its QPs, their CQ and its rings come then (see [`Bootstrap`]).
#[derive(Debug)]
pub struct VerbsLane {
    // Field order is drop order: the QPs before the regions they read and write, and
    // before their CQ; the context (held by all of them) goes last.
    /// Data write k goes on `qps[k % qps.len()]`; credit returns on `qps[0]`. Empty
    /// until the lane is set up.
    qps: Vec<Qp>,
    /// Per QP, the registrations of payloads written in place, held until their
    /// completions (which come in posting order).
    held: Vec<VecDeque<Arc<Registration>>>,
    /// Its NIC, for a registration of GPU memory to reach the flush QP; its settings,
    /// for that and for when to write payloads in place (`RAILOVER_ZERO_COPY`).
    nic: VerbsNic,
    settings: VerbsSettings,
    rings: Option<Rings>,
    cq: Option<Arc<Cq>>,
    /// Made with the lane, so that the reactor watches one fd from the start.
    channel: Arc<CompChannel>,
    dom: Arc<Domain>,
    qp_nums: Vec<u32>,
    sock: mio::net::TcpStream,
    boot: Bootstrap,
    port: LocalPort,
    grh: bool,
    timing: super::sys::QpTiming,
    mine: Vec<QpHello>,
    /// The peer's ring (from its first QP's hello; all name the same).
    peer: Option<QpHello>,
    ring: Ring,
    /// Receives the peer offered to have written in place, by sequence number.
    offers: Offers,
    peer_closed: bool,
    fenced: bool,
    /// Given up as a receive lane: QPs connected from now on refuse the peer's writes.
    sealed: bool,
    /// The first error: its kind, its message, and whether it was [`MemoryUnreachable`].
    error: Option<(io::ErrorKind, String, bool)>,
    wcs: Vec<Completion>,
    /// What the NIC can do with GPU memory, where the fabric judged it: GPU memory it
    /// cannot take is refused without a registration attempt.
    gpu: Option<GpuMemory>,
}

impl Drop for VerbsLane {
    fn drop(&mut self) {
        // Before the QPs and the CQ go (fields drop after this): their numbers and
        // addresses may be reused.
        self.dom.forget_qps(&self.qp_nums);
        if let Some(cq) = &self.cq {
            self.dom.forget_cq(cq.id());
        }
    }
}

impl VerbsLane {
    /// A lane on `nic` (a port of `dom`'s device) over the (possibly still connecting)
    /// bootstrap socket, accepted (`listener`) or ours. Only its completion channel is
    /// made now: QPs and rings wait for the peer to be authenticated.
    pub fn new(
        dom: &Arc<Domain>,
        nic: &VerbsNic,
        sock: mio::net::TcpStream,
        settings: &VerbsSettings,
        listener: bool,
    ) -> io::Result<VerbsLane> {
        let channel = CompChannel::new(&dom.ctx)?;
        let n = usize::from(settings.qps_per_lane.max(1));
        Ok(VerbsLane {
            qps: Vec::new(),
            held: vec![VecDeque::new(); n],
            nic: nic.clone(),
            settings: *settings,
            rings: None,
            cq: None,
            channel,
            dom: dom.clone(),
            qp_nums: Vec::new(),
            sock,
            // A peer with another QP count is told so by `decode_hellos`.
            boot: Bootstrap::new(listener, hellos_len(usize::from(u8::MAX))),
            port: local_port(nic, settings),
            grh: needs_grh(nic),
            timing: qp_timing(settings),
            mine: Vec::new(),
            peer: None,
            ring: Ring::with_qps(RING, n),
            offers: Offers::default(),
            peer_closed: false,
            fenced: false,
            sealed: false,
            error: None,
            wcs: Vec::with_capacity(64),
            gpu: None,
        })
    }

    /// The lane's NIC can do `gpu` with GPU memory (`None`: not judged, so registering
    /// is tried whatever the memory).
    pub fn taking(mut self, gpu: Option<GpuMemory>) -> VerbsLane {
        self.gpu = gpu;
        self
    }

    /// The engine authenticated the peer of this accepted lane: its QPs and rings are
    /// set up now. A failure is the lane's, seen at its next read or write.
    pub fn authenticated(&mut self) {
        self.boot.authenticated();
        if let Err(e) = self.advance() {
            self.fail_with(e);
        }
    }

    /// Bytes in the ring, or the peer's close, not yet read. A completion reaped by a
    /// `write` (or after a `read`'s last look) puts bytes here whose completion-channel
    /// event is already consumed: nothing else would announce them. (Before the ring, the
    /// socket's own readiness announces the stream.)
    pub fn has_unread(&self) -> bool {
        self.boot.rx_on_ring() && (self.ring.readable().1 > 0 || self.peer_closed)
    }

    /// Whether both directions of the stream go through the rings.
    pub fn is_ready(&self) -> bool {
        self.boot.tx_on_ring() && self.boot.rx_on_ring()
    }

    /// Whether the lane's rings are registered (its peer was authenticated).
    pub fn is_set_up(&self) -> bool {
        self.rings.is_some()
    }

    /// (bytes posted, bytes the peer acknowledged).
    pub fn progress(&self) -> (u64, u64) {
        self.ring.progress()
    }

    /// The peer's address on its bootstrap connection: the peer NIC's.
    pub fn peer(&self) -> Option<std::net::IpAddr> {
        self.sock.peer_addr().ok().map(|a| a.ip())
    }

    /// Of the bytes posted, payload bytes written in place (this lane's share of
    /// [`PLACED_BYTES`]).
    pub fn placed(&self) -> u64 {
        self.ring.placed()
    }

    fn fail(&mut self, kind: io::ErrorKind, msg: String) -> io::Error {
        self.error.get_or_insert((kind, msg.clone(), false));
        io::Error::new(kind, msg)
    }

    /// Fails the lane with `e`, kept as it is (a [`MemoryUnreachable`] stays one).
    fn fail_with(&mut self, e: io::Error) -> io::Error {
        let memory = e.get_ref().is_some_and(|i| i.is::<MemoryUnreachable>());
        self.error.get_or_insert((e.kind(), e.to_string(), memory));
        e
    }

    fn check(&self) -> io::Result<()> {
        match &self.error {
            Some((_, m, true)) => Err(io::Error::other(MemoryUnreachable(m.clone()))),
            Some((k, m, false)) => Err(io::Error::new(*k, m.clone())),
            None => Ok(()),
        }
    }

    /// Everything the lane's fds may have signalled beside the stream: bootstrap chunks
    /// still to send, the peer closing, async events, completions; then credit owed to
    /// the peer.
    pub fn pump(&mut self) -> io::Result<()> {
        self.check()?;
        if let Err(e) = self.flush_boot() {
            return Err(self.fail(e.kind(), format!("verbs bootstrap socket: {e}")));
        }
        if self.boot.rx_on_ring() {
            self.watch_socket()?;
        }
        if self.cq.is_none() {
            return Ok(());
        }
        self.async_events()?;
        self.reap()?;
        if self.boot.tx_on_ring() {
            self.return_credit()?;
        }
        Ok(())
    }

    /// Does what the bootstrap machine says is due: set up, connect; then sends its
    /// chunks. A fenced lane sets up nothing more.
    fn advance(&mut self) -> io::Result<()> {
        if self.fenced {
            return Ok(());
        }
        if self.boot.setup_due() {
            self.set_up()?;
        }
        if let Some(peer) = self.boot.connect_due() {
            let peer = peer.to_vec();
            self.connect(&peer)?;
        }
        self.flush_boot()
    }

    /// The peer is authenticated: the CQ, the QPs (to INIT) and the rings, and our hello.
    fn set_up(&mut self) -> io::Result<()> {
        let (ctx, pd) = (&self.dom.ctx, &self.dom.pd);
        let n = self.ring.qps();
        let cq = Cq::new(
            ctx,
            &self.channel,
            (n as u32 * (MAX_SEND + MAX_RECV) + 16) as i32,
        )?;
        let rings = Rings::new(pd)?;
        let mut qps = Vec::with_capacity(n);
        let mut mine = Vec::with_capacity(n);
        for _ in 0..n {
            let qp = Qp::new_rc(pd, &cq, MAX_SEND, MAX_RECV)?;
            qp.to_init(self.nic.port)?;
            let mut psn = [0u8; 4];
            getrandom::getrandom(&mut psn).map_err(|e| io::Error::other(e.to_string()))?;
            mine.push(QpHello {
                qpn: qp.qp_num(),
                psn: u32::from_le_bytes(psn) & 0xff_ffff,
                lid: self.nic.attr.lid,
                mtu: self.nic.attr.active_mtu,
                gid: local_gid(&self.nic),
                addr: rings.recv.addr(),
                rkey: rings.recv.rkey(),
                len: RING as u64,
            });
            qps.push(qp);
        }
        self.qp_nums = qps.iter().map(Qp::qp_num).collect();
        self.qps = qps;
        self.rings = Some(rings);
        self.cq = Some(cq);
        self.boot.set_up(&encode_hellos(&mine));
        self.mine = mine;
        Ok(())
    }

    /// Both hellos known: our QPs to RTR and RTS towards the peer's, receives posted.
    fn connect(&mut self, hello: &[u8]) -> io::Result<()> {
        let n = self.qps.len();
        let peers =
            decode_hellos(hello, n).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if peers[0].len != RING as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the peer's ring is {} bytes, ours {RING}", peers[0].len),
            ));
        }
        for ((qp, mine), peer) in self.qps.iter().zip(&self.mine).zip(&peers) {
            // A lane only WRITEs: one READ slot each way is the least a QP takes.
            qp.to_rtr(&self.port, &remote_qp(peer, self.grh, mine.mtu), 1)?;
            qp.to_rts(mine.psn, self.timing, 1)?;
            for _ in 0..MAX_RECV {
                qp.post_recv(WR_RECV)?;
            }
        }
        self.peer = Some(peers[0]);
        self.boot.connected();
        if self.sealed {
            self.refuse_writes();
        }
        Ok(())
    }

    /// Sends what the bootstrap machine has queued, as far as the socket takes it.
    fn flush_boot(&mut self) -> io::Result<()> {
        while !self.boot.outbox().is_empty() {
            match self.sock.write(self.boot.outbox()) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.boot.sent(n),
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads the stream from the bootstrap socket into `buf` until the peer's `Ready`,
    /// acting on its chunks on the way; `None` once the stream comes through the ring.
    fn read_socket(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        loop {
            let got = match self.boot.want() {
                Want::Ring => return None,
                Want::Stream(left) => {
                    let n = left.min(buf.len());
                    match self.sock.read(&mut buf[..n]) {
                        Ok(n) if n > 0 => {
                            self.boot.streamed(n);
                            return Some(Ok(n));
                        }
                        other => other,
                    }
                }
                Want::Control(want) => {
                    let mut b = [0u8; 256];
                    let want = want.min(b.len());
                    match self.sock.read(&mut b[..want]) {
                        Ok(n) if n > 0 => {
                            let acted = match self.boot.took(&b[..n]) {
                                Ok(()) => self.advance(),
                                Err(why) => Err(io::Error::new(io::ErrorKind::InvalidData, why)),
                            };
                            if let Err(e) = acted {
                                return Some(Err(self.fail_with(e)));
                            }
                            continue;
                        }
                        other => other,
                    }
                }
            };
            return Some(match got {
                Ok(_) => {
                    // The peer closed its end before its stream reached the ring.
                    self.peer_closed = true;
                    Ok(0)
                }
                Err(e) if would_block(&e) => Err(io::ErrorKind::WouldBlock.into()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(self.fail(e.kind(), format!("verbs bootstrap socket: {e}"))),
            });
        }
    }

    /// After the peer's `Ready` its socket carries nothing: EOF is the peer closing, a
    /// reset the peer fencing or dying.
    fn watch_socket(&mut self) -> io::Result<()> {
        if self.peer_closed {
            return Ok(());
        }
        let mut b = [0u8; 1];
        loop {
            return match self.sock.read(&mut b) {
                Ok(0) => {
                    self.peer_closed = true;
                    Ok(())
                }
                Ok(_) => Err(self.fail(
                    io::ErrorKind::InvalidData,
                    "unexpected bytes on the verbs bootstrap socket".into(),
                )),
                Err(e) if would_block(&e) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(self.fail(e.kind(), format!("verbs bootstrap socket: {e}"))),
            };
        }
    }

    /// What the device's async events (read by the fabric) said about this lane.
    fn async_events(&mut self) -> io::Result<()> {
        if self.fenced {
            return Ok(());
        }
        let cq = self.cq.as_ref().map(|c| c.id());
        let why = (self.dom.fault(self.port.port, &self.qp_nums))
            .or_else(|| cq.and_then(|c| self.dom.cq_fault(c)));
        match why {
            Some(why) => Err(self.fail(io::ErrorKind::Other, why)),
            None => Ok(()),
        }
    }

    /// Drain, acknowledge and re-arm the channel, then poll the CQ empty.
    fn reap(&mut self) -> io::Result<()> {
        let Some(cq) = self.cq.clone() else {
            return Ok(());
        };
        cq.drain_and_rearm()?;
        loop {
            self.wcs.clear();
            let n = cq.poll(&mut self.wcs, 64)?;
            for i in 0..n {
                let c = self.wcs[i];
                self.complete(&c)?;
            }
            if n < 64 {
                return Ok(());
            }
        }
    }

    fn complete(&mut self, c: &Completion) -> io::Result<()> {
        if c.status != wc::SUCCESS {
            if self.fenced || self.error.is_some() {
                return Ok(());
            }
            let e = completion_error(c);
            return Err(self.fail(e.kind(), e.to_string()));
        }
        let Some(qp) = self.qps.iter().position(|q| q.qp_num() == c.qp_num) else {
            return Err(self.fail(
                io::ErrorKind::InvalidData,
                format!(
                    "a verbs completion of QP {}, not one of this lane's",
                    c.qp_num
                ),
            ));
        };
        if c.wr_id == WR_RECV {
            let Some(imm) = c.imm else {
                return Err(self.fail(
                    io::ErrorKind::InvalidData,
                    "a verbs receive completed without an immediate".into(),
                ));
            };
            if let Err(why) = self.ring.arrived(qp, Imm::decode(imm)) {
                return Err(self.fail(io::ErrorKind::InvalidData, why.into()));
            }
            return self.qps[qp].post_recv(WR_RECV);
        }
        let data = if c.wr_id & WR_CREDIT != 0 {
            0
        } else if c.wr_id & WR_PLACED != 0 {
            self.held[qp].pop_front();
            c.wr_id & !WR_PLACED
        } else {
            c.wr_id
        };
        self.ring.send_done(qp, data);
        Ok(())
    }

    fn return_credit(&mut self) -> io::Result<()> {
        let Some(owed) = self.ring.credit_due(MAX_SEND) else {
            return Ok(());
        };
        let (peer, rings) = self.connected_to();
        self.qps[0].post_write(&RdmaWrite {
            local: &rings.send,
            offset: 0,
            len: 0,
            remote_addr: peer.addr,
            rkey: peer.rkey,
            imm: Some(Imm::Credit(owed).encode()),
            signaled: true,
            wr_id: WR_CREDIT,
        })?;
        self.ring.posted_credit();
        Ok(())
    }

    /// The peer's ring and our regions, on a lane whose QPs are connected.
    fn connected_to(&self) -> (QpHello, &Rings) {
        let peer = self.peer.expect("connected lanes know their peer");
        (
            peer,
            self.rings.as_ref().expect("connected lanes are set up"),
        )
    }

    /// The fence: every QP goes to ERR, the socket will close with a reset, and the lane
    /// sets up nothing more.
    pub fn fence(&mut self) {
        self.fenced = true;
        for qp in &self.qps {
            let _ = qp.to_err();
        }
        let _ = socket2::SockRef::from(&self.sock).set_linger(Some(Duration::ZERO));
    }

    /// Given up as a receive lane: the peer's writes are refused from now on (its RDMA
    /// WRITEs fail with a remote access error), while ours still go out. QPs not yet
    /// connected refuse them once they are.
    pub fn seal(&mut self) {
        if self.fenced {
            return;
        }
        self.sealed = true;
        if self.boot.is_connected() {
            self.refuse_writes();
        }
    }

    fn refuse_writes(&self) {
        for qp in &self.qps {
            if let Err(e) = qp.refuse_remote_writes() {
                tracing::debug!("railover: sealing a lane on {}: {e}", self.dom.name());
            }
        }
    }

    /// Before a graceful close: wait (briefly) until the bootstrap socket took our last
    /// chunks and the peer acknowledged what we posted, so that it has it all before it
    /// sees the socket close.
    pub fn linger(&mut self) {
        if self.fenced {
            return;
        }
        let end = Instant::now() + LINGER;
        if !self.boot.outbox().is_empty() {
            // Blocking now: this runs on the reaper thread, off the reactor.
            let s = socket2::SockRef::from(&self.sock);
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(LINGER));
            let _ = (&*s).write_all(self.boot.outbox());
        }
        if !self.is_ready() {
            return;
        }
        while self.ring.unacked() > 0 && self.error.is_none() && Instant::now() < end {
            if self.reap().is_err() {
                break;
            }
            if self.ring.unacked() > 0 {
                let _ = self.channel.wait(Duration::from_millis(10));
            }
        }
        if self.ring.unacked() > 0 {
            tracing::debug!(
                "railover: verbs lane closed with {} bytes unacknowledged",
                self.ring.unacked()
            );
        }
    }

    /// The fds registered readable beside the bootstrap socket: the completion channel.
    /// (The device's async-event fd is the fabric's.)
    fn fds(&self) -> [std::os::fd::RawFd; 1] {
        [self.channel.fd()]
    }

    /// The peer offered receive `seq` to be written in place (a `Place` frame).
    pub fn offer(&mut self, seq: u64, offer: Offer) {
        self.offers.insert(seq, offer);
    }

    /// The offers held (for tests and stats).
    pub fn offers(&self) -> usize {
        self.offers.len()
    }

    /// This device's registration of the range `buf` lies in (see [`register`]): made
    /// the first time a lane of the device needs it, unless `regMr` made it already.
    fn registration(&self, buf: &LentBuf) -> io::Result<Option<Arc<Registration>>> {
        let Some(region) = buf.region() else {
            return Ok(None);
        };
        register(
            &self.dom,
            &self.nic,
            &self.settings,
            self.gpu.as_ref(),
            region,
            "first use there",
        )
    }
}

impl Placer for VerbsLane {
    fn advertise(
        &mut self,
        seq: u64,
        buf: &LentBuf,
        capacity: u64,
        gen: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        // Unless RAILOVER_GDR=off (or no payload goes in place) every receive is offered:
        // a sender's GPU memory needs one.
        let offer_all = self.settings.gdr != Gdr::Off;
        let least = match self.settings.zero_copy {
            _ if !buf.cpu_reachable() => 1,
            ZeroCopy::Off => return Ok(None),
            _ if offer_all => 1,
            ZeroCopy::Auto => PLACE_MIN,
            ZeroCopy::Always => 1,
        };
        // Offered once the lane has its rings, even while its stream still crosses the
        // bootstrap socket: the sender uses an offer only from its QPs, once they are
        // connected, and a first receive offered then is written in place too.
        if capacity < least || !self.boot.is_set_up() {
            return Ok(None);
        }
        // Not the lane's failure: the engine fails it, after telling the sender why.
        let Some(mr) = self.registration(buf)? else {
            return Ok(None);
        };
        let rkey = (mr.mr.as_ref())
            .expect("registration() hands out only made ones")
            .rkey();
        let offer = Offer {
            addr: buf.addr() as u64,
            rkey,
            capacity: capacity.min(buf.len() as u64),
            gen,
        };
        Ok(Some(offer.frame(seq)))
    }

    fn direct(&mut self, seq: u64, buf: &LentBuf, len: u64, place: Placing) -> io::Result<bool> {
        self.check()?;
        let must = place.must || !buf.cpu_reachable();
        let Some((least, wait)) = offers::policy(self.settings.zero_copy, must) else {
            return Ok(false);
        };
        // No offer yet, or one the receiver made before it fenced the lane this message
        // was lost with: in the stream, or (every payload in place) wait for the next.
        // The QPs are not connected yet (they are once the peer's Ready arrives, an RTT
        // after its Welcome): wait for them, and for the offers the receiver makes, rather
        // than send a first message through the stream.
        let pick = match self.boot.tx_on_ring() {
            true => self.offers.pick(seq, len, place.min_gen, (least, wait)),
            false => Pick::Wait,
        };
        let offer = match pick {
            Pick::Place(offer) => offer,
            Pick::Stream => return Ok(false),
            Pick::Wait => return Err(io::ErrorKind::WouldBlock.into()),
        };
        // One work request per PLACE_MAX bytes, all on the QP that carries the header.
        let writes = len.div_ceil(PLACE_MAX) as u32;
        if !self.ring.can_place(DATA_SLOTS, writes) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let held = match self.registration(buf) {
            Ok(Some(held)) => held,
            Err(e) => return Err(self.fail_with(e)),
            Ok(None) if wait => {
                return Err(self.fail(
                    io::ErrorKind::Other,
                    format!(
                        "RAILOVER_ZERO_COPY=always: the send buffer at {:#x} cannot be registered on {}",
                        buf.addr(),
                        self.dom.name()
                    ),
                ));
            }
            Ok(None) => {
                self.offers.remove(seq);
                return Ok(false);
            }
        };
        self.offers.remove(seq);
        let mr = held
            .mr
            .as_ref()
            .expect("registration() hands out only made ones");
        let qp = self.ring.send_qp();
        let mut off = 0;
        while off < len {
            let n = (len - off).min(PLACE_MAX);
            self.qps[qp].post_user_write(
                mr,
                &RawWrite {
                    addr: buf.addr() as u64 + off,
                    len: n as u32,
                    lkey: mr.lkey(),
                    remote_addr: offer.addr + off,
                    rkey: offer.rkey,
                    imm: None,
                    signaled: true,
                    wr_id: WR_PLACED | n,
                },
            )?;
            self.ring.posted_placed(n);
            self.held[qp].push_back(held.clone());
            off += n;
        }
        PLACED_BYTES.fetch_add(len, Ordering::Relaxed);
        Ok(true)
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::NotConnected
}

impl Read for VerbsLane {
    /// Bytes the peer wrote are read even once the lane failed (their completions came
    /// before the error); then the error.
    /// Before the peer's `Ready`, its stream comes over the bootstrap socket.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if let Some(got) = self.read_socket(buf) {
            return got;
        }
        let (off, avail) = self.ring.readable();
        if avail == 0 {
            self.check()?;
            // Bytes the peer posted before closing are reaped before its EOF is seen.
            return if self.peer_closed {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = avail.min(buf.len());
        let rings = self
            .rings
            .as_ref()
            .expect("a lane reading its ring has one");
        rings.recv.read(off, &mut buf[..n])?;
        self.ring.consume(n);
        Ok(n)
    }
}

impl Write for VerbsLane {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.check()?;
        if self.peer_closed {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the peer closed the verbs lane",
            ));
        }
        if !self.boot.tx_on_ring() {
            // Before the rings: over the bootstrap socket, as far as it may carry it.
            let n = self.boot.push_stream(bufs);
            if let Err(e) = self.flush_boot() {
                return Err(self.fail(e.kind(), format!("verbs bootstrap socket: {e}")));
            }
            return match n {
                0 => Err(io::ErrorKind::WouldBlock.into()),
                n => Ok(n),
            };
        }
        let (off, room) = self.ring.send_window(DATA_SLOTS);
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // Gather as much as fits contiguously: one WRITE for many small frames.
        let (peer, rings) = self.connected_to();
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(room - n);
            rings.send.write(off + n, &b[..take])?;
            n += take;
            if n == room {
                break;
            }
        }
        if n == 0 {
            return Ok(0);
        }
        self.qps[self.ring.send_qp()].post_write(&RdmaWrite {
            local: &rings.send,
            offset: off,
            len: n,
            remote_addr: peer.addr + off as u64,
            rkey: peer.rkey,
            imm: Some(Imm::Data(n as u32).encode()),
            signaled: true,
            wr_id: n as u64,
        })?;
        self.ring.posted(n);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl mio::event::Source for VerbsLane {
    fn register(&mut self, r: &mio::Registry, t: mio::Token, i: mio::Interest) -> io::Result<()> {
        self.sock.register(r, t, i)?;
        for fd in self.fds() {
            mio::unix::SourceFd(&fd).register(r, t, mio::Interest::READABLE)?;
        }
        Ok(())
    }

    fn reregister(&mut self, r: &mio::Registry, t: mio::Token, i: mio::Interest) -> io::Result<()> {
        self.sock.reregister(r, t, i)?;
        for fd in self.fds() {
            mio::unix::SourceFd(&fd).reregister(r, t, mio::Interest::READABLE)?;
        }
        Ok(())
    }

    fn deregister(&mut self, r: &mio::Registry) -> io::Result<()> {
        self.sock.deregister(r)?;
        for fd in self.fds() {
            mio::unix::SourceFd(&fd).deregister(r)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips() {
        let h = QpHello {
            qpn: 0x11_2233,
            psn: 0xab_cdef,
            lid: 7,
            mtu: 3,
            gid: [9; 16],
            addr: 0xdead_beef_0000,
            rkey: 0x55,
            len: RING as u64,
        };
        assert_eq!(QpHello::decode(&h.encode()), h);
    }

    fn nic(link_layer: u8, flags: u8) -> VerbsNic {
        VerbsNic {
            device: "mlx5_0".into(),
            port: 1,
            guid: 1,
            attr: super::super::sys::PortAttr {
                link_layer,
                flags,
                lid: 17,
                ..Default::default()
            },
            speed_mbps: 0,
            gids: vec![super::super::sys::GidEntry {
                index: 3,
                gid: [7; 16],
                gid_type: 2,
                ndev_ifindex: 0,
            }],
            gid_index: Some(3),
            netdev: None,
            pci_path: None,
        }
    }

    #[test]
    fn ib_ports_address_by_lid_and_roce_ports_by_gid() {
        use super::super::sys::LINK_LAYER_INFINIBAND;
        let peer = QpHello {
            qpn: 9,
            psn: 5,
            lid: 42,
            mtu: 5,
            gid: [1; 16],
            addr: 0,
            rkey: 0,
            len: RING as u64,
        };
        let ib = nic(LINK_LAYER_INFINIBAND, 0);
        assert!(!needs_grh(&ib));
        let r = remote_qp(&peer, needs_grh(&ib), 3);
        assert_eq!(
            (r.global, r.lid, r.qp_num, r.psn, r.mtu),
            (false, 42, 9, 5, 3)
        );
        assert!(needs_grh(&nic(LINK_LAYER_INFINIBAND, QPF_GRH_REQUIRED)));
        let roce = nic(LINK_LAYER_ETHERNET, 0);
        assert!(needs_grh(&roce));
        let r = remote_qp(&peer, needs_grh(&roce), 5);
        assert_eq!((r.global, r.gid, r.mtu), (true, [1; 16], 5));
        let s = VerbsSettings {
            traffic_class: 106,
            service_level: 3,
            ..Default::default()
        };
        let p = local_port(&roce, &s);
        assert_eq!(
            (p.port, p.sgid_index, p.traffic_class, p.service_level),
            (1, 3, 106, 3)
        );
        assert_eq!(local_gid(&roce), [7; 16]);
    }

    /// Moves bytes from `a` to `b` as the lane does, with the given read sizes; returns
    /// the stream `b` read. A write's bytes land in `b`'s ring only when its completion
    /// is delivered; `seed` (0: in order) picks which QP's next completion comes next and
    /// how many are left in flight, as a NIC may order completions across QPs.
    fn pump(a: &mut Ring, b: &mut Ring, send: &[u8], reads: usize, seed: u64) -> Vec<u8> {
        let size = a.size as usize;
        let mut peer_ring = vec![0u8; size];
        let mut out = Vec::new();
        let mut sent = 0;
        let mut in_flight: Vec<VecDeque<(usize, Vec<u8>)>> = vec![VecDeque::new(); a.qps()];
        let mut rng = seed;
        let mut next = move |n: usize| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize % n
        };
        for _ in 0..100_000 {
            if out.len() == send.len() {
                break;
            }
            // Up to three writes, of uneven sizes so the QPs' writes differ.
            for _ in 0..3 {
                let (off, room) = a.send_window(8);
                let n = room.min(send.len() - sent).min(1 + next(40));
                if n == 0 {
                    break;
                }
                let qp = a.send_qp();
                in_flight[qp].push_back((off, send[sent..sent + n].to_vec()));
                sent += n;
                a.posted(n);
            }
            // Deliver completions: in order, or a random QP's next one at a time.
            loop {
                let busy: Vec<usize> = (0..in_flight.len())
                    .filter(|&q| !in_flight[q].is_empty())
                    .collect();
                if busy.is_empty() || (seed != 0 && next(4) == 0) {
                    break;
                }
                let qp = if seed == 0 {
                    busy[0]
                } else {
                    busy[next(busy.len())]
                };
                let (off, bytes) = in_flight[qp].pop_front().unwrap();
                peer_ring[off..off + bytes.len()].copy_from_slice(&bytes);
                b.arrived(qp, Imm::decode(Imm::Data(bytes.len() as u32).encode()))
                    .unwrap();
                a.send_done(qp, bytes.len() as u64);
            }
            let (off, avail) = b.readable();
            let n = avail.min(reads);
            out.extend_from_slice(&peer_ring[off..off + n]);
            b.consume(n);
            if let Some(c) = b.credit_due(8) {
                b.posted_credit();
                a.arrived(0, Imm::decode(Imm::Credit(c).encode())).unwrap();
                b.send_done(0, 0);
            }
        }
        out
    }

    #[test]
    fn a_stream_wraps_the_ring_intact() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for reads in [1, 7, 64, 100, 1000] {
            let (mut a, mut b) = (Ring::new(64), Ring::new(64));
            assert_eq!(
                pump(&mut a, &mut b, &data, reads, 0),
                data,
                "reads of {reads}"
            );
            assert_eq!(a.progress(), (data.len() as u64, data.len() as u64));
            assert_eq!(a.unacked(), 0);
        }
    }

    #[test]
    fn completions_out_of_order_across_qps_still_make_an_in_order_stream() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        for qps in [2, 3, 16] {
            for seed in 1..=20 {
                let (mut a, mut b) = (Ring::with_qps(256, qps), Ring::with_qps(256, qps));
                let got = pump(&mut a, &mut b, &data, 1 + seed as usize * 37, seed);
                assert!(got == data, "{qps} QPs, seed {seed}: the stream differs");
                assert_eq!(a.unacked(), 0);
                assert!(a.outstanding.iter().all(|&o| o == 0));
            }
        }
    }

    #[test]
    fn a_later_qps_write_waits_for_the_earlier_ones() {
        let (mut a, mut b) = (Ring::with_qps(100, 3), Ring::with_qps(100, 3));
        for (n, qp) in [(10, 0), (20, 1), (30, 2), (5, 0)] {
            assert_eq!(a.send_qp(), qp, "write k goes on QP k mod 3");
            a.posted(n);
        }
        assert_eq!(a.outstanding, [2, 1, 1]);
        b.arrived(2, Imm::Data(30)).unwrap();
        b.arrived(1, Imm::Data(20)).unwrap();
        assert_eq!(b.readable(), (0, 0), "write 0 (QP 0) has not completed");
        b.arrived(0, Imm::Data(10)).unwrap();
        assert_eq!(b.readable(), (0, 60));
        b.arrived(0, Imm::Data(5)).unwrap();
        assert_eq!(b.readable(), (0, 65));
        // Credit returns go on QP 0 and count against its send queue only.
        b.consume(65);
        assert_eq!(b.credit_due(1), Some(65));
        b.posted_credit();
        assert_eq!(b.outstanding, [1, 0, 0]);
        assert_eq!(b.credit_due(1), None);
        // A QP the lane lacks, and writes queued past the free space, are refused.
        assert!(b.arrived(3, Imm::Data(1)).is_err());
        let mut c = Ring::with_qps(100, 2);
        c.arrived(1, Imm::Data(60)).unwrap();
        assert!(
            c.arrived(1, Imm::Data(50)).is_err(),
            "110 bytes waiting in a 100-byte ring"
        );
        // The sender stops when the next QP's send queue is full, not another's.
        let mut d = Ring::with_qps(100, 2);
        d.posted(1);
        assert_eq!(d.send_window(1).1, 99, "QP 1 is free");
        d.posted(1);
        assert_eq!(d.send_window(1).1, 0, "QP 0 is full");
        d.send_done(0, 1);
        assert_eq!(d.send_window(1).1, 98);
    }

    #[test]
    fn lane_hellos_round_trip_and_refuse_another_qp_count() {
        let h = |i: u32| QpHello {
            qpn: 100 + i,
            psn: 7 * i,
            lid: 3,
            mtu: 5,
            gid: [i as u8; 16],
            addr: 0x1000,
            rkey: 9,
            len: RING as u64,
        };
        let three = [h(0), h(1), h(2)];
        let b = encode_hellos(&three);
        assert_eq!(b.len(), hellos_len(3));
        assert_eq!(b[0], 3);
        assert_eq!(decode_hellos(&b, 3).unwrap(), three);
        let e = decode_hellos(&b, 2).unwrap_err();
        assert!(
            e.contains("peer opens 3 QP(s)")
                && e.contains("this end 2")
                && e.contains("RAILOVER_QPS_PER_LANE"),
            "{e}"
        );
        assert!(decode_hellos(&b[..b.len() - 1], 3).is_err(), "short");
        assert!(decode_hellos(&[], 1).is_err());
        let mut other = three;
        other[1].rkey = 10;
        let e = decode_hellos(&encode_hellos(&other), 3).unwrap_err();
        assert!(e.contains("different rings"), "{e}");
        assert!(check_hello_count(1, 1).is_ok() && check_hello_count(2, 1).is_err());
    }

    #[test]
    fn the_sender_stops_at_a_full_ring_until_credit_returns() {
        let (mut a, mut b) = (Ring::new(100), Ring::new(100));
        assert_eq!(a.send_window(8), (0, 100));
        a.posted(60);
        assert_eq!(a.send_window(8), (60, 40));
        a.posted(40);
        assert_eq!(a.send_window(8).1, 0, "full");
        b.arrived(0, Imm::Data(60)).unwrap();
        b.arrived(0, Imm::Data(40)).unwrap();
        b.consume(10);
        assert_eq!(
            b.credit_due(8),
            None,
            "a tenth of the ring read, more waiting"
        );
        b.consume(90);
        assert_eq!(b.credit_due(8), Some(100), "all read: everything is owed");
        b.posted_credit();
        assert_eq!(b.credit_due(8), None);
        a.arrived(0, Imm::Credit(100)).unwrap();
        assert_eq!(a.send_window(8), (0, 100), "wrapped to the start");
        assert_eq!(a.send_window(2).1, 0, "but two WRs are in flight");
    }

    #[test]
    fn placed_payloads_count_as_posted_but_take_no_ring_space() {
        let mut a = Ring::new(100);
        a.posted(40);
        a.posted_placed(5000);
        assert_eq!(a.placed(), 5000);
        assert_eq!(a.progress(), (5040, 0));
        assert_eq!(
            a.send_window(8),
            (40, 60),
            "the payload went around the ring"
        );
        a.send_done(0, 40);
        a.send_done(0, 5000);
        assert_eq!((a.progress(), a.unacked()), ((5040, 5040), 0));
        assert_eq!(a.placed(), 5000, "completions leave the placed count alone");
    }

    #[test]
    fn protocol_violations_are_refused() {
        let mut r = Ring::new(100);
        r.arrived(0, Imm::Data(100)).unwrap();
        assert!(r.arrived(0, Imm::Data(1)).is_err(), "past the free space");
        let mut r = Ring::new(100);
        r.posted(10);
        assert!(
            r.arrived(0, Imm::Credit(11)).is_err(),
            "credit for unsent bytes"
        );
        assert_eq!(Imm::decode(Imm::Credit(5).encode()), Imm::Credit(5));
        assert_eq!(Imm::decode(Imm::Data(5).encode()), Imm::Data(5));
    }

    #[test]
    fn the_credit_flag_is_out_of_reach_of_lengths() {
        assert!((RING as u64) < u64::from(CREDIT_FLAG));
        assert_eq!(WR_RECV & WR_CREDIT, 0);
        assert!((RING as u64) < WR_RECV, "a data wr_id is its length");
    }
}
