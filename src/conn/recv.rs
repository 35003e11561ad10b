//! The receiving half of a comm.
//!
//! Call order: `post` for each receive NCCL posts; for each inbound `Data` header call
//! `handle_data` with the lane it came on and, once the payload is in place,
//! `payload_done`; then drain `poll_transmit` (CTS and acks to send) and `poll_event`
//! (completed receives, in order).
//!
//! A striped comm's messages arrive over several lanes, so message `n + 1` may be done
//! before message `n`, and after a lane dies the sender sends again what it held: the same
//! message may then be arriving on two lanes at once. Both copies are the same bytes; the
//! first to finish completes the receive, and the other lane must stop writing into its
//! buffer at once ([`RecvMachine::payload_done`] names those lanes), because NCCL may reuse
//! a completed receive's buffer.

use std::collections::{BTreeMap, VecDeque};

use super::wire::Group;
use super::{ConnError, Outcome, Stats};

/// Control frames the receiver owes the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Clear-to-send: receive `seq` is posted with `capacity` bytes, in `group`.
    Cts {
        seq: u64,
        capacity: u64,
        group: Group,
    },
    /// Every message below `delivered` is in place.
    Ack { delivered: u64 },
}

/// Where the payload of an inbound `Data` frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Into the buffer of receive `seq` (`len` ≤ its capacity).
    Deliver { seq: u64, len: u64 },
    /// A duplicate of something already delivered (a replay overlap): read and drop.
    Discard { len: u64 },
}

#[derive(Debug)]
struct Posted<T> {
    seq: u64,
    capacity: u64,
    group: Group,
    token: T,
    /// Settled, waiting for the receives before it: its length.
    done: Option<u64>,
}

/// Receiver-side bookkeeping of one comm. Lanes are the caller's keys.
#[derive(Debug)]
pub struct RecvMachine<T> {
    /// Posted and not yet reported, in sequence order from `delivered` on.
    posted: VecDeque<Posted<T>>,
    next_seq: u64,
    /// Next sequence number to report: everything below it is in place.
    delivered: u64,
    /// The message each lane is writing a payload of.
    writing: BTreeMap<usize, u64>,
    ctrl: VecDeque<Control>,
    ack_owed: bool,
    /// Whether an Ack may wait for the next turn ([`RecvMachine::hold_acks`]).
    hold: bool,
    /// The current output run sent a control frame: an owed Ack goes with it.
    carrier: bool,
    /// A new turn began: an Ack held in the last one goes now.
    release: bool,
    events: VecDeque<Outcome<T>>,
    failed: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for RecvMachine<T> {
    fn default() -> Self {
        RecvMachine {
            posted: VecDeque::new(),
            next_seq: 0,
            delivered: 0,
            writing: BTreeMap::new(),
            ctrl: VecDeque::new(),
            ack_owed: false,
            hold: false,
            carrier: false,
            release: false,
            events: VecDeque::new(),
            failed: None,
            stats: Stats::default(),
        }
    }
}

impl<T> RecvMachine<T> {
    /// Posts a receive of up to `capacity` bytes and owes the sender its CTS.
    pub fn post(&mut self, capacity: u64, token: T) -> u64 {
        self.post_one(capacity, Group::SINGLE, token)
    }

    /// Posts a grouped receive: `(capacity, tag, token)` for each of its 1 to
    /// [`MAX_GROUP`](super::wire::MAX_GROUP) receives. Each is a message of its own with
    /// its own sequence number; the sender fills them with its next sends by tag. Returns
    /// the first sequence number.
    pub fn post_group(&mut self, subs: Vec<(u64, i32, T)>) -> u64 {
        let first = self.next_seq;
        let count = u8::try_from(subs.len()).expect("a group holds at most 8 receives");
        assert!(
            (1..=super::wire::MAX_GROUP).contains(&count),
            "a group of {count} receives"
        );
        for (index, (capacity, tag, token)) in (0..).zip(subs) {
            let group = if count == 1 {
                Group {
                    tag,
                    ..Group::SINGLE
                }
            } else {
                Group { tag, index, count }
            };
            self.post_one(capacity, group, token);
        }
        first
    }

