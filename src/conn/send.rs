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
    seq: u64,
    len: u64,
    /// `None` once the message failed as truncated: its notice is still owed to the
    /// receiver until acknowledged, its request is settled.
    token: Option<T>,
    /// The lane it was last put on; `None`: (again) waiting to be sent.
    lane: Option<usize>,
}

/// Sender-side bookkeeping of one comm. `T` is the caller's handle for a message
/// (its buffer and request); the machine never looks inside it.
#[derive(Debug)]
pub struct SendMachine<T> {
    /// Posted and not yet acknowledged, in sequence order.
    queue: VecDeque<Msg<T>>,
    next_seq: u64,
    /// Receive capacities announced by CTS, by sequence number, from `acked` on.
    cts: BTreeMap<u64, u64>,
    /// Messages the receiver has acknowledged (cumulative).
    acked: u64,
    /// One past the highest sequence number ever transmitted.
    sent_end: u64,
    events: VecDeque<SendEvent<T>>,
    failed: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for SendMachine<T> {
    fn default() -> Self {
        SendMachine {
            queue: VecDeque::new(),
            next_seq: 0,
            cts: BTreeMap::new(),
            acked: 0,
            sent_end: 0,
            events: VecDeque::new(),
            failed: None,
            stats: Stats::default(),
        }
    }
}

impl<T> SendMachine<T> {
    /// Queues a message of `len` bytes; returns its sequence number. On a failed comm the
    /// message fails at once.
    pub fn post(&mut self, len: u64, token: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(error) = self.failed.clone() {
            self.acked = self.acked.max(seq + 1);
            self.events
                .push_back(SendEvent::Failed { seq, token, error });
        } else {
            self.queue.push_back(Msg {
                seq,
                len,
                token: Some(token),
                lane: None,
            });
        }
        seq
    }

    /// The receiver posted receive `seq` with `capacity` bytes. Repeats (the receiver
    /// announces again after a lane change, or over several lanes) are ignored.
    pub fn handle_cts(&mut self, seq: u64, capacity: u64) -> Result<(), ConnError> {
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
            Some(&c) if c != capacity => Err(ConnError::Protocol(format!(
                "CTS for {seq} announced {c} bytes, now {capacity}"
            ))),
            Some(_) => Ok(()),
            None => {
                self.cts.insert(seq, capacity);
                Ok(())
            }
        }
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
        while self.queue.front().is_some_and(|m| m.seq < delivered) {
            let m = self.queue.pop_front().expect("front checked");
            let Some(token) = m.token else {
                continue; // a truncation notice: its request failed already
            };
            self.stats.messages += 1;
            self.stats.bytes += m.len;
            self.events.push_back(SendEvent::Completed {
                seq: m.seq,
                len: m.len,
                token,
            });
        }
        Ok(())
    }

    /// The next thing to put on `lane`: the oldest message not on any lane, once the
    /// receiver has cleared it. Messages go out in sequence order.
    #[must_use]
    pub fn poll_transmit(&mut self, lane: usize) -> Option<Transmit> {
        if self.failed.is_some() {
            return None;
        }
        let m = self.queue.iter_mut().find(|m| m.lane.is_none())?;
        let capacity = *self.cts.get(&m.seq)?;
        m.lane = Some(lane);
        let (seq, len) = (m.seq, m.len);
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

    /// Whether a message is cleared and waiting for a lane.
    pub fn wants_lane(&self) -> bool {
        self.failed.is_none()
            && self
                .queue
                .iter()
                .find(|m| m.lane.is_none())
                .is_some_and(|m| self.cts.contains_key(&m.seq))
    }

    /// The caller's handle of message `seq` while it is unacknowledged.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.queue
            .iter()
            .find(|m| m.seq == seq)
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
        self.acked = self.next_seq;
        self.cts.clear();
        while let Some(m) = self.queue.pop_front() {
            if let Some(token) = m.token {
                self.events.push_back(SendEvent::Failed {
                    seq: m.seq,
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
        // Lane 7 dies: seqs 2 and 4 go out again, on lane 9, in order.
        assert_eq!(m.handle_lane_down(7), 30 + 50);
        assert_eq!(m.stats.replayed_bytes, 80);
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
}
