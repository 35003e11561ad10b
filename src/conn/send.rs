//! The sending half of a comm.
//!
//! Call order, per reactor turn: feed inputs (`post`, `handle_cts`, `handle_ack`,
//! `handle_lane_down`), then drain outputs (`poll_transmit` until `None`, then
//! `poll_event` until `None`). A message is transmitted only after the receiver's
//! clear-to-send for its sequence number, and completes only when the receiver has
//! acknowledged it, so everything not yet acknowledged can be sent again.
//!
//! A comm may run over several lanes at once (striping). The caller chooses the lane of
//! each transmission ([`SendMachine::poll_transmit`] takes it) and the machine remembers
//! it, so that when a lane dies exactly the messages it held and the receiver has not
//! acknowledged are sent again, on whatever lanes remain ([`SendMachine::handle_lane_down`]).
//! Control frames may come over any lane in any order: a repeated CTS is ignored and an
//! ack is cumulative, so a stale one changes nothing.

use std::collections::{BTreeMap, VecDeque};

use super::wire::Group;
use super::{ConnError, Stats};

/// How far ahead of the acknowledged point a CTS may reach: far beyond any real window
/// (NCCL keeps 8 requests in flight per comm), small enough to bound what a confused peer
/// can make us store.
const CTS_WINDOW: u64 = 1 << 16;

/// What the reactor must put on the lane next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transmit {
    /// Header `Data{seq, len}` followed by the `len` bytes of message `seq`.
    Data { seq: u64, len: u64 },
    /// Header `Truncated{seq, len}`: the message is larger than the posted receive.
    Truncated { seq: u64, len: u64 },
}

/// Outcomes for the owner of a message.
#[derive(Debug, PartialEq, Eq)]
pub enum SendEvent<T> {
    Completed {
        seq: u64,
        len: u64,
        token: T,
    },
    Failed {
        seq: u64,
        token: T,
        error: ConnError,
    },
}

#[derive(Debug)]
struct Msg<T> {
    /// Its place among the sends: the `n`th send fills a receive of the group that
    /// holds sequence number `n`.
    ord: u64,
    /// The receive it fills, once its group is matched; `None` before.
    seq: Option<u64>,
    tag: i32,
    len: u64,
    /// `None` once the message failed as truncated: its notice is still owed to the
    /// receiver until acknowledged, its request is settled.
    token: Option<T>,
    /// The lane it was last put on; `None`: (again) waiting to be sent.
    lane: Option<usize>,
    /// It was put on a lane that then died: it goes out again.
    replayed: bool,
}

/// One receive the receiver announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Announced {
    capacity: u64,
    group: Group,
    /// A send was matched to it.
    taken: bool,
}

/// Sender-side bookkeeping of one comm. `T` is the caller's handle for a message
/// (its buffer and request); the machine never looks inside it.
///
/// Grouped receives: the receiver numbers every receive of a group, and the sends fill
/// them in order of posting, group by group; inside a group a send takes the first free
/// receive with its tag (a group of one takes any tag). A send whose tag matches no free
/// receive of its group fails the comm ([`ConnError::Unmatched`]).
#[derive(Debug)]
pub struct SendMachine<T> {
    /// Posted and not yet acknowledged, in posting order; the matched ones first.
    queue: VecDeque<Msg<T>>,
    next_ord: u64,
    /// The group the next unmatched send falls in: its first and end sequence numbers.
    group: (u64, u64),
    /// Receives announced by CTS, by sequence number, from `acked` on.
    cts: BTreeMap<u64, Announced>,
    /// Messages the receiver has acknowledged (cumulative).
    acked: u64,
    /// One past the highest sequence number ever transmitted.
    sent_end: u64,
    events: VecDeque<SendEvent<T>>,
    failed: Option<ConnError>,
    /// A matching failure found while posting, for the owner to fail the comm with.
    fault: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for SendMachine<T> {
    fn default() -> Self {
        SendMachine {
            queue: VecDeque::new(),
            next_ord: 0,
            group: (0, 0),
            cts: BTreeMap::new(),
            acked: 0,
            sent_end: 0,
            events: VecDeque::new(),
            failed: None,
            fault: None,
            stats: Stats::default(),
        }
    }
}

impl<T> SendMachine<T> {
    /// Queues a message of `len` bytes with tag 0.
    pub fn post(&mut self, len: u64, token: T) {
        self.post_tagged(len, 0, token);
    }

