//! Objects NCCL holds handles to: comms, listeners, pending connects, memory regions.
//! Each is shared between NCCL's threads and the reactor, so each field is either
//! immutable, atomic, or behind a short lock.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::queue::{Call, Command, CommandQueue};
use super::request::Request;
use super::Error;
use crate::conn::matching::{Matched, Matcher};
use crate::conn::wire::{Group, NicAddr};
use crate::conn::ConnError;
use crate::transport::memory::{Memory, Region, UserBuf};

/// Requests a comm may have in flight (`NCCL_NET_MAX_REQUESTS`, which `ffi` reports).
pub const NCCL_NET_MAX_REQUESTS: usize = 32;
/// Buffers one `irecv` may post (`maxRecvs`, which `ffi` reports): a grouped receive.
pub const MAX_RECVS: usize = crate::conn::wire::MAX_GROUP as usize;
/// `regMr` pointer types and `ptrSupport` bits (`NCCL_PTR_HOST`, `_CUDA`, `_DMABUF`).
pub const NCCL_PTR_HOST: i32 = 0x1;
pub const NCCL_PTR_CUDA: i32 = 0x2;
pub const NCCL_PTR_DMABUF: i32 = 0x4;

/// Which half of a connection a comm is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Send,
    Recv,
}

/// A send or receive comm.
#[derive(Debug)]
pub struct CommShared {
    pub side: Side,
    /// The reactor's key for this comm.
    pub(crate) key: usize,
    pub(crate) queue: Arc<CommandQueue>,
    /// Requests handed to NCCL that `test` has not yet reported finished.
    inflight: AtomicUsize,
    /// Set once the comm can no longer carry data; later requests fail with it.
    failed: Mutex<Option<Error>>,
    /// NCCL was told of that failure (one WARN per comm, not one per request).
    reported: AtomicBool,
    closed: AtomicBool,
    /// The local NIC that carries most of the comm now (the reactor moves it on failover).
    nic: AtomicUsize,
    /// How many NIC pairs the comm's stripes run over (1 unless a failover spread it).
    spread: AtomicUsize,
    /// Registrations made on this comm, so a move to another NIC can register them there.
    regions: Mutex<Vec<Weak<MemoryRegion>>>,
    /// Send side: the receives the peer announced and which send took which. The reactor
    /// announces, NCCL's `isend` claims: each holds the lock for one short call.
    matcher: Mutex<Matcher>,
    /// How long sends may find no receive for their tags in the head group before one
    /// WARN names them (`RAILOVER_UNMATCHED_WARN_MS`).
    unmatched_warn: Duration,
    /// The caller turn during which `test` last looked at this comm ([`Call::Test`]).
    sweep: AtomicU64,
}

/// Comms whose sends found no matching receive for longer than their bound (one WARN
/// each), process-wide.
pub static UNMATCHED_SENDS: AtomicU64 = AtomicU64::new(0);

impl CommShared {
    pub(crate) fn new(
        side: Side,
        key: usize,
        queue: Arc<CommandQueue>,
        nic: usize,
        unmatched_warn: Duration,
    ) -> CommShared {
        CommShared {
            side,
            key,
            queue,
            inflight: AtomicUsize::new(0),
            failed: Mutex::new(None),
            reported: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            nic: AtomicUsize::new(nic),
            spread: AtomicUsize::new(1),
            regions: Mutex::new(Vec::new()),
            matcher: Mutex::new(Matcher::default()),
            unmatched_warn,
            sweep: AtomicU64::new(0),
        }
    }

    /// Offers the caller's thread to the reactor from `test` of one of this comm's
    /// requests: a turn once the caller's sweep over its comms comes back here.
    pub(crate) fn drive_tested(&self) {
        self.queue.drive_for(Call::Test(&self.sweep));
    }

    /// Offers the caller's thread to the reactor from `isend`/`irecv`: the test that
    /// follows runs the turn unless the last one is long past.
    pub(crate) fn drive_posted(&self) {
        self.queue.drive_for(Call::Post);
    }