    fn post_one(&mut self, capacity: u64, group: Group, token: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(error) = self.failed.clone() {
            self.delivered = self.delivered.max(seq + 1);
            self.events.push_back(Outcome::Failed { seq, token, error });
        } else {
            self.posted.push_back(Posted {
                seq,
                capacity,
                group,
                token,
                done: None,
            });
            self.ctrl.push_back(Control::Cts {
                seq,
                capacity,
                group,
            });
        }
        seq
    }

    fn slot(&mut self, seq: u64) -> Option<&mut Posted<T>> {
        let i = usize::try_from(seq.checked_sub(self.delivered)?).ok()?;
        self.posted.get_mut(i)
    }

    /// A `Data{seq, len}` header arrived on `lane`.
    pub fn handle_data(&mut self, lane: usize, seq: u64, len: u64) -> Result<Placement, ConnError> {
        if self.writing.contains_key(&lane) {
            return Err(ConnError::Protocol("data header inside a payload".into()));
        }
        if seq < self.delivered {
            self.stats.duplicates += 1;
            return Ok(Placement::Discard { len });
        }
        let p = self
            .slot(seq)
            .ok_or_else(|| ConnError::Protocol(format!("data {seq} without a posted receive")))?;
        if p.done.is_some() {
            self.stats.duplicates += 1;
            return Ok(Placement::Discard { len });
        }
        if len > p.capacity {
            return Err(ConnError::Protocol(format!(
                "data {seq} of {len} bytes exceeds the announced {}",
                p.capacity
            )));
        }
        self.writing.insert(lane, seq);
        Ok(Placement::Deliver { seq, len })
    }

    /// The caller's handle of posted receive `seq`.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.posted.iter().find(|p| p.seq == seq).map(|p| &p.token)
    }

    /// A payload of message `seq` read on `lane` has ended: placed by `Deliver`, or
    /// dropped. Returns the other lanes that were writing the same message: it is
    /// complete, so they must drop the rest of their copy instead of writing it.
    pub fn payload_done(
        &mut self,
        lane: usize,
        seq: u64,
        len: u64,
    ) -> Result<Vec<usize>, ConnError> {
        if self.writing.get(&lane) != Some(&seq) {
            let settled = seq < self.delivered || self.slot(seq).is_some_and(|p| p.done.is_some());
            return if settled {
                Ok(Vec::new()) // a dropped duplicate
            } else {
                Err(ConnError::Protocol(format!(
                    "payload {seq} was not expected"
                )))
            };
        }
        self.writing.remove(&lane);
        let p = self
            .slot(seq)
            .expect("a payload being written has its receive");
        p.done = Some(len);
        let others: Vec<usize> = (self.writing.iter())
            .filter(|&(_, &s)| s == seq)
            .map(|(&l, _)| l)
            .collect();
        for l in &others {
            self.writing.remove(l);
        }
        self.advance();
        Ok(others)
    }

    /// Reports the settled receives at the front, in order.
    fn advance(&mut self) {
        while self.posted.front().is_some_and(|p| p.done.is_some()) {
            let p = self.posted.pop_front().expect("front checked");
            self.delivered = p.seq + 1;
            self.ack_owed = true;
            let len = p.done.expect("front checked");
            self.stats.messages += 1;
            self.stats.bytes += len;
            self.events.push_back(Outcome::Completed {
                seq: p.seq,
                len,
                token: p.token,
            });
        }
    }

    /// Lets an Ack wait for the caller's next turn while other receives are posted: the
    /// receiver's next call (NCCL testing those receives, or posting the next one) comes
    /// within microseconds, and an Ack that goes out with that turn's `Cts` costs no
    /// segment of its own. Without other receives posted nothing may come soon, so the
    /// Ack goes at once. The caller runs [`RecvMachine::release_ack`] at each turn's start.
    pub fn hold_acks(&mut self) {
        self.hold = true;
    }

    /// A new turn of the caller began: an Ack held in the last one goes with this turn's
    /// output.
    pub fn release_ack(&mut self) {
        self.release = true;
    }

    /// An Ack is owed and held for the next turn.
    pub fn holds_ack(&self) -> bool {
        self.ack_owed && self.failed.is_none()
    }

