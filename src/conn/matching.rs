//! Which posted receive a send fills: NCCL's IB transport's rules, decided at the sender.
//!
//! NCCL's core and every plugin test written against it expect what `ncclIbIsend`
//! (`src/transport/net_ib/p2p.cc`) does, and `conn::ib_model` (tests) transcribes it:
//!
//! * a send looks only at the oldest posted receive that is not fully matched (the head
//!   of the receiver's clear-to-send FIFO);
//! * it takes the first buffer of that group that is still free and whose tag equals the
//!   send's tag, for a group of one too;
//! * when there is none (the receive is not posted yet, or no free buffer has the tag),
//!   `isend` answers "not now" (`*request = NULL`): the caller tries again later and the
//!   comm goes on;
//! * the head moves to the next group once every buffer of the head group is matched;
//! * a send larger than its buffer is cut to the buffer's size, and both ends report
//!   the size that moved.
//!
//! The receiver announces each buffer of a grouped receive by its own `Cts` (see
//! [`Group`]); the reactor feeds them to [`Matcher::announce`], in any order and as often
//! as lanes repeat them, and NCCL's thread asks [`Matcher::claim`] inside `isend`. A
//! send is only ever handed to the reactor with its receive chosen, so nothing waits in a
//! queue of unmatched sends (which would deadlock a receiver that posts a group the next
//! send does not belong to).
//!
//! No sockets, no threads, no clock reads: time is an argument.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::wire::{Group, MAX_GROUP};
use super::ConnError;

/// How far beyond the head group a receive may be announced: sixteen times what NCCL can
/// have posted (`NCCL_NET_MAX_REQUESTS` receives of up to [`MAX_GROUP`] buffers each), a
/// bound on what a confused peer can make us store.
pub const WINDOW: u64 = 16 * 32 * MAX_GROUP as u64;

/// Distinct tags a stall remembers for its diagnostic.
const STALL_TAGS: usize = 16;

/// One announced buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    capacity: u64,
    group: Group,
    /// A send was matched to it.
    taken: bool,
}

impl Slot {
    /// The sequence numbers of its group, when it is announced as `seq`.
    fn group_range(&self, seq: u64) -> std::ops::Range<u64> {
        let first = seq - u64::from(self.group.index);
        first..first + u64::from(self.group.count)
    }
}

/// The receive a send was matched to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matched {
    /// Its sequence number: the receive the send's payload fills.
    pub seq: u64,
    /// The buffer's size: a larger send is cut to it.
    pub capacity: u64,
}

/// Sends refused while the head group was posted, since the last match.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stall {
    since: Instant,
    tags: BTreeSet<i32>,
}

/// A stall that lasted past the caller's bound: what the WARN names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overdue {
    pub waited: Duration,
    /// Tags of the sends refused meanwhile (at most 16).
    pub tags: Vec<i32>,
    /// The head group: its first sequence number, its size and the tags of its free
    /// buffers.
    pub first: u64,
    pub count: u8,
    pub free: Vec<i32>,
}

impl std::fmt::Display for Overdue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sends with tags {:?} have found no matching receive for {:.1} s: the oldest posted receive (receives {}..{}, a group of {}) has free buffers only for tags {:?}",
            self.tags,
            self.waited.as_secs_f64(),
            self.first,
            self.first + u64::from(self.count),
            self.count,
            self.free
        )
    }
}

/// The sender's view of the receives its peer posted, and which send took which.
#[derive(Debug, Default)]
pub struct Matcher {
    /// Buffers announced from `head` on, by sequence number.
    slots: BTreeMap<u64, Slot>,
    /// First sequence number of the head group (IB's `fifoHead`): every receive below it
    /// is matched.
    head: u64,
    stall: Option<Stall>,
    /// A stall was reported already: one report per comm.
    reported: bool,
}

