//! Per-comm protocol machines: no sockets, no threads, no clock reads.
//!
//! A comm is one direction of an NCCL connection: a [`SendMachine`] on one side, a
//! [`RecvMachine`] on the other. They agree on per-comm sequence numbers, move data
//! only after the receiver's clear-to-send, acknowledge cumulatively and keep every
//! unacknowledged message so that it can be replayed on another lane; [`comm`] puts both
//! behind one interface. [`lane`] is one lane's handshake, deadline and liveness (silence,
//! keepalives, brown-out); [`path`] is a comm's life across failures (attempts, detection,
//! the receiver's wait for a replacement). The reactor feeds them decoded frames and `now`
//! and does the I/O; [`wire`] is the byte format.

pub mod auth;
pub mod comm;
pub mod health;
pub mod lane;
pub mod path;
pub mod recv;
pub mod send;
pub mod wire;

pub use recv::{Control, Placement, RecvEvent, RecvMachine};
pub use send::{SendEvent, SendMachine, Transmit};

/// Why a message or a comm failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    /// The send was larger than the posted receive (a usage error on both sides).
    #[error("message of {len} bytes is larger than the posted receive of {capacity} bytes")]
    Truncated { len: u64, capacity: u64 },
    /// The peer broke the protocol; the lane is closed.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer closed the comm or its process went away.
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer no longer has the comm (it failed or was closed there): no replacement
    /// lane can restore it.
    #[error("the peer no longer has this comm: {0}")]
    Gone(String),
    /// The local socket failed.
    #[error("network error: {0}")]
    Io(String),
    /// The path stopped making progress: silence, a brown-out, or the peer hearing
    /// nothing on it.
    #[error("no progress: {0}")]
    Stalled(String),
}

/// Plain counters of one machine; telemetry reads them, the machine knows no metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub messages: u64,
    pub bytes: u64,
    pub replayed_bytes: u64,
    pub duplicates: u64,
}

#[cfg(test)]
mod tests {
    //! The two machines joined back to back, checking they agree with each other.
    use super::*;

    /// Runs a full exchange with the given send sizes and receive capacities.
    fn exchange(sends: &[u64], caps: &[u64]) -> (Vec<RecvEvent<usize>>, Vec<SendEvent<usize>>) {
        let mut s = SendMachine::default();
        let mut r = RecvMachine::default();
        for (i, &len) in sends.iter().enumerate() {
            s.post(len, i);
        }
        for (i, &cap) in caps.iter().enumerate() {
            r.post(cap, i);
        }
        for _ in 0..(sends.len() * 4 + 4) {
            while let Some(c) = r.poll_transmit() {
                match c {
                    Control::Cts { seq, capacity } => s.handle_cts(seq, capacity).unwrap(),
                    Control::Ack { delivered } => s.handle_ack(delivered).unwrap(),
                }
            }
            while let Some(t) = s.poll_transmit() {
                match t {
                    Transmit::Data { seq, len } => match r.handle_data(seq, len).unwrap() {
                        Placement::Deliver { seq, len } => r.payload_done(seq, len).unwrap(),
                        Placement::Discard { .. } => unreachable!("no replay here"),
                    },
                    Transmit::Truncated { seq, len } => r.handle_truncated(seq, len).unwrap(),
                }
            }
        }
        (
            std::iter::from_fn(|| r.poll_event()).collect(),
            std::iter::from_fn(|| s.poll_event()).collect(),
        )
    }

    #[test]
    fn every_message_completes_on_both_sides_in_order() {
        let sends = [0, 1, 4095, 4096, 65537, 1 << 20];
        let (recvd, sent) = exchange(&sends, &[1 << 20; 6]);
        let got: Vec<(u64, u64)> = recvd
            .iter()
            .map(|e| match e {
                RecvEvent::Completed { seq, len, .. } => (*seq, *len),
                RecvEvent::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        let want: Vec<(u64, u64)> = sends
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u64, l))
            .collect();
        assert_eq!(got, want);
        assert_eq!(sent.len(), sends.len());
        assert!(sent
            .iter()
            .all(|e| matches!(e, SendEvent::Completed { .. })));
    }

    #[test]
    fn oversized_send_fails_both_sides_and_the_next_one_still_works() {
        let (recvd, sent) = exchange(&[10, 3], &[9, 9]);
        assert!(matches!(
            recvd[0],
            RecvEvent::Failed {
                error: ConnError::Truncated { .. },
                ..
            }
        ));
        assert!(matches!(recvd[1], RecvEvent::Completed { len: 3, .. }));
        assert!(matches!(
            sent[0],
            SendEvent::Failed {
                error: ConnError::Truncated { .. },
                ..
            }
        ));
        assert!(matches!(sent[1], SendEvent::Completed { len: 3, .. }));
    }
}
