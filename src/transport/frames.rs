//! Frames over a non-blocking TCP stream, with payloads read and written in place.
//!
//! [`FrameReader`] parses headers out of a small staging buffer and then reads a `Data`
//! payload straight into the buffer the receive machine named, so bulk bytes are copied
//! once (kernel → NCCL's buffer). [`FrameWriter`] queues control frames and payload
//! references and sends them with `writev`, so a small message costs one system call.
//! Both stop at `WouldBlock` and keep their place; both bound the bytes moved per call
//! so that one busy lane cannot starve the others.

use std::collections::{BTreeSet, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use super::memory::LentBuf;
use super::offers::MAX_OFFERS;
use crate::conn::wire::{Header, Kind, WireError, DATA_PLACED, HEADER_LEN};

/// Payload bytes the CPU copied through lanes' streams, process-wide: out of them into
/// receive buffers, and into them from send buffers. A payload written in place by a
/// NIC counts in neither, nor do bytes read and dropped (a duplicate, a probe's).
pub static STREAMED_IN: AtomicU64 = AtomicU64::new(0);
pub static STREAMED_OUT: AtomicU64 = AtomicU64::new(0);

/// Bytes moved per call before yielding to other lanes.
const BUDGET: usize = 8 << 20;
/// Staging buffer of an authenticated lane at most: holds many small frames per `read`.
const STAGING: usize = 256 << 10;
/// Staging buffer of an authenticated lane at first. It doubles, up to [`STAGING`], each
/// time a read fills it: a lane that carries little (most of thousands, or one of a
/// failover's new stripes) never zeroes and holds the full size.
const STAGING_FIRST: usize = 16 << 10;
/// Staging buffer before that: room for one handshake frame (header plus `MAX_BODY`).
const HANDSHAKE_STAGING: usize = 8 << 10;
/// Payload remainders at least this large bypass staging.
const DIRECT_MIN: usize = 16 << 10;

/// What the reader found.
#[derive(Debug, PartialEq, Eq)]
pub enum Inbound {
    /// A frame without payload, with its body (handshake frames) or none.
    Frame(Header, Vec<u8>),
    /// A `Data` header: call [`FrameReader::place`] before calling `next` again.
    /// `placed`: its payload was written in place by the sender's NIC, into a buffer
    /// this end offered on this lane ([`FrameWriter::offered`] tells whether it did),
    /// and none follows in the stream.
    Data { seq: u64, len: u64, placed: bool },
    /// The placed payload has fully arrived.
    PayloadDone { seq: u64, len: u64 },
    /// The peer closed the stream at a frame boundary.
    Eof,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
}

#[derive(Debug)]
enum State {
    Header,
    Body(Header),
    NeedPlacement {
        seq: u64,
        len: u64,
        /// The sender's NIC wrote the payload in place: none follows in the stream.
        placed: bool,
    },
    Payload {
        seq: u64,
        len: u64,
        off: u64,
        dst: Option<LentBuf>,
    },
}

/// Incremental frame parser for one lane. It starts with no buffer at all and a small
/// one once bytes arrive, so connections that never authenticate cost little memory;
/// [`FrameReader::enlarge`] gives an authenticated lane its full staging buffer.
#[derive(Debug)]
pub struct FrameReader {
    buf: Box<[u8]>,
    /// What `buf` grows to at the next read.
    size: usize,
    /// What `size` may grow to: [`HANDSHAKE_STAGING`], then [`STAGING`].
    most: usize,
    start: usize,
    end: usize,
    state: State,
    more: bool,
    total: u64,
    /// The last socket read during this service came back shorter than asked, from a
    /// socket whose short reads mean "empty" ([`FrameReader::next_stream`]): reading
    /// again before the next readiness edge would only return `WouldBlock`.
    drained: bool,
    /// Whether the current call reads a kernel stream socket (see `drained`).
    stream: bool,
}

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader {
            buf: Box::default(),
            size: HANDSHAKE_STAGING,
            most: HANDSHAKE_STAGING,
            start: 0,
            end: 0,
            state: State::Header,
            more: false,
            total: 0,
            drained: false,
            stream: false,
        }
    }
}

enum Fill {
    Got,
    WouldBlock,
    Eof,
}

impl FrameReader {
    /// The next inbound item, `Ok(None)` when the socket has nothing more for now (or the
    /// per-call budget is spent: see [`FrameReader::wants_more`]).
    pub fn next(&mut self, sock: &mut impl Read) -> Result<Option<Inbound>, ReadError> {
        self.stream = false;
        self.next_item(sock)
    }

    /// [`FrameReader::next`] from a kernel TCP socket that the caller watches
    /// edge-triggered: there a read shorter than asked took everything queued, and bytes
    /// that arrive later raise a new edge, so until the next service
    /// ([`FrameReader::forget_drained`]) the reader answers `Ok(None)` from what is staged
    /// instead of making the read that could only return `WouldBlock`: one system call
    /// less per wake-up. (A simulated or test socket may return short reads with more
    /// queued: it goes through `next`.)
    pub fn next_stream(&mut self, sock: &mut impl Read) -> Result<Option<Inbound>, ReadError> {
        self.stream = true;
        self.next_item(sock)
    }

    /// Starts a service of the lane (a readiness edge, or a retry): what an earlier read
    /// said about the socket no longer holds.
    pub fn forget_drained(&mut self) {
        self.drained = false;
    }

