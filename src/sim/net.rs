//! An in-memory network with virtual time: what TCP gives the reactor, between nodes
//! whose NICs can be cut, black-holed or slowed per direction.
//!
//! A connection is two ends and two directions. A direction holds the bytes its writer
//! handed over and not yet delivered (the send buffer, bounded), sends them in chunks at
//! the path's rate, and they arrive a latency later; the receiver's cumulative ack comes
//! back a latency after that. A path that goes down loses what was in flight, and the
//! sender sends it again when the path returns, as TCP retransmits. Everything is
//! ordered by index and time: no hash maps, no clock, no threads.
//!
//! Verbs-like lanes also write payloads in place: a placed write takes its place (and
//! its wire time) in its direction's stream just before the frame that announces it, as
//! an RC QP orders an RDMA WRITE before the next, and lands in the receive buffer once
//! all of it has arrived; its bytes never reach the receiver's stream. It is lost with
//! the path and sent again when it returns, as a NIC retransmits, so a write from a lane
//! its sender gave up can still land later unless the receiver fenced or closed its end. A write that lands in a receive already finished (or failed) is
//! what a reused buffer would be corrupted by: the run reports it.

use std::sync::Arc;

use crate::handoff::{Request, Status};
use crate::transport::memory::SimMem;

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// Virtual time since the start of a run.
pub(crate) type Time = Duration;

/// The state of one direction of one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    Up,
    /// Nothing crosses (carrier lost or a black hole; the event is the caller's).
    Down,
    /// Crosses at the base rate divided by this.
    Slow(u32),
}

/// Fixed properties of the simulated wire.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wire {
    pub latency: Duration,
    /// Bytes per second of a healthy path.
    pub rate: u64,
    pub sndbuf: usize,
    pub rcvbuf: usize,
    /// Largest piece sent at once.
    pub chunk: usize,
    /// How often an unanswered SYN is sent again.
    pub syn_retry: Duration,
}

