//! One comm's path across failures: the lanes carrying it and the share (stripes) each
//! carries, the lanes being opened, which attempt each is, when a failure was detected and
//! how long it went unnoticed, and the receiver's wait for the sender's replacement lane.
//! Lanes are the caller's keys. No sockets, no clock reads.
//!
//! # Stripes
//!
//! A sender's comm is cut into a fixed number of stripes, the router's lanes
//! ([`LaneId`]), all on the comm's original pair while nothing fails, and so on one lane.
//! When a pair fails the router moves each stripe on its own, spreading them over every
//! eligible pair by load; stripes that land on the same pair share one lane. A lane's
//! share of the comm's messages is its stripe count over the total. A lane whose stripes
//! all left drains what it holds and is retired.
//!
//! Call order: [`PathMachine::handle_lane_lost`] when one of the comm's lanes is gone says
//! whether to report a failover, carry on, wait or fail the comm; a receiver that waits has
//! a deadline in [`PathMachine::poll_timeout`], and [`PathMachine::handle_timeout`] says
//! when it has waited long enough. A sender feeds the router's moves to
//! [`PathMachine::handle_move`] and the outcome of the lanes it opens to
//! `handle_opening*`/[`PathMachine::handle_moved`]; [`PathMachine::settle`] says when a
//! failover or fail-back is complete.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::auth::AuthError;
use super::ConnError;
use crate::routing::{FailReason, LaneId, MoveReason, Pair};
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
    /// Sender: report this stripe's pair as failed to the router, which moves every stripe
    /// on it.
    Failover(LaneId),
    /// Other lanes carry the comm, or are being opened: nothing more to do.
    Carry,
    /// Receiver: wait up to `grace` for the sender's replacement lane; `path` when the
    /// path failed (the sender noticed too) rather than the peer closing the lane.
    Wait { grace: Duration, path: bool },
    /// Nothing to wait for: fail the comm.
    Fail,
}

/// How a move ended, for its log line and metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// Home again after being away this long, from `from` (the backup pair the first
    /// stripe to go home left).
    Failback { from: Option<Pair>, away: Duration },
    /// Moved off the failed pair `from`: what detected it, how long the failure went
    /// unnoticed, how long from detection to traffic flowing again, and how many pairs
    /// the comm now runs over.
    Failover {
        from: Option<Pair>,
        reason: FailReason,
        detection: Duration,
        resume: Duration,
        spread: usize,
    },
    /// Moved off `from` because an end of it was drained: how long from the move's start
    /// until the new lanes carried the comm (the old lane carried it meanwhile), and how
    /// many pairs the comm now runs over.
    Drain {
        from: Option<Pair>,
        switch: Duration,
        spread: usize,
    },
    /// Moved off the backup pair `from`, whose NIC carried less than it was weighed by:
    /// as for a drain, how long until the new lanes carried the comm, and how many pairs
    /// it now runs over.
    Rebalance {
        from: Option<Pair>,
        switch: Duration,
        spread: usize,
    },
}

/// Where a moved stripe goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// Onto lane `k`, which already carries the comm on that pair.
    Joined(usize),
    /// Onto lane `k`, being opened on that pair.
    Waiting(usize),
    /// A lane must be opened on that pair, attempt `epoch`: then
    /// [`PathMachine::handle_opening`], or report the pair failed if it cannot start.
    Open { epoch: u64 },
}

/// A receiver's new lane was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replaced {
    /// How long since the failure was detected, and how, if it was.
    pub outage: Option<(Duration, FailReason)>,
}

/// One lane of the comm, as the path sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carrier {
    /// The pair it runs on (sender; a receiver does not know).
    pub pair: Option<Pair>,
    /// The stripes it carries (sender).
    pub stripes: Vec<LaneId>,
    /// The attempt that opened it.
    pub epoch: u64,
    /// Receiver: when the sender's replacement lane arrived (None for the first lane).
    pub since: Option<Instant>,
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