    /// Queues a message of `len` bytes with `tag`, which picks its receive inside a
    /// grouped receive. On a failed comm the message fails at once. A tag that matches
    /// no free receive of its group is kept for [`SendMachine::take_fault`].
    pub fn post_tagged(&mut self, len: u64, tag: i32, token: T) {
        let ord = self.next_ord;
        self.next_ord += 1;
        if let Some(error) = self.failed.clone() {
            self.events.push_back(SendEvent::Failed {
                seq: ord,
                token,
                error,
            });
            return;
        }
        self.queue.push_back(Msg {
            ord,
            seq: None,
            tag,
            len,
            token: Some(token),
            lane: None,
            replayed: false,
        });
        if let Err(e) = self.match_sends() {
            self.fault.get_or_insert(e);
        }
    }

    /// A matching failure found by [`SendMachine::post_tagged`]: the comm must fail.
    pub fn take_fault(&mut self) -> Option<ConnError> {
        self.fault.take()
    }

    /// The receiver posted receive `seq` with `capacity` bytes, alone. (Tests.)
    #[cfg(test)]
    pub fn handle_cts(&mut self, seq: u64, capacity: u64) -> Result<(), ConnError> {
        self.handle_cts_in(seq, capacity, Group::SINGLE)
    }

    /// The receiver posted receive `seq` with `capacity` bytes in `group`. Repeats (the
    /// receiver announces again after a lane change, or over several lanes) are ignored.
    pub fn handle_cts_in(
        &mut self,
        seq: u64,
        capacity: u64,
        group: Group,
    ) -> Result<(), ConnError> {
        if seq < self.acked {
            return Ok(());
        }
        if seq >= self.acked + CTS_WINDOW {
            return Err(ConnError::Protocol(format!(
                "CTS for {seq}, far beyond the acknowledged {}",
                self.acked
            )));
        }
        match self.cts.get(&seq) {
            Some(a) if (a.capacity, a.group) != (capacity, group) => {
                Err(ConnError::Protocol(format!(
                    "CTS for {seq} announced {} bytes in {:?}, now {capacity} in {group:?}",
                    a.capacity, a.group
                )))
            }
            Some(_) => Ok(()),
            None => {
                self.cts.insert(
                    seq,
                    Announced {
                        capacity,
                        group,
                        taken: false,
                    },
                );
                self.match_sends()
            }
        }
    }

    /// Matches unmatched sends, in posting order, to the receives of their group once
    /// the receiver has announced the whole group.
    fn match_sends(&mut self) -> Result<(), ConnError> {
        if self.failed.is_some() {
            return Ok(());
        }
        while let Some(i) = self.queue.iter().position(|m| m.seq.is_none()) {
            let (ord, tag) = (self.queue[i].ord, self.queue[i].tag);
            if ord < self.acked {
                return Err(ConnError::Protocol(format!(
                    "ack {} covers receive {ord} before a send filled it",
                    self.acked
                )));
            }
            // Send `ord` falls in the group holding sequence number `ord`; everything
            // below the acknowledged point is matched, so its CTS is still kept.
            let Some(a) = self.cts.get(&ord) else {
                return Ok(());
            };
            let count = u64::from(a.group.count);
            let first = ord.saturating_sub(u64::from(a.group.index));
            let (at, end) = self.group;
            let fits = if ord == end {
                a.group.index == 0
            } else {
                first == at && first + count == end && ord - first == u64::from(a.group.index)
            };
            if !fits {
                return Err(ConnError::Protocol(format!(
                    "CTS for {ord} places it in {:?}, across the group {at}..{end}",
                    a.group
                )));
            }
            self.group = (first, first + count);
            let mut free = Vec::new();
            for seq in first..first + count {
                if seq < self.acked {
                    continue; // delivered, so matched
                }
                let Some(b) = self.cts.get(&seq) else {
                    return Ok(()); // wait for the whole group
                };
                if b.group.count != a.group.count || u64::from(b.group.index) != seq - first {
                    return Err(ConnError::Protocol(format!(
                        "CTS for {seq} places it in {:?}, not in the group from {first} of {count}",
                        b.group
                    )));
                }
                if !b.taken {
                    free.push((seq, b.group.tag));
                }
            }
            let Some(&(seq, _)) = free.iter().find(|&&(_, t)| count == 1 || t == tag) else {
                let tags: Vec<i32> = free.iter().map(|&(_, t)| t).collect();
                return Err(ConnError::Unmatched(format!(
                    "send tag {tag} matches no free receive of the grouped receive {first}..{} (free tags {tags:?})",
                    first + count
                )));
            };
            self.cts.get_mut(&seq).expect("listed above").taken = true;
            self.queue[i].seq = Some(seq);
        }
        Ok(())
    }

