//! Per-comm protocol machines: no sockets, no threads, no clock reads.
//!
//! A comm is one direction of an NCCL connection: a [`SendMachine`] on one side, a
//! [`RecvMachine`] on the other. They agree on per-comm sequence numbers, move data
//! only after the receiver's clear-to-send, acknowledge cumulatively and keep every
//! unacknowledged message so that it can be replayed on another lane; [`comm`] puts both
//! behind one interface. [`matching`] decides which posted receive each send fills, by
//! NCCL's IB rules, when NCCL posts it. [`lane`] is one lane's handshake, deadline and liveness (silence,
//! keepalives, brown-out); [`path`] is a comm's life across failures (attempts, detection,
//! the receiver's wait for a replacement). The reactor feeds them decoded frames and `now`
//! and does the I/O; [`wire`] is the byte format.

pub mod auth;
pub mod comm;
pub mod health;
#[cfg(test)]
pub(crate) mod ib_model;
pub mod lane;
pub mod matching;
pub mod path;
pub mod recv;
pub mod send;
pub mod wire;

pub use recv::{Control, Placement, RecvMachine};
pub use send::{SendMachine, Transmit};
pub use wire::Group;

/// What became of a message, sent or received, for its owner (the token it was posted
/// with).
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<T> {
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

/// Why a message or a comm failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
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
    /// The lane's NIC cannot register memory a message is in (GPU memory out of its
    /// reach): the comm needs a pair with another local NIC.
    #[error("{0}")]
    Memory(String),
    /// The peer's NIC cannot register its receive buffer: the comm needs a pair with
    /// another remote NIC.
    #[error("the receiver's NIC cannot register its receive buffer")]
    PeerMemory,
}

/// A fabric's device cannot register memory one of a comm's messages is in (GPU memory
/// out of its NIC's reach, or a driver without peer memory): the comm must move to a pair
/// whose NIC can, which a probe of the pair would not show. The `io::Error` a lane fails
/// with carries it, so that the engine can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryUnreachable(pub String);

