//! The sending half of a comm.
//!
//! Call order, per reactor turn: feed inputs (`post`, `handle_ack`, `handle_lane_down`),
//! then drain outputs (`poll_transmit` until `None`, then `poll_event` until `None`). A
//! message is posted only once it is matched to a receive the receiver announced
//! ([`super::matching`]), and completes only when the receiver has acknowledged it, so
//! everything not yet acknowledged can be sent again.
//!
//! A comm may run over several lanes at once (striping). The caller chooses the lane of
//! each transmission ([`SendMachine::poll_transmit`] takes it) and the machine remembers
//! it, so that when a lane dies exactly the messages it held and the receiver has not
//! acknowledged are sent again, on whatever lanes remain ([`SendMachine::handle_lane_down`]).
//! Acks may come over any lane in any order: they are cumulative, so a stale one changes
//! nothing.

use std::collections::VecDeque;

use super::{ConnError, Outcome, Stats};

/// What the reactor must put on the lane next: header `Data{seq, len}` followed by the
/// `len` bytes of message `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub seq: u64,
    pub len: u64,
}

#[derive(Debug)]
struct Msg<T> {
    /// The receive it fills.
    seq: u64,
    len: u64,
    token: T,
    /// The lane it was last put on; `None`: (again) waiting to be sent.
    lane: Option<usize>,
    /// It was put on a lane that then died: it goes out again.
    replayed: bool,
}

