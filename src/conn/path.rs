//! One comm's path across failures: its lane and the replacement being opened, which
//! attempt the lane is, when a failure was detected and how long it went unnoticed, and
//! the receiver's wait for the sender's replacement lane. Lanes are the caller's keys.
//! No sockets, no clock reads.
//!
//! Call order: [`PathMachine::handle_lane_lost`] when the comm's lane is gone says
//! whether to fail over, wait or fail the comm; a receiver that waits has a deadline in
//! [`PathMachine::poll_timeout`], and [`PathMachine::handle_timeout`] says when it has
//! waited long enough. The `handle_*` methods of a move record its outcome.

use std::time::{Duration, Instant};

use super::auth::AuthError;
use super::ConnError;
use crate::routing::{FailReason, MoveReason};

/// The timeouts a path is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// The completion timeout: how long a silent lane lives (P1).
    pub completion: Duration,
    /// How long a probe of a candidate pair may take.
    pub probe: Duration,
    /// How long a sender with no eligible pair keeps re-probing before giving up.
    pub giveup: Duration,
}

/// What a lost lane means for its comm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Sender: ask the router for another pair.
    Failover,
    /// Receiver: wait up to `grace` for the sender's replacement lane; `path` when the
    /// path failed (the sender noticed too) rather than the peer closing the lane.
    Wait { grace: Duration, path: bool },
    /// Nothing to wait for: fail the comm.
    Fail,
    /// A replacement lane is being opened anyway: its outcome decides.
    Replacing,
}

/// How a move ended, for its log line and metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// Home again after being away this long.
    Failback { away: Duration },
    /// Moved off a failed pair: what detected it, how long the failure went unnoticed,
    /// and how long from detection to the new lane.
    Failover {
        reason: FailReason,
        detection: Duration,
        resume: Duration,
    },
}

/// A receiver's lane was replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replaced {
    /// How long since the failure was detected, and how, if it was.
    pub outage: Option<(Duration, FailReason)>,
    /// The lane it replaced, to close.
    pub old: Option<usize>,
}

/// A receiver waiting for the sender's replacement lane.
#[derive(Debug, Clone)]
struct Stranded {
    deadline: Instant,
    path: bool,
    error: ConnError,
}

/// The comm failed for want of a replacement lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// What its requests fail with.
    pub error: ConnError,
    /// The path failed and no pair came back (a give-up), rather than the peer closing.
    pub path: bool,
}

/// How long a receiver whose lane died waits for the sender's replacement lane. When the
/// receiver noticed first (its carrier, a socket error) the sender may only notice at its
/// completion timeout, which started when the lane fell `silent`; when the receiver
/// noticed by silence, the sender has too.
pub fn receiver_grace(
    reason: FailReason,
    timeout: Duration,
    probe: Duration,
    silent: Duration,
) -> Duration {
    let slack = probe + Duration::from_millis(500);
    match reason {
        FailReason::Timeout => slack,
        _ => timeout.saturating_sub(silent) + slack,
    }
}

/// One comm's path machine.
#[derive(Debug)]
pub struct PathMachine {
    sender: bool,
    /// The lane carrying the comm, and (sender) the replacement being opened.
    lane: Option<usize>,
    migrating: Option<usize>,
    t: Timeouts,
    /// The attempt number of the newest replacement lane: the sender counts its
    /// attempts, the receiver keeps the one in use and refuses older ones.
    epoch: u64,
    /// A failure was detected at this time and traffic has not resumed yet.
    detected: Option<(Instant, FailReason)>,
    /// How long the last failure went unnoticed (silence before a timeout).
    detection: Option<Duration>,
    /// When the comm first left its original pair (for the fail-back's "away" time).
    away_since: Option<Instant>,
    stranded: Option<Stranded>,
}

impl PathMachine {
    /// A comm that starts on `lane`.
    pub fn new(sender: bool, t: Timeouts, lane: usize) -> PathMachine {
        PathMachine {
            sender,
            lane: Some(lane),
            migrating: None,
            t,
            epoch: 0,
            detected: None,
            detection: None,
            away_since: None,
            stranded: None,
        }
    }

    /// The lane carrying the comm, if it has one.
    pub fn lane(&self) -> Option<usize> {
        self.lane
    }

    /// The replacement lane being opened, if any.
    pub fn migrating(&self) -> Option<usize> {
        self.migrating
    }

    /// When the current failure was detected, and how.
    pub fn detected(&self) -> Option<(Instant, FailReason)> {
        self.detected
    }