impl std::fmt::Display for MemoryUnreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MemoryUnreachable {}

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
    use std::collections::VecDeque;
    use std::time::Instant;

    use super::matching::Matcher;
    use super::*;

    /// NCCL's sending side as the plugin runs it: a send waits in NCCL, retried after
    /// "not now", until the matcher gives it a receive; then it goes to the machine, cut
    /// to the receive's size.
    struct Sender<U> {
        matcher: Matcher,
        s: SendMachine<U>,
        waiting: VecDeque<(i32, u64, U)>,
        now: Instant,
    }

    impl<U> Sender<U> {
        fn new() -> Self {
            Sender {
                matcher: Matcher::default(),
                s: SendMachine::default(),
                waiting: VecDeque::new(),
                now: Instant::now(),
            }
        }

        fn post(&mut self, tag: i32, len: u64, token: U) {
            self.waiting.push_back((tag, len, token));
            self.retry();
        }

        /// NCCL calls `isend` again for every send it still holds.
        fn retry(&mut self) {
            for _ in 0..self.waiting.len() {
                let (tag, len, token) = self.waiting.pop_front().expect("counted");
                match self.matcher.claim(tag, self.now) {
                    Some(m) => self.s.post(m.seq, len.min(m.capacity), token),
                    None => self.waiting.push_back((tag, len, token)),
                }
            }
        }

        fn handle(&mut self, c: Control) {
            match c {
                Control::Cts {
                    seq,
                    capacity,
                    group,
                } => {
                    self.matcher.announce(seq, capacity, group).unwrap();
                    self.retry();
                }
                Control::Ack { delivered } => self.s.handle_ack(delivered).unwrap(),
            }
        }

        fn pending(&self) -> usize {
            self.waiting.len() + self.s.pending()
        }
    }

    /// Hands every control frame the receiver has to the sender, on one lane.
    fn hand_control<T, U>(r: &mut RecvMachine<T>, s: &mut Sender<U>) {
        while let Some(c) = r.poll_transmit() {
            s.handle(c);
        }
    }

    /// Runs a full exchange with the given send sizes and receive capacities.
    fn exchange(sends: &[u64], caps: &[u64]) -> (Vec<Outcome<usize>>, Vec<Outcome<usize>>) {
        let mut s = Sender::new();
        let mut r = RecvMachine::default();
        for (i, &len) in sends.iter().enumerate() {
            s.post(0, len, i);
        }
        for (i, &cap) in caps.iter().enumerate() {
            r.post(cap, i);
        }
        for _ in 0..(sends.len() * 4 + 4) {
            hand_control(&mut r, &mut s);
            while let Some(Transmit { seq, len }) = s.s.poll_transmit(0) {
                match r.handle_data(0, seq, len).unwrap() {
                    Placement::Deliver { seq, len } => {
                        r.payload_done(0, seq, len).unwrap();
                    }
                    Placement::Discard { .. } => unreachable!("no replay here"),
                }
            }
        }
        (
            std::iter::from_fn(|| r.poll_event()).collect(),
            std::iter::from_fn(|| s.s.poll_event()).collect(),
        )
    }

    /// A frame in flight on one lane of the striped exchange.
    #[derive(Debug, Clone, Copy)]
    enum Wire {
        Ctl(Control),
        Data(u64, u64),
    }

    /// Three lanes, frames delivered in a seeded interleaving; lane 1 dies after `kill`
    /// steps with whatever it still carried, and its payload in progress is cut short.
    fn striped(seed: u64, n: u64, kill: usize) -> (Vec<u64>, usize) {
        let mut s = Sender::new();
        let mut r = RecvMachine::default();
        for i in 0..n {
            s.post(0, 100 + i, i);
            r.post(1000, i);
        }
        let mut rng = crate::routing::rng::SplitMix64::new(seed);
        drive_striped(&mut rng, s, r, kill, |seq, len, _| {
            assert_eq!(len, 100 + seq, "seed {seed}: message {seq} intact");
        })
    }

    /// Runs `s` and `r` over three lanes as [`striped`] does; `check` sees each
    /// completed receive (sequence number, length, token).
    fn drive_striped<T: std::fmt::Debug, U: std::fmt::Debug>(
        rng: &mut crate::routing::rng::SplitMix64,
        mut s: Sender<U>,
        mut r: RecvMachine<T>,
        kill: usize,
        mut check: impl FnMut(u64, u64, T),
    ) -> (Vec<u64>, usize) {
        let mut up = [true; 3];
        let mut to_recv: [VecDeque<Wire>; 3] = Default::default();
        let mut to_send: [VecDeque<Wire>; 3] = Default::default();
        let mut completed = Vec::new();
        for step in 0..10_000 {
            if step == kill {
                up[1] = false;
                to_recv[1].clear();
                to_send[1].clear();
                s.s.handle_lane_down(1);
                r.handle_lane_down(1);
                r.reannounce();
            }
            let live: Vec<usize> = (0..3).filter(|&l| up[l]).collect();
            while let Some(c) = r.poll_transmit() {
                for &l in &live {
                    to_send[l].push_back(Wire::Ctl(c));
                }
            }
            let mut turn = 0;
            while s.s.wants_lane() {
                let l = live[turn % live.len()];
                turn += 1;
                let Transmit { seq, len } = s.s.poll_transmit(l).unwrap();
                to_recv[l].push_back(Wire::Data(seq, len));
            }
            let l = live[(rng.next_u64() % live.len() as u64) as usize];
            if rng.next_u64() % 2 == 0 {
                if let Some(Wire::Data(seq, len)) = to_recv[l].pop_front() {
                    if let Placement::Deliver { .. } = r.handle_data(l, seq, len).unwrap() {
                        r.payload_done(l, seq, len).unwrap();
                    }
                }
            } else if let Some(Wire::Ctl(c)) = to_send[l].pop_front() {
                s.handle(c);
            }
            while let Some(e) = r.poll_event() {
                match e {
                    Outcome::Completed { seq, len, token } => {
                        check(seq, len, token);
                        completed.push(seq);
                    }
                    Outcome::Failed { .. } => panic!("{e:?}"),
                }
            }
            while let Some(e) = s.s.poll_event() {
                assert!(matches!(e, Outcome::Completed { .. }), "{e:?}");
            }
            if s.pending() == 0 && r.pending() == 0 {
                return (completed, step);
            }
        }
        panic!("stuck with {} sends, {} receives", s.pending(), r.pending());
    }

    #[test]
    fn a_striped_comm_delivers_exactly_once_in_order_through_a_lane_death() {
        for seed in 0..200 {
            let kill = (seed as usize * 7) % 60;
            let (got, _) = striped(seed, 24, kill);
            assert_eq!(got, (0..24).collect::<Vec<u64>>(), "seed {seed}");
        }
    }

    #[test]
    fn grouped_receives_take_each_send_by_tag_through_a_lane_death() {
        for seed in 0..200 {
            let mut rng = crate::routing::rng::SplitMix64::new(seed);
            let mut s = Sender::new();
            let mut r = RecvMachine::default();
            let mut total = 0;
            for g in 0..6u64 {
                let n = 1 + rng.next_u64() % 8;
                // The same tags in every group, so a send whose tag is taken in the head
                // group belongs to the next one.
                let mut tags: Vec<i32> = (0..n as i32).map(|k| 100 + k).collect();
                let subs = tags.iter().map(|&t| (1000, t, (g, t))).collect();
                r.post_group(subs);
                // The sends of a group come in any order; the length names its buffer.
                for i in (1..tags.len()).rev() {
                    tags.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                for &t in &tags {
                    s.post(t, g * 1000 / 8 + t as u64, ());
                }
                total += n;
            }
            let kill = (seed as usize * 7) % 60;
            let (got, _) = drive_striped(&mut rng, s, r, kill, |seq, len, (g, t)| {
                assert_eq!(len, g * 1000 / 8 + t as u64, "seed {seed}: receive {seq}");
            });
            assert_eq!(got, (0..total).collect::<Vec<u64>>(), "seed {seed}");
        }
    }

    #[test]
    fn a_grouped_receive_gets_each_size_and_a_zero_byte_send() {
        let mut s = Sender::new();
        let mut r = RecvMachine::default();
        r.post_group(vec![(100, 10, 'a'), (0, 20, 'b'), (50, 30, 'c')]);
        r.post_group(vec![(10, 99, 'd')]);
        for (len, tag) in [(50, 30), (7, 10), (5, 99), (0, 20)] {
            s.post(tag, len, ());
        }
        for _ in 0..8 {
            hand_control(&mut r, &mut s);
            while let Some(Transmit { seq, len }) = s.s.poll_transmit(0) {
                assert!(matches!(
                    r.handle_data(0, seq, len),
                    Ok(Placement::Deliver { .. })
                ));
                r.payload_done(0, seq, len).unwrap();
            }
        }
        let got: Vec<(char, u64)> = std::iter::from_fn(|| r.poll_event())
            .map(|e| match e {
                Outcome::Completed { len, token, .. } => (token, len),
                Outcome::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(got, vec![('a', 7), ('b', 0), ('c', 50), ('d', 5)]);
        assert_eq!(std::iter::from_fn(|| s.s.poll_event()).count(), 4);
    }

    #[test]
    fn every_message_completes_on_both_sides_in_order() {
        let sends = [0, 1, 4095, 4096, 65537, 1 << 20];
        let (recvd, sent) = exchange(&sends, &[1 << 20; 6]);
        let got: Vec<(u64, u64)> = recvd
            .iter()
            .map(|e| match e {
                Outcome::Completed { seq, len, .. } => (*seq, *len),
                Outcome::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        let want: Vec<(u64, u64)> = sends
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u64, l))
            .collect();
        assert_eq!(got, want);
        assert_eq!(sent.len(), sends.len());
        assert!(sent.iter().all(|e| matches!(e, Outcome::Completed { .. })));
    }

    #[test]
    fn an_oversized_send_is_cut_to_its_receive_on_both_sides() {
        let (recvd, sent) = exchange(&[10, 3], &[9, 9]);
        let sizes = |e: &[Outcome<usize>]| -> Vec<u64> {
            e.iter()
                .map(|e| match e {
                    Outcome::Completed { len, .. } => *len,
                    Outcome::Failed { .. } => panic!("{e:?}"),
                })
                .collect()
        };
        assert_eq!(sizes(&recvd), [9, 3]);
        let sent: Vec<u64> = sent
            .iter()
            .map(|e| match e {
                Outcome::Completed { len, .. } => *len,
                Outcome::Failed { .. } => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(sent, [9, 3]);
    }
}
