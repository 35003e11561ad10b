//! Requests: the only state NCCL's progress thread and the reactor share per message.
//!
//! The reactor writes the outcome once (size, then state with `Release`); `test` reads
//! the state with `Acquire` and never blocks. A grouped receive is one request over
//! several buffers: each is settled on its own, and the request finishes with the last.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::comm::{CommShared, MAX_RECVS};
use super::Error;

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// One `isend` or `irecv` as NCCL sees it.
#[derive(Debug)]
pub struct Request {
    state: AtomicU8,
    /// Bytes of each buffer, the first `count`.
    sizes: [AtomicU64; MAX_RECVS],
    count: usize,
    /// Buffers not yet settled.
    unsettled: AtomicUsize,
    /// The first failure of a buffer, or of the whole request.
    error: Mutex<Option<Error>>,
    /// The comm, so that `test` can free the request slot it holds.
    pub(crate) comm: Arc<CommShared>,
    /// Whether it holds one of the comm's request slots (an `isend`/`irecv` does; an
    /// `iflush` does not).
    pub(crate) slot: bool,
    /// A request `test` finishes itself, by asking this until it says done (a flush).
    poll: Option<Mutex<Poller>>,
}

/// What a polled request asks: `Ok(true)` once done.
pub struct Poller(pub Box<dyn FnMut() -> Result<bool, Error> + Send>);

impl std::fmt::Debug for Poller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Poller")
    }
}

/// What `test` reports.
#[derive(Debug, PartialEq, Eq)]
pub enum Status {
    Pending,
    /// Done, with the number of bytes sent or received.
    Done(u64),
}

impl Request {
    #[cfg(test)]
    pub(crate) fn new(comm: Arc<CommShared>) -> Request {
        Request::group(comm, 1)
    }

    /// A request over `count` buffers (1 to [`MAX_RECVS`]).
    pub(crate) fn group(comm: Arc<CommShared>, count: usize) -> Request {
        assert!((1..=MAX_RECVS).contains(&count), "{count} buffers");
        Request {
            state: AtomicU8::new(PENDING),
            sizes: Default::default(),
            count,
            unsettled: AtomicUsize::new(count),
            error: Mutex::new(None),
            comm,
            slot: true,
            poll: None,
        }
    }

    /// A request without a slot that `test` finishes by calling `poll` (an `iflush`).
    pub(crate) fn polled(comm: Arc<CommShared>, poll: Poller) -> Request {
        Request {
            slot: false,
            poll: Some(Mutex::new(poll)),
            ..Request::group(comm, 1)
        }
    }

    /// A polled request's progress, asked by `test`: settled when its poller says done
    /// or fails.
    pub(crate) fn progress(&self) {
        let Some(p) = &self.poll else {
            return;
        };
        if self.is_finished() {
            return;
        }
        match (p.lock().0)() {
            Ok(true) => self.settle(0, Ok(0)),
            Ok(false) => {}
            Err(e) => self.fail(e),
        }
    }

    /// Reactor side: buffer `sub` finished with its size or failed. The request
    /// finishes once every buffer has, failed if any did: until then the reactor may
    /// still write into the others, so NCCL must not get them back.
    pub(crate) fn settle(&self, sub: usize, outcome: Result<u64, Error>) {
        match outcome {
            Ok(size) => self.sizes[sub].store(size, Ordering::Relaxed),
            Err(e) => {
                self.error.lock().get_or_insert(e);
            }
        }
        if self.unsettled.fetch_sub(1, Ordering::AcqRel) == 1 {
            let state = if self.error.lock().is_some() {
                FAILED
            } else {
                DONE
            };
            self.state.store(state, Ordering::Release);
        }
    }

    /// The request failed as a whole (before the reactor got it, or after the
    /// reactor is gone).
    pub(crate) fn fail(&self, error: Error) {
        *self.error.lock() = Some(error);
        self.state.store(FAILED, Ordering::Release);
    }

    /// NCCL side: the current outcome, without blocking.
    pub fn status(&self) -> Result<Status, Error> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(Status::Pending),
            DONE => Ok(Status::Done(self.sizes[0].load(Ordering::Relaxed))),
            _ => Err(self
                .error
                .lock()
                .clone()
                .unwrap_or_else(|| Error::Internal("request failed".into()))),
        }
    }

    /// Buffers the request holds: 1, or a grouped receive's `n`.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Once done: the bytes each buffer got (a send's or single receive's is the one).
    pub fn sizes(&self) -> impl Iterator<Item = u64> + '_ {
        self.sizes[..self.count]
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
    }

    pub fn is_finished(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }
}

#[cfg(test)]
mod tests {
    use mio::{Poll, Token, Waker};

    use super::*;
    use crate::handoff::{CommandQueue, Side};

    fn comm() -> Arc<CommShared> {
        let poll = Poll::new().unwrap();
        let q = Arc::new(CommandQueue::new(
            Waker::new(poll.registry(), Token(0)).unwrap(),
        ));
        Arc::new(CommShared::new(
            Side::Recv,
            0,
            q,
            0,
            std::time::Duration::from_secs(10),
        ))
    }

    #[test]
    fn a_polled_request_is_done_when_its_poller_says_and_holds_no_slot() {
        let mut answers = vec![Ok(true), Ok(false), Ok(false)];
        let r = Request::polled(comm(), Poller(Box::new(move || answers.pop().unwrap())));
        assert!(!r.slot, "an iflush takes none of the comm's request slots");
        for _ in 0..2 {
            r.progress();
            assert_eq!(r.status(), Ok(Status::Pending));
        }
        r.progress();
        assert_eq!(r.status(), Ok(Status::Done(0)));
        r.progress(); // not asked again once done
        let r = Request::polled(
            comm(),
            Poller(Box::new(|| Err(Error::System("READ failed".into())))),
        );
        r.progress();
        assert_eq!(r.status(), Err(Error::System("READ failed".into())));
        assert!(Request::group(comm(), 1).slot);
    }

    #[test]
    fn a_grouped_request_finishes_with_its_last_buffer_and_fails_if_one_did() {
        let r = Request::group(comm(), 3);
        r.settle(2, Ok(7));
        r.settle(0, Ok(0));
        assert_eq!(
            r.status(),
            Ok(Status::Pending),
            "buffer 1 is still arriving"
        );
        r.settle(1, Ok(4));
        assert_eq!(r.status(), Ok(Status::Done(0)));
        assert_eq!(r.sizes().collect::<Vec<_>>(), vec![0, 4, 7]);

        let r = Request::group(comm(), 2);
        r.settle(0, Err(Error::InvalidUsage("too big".into())));
        assert!(!r.is_finished(), "the other buffer may still be written");
        r.settle(1, Ok(1));
        assert_eq!(r.status(), Err(Error::InvalidUsage("too big".into())));
    }
}