/// How long a replacement lane may take from its dial to the receiver's `Welcome`: a few
/// round trips (SYN, Hello, Challenge, Proof, Welcome) through a congested NIC, where a
/// dropped SYN alone costs a second, during a storm of thousands of such handshakes.
pub fn migration_limit(completion: Duration, probe: Duration) -> Duration {
    (probe * 5).max(completion * 3)
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
    /// The lanes carrying the comm.
    lanes: BTreeMap<usize, Carrier>,
    /// Sender: lanes being opened, with the stripes waiting for them.
    opening: BTreeMap<usize, Carrier>,
    /// Sender: stripes whose lane died, waiting for the router to move them.
    orphans: BTreeSet<LaneId>,
    /// Sender: a move is under way; the reason of the latest.
    moving: Option<MoveReason>,
    t: Timeouts,
    /// The sender's newest attempt number.
    epoch: u64,
    /// A failure was detected at this time and the comm has not settled since.
    detected: Option<(Instant, FailReason)>,
    /// When traffic flowed again after the failure (a lane joined or was opened).
    resumed: Option<Instant>,
    /// How long the last failure went unnoticed (silence before a timeout).
    detection: Option<Duration>,
    /// When the comm first left its original pair (for the fail-back's "away" time).
    away_since: Option<Instant>,
    /// When the planned move under way (a drain) began.
    planned: Option<Instant>,
    /// The pair the move under way started from: the failed one, or the backup a
    /// fail-back leaves. Later hops of the same move do not replace it.
    left: Option<Pair>,
    stranded: Option<Stranded>,
    /// Sender: a message has gone out on some lane.
    carried: bool,
    /// Sender: a lane opened while the comm held its first messages failed to open, so
    /// they no longer wait ([`PathMachine::holding`]).
    hold_failed: bool,
    /// Sender: a failover that a fail-back overtook before it settled, as it stood then.
    interrupted: Option<Moved>,
    /// Sender: the comm started on a pair it leaves at once (drained, or one that could
    /// not carry its connect), and its first messages wait until then for the router's
    /// first move ([`PathMachine::handle_leaving`]).
    leaving_until: Option<Instant>,
}

impl PathMachine {
    /// A comm that starts on `lane`, as one stripe until [`PathMachine::route`].
    pub fn new(sender: bool, t: Timeouts, lane: usize) -> PathMachine {
        let first = Carrier {
            pair: None,
            stripes: if sender { vec![LaneId(0)] } else { Vec::new() },
            epoch: 0,
            since: None,
        };
        PathMachine {
            sender,
            lanes: BTreeMap::from([(lane, first)]),
            opening: BTreeMap::new(),
            orphans: BTreeSet::new(),
            moving: None,
            t,
            epoch: 0,
            detected: None,
            resumed: None,
            detection: None,
            away_since: None,
            planned: None,
            left: None,
            stranded: None,
            carried: false,
            hold_failed: false,
            interrupted: None,
            leaving_until: None,
        }
    }

    /// Sender: the router knows the comm, cut into `stripes` on `pair`.
    pub fn route(&mut self, pair: Pair, stripes: usize) {
        if let Some(c) = self.lanes.values_mut().next() {
            c.pair = Some(pair);
            c.stripes = (0..stripes.max(1)).map(LaneId).collect();
        }
    }

