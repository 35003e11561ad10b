//! Requests: the only state NCCL's progress thread and the reactor share per message.
//!
//! The reactor writes the outcome once (size, then state with `Release`); `test` reads
//! the state with `Acquire` and never blocks.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::comm::CommShared;
use super::Error;

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// One `isend` or `irecv` as NCCL sees it.
#[derive(Debug)]
pub struct Request {
    state: AtomicU8,
    size: AtomicU64,
    error: Mutex<Option<Error>>,
    /// The comm, so that `test` can free the request slot it holds.
    pub(crate) comm: Arc<CommShared>,
}

/// What `test` reports.
#[derive(Debug, PartialEq, Eq)]
pub enum Status {
    Pending,
    /// Done, with the number of bytes sent or received.
    Done(u64),
}

impl Request {
    pub(crate) fn new(comm: Arc<CommShared>) -> Request {
        Request {
            state: AtomicU8::new(PENDING),
            size: AtomicU64::new(0),
            error: Mutex::new(None),
            comm,
        }
    }

    /// Reactor side: the request finished with `size` bytes.
    pub(crate) fn complete(&self, size: u64) {
        self.size.store(size, Ordering::Relaxed);
        self.state.store(DONE, Ordering::Release);
    }

    /// Reactor side: the request failed.
    pub(crate) fn fail(&self, error: Error) {
        *self.error.lock() = Some(error);
        self.state.store(FAILED, Ordering::Release);
    }

    /// NCCL side: the current outcome, without blocking.
    pub fn status(&self) -> Result<Status, Error> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(Status::Pending),
            DONE => Ok(Status::Done(self.size.load(Ordering::Relaxed))),
            _ => Err(self
                .error
                .lock()
                .clone()
                .unwrap_or_else(|| Error::Internal("request failed".into()))),
        }
    }

    pub fn is_finished(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }
}
