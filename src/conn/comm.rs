//! One comm's data machine, either side, behind one interface: the reactor feeds it the
//! frames and payloads of the comm's lanes and writes what it gives back. No sockets, no
//! threads, no clock reads. Lanes are the caller's keys.
//!
//! Call order: [`CommMachine::post_send`] (matched sends) and [`CommMachine::post_recv`]
//! NCCL's requests; feed each lane's items to
//! [`CommMachine::handle_frame`], [`CommMachine::handle_data`] (then place the payload
//! where it says) and [`CommMachine::handle_payload_done`]; then write
//! [`CommMachine::poll_data`]'s output on the lane the caller picks (sender) or
//! [`CommMachine::poll_control`]'s on every lane (receiver: control frames are small and
//! idempotent, so whichever lane survives carries them), and settle the requests
//! [`CommMachine::poll_outcome`] gives.

use super::wire::{Group, Header, Kind, STALLED_MEMORY};
use super::{ConnError, Control, Outcome, Placement, RecvMachine, SendMachine, Transmit};

/// What a frame without payload meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// The receiver posted receive `seq` of `capacity` bytes in `group` (sender only): for
    /// the comm's [`Matcher`](super::matching::Matcher), which NCCL's `isend` asks.
    Cts {
        seq: u64,
        capacity: u64,
        group: Group,
    },
    /// The receiver acknowledged progress, so a failover is complete.
    Progress,
    /// The sender retired the lane it came on (receiver only).
    Retire,
    /// The sender gave up the comm's lane of this epoch: fence it now (receiver only).
    Fence(u64),
    /// The receiver's drained NICs, a bit per index (sender only).
    Drained(u32),
}

/// A comm's machine: the send side or the receive side.
#[derive(Debug)]
pub enum CommMachine<T> {
    Send(SendMachine<T>),
    Recv(RecvMachine<T>),
}

impl<T> CommMachine<T> {
    pub fn new(sender: bool) -> CommMachine<T> {
        if sender {
            CommMachine::Send(SendMachine::default())
        } else {
            CommMachine::Recv(RecvMachine::default())
        }
    }

    /// Requests posted and not yet settled.
    pub fn pending(&self) -> usize {
        match self {
            CommMachine::Send(m) => m.pending(),
            CommMachine::Recv(m) => m.pending(),
        }
    }

    /// Sender: NCCL posted a send of `len` bytes, matched to receive `seq` (and cut to
    /// its size); a receive comm hands the token back.
    pub fn post_send(&mut self, seq: u64, len: u64, token: T) -> Result<(), T> {
        let CommMachine::Send(m) = self else {
            return Err(token);
        };
        m.post(seq, len, token);
        Ok(())
    }

    /// Receiver: NCCL posted a grouped receive, `(capacity, tag, token)` for each of its
    /// 1 to [`MAX_GROUP`](super::wire::MAX_GROUP) buffers; a send comm hands the tokens
    /// back.
    pub fn post_recv(&mut self, subs: Vec<(u64, i32, T)>) -> Result<(), Vec<T>> {
        let CommMachine::Recv(m) = self else {
            return Err(subs.into_iter().map(|(_, _, t)| t).collect());
        };
        m.post_group(subs);
        Ok(())
    }

    /// Sender: a posted send contradicts what the receiver acknowledged; the comm must
    /// fail with this error.
    pub fn take_fault(&mut self) -> Option<ConnError> {
        match self {
            CommMachine::Send(m) => m.take_fault(),
            CommMachine::Recv(_) => None,
        }
    }

    /// A frame without payload from the peer.
    pub fn handle_frame(&mut self, h: &Header) -> Result<Heard, ConnError> {
        match (self, h.kind) {
            (_, Kind::Close) => Err(ConnError::PeerClosed),
            (CommMachine::Send(_), Kind::Stalled) if h.len == STALLED_MEMORY => {
                Err(ConnError::PeerMemory)
            }
            (CommMachine::Send(_), Kind::Stalled) => Err(ConnError::Stalled(
                "the receiver has heard nothing on this lane for the completion timeout".into(),
            )),
            (CommMachine::Send(_), Kind::Cts) => {
                let (capacity, group) = Group::of_cts(h);
                Ok(Heard::Cts {
                    seq: h.seq,
                    capacity,
                    group,
                })
            }
            (CommMachine::Send(m), Kind::Ack) => m.handle_ack(h.seq).map(|()| Heard::Progress),
            (CommMachine::Recv(_), Kind::Retire) => Ok(Heard::Retire),
            (CommMachine::Recv(_), Kind::Fence) => Ok(Heard::Fence(h.seq)),
            (CommMachine::Send(_), Kind::Drained) => Ok(Heard::Drained(h.aux)),
            _ => Err(ConnError::Protocol(format!("unexpected {h:?}"))),
        }
    }

