//! The receiving half of a comm.
//!
//! Call order: `post` for each receive NCCL posts; for each inbound `Data` header call
//! `handle_data` and, once the payload is in place, `payload_done`; then drain
//! `poll_transmit` (CTS and acks to send) and `poll_event` (completed receives).

use std::collections::VecDeque;

use super::{ConnError, Stats};

/// Control frames the receiver owes the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Clear-to-send: receive `seq` is posted with `capacity` bytes.
    Cts { seq: u64, capacity: u64 },
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

#[derive(Debug, PartialEq, Eq)]
pub enum RecvEvent<T> {
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
struct Posted<T> {
    seq: u64,
    capacity: u64,
    token: T,
}

/// Receiver-side bookkeeping of one comm.
#[derive(Debug)]
pub struct RecvMachine<T> {
    posted: VecDeque<Posted<T>>,
    next_seq: u64,
    /// Next sequence number to deliver.
    delivered: u64,
    /// A `Deliver` handed out and not yet finished.
    in_progress: Option<u64>,
    ctrl: VecDeque<Control>,
    ack_owed: bool,
    events: VecDeque<RecvEvent<T>>,
    failed: Option<ConnError>,
    pub stats: Stats,
}

impl<T> Default for RecvMachine<T> {
    fn default() -> Self {
        RecvMachine {
            posted: VecDeque::new(),
            next_seq: 0,
            delivered: 0,
            in_progress: None,
            ctrl: VecDeque::new(),
            ack_owed: false,
            events: VecDeque::new(),
            failed: None,
            stats: Stats::default(),
        }
    }
}

impl<T> RecvMachine<T> {
    /// Posts a receive of up to `capacity` bytes and owes the sender its CTS.
    pub fn post(&mut self, capacity: u64, token: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(error) = self.failed.clone() {
            self.delivered = self.delivered.max(seq + 1);
            self.events
                .push_back(RecvEvent::Failed { seq, token, error });
        } else {
            self.posted.push_back(Posted {
                seq,
                capacity,
                token,
            });
            self.ctrl.push_back(Control::Cts { seq, capacity });
        }
        seq
    }

    /// A `Data{seq, len}` header arrived.
    pub fn handle_data(&mut self, seq: u64, len: u64) -> Result<Placement, ConnError> {
        if self.in_progress.is_some() {
            return Err(ConnError::Protocol("data header inside a payload".into()));
        }
        if seq < self.delivered {
            self.stats.duplicates += 1;
            return Ok(Placement::Discard { len });
        }
        if seq > self.delivered {
            return Err(ConnError::Protocol(format!(
                "data {seq}, expected {}",
                self.delivered
            )));
        }
        let p = self
            .posted
            .front()
            .filter(|p| p.seq == seq)
            .ok_or_else(|| ConnError::Protocol(format!("data {seq} without a posted receive")))?;
        if len > p.capacity {
            return Err(ConnError::Protocol(format!(
                "data {seq} of {len} bytes exceeds the announced {}",
                p.capacity
            )));
        }
        self.in_progress = Some(seq);
        Ok(Placement::Deliver { seq, len })
    }

    /// The caller's handle of posted receive `seq`.
    pub fn message(&self, seq: u64) -> Option<&T> {
        self.posted.iter().find(|p| p.seq == seq).map(|p| &p.token)
    }

    /// The payload of the `Deliver` in progress is entirely in its buffer.
    pub fn payload_done(&mut self, seq: u64, len: u64) -> Result<(), ConnError> {
        if self.in_progress != Some(seq) {
            return Err(ConnError::Protocol(format!(
                "payload {seq} was not expected"
            )));
        }
        self.in_progress = None;
        let p = self
            .posted
            .pop_front()
            .expect("in-progress receive is at the front");
        self.delivered = seq + 1;
        self.ack_owed = true;
        self.stats.messages += 1;
        self.stats.bytes += len;
        self.events.push_back(RecvEvent::Completed {
            seq,
            len,
            token: p.token,
        });
        Ok(())
    }

    /// The sender's message `seq` of `len` bytes did not fit: that receive fails with a
    /// usage error and the comm moves on to the next one.
    pub fn handle_truncated(&mut self, seq: u64, len: u64) -> Result<(), ConnError> {
        match self.posted.front() {
            Some(p) if p.seq == seq && seq == self.delivered && self.in_progress.is_none() => {
                let capacity = p.capacity;
                let p = self.posted.pop_front().expect("front checked");
                self.delivered = seq + 1;
                self.ack_owed = true;
                self.events.push_back(RecvEvent::Failed {
                    seq,
                    token: p.token,
                    error: ConnError::Truncated { len, capacity },
                });
                Ok(())
            }
            _ => Err(ConnError::Protocol(format!(
                "truncation notice for {seq} out of order"
            ))),
        }
    }

    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Control> {
        if self.failed.is_some() {
            return None;
        }
        if let Some(c) = self.ctrl.pop_front() {
            return Some(c);
        }
        // Acks are cumulative: one carries every delivery since the last.
        if std::mem::take(&mut self.ack_owed) {
            return Some(Control::Ack {
                delivered: self.delivered,
            });
        }
        None
    }

    #[must_use]
    pub fn poll_event(&mut self) -> Option<RecvEvent<T>> {
        self.events.pop_front()
    }

