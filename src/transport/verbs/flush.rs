//! One device's flush QP: what makes a NIC's RDMA WRITEs into GPU memory visible to the
//! GPU before a kernel reads them, as NCCL's IB transport does it (`ncclIbIflush`).
//!
//! The flush is an RDMA READ of [`FLUSH_BYTES`] at the receive buffer's address, through
//! the buffer's registration, posted on an RC QP of the same device connected to itself,
//! into a small registered host buffer. The NIC answers a READ only after its earlier
//! PCIe writes to that memory have landed, so the READ's completion is the proof. The QP
//! is addressed as a lane's (port, GID, GRH, traffic class, service level, timing from
//! the same settings) with itself as the peer, and completes on a CQ of its own that its
//! user polls (no completion channel).
//!
//! Every READ of one QP completes in posting order, so a flush is a [`Ticket`] and
//! "done" is a watermark: [`Flusher::done`] says whether that ticket and every earlier one
//! completed. At most [`FLUSH_DEPTH`] READs are outstanding; each lands in its own slot of
//! the host buffer, so [`Flusher::fetched`] can say what one of them read.
//!
//! An error completion (a bad key, the port gone) breaks the flusher for good: the QP is
//! in ERR and flushes whatever follows. [`Domain::flusher`](super::Domain::flusher) hands
//! out a fresh one after that.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::VerbsNic;
use super::lane::{local_gid, local_port, needs_grh, remote_qp, QpHello};
use super::register::Registration;
use super::sys::{wc, Completion, Mr, Pd, PolledCq, Qp, Read};
use super::{completion_error, qp_timing};
use crate::config::VerbsSettings;
use crate::transport::memory::Region;

/// Bytes one flush READs: NCCL's flush SGE has length 1 (into an `int` it registered).
pub const FLUSH_BYTES: usize = 1;
/// READs outstanding at most on one device's flush QP (its send queue). NCCL gives each
/// receive comm's flush QP `NET_IB_MAX_REQUESTS` (32) slots; this QP serves every comm of
/// the device.
pub const FLUSH_DEPTH: u32 = 128;
/// READs one flush QP keeps in flight at most (the device may allow fewer): it serves
/// every receive comm of its device, so one at a time would queue each comm's flush
/// behind every other's round trip. mlx5 allows 16.
pub const FLUSH_READS_IN_FLIGHT: i32 = 16;
/// The flush QP's packet sequence number; it only ever talks to itself.
const FLUSH_PSN: u32 = 0;

/// A posted flush: tickets grow by one per READ, from 1.
pub type Ticket = u64;

/// A device's flusher as [`Domain::flusher`](super::Domain::flusher) shares it.
pub type SharedFlusher = Arc<parking_lot::Mutex<Flusher>>;

/// Flushes what the comm's devices wrote into `region` (NCCL's `iflush` of a receive into
/// GPU memory at `addr`): one READ at `addr` on the flush QP of each device that
/// registered the range, since a comm's lanes may have written it from several NICs (its
/// own, and the backups a failover moved it to). The range is one `regMr` of one comm, so
/// no other comm's devices are asked. A device that registered the range but wrote none
/// of this receive costs one READ that proves nothing, which is cheaper than tracking
/// which NIC wrote which receive. None for host memory or a range no device registered.
pub fn flush_region(region: &Region, addr: u64) -> Vec<PendingFlush> {
    if region.cpu_reachable() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (_, key) in region.keys() {
        if let Ok(r) = key.downcast::<Registration>() {
            out.extend(Registration::flush(&r, addr));
        }
    }
    out
}

/// READs the flushes posted (each device's share of an `iflush`).
pub static FLUSH_READS: AtomicU64 = AtomicU64::new(0);
/// Flushes counted as done because their device is down (port or device fault).
pub static FLUSHES_EXCUSED: AtomicU64 = AtomicU64::new(0);
/// Flushes that waited for a free slot on their device's flush QP.
pub static FLUSHES_QUEUED: AtomicU64 = AtomicU64::new(0);
/// Times a flush was posted again after its READ failed on a device not known to be down.
pub static FLUSHES_REPOSTED: AtomicU64 = AtomicU64::new(0);