    /// The receiver has delivered every message below `delivered`. An ack older than one
    /// already seen (it came over a slower lane) changes nothing.
    pub fn handle_ack(&mut self, delivered: u64) -> Result<(), ConnError> {
        if delivered > self.sent_end {
            return Err(ConnError::Protocol(format!(
                "ack {delivered} beyond the {} messages sent",
                self.sent_end
            )));
        }
        if delivered <= self.acked {
            return Ok(());
        }
        self.acked = delivered;
        while self
            .cts
            .first_key_value()
            .is_some_and(|(&seq, _)| seq < delivered)
        {
            self.cts.pop_first();
        }
        // Inside a group sends may fill receives out of order: complete every one below.
        let queue = std::mem::take(&mut self.queue);
        for m in queue {
            let Some(seq) = m.seq.filter(|&s| s < delivered) else {
                self.queue.push_back(m);
                continue;
            };
            let Some(token) = m.token else {
                continue; // a truncation notice: its request failed already
            };
            self.stats.messages += 1;
            self.stats.bytes += m.len;
            self.events.push_back(SendEvent::Completed {
                seq,
                len: m.len,
                token,
            });
        }
        Ok(())
    }

    /// The next thing to put on `lane`: the oldest matched message not on any lane.
    #[must_use]
    pub fn poll_transmit(&mut self, lane: usize) -> Option<Transmit> {
        if self.failed.is_some() {
            return None;
        }
        let m = (self.queue.iter_mut()).find(|m| m.lane.is_none() && m.seq.is_some())?;
        let seq = m.seq.expect("matched");
        let capacity = self
            .cts
            .get(&seq)
            .expect("a matched receive is kept")
            .capacity;
        m.lane = Some(lane);
        let len = m.len;
        self.sent_end = self.sent_end.max(seq + 1);
        if len > capacity {
            if let Some(token) = m.token.take() {
                self.events.push_back(SendEvent::Failed {
                    seq,
                    token,
                    error: ConnError::Truncated { len, capacity },
                });
            }
            return Some(Transmit::Truncated { seq, len });
        }
        Some(Transmit::Data { seq, len })
    }

    /// Whether message `seq` is on its first transmission: no lane that carried it died,
    /// so the receiver cannot have it from elsewhere. Only then may its payload be written
    /// straight into the receive buffer, where a duplicate could not be dropped.
    pub fn first_try(&self, seq: u64) -> bool {
        (self.queue.iter()).any(|m| m.seq == Some(seq) && !m.replayed)
    }

    /// Whether a message is matched and waiting for a lane.
    pub fn wants_lane(&self) -> bool {
        self.failed.is_none() && (self.queue.iter()).any(|m| m.lane.is_none() && m.seq.is_some())
    }

    /// The caller's handle of message `seq` while it is unacknowledged.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.queue
            .iter()
            .find(|m| m.seq == Some(seq))
            .and_then(|m| m.token.as_ref())
    }

    #[must_use]
    pub fn poll_event(&mut self) -> Option<SendEvent<T>> {
        self.events.pop_front()
    }

    /// Lane `lane` is gone: what it carried and the receiver has not acknowledged is
    /// sent again on the lanes left. Returns the bytes that will be sent again.
    pub fn handle_lane_down(&mut self, lane: usize) -> u64 {
        let mut again = 0;
        for m in self.queue.iter_mut().filter(|m| m.lane == Some(lane)) {
            m.lane = None;
            m.replayed = true;
            again += m.len;
        }
        self.stats.replayed_bytes += again;
        again
    }

    /// Messages on `lane` the receiver has not acknowledged.
    pub fn on_lane(&self, lane: usize) -> usize {
        self.queue.iter().filter(|m| m.lane == Some(lane)).count()
    }

    /// A new lane was accepted and the receiver reports `delivered` messages. Lanes open
    /// side by side, so the report may be older than an ack that came over another lane;
    /// more than was ever sent means the receiver is not the comm this machine talks to.
    pub fn handle_welcome(&mut self, delivered: u64) -> Result<(), ConnError> {
        if delivered > self.sent_end {
            return Err(ConnError::Protocol(format!(
                "replay point {delivered} beyond the {} messages sent",
                self.sent_end
            )));
        }
        self.handle_ack(delivered)
    }

