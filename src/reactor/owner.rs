//! Who runs the reactor's turns: one owner at a time, behind one lock.
//!
//! With `RAILOVER_PROGRESS=caller` (the default) the thread NCCL already spins in
//! (`isend`, `irecv`, `test`, `connect`, `accept`) runs a turn itself whenever the reactor
//! is free, so a command, a completion and the next write happen on that thread, with no
//! wake-up of another. The rules:
//! * a caller only ever *tries* the lock ([`Owner::try_drive`]); finding it taken, it goes
//!   on, and whoever holds it (or the reactor thread, nudged out of `epoll`) serves what
//!   the caller queued;
//! * callers run one turn per sweep: NCCL's proxy loop posts and tests the requests of
//!   all its comms in turn, so a `test` that comes back to a comm already tested since
//!   the last caller turn ends a sweep and runs the next turn ([`Call`]); posts and first
//!   looks leave what they queued to it, which batches the commands and writes of every
//!   comm in the sweep. A sweep defers the turn by at most [`SWEEP_LIMIT`], and no two
//!   caller turns come within [`CALLER_GAP`];
//! * a caller's turn never waits in `epoll` and serves at most [`CALLER_EVENTS`]
//!   readiness events, besides the engine's own per-turn bounds (connects dialled, bytes
//!   per lane): a failover's work spreads over many calls instead of landing in one;
//! * the reactor thread stays out of the way while callers drive ([`HANDOVER`]): it
//!   sleeps, off `epoll`, until no caller has driven or tried for that long, then takes
//!   the reactor and runs turns as it always has (timers, failover while NCCL is not
//!   polling, keepalives during a long GPU kernel), until a caller shows up again;
//! * a panic in anyone's turn is caught there: the reactor's state is dropped unread, the
//!   queue poisoned, one WARN; nothing crosses the C boundary and nobody hangs.
//!
//! With `RAILOVER_PROGRESS=thread` callers never drive: every turn is the thread's.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Reactor;
use crate::handoff::{panic_message, Call, CommandQueue, Drive};
use crate::transport::Fabric;

/// How long after a caller last drove (or tried to) the reactor thread keeps off it. A
/// proxy thread with requests in flight calls in every few microseconds; a gap this long
/// means NCCL stopped polling (its requests are done, a kernel runs), and timers must run.
/// It is also how often the idle thread looks, while callers drive: 200 cheap wake-ups a
/// second.
pub const HANDOVER: Duration = Duration::from_millis(5);

/// Readiness events one caller's turn serves; the rest stay in `epoll`'s ready list for
/// the next turn, whoever runs it.
pub const CALLER_EVENTS: usize = 64;

/// How long after a caller's turn ended a caller runs no turn of its own. NCCL's proxy
/// loop calls `isend`, `irecv` and `test` for every request in flight, a few hundred
/// nanoseconds apart; a turn for each costs an `epoll_wait` and a write per message,
/// where one turn a microsecond later serves them all together (one `writev` for the
/// messages a lane gained meanwhile). A microsecond is well under a message's round trip
/// on any fabric, so what a caller queued still leaves within its next few calls.
pub const CALLER_GAP: Duration = Duration::from_micros(1);

/// The longest a caller's sweep over its comms' requests defers the next turn. A proxy
/// loop over 64 comms, posting and testing on each, takes tens of microseconds; over
/// thousands, longer, and the turn then comes mid-sweep. A caller that only posts, or
/// looks at one comm once and leaves, is still served within it (or by the reactor
/// thread after [`HANDOVER`]). With 20 µs, 64 comms moved 8 B–4 KiB messages at 0.6–0.8×
/// the rate they reach with 100 µs; a comm alone turns every second look either way.
pub const SWEEP_LIMIT: Duration = Duration::from_micros(100);

