//! One verbs lane: an RC QP carrying the lane's byte stream through a ring of registered
//! memory at each end, with a TCP connection beside it for the QP handshake and for
//! noticing that the peer closed.
//!
//! The sender copies bytes into its staging region at the ring offset they will occupy
//! at the peer and RDMA-WRITEs them there with an immediate holding the length; the
//! receiver's completion says that many more bytes are in its ring. The receiver returns
//! credit (bytes it consumed) with zero-byte WRITE_WITH_IMMs whose immediate has the top
//! bit set, so the sender never overwrites unread bytes. Every WRITE_WITH_IMM consumes a
//! posted receive, which the receiver reposts as it reaps them.
//!
//! This is the byte-stream shape the [`Fabric`](super::super::Fabric) trait asks for; it
//! costs a copy at each end. NCCL's IB transport instead writes straight into the
//! receive buffer the receiver advertised (a clear-to-send FIFO), which needs the trait to
//! carry receive buffers and their keys to the fabric.

use std::io::{self, IoSlice, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::VerbsNic;
use super::sys::{
    event, wc, CompChannel, Completion, Context, Cq, LocalPort, Mr, Pd, Qp, RemoteQp,
    Write as RdmaWrite, LINK_LAYER_ETHERNET, QPF_GRH_REQUIRED,
};
use super::{completion_error, QP_TIMING};

/// Bytes of each end's ring (and of the sender's staging region).
pub const RING: usize = 4 << 20;
const MAX_SEND: u32 = 256;
const MAX_RECV: u32 = 512;
/// Send slots data may use; the rest are kept for credit returns.
const DATA_SLOTS: u32 = MAX_SEND - 4;
const CREDIT_FLAG: u32 = 1 << 31;
const WR_CREDIT: u64 = 1 << 63;
const WR_RECV: u64 = 1 << 62;
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

/// The local half of a QP's addressing, from discovery.
pub fn local_port(nic: &VerbsNic) -> LocalPort {
    LocalPort {
        port: nic.port,
        sgid_index: nic.gid_index.unwrap_or(0) as u8,
        traffic_class: 0,
        service_level: 0,
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

#[derive(Debug)]
enum Phase {
    /// Sending our hello, reading the peer's, then the one-byte "ready" both ways.
    Handshake {
        out: Vec<u8>,
        out_off: usize,
        got: Vec<u8>,
    },
    Ready,
}

/// A lane of the verbs fabric.
#[derive(Debug)]
pub struct VerbsLane {
    // Field order is drop order: the QP before the regions it reads and writes, and
    // before its CQ; the context (held by all of them) goes last.
    qp: Qp,
    send: Mr,
    recv: Mr,
    cq: Arc<Cq>,
    ctx: Arc<Context>,
    sock: mio::net::TcpStream,
    port: LocalPort,
    grh: bool,
    mine: QpHello,
    peer: Option<QpHello>,
    phase: Phase,
    /// Sender: bytes posted, bytes the peer acknowledged, bytes it freed.
    head: u64,
    acked: u64,
    credited: u64,
    outstanding: u32,
    /// Receiver: bytes arrived, read, and returned as credit.
    received: u64,
    consumed: u64,
    credit_sent: u64,
    peer_closed: bool,
    fenced: bool,
    error: Option<(io::ErrorKind, String)>,
    wcs: Vec<Completion>,
}

impl VerbsLane {
    /// A lane on `nic` over the (possibly still connecting) bootstrap socket: resources
    /// allocated, QP in INIT, our hello queued.
    pub fn new(nic: &VerbsNic, sock: mio::net::TcpStream) -> io::Result<VerbsLane> {
        let ctx = Context::open(&nic.device)?;
        let pd = Pd::new(&ctx)?;
        let ch = CompChannel::new(&ctx)?;
        ctx.async_fd()?;
        let cq = Cq::new(&ctx, &ch, (MAX_SEND + MAX_RECV + 16) as i32)?;
        let qp = Qp::new_rc(&pd, &cq, MAX_SEND, MAX_RECV)?;
        let send = Mr::new(&pd, RING)?;
        let recv = Mr::new(&pd, RING)?;
        qp.to_init(nic.port)?;
        let mut psn = [0u8; 4];
        getrandom::getrandom(&mut psn).map_err(|e| io::Error::other(e.to_string()))?;
        let mine = QpHello {
            qpn: qp.qp_num(),
            psn: u32::from_le_bytes(psn) & 0xff_ffff,
            lid: nic.attr.lid,
            mtu: nic.attr.active_mtu,
            gid: local_gid(nic),
            addr: recv.addr(),
            rkey: recv.rkey(),
            len: RING as u64,
        };
        Ok(VerbsLane {
            phase: Phase::Handshake {
                out: mine.encode().to_vec(),
                out_off: 0,
                got: Vec::with_capacity(QpHello::LEN + 1),
            },
            qp,
            send,
            recv,
            cq,
            ctx,
            sock,
            port: local_port(nic),
            grh: needs_grh(nic),
            mine,
            peer: None,
            head: 0,
            acked: 0,
            credited: 0,
            outstanding: 0,
            received: 0,
            consumed: 0,
            credit_sent: 0,
            peer_closed: false,
            fenced: false,
            error: None,
            wcs: Vec::with_capacity(64),
        })
    }

    pub fn is_ready(&self) -> bool {
        matches!(self.phase, Phase::Ready)
    }

    /// (bytes posted, bytes the peer acknowledged).
    pub fn progress(&self) -> (u64, u64) {
        (self.head, self.acked)
    }

    fn fail(&mut self, kind: io::ErrorKind, msg: String) -> io::Error {
        self.error.get_or_insert((kind, msg.clone()));
        io::Error::new(kind, msg)
    }

    fn check(&self) -> io::Result<()> {
        match &self.error {
            Some((k, m)) => Err(io::Error::new(*k, m.clone())),
            None => Ok(()),
        }
    }

    /// Everything the lane's fds may have signalled: handshake bytes, the peer closing,
    /// async events, completions; then credit owed to the peer.
    pub fn pump(&mut self) -> io::Result<()> {
        self.check()?;
        if !self.is_ready() {
            self.handshake()?;
            if !self.is_ready() {
                return Ok(());
            }
        } else {
            self.watch_socket()?;
        }
        self.async_events()?;
        self.reap()?;
        self.return_credit()
    }

    fn handshake(&mut self) -> io::Result<()> {
        let Phase::Handshake { out, out_off, got } = &mut self.phase else {
            return Ok(());
        };
        while *out_off < out.len() {
            match self.sock.write(&out[*out_off..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => *out_off += n,
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let want = QpHello::LEN + 1;
        while got.len() < want {
            let mut b = [0u8; QpHello::LEN + 1];
            let room = want - got.len();
            match self.sock.read(&mut b[..room]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed during the verbs handshake",
                    ))
                }
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.peer.is_none() && got.len() >= QpHello::LEN {
            let mut b = [0u8; QpHello::LEN];
            b.copy_from_slice(&got[..QpHello::LEN]);
            let peer = QpHello::decode(&b);
            if peer.len != RING as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the peer's ring is {} bytes, ours {RING}", peer.len),
                ));
            }
            self.qp.to_rtr(
                &self.port,
                &RemoteQp {
                    qp_num: peer.qpn,
                    psn: peer.psn,
                    lid: peer.lid,
                    gid: peer.gid,
                    global: self.grh,
                    mtu: self.mine.mtu.min(peer.mtu),
                },
            )?;
            self.qp.to_rts(self.mine.psn, QP_TIMING)?;
            for _ in 0..MAX_RECV {
                self.qp.post_recv(WR_RECV)?;
            }
            self.peer = Some(peer);
            // Receives are posted: the peer may write once it reads this.
            out.push(b'R');
            return self.handshake();
        }
        if got.len() == want && *out_off == out.len() {
            if got[QpHello::LEN] != b'R' {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bad ready byte in the verbs handshake",
                ));
            }
            self.phase = Phase::Ready;
        }
        Ok(())
    }

    /// After the handshake the socket carries nothing: EOF is the peer closing, a reset
    /// the peer fencing or dying.
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

    fn async_events(&mut self) -> io::Result<()> {
        while let Some(ev) = self.ctx.next_async_event() {
            let mine = match ev.kind {
                event::PORT_ERR => ev.port == Some(self.port.port),
                event::DEVICE_FATAL | event::CQ_ERR => true,
                event::QP_FATAL | event::QP_REQ_ERR | event::QP_ACCESS_ERR => {
                    ev.qp_num == Some(self.qp.qp_num())
                }
                _ => false,
            };
            if mine && !self.fenced {
                return Err(self.fail(
                    io::ErrorKind::Other,
                    format!(
                        "verbs async event {} on {} port {}",
                        ev.kind,
                        self.ctx.name(),
                        self.port.port
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Drain, acknowledge and re-arm the channel, then poll the CQ empty.
    fn reap(&mut self) -> io::Result<()> {
        self.cq.drain_and_rearm()?;
        loop {
            self.wcs.clear();
            let n = self.cq.poll(&mut self.wcs, 64)?;
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
        if c.wr_id == WR_RECV {
            let imm = c.imm.unwrap_or(0);
            if imm & CREDIT_FLAG != 0 {
                self.credited += u64::from(imm & !CREDIT_FLAG);
            } else {
                self.received += u64::from(imm);
            }
            if self.received - self.consumed > RING as u64 || self.credited > self.head {
                return Err(self.fail(
                    io::ErrorKind::InvalidData,
                    "the peer broke the verbs ring protocol".into(),
                ));
            }
            return self.qp.post_recv(WR_RECV);
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        if c.wr_id & WR_CREDIT == 0 {
            self.acked += c.wr_id;
        }
        Ok(())
    }

    fn return_credit(&mut self) -> io::Result<()> {
        let owed = self.consumed - self.credit_sent;
        let drained = self.consumed == self.received;
        if owed == 0 || (owed < RING as u64 / 4 && !drained) || self.outstanding >= MAX_SEND {
            return Ok(());
        }
        let peer = self.peer.expect("ready lanes know their peer");
        self.qp.post_write(&RdmaWrite {
            local: &self.send,
            offset: 0,
            len: 0,
            remote_addr: peer.addr,
            rkey: peer.rkey,
            imm: Some(CREDIT_FLAG | owed as u32),
            signaled: true,
            wr_id: WR_CREDIT,
        })?;
        self.outstanding += 1;
        self.credit_sent = self.consumed;
        Ok(())
    }

    /// The fence: the QP goes to ERR, the socket will close with a reset.
    pub fn fence(&mut self) {
        self.fenced = true;
        let _ = self.qp.to_err();
        let _ = socket2::SockRef::from(&self.sock).set_linger(Some(Duration::ZERO));
    }

    /// Before a graceful close: wait (briefly) until the peer acknowledged what we
    /// posted, so that it has it all before it sees the socket close.
    pub fn linger(&mut self) {
        if self.fenced || !self.is_ready() {
            return;
        }
        let end = Instant::now() + LINGER;
        while self.acked < self.head && self.error.is_none() && Instant::now() < end {
            if self.reap().is_err() {
                break;
            }
            if self.acked < self.head {
                let _ = self.cq.channel().wait(Duration::from_millis(10));
            }
        }
        if self.acked < self.head {
            tracing::debug!(
                "railover: verbs lane closed with {} bytes unacknowledged",
                self.head - self.acked
            );
        }
    }

    /// Registers the bootstrap socket with `interest` and the channel and async fds
    /// readable, all under `token`.
    fn fds(&self) -> [std::os::fd::RawFd; 2] {
        [self.cq.channel().fd(), self.ctx.async_fd().unwrap_or(-1)]
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::NotConnected
}

impl Read for VerbsLane {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.check()?;
        let avail = (self.received - self.consumed) as usize;
        if avail == 0 {
            // Bytes the peer posted before closing are reaped before its EOF is seen.
            return if self.peer_closed {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let off = (self.consumed % RING as u64) as usize;
        let n = avail.min(buf.len()).min(RING - off);
        self.recv.read(off, &mut buf[..n])?;
        self.consumed += n as u64;
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
        let free = RING as u64 - (self.head - self.credited);
        let off = (self.head % RING as u64) as usize;
        let room = (free as usize).min(RING - off);
        if room == 0 || self.outstanding >= DATA_SLOTS {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // Gather as much as fits contiguously: one WRITE for many small frames.
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(room - n);
            self.send.write(off + n, &b[..take])?;
            n += take;
            if n == room {
                break;
            }
        }
        if n == 0 {
            return Ok(0);
        }
        let peer = self.peer.expect("ready lanes know their peer");
        self.qp.post_write(&RdmaWrite {
            local: &self.send,
            offset: off,
            len: n,
            remote_addr: peer.addr + off as u64,
            rkey: peer.rkey,
            imm: Some(n as u32),
            signaled: true,
            wr_id: n as u64,
        })?;
        self.outstanding += 1;
        self.head += n as u64;
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

    #[test]
    fn the_credit_flag_is_out_of_reach_of_lengths() {
        assert!((RING as u64) < u64::from(CREDIT_FLAG));
        assert_eq!(WR_RECV & WR_CREDIT, 0);
        assert!((RING as u64) < WR_RECV, "a data wr_id is its length");
    }
}