    /// The lanes carrying the comm.
    pub fn lanes(&self) -> impl Iterator<Item = (usize, &Carrier)> + '_ {
        self.lanes.iter().map(|(&k, c)| (k, c))
    }

    /// When the comm first left its original pair, while it is away (sender).
    pub fn away_since(&self) -> Option<Instant> {
        self.away_since
    }

    /// Lane `k`, if it carries the comm.
    pub fn carrier(&self, k: usize) -> Option<&Carrier> {
        self.lanes.get(&k)
    }

    /// The newest lane attempt: the sender's latest, or the latest a receiver was
    /// offered (attempts count up from 0, the comm's first lane).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether some lane carries the comm.
    pub fn has_lane(&self) -> bool {
        !self.lanes.is_empty()
    }

    /// The lanes being opened.
    pub fn openings(&self) -> impl Iterator<Item = usize> + '_ {
        self.opening.keys().copied()
    }

    /// The distinct pairs the comm's stripes run on now.
    pub fn spread(&self) -> usize {
        let pairs: BTreeSet<Pair> = (self.lanes.values())
            .filter(|c| !c.stripes.is_empty())
            .filter_map(|c| c.pair)
            .collect();
        pairs.len()
    }

    /// Sender: lanes that carry no stripe while another lane does: once they hold nothing
    /// unacknowledged they can be retired.
    pub fn idle(&self) -> Vec<usize> {
        if !self.lanes.values().any(|c| !c.stripes.is_empty()) {
            return Vec::new();
        }
        (self.lanes.iter())
            .filter(|(_, c)| c.stripes.is_empty())
            .map(|(&k, _)| k)
            .collect()
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
        let carrier = self.lanes.remove(&k);
        let carrier_pair = carrier.as_ref().and_then(|c| c.pair);
        let peer_gone = matches!(error, ConnError::PeerClosed);
        // A broken protocol: another lane will not help.
        let protocol = matches!(error, ConnError::Protocol(_));
        if self.sender {
            let stripes = carrier.map(|c| c.stripes).unwrap_or_default();
            self.orphans.extend(stripes.iter().copied());
            let alive = !self.lanes.is_empty() || !self.opening.is_empty();
            return match stripes.first() {
                _ if peer_gone || protocol => Loss::Fail,
                _ if !routed => {
                    if alive {
                        Loss::Carry
                    } else {
                        Loss::Fail
                    }
                }
                Some(&s) => {
                    self.detected.get_or_insert((now, reason));
                    if self.left.is_none() {
                        self.left = carrier_pair;
                    }
                    Loss::Failover(s)
                }
                None => Loss::Carry,
            };
        }
        if protocol {
            return Loss::Fail;
        }
        if !self.lanes.is_empty() {
            return Loss::Carry;
        }
        let (grace, path, error) = if !peer_gone {
            self.detected.get_or_insert((now, reason));
            let grace = receiver_grace(reason, self.t.completion, self.t.probe, silent);
            let e = ConnError::Io("receive lane lost and not replaced".into());
            (grace, true, e)
        } else {
            // The sender resets a lane it gives up on (a brown-out, silence), and that
            // looks the same as a peer that went away: wait as long as a receiver that
            // noticed first would, then fail with the peer's close. A replacement lane
            // closed within its handshake limit may be one the sender gave up before our
            // Welcome reached it (a storm of handshakes on congested links): then the
            // sender's next attempt gets that long again.
            let limit = migration_limit(self.t.completion, self.t.probe);
            let young = (carrier.as_ref().and_then(|c| c.since))
                .is_some_and(|t| now.saturating_duration_since(t) < limit);
            let grace = receiver_grace(
                FailReason::NicError,
                self.t.completion,
                self.t.probe,
                Duration::ZERO,
            ) + if young { limit } else { Duration::ZERO };
            (grace, false, error.clone())
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
    pub fn handle_failed(&mut self) -> Vec<usize> {
        self.stranded = None;
        self.orphans.clear();
        self.moving = None;
        let lanes = std::mem::take(&mut self.lanes).into_keys();
        lanes
            .chain(std::mem::take(&mut self.opening).into_keys())
            .collect()
    }

    /// The lane fell silent for `silent` before it was failed.
    pub fn handle_silence(&mut self, silent: Duration) {
        self.detection = Some(silent);
    }

    /// Sender: the router moves `stripe` to `to` (`reason`). Returns where it goes, and a
    /// lane being opened that no stripe waits for any more, to abandon.
    pub fn handle_move(
        &mut self,
        stripe: LaneId,
        to: Pair,
        reason: MoveReason,
        now: Instant,
    ) -> (Placed, Option<usize>) {
        self.leaving_until = None;
        if reason == MoveReason::Failback && matches!(self.moving, Some(MoveReason::Failover(_))) {
            // The failed pair healed before every stripe found a backup: the failover is
            // reported as it stood, and the fail-back is a move of its own.
            self.interrupted = self.conclude(now);
        }
        match reason {
            // Moved because its pair failed under another comm: its outage starts now.
            MoveReason::Failover(r) => _ = self.detected.get_or_insert((now, r)),
            MoveReason::Drain | MoveReason::Rebalance => _ = self.planned.get_or_insert(now),
            MoveReason::Failback => {}
        }
        // A failover under way stays one when a planned move (a drain, a rebalance) joins
        // it before it settles: its detection, resume time and log line are the news.
        self.moving = match (self.moving, reason) {
            (Some(f @ MoveReason::Failover(_)), MoveReason::Drain | MoveReason::Rebalance) => {
                Some(f)
            }
            _ => Some(reason),
        };
        if self.left.is_none() {
            self.left = (self.lanes.values())
                .find(|c| c.stripes.contains(&stripe))
                .and_then(|c| c.pair);
        }
        self.orphans.remove(&stripe);
        for c in self.lanes.values_mut() {
            c.stripes.retain(|&s| s != stripe);
        }
        let mut abandoned = None;
        for (&k, c) in self.opening.iter_mut() {
            let before = c.stripes.len();
            c.stripes.retain(|&s| s != stripe);
            if before != c.stripes.len() && c.stripes.is_empty() {
                abandoned = Some(k);
            }
        }
        if let Some(k) = abandoned {
            self.opening.remove(&k);
        }
        let on = |c: &Carrier| c.pair == Some(to);
        if let Some((&k, c)) = self.lanes.iter_mut().find(|(_, c)| on(c)) {
            c.stripes.push(stripe);
            self.resumed.get_or_insert(now);
            return (Placed::Joined(k), abandoned);
        }
        if let Some((&k, c)) = self.opening.iter_mut().find(|(_, c)| on(c)) {
            c.stripes.push(stripe);
            return (Placed::Waiting(k), abandoned);
        }
        self.orphans.insert(stripe);
        self.epoch += 1;
        (Placed::Open { epoch: self.epoch }, abandoned)
    }

    /// Sender: lane `k` is being opened on `pair` (attempt `epoch`) for `stripe`.
    pub fn handle_opening(&mut self, k: usize, pair: Pair, stripe: LaneId, epoch: u64) {
        self.orphans.remove(&stripe);
        self.opening.insert(
            k,
            Carrier {
                pair: Some(pair),
                stripes: vec![stripe],
                epoch,
                since: None,
            },
        );
    }

    /// Sender: a message went out on one of the comm's lanes.
    pub fn handle_carried(&mut self) {
        self.carried = true;
    }

    /// Sender: the comm starts on a pair it leaves at once (drained, or one that could
    /// not carry its connect, which another pair did), and the router may first probe
    /// the candidates before it moves the stripes off: its first messages wait for that
    /// until `until` at the latest ([`PathMachine::handle_hold_timeout`]).
    pub fn handle_leaving(&mut self, until: Instant) {
        if self.sender && !self.carried {
            self.leaving_until = Some(until);
        }
    }

    /// Sender: whether the comm's messages wait rather than go out on the lanes it has.
    /// Only a comm that has carried nothing yet waits, so that its first message does not
    /// cross a drained NIC (NCCL opened it on a drained NIC, or on a pair ending on the
    /// peer's): while the router has not moved its stripes yet, until the limit given to
    /// [`PathMachine::handle_leaving`] (a probe of the candidates); then while every
    /// stripe has left in a drain and a new lane is being opened for them. That wait ends
    /// when a lane is welcomed, and for good at the first lane that fails to open: the
    /// drained pair then carries the comm until its move completes, as it carries any
    /// comm being drained. So it lasts a probe and a handshake at most.
    pub fn holding(&self) -> bool {
        let awaiting_move = self.leaving_until.is_some() && self.moving.is_none();
        let awaiting_lane = self.moving == Some(MoveReason::Drain)
            && !self.opening.is_empty()
            && self.lanes.values().all(|c| c.stripes.is_empty());
        self.sender && !self.carried && !self.hold_failed && (awaiting_move || awaiting_lane)
    }

    /// Sender: ends a wait for the router's first move that has run to its limit; `true`
    /// when it did, and the comm's messages go out on the lanes it has.
    pub fn handle_hold_timeout(&mut self, now: Instant) -> bool {
        match self.leaving_until {
            Some(t) if now >= t => {
                self.leaving_until = None;
                !self.carried
            }
            _ => false,
        }
    }

    /// Sender: the lane `k` being opened failed. Returns the stripes that waited for it,
    /// now waiting for another move.
    pub fn handle_opening_failed(&mut self, k: usize) -> Vec<LaneId> {
        self.hold_failed |= self.holding();
        let stripes = self
            .opening
            .remove(&k)
            .map(|c| c.stripes)
            .unwrap_or_default();
        self.orphans.extend(stripes.iter().copied());
        stripes
    }

    /// Sender: lane `k`, being opened, was welcomed and now carries its stripes.
    pub fn handle_moved(&mut self, k: usize, now: Instant) -> bool {
        let Some(c) = self.opening.remove(&k) else {
            return false;
        };
        self.lanes.insert(k, c);
        self.resumed.get_or_insert(now);
        true
    }

    /// Sender: the move under way is complete (no stripe waits for a lane): how it ended.
    pub fn settle(&mut self, now: Instant) -> Option<Moved> {
        if !self.orphans.is_empty() || !self.opening.is_empty() {
            return None;
        }
        self.conclude(now)
    }

    /// Sender: a failover that a fail-back overtook before it settled (some stripe still
    /// waited for a lane), as it stood when the fail-back began: its detection, the time
    /// until traffic flowed again (or until the fail-back began, if none had), and its
    /// spread then. Taken once.
    pub fn take_interrupted(&mut self) -> Option<Moved> {
        self.interrupted.take()
    }

    /// Ends the move under way as it stands: how it went.
    fn conclude(&mut self, now: Instant) -> Option<Moved> {
        let reason = self.moving.take()?;
        let detected = self.detected.take();
        let planned = self.planned.take();
        let resumed = self.resumed.take().unwrap_or(now);
        let from = self.left.take();
        Some(match reason {
            MoveReason::Failback => Moved::Failback {
                from,
                away: self
                    .away_since
                    .take()
                    .map_or(Duration::ZERO, |t0| now.saturating_duration_since(t0)),
            },
            MoveReason::Drain | MoveReason::Rebalance => {
                let t0 = planned.unwrap_or(now);
                self.away_since.get_or_insert(t0);
                let (switch, spread) = (resumed.saturating_duration_since(t0), self.spread());
                match reason {
                    MoveReason::Drain => Moved::Drain {
                        from,
                        switch,
                        spread,
                    },
                    _ => Moved::Rebalance {
                        from,
                        switch,
                        spread,
                    },
                }
            }
            MoveReason::Failover(r) => {
                let (t0, reason) = detected.unwrap_or((now, r));
                self.away_since.get_or_insert(t0);
                Moved::Failover {
                    from,
                    reason,
                    detection: self.detection.take().unwrap_or_default(),
                    resume: resumed.saturating_duration_since(t0),
                    spread: self.spread(),
                }
            }
        })
    }

    /// Sender: acknowledged progress and nothing moving: any failure is behind us.
    pub fn handle_resumed(&mut self) {
        if self.moving.is_none() && self.orphans.is_empty() {
            self.detected = None;
        }
    }

    /// Lane `k` was retired (its stripes left and it drained): it no longer carries the
    /// comm. Returns whether other lanes still do.
    pub fn handle_retired(&mut self, k: usize) -> bool {
        self.lanes.remove(&k);
        !self.lanes.is_empty()
    }

    /// Receiver: the sender opened lane `k`, attempt `epoch`. An attempt already taken (a
    /// handshake replayed or held up in the network) is refused. Returns the outage it
    /// ends, if any.
    pub fn handle_replacement(
        &mut self,
        k: usize,
        epoch: u64,
        now: Instant,
    ) -> Result<Replaced, AuthError> {
        if epoch == 0 || self.lanes.values().any(|c| c.epoch == epoch) {
            return Err(AuthError::Stale {
                offered: epoch,
                current: self.epoch,
            });
        }
        self.epoch = self.epoch.max(epoch);
        self.stranded = None;
        self.lanes.insert(
            k,
            Carrier {
                pair: None,
                stripes: Vec::new(),
                epoch,
                since: Some(now),
            },
        );
        Ok(Replaced {
            outage: (self.detected.take()).map(|(t, r)| (now.saturating_duration_since(t), r)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{NicId, PeerId};

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
    fn a_new_lane_ends_the_wait_and_a_repeated_attempt_is_refused() {
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
        assert!(!p.has_lane(), "the lost lane is gone");
        assert_eq!(
            p.handle_replacement(1, 2, t0 + 300 * MS),
            Ok(Replaced {
                outage: Some((300 * MS, FailReason::LinkDown)),
            })
        );
        assert_eq!(p.poll_timeout(true), None);
        assert!(matches!(
            p.handle_replacement(2, 2, t0 + 400 * MS),
            Err(AuthError::Stale { offered: 2, .. })
        ));
        assert!(
            p.handle_replacement(2, 0, t0).is_err(),
            "0 is a comm's first lane"
        );
        // Lanes of a striped comm join; an older attempt displaces nothing.
        assert_eq!(
            p.handle_replacement(3, 1, t0 + 500 * MS),
            Ok(Replaced { outage: None })
        );
        let keys: Vec<usize> = p.lanes().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![1, 3]);
        // Losing one of two lanes strands nothing.
        assert_eq!(
            p.handle_lane_lost(
                1,
                &link_down(),
                FailReason::LinkDown,
                Duration::ZERO,
                false,
                t0
            ),
            Loss::Carry
        );
        assert_eq!(p.poll_timeout(true), None);
        assert!(!p.handle_retired(3), "the last lane retired");
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
        // As long as a receiver that noticed first: a killed sender is noticed at once.
        let grace = 1700 * MS;
        assert_eq!(loss, Loss::Wait { grace, path: false });
        assert_eq!(r.handle_timeout(t0 + grace - MS, true), None);
        // Not a path failure: no give-up window even with NICs up; the peer's close.
        let gone = r.handle_timeout(t0 + grace, true).unwrap();
        assert_eq!(gone.error, ConnError::PeerClosed);
        let bad = ConnError::Protocol("bad frame".into());
        assert_eq!(
            r.handle_lane_lost(0, &bad, FailReason::Timeout, Duration::ZERO, false, t0),
            Loss::Fail
        );
        let lost = |routed: bool, e: &ConnError| {
            let mut s = PathMachine::new(true, T, 0);
            s.route(pair(0), 3);
            s.handle_lane_lost(0, e, FailReason::NicError, Duration::ZERO, routed, t0)
        };
        assert_eq!(lost(true, &link_down()), Loss::Failover(LaneId(0)));
        assert_eq!(
            lost(false, &link_down()),
            Loss::Fail,
            "a comm the router does not know cannot move"
        );
        assert_eq!(lost(true, &ConnError::PeerClosed), Loss::Fail);
    }

    #[test]
    fn a_replacement_closed_within_its_handshake_limit_gets_one_more_attempt() {
        let t0 = Instant::now();
        let limit = migration_limit(T.completion, T.probe);
        let lost_after = |age: Duration| {
            let mut r = PathMachine::new(false, T, 0);
            assert!(
                r.handle_lane_lost(
                    0,
                    &link_down(),
                    FailReason::LinkDown,
                    Duration::ZERO,
                    false,
                    t0
                ) != Loss::Fail
            );
            r.handle_replacement(1, 1, t0).unwrap();
            r.handle_lane_lost(
                1,
                &ConnError::PeerClosed,
                FailReason::Timeout,
                Duration::ZERO,
                false,
                t0 + age,
            )
        };
        // Closed soon after it arrived: the sender may have given it up unanswered.
        assert_eq!(
            lost_after(limit - MS),
            Loss::Wait {
                grace: 1700 * MS + limit,
                path: false
            }
        );
        // An older lane closing is the sender going away: as long as any close.
        assert_eq!(
            lost_after(limit),
            Loss::Wait {
                grace: 1700 * MS,
                path: false
            }
        );
    }

    fn pair(n: u32) -> Pair {
        Pair {
            local: NicId(n),
            peer: PeerId(0),
            remote: NicId(n),
        }
    }

    fn stripes_of(p: &PathMachine) -> Vec<(usize, usize)> {
        p.lanes().map(|(k, c)| (k, c.stripes.len())).collect()
    }

    /// A sender whose one lane, cut into two stripes on pair 0, lost its link at `t0`.
    fn two_stripes_on_a_lost_lane(t0: Instant) -> PathMachine {
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        let loss = s.handle_lane_lost(
            0,
            &link_down(),
            FailReason::LinkDown,
            Duration::ZERO,
            true,
            t0,
        );
        assert_eq!(loss, Loss::Failover(LaneId(0)));
        s
    }

    #[test]
    fn a_comm_drained_before_its_first_message_holds_it_for_one_handshake_at_most() {
        let t0 = Instant::now();
        let drain = MoveReason::Drain;
        let drained = |carried: bool| {
            let mut s = PathMachine::new(true, T, 0);
            s.route(pair(0), 2);
            if carried {
                s.handle_carried();
            }
            assert!(!s.holding(), "nothing moves yet");
            for stripe in 0..2 {
                let (placed, _) = s.handle_move(LaneId(stripe), pair(1), drain, t0);
                if let Placed::Open { epoch } = placed {
                    s.handle_opening(10, pair(1), LaneId(stripe), epoch);
                }
            }
            s
        };
        // Fresh, every stripe off the drained pair: it waits for lane 10.
        let mut s = drained(false);
        assert!(s.holding());
        assert!(s.handle_moved(10, t0 + MS));
        assert!(!s.holding(), "welcomed: the new lane carries it");
        // A comm that has carried messages goes on over its old lane meanwhile.
        assert!(!drained(true).holding());
        // The new lane fails: the old one carries the comm, even while the next opens.
        let mut s = drained(false);
        assert_eq!(s.handle_opening_failed(10), vec![LaneId(0), LaneId(1)]);
        assert!(!s.holding());
        let (placed, _) = s.handle_move(LaneId(0), pair(2), drain, t0 + MS);
        assert_eq!(placed, Placed::Open { epoch: 2 });
        s.handle_opening(11, pair(2), LaneId(0), 2);
        assert!(!s.holding(), "the wait is over for good");
        // A stripe still on the old lane carries the comm: nothing waits.
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        let (placed, _) = s.handle_move(LaneId(0), pair(1), drain, t0);
        assert_eq!(placed, Placed::Open { epoch: 1 });
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert!(!s.holding());
        // A failover is not held here (its lanes are gone), nor is a receiver.
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 1);
        let fo = MoveReason::Failover(FailReason::LinkDown);
        assert_eq!(
            s.handle_move(LaneId(0), pair(1), fo, t0).0,
            Placed::Open { epoch: 1 }
        );
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert!(!s.holding());
        assert!(!PathMachine::new(false, T, 0).holding());
    }

    #[test]
    fn a_comm_opened_on_a_drained_pair_waits_for_the_routers_move_until_its_limit() {
        let t0 = Instant::now();
        let limit = t0 + 100 * MS;
        let leaving = || {
            let mut s = PathMachine::new(true, T, 0);
            s.route(pair(0), 2);
            s.handle_leaving(limit);
            s
        };
        // No move by the limit (the candidates' probes did not answer): it goes out on
        // the lane it has, not a millisecond before.
        let mut s = leaving();
        assert!(s.holding());
        assert!(!s.handle_hold_timeout(limit - MS));
        assert!(s.holding());
        assert!(s.handle_hold_timeout(limit));
        assert!(!s.holding());
        assert!(!s.handle_hold_timeout(limit + MS), "released once");
        // The move comes: the wait for the new lane takes over, and the limit is gone.
        let mut s = leaving();
        let drain = MoveReason::Drain;
        assert_eq!(
            s.handle_move(LaneId(0), pair(1), drain, t0).0,
            Placed::Open { epoch: 1 }
        );
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert_eq!(
            s.handle_move(LaneId(1), pair(1), drain, t0).0,
            Placed::Waiting(10)
        );
        assert!(s.holding());
        assert!(!s.handle_hold_timeout(limit + MS));
        assert!(s.holding(), "until lane 10 is welcomed");
        assert!(s.handle_moved(10, limit + 2 * MS));
        assert!(!s.holding());
        // A comm that has carried messages never waits.
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        s.handle_carried();
        s.handle_leaving(limit);
        assert!(!s.holding());
        assert!(!s.handle_hold_timeout(limit));
    }

    #[test]
    fn a_failover_overtaken_by_the_fail_back_is_reported_as_it_stood() {
        let t0 = Instant::now();
        let fo = MoveReason::Failover(FailReason::LinkDown);
        let mut s = two_stripes_on_a_lost_lane(t0);
        // Stripe 0 reaches pair 1; stripe 1's lane to pair 2 is still opening when the
        // failed pair heals.
        s.handle_move(LaneId(0), pair(1), fo, t0 + MS);
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert!(s.handle_moved(10, t0 + 20 * MS));
        s.handle_move(LaneId(1), pair(2), fo, t0 + MS);
        s.handle_opening(11, pair(2), LaneId(1), 2);
        assert_eq!(s.settle(t0 + 30 * MS), None, "stripe 1 still waits");
        assert_eq!(s.take_interrupted(), None);
        let home = t0 + Duration::from_secs(3);
        let (placed, abandoned) = s.handle_move(LaneId(1), pair(0), MoveReason::Failback, home);
        assert_eq!((placed, abandoned), (Placed::Open { epoch: 3 }, Some(11)));
        match s.take_interrupted() {
            Some(Moved::Failover {
                from,
                reason,
                resume,
                spread,
                ..
            }) => {
                assert_eq!(from, Some(pair(0)));
                assert_eq!(reason, FailReason::LinkDown);
                assert_eq!(resume, 20 * MS, "traffic flowed again on pair 1");
                assert_eq!(spread, 1);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.take_interrupted(), None, "taken once");
        // The fail-back then settles as one, from the backup it left.
        s.handle_opening(12, pair(0), LaneId(1), 3);
        s.handle_move(LaneId(0), pair(0), MoveReason::Failback, home);
        assert!(s.handle_moved(12, home + 5 * MS));
        assert!(matches!(
            s.settle(home + 5 * MS),
            Some(Moved::Failback { from: Some(f), away })
                if f == pair(1) && away == home + 5 * MS - t0
        ));
        // A fail-back after a settled failover interrupts nothing.
        assert_eq!(s.take_interrupted(), None);
    }

    #[test]
    fn a_planned_move_that_joins_a_failover_under_way_leaves_it_a_failover() {
        let t0 = Instant::now();
        let fo = MoveReason::Failover(FailReason::LinkDown);
        let mut s = two_stripes_on_a_lost_lane(t0);
        let at = t0 + 10 * MS;
        assert_eq!(
            s.handle_move(LaneId(0), pair(1), fo, at).0,
            Placed::Open { epoch: 1 }
        );
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert_eq!(
            s.handle_move(LaneId(1), pair(1), fo, at).0,
            Placed::Waiting(10)
        );
        // Before the new lane is up, a rebalance sends stripe 1 on to pair 2.
        let rb = MoveReason::Rebalance;
        assert_eq!(
            s.handle_move(LaneId(1), pair(2), rb, at).0,
            Placed::Open { epoch: 2 }
        );
        s.handle_opening(11, pair(2), LaneId(1), 2);
        assert!(s.handle_moved(10, t0 + 50 * MS));
        assert!(s.handle_moved(11, t0 + 60 * MS));
        assert!(
            matches!(s.settle(t0 + 60 * MS), Some(Moved::Failover { from: Some(f), .. }) if f == pair(0)),
            "the failover is what settled"
        );
    }

    #[test]
    fn a_failed_lanes_stripes_spread_over_the_pairs_the_router_chose() {
        let t0 = Instant::now();
        let fo = MoveReason::Failover(FailReason::Timeout);
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 3);
        assert_eq!(stripes_of(&s), vec![(0, 3)]);
        s.handle_silence(1000 * MS);
        let loss = s.handle_lane_lost(0, &link_down(), FailReason::Timeout, 1000 * MS, true, t0);
        assert_eq!(loss, Loss::Failover(LaneId(0)));
        // The router spreads the three stripes over pairs 1, 2, 1.
        let at = t0 + 10 * MS;
        assert_eq!(
            s.handle_move(LaneId(0), pair(1), fo, at),
            (Placed::Open { epoch: 1 }, None)
        );
        s.handle_opening(10, pair(1), LaneId(0), 1);
        assert_eq!(
            s.handle_move(LaneId(1), pair(2), fo, at),
            (Placed::Open { epoch: 2 }, None)
        );
        s.handle_opening(11, pair(2), LaneId(1), 2);
        assert_eq!(
            s.handle_move(LaneId(2), pair(1), fo, at),
            (Placed::Waiting(10), None)
        );
        assert_eq!(s.settle(at), None, "nothing is open yet");
        assert!(s.handle_moved(10, t0 + 200 * MS));
        assert_eq!(s.settle(t0 + 200 * MS), None, "stripe 1 still waits");
        assert!(s.handle_moved(11, t0 + 300 * MS));
        assert_eq!(
            s.settle(t0 + 300 * MS),
            Some(Moved::Failover {
                from: Some(pair(0)),
                reason: FailReason::Timeout,
                detection: 1000 * MS,
                resume: 200 * MS,
                spread: 2
            }),
            "named after the pair that failed, not the last hop"
        );
        assert_eq!(stripes_of(&s), vec![(10, 2), (11, 1)]);
        assert_eq!(s.detected(), None);
        // Fail-back: every stripe home on one new lane; the backups drain and retire.
        let fb = MoveReason::Failback;
        let at = t0 + 5000 * MS;
        assert_eq!(
            s.handle_move(LaneId(0), pair(0), fb, at).0,
            Placed::Open { epoch: 3 }
        );
        s.handle_opening(12, pair(0), LaneId(0), 3);
        assert_eq!(
            s.handle_move(LaneId(1), pair(0), fb, at).0,
            Placed::Waiting(12)
        );
        assert_eq!(
            s.handle_move(LaneId(2), pair(0), fb, at).0,
            Placed::Waiting(12)
        );
        assert_eq!(
            s.idle(),
            Vec::<usize>::new(),
            "nobody carries a stripe yet: keep both"
        );
        assert!(s.handle_moved(12, t0 + 5100 * MS));
        assert_eq!(
            s.settle(t0 + 5100 * MS),
            Some(Moved::Failback {
                from: Some(pair(1)),
                away: 5100 * MS
            })
        );
        assert_eq!(s.idle(), vec![10, 11]);
        assert!(s.handle_retired(10));
        assert!(s.handle_retired(11));
        assert_eq!(stripes_of(&s), vec![(12, 3)]);
        assert_eq!(s.spread(), 1);
    }

    #[test]
    fn a_stripe_joins_a_lane_already_on_its_new_pair() {
        let t0 = Instant::now();
        let link = MoveReason::Failover(FailReason::LinkDown);
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        s.handle_lane_lost(
            0,
            &link_down(),
            FailReason::LinkDown,
            Duration::ZERO,
            true,
            t0,
        );
        s.handle_move(LaneId(0), pair(1), link, t0);
        s.handle_opening(5, pair(1), LaneId(0), 1);
        s.handle_moved(5, t0 + 40 * MS);
        assert_eq!(s.settle(t0 + 40 * MS), None, "stripe 1 has no lane yet");
        assert_eq!(
            s.handle_move(LaneId(1), pair(1), link, t0 + 50 * MS),
            (Placed::Joined(5), None)
        );
        assert_eq!(
            s.settle(t0 + 50 * MS),
            Some(Moved::Failover {
                from: Some(pair(0)),
                reason: FailReason::LinkDown,
                detection: Duration::ZERO,
                resume: 40 * MS,
                spread: 1
            })
        );
        assert_eq!(stripes_of(&s), vec![(5, 2)]);
    }

    #[test]
    fn an_opening_no_stripe_waits_for_is_abandoned_and_a_failed_one_orphans_its_stripes() {
        let t0 = Instant::now();
        let fo = MoveReason::Failover(FailReason::NicError);
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        s.handle_lane_lost(
            0,
            &link_down(),
            FailReason::NicError,
            Duration::ZERO,
            true,
            t0,
        );
        s.handle_move(LaneId(0), pair(1), fo, t0);
        s.handle_opening(7, pair(1), LaneId(0), 1);
        s.handle_move(LaneId(1), pair(1), fo, t0);
        assert_eq!(s.handle_opening_failed(7), vec![LaneId(0), LaneId(1)]);
        assert_eq!(s.settle(t0), None, "both stripes wait for a move");
        s.handle_move(LaneId(0), pair(2), fo, t0);
        s.handle_opening(8, pair(2), LaneId(0), 2);
        s.handle_move(LaneId(1), pair(3), fo, t0);
        s.handle_opening(9, pair(3), LaneId(1), 3);
        // The router moves stripe 1 on before its lane opened: that opening is abandoned.
        assert_eq!(
            s.handle_move(LaneId(1), pair(2), fo, t0),
            (Placed::Waiting(8), Some(9))
        );
        let open: Vec<usize> = s.openings().collect();
        assert_eq!(open, vec![8]);
        s.handle_moved(8, t0 + 90 * MS);
        assert!(matches!(
            s.settle(t0 + 90 * MS),
            Some(Moved::Failover { spread: 1, .. })
        ));
        assert_eq!(s.handle_failed(), vec![8]);
    }

    #[test]
    fn losing_a_lane_while_another_carries_on_reports_its_stripes_only() {
        let t0 = Instant::now();
        let fo = MoveReason::Failover(FailReason::LinkDown);
        let mut s = PathMachine::new(true, T, 0);
        s.route(pair(0), 2);
        s.handle_move(LaneId(1), pair(1), fo, t0);
        s.handle_opening(4, pair(1), LaneId(1), 1);
        s.handle_moved(4, t0);
        assert_eq!(stripes_of(&s), vec![(0, 1), (4, 1)]);
        assert_eq!(
            s.handle_lane_lost(
                4,
                &link_down(),
                FailReason::LinkDown,
                Duration::ZERO,
                true,
                t0
            ),
            Loss::Failover(LaneId(1))
        );
        assert!(s.has_lane(), "lane 0 carries on");
        // A lane without stripes (draining) that dies needs no move.
        s.handle_move(LaneId(0), pair(2), fo, t0);
        s.handle_opening(6, pair(2), LaneId(0), 2);
        s.handle_moved(6, t0);
        assert_eq!(
            s.handle_lane_lost(
                0,
                &link_down(),
                FailReason::LinkDown,
                Duration::ZERO,
                true,
                t0
            ),
            Loss::Carry
        );
    }
}