    /// A new lane replaces the old one: a partly received message will arrive again in
    /// full, and the sender needs a fresh CTS for every receive still waiting. Returns the
    /// number of messages delivered so far, which the new lane's handshake reports.
    pub fn begin_replay(&mut self) -> u64 {
        self.in_progress = None;
        self.ctrl.clear();
        self.ack_owed = false;
        for p in &self.posted {
            self.ctrl.push_back(Control::Cts {
                seq: p.seq,
                capacity: p.capacity,
            });
        }
        self.delivered
    }

    /// The lane is gone and will not be replaced: every posted receive fails.
    pub fn handle_lane_lost(&mut self, error: ConnError) {
        self.in_progress = None;
        self.delivered = self.next_seq;
        while let Some(p) = self.posted.pop_front() {
            self.events.push_back(RecvEvent::Failed {
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
                    capacity: 100
                },
                Control::Cts {
                    seq: 1,
                    capacity: 0
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
            m.handle_data(0, 40).unwrap(),
            Placement::Deliver { seq: 0, len: 40 }
        );
        assert_eq!(m.message(0), Some(&'a'));
        assert!(m.poll_event().is_none());
        m.payload_done(0, 40).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(RecvEvent::Completed {
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
            m.handle_data(i, 8).unwrap();
            m.payload_done(i, 8).unwrap();
        }
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 3 }]);
    }

    #[test]
    fn zero_byte_and_maximum_size_messages() {
        let mut m = RecvMachine::default();
        m.post(0, 0);
        m.post(crate::conn::wire::MAX_DATA, 1);
        assert_eq!(
            m.handle_data(0, 0).unwrap(),
            Placement::Deliver { seq: 0, len: 0 }
        );
        m.payload_done(0, 0).unwrap();
        let max = crate::conn::wire::MAX_DATA;
        assert_eq!(
            m.handle_data(1, max).unwrap(),
            Placement::Deliver { seq: 1, len: max }
        );
        m.payload_done(1, max).unwrap();
        assert_eq!(m.stats.bytes, max);
        assert_eq!(m.delivered(), 2);
    }

    #[test]
    fn out_of_order_oversized_or_unposted_data_is_a_protocol_error() {
        let mut m = RecvMachine::default();
        assert!(m.handle_data(0, 1).is_err(), "no receive posted");
        m.post(10, ());
        m.post(10, ());
        assert!(m.handle_data(1, 1).is_err(), "gap");
        assert!(m.handle_data(0, 11).is_err(), "larger than announced");
        m.handle_data(0, 10).unwrap();
        assert!(m.handle_data(1, 1).is_err(), "header inside a payload");
        assert!(m.payload_done(1, 1).is_err(), "wrong payload");
    }

    #[test]
    fn truncation_fails_that_receive_and_moves_on() {
        let mut m = RecvMachine::default();
        m.post(10, 'a');
        m.post(10, 'b');
        let _ = ctrl(&mut m);
        m.handle_truncated(0, 11).unwrap();
        assert_eq!(
            m.poll_event(),
            Some(RecvEvent::Failed {
                seq: 0,
                token: 'a',
                error: ConnError::Truncated {
                    len: 11,
                    capacity: 10
                }
            })
        );
        assert_eq!(ctrl(&mut m), vec![Control::Ack { delivered: 1 }]);
        m.handle_data(1, 10).unwrap();
        m.payload_done(1, 10).unwrap();
        assert!(m.handle_truncated(5, 1).is_err());
    }

    #[test]
    fn replay_drops_duplicates_and_reannounces_waiting_receives() {
        let mut m = RecvMachine::default();
        for i in 0..3 {
            m.post(100, i);
        }
        let _ = ctrl(&mut m);
        m.handle_data(0, 100).unwrap();
        m.payload_done(0, 100).unwrap();
        // Message 1 was half received when the lane died.
        m.handle_data(1, 100).unwrap();
        assert_eq!(m.begin_replay(), 1);
        assert_eq!(
            ctrl(&mut m),
            vec![
                Control::Cts {
                    seq: 1,
                    capacity: 100
                },
                Control::Cts {
                    seq: 2,
                    capacity: 100
                }
            ]
        );
        // A sender replaying from further back: the overlap is discarded and counted.
        assert_eq!(
            m.handle_data(0, 100).unwrap(),
            Placement::Discard { len: 100 }
        );
        assert_eq!(m.stats.duplicates, 1);
        assert_eq!(
            m.handle_data(1, 100).unwrap(),
            Placement::Deliver { seq: 1, len: 100 }
        );
        m.payload_done(1, 100).unwrap();
        assert_eq!(m.delivered(), 2);
    }

    #[test]
    fn lost_lane_fails_every_receive() {
        let mut m = RecvMachine::default();
        m.post(1, 'a');
        m.post(1, 'b');
        m.handle_lane_lost(ConnError::PeerClosed);
        assert!(matches!(
            m.poll_event(),
            Some(RecvEvent::Failed { token: 'a', .. })
        ));
        assert!(matches!(
            m.poll_event(),
            Some(RecvEvent::Failed { token: 'b', .. })
        ));
        m.post(1, 'c');
        assert!(matches!(
            m.poll_event(),
            Some(RecvEvent::Failed { token: 'c', .. })
        ));
        assert!(m.poll_transmit().is_none());
    }
}