    /// The comm is lost and will not be restored: every pending message fails.
    pub fn handle_lane_lost(&mut self, error: ConnError) {
        self.cts.clear();
        while let Some(m) = self.queue.pop_front() {
            if let Some(token) = m.token {
                self.events.push_back(SendEvent::Failed {
                    seq: m.seq.unwrap_or(m.ord),
                    token,
                    error: error.clone(),
                });
            }
        }
        self.failed.get_or_insert(error);
    }

    /// Sent but not yet acknowledged, or not yet sent: requests still owed.
    pub fn pending(&self) -> usize {
        self.queue.iter().filter(|m| m.token.is_some()).count()
    }

    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain<T>(m: &mut SendMachine<T>) -> Vec<Transmit> {
        std::iter::from_fn(|| m.poll_transmit(0)).collect()
    }

    #[test]
    fn nothing_moves_before_clear_to_send() {
        let mut m = SendMachine::default();
        m.post(10, 'a');
        m.post(0, 'b');
        assert!(drain(&mut m).is_empty());
        assert!(!m.wants_lane());
        m.handle_cts(0, 10).unwrap();
        assert!(m.wants_lane());
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 0, len: 10 }]);
        m.handle_cts(1, 100).unwrap();
        // Zero-byte messages are real messages.
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 1, len: 0 }]);
        assert!(m.poll_event().is_none(), "no completion before the ack");
    }

    #[test]
    fn cts_may_arrive_before_the_send_and_out_of_order() {
        let mut m = SendMachine::default();
        m.handle_cts(1, 64).unwrap();
        m.handle_cts(0, 64).unwrap();
        assert!(drain(&mut m).is_empty());
        m.post(64, ());
        m.post(1, ());
        assert_eq!(
            drain(&mut m),
            vec![
                Transmit::Data { seq: 0, len: 64 },
                Transmit::Data { seq: 1, len: 1 }
            ]
        );
    }

    #[test]
    fn messages_go_in_order_even_when_a_later_one_is_cleared_first() {
        let mut m = SendMachine::default();
        m.post(1, ());
        m.post(1, ());
        m.handle_cts(1, 8).unwrap();
        assert!(drain(&mut m).is_empty(), "message 0 waits for its CTS");
        m.handle_cts(0, 8).unwrap();
        assert_eq!(drain(&mut m).len(), 2);
    }

    #[test]
    fn repeated_cts_and_stale_acks_change_nothing() {
        let mut m = SendMachine::default();
        for i in 0..3 {
            m.post(5, i);
            m.handle_cts(i, 5).unwrap();
            m.handle_cts(i, 5).unwrap();
        }
        assert_eq!(drain(&mut m).len(), 3);
        m.handle_ack(2).unwrap();
        m.handle_ack(1).unwrap();
        m.handle_cts(0, 5).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 2);
        assert!(drain(&mut m).is_empty(), "nothing is sent twice");
        m.handle_ack(3).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 1);
    }

    #[test]
    fn cumulative_ack_completes_in_order() {
        let mut m = SendMachine::default();
        for i in 0..3 {
            m.post(i + 1, i);
            m.handle_cts(i, 1 << 20).unwrap();
        }
        assert_eq!(drain(&mut m).len(), 3);
        m.handle_ack(2).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 0,
                len: 1,
                token: 0
            })
        );
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 1,
                len: 2,
                token: 1
            })
        );
        assert_eq!(m.poll_event(), None);
        m.handle_ack(3).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 2,
                len: 3,
                token: 2
            })
        );
        assert_eq!((m.stats.messages, m.stats.bytes), (3, 6));
    }

    #[test]
    fn protocol_violations_are_errors() {
        let mut m = SendMachine::<()>::default();
        assert!(m.handle_ack(1).is_err(), "ack for something never sent");
        assert!(
            m.handle_cts(CTS_WINDOW, 5).is_err(),
            "CTS far beyond the window"
        );
        m.handle_cts(0, 5).unwrap();
        assert!(m.handle_cts(0, 6).is_err(), "one receive, two capacities");
    }

    #[test]
    fn larger_than_receive_fails_only_that_message() {
        let mut m = SendMachine::default();
        m.post(100, 'x');
        m.post(5, 'y');
        m.handle_cts(0, 99).unwrap();
        m.handle_cts(1, 5).unwrap();
        assert_eq!(
            drain(&mut m),
            vec![
                Transmit::Truncated { seq: 0, len: 100 },
                Transmit::Data { seq: 1, len: 5 }
            ]
        );
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Failed {
                seq: 0,
                token: 'x',
                error: ConnError::Truncated {
                    len: 100,
                    capacity: 99
                }
            })
        );
        assert_eq!(m.pending(), 1, "the failed send is settled");
        m.handle_ack(2).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 1,
                len: 5,
                token: 'y'
            })
        );
        assert_eq!(m.poll_event(), None);
    }

    #[test]
    fn a_lost_truncation_notice_is_sent_again_but_settled_once() {
        let mut m = SendMachine::default();
        m.post(100, 'x');
        m.handle_cts(0, 1).unwrap();
        assert_eq!(
            m.poll_transmit(3),
            Some(Transmit::Truncated { seq: 0, len: 100 })
        );
        assert!(matches!(m.poll_event(), Some(SendEvent::Failed { .. })));
        m.handle_lane_down(3);
        assert_eq!(
            m.poll_transmit(4),
            Some(Transmit::Truncated { seq: 0, len: 100 })
        );
        assert_eq!(m.poll_event(), None);
        m.handle_ack(1).unwrap();
        assert_eq!(m.poll_event(), None);
    }

    #[test]
    fn a_dead_lane_gives_back_exactly_what_it_held_unacknowledged() {
        let mut m = SendMachine::default();
        for i in 0..6u64 {
            m.post(10 * (i + 1), i);
            m.handle_cts(i, 1000).unwrap();
        }
        // Striped over lanes 7 and 9, alternately.
        let lanes: Vec<(usize, Transmit)> = (0..6)
            .map(|i| {
                let lane = if i % 2 == 0 { 7 } else { 9 };
                (lane, m.poll_transmit(lane).unwrap())
            })
            .collect();
        assert_eq!(lanes.len(), 6);
        assert_eq!((m.on_lane(7), m.on_lane(9)), (3, 3));
        m.handle_ack(1).unwrap();
        assert_eq!(m.on_lane(7), 2, "seq 0 was acknowledged");
        assert!((1..6).all(|s| m.first_try(s)));
        // Lane 7 dies: seqs 2 and 4 go out again, on lane 9, in order.
        assert_eq!(m.handle_lane_down(7), 30 + 50);
        assert_eq!(m.stats.replayed_bytes, 80);
        // A replay may meet a receive another lane completed: never written in place.
        assert_eq!(
            (1..6).map(|s| m.first_try(s)).collect::<Vec<_>>(),
            [true, false, true, false, true]
        );
        assert_eq!(
            drain(&mut m),
            vec![
                Transmit::Data { seq: 2, len: 30 },
                Transmit::Data { seq: 4, len: 50 }
            ]
        );
        // The receiver had got seq 2 before the lane died: its ack is accepted.
        m.handle_ack(6).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 6);
        assert_eq!(m.pending(), 0);
    }

    #[test]
    fn a_welcome_may_be_older_than_the_last_ack_but_not_beyond_what_was_sent() {
        let mut m = SendMachine::default();
        for i in 0..4u64 {
            m.post(1, i);
            m.handle_cts(i, 1).unwrap();
        }
        assert_eq!(drain(&mut m).len(), 4);
        m.handle_ack(2).unwrap();
        m.handle_welcome(1).unwrap();
        assert!(m.handle_welcome(5).is_err(), "beyond what was sent");
        m.handle_welcome(3).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 3);
    }

    #[test]
    fn lost_comm_fails_everything_pending_and_later() {
        let mut m = SendMachine::default();
        m.post(1, 1);
        m.post(2, 2);
        m.handle_cts(0, 8).unwrap();
        let _ = drain(&mut m);
        m.handle_lane_lost(ConnError::PeerClosed);
        assert!(matches!(
            m.poll_event(),
            Some(SendEvent::Failed { seq: 0, .. })
        ));
        assert!(matches!(
            m.poll_event(),
            Some(SendEvent::Failed { seq: 1, .. })
        ));
        m.post(3, 3);
        assert!(matches!(
            m.poll_event(),
            Some(SendEvent::Failed { seq: 2, .. })
        ));
        assert!(m.poll_transmit(0).is_none());
        assert_eq!(m.pending(), 0);
    }

    fn group(tags: &[i32]) -> impl Iterator<Item = (u64, Group)> + '_ {
        let count = tags.len() as u8;
        (0..)
            .zip(tags)
            .map(move |(index, &tag)| (u64::from(index), Group { tag, index, count }))
    }

    #[test]
    fn a_group_fills_its_receives_by_tag_whatever_the_send_order() {
        let mut m = SendMachine::default();
        // Receive 0 alone (any tag), then a group of three at 1..4, then one alone.
        m.handle_cts_in(
            0,
            8,
            Group {
                tag: 5,
                ..Group::SINGLE
            },
        )
        .unwrap();
        for (i, g) in group(&[10, 20, 30]) {
            m.handle_cts_in(1 + i, 100, g).unwrap();
        }
        m.post_tagged(1, 99, 'x'); // a single receive ignores the tag
        m.post_tagged(3, 30, 'c');
        m.post_tagged(1, 10, 'a');
        assert_eq!(
            drain(&mut m),
            vec![
                Transmit::Data { seq: 0, len: 1 },
                Transmit::Data { seq: 3, len: 3 },
                Transmit::Data { seq: 1, len: 1 }
            ]
        );
        m.post_tagged(0, 20, 'b');
        m.post_tagged(4, 7, 'y');
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 2, len: 0 }]);
        m.handle_cts_in(4, 4, Group::SINGLE).unwrap();
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 4, len: 4 }]);
        assert_eq!(m.message(3), Some(&'c'));
        // Acks are by receive: the receives below 3 complete the sends that filled them.
        m.handle_ack(3).unwrap();
        let done: Vec<(u64, char)> = std::iter::from_fn(|| m.poll_event())
            .map(|e| match e {
                SendEvent::Completed { seq, token, .. } => (seq, token),
                SendEvent::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(done, vec![(0, 'x'), (1, 'a'), (2, 'b')]);
        assert_eq!(m.pending(), 2);
        m.handle_ack(5).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 2);
        assert_eq!(m.take_fault(), None);
    }

    #[test]
    fn a_group_waits_for_all_its_receives_before_matching() {
        let mut m = SendMachine::default();
        m.post_tagged(5, 20, ());
        let mut cts = group(&[10, 20]);
        let (i, g) = cts.next().unwrap();
        m.handle_cts_in(i, 9, g).unwrap();
        assert!(drain(&mut m).is_empty(), "receive 1's tag is not known yet");
        let (i, g) = cts.next().unwrap();
        m.handle_cts_in(i, 9, g).unwrap();
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 1, len: 5 }]);
    }

    #[test]
    fn a_send_whose_tag_matches_no_free_receive_fails_the_comm() {
        // Found when the send is posted after the group's CTS ...
        let mut m = SendMachine::default();
        for (i, g) in group(&[10, 20]) {
            m.handle_cts_in(i, 9, g).unwrap();
        }
        m.post_tagged(1, 10, ());
        assert_eq!(m.take_fault(), None);
        m.post_tagged(1, 10, ());
        assert!(matches!(m.take_fault(), Some(ConnError::Unmatched(_))));
        // ... or when the CTS comes after the sends.
        let mut m = SendMachine::default();
        m.post_tagged(1, 7, ());
        let mut cts = group(&[10, 20]);
        let (i, g) = cts.next().unwrap();
        m.handle_cts_in(i, 9, g).unwrap();
        let (i, g) = cts.next().unwrap();
        let e = m.handle_cts_in(i, 9, g).unwrap_err();
        assert!(
            matches!(e, ConnError::Unmatched(ref s) if s.contains("tag 7")),
            "{e}"
        );
    }

    #[test]
    fn a_cts_that_contradicts_its_group_is_a_protocol_error() {
        let mut m = SendMachine::default();
        m.post_tagged(1, 1, ());
        let g = |tag, index, count| Group { tag, index, count };
        // A group must start at the first receive after the last group.
        let e = m.handle_cts_in(0, 9, g(1, 1, 2)).unwrap_err();
        assert!(matches!(e, ConnError::Protocol(_)), "{e}");
        let mut m = SendMachine::default();
        m.post_tagged(1, 1, ());
        m.handle_cts_in(1, 9, g(2, 0, 2)).unwrap();
        let e = m.handle_cts_in(0, 9, g(1, 0, 2)).unwrap_err();
        assert!(matches!(e, ConnError::Protocol(_)), "{e}");
        // The same receive announced twice differently.
        let mut m = SendMachine::<()>::default();
        m.handle_cts_in(0, 9, g(1, 0, 2)).unwrap();
        assert!(m.handle_cts_in(0, 9, g(2, 0, 2)).is_err());
    }
}
