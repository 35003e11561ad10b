//! Objects NCCL holds handles to: comms, listeners, pending connects, memory regions.
//! Each is shared between NCCL's threads and the reactor, so each field is either
//! immutable, atomic, or behind a short lock.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::Error;
use crate::ffi::types::NCCL_NET_MAX_REQUESTS;
use crate::reactor::CommandQueue;

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
    closed: AtomicBool,
}

impl CommShared {
    pub(crate) fn new(side: Side, key: usize, queue: Arc<CommandQueue>) -> CommShared {
        CommShared {
            side,
            key,
            queue,
            inflight: AtomicUsize::new(0),
            failed: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    /// Takes a request slot, or `false` when all [`NCCL_NET_MAX_REQUESTS`] are in use.
    pub(crate) fn try_take_slot(&self) -> bool {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < NCCL_NET_MAX_REQUESTS).then_some(n + 1)
            })
            .is_ok()
    }

    pub(crate) fn release_slot(&self) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn set_failed(&self, e: Error) {
        self.failed.lock().get_or_insert(e);
    }

    pub(crate) fn check_usable(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument("comm is closed".into()));
        }
        match &*self.failed.lock() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Marks the comm closed; `false` if it already was.
    pub(crate) fn mark_closed(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }
}

/// A listening endpoint and the comms it has accepted but NCCL has not yet taken.
#[derive(Debug)]
pub struct ListenShared {
    pub(crate) id: u64,
    pub(crate) token: [u8; 16],
    pub(crate) ready: Mutex<VecDeque<Arc<CommShared>>>,
    pub(crate) queue: Arc<CommandQueue>,
}

/// A `connect` in progress, between NCCL's retries.
#[derive(Debug, Default)]
pub struct PendingConnect {
    pub(crate) result: Mutex<Option<Result<Arc<CommShared>, Error>>>,
}

/// A memory registration. It remembers its region so that a lane moving to another NIC
/// can register the same memory there when (and only when) that happens.
#[derive(Debug)]
pub struct MemoryRegion {
    pub(crate) comm: Arc<CommShared>,
    pub base: usize,
    pub len: usize,
    pub ptr_type: i32,
}

impl MemoryRegion {
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
