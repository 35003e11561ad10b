//! The sending half of a comm.
//!
//! Call order, per reactor turn: feed inputs (`post`, `handle_cts`, `handle_ack`,
//! `handle_lane_lost`), then drain outputs (`poll_transmit` until `None`, then
//! `poll_event` until `None`). A message is transmitted only after the receiver's
//! clear-to-send for its sequence number, and completes only when the receiver has
//! acknowledged it, so everything not yet acknowledged can be replayed on another lane.

use std::collections::VecDeque;

use super::{ConnError, Stats};

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
    token: T,
}

/// Sender-side bookkeeping of one comm. `T` is the caller's handle for a message
/// (its buffer and request); the machine never looks inside it.
#[derive(Debug)]
pub struct SendMachine<T> {
    /// Posted and not yet acknowledged, in sequence order.
    queue: VecDeque<Msg<T>>,
    next_seq: u64,
    /// Next sequence number to transmit.
    tx_next: u64,
    /// Receive capacities announced by CTS, from `cts_base` on.
    cts: VecDeque<u64>,
    cts_base: u64,
    /// Messages the receiver has acknowledged (cumulative).
    acked: u64,
    events: VecDeque<SendEvent<T>>,
    failed: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for SendMachine<T> {
    fn default() -> Self {
        SendMachine {
            queue: VecDeque::new(),
            next_seq: 0,
            tx_next: 0,
            cts: VecDeque::new(),
            cts_base: 0,
            acked: 0,
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
            self.queue.push_back(Msg { seq, len, token });
        }
        seq
    }

    /// The receiver posted receive `seq` with `capacity` bytes.
    pub fn handle_cts(&mut self, seq: u64, capacity: u64) -> Result<(), ConnError> {
        let expected = self.cts_base + self.cts.len() as u64;
        if seq != expected {
            return Err(ConnError::Protocol(format!(
                "CTS for {seq}, expected {expected}"
            )));
        }
        self.cts.push_back(capacity);
        Ok(())
    }

    /// The receiver has delivered every message below `delivered`.
    pub fn handle_ack(&mut self, delivered: u64) -> Result<(), ConnError> {
        if delivered > self.tx_next || delivered < self.acked {
            return Err(ConnError::Protocol(format!(
                "ack {delivered} outside [{}, {}]",
                self.acked, self.tx_next
            )));
        }
        self.acked = delivered;
        while self.queue.front().is_some_and(|m| m.seq < delivered) {
            let m = self.queue.pop_front().expect("front checked");
            self.stats.messages += 1;
            self.stats.bytes += m.len;
            self.events.push_back(SendEvent::Completed {
                seq: m.seq,
                len: m.len,
                token: m.token,
            });
        }
        Ok(())
    }

    /// The next thing to put on the lane, if any message is both posted and cleared.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if self.failed.is_some() {
            return None;
        }
        let seq = self.tx_next;
        let idx = seq.checked_sub(self.cts_base)? as usize;
        let capacity = *self.cts.get(idx)?;
        let pos = self.queue.iter().position(|m| m.seq == seq)?;
        self.tx_next += 1;
        let len = self.queue[pos].len;
        if len > capacity {
            let m = self.queue.remove(pos).expect("position found");
            self.events.push_back(SendEvent::Failed {
                seq,
                token: m.token,
                error: ConnError::Truncated { len, capacity },
            });
            return Some(Transmit::Truncated { seq, len });
        }
        Some(Transmit::Data { seq, len })
    }

    /// The caller's handle of message `seq` while it is unacknowledged.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.queue.iter().find(|m| m.seq == seq).map(|m| &m.token)
    }

    #[must_use]
    pub fn poll_event(&mut self) -> Option<SendEvent<T>> {
        self.events.pop_front()
    }

    /// The lane is gone and will not be replaced: every pending message fails.
    pub fn handle_lane_lost(&mut self, error: ConnError) {
        self.acked = self.next_seq;
        while let Some(m) = self.queue.pop_front() {
            self.events.push_back(SendEvent::Failed {
                seq: m.seq,
                token: m.token,
                error: error.clone(),
            });
        }
        self.failed.get_or_insert(error);
    }

    /// A new lane replaces the old one and the receiver reports `delivered` messages:
    /// acknowledge those, and transmit again from there once fresh CTS arrive (the
    /// receiver re-announces every receive it still waits for). Returns the bytes that
    /// will be sent again.
    pub fn begin_replay(&mut self, delivered: u64) -> Result<u64, ConnError> {
        if delivered < self.acked || delivered > self.tx_next {
            return Err(ConnError::Protocol(format!(
                "replay from {delivered} outside [{}, {}]",
                self.acked, self.tx_next
            )));
        }
        self.handle_ack(delivered)?;
        let replayed: u64 = self
            .queue
            .iter()
            .filter(|m| m.seq < self.tx_next)
            .map(|m| m.len)
            .sum();
        self.stats.replayed_bytes += replayed;
        self.tx_next = delivered;
        self.cts.clear();
        self.cts_base = delivered;
        Ok(replayed)
    }

    /// Sent but not yet acknowledged, or not yet sent: messages still owed.
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
        std::iter::from_fn(|| m.poll_transmit()).collect()
    }

    #[test]
    fn nothing_moves_before_clear_to_send() {
        let mut m = SendMachine::default();
        m.post(10, 'a');
        m.post(0, 'b');
        assert!(drain(&mut m).is_empty());
        m.handle_cts(0, 10).unwrap();
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 0, len: 10 }]);
        m.handle_cts(1, 100).unwrap();
        // Zero-byte messages are real messages.
        assert_eq!(drain(&mut m), vec![Transmit::Data { seq: 1, len: 0 }]);
        assert!(m.poll_event().is_none(), "no completion before the ack");
    }

    #[test]
    fn cts_may_arrive_before_the_send() {
        let mut m = SendMachine::default();
        m.handle_cts(0, 64).unwrap();
        m.handle_cts(1, 64).unwrap();
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
        assert!(m.handle_cts(1, 5).is_err(), "CTS out of order");
        assert!(m.handle_ack(1).is_err(), "ack for something never sent");
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
        m.handle_ack(2).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 1,
                len: 5,
                token: 'y'
            })
        );
    }

    #[test]
    fn replay_resends_exactly_the_unacknowledged() {
        let mut m = SendMachine::default();
        for i in 0..4u64 {
            m.post(10 * (i + 1), i);
            m.handle_cts(i, 1000).unwrap();
        }
        assert_eq!(drain(&mut m).len(), 4);
        m.handle_ack(1).unwrap();
        let _ = m.poll_event();
        // The lane dies; the receiver says it delivered 2 messages.
        let replayed = m.begin_replay(2).unwrap();
        assert_eq!(replayed, 30 + 40);
        assert_eq!(m.stats.replayed_bytes, 70);
        assert_eq!(
            m.poll_event(),
            Some(SendEvent::Completed {
                seq: 1,
                len: 20,
                token: 1
            })
        );
        assert!(drain(&mut m).is_empty(), "waits for fresh CTS");
        m.handle_cts(2, 1000).unwrap();
        m.handle_cts(3, 1000).unwrap();
        assert_eq!(
            drain(&mut m),
            vec![
                Transmit::Data { seq: 2, len: 30 },
                Transmit::Data { seq: 3, len: 40 }
            ]
        );
        m.handle_ack(4).unwrap();
        assert_eq!(std::iter::from_fn(|| m.poll_event()).count(), 2);
        assert!(
            m.begin_replay(3).is_err(),
            "cannot replay below what was acknowledged"
        );
    }

    #[test]
    fn lost_lane_fails_everything_pending_and_later() {
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
        assert!(m.poll_transmit().is_none());
        assert_eq!(m.pending(), 0);
    }
}
