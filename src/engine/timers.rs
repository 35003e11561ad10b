//! The lanes' timers in one structure: each lane's next deadline (its handshake, linger,
//! keepalive or silence limit, whichever its machine says is first) in a heap, so a turn
//! looks only at the lanes that are due instead of every lane. Thousands of comms keep
//! thousands of lanes, each with a keepalive every quarter of the completion timeout:
//! scanning them all at every deadline cost a fifth of a core at 1,024 idle comms.
//!
//! A lane has at most one live entry, the earliest deadline armed for it; arming a
//! later one changes nothing, since the lane is then looked at early and armed again
//! with what its machine says. Entries of lanes that were re-armed earlier or forgotten
//! are skipped when they come up. No clock reads: `now` is an argument.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

#[derive(Debug, Default)]
pub(super) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Per lane key: the deadline of its live entry.
    live: Vec<Option<Instant>>,
}

impl Timers {
    /// Lane `k` must be looked at by `at`.
    pub fn arm(&mut self, k: usize, at: Instant) {
        if self.live.len() <= k {
            self.live.resize(k + 1, None);
        }
        if !self.live[k].is_some_and(|t| at >= t) {
            self.live[k] = Some(at);
            self.heap.push(Reverse((at, k)));
        }
    }

    /// Lane `k` is gone (its key may be reused).
    pub fn forget(&mut self, k: usize) {
        if let Some(t) = self.live.get_mut(k) {
            *t = None;
        }
    }

    /// The next lane due at `now`, taken off the heap: look at it, then arm it again.
    pub fn pop_due(&mut self, now: Instant) -> Option<usize> {
        while let Some(&Reverse((t, k))) = self.heap.peek() {
            if t > now {
                return None;
            }
            self.heap.pop();
            if self.live.get(k).copied().flatten() == Some(t) {
                self.live[k] = None;
                return Some(k);
            }
        }
        None
    }

    /// When the next entry comes up (perhaps one that turns out stale: an early look).
    pub fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|r| r.0 .0)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_due_lanes_come_up_each_once_at_their_earliest_deadline() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut t = Timers::default();
        t.arm(3, t0 + 30 * ms);
        t.arm(1, t0 + 10 * ms);
        t.arm(2, t0 + 20 * ms);
        // A later deadline for a lane already armed earlier adds nothing.
        t.arm(1, t0 + 50 * ms);
        assert_eq!(t.len(), 3);
        // An earlier one replaces it; the old entry is skipped when it comes up.
        t.arm(3, t0 + 5 * ms);
        assert_eq!(t.next(), Some(t0 + 5 * ms));
        assert_eq!(t.pop_due(t0 + 4 * ms), None);
        assert_eq!(t.pop_due(t0 + 20 * ms), Some(3));
        assert_eq!(t.pop_due(t0 + 20 * ms), Some(1));
        // Lane 2 was forgotten (and its key reused with a later deadline).
        t.forget(2);
        t.arm(2, t0 + 40 * ms);
        assert_eq!(
            t.pop_due(t0 + 35 * ms),
            None,
            "2's old entry and 3's stale one"
        );
        assert_eq!(t.pop_due(t0 + 40 * ms), Some(2));
        assert_eq!(t.pop_due(t0 + 1000 * ms), None);
        assert_eq!(t.next(), None);
        // Once taken, a lane can be armed again at any time.
        t.arm(1, t0 + 60 * ms);
        assert_eq!(t.pop_due(t0 + 60 * ms), Some(1));
    }
}