    fn next_item(&mut self, sock: &mut impl Read) -> Result<Option<Inbound>, ReadError> {
        let mut moved = 0usize;
        self.more = false;
        loop {
            let avail = self.end - self.start;
            match self.state {
                State::Header => {
                    if avail >= HEADER_LEN {
                        let h = Header::decode(&self.buf[self.start..])?;
                        self.start += HEADER_LEN;
                        if h.kind == Kind::Data {
                            self.state = State::NeedPlacement {
                                seq: h.seq,
                                len: h.len,
                                placed: h.placed(),
                            };
                            return Ok(Some(Inbound::Data {
                                seq: h.seq,
                                len: h.len,
                                placed: h.placed(),
                            }));
                        }
                        if h.body_len() == 0 {
                            return Ok(Some(Inbound::Frame(h, Vec::new())));
                        }
                        self.state = State::Body(h);
                        continue;
                    }
                }
                State::Body(h) => {
                    let n = h.body_len() as usize;
                    if avail >= n {
                        let body = self.buf[self.start..self.start + n].to_vec();
                        self.start += n;
                        self.state = State::Header;
                        return Ok(Some(Inbound::Frame(h, body)));
                    }
                }
                State::NeedPlacement { .. } => {
                    return Err(WireError::Malformed("payload read before placement").into())
                }
                State::Payload {
                    seq,
                    len,
                    ref mut off,
                    ref mut dst,
                } => {
                    if *off == len {
                        self.state = State::Header;
                        return Ok(Some(Inbound::PayloadDone { seq, len }));
                    }
                    let want = (len - *off) as usize;
                    if dst.as_ref().is_some_and(|d| !d.cpu_reachable()) {
                        // Only a NIC writes GPU memory: its sender should have waited
                        // for an offer and written it in place.
                        return Err(WireError::Malformed(
                            "a payload for GPU memory came through the stream",
                        )
                        .into());
                    }
                    if avail > 0 {
                        let n = avail.min(want);
                        if let Some(d) = dst {
                            d.slice_mut(*off as usize, n)
                                .copy_from_slice(&self.buf[self.start..self.start + n]);
                            STREAMED_IN.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        self.start += n;
                        *off += n as u64;
                        continue;
                    }
                    if moved >= BUDGET {
                        self.more = true;
                        return Ok(None);
                    }
                    if want >= DIRECT_MIN && !self.drained {
                        if let Some(d) = dst {
                            let ask = want.min(BUDGET);
                            match sock.read(d.slice_mut(*off as usize, ask)) {
                                Ok(0) => return Err(eof_mid_frame()),
                                Ok(n) => {
                                    self.drained = self.stream && n < ask;
                                    *off += n as u64;
                                    STREAMED_IN.fetch_add(n as u64, Ordering::Relaxed);
                                    moved += n;
                                    self.total += n as u64;
                                    continue;
                                }
                                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                                Err(e) => return Err(e.into()),
                            }
                        }
                    }
                }
            }
            // Not enough staged bytes for the current state: read more.
            if moved >= BUDGET {
                self.more = true;
                return Ok(None);
            }
            if self.drained {
                // Read empty in this service already: the next edge brings more.
                return Ok(None);
            }
            match self.fill(sock)? {
                Fill::Got => moved += 1,
                Fill::WouldBlock => return Ok(None),
                Fill::Eof => {
                    return if matches!(self.state, State::Header) && self.start == self.end {
                        Ok(Some(Inbound::Eof))
                    } else {
                        Err(eof_mid_frame())
                    }
                }
            }
        }
    }

    /// Where the payload announced by the last [`Inbound::Data`] goes: `Some(buf)` (at
    /// least `len` bytes) or `None` to read and drop it. A payload written in place is
    /// already in the buffer the receiver advertised for `seq`, which is `buf`: the next
    /// call reports it done.
    pub fn place(&mut self, dst: Option<LentBuf>) {
        if let State::NeedPlacement { seq, len, placed } = self.state {
            self.state = State::Payload {
                seq,
                len,
                off: if placed { len } else { 0 },
                dst,
            };
        }
    }

    /// The rest of the payload being read is dropped instead of placed: another lane
    /// completed the same message and its buffer is no longer ours to write.
    pub fn discard_rest(&mut self) {
        if let State::Payload { ref mut dst, .. } = self.state {
            *dst = None;
        }
    }

    /// The last `next` stopped on its budget, not on `WouldBlock`: call it again soon.
    pub fn wants_more(&self) -> bool {
        self.more
    }

    /// The lane is authenticated: its staging buffer may grow to the full size, as reads
    /// fill it.
    pub fn enlarge(&mut self) {
        self.size = self.size.max(STAGING_FIRST);
        self.most = STAGING;
    }

    /// Bytes of staging buffer held now.
    pub fn staging_capacity(&self) -> usize {
        self.buf.len()
    }

    /// Bytes read from the socket so far: byte-level progress, even inside a payload.
    pub fn total_read(&self) -> u64 {
        self.total
    }

    fn fill(&mut self, sock: &mut impl Read) -> io::Result<Fill> {
        if self.buf.len() < self.size {
            let mut grown = vec![0; self.size].into_boxed_slice();
            let n = self.end - self.start;
            grown[..n].copy_from_slice(&self.buf[self.start..self.end]);
            self.buf = grown;
            self.start = 0;
            self.end = n;
        } else if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            return match sock.read(&mut self.buf[self.end..]) {
                Ok(0) => Ok(Fill::Eof),
                Ok(n) => {
                    self.end += n;
                    self.total += n as u64;
                    self.drained = self.stream && self.end < self.buf.len();
                    if self.end == self.buf.len() {
                        // The socket may hold more than fits: stage more next time.
                        self.size = (self.buf.len() * 2).min(self.most);
                    }
                    Ok(Fill::Got)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if self.start == self.end && self.most < STAGING {
                        // Not authenticated and nothing staged: hold no buffer while idle.
                        self.buf = Box::default();
                        (self.start, self.end) = (0, 0);
                    }
                    Ok(Fill::WouldBlock)
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }
}

fn eof_mid_frame() -> ReadError {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "connection closed in the middle of a frame",
    )
    .into()
}

#[derive(Debug)]
enum Chunk {
    Ctrl {
        bytes: Vec<u8>,
        off: usize,
    },
    Payload {
        buf: LentBuf,
        off: usize,
        end: usize,
    },
    /// A `Data` frame the lane may write in place as `place` allows: decided when it
    /// reaches the front.
    Data {
        seq: u64,
        len: u64,
        buf: LentBuf,
        place: Placing,
    },
    /// A receive the lane may offer to have written in place, sent before its `Cts`.
    Advertise {
        seq: u64,
        capacity: u64,
        buf: LentBuf,
        gen: u64,
    },
}

impl Chunk {
    /// Whether the writer must settle the chunk before any byte of it goes out.
    fn unsettled(&self) -> bool {
        matches!(self, Chunk::Data { .. } | Chunk::Advertise { .. })
    }
}

/// How a message may be written in place ([`FrameWriter::push_data`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placing {
    /// The least generation of an offer it may use: 0 for a first transmission; a
    /// message sent again needs an offer the receiver made after it fenced the lane the
    /// message was lost with, since before that the dead lane could still complete it.
    pub min_gen: u64,
    /// The receive buffer is GPU memory (its `Cts` said so): the payload must be written
    /// in place, whatever its size, waiting for the offer if need be.
    pub must: bool,
}

/// A lane that can move a payload in place (the verbs fabric: its NIC writes the send
/// buffer straight into the receive buffer). [`FrameWriter::flush_placing`] asks it
/// about each receive it announces and each message it sends, in stream order, just
/// before the frame's first byte is written, so whatever it posts is ordered before the
/// frame. A plain stream places nothing: the defaults.
pub trait Placer: Write {
    /// A `Place` frame offering receive `seq` (`capacity` bytes of `buf`) to the peer,
    /// written just before its `Cts`, stamped with the receiver's generation `gen` (the
    /// lanes it had fenced when it decided the offer); `None` when the peer must send it
    /// in the stream; an error when the buffer must be written in place (GPU memory) and
    /// the lane cannot offer it.
    fn advertise(
        &mut self,
        seq: u64,
        buf: &LentBuf,
        capacity: u64,
        gen: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        let _ = (seq, buf, capacity, gen);
        Ok(None)
    }