/// How long a flush keeps trying fresh flush QPs after its READ failed (or a fresh QP
/// could not be made) on a device not known to be down: long enough for the port-down
/// event that explains a failure to arrive, short enough that an error of the flush's
/// own (a bad key) is NCCL's within the completion timeout's order.
pub const FLUSH_RETRY_FOR: Duration = Duration::from_secs(2);
/// The pause between those tries: a fresh flush QP is a few firmware commands, never to
/// be made in NCCL's polling loop.
pub const FLUSH_RETRY_EVERY: Duration = Duration::from_millis(100);

/// What a device offers one flush: the seam between [`PendingFlush`]'s rules and the
/// device's flush QP, so the rules are unit tests.
pub trait FlushPath {
    /// Why the device's writes need no flush now, if they do not: its port is down or
    /// the device is dead. Its lanes are fenced then: what they wrote of a receive still
    /// in progress was refused and replayed over another NIC, and what they wrote of one
    /// already complete was written before the failure, long before any kernel reads it.
    /// NCCL's own transport fails the comm here instead.
    fn down(&self) -> Option<String>;
    /// Posts a READ at `addr` and returns its ticket: `WouldBlock` while the device's
    /// flush QP has no free slot.
    fn post(&mut self, addr: u64) -> io::Result<Ticket>;
    /// Whether the READ of `ticket` (from the last [`FlushPath::post`]) completed.
    fn done(&mut self, ticket: Ticket) -> io::Result<bool>;
}

/// One device's share of an `iflush`, waited for by polling [`PendingFlush::done`].
pub type PendingFlush = Flush<DeviceFlush>;

/// One device's share of an `iflush`: posted when its flush QP has a slot, done when its
/// READ completes or when the device goes down. Sans-IO: the caller passes `now`.
#[derive(Debug)]
pub struct Flush<P> {
    path: P,
    addr: u64,
    state: FlushState,
    /// Since when its READs fail on a device not known to be down.
    failing_since: Option<Instant>,
    /// Not to be posted again before this.
    next_try: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlushState {
    /// To be posted: new, its device's flush QP was full, or its READ failed.
    Waiting,
    Posted(Ticket),
    Done,
}

impl<P: FlushPath> Flush<P> {
    /// A flush at `addr` through `path`, posted by the first [`Flush::done`].
    pub fn new(path: P, addr: u64) -> Flush<P> {
        Flush {
            path,
            addr,
            state: FlushState::Waiting,
            failing_since: None,
            next_try: None,
        }
    }

    /// Whether the flush is done at `now`, without blocking: its READ completed, or its
    /// device went down (see [`FlushPath::down`]). A full flush QP only delays it. A READ
    /// that failed (an earlier READ may have broken the QP it shared, or the port-down
    /// event is still on its way) is posted again on a fresh QP every
    /// [`FLUSH_RETRY_EVERY`]; the error is the flush's only after [`FLUSH_RETRY_FOR`].
    pub fn done(&mut self, now: Instant) -> io::Result<bool> {
        loop {
            if self.state == FlushState::Done {
                return Ok(true);
            }
            if let Some(why) = self.path.down() {
                self.excuse(&why);
                return Ok(true);
            }
            let outcome = match self.state {
                FlushState::Waiting if self.next_try.is_some_and(|t| now < t) => return Ok(false),
                FlushState::Waiting => match self.path.post(self.addr) {
                    Ok(t) => {
                        FLUSH_READS.fetch_add(1, Ordering::Relaxed);
                        self.state = FlushState::Posted(t);
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if self.next_try.is_none() {
                            FLUSHES_QUEUED.fetch_add(1, Ordering::Relaxed);
                            self.next_try = Some(now);
                        }
                        return Ok(false);
                    }
                    Err(e) => Err(e),
                },
                FlushState::Posted(t) => self.path.done(t),
                FlushState::Done => unreachable!("returned above"),
            };
            match outcome {
                Ok(true) => self.state = FlushState::Done,
                Ok(false) => return Ok(false),
                // The device may have gone down while the READ was out: its error is
                // the port's, not the flush's.
                Err(_) if self.path.down().is_some() => continue,
                Err(e) => return self.failed(e, now),
            }
        }
    }