    /// A payload's header on `lane`: the posted receive it fills, or `None` for a
    /// duplicate to read and drop.
    pub fn handle_data(
        &mut self,
        lane: usize,
        seq: u64,
        len: u64,
    ) -> Result<Option<&T>, ConnError> {
        let CommMachine::Recv(m) = self else {
            return Err(ConnError::Protocol(format!(
                "unexpected Data {{ seq: {seq}, len: {len} }}"
            )));
        };
        match m.handle_data(lane, seq, len)? {
            Placement::Deliver { seq, .. } => Ok(m.message(seq)),
            Placement::Discard { .. } => Ok(None),
        }
    }

    /// The payload `lane` was reading has fully arrived (placed or dropped). Returns the
    /// other lanes that must drop the rest of their copy of the same message.
    pub fn handle_payload_done(
        &mut self,
        lane: usize,
        seq: u64,
        len: u64,
    ) -> Result<Vec<usize>, ConnError> {
        let CommMachine::Recv(m) = self else {
            return Err(ConnError::Protocol(format!(
                "unexpected PayloadDone {{ seq: {seq}, len: {len} }}"
            )));
        };
        m.payload_done(lane, seq, len)
    }

    /// Sender: the next message to write on `lane`, which the caller picked for it (a
    /// `Data` frame with the payload of [`CommMachine::message`]).
    #[must_use]
    pub fn poll_data(&mut self, lane: usize) -> Option<Transmit> {
        let CommMachine::Send(m) = self else {
            return None;
        };
        m.poll_transmit(lane)
    }

    /// Sender: a message is cleared and waits for a lane.
    pub fn wants_lane(&self) -> bool {
        matches!(self, CommMachine::Send(m) if m.wants_lane())
    }

    /// Receiver: Acks may wait for the next turn ([`RecvMachine::hold_acks`]).
    pub fn hold_acks(&mut self) {
        if let CommMachine::Recv(m) = self {
            m.hold_acks();
        }
    }

    /// Receiver: a turn began; an Ack held in the last one goes now.
    pub fn release_ack(&mut self) {
        if let CommMachine::Recv(m) = self {
            m.release_ack();
        }
    }

    /// Receiver: an Ack is owed and waits for the next turn.
    pub fn holds_ack(&self) -> bool {
        matches!(self, CommMachine::Recv(m) if m.holds_ack())
    }

    /// Receiver: the next control frame, to write on every lane.
    #[must_use]
    pub fn poll_control(&mut self) -> Option<Header> {
        let CommMachine::Recv(m) = self else {
            return None;
        };
        m.poll_transmit().map(|c| match c {
            Control::Cts {
                seq,
                capacity,
                group,
            } => group.cts(seq, capacity),
            Control::Ack { delivered } => Header::new(Kind::Ack, delivered, 0),
        })
    }

    /// The token of message `seq` (a send's, for its payload).
    pub fn message(&self, seq: u64) -> Option<&T> {
        match self {
            CommMachine::Send(m) => m.message(seq),
            CommMachine::Recv(m) => m.message(seq),
        }
    }

    /// Sender: message `seq` goes out for the first time ([`SendMachine::first_try`]).
    pub fn first_try(&self, seq: u64) -> bool {
        matches!(self, CommMachine::Send(m) if m.first_try(seq))
    }

    /// A settled request: its token and its length, or why it failed.
    #[must_use]
    pub fn poll_outcome(&mut self) -> Option<(T, Result<u64, ConnError>)> {
        match self {
            CommMachine::Send(m) => m.poll_event().map(|e| match e {
                Outcome::Completed { len, token, .. } => (token, Ok(len)),
                Outcome::Failed { token, error, .. } => (token, Err(error)),
            }),
            CommMachine::Recv(m) => m.poll_event().map(|e| match e {
                Outcome::Completed { len, token, .. } => (token, Ok(len)),
                Outcome::Failed { token, error, .. } => (token, Err(error)),
            }),
        }
    }

    /// One of the comm's lanes is gone. Sender: what it held unacknowledged is sent again
    /// on the lanes left (returns those bytes). Receiver: its partial payload is dropped,
    /// and every waiting receive is announced again on the lanes left.
    pub fn handle_lane_down(&mut self, lane: usize) -> u64 {
        match self {
            CommMachine::Send(m) => m.handle_lane_down(lane),
            CommMachine::Recv(m) => {
                m.handle_lane_down(lane);
                m.reannounce();
                0
            }
        }
    }