impl Matcher {
    /// The receiver posted receive `seq` with `capacity` bytes, as buffer `group.index`
    /// of a group. A repeat (the receiver announces again after a lane change, or over
    /// several lanes) changes nothing; one that contradicts what was announced, or a
    /// group that overlaps another, is a protocol error.
    pub fn announce(&mut self, seq: u64, capacity: u64, group: Group) -> Result<(), ConnError> {
        if seq < self.head {
            return Ok(()); // matched already: a repeat
        }
        if seq >= self.head + WINDOW {
            return Err(ConnError::Protocol(format!(
                "CTS for {seq}, far beyond the oldest unmatched receive {}",
                self.head
            )));
        }
        if group.count == 0 || group.count > MAX_GROUP || group.index >= group.count {
            return Err(ConnError::Protocol(format!("CTS for {seq} in {group:?}")));
        }
        let slot = Slot {
            capacity,
            group,
            taken: false,
        };
        if let Some(s) = self.slots.get(&seq) {
            if (s.capacity, s.group) != (capacity, group) {
                return Err(ConnError::Protocol(format!(
                    "CTS for {seq} announced {} bytes in {:?}, now {capacity} in {group:?}",
                    s.capacity, s.group
                )));
            }
            return Ok(());
        }
        let range = slot.group_range(seq);
        if range.start < self.head {
            return Err(ConnError::Protocol(format!(
                "CTS for {seq} places it in {group:?}, across the matched receives below {}",
                self.head
            )));
        }
        // Groups tile the sequence numbers: another buffer's group is this one or lies
        // beside it. Only buffers within a group's length can overlap it.
        let near =
            range.start.saturating_sub(u64::from(MAX_GROUP))..range.end + u64::from(MAX_GROUP);
        for (&other, s) in self.slots.range(near) {
            let theirs = s.group_range(other);
            if theirs != range && theirs.start < range.end && range.start < theirs.end {
                return Err(ConnError::Protocol(format!(
                    "CTS for {seq} places it in {group:?}, across the group {}..{} of receive {other}",
                    theirs.start, theirs.end
                )));
            }
        }
        self.slots.insert(seq, slot);
        Ok(())
    }

    /// A send with `tag` asks for its receive at `now`: the first free buffer of the head
    /// group whose tag is `tag`, or `None` ("not now"; the caller asks again).
    pub fn claim(&mut self, tag: i32, now: Instant) -> Option<Matched> {
        let Some(count) = self.head_group() else {
            self.stall = None; // nothing posted yet: a slow peer, not a mismatch
            return None;
        };
        let end = self.head + u64::from(count);
        let found = (self.slots.range_mut(self.head..end))
            .find(|(_, s)| !s.taken && s.group.tag == tag)
            .map(|(&seq, s)| {
                s.taken = true;
                Matched {
                    seq,
                    capacity: s.capacity,
                }
            });
        let Some(m) = found else {
            let stall = self.stall.get_or_insert_with(|| Stall {
                since: now,
                tags: BTreeSet::new(),
            });
            if stall.tags.len() < STALL_TAGS {
                stall.tags.insert(tag);
            }
            return None;
        };
        self.stall = None;
        if self.slots.range(self.head..end).all(|(_, s)| s.taken) {
            self.slots = self.slots.split_off(&end);
            self.head = end;
        }
        Some(m)
    }

    /// The head group's size once all of its buffers are announced.
    fn head_group(&self) -> Option<u8> {
        let count = self.slots.get(&self.head)?.group.count;
        let end = self.head + u64::from(count);
        (self.slots.range(self.head..end).count() == usize::from(count)).then_some(count)
    }