/// The reactor and the record of who drives it.
pub(super) struct Owner<F: Fabric> {
    reactor: Mutex<Option<Reactor<F>>>,
    queue: Arc<CommandQueue>,
    /// When a caller last drove or tried to: nanoseconds after `epoch`, 0 for never.
    caller_at: AtomicU64,
    /// When a caller's last turn ended: nanoseconds after `epoch`, 0 for never.
    turned_at: AtomicU64,
    /// Caller turns run so far, from 1: the sweep marks of comms ([`Call::Test`]) hold
    /// the count at their last look.
    turns: AtomicU64,
    epoch: Instant,
}

impl<F: Fabric> Owner<F> {
    pub(super) fn new(reactor: Reactor<F>) -> Owner<F> {
        Owner {
            queue: reactor.queue.clone(),
            reactor: Mutex::new(Some(reactor)),
            caller_at: AtomicU64::new(0),
            turned_at: AtomicU64::new(0),
            turns: AtomicU64::new(1),
            epoch: Instant::now(),
        }
    }

    fn nanos(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.epoch).as_nanos() as u64).max(1)
    }

    fn mark_caller(&self, now: Instant) {
        self.caller_at.store(self.nanos(now), Ordering::Relaxed);
    }

    /// How long no caller has driven or tried to, at `now`; `None` if none ever has.
    fn callers_quiet_for(&self, now: Instant) -> Option<Duration> {
        let at = self.caller_at.load(Ordering::Relaxed);
        (at != 0).then(|| {
            let since = now.saturating_duration_since(self.epoch);
            since.saturating_sub(Duration::from_nanos(at))
        })
    }

    /// Whether callers drove within [`HANDOVER`] of `now`.
    fn callers_active(&self, now: Instant) -> bool {
        self.callers_quiet_for(now).is_some_and(|q| q < HANDOVER)
    }

    /// Runs `turn` on the reactor under the held lock, catching a panic. After a panic or
    /// a shutdown the reactor is gone from `slot`: `false` then, for "stop driving".
    fn guarded(&self, slot: &mut Option<Reactor<F>>, turn: impl FnOnce(&mut Reactor<F>)) -> bool {
        let Some(r) = slot.as_mut() else {
            return false;
        };
        match catch_unwind(AssertUnwindSafe(|| turn(r))) {
            Ok(()) if !r.shutdown => true,
            Ok(()) => {
                if let Some(mut r) = slot.take() {
                    r.close_everything();
                }
                // Anyone still waiting on a close: the comm is gone with the reactor.
                self.queue.stop();
                false
            }
            Err(panic) => {
                // A panic can leave a machine, a lane or the router half-updated, and
                // running on from there could deliver wrongly (P4). So the state is
                // dropped unread (closing every socket, so peers see the end at once)
                // and the queue is poisoned: requests in flight and every later call fail
                // with `ncclInternalError` instead of waiting forever (P5), and
                // `finalize` still joins the thread. Dropping touches no user memory; a
                // panic in some Drop must not stop the poisoning.
                let message = panic_message(&*panic);
                let r = slot.take();
                let _ = catch_unwind(AssertUnwindSafe(move || drop(r)));
                self.queue.poison(message);
                false
            }
        }
    }

    /// The reactor thread: runs turns whenever no caller drives, until shutdown or a
    /// panic. `callers`: whether callers may drive at all.
    pub(super) fn run_thread(&self, callers: bool) {
        loop {
            if callers {
                let now = Instant::now();
                if let Some(quiet) = self.callers_quiet_for(now).filter(|q| *q < HANDOVER) {
                    // Off `epoll` too: the events are the callers' to serve. A shutdown
                    // unparks this thread.
                    std::thread::park_timeout(HANDOVER - quiet);
                    continue;
                }
            }
            let mut slot = self.reactor.lock();
            loop {
                if !self.guarded(&mut slot, Reactor::thread_turn) {
                    return;
                }
                // Hand over as soon as a caller shows up (it nudged us out of `epoll`).
                if callers && self.callers_active(Instant::now()) {
                    break;
                }
            }
        }
    }
}