    /// Sender: messages on `lane` not yet acknowledged.
    pub fn on_lane(&self, lane: usize) -> usize {
        match self {
            CommMachine::Send(m) => m.on_lane(lane),
            CommMachine::Recv(_) => 0,
        }
    }

    /// The comm is lost: every request fails with `error`, now and later.
    pub fn handle_lane_lost(&mut self, error: ConnError) {
        match self {
            CommMachine::Send(m) => m.handle_lane_lost(error),
            CommMachine::Recv(m) => m.handle_lane_lost(error),
        }
    }

    /// Receiver: a lane joined; returns how many messages were delivered, which its
    /// Welcome reports, and announces every waiting receive again.
    pub fn replay_point(&mut self) -> u64 {
        match self {
            CommMachine::Recv(m) => m.reannounce(),
            CommMachine::Send(_) => 0,
        }
    }

    /// Sender: a new lane was welcomed by a receiver that has `delivered` messages.
    pub fn handle_welcome(&mut self, delivered: u64) -> Result<(), ConnError> {
        match self {
            CommMachine::Send(m) => m.handle_welcome(delivered),
            CommMachine::Recv(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_side_takes_only_its_frames() {
        let mut s = CommMachine::new(true);
        let mut r = CommMachine::new(false);
        assert_eq!(s.post_recv(vec![(1, 0, 'x')]), Err(vec!['x']));
        assert_eq!(r.post_send(0, 1, 'y'), Err('y'));
        assert_eq!(r.post_recv(vec![(8, 5, 'b')]), Ok(()));
        // CTS from the receiver, then the send matched to it, its data, then its ack.
        let cts = r.poll_control().expect("the receiver's CTS first");
        let group = Group {
            tag: 5,
            ..Group::SINGLE
        };
        assert_eq!(
            s.handle_frame(&cts),
            Ok(Heard::Cts {
                seq: 0,
                capacity: 8,
                group
            })
        );
        assert!(!s.wants_lane());
        assert_eq!(s.post_send(0, 4, 'a'), Ok(()));
        assert!(s.wants_lane());
        assert_eq!(s.poll_data(3), Some(Transmit { seq: 0, len: 4 }));
        assert_eq!(s.on_lane(3), 1);
        assert_eq!(s.message(0), Some(&'a'));
        assert_eq!(r.handle_data(3, 0, 4), Ok(Some(&'b')));
        assert_eq!(r.handle_payload_done(3, 0, 4), Ok(vec![]));
        assert_eq!(r.poll_outcome(), Some(('b', Ok(4))));
        let ack = r.poll_control().expect("an ack");
        assert_eq!(s.handle_frame(&ack), Ok(Heard::Progress));
        assert_eq!(s.poll_outcome(), Some(('a', Ok(4))));
        // Frames of the other side are protocol errors; a Close is the peer leaving.
        assert!(matches!(r.handle_frame(&ack), Err(ConnError::Protocol(_))));
        assert!(matches!(
            s.handle_data(3, 1, 1),
            Err(ConnError::Protocol(_))
        ));
        assert_eq!(r.poll_data(3), None);
        assert_eq!(s.poll_control(), None);
        let stalled = Header::new(Kind::Stalled, 0, 0);
        assert!(matches!(
            s.handle_frame(&stalled),
            Err(ConnError::Stalled(_))
        ));
        assert!(matches!(
            r.handle_frame(&stalled),
            Err(ConnError::Protocol(_))
        ));
        let retire = Header::new(Kind::Retire, 0, 0);
        assert_eq!(r.handle_frame(&retire), Ok(Heard::Retire));
        assert!(matches!(
            s.handle_frame(&retire),
            Err(ConnError::Protocol(_))
        ));
        let fence = Header::new(Kind::Fence, 5, 0);
        assert_eq!(r.handle_frame(&fence), Ok(Heard::Fence(5)));
        assert!(matches!(
            s.handle_frame(&fence),
            Err(ConnError::Protocol(_))
        ));
        let close = Header::new(Kind::Close, 0, 0);
        assert_eq!(r.handle_frame(&close), Err(ConnError::PeerClosed));
    }

    #[test]
    fn a_lost_comm_settles_every_request_with_the_error() {
        let mut r = CommMachine::new(false);
        r.post_recv(vec![(8, 0, 1)]).unwrap();
        r.post_recv(vec![(8, 0, 2)]).unwrap();
        assert_eq!(r.pending(), 2);
        r.handle_lane_lost(ConnError::PeerClosed);
        let got: Vec<_> = std::iter::from_fn(|| r.poll_outcome()).collect();
        assert_eq!(
            got,
            [
                (1, Err(ConnError::PeerClosed)),
                (2, Err(ConnError::PeerClosed))
            ]
        );
        assert_eq!(r.pending(), 0);
    }
}