    fn failed(&mut self, e: io::Error, now: Instant) -> io::Result<bool> {
        let since = *self.failing_since.get_or_insert(now);
        if now.saturating_duration_since(since) >= FLUSH_RETRY_FOR {
            return Err(e);
        }
        tracing::debug!(
            "railover: flush at {:#x} failed ({e}); trying a fresh flush QP",
            self.addr
        );
        FLUSHES_REPOSTED.fetch_add(1, Ordering::Relaxed);
        self.state = FlushState::Waiting;
        self.next_try = Some(now + FLUSH_RETRY_EVERY);
        Ok(false)
    }

    fn excuse(&mut self, why: &str) {
        FLUSHES_EXCUSED.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            "railover: flush at {:#x} counted done: {why} (its lanes are fenced)",
            self.addr
        );
        self.state = FlushState::Done;
    }
}

/// A device's flush QP as one flush uses it: the device's shared [`Flusher`] (a fresh one
/// once a READ broke the last), the registration's key, the device's faults.
#[derive(Debug)]
pub struct DeviceFlush {
    reg: Arc<Registration>,
    /// The flusher the last READ went to, which alone can say when it is done.
    flusher: Option<SharedFlusher>,
}

impl DeviceFlush {
    pub(super) fn new(reg: Arc<Registration>) -> DeviceFlush {
        DeviceFlush { reg, flusher: None }
    }
}

impl FlushPath for DeviceFlush {
    fn down(&self) -> Option<String> {
        let via = self.reg.flush_via()?;
        via.dom.fault(via.nic.port, &[])
    }

    fn post(&mut self, addr: u64) -> io::Result<Ticket> {
        let (Some(via), Some(rkey)) = (self.reg.flush_via(), self.reg.rkey()) else {
            return Err(io::Error::other("the registration has no flush QP"));
        };
        let flusher = via.dom.flusher(&via.nic, &via.settings)?;
        let t = flusher.lock().post(addr, rkey)?;
        self.flusher = Some(flusher);
        Ok(t)
    }

    fn done(&mut self, ticket: Ticket) -> io::Result<bool> {
        let (Some(f), Some(via)) = (&self.flusher, self.reg.flush_via()) else {
            return Err(io::Error::other("flush ticket without a flusher"));
        };
        let mut f = f.lock();
        // An overrun CQ lost completions: this ticket's may never come. The flusher is
        // done for, and the device hands out a fresh one.
        if let Some(why) = via.dom.cq_fault(f.cq_id()) {
            f.broke(&why);
            return Err(io::Error::other(why));
        }
        f.done(ticket)
    }
}

/// One device's flush QP and the host buffer its READs land in.
#[derive(Debug)]
pub struct Flusher {
    // Field order is drop order: the QP before its CQ and before the buffer it READs into.
    qp: Qp,
    cq: Arc<PolledCq>,
    landing: Mr,
    port: u8,
    /// RDMA READs the QP may have in flight (initiator and target).
    reads: u8,
    tickets: Tickets,
    wcs: Vec<Completion>,
}