impl Default for Wire {
    fn default() -> Self {
        Wire {
            latency: Duration::from_micros(20),
            rate: 1_250_000_000,
            sndbuf: 1 << 20,
            rcvbuf: 1 << 20,
            chunk: 64 << 10,
            syn_retry: Duration::from_millis(200),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct NicLinks {
    tx: Link,
    rx: Link,
}

/// One end of a connection, as the socket owner sees it.
#[derive(Debug, Default)]
struct End {
    /// The owner still holds it.
    open: bool,
    /// Connected (the acceptor at once; the connector when the SYN-ACK arrives).
    established: bool,
    rcv: VecDeque<u8>,
    /// The peer's FIN arrived after all its data.
    eof: bool,
    err: Option<io::ErrorKind>,
    sent: u64,
    acked: u64,
    /// Something the owner may act on happened since it last asked (an edge-triggered
    /// poll's event): bytes, the end of the stream, an error, room to write.
    news: bool,
    /// The owner fenced or sealed it (a verbs QP moved to ERR, or refusing writes):
    /// nothing lands through it any more.
    fenced: bool,
    /// Closed, it still takes writes in place until then (a verbs QP during teardown).
    linger_until: Option<Time>,
    /// Payload bytes this end wrote in place.
    placed: u64,
}

impl End {
    /// Whether the owner may write: an error once the connection failed, `WouldBlock`
    /// until it is established.
    fn writable(&self) -> io::Result<()> {
        if let Some(kind) = self.err {
            return Err(kind.into());
        }
        if !self.established {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(())
    }
}

/// A payload written in place: stream offsets `at..at + bytes.len()` of its direction
/// carry it, and it lands at `addr` once they have all arrived (unless `cut`: its sender
/// reset the lane with part of it still unsent, so it never completes).
#[derive(Debug)]
struct Landing {
    at: u64,
    addr: usize,
    bytes: Vec<u8>,
    cut: bool,
}

impl Landing {
    fn end(&self) -> u64 {
        self.at + self.bytes.len() as u64
    }
}

/// A receive buffer writes may land in, and the request it belongs to.
#[derive(Debug)]
struct Target {
    mem: Arc<SimMem>,
    req: Arc<Request>,
    what: String,
}

/// Bytes from end `d` to end `1 - d`.
#[derive(Debug, Default)]
struct Dir {
    /// Accepted and not yet delivered; the first `inflight` are on the wire.
    buf: VecDeque<u8>,
    inflight: usize,
    /// Arrival times and sizes of what is on the wire (a size of 0 is the FIN).
    chunks: VecDeque<(Time, usize)>,
    /// The sender is serialising until then.
    busy_until: Time,
    /// Something may have become sendable at this time.
    kick: Time,
    fin_queued: bool,
    fin_sent: bool,
    delivered: u64,
    /// Cumulative acks on their way back.
    acks: VecDeque<(Time, u64)>,
    /// A reset on its way to the other end.
    rst: Option<Time>,
    /// Writes in place, in stream order.
    landings: VecDeque<Landing>,
}

#[derive(Debug)]
enum Setup {
    /// The next SYN leaves at this time.
    SynSent(Time),
    /// The SYN reached the listener; the SYN-ACK arrives at this time, if its path holds.
    SynAck(Time),
    Done,
}

#[derive(Debug)]
struct Conn {
    node: [usize; 2],
    nic: [usize; 2],
    /// The listener's address, for the SYN.
    to: SocketAddr,
    setup: Setup,
    ends: [End; 2],
    dirs: [Dir; 2],
}

impl Conn {
    fn idle(&self) -> bool {
        !self.ends[0].open
            && !self.ends[1].open
            && self
                .dirs
                .iter()
                .all(|d| d.chunks.is_empty() && d.rst.is_none())
    }
}

#[derive(Debug, Default)]
struct Listening {
    nic: usize,
    backlog: VecDeque<usize>,
}

/// The network of one run.
#[derive(Debug)]
pub(crate) struct Net {
    pub now: Time,
    wire: Wire,
    /// Per node: its NICs' links, and whether the node still runs.
    nics: Vec<Vec<NicLinks>>,
    conns: Vec<Conn>,
    /// Connections that may still have something to do.
    live: Vec<usize>,
    listeners: BTreeMap<SocketAddr, Listening>,
    next_port: u16,
    /// Receive buffers by address, for writes in place.
    targets: BTreeMap<usize, Target>,
    /// Writes in place that landed, and that were dropped (their lane fenced or closed).
    pub landed: u64,
    pub dropped: u64,
    /// What writes in place did wrong, for the run to report.
    pub faults: Vec<String>,
    /// Print what happens (a replay).
    pub trace: bool,
}

/// The address of node `n`'s NIC `i`.
pub(crate) fn ip_of(n: usize, i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, n as u8, i as u8, 1))
}

fn nic_of(ip: IpAddr) -> (usize, usize) {
    match ip {
        IpAddr::V4(v) => (v.octets()[1] as usize, v.octets()[2] as usize),
        IpAddr::V6(_) => (usize::MAX, usize::MAX),
    }
}

impl Net {
    pub(crate) fn new(wire: Wire, nics_per_node: &[usize]) -> Net {
        Net {
            now: Duration::ZERO,
            wire,
            nics: nics_per_node
                .iter()
                .map(|&n| {
                    vec![
                        NicLinks {
                            tx: Link::Up,
                            rx: Link::Up
                        };
                        n
                    ]
                })
                .collect(),
            conns: Vec::new(),
            live: Vec::new(),
            listeners: BTreeMap::new(),
            next_port: 1000,
            targets: BTreeMap::new(),
            landed: 0,
            dropped: 0,
            faults: Vec::new(),
            trace: false,
        }
    }

    fn note(&self, f: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("{:>10.3} ms  net  {}", self.now.as_secs_f64() * 1e3, f());
        }
    }

    /// Sets NIC `nic` of `node`: its transmit side (`tx`) and receive side (`rx`).
    pub(crate) fn set_link(&mut self, node: usize, nic: usize, tx: Option<Link>, rx: Option<Link>) {
        let before: Vec<[bool; 2]> = self.live.iter().map(|&c| self.ups(c)).collect();
        let l = &mut self.nics[node][nic];
        if let Some(tx) = tx {
            l.tx = tx;
        }
        if let Some(rx) = rx {
            l.rx = rx;
        }
        let now = self.now;
        for (i, &c) in self.live.clone().iter().enumerate() {
            let after = self.ups(c);
            for d in 0..2 {
                let dir = &mut self.conns[c].dirs[d];
                if before[i][d] && !after[d] {
                    // What was on the wire is lost; TCP sends it again later.
                    dir.inflight = 0;
                    dir.chunks.clear();
                    dir.fin_sent = false;
                    dir.busy_until = now;
                }
                if after[d] {
                    dir.kick = now;
                }
            }
        }
    }

    /// Whether each direction of connection `c` crosses now.
    fn ups(&self, c: usize) -> [bool; 2] {
        let k = &self.conns[c];
        [0, 1].map(|d| {
            self.path(k.node[d], k.nic[d], k.node[1 - d], k.nic[1 - d])
                .is_some()
        })
    }

    /// The rate from (`a`, `i`) to (`b`, `j`), `None` when nothing crosses.
    fn path(&self, a: usize, i: usize, b: usize, j: usize) -> Option<u64> {
        let tx = self.nics.get(a)?.get(i)?.tx;
        let rx = self.nics.get(b)?.get(j)?.rx;
        let mut rate = self.wire.rate;
        for l in [tx, rx] {
            match l {
                Link::Up => {}
                Link::Down => return None,
                Link::Slow(f) => rate /= u64::from(f.max(1)),
            }
        }
        Some(rate.max(1))
    }

    pub(crate) fn listen(&mut self, node: usize, nic: usize) -> io::Result<SocketAddr> {
        if nic >= self.nics[node].len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no NIC {nic}"),
            ));
        }
        let addr = SocketAddr::new(ip_of(node, nic), self.next_port);
        self.next_port = self.next_port.wrapping_add(1).max(1000);
        self.listeners.insert(
            addr,
            Listening {
                nic,
                backlog: VecDeque::new(),
            },
        );
        Ok(addr)
    }

    /// The listener is gone: what waits in its backlog is reset.
    pub(crate) fn close_listener(&mut self, addr: SocketAddr) {
        if let Some(l) = self.listeners.remove(&addr) {
            for c in l.backlog {
                self.close(c, 1, true);
            }
        }
    }

    /// The address of the NIC at the other end of connection `c` from `end`.
    pub(crate) fn peer_of(&self, c: usize, end: usize) -> Option<IpAddr> {
        let conn = self.conns.get(c)?;
        let other = 1 - end.min(1);
        Some(ip_of(conn.node[other], conn.nic[other]))
    }

    pub(crate) fn accept(&mut self, addr: SocketAddr) -> Option<(usize, usize)> {
        let l = self.listeners.get_mut(&addr)?;
        let nic = l.nic;
        l.backlog.pop_front().map(|c| (c, nic))
    }

    pub(crate) fn connect(&mut self, node: usize, nic: usize, to: SocketAddr) -> io::Result<usize> {
        if nic >= self.nics[node].len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no NIC {nic}"),
            ));
        }
        let (rn, ri) = nic_of(to.ip());
        let c = self.conns.len();
        let mut conn = Conn {
            node: [node, rn],
            nic: [nic, ri],
            to,
            setup: Setup::SynSent(self.now),
            ends: [End::default(), End::default()],
            dirs: [Dir::default(), Dir::default()],
        };
        conn.ends[0].open = true;
        self.conns.push(conn);
        self.live.push(c);
        self.note(|| format!("conn {c}: connect n{node}e{nic} -> {to}"));
        Ok(c)
    }

    /// The owner of end `e` of `c` lets it go: gracefully (a FIN after the data), or
    /// with a reset (`rst`: unsent data dropped). Unread data also turns it into a reset.
    pub(crate) fn close(&mut self, c: usize, e: usize, rst: bool) {
        let now = self.now;
        let lat = self.wire.latency;
        let up = self.ups(c)[e];
        let k = &mut self.conns[c];
        let end = &mut k.ends[e];
        if !end.open {
            return;
        }
        end.open = false;
        let mut gone = 0;
        let reset = rst || !end.rcv.is_empty() || end.err.is_some();
        end.rcv.clear();
        let dir = &mut k.dirs[e];
        if reset {
            dir.buf.truncate(dir.inflight);
            // Writes still unsent go; one partly on the wire arrives but never lands.
            let keep = dir.delivered + dir.inflight as u64;
            let before = dir.landings.len();
            dir.landings.retain(|l| l.at < keep);
            gone = before - dir.landings.len();
            for l in dir.landings.iter_mut().filter(|l| l.end() > keep && !l.cut) {
                l.cut = true;
                gone += 1;
            }
            if k.ends[e].err.is_none() && up && !matches!(k.setup, Setup::SynSent(_)) {
                dir.rst = Some(now + lat);
            }
        } else {
            dir.fin_queued = true;
            dir.kick = now;
        }
        if let Setup::SynSent(_) | Setup::SynAck(_) = k.setup {
            if e == 0 {
                k.setup = Setup::Done;
            }
        }
        self.note(|| {
            format!(
                "conn {c}: end {e} closed{}",
                if reset { " (reset)" } else { "" }
            )
        });
        self.dropped += gone as u64;
    }

    /// End `e` of `c`, about to close, still takes writes in place for `d`.
    pub(crate) fn linger(&mut self, c: usize, e: usize, d: Duration) {
        self.conns[c].ends[e].linger_until = Some(self.now + d);
    }

    /// The owner of end `e` of `c` fenced it: what its peer still writes in place does
    /// not land through it.
    pub(crate) fn fence(&mut self, c: usize, e: usize) {
        self.conns[c].ends[e].fenced = true;
        self.note(|| format!("conn {c}: end {e} fenced"));
    }

    /// Receive buffer `mem` of request `req` (`what`, for reports) may be written in place.
    pub(crate) fn expect_writes(&mut self, mem: Arc<SimMem>, req: Arc<Request>, what: String) {
        self.targets.insert(mem.addr(), Target { mem, req, what });
    }

    /// End `e` of `c` writes `bytes` in place at `addr`, ordered before whatever it
    /// writes to the stream next.
    pub(crate) fn place(
        &mut self,
        c: usize,
        e: usize,
        addr: usize,
        bytes: Vec<u8>,
    ) -> io::Result<()> {
        let now = self.now;
        let k = &mut self.conns[c];
        let end = &mut k.ends[e];
        end.writable()?;
        let n = bytes.len();
        end.placed += n as u64;
        let at = end.sent;
        end.sent += n as u64;
        let dir = &mut k.dirs[e];
        dir.kick = now;
        // Its wire time: stand-in bytes the receiver's stream skips.
        dir.buf.extend(std::iter::repeat(0u8).take(n));
        dir.landings.push_back(Landing {
            at,
            addr,
            bytes,
            cut: false,
        });
        self.note(|| format!("conn {c}: end {e} places {n} B at {addr:#x} (stream offset {at})"));
        Ok(())
    }

    /// Payload bytes end `e` of `c` wrote in place.
    pub(crate) fn placed(&self, c: usize, e: usize) -> u64 {
        self.conns[c].ends[e].placed
    }

    /// A write in place arrives at a receiver end that takes it.
    fn land(&mut self, l: Landing) {
        let hit = self.targets.range(..=l.addr).next_back().map(|(_, t)| t);
        let Some(t) = hit.filter(|t| t.mem.land(l.addr, &l.bytes)) else {
            self.faults.push(format!(
                "{} B written in place at {:#x}, where no receive buffer lies",
                l.bytes.len(),
                l.addr
            ));
            return;
        };
        self.landed += 1;
        match t.req.status() {
            Ok(Status::Pending) => {}
            Ok(Status::Done(_)) | Err(_) => {
                let what = t.what.clone();
                self.note(|| format!("LATE write in place into {what}"));
                self.faults.push(format!(
                    "{} B written in place into {what} after it finished: a reused buffer would be corrupted",
                    l.bytes.len()
                ));
            }
        }
    }

    /// Reads from end `e` of `c`.
    pub(crate) fn read(&mut self, c: usize, e: usize, out: &mut [u8]) -> io::Result<usize> {
        let now = self.now;
        let k = &mut self.conns[c];
        let end = &mut k.ends[e];
        if !end.rcv.is_empty() {
            let n = out.len().min(end.rcv.len());
            for (o, b) in out.iter_mut().zip(end.rcv.drain(..n)) {
                *o = b;
            }
            k.dirs[1 - e].kick = now;
            return Ok(n);
        }
        if let Some(kind) = end.err {
            return Err(kind.into());
        }
        if end.eof {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    /// Writes to end `e` of `c`.
    pub(crate) fn write(
        &mut self,
        c: usize,
        e: usize,
        bufs: &[io::IoSlice<'_>],
    ) -> io::Result<usize> {
        let now = self.now;
        let cap = self.wire.sndbuf;
        let k = &mut self.conns[c];
        let end = &mut k.ends[e];
        end.writable()?;
        let dir = &mut k.dirs[e];
        let room = cap.saturating_sub(dir.buf.len());
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(room - n);
            dir.buf.extend(&b[..take]);
            n += take;
            if n == room {
                break;
            }
        }
        dir.kick = now;
        end.sent += n as u64;
        Ok(n)
    }

    /// Whether anything happened at end `e` of `c` since the last call: what an
    /// edge-triggered poll reports, once.
    pub(crate) fn take_news(&mut self, c: usize, e: usize) -> bool {
        std::mem::take(&mut self.conns[c].ends[e].news)
    }

    pub(crate) fn has_news(&self, c: usize, e: usize) -> bool {
        self.conns[c].ends[e].news
    }

    /// Bytes end `e` handed over, and of those the peer acknowledged.
    pub(crate) fn progress(&self, c: usize, e: usize) -> (u64, u64) {
        let end = &self.conns[c].ends[e];
        (end.sent, end.acked)
    }

    /// The earliest time something happens on the wire, if anything will.
    pub(crate) fn next_event(&self) -> Option<Time> {
        self.live
            .iter()
            .filter_map(|&c| self.conn_next(c).map(|(t, _)| t))
            .min()
    }

    /// Runs the wire up to `now` (inclusive).
    pub(crate) fn advance(&mut self, now: Time) {
        for c in self.live.clone() {
            // Bounded: each event moves data, a chunk, or a timer forward.
            for _ in 0..100_000 {
                match self.conn_next(c) {
                    Some((t, ev)) if t <= now => {
                        self.now = self.now.max(t);
                        self.fire(c, ev);
                    }
                    _ => break,
                }
            }
        }
        self.now = now;
        let conns = &self.conns;
        self.live.retain(|&c| !conns[c].idle());
    }

    fn conn_next(&self, c: usize) -> Option<(Time, Ev)> {
        let k = &self.conns[c];
        let ups = self.ups(c);
        let mut best: Option<(Time, Ev)> = None;
        let mut consider = |t: Time, ev: Ev| {
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, ev));
            }
        };
        match k.setup {
            Setup::SynSent(t) => consider(t, Ev::Syn),
            Setup::SynAck(t) => consider(t, Ev::SynAck),
            Setup::Done => {}
        }
        for d in 0..2 {
            let dir = &k.dirs[d];
            if let Some(&(t, _)) = dir.chunks.front() {
                consider(t, Ev::Arrive(d));
            }
            if let Some(t) = dir.rst {
                consider(t, Ev::Rst(d));
            }
            // Acks travel the other way.
            if let (Some(&(t, _)), true) = (dir.acks.front(), ups[1 - d]) {
                consider(t, Ev::Ack(d));
            }
            if ups[d] && k.ends[d].established && self.sendable(c, d) {
                consider(dir.busy_until.max(dir.kick), Ev::Send(d));
            }
        }
        best
    }

    /// Whether direction `d` of `c` has something to put on the wire now.
    fn sendable(&self, c: usize, d: usize) -> bool {
        let k = &self.conns[c];
        let dir = &k.dirs[d];
        let unsent = dir.buf.len() - dir.inflight;
        let window = self
            .wire
            .rcvbuf
            .saturating_sub(k.ends[1 - d].rcv.len() + dir.inflight);
        (unsent > 0 && window > 0) || (unsent == 0 && dir.fin_queued && !dir.fin_sent)
    }

    fn fire(&mut self, c: usize, ev: Ev) {
        let now = self.now;
        let lat = self.wire.latency;
        let ups = self.ups(c);
        match ev {
            Ev::Syn => {
                let k = &mut self.conns[c];
                if !ups[0] {
                    k.setup = Setup::SynSent(now + self.wire.syn_retry);
                    return;
                }
                // The SYN arrives a latency later; its fate is decided then, which is
                // close enough (a path that fails meanwhile retries the SYN-ACK).
                let to = k.to;
                match self.listeners.get_mut(&to) {
                    Some(l) => {
                        let k = &mut self.conns[c];
                        if !k.ends[1].open && !k.ends[1].established {
                            k.ends[1].open = true;
                            k.ends[1].established = true;
                            k.ends[1].news = true;
                            l.backlog.push_back(c);
                        }
                        k.setup = Setup::SynAck(now + lat * 2);
                    }
                    None => {
                        let k = &mut self.conns[c];
                        if ups[1] {
                            k.ends[0].err = Some(io::ErrorKind::ConnectionRefused);
                            k.ends[0].news = true;
                            k.setup = Setup::Done;
                        } else {
                            k.setup = Setup::SynSent(now + self.wire.syn_retry);
                        }
                    }
                }
            }
            Ev::SynAck => {
                let k = &mut self.conns[c];
                if ups[1] && ups[0] {
                    k.ends[0].established = true;
                    k.ends[0].news = true;
                    k.setup = Setup::Done;
                    k.dirs[0].kick = now;
                    self.note(|| format!("conn {c}: established"));
                } else {
                    k.setup = Setup::SynSent(now + self.wire.syn_retry);
                }
            }
            Ev::Send(d) => {
                let chunk = self.wire.chunk;
                let rcvbuf = self.wire.rcvbuf;
                let Some(rate) = ({
                    let k = &self.conns[c];
                    self.path(k.node[d], k.nic[d], k.node[1 - d], k.nic[1 - d])
                }) else {
                    return;
                };
                let k = &mut self.conns[c];
                let peer_rcv = k.ends[1 - d].rcv.len();
                let dir = &mut k.dirs[d];
                let unsent = dir.buf.len() - dir.inflight;
                let window = rcvbuf.saturating_sub(peer_rcv + dir.inflight);
                let n = unsent.min(chunk).min(window);
                let wire_time = Duration::from_nanos((n as u64 * 1_000_000_000) / rate);
                dir.busy_until = now + wire_time;
                dir.kick = now;
                if n == 0 {
                    dir.fin_sent = true;
                }
                dir.inflight += n;
                dir.chunks.push_back((now + wire_time + lat, n));
            }
            Ev::Arrive(d) => {
                let k = &mut self.conns[c];
                let Some((_, n)) = k.dirs[d].chunks.pop_front() else {
                    return;
                };
                let [a, b] = &mut k.ends;
                let (from, to) = if d == 0 { (a, b) } else { (b, a) };
                // The sender's buffer has room again; the receiver has bytes or a FIN.
                from.news = true;
                to.news = true;
                let dir = &mut k.dirs[d];
                if !to.open {
                    // Nobody holds the other end: its kernel answers with a reset. A
                    // write in place that arrived whole still lands while the end's QP
                    // lingers, unless it was fenced or sealed.
                    let upto = dir.delivered + n.min(dir.buf.len()) as u64;
                    let takes = !to.fenced && to.linger_until.is_some_and(|t| now <= t);
                    dir.buf.drain(..n.min(dir.buf.len()));
                    dir.inflight = 0;
                    dir.chunks.clear();
                    let mut late = Vec::new();
                    for l in dir.landings.drain(..) {
                        if takes && !l.cut && l.end() <= upto {
                            late.push(l);
                        } else {
                            self.dropped += 1;
                        }
                    }
                    if ups[1 - d] && k.ends[d].err.is_none() && k.ends[d].open {
                        k.dirs[1 - d].rst = Some(now + lat);
                    }
                    for l in late {
                        self.land(l);
                    }
                    return;
                }
                if n == 0 {
                    to.eof = true;
                    return;
                }
                // Stream bytes go to the reader; a write in place's bytes do not.
                let from_off = dir.delivered;
                let mut pos = from_off;
                let arrived: Vec<u8> = dir.buf.drain(..n).collect();
                let upto = from_off + n as u64;
                for l in dir.landings.iter().take_while(|l| l.at < upto) {
                    if l.end() <= pos {
                        continue;
                    }
                    let skip_from = l.at.max(pos);
                    to.rcv.extend(
                        &arrived[(pos - from_off) as usize..(skip_from - from_off) as usize],
                    );
                    pos = l.end().min(upto);
                }
                to.rcv.extend(&arrived[(pos - from_off) as usize..]);
                dir.inflight -= n;
                dir.delivered = upto;
                dir.acks.push_back((now + lat, upto));
                // Writes wholly arrived land before the reader sees what follows them.
                let fenced = to.fenced;
                let mut due = Vec::new();
                while dir.landings.front().is_some_and(|l| l.end() <= upto) {
                    due.extend(dir.landings.pop_front());
                }
                for l in due {
                    if l.cut {
                        continue;
                    }
                    if fenced {
                        self.dropped += 1;
                    } else {
                        self.land(l);
                    }
                }
            }
            Ev::Ack(d) => {
                let k = &mut self.conns[c];
                if let Some((_, total)) = k.dirs[d].acks.pop_front() {
                    k.ends[d].acked = k.ends[d].acked.max(total);
                    k.ends[d].news = true;
                }
            }
            Ev::Rst(d) => {
                let k = &mut self.conns[c];
                k.dirs[d].rst = None;
                let to = &mut k.ends[1 - d];
                if !ups[d] || !to.open {
                    return;
                }
                if to.err.is_none() {
                    to.err = Some(io::ErrorKind::ConnectionReset);
                }
                to.news = true;
                let dir = &mut k.dirs[1 - d];
                dir.buf.clear();
                dir.inflight = 0;
                dir.chunks.clear();
                dir.fin_queued = false;
                let gone = dir.landings.len() as u64;
                dir.landings.clear();
                self.dropped += gone;
                self.note(|| format!("conn {c}: end {} reset", 1 - d));
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Syn,
    SynAck,
    Send(usize),
    Arrive(usize),
    Ack(usize),
    Rst(usize),
}