    /// The next control frame: every `Cts`, then the Ack owed, unless it waits for the
    /// next turn ([`RecvMachine::hold_acks`]). Call until `None`: that ends a run of output.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Control> {
        if self.failed.is_some() {
            return None;
        }
        if let Some(c) = self.ctrl.pop_front() {
            self.carrier = true;
            return Some(c);
        }
        let carrier = std::mem::take(&mut self.carrier);
        let release = std::mem::take(&mut self.release);
        let send = carrier || release || !self.hold || self.posted.is_empty();
        // Acks are cumulative: one carries every delivery since the last.
        if self.ack_owed && send {
            self.ack_owed = false;
            return Some(Control::Ack {
                delivered: self.delivered,
            });
        }
        None
    }

    #[must_use]
    pub fn poll_event(&mut self) -> Option<Outcome<T>> {
        self.events.pop_front()
    }

    /// The comm's lanes changed (one joined, one died): what the sender knows may have
    /// been lost with a lane, so announce again every receive still waiting, and where
    /// delivery stands. Returns the number of messages delivered so far, which a new
    /// lane's handshake reports.
    pub fn reannounce(&mut self) -> u64 {
        self.ctrl.clear();
        self.ack_owed = true;
        for p in self.posted.iter().filter(|p| p.done.is_none()) {
            self.ctrl.push_back(Control::Cts {
                seq: p.seq,
                capacity: p.capacity,
                group: p.group,
            });
        }
        self.delivered
    }

    /// Lane `lane` is gone: a payload it was writing will come again in full.
    pub fn handle_lane_down(&mut self, lane: usize) {
        self.writing.remove(&lane);
    }

    /// The comm is lost and will not be restored: every posted receive fails.
    pub fn handle_lane_lost(&mut self, error: ConnError) {
        self.writing.clear();
        self.delivered = self.next_seq;
        while let Some(p) = self.posted.pop_front() {
            self.events.push_back(Outcome::Failed {
                seq: p.seq,
                token: p.token,
                error: error.clone(),
            });
        }
        self.failed.get_or_insert(error);
    }

    /// Receives posted and not yet completed.
    pub fn pending(&self) -> usize {
        self.posted.len()
    }

    pub fn delivered(&self) -> u64 {
        self.delivered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctrl<T>(m: &mut RecvMachine<T>) -> Vec<Control> {
        std::iter::from_fn(|| m.poll_transmit()).collect()
    }

    fn events<T>(m: &mut RecvMachine<T>) -> Vec<Outcome<T>> {
        std::iter::from_fn(|| m.poll_event()).collect()
    }

    #[test]
    fn post_announces_cts_in_order() {
        let mut m = RecvMachine::default();
        m.post(100, 'a');
        m.post(0, 'b');
        assert_eq!(
            ctrl(&mut m),
            vec![
                Control::Cts {
                    seq: 0,
                    capacity: 100,
                    group: Group::SINGLE,
                },
                Control::Cts {
                    seq: 1,
                    capacity: 0,
                    group: Group::SINGLE,
                }
            ]
        );
    }

    #[test]
    fn delivery_acks_and_reports_the_real_size() {
        let mut m = RecvMachine::default();
        m.post(100, 'a');
        let _ = ctrl(&mut m);
        assert_eq!(
            m.handle_data(0, 0, 40).unwrap(),
            Placement::Deliver { seq: 0, len: 40 }
        );
        assert_eq!(m.message(0), Some(&'a'));
        assert!(m.poll_event().is_none());
        assert!(m.payload_done(0, 0, 40).unwrap().is_empty());
        assert_eq!(
            m.poll_event(),
            Some(Outcome::Completed {
                seq: 0,
                len: 40,
                token: 'a'
            })
        );
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 1 }]);
    }

    #[test]
    fn acks_coalesce() {
        let mut m = RecvMachine::default();
        for i in 0..3 {
            m.post(8, i);
        }
        let _ = ctrl(&mut m);
        for i in 0..3 {
            m.handle_data(0, i, 8).unwrap();
            m.payload_done(0, i, 8).unwrap();
        }
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 3 }]);
    }

    #[test]
    fn a_held_ack_rides_with_the_next_cts_or_goes_in_the_next_turn() {
        let mut m = RecvMachine::default();
        m.hold_acks();
        m.post(8, 0);
        m.post(8, 1);
        let _ = ctrl(&mut m);
        m.handle_data(0, 0, 8).unwrap();
        m.payload_done(0, 0, 8).unwrap();
        // Receive 1 is still posted: the Ack waits for the turn's end and the next one.
        assert_eq!(ctrl(&mut m), vec![]);
        assert!(m.holds_ack());
        // NCCL posts the next receive: its Cts carries the Ack in the same run.
        m.post(8, 2);
        assert_eq!(
            ctrl(&mut m),
            vec![
                Control::Cts {
                    seq: 2,
                    capacity: 8,
                    group: Group::SINGLE,
                },
                Control::Ack { delivered: 1 }
            ]
        );
        // Nothing posted next: the next turn sends the Ack on its own.
        m.handle_data(0, 1, 8).unwrap();
        m.payload_done(0, 1, 8).unwrap();
        assert_eq!(ctrl(&mut m), vec![]);
        m.release_ack();
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 2 }]);
        assert!(!m.holds_ack());
        // The last posted receive delivered: nothing may come soon, so no hold.
        m.handle_data(0, 2, 8).unwrap();
        m.payload_done(0, 2, 8).unwrap();
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 3 }]);
    }

    #[test]
    fn zero_byte_and_maximum_size_messages() {
        let mut m = RecvMachine::default();
        m.post(0, 0);
        m.post(crate::conn::wire::MAX_DATA, 1);
        assert_eq!(
            m.handle_data(0, 0, 0).unwrap(),
            Placement::Deliver { seq: 0, len: 0 }
        );
        m.payload_done(0, 0, 0).unwrap();
        let max = crate::conn::wire::MAX_DATA;
        assert_eq!(
            m.handle_data(0, 1, max).unwrap(),
            Placement::Deliver { seq: 1, len: max }
        );
        m.payload_done(0, 1, max).unwrap();
        assert_eq!(m.stats.bytes, max);
        assert_eq!(m.delivered(), 2);
    }

    #[test]
    fn unposted_oversized_or_nested_data_is_a_protocol_error() {
        let mut m = RecvMachine::default();
        assert!(m.handle_data(0, 0, 1).is_err(), "no receive posted");
        m.post(10, ());
        m.post(10, ());
        assert!(m.handle_data(0, 2, 1).is_err(), "beyond what is posted");
        assert!(m.handle_data(0, 0, 11).is_err(), "larger than announced");
        m.handle_data(0, 0, 10).unwrap();
        assert!(m.handle_data(0, 1, 1).is_err(), "header inside a payload");
        assert!(m.payload_done(0, 1, 1).is_err(), "wrong payload");
    }

    #[test]
    fn messages_of_a_striped_comm_finish_out_of_order_and_complete_in_order() {
        let mut m = RecvMachine::default();
        for i in 0..3 {
            m.post(10, i);
        }
        let _ = ctrl(&mut m);
        m.handle_data(1, 0, 10).unwrap();
        m.handle_data(2, 1, 10).unwrap();
        m.handle_data(3, 2, 10).unwrap();
        m.payload_done(3, 2, 10).unwrap();
        m.payload_done(2, 1, 10).unwrap();
        assert!(events(&mut m).is_empty(), "message 0 is still arriving");
        assert_eq!(ctrl(&mut m), vec![]);
        m.payload_done(1, 0, 10).unwrap();
        let seqs: Vec<u64> = events(&mut m)
            .iter()
            .map(|e| match e {
                Outcome::Completed { seq, .. } => *seq,
                Outcome::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(seqs, vec![0, 1, 2]);
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 3 }]);
    }

    #[test]
    fn the_first_copy_to_finish_wins_and_the_other_lane_stops_writing() {
        let mut m = RecvMachine::default();
        m.post(10, 'a');
        m.post(10, 'b');
        // Lane 1 is writing message 0 when the sender, which took lane 1 for dead,
        // sends it again on lane 2.
        m.handle_data(1, 0, 10).unwrap();
        assert_eq!(
            m.handle_data(2, 0, 10).unwrap(),
            Placement::Deliver { seq: 0, len: 10 }
        );
        assert_eq!(m.payload_done(2, 0, 10).unwrap(), vec![1]);
        assert_eq!(events(&mut m).len(), 1);
        // Lane 1's copy ends as a drop; a third copy is a duplicate.
        assert!(m.payload_done(1, 0, 10).unwrap().is_empty());
        assert_eq!(
            m.handle_data(1, 0, 10).unwrap(),
            Placement::Discard { len: 10 }
        );
        assert_eq!(m.stats.duplicates, 1);
        // Lane 1 is free for the next message.
        m.handle_data(1, 1, 4).unwrap();
        m.payload_done(1, 1, 4).unwrap();
        assert_eq!(m.delivered(), 2);
    }

    #[test]
    fn a_copy_that_arrives_after_completion_out_of_order_is_dropped() {
        let mut m = RecvMachine::default();
        m.post(10, 'a');
        m.post(10, 'b');
        m.handle_data(1, 1, 10).unwrap();
        m.payload_done(1, 1, 10).unwrap();
        assert_eq!(
            m.handle_data(2, 1, 10).unwrap(),
            Placement::Discard { len: 10 }
        );
        assert!(m.payload_done(2, 1, 10).unwrap().is_empty());
    }

    #[test]
    fn a_lane_change_reannounces_waiting_receives_and_drops_its_partial_copy() {
        let mut m = RecvMachine::default();
        for i in 0..3 {
            m.post(100, i);
        }
        let _ = ctrl(&mut m);
        m.handle_data(0, 0, 100).unwrap();
        m.payload_done(0, 0, 100).unwrap();
        // Message 1 was half received when lane 0 died.
        m.handle_data(0, 1, 100).unwrap();
        m.handle_lane_down(0);
        assert_eq!(m.reannounce(), 1);
        assert_eq!(
            ctrl(&mut m),
            vec![
                Control::Cts {
                    seq: 1,
                    capacity: 100,
                    group: Group::SINGLE,
                },
                Control::Cts {
                    seq: 2,
                    capacity: 100,
                    group: Group::SINGLE,
                },
                Control::Ack { delivered: 1 }
            ]
        );
        // A sender replaying from further back: the overlap is discarded and counted.
        assert_eq!(
            m.handle_data(5, 0, 100).unwrap(),
            Placement::Discard { len: 100 }
        );
        assert_eq!(m.stats.duplicates, 1);
        m.payload_done(5, 0, 100).unwrap();
        assert_eq!(
            m.handle_data(5, 1, 100).unwrap(),
            Placement::Deliver { seq: 1, len: 100 }
        );
        m.payload_done(5, 1, 100).unwrap();
        assert_eq!(m.delivered(), 2);
    }

    #[test]
    fn lost_comm_fails_every_receive() {
        let mut m = RecvMachine::default();
        m.post(1, 'a');
        m.post(1, 'b');
        m.handle_lane_lost(ConnError::PeerClosed);
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { token: 'a', .. })
        ));
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { token: 'b', .. })
        ));
        m.post(1, 'c');
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { token: 'c', .. })
        ));
        assert!(m.poll_transmit().is_none());
    }

    #[test]
    fn a_grouped_receive_announces_each_buffer_with_its_tag_again_after_a_lane_change() {
        let mut m = RecvMachine::default();
        assert_eq!(m.post_group(vec![(7, 1, 'a')]), 0);
        assert_eq!(m.post_group(vec![(10, 5, 'b'), (0, 6, 'c')]), 1);
        let g = |tag, index, count| Group { tag, index, count };
        let cts = |seq, capacity, group| Control::Cts {
            seq,
            capacity,
            group,
        };
        assert_eq!(
            ctrl(&mut m),
            vec![
                cts(0, 7, g(1, 0, 1)),
                cts(1, 10, g(5, 0, 2)),
                cts(2, 0, g(6, 1, 2))
            ]
        );
        // The zero-byte buffer is filled first; the group's first still waits.
        m.handle_data(0, 2, 0).unwrap();
        m.payload_done(0, 2, 0).unwrap();
        m.reannounce();
        assert_eq!(
            ctrl(&mut m),
            vec![
                cts(0, 7, g(1, 0, 1)),
                cts(1, 10, g(5, 0, 2)),
                Control::Ack { delivered: 0 }
            ]
        );
    }
}