impl Flusher {
    /// The flush QP of `pd`'s device on `nic`'s port (a port of that device), connected to
    /// itself and ready to post, with its QP timing, traffic class and service level from
    /// `settings`.
    pub fn new(pd: &Arc<Pd>, nic: &VerbsNic, settings: &VerbsSettings) -> io::Result<Flusher> {
        let ctx = pd.context();
        if ctx.name() != nic.device {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a flush QP of {} cannot use {}'s port",
                    ctx.name(),
                    nic.label()
                ),
            ));
        }
        let cq = PolledCq::new(ctx, (FLUSH_DEPTH + 16) as i32)?;
        // One receive slot: the QP never receives, some providers refuse none.
        let qp = Qp::new_rc_polled(pd, &cq, FLUSH_DEPTH, 1)?;
        let landing = Mr::new(pd, FLUSH_DEPTH as usize * FLUSH_BYTES)?;
        qp.to_init(nic.port)?;
        let me = QpHello {
            qpn: qp.qp_num(),
            psn: FLUSH_PSN,
            lid: nic.attr.lid,
            mtu: nic.attr.active_mtu,
            gid: local_gid(nic),
            addr: landing.addr(),
            rkey: landing.rkey(),
            len: landing.len() as u64,
        };
        let remote = remote_qp(&me, needs_grh(nic), me.mtu);
        // The QP is both ends of its READs: as many in flight as the device lets one
        // QP have, as initiator and as target, up to FLUSH_READS_IN_FLIGHT.
        let reads = ctx.query_device().map_or(1, |a| {
            (a.max_qp_rd_atom.min(a.max_qp_init_rd_atom)).clamp(1, FLUSH_READS_IN_FLIGHT)
        }) as u8;
        qp.to_rtr(&local_port(nic, settings), &remote, reads)?;
        qp.to_rts(FLUSH_PSN, qp_timing(settings), reads)?;
        Ok(Flusher {
            qp,
            cq,
            landing,
            port: nic.port,
            reads,
            tickets: Tickets::new(FLUSH_DEPTH),
            wcs: Vec::with_capacity(FLUSH_DEPTH as usize),
        })
    }

    /// Posts a signaled READ of [`FLUSH_BYTES`] at `addr` under `rkey` (a registration of
    /// this device that grants remote read, as `UserMr` does) and returns its ticket.
    /// `WouldBlock` while [`FLUSH_DEPTH`] READs are outstanding (it reaps first); the
    /// flusher's error once a READ failed.
    pub fn post(&mut self, addr: u64, rkey: u32) -> io::Result<Ticket> {
        let t = match self.tickets.next() {
            // Reap what completed since the last look before saying the QP is full.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.reap()?;
                self.tickets.next()?
            }
            t => t?,
        };
        self.qp.post_read(&Read {
            local: &self.landing,
            offset: self.tickets.slot(t),
            len: FLUSH_BYTES,
            remote_addr: addr,
            rkey,
            wr_id: t,
        })?;
        self.tickets.posted(t);
        Ok(t)
    }

    /// Polls the CQ (without blocking) and says whether READ `ticket` and every earlier one
    /// completed. `Err` when one of them failed (naming the completion status; the error
    /// stays), or when `ticket` was never issued.
    pub fn done(&mut self, ticket: Ticket) -> io::Result<bool> {
        if !self.tickets.is_done(ticket) {
            self.reap()?;
        }
        self.tickets.done(ticket)
    }

    /// The bytes READ `ticket` fetched: `None` until it is done, or once its slot was taken
    /// by a later READ (after [`FLUSH_DEPTH`] more).
    pub fn fetched(&self, ticket: Ticket) -> Option<[u8; FLUSH_BYTES]> {
        if !self.tickets.slot_holds(ticket) {
            return None;
        }
        let mut b = [0u8; FLUSH_BYTES];
        self.landing.read(self.tickets.slot(ticket), &mut b).ok()?;
        Some(b)
    }

    /// Its CQ's identity, as a `CQ_ERR` event names it.
    pub fn cq_id(&self) -> usize {
        self.cq.id()
    }

    /// Something other than a completion broke the flusher (its CQ overran): every
    /// outstanding and later ticket fails with `why`.
    pub fn broke(&mut self, why: &str) {
        self.tickets
            .error
            .get_or_insert((io::ErrorKind::Other, why.to_string()));
    }

    /// Whether a READ failed: the flusher posts nothing more.
    pub fn is_broken(&self) -> bool {
        self.tickets.error.is_some()
    }

    /// RDMA READs the QP keeps in flight at most.
    pub fn reads_in_flight(&self) -> u8 {
        self.reads
    }

    /// The device's port the QP is on.
    pub fn port(&self) -> u8 {
        self.port
    }

    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    fn reap(&mut self) -> io::Result<()> {
        loop {
            self.wcs.clear();
            let n = self.cq.poll(&mut self.wcs, 64)?;
            for c in &self.wcs {
                self.tickets.complete(c);
            }
            if n < 64 {
                return Ok(());
            }
        }
    }
}

/// The flush QP's bookkeeping, without I/O: tickets issued, the completion watermark, the
/// bound on outstanding READs, and the first error.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tickets {
    depth: u32,
    /// The last ticket posted.
    posted: Ticket,
    /// Every ticket up to this one completed successfully.
    completed: Ticket,
    /// The first failed completion: (kind, message).
    error: Option<(io::ErrorKind, String)>,
}