    /// Sends have been refused for `bound` or longer while the head group was posted
    /// without a free buffer for their tags: the first time only, what to report. A
    /// mismatch that never resolves is a caller bug (NCCL's IB transport would hang);
    /// the comm stays open, since the matching receive may still come.
    pub fn overdue(&mut self, now: Instant, bound: Duration) -> Option<Overdue> {
        let stall = self.stall.as_ref()?;
        let waited = now.saturating_duration_since(stall.since);
        if self.reported || waited < bound {
            return None;
        }
        let count = self.head_group()?;
        self.reported = true;
        let end = self.head + u64::from(count);
        Some(Overdue {
            waited,
            tags: stall.tags.iter().copied().collect(),
            first: self.head,
            count,
            free: (self.slots.range(self.head..end))
                .filter(|(_, s)| !s.taken)
                .map(|(_, s)| s.group.tag)
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::ib_model::IbModel;
    use super::*;
    use crate::routing::rng::SplitMix64;

    fn group(tag: i32, index: u8, count: u8) -> Group {
        Group { tag, index, count }
    }

    /// Announces a group of `tags` from `first`, every buffer `cap` bytes.
    fn post(m: &mut Matcher, first: u64, tags: &[i32], cap: u64) {
        let count = tags.len() as u8;
        for (i, &tag) in tags.iter().enumerate() {
            m.announce(first + i as u64, cap, group(tag, i as u8, count))
                .unwrap();
        }
    }

    fn seq(m: Option<Matched>) -> Option<u64> {
        m.map(|m| m.seq)
    }

    #[test]
    fn a_send_takes_the_first_free_buffer_of_the_head_group_with_its_tag() {
        let t0 = Instant::now();
        let mut m = Matcher::default();
        assert_eq!(m.claim(3, t0), None, "nothing posted");
        post(&mut m, 0, &[5, 3, 3, 9], 100);
        assert_eq!(seq(m.claim(3, t0)), Some(1));
        assert_eq!(seq(m.claim(3, t0)), Some(2));
        assert_eq!(m.claim(3, t0), None, "no free buffer has tag 3");
        assert_eq!(seq(m.claim(9, t0)), Some(3));
        assert_eq!(seq(m.claim(5, t0)), Some(0));
        assert_eq!(m.claim(5, t0), None, "the group is spent; nothing after it");
    }

    #[test]
    fn a_group_of_one_matches_by_tag_too() {
        let t0 = Instant::now();
        let mut m = Matcher::default();
        post(&mut m, 0, &[8], 64);
        post(&mut m, 1, &[0, 1, 2, 3, 4, 5, 6, 7], 64);
        // Sends for the group behind wait: the head is the single receive of tag 8.
        for tag in 0..8 {
            assert_eq!(m.claim(tag, t0), None);
        }
        assert_eq!(seq(m.claim(8, t0)), Some(0));
        for tag in (0..8).rev() {
            assert_eq!(seq(m.claim(tag, t0)), Some(1 + tag as u64));
        }
    }

    #[test]
    fn the_head_moves_only_once_every_buffer_of_its_group_is_matched() {
        let t0 = Instant::now();
        let mut m = Matcher::default();
        post(&mut m, 0, &[0, 1], 8);
        post(&mut m, 2, &[0, 1], 8);
        assert_eq!(seq(m.claim(1, t0)), Some(1));
        // Tag 1 is taken in the head group; the next group's tag 1 waits for the head.
        assert_eq!(m.claim(1, t0), None);
        assert_eq!(seq(m.claim(0, t0)), Some(0));
        assert_eq!(seq(m.claim(1, t0)), Some(3));
        assert_eq!(seq(m.claim(0, t0)), Some(2));
    }

    #[test]
    fn a_group_is_matched_only_once_all_its_buffers_are_announced() {
        let t0 = Instant::now();
        let mut m = Matcher::default();
        m.announce(1, 8, group(7, 1, 2)).unwrap();
        assert_eq!(m.claim(7, t0), None, "buffer 0 not announced yet");
        m.announce(0, 8, group(6, 0, 2)).unwrap();
        assert_eq!(seq(m.claim(7, t0)), Some(1));
    }

    #[test]
    fn the_capacity_comes_with_the_match() {
        let mut m = Matcher::default();
        post(&mut m, 0, &[1, 2], 10);
        m.announce(2, 4, group(0, 0, 1)).unwrap();
        let now = Instant::now();
        assert_eq!(
            m.claim(2, now),
            Some(Matched {
                seq: 1,
                capacity: 10
            })
        );
        m.claim(1, now).unwrap();
        assert_eq!(
            m.claim(0, now),
            Some(Matched {
                seq: 2,
                capacity: 4
            })
        );
    }

    #[test]
    fn repeats_are_ignored_and_contradictions_are_protocol_errors() {
        let t0 = Instant::now();
        let mut m = Matcher::default();
        post(&mut m, 0, &[1, 2], 8);
        post(&mut m, 0, &[1, 2], 8);
        m.claim(1, t0).unwrap();
        m.claim(2, t0).unwrap();
        // Matched and retired: announced again after a lane change, ignored.
        post(&mut m, 0, &[1, 2], 8);
        let bad = |m: &mut Matcher, seq, cap, g| {
            assert!(
                matches!(m.announce(seq, cap, g), Err(ConnError::Protocol(_))),
                "{seq} {cap} {g:?}"
            );
        };
        m.announce(2, 8, group(0, 0, 3)).unwrap();
        bad(&mut m, 2, 9, group(0, 0, 3)); // another capacity
        bad(&mut m, 2, 8, group(1, 0, 3)); // another tag
        bad(&mut m, 3, 8, group(0, 0, 2)); // inside the group of 3 from 2
        bad(&mut m, 5, 8, group(0, 2, 3)); // a group from 3, across it
        bad(&mut m, 2 + WINDOW, 8, group(0, 0, 1)); // far beyond the head
        bad(&mut m, 3, 8, group(0, 2, 3)); // a group from 1, below the head
        bad(&mut m, 9, 8, group(0, 3, 3)); // no such place in a group
        m.announce(4, 8, group(0, 2, 3)).unwrap();
        m.announce(5, 8, group(0, 0, 1)).unwrap();
    }

    #[test]
    fn a_stall_is_reported_once_after_its_bound_with_what_waits_and_what_is_free() {
        let t0 = Instant::now();
        let bound = Duration::from_secs(10);
        let mut m = Matcher::default();
        // Nothing posted: a slow peer is not a mismatch.
        assert_eq!(m.claim(4, t0), None);
        assert_eq!(m.overdue(t0 + bound * 2, bound), None);
        post(&mut m, 0, &[1, 2], 8);
        assert_eq!(m.claim(4, t0 + bound), None);
        assert_eq!(m.claim(3, t0 + bound), None);
        assert_eq!(
            m.overdue(t0 + bound * 2 - Duration::from_millis(1), bound),
            None
        );
        let o = m
            .overdue(t0 + bound * 2, bound)
            .expect("overdue at the bound");
        assert_eq!(o.tags, [3, 4]);
        assert_eq!((o.first, o.count, o.free.as_slice()), (0, 2, &[1, 2][..]));
        assert_eq!(o.waited, bound);
        assert!(o.to_string().contains("tags [3, 4]"), "{o}");
        assert_eq!(m.overdue(t0 + bound * 9, bound), None, "once per comm");
        // A match ends a stall; the comm carries on.
        assert_eq!(seq(m.claim(2, t0 + bound * 9)), Some(1));
    }

    #[test]
    fn a_match_resets_the_stall_clock() {
        let t0 = Instant::now();
        let bound = Duration::from_secs(1);
        let mut m = Matcher::default();
        post(&mut m, 0, &[1, 2], 8);
        assert_eq!(m.claim(9, t0), None);
        m.claim(1, t0 + bound / 2).unwrap();
        assert_eq!(m.claim(9, t0 + bound), None);
        assert_eq!(m.overdue(t0 + bound, bound), None);
        assert!(m.overdue(t0 + bound * 2, bound).is_some());
    }

    /// One random run: a receiver posting groups, a sender retrying sends after "not
    /// now", the announcements reaching the sender late, out of order and repeated.
    /// Every send the matcher takes must land where NCCL's IB transport puts it, with the
    /// size it reports; with everything announced, "not now" must agree too.
    fn random_run(seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let mut pick = |n: u64| rng.next_u64() % n;
        let now = Instant::now();
        let mut model = IbModel::default();
        let mut m = Matcher::default();
        // Per group: its first sequence number and the model's receive id.
        let mut groups: Vec<(u64, u64)> = Vec::new();
        let mut next_seq = 0u64;
        // Announcements not yet delivered to the sender.
        let mut unheard: Vec<(u64, u64, Group)> = Vec::new();
        // Sends NCCL has not posted yet (tag, size), in the order it will try them.
        let mut sends: Vec<(i32, u64)> = Vec::new();
        let tags_per_run = 1 + pick(4) as i32;
        let mut done = 0usize;
        for _ in 0..2000 {
            match pick(6) {
                0 if groups.len() < 40 => {
                    let n = 1 + pick(8) as usize;
                    let bufs: Vec<(i32, u64)> = (0..n)
                        .map(|_| (pick(tags_per_run as u64) as i32, pick(100)))
                        .collect();
                    let id = model.irecv(&bufs);
                    for (i, &(tag, cap)) in bufs.iter().enumerate() {
                        let g = group(tag, i as u8, n as u8);
                        unheard.push((next_seq + i as u64, cap, g));
                        // This receive's sends, in a random order later.
                        sends.push((tag, pick(150)));
                    }
                    groups.push((next_seq, id));
                    next_seq += n as u64;
                }
                1 | 2 if !unheard.is_empty() => {
                    let i = pick(unheard.len() as u64) as usize;
                    let (s, cap, g) = unheard[i];
                    if pick(4) > 0 {
                        unheard.swap_remove(i); // else a repeat comes later as well
                    }
                    m.announce(s, cap, g).unwrap();
                }
                _ if !sends.is_empty() => {
                    let i = pick(sends.len().min(3) as u64) as usize;
                    let (tag, size) = sends[i];
                    let ours = m.claim(tag, now);
                    let everything_heard = unheard.is_empty();
                    let Some(got) = ours else {
                        if everything_heard {
                            assert_eq!(model.isend(tag, size), None, "seed {seed}: tag {tag}");
                        }
                        continue;
                    };
                    let want = model.isend(tag, size).unwrap_or_else(|| {
                        panic!("seed {seed}: tag {tag} matched {got:?}, IB would refuse")
                    });
                    let g = groups
                        .iter()
                        .find(|g| g.1 == want.recv)
                        .expect("a posted receive");
                    assert_eq!(got.seq, g.0 + want.index as u64, "seed {seed}: tag {tag}");
                    assert_eq!(size.min(got.capacity), want.size, "seed {seed}");
                    sends.remove(i);
                    done += 1;
                }
                _ => {}
            }
        }
        // Everything announced: every posted receive is eventually matched.
        for (s, cap, g) in std::mem::take(&mut unheard) {
            m.announce(s, cap, g).unwrap();
        }
        let mut rounds = 0;
        while !sends.is_empty() {
            rounds += 1;
            assert!(rounds < 10_000, "seed {seed}: sends {sends:?} never match");
            let (tag, size) = sends[rounds % sends.len()];
            if let Some(got) = m.claim(tag, now) {
                let want = model.isend(tag, size).expect("IB matches it too");
                let g = groups.iter().find(|g| g.1 == want.recv).expect("posted");
                assert_eq!(got.seq, g.0 + want.index as u64, "seed {seed}");
                sends.remove(rounds % sends.len());
                done += 1;
            } else {
                assert_eq!(model.isend(tag, size), None, "seed {seed}: tag {tag}");
            }
        }
        assert_eq!(done as u64, next_seq);
    }

    #[test]
    fn the_matcher_agrees_with_ncclibisend_over_random_interleavings() {
        for seed in 0..500 {
            random_run(seed);
        }
    }
}