    /// The comm's lane `k` died of `error` (`reason`) after `silent` without a byte;
    /// `routed`: the router knows this sender's comm and can move it.
    pub fn handle_lane_lost(
        &mut self,
        k: usize,
        error: &ConnError,
        reason: FailReason,
        silent: Duration,
        routed: bool,
        now: Instant,
    ) -> Loss {
        if self.lane == Some(k) {
            self.lane = None;
        }
        if self.migrating.is_some() {
            return Loss::Replacing;
        }
        let peer_gone = matches!(error, ConnError::PeerClosed);
        let path_failed = !peer_gone && !matches!(error, ConnError::Protocol(_));
        let (grace, path, error) = match (self.sender, path_failed) {
            (true, true) if routed => {
                self.detected.get_or_insert((now, reason));
                return Loss::Failover;
            }
            (false, true) => {
                self.detected.get_or_insert((now, reason));
                let grace = receiver_grace(reason, self.t.completion, self.t.probe, silent);
                let e = ConnError::Io("receive lane lost and not replaced".into());
                (grace, true, e)
            }
            // The sender resets a lane it gives up on (a brown-out, silence), and that
            // looks the same as a peer that went away: wait as long as a receiver that
            // noticed first would, then fail with the peer's close.
            (false, false) if peer_gone => {
                let grace = receiver_grace(
                    FailReason::NicError,
                    self.t.completion,
                    self.t.probe,
                    Duration::ZERO,
                );
                (grace, false, error.clone())
            }
            _ => return Loss::Fail,
        };
        let s = self.stranded.get_or_insert(Stranded {
            deadline: now + grace,
            path,
            error,
        });
        Loss::Wait {
            grace: s.deadline.saturating_duration_since(now),
            path: s.path,
        }
    }

    /// When a stranded receiver gives up. While one of our NICs is up (`nic_up`) the
    /// sender may still be re-probing candidates, for as long as its give-up window;
    /// with none up, no lane can reach us.
    pub fn poll_timeout(&self, nic_up: bool) -> Option<Instant> {
        let s = self.stranded.as_ref()?;
        let window = if s.path && nic_up {
            self.t.giveup
        } else {
            Duration::ZERO
        };
        Some(s.deadline + window)
    }

    /// A stranded receiver whose sender never came back: the comm must fail.
    pub fn handle_timeout(&mut self, now: Instant, nic_up: bool) -> Option<Abandoned> {
        if self.poll_timeout(nic_up)? > now {
            return None;
        }
        let s = self.stranded.take()?;
        Some(Abandoned {
            error: s.error,
            path: s.path,
        })
    }

    /// The comm failed: nothing is awaited any more. Returns the lanes to close.
    pub fn handle_failed(&mut self) -> [Option<usize>; 2] {
        self.stranded = None;
        [self.lane.take(), self.migrating.take()]
    }

    /// The lane fell silent for `silent` before it was failed.
    pub fn handle_silence(&mut self, silent: Duration) {
        self.detection = Some(silent);
    }

    /// Sender: the router moves the comm (`reason`). Returns the new attempt's epoch,
    /// and the replacement of an earlier attempt, now abandoned, to close.
    pub fn handle_move(&mut self, reason: MoveReason, now: Instant) -> (u64, Option<usize>) {
        if let MoveReason::Failover(r) = reason {
            // Moved because its pair failed under another comm: its outage starts now.
            self.detected.get_or_insert((now, r));
        }
        self.epoch += 1;
        (self.epoch, self.migrating.take())
    }

    /// Sender: the replacement lane `k` is being opened.
    pub fn handle_opening(&mut self, k: usize) {
        self.migrating = Some(k);
    }

    /// Sender: the replacement lane being opened failed.
    pub fn handle_opening_failed(&mut self) {
        self.migrating = None;
    }

    /// Sender: acknowledged progress on the lane, so any failover is complete.
    pub fn handle_resumed(&mut self) {
        self.detected = None;
    }

    /// Sender: replacement lane `k` of a move for `reason` was welcomed and now carries
    /// the comm. Returns how the move ended, and the lane it replaced, to close.
    pub fn handle_moved(
        &mut self,
        k: usize,
        reason: MoveReason,
        now: Instant,
    ) -> (Moved, Option<usize>) {
        self.migrating = None;
        let old = self.lane.replace(k).filter(|&o| o != k);
        (self.outcome(reason, now), old)
    }

    fn outcome(&mut self, reason: MoveReason, now: Instant) -> Moved {
        let detected = self.detected.take();
        match reason {
            MoveReason::Failback => Moved::Failback {
                away: self
                    .away_since
                    .take()
                    .map_or(Duration::ZERO, |t0| now.saturating_duration_since(t0)),
            },
            MoveReason::Failover(r) => {
                let (t0, reason) = detected.unwrap_or((now, r));
                self.away_since.get_or_insert(t0);
                Moved::Failover {
                    reason,
                    detection: self.detection.take().unwrap_or_default(),
                    resume: now.saturating_duration_since(t0),
                }
            }
        }
    }

