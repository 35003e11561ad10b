//! Pacing the replacement lanes of a failover storm. When a NIC fails under thousands of
//! comms, each opens lanes to every survivor at once: thousands of handshakes queued
//! behind the data on congested links, racing their deadlines and the peer's handshake
//! gate, and starving the probes that must tell healthy pairs from dead ones. So at most
//! [`PER_NIC`] replacement lanes per local NIC are in their handshake at a time; the rest
//! wait here, in order, without a socket, and their handshake deadline starts when they
//! are dialled. Probes and NCCL's own connects are not paced. No sockets, no clock.

use std::collections::{BTreeSet, VecDeque};

/// Replacement lanes one local NIC has in their handshake at once.
pub const PER_NIC: usize = 32;

#[derive(Debug, Default)]
pub(super) struct Dials {
    /// Lanes waiting to be dialled, oldest first, with their local NIC.
    waiting: VecDeque<(usize, usize)>,
    /// Lanes dialled and not yet through their handshake: (local NIC, lane).
    dialing: BTreeSet<(usize, usize)>,
}

impl Dials {
    /// Whether a new replacement lane on local NIC `nic` may be dialled now: none waits
    /// before it there, and fewer than [`PER_NIC`] are in their handshake.
    pub fn may_dial(&self, nic: usize) -> bool {
        !self.waiting.iter().any(|&(n, _)| n == nic) && self.in_handshake(nic) < PER_NIC
    }

    fn in_handshake(&self, nic: usize) -> usize {
        self.dialing.range((nic, 0)..=(nic, usize::MAX)).count()
    }

    /// Lane `k` on `nic` was dialled.
    pub fn dialled(&mut self, nic: usize, k: usize) {
        self.dialing.insert((nic, k));
    }

    /// Lane `k` on `nic` waits for its turn.
    pub fn wait(&mut self, nic: usize, k: usize) {
        self.waiting.push_back((nic, k));
    }

    /// Forgets lanes that are through their handshake, failed or gone (`still(k)` false),
    /// and returns the waiting lanes that may be dialled now, in order; they count as
    /// dialled from here on.
    pub fn turn(&mut self, still: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
        self.dialing.retain(|&(_, k)| still(k));
        self.waiting.retain(|&(_, k)| still(k));
        let mut now = Vec::new();
        let mut left = VecDeque::with_capacity(self.waiting.len());
        while let Some((nic, k)) = self.waiting.pop_front() {
            if self.in_handshake(nic) < PER_NIC {
                self.dialing.insert((nic, k));
                now.push((nic, k));
            } else {
                left.push_back((nic, k));
            }
        }
        self.waiting = left;
        now
    }

    /// Nothing dialled, nothing waiting.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.dialing.is_empty()
    }

    /// Lanes waiting for their turn.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_nic_has_at_most_its_share_in_handshake_and_the_rest_go_in_order() {
        let mut d = Dials::default();
        for k in 0..PER_NIC {
            assert!(d.may_dial(0));
            d.dialled(0, k);
        }
        assert!(!d.may_dial(0), "NIC 0 is full");
        assert!(d.may_dial(1), "NIC 1 is not");
        for k in 100..110 {
            d.wait(0, k);
        }
        // Nothing finished: nothing more is dialled.
        let all = |_| true;
        assert_eq!(d.turn(all), vec![]);
        assert_eq!(d.waiting(), 10);
        // Three handshakes end (lanes 0, 1, 2): the three oldest waiting go, in order.
        let done = |k: usize| k > 2;
        assert_eq!(d.turn(done), vec![(0, 100), (0, 101), (0, 102)]);
        assert_eq!(d.waiting(), 7);
        // A waiting lane that is gone (its comm failed) is dropped, not dialled.
        let gone = |k: usize| k > 2 && k != 103;
        assert_eq!(d.turn(gone), vec![]);
        assert_eq!(d.waiting(), 6);
        // While lanes wait on NIC 0, a new one there queues behind them.
        assert!(!d.may_dial(0));
    }
}