impl<F: Fabric> Drive for Owner<F> {
    fn try_drive(&self, call: Call<'_>) {
        let now = Instant::now();
        self.mark_caller(now);
        let at = self.turned_at.load(Ordering::Relaxed);
        let sweeping = match call {
            Call::Other => false,
            Call::Post => true,
            Call::Test(mark) => first_look(mark, self.turns.load(Ordering::Relaxed)),
        };
        if !due(at, self.nanos(now), sweeping) {
            // The caller's next call (NCCL's loop comes back within microseconds), or
            // the one that ends its sweep, runs the turn.
            return;
        }
        let Some(mut slot) = self.reactor.try_lock() else {
            // Taken: by another caller, who serves our commands too, or by the thread,
            // perhaps parked in `epoll`; wake it so it hands over.
            self.queue.nudge();
            return;
        };
        self.guarded(&mut slot, |r| r.caller_turn(now));
        self.turns.fetch_add(1, Ordering::Relaxed);
        self.turned_at
            .store(self.nanos(Instant::now()), Ordering::Relaxed);
    }
}

/// Whether a turn that ended at `at` (nanoseconds, 0 for none yet) is less than `gap`
/// before `now`.
fn within(at: u64, now: u64, gap: Duration) -> bool {
    at != 0 && now.saturating_sub(at) < gap.as_nanos() as u64
}

/// Whether a caller runs a turn at `now`, the last caller turn having ended at `at`: never
/// within [`CALLER_GAP`]; in the middle of a sweep (`sweeping`) only once
/// [`SWEEP_LIMIT`] has passed.
fn due(at: u64, now: u64, sweeping: bool) -> bool {
    let gap = if sweeping { SWEEP_LIMIT } else { CALLER_GAP };
    !within(at, now, gap)
}

/// Whether this `test` is the caller's first look at the comm with `mark` since caller
/// turn `turns` ran (the sweep goes on), rather than a return to it (the sweep is done).
/// Records the look.
fn first_look(mark: &AtomicU64, turns: u64) -> bool {
    mark.swap(turns, Ordering::Relaxed) != turns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_runs_a_turn_unless_one_ended_within_the_gap() {
        let gap = CALLER_GAP.as_nanos() as u64;
        assert!(
            !within(0, 5, CALLER_GAP),
            "no turn yet: the first caller turns"
        );
        assert!(within(1_000, 1_000, CALLER_GAP));
        assert!(within(1_000, 1_000 + gap - 1, CALLER_GAP));
        assert!(!within(1_000, 1_000 + gap, CALLER_GAP), "the gap passed");
        // Another thread's clock read just before the turn's end: still within.
        assert!(within(1_000, 900, CALLER_GAP));
    }

    #[test]
    fn a_sweep_over_comms_runs_one_turn_when_the_caller_comes_back_to_a_comm() {
        let limit = SWEEP_LIMIT.as_nanos() as u64;
        let (a, b, c) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        // Caller turn 1 ended at t=1 ms; the caller then tests comms a, b, c in turn.
        let (turns, at) = (1, 1_000_000);
        let gap = CALLER_GAP.as_nanos() as u64;
        for (mark, t) in [(&a, at + gap), (&b, at + 2 * gap), (&c, at + 3 * gap)] {
            assert!(first_look(mark, turns));
            assert!(!due(at, t, true), "mid-sweep: no turn");
        }
        // Back at a: the sweep is over, and a turn is due past the caller gap.
        assert!(!first_look(&a, turns));
        assert!(due(at, at + 4 * gap, false));
        // A sweep longer than the limit still gets a turn in its middle.
        assert!(first_look(&b, turns + 1));
        assert!(due(at, at + limit, true));
        assert!(!due(at, at + limit - 1, true));
        // One comm alone: every second look at it turns.
        let solo = AtomicU64::new(0);
        assert!(first_look(&solo, 7));
        assert!(!first_look(&solo, 7));
        assert!(first_look(&solo, 8), "after the turn, a new sweep");
        // `connect`, `accept`: only the caller gap holds them back.
        assert!(!due(at, at + 1, false));
        assert!(due(0, 5, true), "no caller turn yet");
    }
}