    /// Receiver: the sender opened lane `k`, replacement attempt `epoch`. One older than
    /// the lane in use (held up in the network while the sender moved on) is refused:
    /// taking it would retire the live lane for a dead one. Returns the outage it ends,
    /// if any, and the lane it replaces, to close.
    pub fn handle_replacement(
        &mut self,
        k: usize,
        epoch: u64,
        now: Instant,
    ) -> Result<Replaced, AuthError> {
        if epoch <= self.epoch {
            return Err(AuthError::Stale {
                offered: epoch,
                current: self.epoch,
            });
        }
        self.epoch = epoch;
        self.stranded = None;
        Ok(Replaced {
            outage: (self.detected.take()).map(|(t, r)| (now.saturating_duration_since(t), r)),
            old: self.lane.replace(k).filter(|&o| o != k),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const T: Timeouts = Timeouts {
        completion: Duration::from_millis(1000),
        probe: Duration::from_millis(200),
        giveup: Duration::from_millis(30_000),
    };

    fn link_down() -> ConnError {
        ConnError::Io("link down".into())
    }

    #[test]
    fn a_receiver_waits_for_the_senders_timeout_only_as_long_as_it_has_left() {
        let (timeout, probe) = (1000 * MS, 200 * MS);
        // Noticed by silence: the sender's timeout has run as well.
        assert_eq!(
            receiver_grace(FailReason::Timeout, timeout, probe, 1000 * MS),
            700 * MS
        );
        // Its own carrier, at once: the sender needs its whole timeout.
        assert_eq!(
            receiver_grace(FailReason::LinkDown, timeout, probe, Duration::ZERO),
            1700 * MS
        );
        // Its carrier dropped after the lane had gone quiet: that much has run already.
        assert_eq!(
            receiver_grace(FailReason::LinkDown, timeout, probe, 600 * MS),
            1100 * MS
        );
        assert_eq!(
            receiver_grace(FailReason::NicError, timeout, probe, 5000 * MS),
            700 * MS
        );
    }

    #[test]
    fn the_receivers_grace_counts_the_silence_before_its_carrier_dropped() {
        let t0 = Instant::now();
        let mut p = PathMachine::new(false, T, 0);
        // Quiet for 600 ms, then the carrier: 400 ms of the sender's timeout are left.
        let loss = p.handle_lane_lost(0, &link_down(), FailReason::LinkDown, 600 * MS, false, t0);
        assert_eq!(
            loss,
            Loss::Wait {
                grace: 1100 * MS,
                path: true
            }
        );
        // With no NIC of ours up the sender cannot reach us: no give-up window.
        let end = t0 + 1100 * MS;
        assert_eq!(p.poll_timeout(false), Some(end));
        assert_eq!(p.handle_timeout(end - MS, false), None);
        let gave_up = p.handle_timeout(end, false).expect("waited its grace");
        assert!(gave_up.path);
        assert_eq!(p.poll_timeout(false), None, "once");
    }

    #[test]
    fn a_receiver_with_a_nic_up_also_waits_out_the_senders_give_up_window() {
        let t0 = Instant::now();
        let mut p = PathMachine::new(false, T, 0);
        p.handle_lane_lost(0, &link_down(), FailReason::Timeout, 1000 * MS, false, t0);
        let end = t0 + 700 * MS + T.giveup;
        assert_eq!(p.handle_timeout(end - MS, true), None);
        // A second loss while stranded keeps the first deadline.
        let later = p.handle_lane_lost(
            0,
            &link_down(),
            FailReason::LinkDown,
            Duration::ZERO,
            false,
            end,
        );
        assert_eq!(
            later,
            Loss::Wait {
                grace: Duration::ZERO,
                path: true
            }
        );
        assert!(p.handle_timeout(end, true).is_some());
    }

    #[test]
    fn a_replacement_ends_the_wait_and_a_stale_one_is_refused() {
        let t0 = Instant::now();
        let mut p = PathMachine::new(false, T, 0);
        p.handle_lane_lost(
            0,
            &link_down(),
            FailReason::LinkDown,
            Duration::ZERO,
            false,
            t0,
        );
        assert_eq!(p.lane(), None, "the lost lane is gone");
        assert_eq!(
            p.handle_replacement(1, 2, t0 + 300 * MS),
            Ok(Replaced {
                outage: Some((300 * MS, FailReason::LinkDown)),
                old: None
            })
        );
        assert_eq!(p.poll_timeout(true), None);
        assert!(matches!(
            p.handle_replacement(2, 1, t0 + 400 * MS),
            Err(AuthError::Stale {
                offered: 1,
                current: 2
            })
        ));
        assert_eq!(p.lane(), Some(1), "a stale lane displaces nothing");
        let newer = p.handle_replacement(3, 3, t0 + 500 * MS);
        assert_eq!(
            newer,
            Ok(Replaced {
                outage: None,
                old: Some(1)
            })
        );
    }

    #[test]
    fn a_closed_lane_waits_for_a_replacement_a_protocol_error_does_not() {
        let t0 = Instant::now();
        let mut r = PathMachine::new(false, T, 0);
        let loss = r.handle_lane_lost(
            0,
            &ConnError::PeerClosed,
            FailReason::Timeout,
            Duration::ZERO,
            false,
            t0,
        );
        assert_eq!(
            loss,
            Loss::Wait {
                grace: 1700 * MS,
                path: false
            }
        );
        // Not a path failure: no give-up window even with NICs up; the peer's close.
        let gone = r.handle_timeout(t0 + 1700 * MS, true).unwrap();
        assert_eq!(gone.error, ConnError::PeerClosed);
        let bad = ConnError::Protocol("bad frame".into());
        assert_eq!(
            r.handle_lane_lost(0, &bad, FailReason::Timeout, Duration::ZERO, false, t0),
            Loss::Fail
        );
        let mut s = PathMachine::new(true, T, 0);
        assert_eq!(
            s.handle_lane_lost(
                0,
                &link_down(),
                FailReason::NicError,
                Duration::ZERO,
                true,
                t0
            ),
            Loss::Failover
        );
        assert_eq!(
            s.handle_lane_lost(
                0,
                &link_down(),
                FailReason::NicError,
                Duration::ZERO,
                false,
                t0
            ),
            Loss::Fail,
            "a comm the router does not know cannot move"
        );
        assert_eq!(
            s.handle_lane_lost(
                0,
                &ConnError::PeerClosed,
                FailReason::Timeout,
                Duration::ZERO,
                true,
                t0
            ),
            Loss::Fail
        );
    }

    #[test]
    fn a_failover_reports_its_detection_and_resume_times_and_a_failback_its_time_away() {
        let t0 = Instant::now();
        let mut s = PathMachine::new(true, T, 0);
        s.handle_silence(1000 * MS);
        s.handle_lane_lost(0, &link_down(), FailReason::Timeout, 1000 * MS, true, t0);
        let fo = MoveReason::Failover(FailReason::Timeout);
        assert_eq!(s.handle_move(fo, t0 + 10 * MS), (1, None));
        s.handle_opening(1);
        assert_eq!(
            s.handle_moved(1, fo, t0 + 250 * MS),
            (
                Moved::Failover {
                    reason: FailReason::Timeout,
                    detection: 1000 * MS,
                    resume: 250 * MS
                },
                None
            )
        );
        assert_eq!(
            (s.detected(), s.lane(), s.migrating()),
            (None, Some(1), None)
        );
        assert_eq!(
            s.handle_move(MoveReason::Failback, t0 + 5000 * MS),
            (2, None)
        );
        s.handle_opening(2);
        assert_eq!(
            s.handle_moved(2, MoveReason::Failback, t0 + 5100 * MS),
            (Moved::Failback { away: 5100 * MS }, Some(1))
        );
        // Moved by a failure under another comm: its outage starts with the move.
        let link = MoveReason::Failover(FailReason::LinkDown);
        s.handle_move(link, t0 + 6000 * MS);
        assert_eq!(
            s.handle_moved(3, link, t0 + 6040 * MS).0,
            Moved::Failover {
                reason: FailReason::LinkDown,
                detection: Duration::ZERO,
                resume: 40 * MS
            }
        );
    }

    #[test]
    fn a_lane_lost_during_a_move_leaves_the_decision_to_the_replacement() {
        let t0 = Instant::now();
        let mut s = PathMachine::new(true, T, 0);
        let fb = MoveReason::Failback;
        s.handle_move(fb, t0);
        s.handle_opening(1);
        let loss = s.handle_lane_lost(
            0,
            &link_down(),
            FailReason::NicError,
            Duration::ZERO,
            true,
            t0,
        );
        assert_eq!(loss, Loss::Replacing);
        assert_eq!(s.lane(), None);
        // A newer move abandons the attempt under way; a failed attempt clears it.
        assert_eq!(s.handle_move(fb, t0).1, Some(1));
        s.handle_opening(2);
        s.handle_opening_failed();
        assert_eq!(s.handle_failed(), [None, None]);
    }
}