    /// Writes message `seq`'s `len` bytes from `buf` straight into the buffer the peer
    /// offered for it, as `place` allows. `Ok(true)`: posted, the header goes out flagged
    /// [`DATA_PLACED`] with no payload behind it; `Ok(false)`: send it in the stream;
    /// `WouldBlock`: ask again later (a payload that must be placed waits for the offer).
    fn direct(&mut self, seq: u64, buf: &LentBuf, len: u64, place: Placing) -> io::Result<bool> {
        let _ = (seq, buf, len, place);
        Ok(false)
    }
}

/// A plain stream as a [`Placer`] that places nothing.
struct Plain<'a, W>(&'a mut W);

impl<W: Write> Write for Plain<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl<W: Write> Placer for Plain<'_, W> {}

/// Outgoing queue of one lane.
#[derive(Debug, Default)]
pub struct FrameWriter {
    q: VecDeque<Chunk>,
    more: bool,
    total: u64,
    /// Bytes ever queued; less `total`, what is still queued.
    pushed: u64,
    /// Receives this lane offered to have written in place (a `Place` went out), the
    /// newest [`MAX_OFFERS`]: only those may come back as a placed `Data`.
    offered: BTreeSet<u64>,
}

const MAX_IOV: usize = 64;

impl FrameWriter {
    /// Queues control bytes (headers, handshake frames); coalesces with queued control bytes.
    pub fn push_ctrl(&mut self, bytes: &[u8]) {
        self.pushed += bytes.len() as u64;
        if let Some(Chunk::Ctrl { bytes: last, .. }) = self.q.back_mut() {
            last.extend_from_slice(bytes);
        } else {
            self.q.push_back(Chunk::Ctrl {
                bytes: bytes.to_vec(),
                off: 0,
            });
        }
    }

    /// Queues message `seq`: its `Data` header and the first `len` bytes of `buf`. With
    /// `place: Some(..)`, a [`Placer`] lane may write the payload in place instead, as
    /// [`Placing`] allows.
    pub fn push_data(&mut self, seq: u64, len: u64, buf: LentBuf, place: Option<Placing>) {
        let len = len.min(buf.len() as u64);
        let Some(place) = place.filter(|_| len > 0) else {
            self.push_ctrl(&Header::new(Kind::Data, seq, len).encode());
            self.push_payload(buf, len as usize);
            return;
        };
        self.pushed += HEADER_LEN as u64 + len;
        self.q.push_back(Chunk::Data {
            seq,
            len,
            buf,
            place,
        });
    }