impl Tickets {
    fn new(depth: u32) -> Tickets {
        Tickets {
            depth,
            posted: 0,
            completed: 0,
            error: None,
        }
    }

    /// The ticket the next READ takes, if it may be posted now.
    fn next(&self) -> io::Result<Ticket> {
        self.check()?;
        if self.posted - self.completed >= u64::from(self.depth) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} flush READs outstanding", self.depth),
            ));
        }
        Ok(self.posted + 1)
    }

    /// READ `t` (from [`Tickets::next`]) was posted.
    fn posted(&mut self, t: Ticket) {
        debug_assert_eq!(t, self.posted + 1, "tickets are posted in order");
        self.posted = t;
    }

    /// A completion of the flush QP: success moves the watermark, the first failure stays.
    fn complete(&mut self, c: &Completion) {
        if c.status != wc::SUCCESS {
            if self.error.is_none() {
                let e = completion_error(c);
                self.error = Some((e.kind(), format!("flush READ failed: {e}")));
            }
            return;
        }
        if self.error.is_none() && c.wr_id > self.completed && c.wr_id <= self.posted {
            self.completed = c.wr_id;
        }
    }

    fn is_done(&self, t: Ticket) -> bool {
        t <= self.completed
    }

    fn done(&self, t: Ticket) -> io::Result<bool> {
        if t == 0 || t > self.posted {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "flush ticket {t} was never issued (the last is {})",
                    self.posted
                ),
            ));
        }
        if self.is_done(t) {
            return Ok(true);
        }
        self.check()?;
        Ok(false)
    }

    /// Where READ `t` lands in the host buffer (of `depth` x [`FLUSH_BYTES`]).
    fn slot(&self, t: Ticket) -> usize {
        (t % u64::from(self.depth)) as usize * FLUSH_BYTES
    }

    /// Whether READ `t`'s slot still holds what it fetched.
    fn slot_holds(&self, t: Ticket) -> bool {
        self.is_done(t) && t > 0 && self.posted < t + u64::from(self.depth)
    }

    fn check(&self) -> io::Result<()> {
        match &self.error {
            Some((k, m)) => Err(io::Error::new(*k, m.clone())),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(wr_id: u64, status: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode: 0,
            byte_len: FLUSH_BYTES as u32,
            imm: None,
            qp_num: 9,
            vendor_err: 0,
        }
    }

    fn post(t: &mut Tickets) -> Ticket {
        let n = t.next().unwrap();
        t.posted(n);
        n
    }

    #[test]
    fn the_read_is_as_large_as_nccls() {
        // NCCL's flush SGE: `gpuFlush.sge.length = 1` (src/transport/net_ib/connect.cc).
        assert_eq!(FLUSH_BYTES, 1);
    }

    #[test]
    fn a_ticket_is_done_when_it_and_every_earlier_one_completed() {
        let mut t = Tickets::new(8);
        let (a, b, c) = (post(&mut t), post(&mut t), post(&mut t));
        assert_eq!((a, b, c), (1, 2, 3), "tickets grow by one from 1");
        assert!(!t.done(a).unwrap());
        t.complete(&wc(b, wc::SUCCESS));
        assert!(t.done(a).unwrap(), "completions come in order");
        assert!(t.done(b).unwrap());
        assert!(!t.done(c).unwrap());
        // A stale completion cannot move the watermark back.
        t.complete(&wc(a, wc::SUCCESS));
        assert!(t.done(b).unwrap());
        t.complete(&wc(c, wc::SUCCESS));
        assert!(t.done(c).unwrap());
    }

    #[test]
    fn tickets_never_issued_are_refused() {
        let mut t = Tickets::new(8);
        assert_eq!(t.done(0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(t.done(1).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        post(&mut t);
        assert!(t.done(1).is_ok());
        let e = t.done(2).unwrap_err();
        assert!(e.to_string().contains("ticket 2"), "{e}");
        // A completion for a ticket not posted (not ours) moves nothing.
        t.complete(&wc(5, wc::SUCCESS));
        assert!(!t.done(1).unwrap());
    }

    #[test]
    fn outstanding_reads_are_bounded_by_the_depth() {
        let mut t = Tickets::new(3);
        for _ in 0..3 {
            post(&mut t);
        }
        assert_eq!(t.next().unwrap_err().kind(), io::ErrorKind::WouldBlock);
        t.complete(&wc(1, wc::SUCCESS));
        assert_eq!(post(&mut t), 4, "one completed, one slot free");
        assert_eq!(t.next().unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn an_error_completion_is_sticky_and_names_the_status() {
        let mut t = Tickets::new(8);
        let (a, b, c) = (post(&mut t), post(&mut t), post(&mut t));
        t.complete(&wc(a, wc::SUCCESS));
        t.complete(&wc(b, wc::REM_ACCESS_ERR));
        // What follows on an errored QP is flushed; the first error is the one kept.
        t.complete(&wc(c, wc::WR_FLUSH_ERR));
        let e = t.done(b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(
            e.to_string().contains("flush READ failed")
                && e.to_string()
                    .contains(&crate::transport::verbs::sys::wc_status_str(
                        wc::REM_ACCESS_ERR
                    )),
            "{e}"
        );
        assert!(t.done(c).is_err(), "every later ticket fails");
        assert!(t.done(b).is_err(), "and keeps failing");
        assert!(t.done(a).unwrap(), "what completed before stays done");
        assert!(t.next().is_err(), "nothing more is posted");
        // A late success cannot hide the failure.
        t.complete(&wc(c, wc::SUCCESS));
        assert!(t.done(c).is_err());
    }

    #[test]
    fn a_slot_holds_its_bytes_until_a_later_read_takes_it() {
        let mut t = Tickets::new(2);
        let a = post(&mut t);
        assert!(!t.slot_holds(a), "not done yet");
        t.complete(&wc(a, wc::SUCCESS));
        assert!(t.slot_holds(a));
        let b = post(&mut t);
        assert!(t.slot_holds(a), "b has another slot");
        t.complete(&wc(b, wc::SUCCESS));
        let c = post(&mut t);
        assert_eq!(t.slot(c), t.slot(a));
        assert_ne!(t.slot(b), t.slot(a));
        assert!(!t.slot_holds(a), "c landed where a did");
        assert!(t.slot_holds(b));
    }

    #[test]
    fn slots_are_distinct_within_the_depth() {
        let t = Tickets::new(FLUSH_DEPTH);
        let slots: std::collections::BTreeSet<_> =
            (1..=u64::from(FLUSH_DEPTH)).map(|n| t.slot(n)).collect();
        assert_eq!(slots.len(), FLUSH_DEPTH as usize);
        assert!(slots
            .iter()
            .all(|&s| s + FLUSH_BYTES <= FLUSH_DEPTH as usize * FLUSH_BYTES));
    }

    /// A device's flush QP in a script: free slots, READs completing on demand, errors
    /// and the port going down.
    #[derive(Debug, Default)]
    struct Script {
        down: Option<String>,
        free: u32,
        posted: Vec<(u64, Ticket)>,
        completed: Ticket,
        /// The next `done` of an outstanding READ fails with this.
        fail: Option<io::ErrorKind>,
    }

    impl FlushPath for &mut Script {
        fn down(&self) -> Option<String> {
            self.down.clone()
        }
        fn post(&mut self, addr: u64) -> io::Result<Ticket> {
            if self.free == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.free -= 1;
            let t = self.posted.len() as Ticket + 1;
            self.posted.push((addr, t));
            Ok(t)
        }
        fn done(&mut self, t: Ticket) -> io::Result<bool> {
            if let Some(k) = self.fail.take() {
                return Err(io::Error::new(k, "flush READ failed: retry exceeded"));
            }
            Ok(t <= self.completed)
        }
    }

    #[test]
    fn a_flush_is_done_when_its_read_completes() {
        let now = Instant::now();
        let mut s = Script {
            free: 4,
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x1000);
        assert!(!f.done(now).unwrap());
        assert!(!f.done(now).unwrap(), "polled again, posted once");
        f.path.completed = 1;
        assert!(f.done(now).unwrap());
        assert!(f.done(now).unwrap(), "and stays done");
        assert_eq!(s.posted, vec![(0x1000, 1)]);
    }

    #[test]
    fn a_full_flush_qp_delays_a_flush_and_never_fails_it() {
        let now = Instant::now();
        let mut s = Script::default();
        let mut f = Flush::new(&mut s, 0x40);
        for k in 0..5 {
            assert!(
                !f.done(now + FLUSH_RETRY_FOR * k).unwrap(),
                "no slot: it waits"
            );
        }
        assert!(f.path.posted.is_empty());
        f.path.free = 1;
        assert!(!f.done(now + FLUSH_RETRY_FOR * 6).unwrap());
        assert_eq!(f.path.posted, vec![(0x40, 1)], "posted once a slot freed");
        f.path.completed = 1;
        assert!(f.done(now + FLUSH_RETRY_FOR * 6).unwrap());
    }

    #[test]
    fn a_device_that_went_down_counts_as_flushed() {
        let now = Instant::now();
        // Down before the flush was posted: nothing is posted on it.
        let mut s = Script {
            free: 4,
            down: Some("verbs async event PORT_ERR on rxe0 port 1".into()),
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x40);
        assert!(f.done(now).unwrap());
        assert!(s.posted.is_empty());
        // Down while its READ was out, which then fails: done, not an error.
        let mut s = Script {
            free: 4,
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x40);
        assert!(!f.done(now).unwrap());
        f.path.down = Some("port down".into());
        f.path.fail = Some(io::ErrorKind::TimedOut);
        assert!(f.done(now).unwrap());
        // Once done, the device coming back changes nothing.
        f.path.down = None;
        assert!(f.done(now).unwrap());
        // A READ failed, and the port-down event that explains it arrives later: done.
        let mut s = Script {
            free: 4,
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x40);
        assert!(!f.done(now).unwrap());
        f.path.fail = Some(io::ErrorKind::TimedOut);
        assert!(
            !f.done(now).unwrap(),
            "not known to be down: tried again later"
        );
        f.path.down = Some("port down".into());
        assert!(f.done(now + FLUSH_RETRY_EVERY / 2).unwrap());
    }

    #[test]
    fn a_failed_read_is_posted_again_on_a_fresh_qp_for_a_while() {
        let t0 = Instant::now();
        let mut s = Script {
            free: 64,
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x40);
        assert!(!f.done(t0).unwrap());
        // An earlier READ broke the shared QP: this one is posted again, not at once.
        f.path.fail = Some(io::ErrorKind::Other);
        assert!(!f.done(t0).unwrap());
        assert!(!f.done(t0 + FLUSH_RETRY_EVERY / 2).unwrap());
        assert_eq!(
            f.path.posted.len(),
            1,
            "not posted again in NCCL's polling loop"
        );
        assert!(!f.done(t0 + FLUSH_RETRY_EVERY).unwrap());
        assert_eq!(f.path.posted.len(), 2);
        f.path.completed = 2;
        assert!(
            f.done(t0 + FLUSH_RETRY_EVERY).unwrap(),
            "the second READ completed"
        );
    }

    #[test]
    fn an_error_that_persists_past_the_retry_window_is_the_flushs() {
        let t0 = Instant::now();
        let mut s = Script {
            free: 1024,
            ..Script::default()
        };
        let mut f = Flush::new(&mut s, 0x40);
        let mut now = t0;
        let e = loop {
            f.path.fail = Some(io::ErrorKind::PermissionDenied);
            match f.done(now) {
                Ok(false) => now += FLUSH_RETRY_EVERY / 4,
                Ok(true) => panic!("a flush whose READs all fail is never done"),
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let waited = now - t0;
        assert!(
            waited >= FLUSH_RETRY_FOR && waited <= FLUSH_RETRY_FOR + FLUSH_RETRY_EVERY,
            "{waited:?}"
        );
        let tries = s.posted.len() as u32;
        let most = FLUSH_RETRY_FOR.as_millis() / FLUSH_RETRY_EVERY.as_millis() + 2;
        assert!(tries >= 2 && tries <= most as u32, "{tries} READs posted");
    }

    #[test]
    fn a_flusher_can_move_between_threads() {
        fn send<T: Send>() {}
        fn sync<T: Sync>() {}
        send::<Flusher>();
        sync::<parking_lot::Mutex<Flusher>>();
    }
}