    /// Reactor side (sender): the receiver posted receive `seq` of `capacity` bytes in
    /// `group`. Repeats change nothing; a contradiction is the peer's protocol error.
    pub(crate) fn announce(&self, seq: u64, capacity: u64, group: Group) -> Result<(), ConnError> {
        self.matcher.lock().announce(seq, capacity, group)
    }

    /// NCCL's side (`isend`): the receive a send with `tag` fills, or `None` for "not
    /// now" (NCCL's IB rules: [`crate::conn::matching`]). Sends that have found no buffer
    /// for their tags in a posted group for longer than the comm's bound get one WARN and
    /// are counted; the comm stays open.
    pub fn claim(&self, tag: i32, now: Instant) -> Option<Matched> {
        let mut m = self.matcher.lock();
        let got = m.claim(tag, now);
        if got.is_none() {
            if let Some(o) = m.overdue(now, self.unmatched_warn) {
                drop(m);
                UNMATCHED_SENDS.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "railover: comm {}: {o}; the comm stays open, waiting (a tag mismatch between the two ranks' NCCL calls never resolves; RAILOVER_UNMATCHED_WARN_MS sets when this is reported)",
                    self.key
                );
            }
        }
        got
    }

    /// The local NIC that carries most of the comm now.
    pub fn nic(&self) -> usize {
        self.nic.load(Ordering::Acquire)
    }

    /// How many NIC pairs the comm runs over now: 1 on its own pair, more while a
    /// failover has it striped over several survivors.
    pub fn spread(&self) -> usize {
        self.spread.load(Ordering::Acquire)
    }

    /// Reactor side: the comm's stripes settled over `pairs` pairs.
    pub(crate) fn spread_over(&self, pairs: usize) {
        self.spread.store(pairs.max(1), Ordering::Release);
    }

    /// Reactor side: the comm now runs on local NIC `nic`. Registrations follow it lazily,
    /// here and only here (P6). Returns how many regions had to be registered on `nic`.
    pub(crate) fn moved_to(&self, nic: usize) -> usize {
        self.nic.store(nic, Ordering::Release);
        let mut regions = self.regions.lock();
        regions.retain(|r| r.strong_count() > 0);
        regions
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|r| r.register_on(nic))
            .count()
    }

    pub(crate) fn remember_region(&self, r: &Arc<MemoryRegion>) {
        self.regions.lock().push(Arc::downgrade(r));
    }

    /// Requests the comm may have in flight: [`NCCL_NET_MAX_REQUESTS`] receives, and as
    /// many sends as those receives may hold buffers (NCCL's contract: a send comm takes
    /// `NCCL_NET_MAX_REQUESTS × maxRecvs` isends).
    pub fn max_requests(&self) -> usize {
        match self.side {
            Side::Send => NCCL_NET_MAX_REQUESTS * MAX_RECVS,
            Side::Recv => NCCL_NET_MAX_REQUESTS,
        }
    }

    /// Takes a request slot, or `false` when all [`CommShared::max_requests`] are in use.
    pub(crate) fn try_take_slot(&self) -> bool {
        let max = self.max_requests();
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    pub(crate) fn release_slot(&self) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn set_failed(&self, e: Error) {
        self.failed.lock().get_or_insert(e);
    }

    /// Why the comm can no longer carry data, once it cannot: its own failure, or its
    /// reactor's panic.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.failed.lock().clone().or_else(|| self.queue.panicked())
    }

    /// Takes a request slot for NCCL's `isend`/`irecv`: `Ok(false)` when all are busy
    /// ("call again"). A comm that is closed, or whose reactor is gone, takes none: the
    /// first is the caller's mistake.
    pub(crate) fn take_slot(&self) -> Result<bool, Error> {
        self.queue.check()?;
        if self.is_closed() {
            return Err(Error::InvalidArgument("comm is closed".into()));
        }
        Ok(self.try_take_slot())
    }

    /// A request of `count` buffers holding a slot [`CommShared::take_slot`] took. On a
    /// comm whose peer closed or failed it is failed already, so that `test` reports the
    /// remote error, as NCCL's own transports do.
    pub(crate) fn new_request(self: &Arc<Self>, count: usize) -> Arc<Request> {
        let req = Arc::new(Request::group(self.clone(), count));
        if let Some(e) = self.failure() {
            req.fail(e);
        }
        req
    }

    /// `true` the first time only: NCCL is told of the comm's failure once.
    pub(crate) fn first_report(&self) -> bool {
        !self.reported.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the comm closed; `false` if it already was.
    pub(crate) fn mark_closed(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }
}