    /// Offers receive `seq` (`capacity` bytes of `buf`) to be written in place, when the
    /// lane can, stamped with generation `gen`; written before the `Cts` that follows.
    pub fn push_advertise(&mut self, seq: u64, capacity: u64, buf: LentBuf, gen: u64) {
        self.q.push_back(Chunk::Advertise {
            seq,
            capacity,
            buf,
            gen,
        });
    }

    /// Forgets the queued offers: for a lane about to go, whose last words must not wait
    /// behind offers it can no longer make (no byte of an offer is out before it is
    /// settled, so the stream stays whole).
    pub fn drop_offers(&mut self) {
        self.q.retain(|c| !matches!(c, Chunk::Advertise { .. }));
    }

    /// Queues the first `len` bytes of `buf`.
    pub fn push_payload(&mut self, buf: LentBuf, len: usize) {
        if len > 0 {
            let end = len.min(buf.len());
            self.pushed += end as u64;
            self.q.push_back(Chunk::Payload { buf, off: 0, end });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// Whether this lane offered receive `seq` to be written in place: a `Data` flagged
    /// placed for anything else is a lie (on a lane that cannot place, such as TCP, it
    /// always is), and would complete a receive with bytes that never arrived.
    pub fn offered(&self, seq: u64) -> bool {
        self.offered.contains(&seq)
    }

    /// Whether any queued bytes still come from a caller's buffer.
    pub fn holds_payload(&self) -> bool {
        (self.q.iter()).any(|c| matches!(c, Chunk::Payload { .. } | Chunk::Data { .. }))
    }

    /// The last `flush` stopped on its budget: call it again soon.
    pub fn wants_more(&self) -> bool {
        self.more
    }

    /// Bytes handed to the socket so far.
    pub fn total_written(&self) -> u64 {
        self.total
    }

    /// Bytes queued and not yet handed to the socket.
    pub fn queued_bytes(&self) -> u64 {
        self.pushed - self.total
    }

    /// Writes until the queue is empty, the socket would block, or the budget is spent.
    pub fn flush(&mut self, sock: &mut impl Write) -> io::Result<()> {
        self.flush_placing(&mut Plain(sock))
    }

    /// [`FrameWriter::flush`] to a lane that may move payloads in place.
    pub fn flush_placing(&mut self, sock: &mut impl Placer) -> io::Result<()> {
        let mut moved = 0usize;
        self.more = false;
        while !self.q.is_empty() {
            if moved >= BUDGET {
                self.more = true;
                return Ok(());
            }
            if self.q.front().is_some_and(Chunk::unsettled) {
                match self.settle(sock) {
                    Ok(()) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            let iov: Vec<IoSlice<'_>> = self
                .q
                .iter()
                .take(MAX_IOV)
                .take_while(|c| !c.unsettled())
                .map(|c| match c {
                    Chunk::Ctrl { bytes, off } => IoSlice::new(&bytes[*off..]),
                    Chunk::Payload { buf, off, end } => IoSlice::new(buf.slice(*off, end - off)),
                    Chunk::Data { .. } | Chunk::Advertise { .. } => {
                        unreachable!("taken while settled")
                    }
                })
                .collect();
            let n = match sock.write_vectored(&iov) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            moved += n;
            self.total += n as u64;
            self.advance(n);
        }
        Ok(())
    }

    /// Settles the front chunk with the lane: a `Data` becomes its header (flagged placed,
    /// or followed by its payload), an offer becomes a `Place` frame or nothing.
    fn settle(&mut self, sock: &mut impl Placer) -> io::Result<()> {
        match self.q.front() {
            Some(Chunk::Data {
                seq,
                len,
                buf,
                place,
            }) => {
                let (seq, len) = (*seq, *len);
                let placed = sock.direct(seq, buf, len, *place)?;
                let Some(Chunk::Data { buf, .. }) = self.q.pop_front() else {
                    unreachable!("the front was a Data");
                };
                let mut h = Header::new(Kind::Data, seq, len);
                if placed {
                    h.aux |= DATA_PLACED;
                    self.pushed -= len;
                } else if !buf.cpu_reachable() {
                    // The lane fails; the comm sends the message again on another.
                    return Err(io::Error::other(format!(
                        "message {seq} is in GPU memory, which only a NIC can send, and this lane cannot write it in place"
                    )));
                } else {
                    let end = len as usize;
                    self.q.push_front(Chunk::Payload { buf, off: 0, end });
                }
                let bytes = h.encode().to_vec();
                self.q.push_front(Chunk::Ctrl { bytes, off: 0 });
            }
            Some(Chunk::Advertise { .. }) => {
                let Some(Chunk::Advertise {
                    seq,
                    capacity,
                    buf,
                    gen,
                }) = self.q.pop_front()
                else {
                    unreachable!("the front was an offer");
                };
                // Gone from the queue even when it fails: what follows may still go out.
                let frame = sock.advertise(seq, &buf, capacity, gen)?;
                if let Some(bytes) = frame {
                    self.pushed += bytes.len() as u64;
                    self.q.push_front(Chunk::Ctrl { bytes, off: 0 });
                    self.offered.insert(seq);
                    if self.offered.len() > MAX_OFFERS {
                        self.offered.pop_first();
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let front = self.q.front_mut().expect("wrote more than was queued");
            let (off, left) = match front {
                Chunk::Ctrl { bytes, off } => {
                    let left = bytes.len() - *off;
                    (off, left)
                }
                Chunk::Payload { off, end, .. } => {
                    let left = *end - *off;
                    STREAMED_OUT.fetch_add(n.min(left) as u64, Ordering::Relaxed);
                    (off, left)
                }
                Chunk::Data { .. } | Chunk::Advertise { .. } => {
                    unreachable!("only settled chunks are written")
                }
            };
            if n >= left {
                n -= left;
                self.q.pop_front();
            } else {
                *off += n;
                n = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::wire::Header;

    /// A socket stand-in that hands out at most `chunk` bytes per call and then
    /// `WouldBlock` every other call, to exercise every resume point.
    struct Trickle {
        data: Vec<u8>,
        pos: usize,
        chunk: usize,
        block_next: bool,
    }

    impl Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            if std::mem::take(&mut self.block_next) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.block_next = true;
            if self.pos == self.data.len() {
                return Ok(0);
            }
            let n = out.len().min(self.chunk).min(self.data.len() - self.pos);
            out[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    /// A copy of `v` that outlives every view of it (leaked).
    fn heap_buf(v: &[u8]) -> crate::transport::memory::UserBuf {
        crate::transport::memory::UserBuf::of_slice(Vec::leak(v.to_vec()))
    }

    #[test]
    fn a_lane_that_cannot_place_offers_nothing() {
        let mut w = FrameWriter::default();
        let buf = heap_buf(&[0u8; 64]);
        w.push_advertise(3, 64, buf.lend(), 0);
        w.push_ctrl(&Header::new(Kind::Cts, 3, 64).encode());
        let mut out = Vec::new();
        w.flush(&mut out).unwrap();
        assert_eq!(out.len(), HEADER_LEN, "the Cts alone");
        assert!(!w.offered(3), "a plain stream never offered receive 3");
    }

    #[test]
    fn staging_grows_while_reads_fill_it_and_a_lane_that_reads_little_stays_small() {
        let acks = |n: u64| {
            let mut wire = Vec::new();
            for seq in 0..n {
                wire.extend_from_slice(&Header::new(Kind::Ack, seq, 0).encode());
            }
            wire
        };
        let drain = |r: &mut FrameReader, sock: &mut Trickle| {
            let mut seen = 0;
            for _ in 0..1000 {
                while let Some(item) = r.next(sock).unwrap() {
                    match item {
                        Inbound::Frame(h, _) => {
                            assert_eq!(h.seq, seen);
                            seen += 1;
                        }
                        Inbound::Eof => return seen,
                        other => panic!("{other:?}"),
                    }
                }
            }
            seen
        };
        // A few frames at a time: the first authenticated size is enough.
        let mut sock = Trickle {
            data: acks(64),
            pos: 0,
            chunk: 4 * HEADER_LEN,
            block_next: false,
        };
        let mut r = FrameReader::default();
        r.enlarge();
        assert_eq!(drain(&mut r, &mut sock), 64);
        assert_eq!(r.staging_capacity(), STAGING_FIRST);
        // A flood: every read fills the buffer, which doubles up to the full size.
        let n = (4 * STAGING / HEADER_LEN) as u64;
        let mut sock = Trickle {
            data: acks(n),
            pos: 0,
            chunk: 1 << 30,
            block_next: false,
        };
        let mut r = FrameReader::default();
        r.enlarge();
        assert_eq!(
            drain(&mut r, &mut sock),
            n,
            "no frame is lost across growing"
        );
        assert_eq!(r.staging_capacity(), STAGING);
    }

    #[test]
    fn no_staging_buffer_until_bytes_arrive_and_full_size_only_when_enlarged() {
        let mut wire = Vec::new();
        for seq in 0..400 {
            wire.extend_from_slice(&Header::new(Kind::Ack, seq, 0).encode());
        }
        let mut sock = Trickle {
            data: wire,
            pos: 0,
            chunk: 1 << 20,
            block_next: true,
        };
        let mut r = FrameReader::default();
        assert_eq!(r.next(&mut sock).unwrap(), None);
        assert_eq!(
            r.staging_capacity(),
            0,
            "an idle connection holds no buffer"
        );
        let mut seen = 0;
        // 400 frames do not fit the small buffer: some stay unread until it grows.
        while let Some(Inbound::Frame(h, _)) = r.next(&mut sock).unwrap() {
            assert_eq!(h.seq, seen);
            seen += 1;
        }
        assert_eq!(r.staging_capacity(), HANDSHAKE_STAGING);
        assert_eq!(seen as usize, HANDSHAKE_STAGING / HEADER_LEN);
        r.enlarge();
        for _ in 0..10 {
            while let Some(item) = r.next(&mut sock).unwrap() {
                match item {
                    Inbound::Frame(h, _) => {
                        assert_eq!(h.seq, seen, "bytes staged before growing survive it");
                        seen += 1;
                    }
                    Inbound::Eof => break,
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(seen, 400);
        assert_eq!(r.staging_capacity(), STAGING_FIRST);
    }

    /// A kernel stream socket's queue: reads take what is queued (short when the queue
    /// is), `WouldBlock` when it is empty, counted.
    #[derive(Default)]
    struct Queue {
        q: Vec<u8>,
        reads: usize,
        blocked: usize,
    }

    impl Read for Queue {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.reads += 1;
            if self.q.is_empty() {
                self.blocked += 1;
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = out.len().min(self.q.len());
            out[..n].copy_from_slice(&self.q[..n]);
            self.q.drain(..n);
            Ok(n)
        }
    }

    /// One service of a lane, as the engine's `read_lane` runs it: items until `Ok(None)`.
    fn service(
        r: &mut FrameReader,
        sock: &mut Queue,
        dst: &crate::transport::memory::UserBuf,
    ) -> Vec<String> {
        r.forget_drained();
        let mut got = Vec::new();
        while let Some(item) = r.next_stream(sock).unwrap() {
            if let Inbound::Data { .. } = item {
                r.place(Some(dst.lend()));
            }
            got.push(format!("{item:?}"));
        }
        got
    }

    #[test]
    fn a_short_stream_read_means_empty_until_the_next_service() {
        let frame = |seq| Header::new(Kind::Ack, seq, 0).encode();
        let dst = heap_buf(&[0u8; 8]);
        let mut sock = Queue::default();
        sock.q.extend_from_slice(&frame(1));
        sock.q.extend_from_slice(&frame(2));
        let mut r = FrameReader::default();
        assert_eq!(service(&mut r, &mut sock, &dst).len(), 2);
        assert_eq!(
            (sock.reads, sock.blocked),
            (1, 0),
            "one read, none to hear WouldBlock"
        );

        // A new edge: what arrived is read, in pieces across edges too.
        sock.q.extend_from_slice(&frame(3));
        assert_eq!(service(&mut r, &mut sock, &dst).len(), 1);
        sock.q.extend_from_slice(&frame(4)[..10]);
        assert!(service(&mut r, &mut sock, &dst).is_empty(), "half a header");
        sock.q.extend_from_slice(&frame(4)[10..]);
        let got = service(&mut r, &mut sock, &dst);
        assert!(got.len() == 1 && got[0].contains("seq: 4"), "{got:?}");
        assert_eq!(sock.blocked, 0);

        // A socket whose short reads say nothing (`next`) is read until WouldBlock.
        sock.q.extend_from_slice(&frame(5));
        r.forget_drained();
        assert!(matches!(r.next(&mut sock), Ok(Some(Inbound::Frame(..)))));
        assert!(matches!(r.next(&mut sock), Ok(None)));
        assert_eq!(sock.blocked, 1);
    }

    #[test]
    fn a_payload_read_straight_into_its_buffer_stops_at_a_short_read() {
        let payload: Vec<u8> = (0..4 * DIRECT_MIN as u32)
            .map(|i| (i % 249) as u8)
            .collect();
        let dst = heap_buf(&vec![0u8; payload.len()]);
        let mut sock = Queue::default();
        sock.q
            .extend_from_slice(&Header::new(Kind::Data, 9, payload.len() as u64).encode());
        let mut r = FrameReader::default();
        r.enlarge();
        let cuts = [0, 100, DIRECT_MIN + 3, 3 * DIRECT_MIN, payload.len()];
        let mut got = Vec::new();
        for w in cuts.windows(2) {
            sock.q.extend_from_slice(&payload[w[0]..w[1]]);
            if w[1] == payload.len() {
                // A read that gets all it asked for cannot tell whether more is queued:
                // the frame behind the payload makes the last read a short one.
                sock.q
                    .extend_from_slice(&Header::new(Kind::Ack, 10, 0).encode());
            }
            got.extend(service(&mut r, &mut sock, &dst));
            assert!(sock.q.is_empty(), "every service took all that was queued");
        }
        assert_eq!(sock.blocked, 0, "no read only to hear WouldBlock");
        assert!(
            got.iter().any(|g| g.starts_with("PayloadDone { seq: 9")),
            "{got:?}"
        );
        assert_eq!(dst.lend().slice(0, dst.len()), payload);
    }

    #[test]
    fn reads_frames_and_places_payloads_across_partial_reads() {
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut wire = Vec::new();
        wire.extend_from_slice(&Header::new(Kind::Cts, 3, 9).encode());
        wire.extend_from_slice(&Header::new(Kind::Data, 4, payload.len() as u64).encode());
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(&Header::new(Kind::Data, 5, 0).encode());
        wire.extend_from_slice(&Header::new(Kind::Ack, 6, 0).encode());
        for chunk in [1, 7, 23, 4096, 1 << 20] {
            let mut sock = Trickle {
                data: wire.clone(),
                pos: 0,
                chunk,
                block_next: false,
            };
            let mut r = FrameReader::default();
            let dst = heap_buf(&vec![0u8; payload.len()]);
            let mut got = Vec::new();
            for _ in 0..1_000_000 {
                match r.next(&mut sock).unwrap() {
                    None => continue,
                    Some(Inbound::Data { seq, len, .. }) => {
                        got.push(format!("data {seq} {len}"));
                        r.place(Some(dst.lend()));
                    }
                    Some(Inbound::Eof) => break,
                    Some(other) => got.push(format!("{other:?}")),
                }
            }
            assert_eq!(dst.lend().slice(0, dst.len()), payload, "chunk {chunk}");
            assert_eq!(got.len(), 6, "chunk {chunk}: {got:?}");
            assert!(got[2].starts_with("PayloadDone { seq: 4"), "{got:?}");
            assert!(
                got[4].starts_with("PayloadDone { seq: 5, len: 0"),
                "{got:?}"
            );
        }
    }

    #[test]
    fn a_payload_told_to_discard_midway_writes_nothing_more() {
        let payload = vec![0xabu8; 100_000];
        let mut wire = Header::new(Kind::Data, 1, payload.len() as u64)
            .encode()
            .to_vec();
        wire.extend_from_slice(&payload);
        let mut sock = Trickle {
            data: wire,
            pos: 0,
            chunk: 30_000,
            block_next: false,
        };
        let mut r = FrameReader::default();
        r.enlarge();
        let dst = heap_buf(&vec![0u8; payload.len()]);
        let mut done = None;
        for _ in 0..1000 {
            match r.next(&mut sock).unwrap() {
                Some(Inbound::Data { .. }) => r.place(Some(dst.lend())),
                // After the first read into the buffer, the message completes elsewhere.
                None if sock.pos > 0 => r.discard_rest(),
                None => {}
                Some(Inbound::PayloadDone { seq, len }) => {
                    done = Some((seq, len));
                    break;
                }
                Some(other) => panic!("{other:?}"),
            }
        }
        assert_eq!(
            done,
            Some((1, 100_000)),
            "the payload is still consumed in full"
        );
        let written = dst
            .lend()
            .slice(0, dst.len())
            .iter()
            .filter(|&&b| b == 0xab)
            .count();
        assert!(
            written > 0 && written < payload.len(),
            "{written} bytes written"
        );
    }

    #[test]
    fn garbage_is_a_wire_error_and_eof_mid_frame_an_io_error() {
        let mut sock = Trickle {
            data: b"GET / HTTP/1.1\r\nHost: railover\r\n\r\n".to_vec(),
            pos: 0,
            chunk: 64,
            block_next: false,
        };
        let mut r = FrameReader::default();
        let err = loop {
            match r.next(&mut sock) {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, ReadError::Wire(WireError::BadMagic(_))));

        let mut half = Header::new(Kind::Data, 0, 10).encode().to_vec();
        half.extend_from_slice(&[1, 2, 3]);
        let mut sock = Trickle {
            data: half,
            pos: 0,
            chunk: 64,
            block_next: false,
        };
        let mut r = FrameReader::default();
        let err = loop {
            match r.next(&mut sock) {
                Ok(Some(Inbound::Data { .. })) => r.place(None),
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, ReadError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof));
    }

    /// A sink that accepts at most `chunk` bytes per call.
    struct Sink {
        out: Vec<u8>,
        chunk: usize,
        calls: usize,
    }

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.write_vectored(&[IoSlice::new(b)])
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls % 2 == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.chunk - n);
                self.out.extend_from_slice(&b[..take]);
                n += take;
                if n == self.chunk {
                    break;
                }
            }
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A lane that writes even-numbered messages in place (into `placed`), offers
    /// even-numbered receives, and is busy at the first placement it is asked for.
    struct InPlace {
        sink: Sink,
        placed: Vec<(u64, Vec<u8>)>,
        asked: usize,
    }

    impl Write for InPlace {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.sink.write(b)
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.sink.write_vectored(bufs)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Placer for InPlace {
        fn advertise(
            &mut self,
            seq: u64,
            _: &LentBuf,
            capacity: u64,
            _: u64,
        ) -> io::Result<Option<Vec<u8>>> {
            Ok((seq % 2 == 0)
                .then(|| Header::new(Kind::Place, seq, capacity).encode().to_vec())
                .map(|mut f| {
                    f.extend_from_slice(&[0; 16]);
                    f
                }))
        }
        fn direct(&mut self, seq: u64, buf: &LentBuf, len: u64, _: Placing) -> io::Result<bool> {
            self.asked += 1;
            if self.asked == 1 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            if seq % 2 == 1 {
                return Ok(false);
            }
            self.placed.push((seq, buf.slice(0, len as usize).to_vec()));
            Ok(true)
        }
    }

    #[test]
    fn a_placing_lane_writes_headers_flagged_and_payloads_around_the_stream() {
        let payload: Vec<u8> = (0..30_000u32).map(|i| (i % 253) as u8).collect();
        let src = heap_buf(&payload);
        for chunk in [1, 29, 1 << 20] {
            let mut w = FrameWriter::default();
            for seq in 0..4 {
                w.push_advertise(seq, 1000, src.lend(), 0);
                w.push_ctrl(&Header::new(Kind::Cts, seq, 1000).encode());
            }
            for seq in 0..4 {
                w.push_data(seq, 1000 * (seq + 1), src.lend(), Some(Placing::default()));
            }
            w.push_data(4, 500, src.lend(), None);
            let mut lane = InPlace {
                sink: Sink {
                    out: Vec::new(),
                    chunk,
                    calls: 0,
                },
                placed: Vec::new(),
                asked: 0,
            };
            for _ in 0..100_000 {
                if w.is_empty() {
                    break;
                }
                w.flush_placing(&mut lane).unwrap();
            }
            assert!(w.is_empty() && w.queued_bytes() == 0, "chunk {chunk}");
            assert_eq!(
                lane.placed,
                vec![(0, payload[..1000].to_vec()), (2, payload[..3000].to_vec())]
            );
            // Only the receives a `Place` went out for may come back placed.
            assert_eq!(
                (0..5).map(|s| w.offered(s)).collect::<Vec<_>>(),
                [true, false, true, false, false]
            );
            // The receiving end: offers before their CTS, placed headers with no payload.
            let mut sock = Trickle {
                data: lane.sink.out,
                pos: 0,
                chunk: 1 << 20,
                block_next: false,
            };
            let mut r = FrameReader::default();
            r.enlarge();
            let mut seen = Vec::new();
            for _ in 0..1000 {
                match r.next(&mut sock).unwrap() {
                    Some(Inbound::Frame(h, body)) => seen.push((h.kind, h.seq, body.len())),
                    Some(Inbound::Data { seq, len, placed }) => {
                        assert_eq!(placed, seq % 2 == 0 && seq < 4, "seq {seq}'s flag");
                        let dst = heap_buf(&vec![0; len as usize]);
                        r.place(Some(dst.lend()));
                        let Some(Inbound::PayloadDone { seq: s, len: n }) =
                            r.next(&mut sock).unwrap()
                        else {
                            panic!("no payload end for {seq}");
                        };
                        assert_eq!((s, n), (seq, len));
                        let got = dst.lend().slice(0, len as usize).to_vec();
                        let placed = seq % 2 == 0 && seq < 4;
                        let want = if placed {
                            vec![0; len as usize]
                        } else {
                            payload[..len as usize].to_vec()
                        };
                        assert_eq!(
                            got, want,
                            "seq {seq}: a placed payload is not in the stream"
                        );
                        seen.push((Kind::Data, seq, len as usize));
                    }
                    Some(Inbound::Eof) | None => break,
                    Some(other) => panic!("{other:?}"),
                }
            }
            let kinds: Vec<(Kind, u64)> = seen.iter().map(|&(k, s, _)| (k, s)).collect();
            assert_eq!(
                kinds,
                [
                    (Kind::Place, 0),
                    (Kind::Cts, 0),
                    (Kind::Cts, 1),
                    (Kind::Place, 2),
                    (Kind::Cts, 2),
                    (Kind::Cts, 3),
                    (Kind::Data, 0),
                    (Kind::Data, 1),
                    (Kind::Data, 2),
                    (Kind::Data, 3),
                    (Kind::Data, 4)
                ]
            );
        }
    }

    #[test]
    fn writer_resumes_exactly_where_the_socket_stopped() {
        let payload: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let expected: Vec<u8> = [&b"head"[..], &payload, &b"tail"[..]].concat();
        for chunk in [1, 5, 999, 1 << 20] {
            let mut w = FrameWriter::default();
            w.push_ctrl(b"he");
            w.push_ctrl(b"ad");
            let src = heap_buf(&payload);
            w.push_payload(src.lend(), 50_000);
            w.push_payload(src.lend(), 0);
            w.push_ctrl(b"tail");
            let mut sink = Sink {
                out: Vec::new(),
                chunk,
                calls: 0,
            };
            assert_eq!(w.queued_bytes(), expected.len() as u64);
            for _ in 0..1_000_000 {
                if w.is_empty() {
                    break;
                }
                w.flush(&mut sink).unwrap();
                assert_eq!(
                    w.queued_bytes(),
                    (expected.len() - sink.out.len()) as u64,
                    "what is still queued, chunk {chunk}"
                );
            }
            assert!(w.is_empty());
            assert_eq!(w.queued_bytes(), 0);
            assert_eq!(sink.out, expected, "chunk {chunk}");
        }
    }
}

#[cfg(test)]
mod gpu_memory {
    //! GPU memory is the NIC's alone: neither end copies it through the stream.
    use super::*;
    use crate::conn::wire::Header;
    use crate::transport::memory::{Memory, Region, UserBuf};

    /// `v` as if NCCL had registered it as GPU memory (the CPU touching it is the bug).
    fn gpu_buf(v: &[u8]) -> UserBuf {
        let s = Vec::leak(v.to_vec());
        let region = std::sync::Arc::new(Region::of(s.as_ptr() as usize, s.len(), Memory::Gpu));
        let mut b = UserBuf::of_slice(s);
        b.attach(region);
        b
    }

    #[test]
    fn a_sender_never_streams_gpu_memory() {
        let src = gpu_buf(&[7u8; 5000]);
        let mut w = FrameWriter::default();
        w.push_data(1, 5000, src.lend(), Some(Placing::default()));
        let mut out = Vec::new();
        let e = w.flush(&mut out).unwrap_err();
        assert!(e.to_string().contains("GPU memory"), "{e}");
        assert!(out.is_empty(), "not a byte went out");
    }

    #[test]
    fn a_receiver_refuses_a_streamed_payload_for_gpu_memory() {
        let mut wire = Header::new(Kind::Data, 4, 16).encode().to_vec();
        wire.extend_from_slice(&[9u8; 16]);
        let mut sock = io::Cursor::new(wire);
        let mut r = FrameReader::default();
        assert!(matches!(
            r.next(&mut sock).unwrap(),
            Some(Inbound::Data {
                seq: 4,
                len: 16,
                placed: false
            })
        ));
        let dst = gpu_buf(&[0u8; 16]);
        r.place(Some(dst.lend()));
        let e = r.next(&mut sock).unwrap_err();
        assert!(e.to_string().contains("GPU memory"), "{e}");
    }

    #[test]
    fn a_payload_placed_in_gpu_memory_completes_untouched() {
        let mut wire = Header::new(Kind::Data, 4, 16).encode().to_vec();
        wire[4] |= crate::conn::wire::DATA_PLACED as u8;
        let mut sock = io::Cursor::new(wire);
        let mut r = FrameReader::default();
        assert!(matches!(
            r.next(&mut sock).unwrap(),
            Some(Inbound::Data {
                seq: 4,
                len: 16,
                placed: true
            })
        ));
        r.place(Some(gpu_buf(&[0u8; 16]).lend()));
        assert!(matches!(
            r.next(&mut sock).unwrap(),
            Some(Inbound::PayloadDone { seq: 4, len: 16 })
        ));
    }
}