/// Sender-side bookkeeping of one comm. `T` is the caller's handle for a message
/// (its buffer and request); the machine never looks inside it.
///
/// Every message arrives matched to the receive it fills ([`super::matching`] chose it
/// when NCCL posted the send, after the receiver's clear-to-send), and cut to that
/// receive's size.
#[derive(Debug)]
pub struct SendMachine<T> {
    /// Posted and not yet acknowledged, in posting order.
    queue: VecDeque<Msg<T>>,
    /// Messages the receiver has acknowledged (cumulative).
    acked: u64,
    /// One past the highest sequence number ever transmitted.
    sent_end: u64,
    events: VecDeque<Outcome<T>>,
    failed: Option<ConnError>,
    /// A send the receiver's acknowledgements contradict, for the owner to fail the comm
    /// with.
    fault: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for SendMachine<T> {
    fn default() -> Self {
        SendMachine {
            queue: VecDeque::new(),
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
    /// Queues a message of `len` bytes for receive `seq`, which the receiver announced
    /// and no other message fills. On a failed comm the message fails at once.
    pub fn post(&mut self, seq: u64, len: u64, token: T) {
        if let Some(error) = self.failed.clone() {
            self.events.push_back(Outcome::Failed { seq, token, error });
            return;
        }
        if seq < self.acked {
            self.fault.get_or_insert(ConnError::Protocol(format!(
                "ack {} covers receive {seq} before a send filled it",
                self.acked
            )));
        }
        self.queue.push_back(Msg {
            seq,
            len,
            token,
            lane: None,
            replayed: false,
        });
    }

    /// A send the receiver's acknowledgements contradict: the comm must fail.
    pub fn take_fault(&mut self) -> Option<ConnError> {
        self.fault.take()
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
        // Inside a group sends may fill receives out of order: complete every one below.
        let queue = std::mem::take(&mut self.queue);
        for m in queue {
            if m.seq >= delivered {
                self.queue.push_back(m);
                continue;
            }
            self.stats.messages += 1;
            self.stats.bytes += m.len;
            self.events.push_back(Outcome::Completed {
                seq: m.seq,
                len: m.len,
                token: m.token,
            });
        }
        Ok(())
    }

    /// The next thing to put on `lane`: the oldest message not on any lane.
    #[must_use]
    pub fn poll_transmit(&mut self, lane: usize) -> Option<Transmit> {
        if self.failed.is_some() {
            return None;
        }
        let m = self.queue.iter_mut().find(|m| m.lane.is_none())?;
        m.lane = Some(lane);
        self.sent_end = self.sent_end.max(m.seq + 1);
        Some(Transmit {
            seq: m.seq,
            len: m.len,
        })
    }

    /// Whether message `seq` is on its first transmission: no lane that carried it died,
    /// so the receiver cannot have it from elsewhere. Only then may its payload be written
    /// straight into the receive buffer, where a duplicate could not be dropped.
    pub fn first_try(&self, seq: u64) -> bool {
        (self.queue.iter()).any(|m| m.seq == seq && !m.replayed)
    }

    /// Whether a message waits for a lane.
    pub fn wants_lane(&self) -> bool {
        self.failed.is_none() && (self.queue.iter()).any(|m| m.lane.is_none())
    }

    /// The caller's handle of message `seq` while it is unacknowledged.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.queue.iter().find(|m| m.seq == seq).map(|m| &m.token)
    }

    #[must_use]
    pub fn poll_event(&mut self) -> Option<Outcome<T>> {
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
        while let Some(m) = self.queue.pop_front() {
            self.events.push_back(Outcome::Failed {
                seq: m.seq,
                token: m.token,
                error: error.clone(),
            });
        }
        self.failed.get_or_insert(error);
    }

    /// Sent but not yet acknowledged, or not yet sent: requests still owed.
    pub fn pending(&self) -> usize {
        self.queue.len()
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

    fn tx(seq: u64, len: u64) -> Transmit {
        Transmit { seq, len }
    }

    #[test]
    fn messages_go_out_in_posting_order_whatever_their_receives() {
        let mut m = SendMachine::default();
        assert!(!m.wants_lane());
        m.post(1, 10, 'a');
        m.post(0, 0, 'b');
        assert!(m.wants_lane());
        // Zero-byte messages are real messages.
        assert_eq!(drain(&mut m), vec![tx(1, 10), tx(0, 0)]);
        assert!(!m.wants_lane());
        assert!(m.poll_event().is_none(), "no completion before the ack");
    }

    #[test]
    fn stale_acks_change_nothing() {
        let mut m = SendMachine::default();
        for i in 0..3 {
            m.post(i, 5, i);
        }
        assert_eq!(drain(&mut m).len(), 3);
        m.handle_ack(2).unwrap();
        m.handle_ack(1).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 2);
        assert!(drain(&mut m).is_empty(), "nothing is sent twice");
        m.handle_ack(3).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 1);
    }

    #[test]
    fn cumulative_ack_completes_every_receive_below_it() {
        let mut m = SendMachine::default();
        // A group filled out of order: receive 2, then 0, then 1.
        for (seq, len) in [(2, 3), (0, 1), (1, 2)] {
            m.post(seq, len, seq);
        }
        assert_eq!(drain(&mut m).len(), 3);
        m.handle_ack(2).unwrap();
        let done: Vec<_> = std::iter::from_fn(|| m.poll_event()).collect();
        assert_eq!(
            done,
            vec![
                Outcome::Completed {
                    seq: 0,
                    len: 1,
                    token: 0
                },
                Outcome::Completed {
                    seq: 1,
                    len: 2,
                    token: 1
                }
            ]
        );
        m.handle_ack(3).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(Outcome::Completed {
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
        m.post(0, 1, ());
        let _ = drain(&mut m);
        m.handle_ack(1).unwrap();
        assert!(
            m.handle_welcome(2).is_err(),
            "a replay point beyond what was sent"
        );
        assert_eq!(m.take_fault(), None);
        // A send matched to a receive the receiver says it delivered already.
        m.post(0, 1, ());
        assert!(matches!(m.take_fault(), Some(ConnError::Protocol(_))));
    }

    #[test]
    fn a_dead_lane_gives_back_exactly_what_it_held_unacknowledged() {
        let mut m = SendMachine::default();
        for i in 0..6u64 {
            m.post(i, 10 * (i + 1), i);
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
        assert_eq!(drain(&mut m), vec![tx(2, 30), tx(4, 50)]);
        // The receiver had got seq 2 before the lane died: its ack is accepted.
        m.handle_ack(6).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 6);
        assert_eq!(m.pending(), 0);
    }

    #[test]
    fn a_welcome_may_be_older_than_the_last_ack_but_not_beyond_what_was_sent() {
        let mut m = SendMachine::default();
        for i in 0..4u64 {
            m.post(i, 1, i);
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
        m.post(0, 1, 1);
        m.post(1, 2, 2);
        let _ = m.poll_transmit(0);
        m.handle_lane_lost(ConnError::PeerClosed);
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { seq: 0, .. })
        ));
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { seq: 1, .. })
        ));
        m.post(2, 3, 3);
        assert!(matches!(
            m.poll_event(),
            Some(Outcome::Failed { seq: 2, .. })
        ));
        assert!(m.poll_transmit(0).is_none());
        assert_eq!(m.pending(), 0);
    }
}
