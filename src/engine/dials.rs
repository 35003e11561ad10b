//! Pacing the replacement lanes of a failover storm. When a NIC fails under thousands of
//! comms, each opens lanes to every survivor at once: thousands of handshakes queued
//! behind the data on congested links, racing their deadlines and the peer's handshake
//! gate, and starving the probes that must tell healthy pairs from dead ones. So at most
//! [`PER_NIC`] replacement lanes per local NIC are in their handshake at a time; the rest
//! wait here, in order, without a socket, and their handshake deadline starts when they
//! are dialled. A lane that is its comm's only way back (the comm has no lane up and
//! none in its handshake) goes before those of comms already on their way, so that
//! every displaced comm resumes within a round or two of handshakes, and the rest of its
//! stripes follow. Probes and NCCL's own connects are not paced. No sockets, no clock.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// Replacement lanes one local NIC has in their handshake at once.
pub const PER_NIC: usize = 64;

#[derive(Debug, Default)]
pub(super) struct Dials {
    /// Lanes waiting to be dialled, oldest first, with their local NIC.
    waiting: VecDeque<(usize, usize)>,
    /// Lanes dialled and not yet through their handshake: (local NIC, lane).
    dialing: BTreeSet<(usize, usize)>,
    /// Lanes waiting, per local NIC.
    waiting_on: BTreeMap<usize, usize>,
    /// A lane waits on a NIC that had a slot free: the next turn must look, even if no
    /// handshake ended.
    look: bool,
    /// The NIC of every lane waiting or in its handshake here.
    nic_of: HashMap<usize, usize>,
}

impl Dials {
    /// Whether a new replacement lane on local NIC `nic` may be dialled now: none waits
    /// before it there, and fewer than [`PER_NIC`] are in their handshake.
    pub fn may_dial(&self, nic: usize) -> bool {
        !self.waiting_on.contains_key(&nic) && self.in_handshake(nic) < PER_NIC
    }

    fn in_handshake(&self, nic: usize) -> usize {
        self.dialing.range((nic, 0)..=(nic, usize::MAX)).count()
    }

    /// Lane `k` on `nic` was dialled.
    pub fn dialled(&mut self, nic: usize, k: usize) {
        self.dialing.insert((nic, k));
        self.nic_of.insert(k, nic);
    }

    /// Lane `k` on `nic` waits for its turn.
    pub fn wait(&mut self, nic: usize, k: usize) {
        self.look |= self.in_handshake(nic) < PER_NIC;
        self.waiting.push_back((nic, k));
        *self.waiting_on.entry(nic).or_default() += 1;
        self.nic_of.insert(k, nic);
    }

    /// Lane `k` is gone, and its key may be reused at once: an entry left behind would
    /// dial the next lane filed under that key from this lane's NIC (a replacement lane
    /// on another rail than the engine believes), or hold a handshake slot.
    pub fn forget(&mut self, k: usize) {
        let Some(nic) = self.nic_of.remove(&k) else {
            return;
        };
        if self.dialing.remove(&(nic, k)) {
            // A slot is free: the next turn must look.
            self.look = true;
            return;
        }
        if let Some(i) = self.waiting.iter().position(|&e| e == (nic, k)) {
            self.waiting.remove(i);
            if let Some(n) = self.waiting_on.get_mut(&nic) {
                *n -= 1;
                if *n == 0 {
                    self.waiting_on.remove(&nic);
                }
            }
        }
    }