/// What `isend` did with a send.
#[derive(Debug)]
pub enum Isend {
    /// "Not now": no receive for its tag yet, or no request slot free. NCCL calls again.
    NotNow,
    /// The comm had failed: a request that reports why.
    Failed(Arc<Request>),
    /// Matched to a receive and handed to the reactor.
    Posted(Arc<Request>, Matched),
}

impl CommShared {
    /// NCCL's `isend` of `buf` with `tag`, its arguments checked: matched to a receive
    /// (NCCL's IB rules, [`crate::conn::matching`]), cut to the receive's size and queued
    /// for the reactor, or "not now". A request slot is taken before a receive is
    /// claimed, so a claimed receive always gets its send.
    pub fn isend(
        self: &Arc<Self>,
        mut buf: UserBuf,
        tag: i32,
        now: Instant,
    ) -> Result<Isend, Error> {
        if !self.take_slot()? {
            return Ok(Isend::NotNow);
        }
        if self.failure().is_some() {
            return Ok(Isend::Failed(self.new_request(1)));
        }
        let Some(m) = self.claim(tag, now) else {
            self.release_slot();
            return Ok(Isend::NotNow);
        };
        buf.truncate(usize::try_from(m.capacity).unwrap_or(usize::MAX));
        // Not `new_request`: a failure that comes meanwhile fails it in the reactor.
        let req = Arc::new(Request::group(self.clone(), 1));
        self.queue.push(Command::Send {
            comm: self.clone(),
            req: req.clone(),
            buf,
            seq: m.seq,
        });
        Ok(Isend::Posted(req, m))
    }
}

/// A listening endpoint and the comms it has accepted but NCCL has not yet taken.
#[derive(Debug)]
pub struct ListenShared {
    pub(crate) id: u64,
    pub(crate) token: [u8; 16],
    /// NCCL's device: the receive comms' NIC, whichever pair their connect came over.
    pub(crate) nic: usize,
    pub(crate) ready: Mutex<VecDeque<Arc<CommShared>>>,
    pub(crate) queue: Arc<CommandQueue>,
}

/// What NCCL's handle says of a listener beyond its address: its id in its process and
/// that process's failover listeners, index for index with its NICs. With them a connect
/// that NCCL's pair cannot carry reaches the same listener over another pair.
#[derive(Debug, Clone, Default)]
pub struct Rescue {
    pub listen_id: u64,
    pub nics: Vec<NicAddr>,
}

/// A `connect` in progress, between NCCL's retries.
#[derive(Debug, Default)]
pub struct PendingConnect {
    pub(crate) result: Mutex<Option<Result<Arc<CommShared>, Error>>>,
}

/// A `listen` waiting for the reactor to open its listener: the address peers connect
/// to, or why there is none.
#[derive(Debug, Default)]
pub struct PendingListen {
    result: Mutex<Option<Result<SocketAddr, Error>>>,
    cv: Condvar,
}

impl PendingListen {
    /// Reactor side: the outcome, once.
    pub(crate) fn finish(&self, r: Result<SocketAddr, Error>) {
        self.result.lock().get_or_insert(r);
        self.cv.notify_all();
    }

    /// Waits up to `limit` for the outcome; `None` if it did not come.
    pub(crate) fn wait(&self, limit: Duration) -> Option<Result<SocketAddr, Error>> {
        let end = Instant::now() + limit;
        let mut r = self.result.lock();
        while r.is_none() {
            if self.cv.wait_until(&mut r, end).timed_out() {
                break;
            }
        }
        r.take()
    }
}

/// A memory registration. It remembers its region so that a lane moving to another NIC
/// can register the same memory there when (and only when) that happens.
#[derive(Debug)]
pub struct MemoryRegion {
    pub(crate) comm: Arc<CommShared>,
    pub base: usize,
    pub len: usize,
    pub ptr_type: i32,
    /// The range, with what fabrics registered of it; buffers of requests carry it.
    pub region: Arc<Region>,
    /// Local NICs this region is registered on: the comm's NIC at `regMr`, then each NIC
    /// a failover moves the comm to. For TCP this is bookkeeping; for verbs it is where
    /// `ibv_reg_mr` runs.
    nics: Mutex<Vec<usize>>,
}