    /// Forgets lanes that are through their handshake, failed or gone (`still(k)` false),
    /// and returns the waiting lanes that may be dialled now: first, in order, those that
    /// are their comm's only way back (`first(k, dialled)`, told the (NIC, lane) pairs
    /// already in their handshake), then the rest in order. They count as dialled from here on.
    pub fn turn(
        &mut self,
        still: impl Fn(usize) -> bool,
        first: impl Fn(usize, &BTreeSet<(usize, usize)>) -> bool,
    ) -> Vec<(usize, usize)> {
        let before = self.dialing.len();
        let nic_of = &mut self.nic_of;
        let mut keep = |k: usize| {
            let kept = still(k);
            if !kept {
                nic_of.remove(&k);
            }
            kept
        };
        self.dialing.retain(|&(_, k)| keep(k));
        // A turn dials while there is room, so a NIC is left either full or with nothing
        // waiting: only a handshake that ended (or a lane queued beside a free slot) lets
        // another go. Every other turn of a storm costs nothing more.
        if self.dialing.len() == before && !std::mem::take(&mut self.look) {
            return Vec::new();
        }
        self.waiting.retain(|&(_, k)| keep(k));
        let mut now = Vec::new();
        for urgent_pass in [true, false] {
            let mut left = VecDeque::with_capacity(self.waiting.len());
            while let Some((nic, k)) = self.waiting.pop_front() {
                let room = self.in_handshake(nic) < PER_NIC;
                let urgent = || first(k, &self.dialing);
                if room && (!urgent_pass || urgent()) {
                    self.dialing.insert((nic, k));
                    now.push((nic, k));
                } else {
                    left.push_back((nic, k));
                }
            }
            self.waiting = left;
        }
        self.waiting_on.clear();
        for &(nic, _) in &self.waiting {
            *self.waiting_on.entry(nic).or_default() += 1;
        }
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
        let plain = |_, _: &BTreeSet<(usize, usize)>| false;
        // Nothing finished: nothing more is dialled.
        let all = |_| true;
        assert_eq!(d.turn(all, plain), vec![]);
        assert_eq!(d.waiting(), 10);
        // Three handshakes end (lanes 0, 1, 2): the three oldest waiting go, in order.
        let done = |k: usize| k > 2;
        assert_eq!(d.turn(done, plain), vec![(0, 100), (0, 101), (0, 102)]);
        assert_eq!(d.waiting(), 7);
        // Nothing more finished: the turn looks at nothing, though a waiting lane is gone.
        let gone = |k: usize| k > 2 && k != 103;
        assert_eq!(d.turn(gone, plain), vec![]);
        assert_eq!(d.waiting(), 7);
        // One more ends (lane 3): the gone lane (its comm failed) is dropped, not
        // dialled, and the next goes.
        let gone = |k: usize| k > 3 && k != 103;
        assert_eq!(d.turn(gone, plain), vec![(0, 104)]);
        assert_eq!(d.waiting(), 5);
        // While lanes wait on NIC 0, a new one there queues behind them.
        assert!(!d.may_dial(0));
        // A lane queued beside a free slot (the lanes before it were all gone) is looked
        // at by the next turn, though no handshake ended.
        let mut d = Dials::default();
        d.dialled(1, 7);
        d.wait(1, 8);
        assert_eq!(d.turn(|_| true, plain), vec![(1, 8)]);
        assert_eq!(d.turn(|_| true, plain), vec![], "and then nothing more");
    }

    #[test]
    fn a_lane_gone_leaves_nothing_behind_for_the_next_lane_filed_under_its_key() {
        let plain = |_, _: &BTreeSet<(usize, usize)>| false;
        let mut d = Dials::default();
        for k in 0..PER_NIC {
            d.dialled(1, k);
        }
        // Lane 100 waits on NIC 1 and is dropped (its comm failed, or its stripe went
        // elsewhere); key 100 is reused at once for a lane on NIC 0, which may dial.
        d.wait(1, 100);
        d.forget(100);
        assert!(!d.may_dial(1), "NIC 1 is still full");
        assert!(d.may_dial(0));
        d.dialled(0, 100);
        // Handshakes end on NIC 1: nothing dials lane 100 again, from NIC 1 or at all.
        let done = |k: usize| k >= PER_NIC;
        assert_eq!(d.turn(done, plain), vec![]);
        assert_eq!(d.waiting(), 0);
        // A lane gone mid-handshake frees its slot, and the next turn fills it.
        let mut d = Dials::default();
        for k in 0..PER_NIC {
            d.dialled(0, k);
        }
        d.wait(0, 500);
        d.forget(3);
        assert_eq!(d.turn(|_| true, plain), vec![(0, 500)]);
        // Key 3, reused for a lane waiting on NIC 2, is that lane's alone.
        d.wait(2, 3);
        assert_eq!(d.turn(|_| true, plain), vec![(2, 3)]);
    }

    #[test]
    fn a_comms_only_way_back_goes_before_the_stripes_of_comms_on_their_way() {
        // Lanes 10 + 2c are comm c's on NIC 0; 11 + 2c, on NIC 1 (an even and an odd
        // key per comm). NIC 0's slots are full; on NIC 1 one is free.
        let mut d = Dials::default();
        for k in 0..PER_NIC {
            d.dialled(0, 1000 + k);
        }
        for k in 0..PER_NIC - 1 {
            d.dialled(1, 2000 + k);
        }
        for c in 0..4 {
            d.wait(0, 10 + 2 * c);
            d.wait(1, 11 + 2 * c);
        }
        let comm = |k: usize| (k - 10) / 2;
        // Comm 0's lane on NIC 0 waits, so on NIC 1 every comm's lane is its first way
        // back: the oldest (comm 0's) goes.
        let first = |k: usize, dialled: &BTreeSet<(usize, usize)>| {
            !dialled
                .iter()
                .any(|&(_, d)| (10..100).contains(&d) && comm(d) == comm(k))
        };
        assert_eq!(d.turn(|_| true, first), vec![(1, 11)]);
        // Two slots free on NIC 0: comm 0 already has a lane on its way (11), so comms 1
        // and 2 go first, though comm 0's lane waited longer.
        let done = |k: usize| k != 1000 && k != 1001;
        assert_eq!(d.turn(done, first), vec![(0, 12), (0, 14)]);
    }
}