/// Registrations made lazily on backup NICs, process-wide (P6).
pub static LAZY_REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

impl MemoryRegion {
    pub(crate) fn new(
        comm: Arc<CommShared>,
        base: usize,
        len: usize,
        ptr_type: i32,
        memory: Memory,
    ) -> MemoryRegion {
        let nic = comm.nic();
        MemoryRegion {
            comm,
            base,
            len,
            ptr_type,
            region: Arc::new(Region::of(base, len, memory)),
            nics: Mutex::new(vec![nic]),
        }
    }

    /// The NICs this region is registered on, in the order they were added.
    pub fn registered_nics(&self) -> Vec<usize> {
        self.nics.lock().clone()
    }

    /// Registers on `nic` if not yet; `true` if this call did it.
    fn register_on(&self, nic: usize) -> bool {
        let mut nics = self.nics.lock();
        if nics.contains(&nic) {
            return false;
        }
        nics.push(nic);
        LAZY_REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Checks that `[addr, addr + len)` lies inside this region of `comm`.
    pub(crate) fn check(
        &self,
        comm: &Arc<CommShared>,
        addr: usize,
        len: usize,
    ) -> Result<(), Error> {
        if !Arc::ptr_eq(&self.comm, comm) {
            return Err(Error::InvalidArgument(
                "memory handle belongs to another comm".into(),
            ));
        }
        let inside = len == 0
            || (addr >= self.base
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= self.base + self.len));
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "buffer {addr:#x}+{len} lies outside its registration {:#x}+{}",
                self.base, self.len
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm() -> Arc<CommShared> {
        let poll = mio::Poll::new().unwrap();
        let waker = mio::Waker::new(poll.registry(), mio::Token(0)).unwrap();
        Arc::new(CommShared::new(
            Side::Send,
            0,
            Arc::new(CommandQueue::for_tests(waker)),
            1,
            Duration::from_secs(10),
        ))
    }

    #[test]
    fn registrations_follow_the_comm_to_a_backup_nic_only_when_it_moves() {
        let c = comm();
        let a = Arc::new(MemoryRegion::new(c.clone(), 0x1000, 4096, 1, Memory::Host));
        c.remember_region(&a);
        let b = Arc::new(MemoryRegion::new(c.clone(), 0x9000, 4096, 1, Memory::Host));
        c.remember_region(&b);
        // At regMr time: registered on the comm's NIC only, nothing on any backup (P6).
        assert_eq!(a.registered_nics(), vec![1]);
        let before = LAZY_REGISTRATIONS.load(Ordering::Relaxed);
        assert_eq!(
            c.moved_to(3),
            2,
            "both regions registered on the backup when the comm moves"
        );
        assert_eq!(a.registered_nics(), vec![1, 3]);
        assert_eq!(c.nic(), 3);
        assert_eq!(c.moved_to(1), 0, "moving back needs no new registration");
        assert_eq!(c.moved_to(3), 0, "nor moving to a NIC it already has");
        assert!(LAZY_REGISTRATIONS.load(Ordering::Relaxed) >= before + 2);
        drop(b);
        assert_eq!(c.moved_to(2), 1, "a deregistered region is forgotten");
    }

    #[test]
    fn buffers_outside_the_registration_are_refused() {
        let c = comm();
        let r = MemoryRegion::new(c.clone(), 0x1000, 100, 1, Memory::Host);
        assert!(r.check(&c, 0x1000, 100).is_ok());
        assert!(r.check(&c, 0x1000, 0).is_ok());
        assert!(r.check(&c, 0x1001, 100).is_err());
        assert!(r.check(&c, 0x0fff, 2).is_err());
        assert!(r.check(&c, usize::MAX, 2).is_err(), "overflow");
        assert!(
            r.check(&comm(), 0x1000, 1).is_err(),
            "another comm's registration"
        );
    }
}
