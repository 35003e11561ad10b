//! Routing: the policy half of the failover engine. No sockets, no threads, no clock reads.
//!
//! [`Router`] decides which NIC pair each lane of each comm runs on. It keeps a health table
//! of (local NIC, remote NIC) pairs, picks backup pairs when a lane fails (P2 of
//! `docs/design.md` §1: rail rule, distance limit, health probe), spreads a failed NIC's
//! lanes by load (P3), and moves lanes back to their original pair once it has passed
//! repeated probes, with a hold-down that grows for flapping links (P7; §5.2 and §5.5).
//! It never touches a file descriptor: the reactor feeds it inputs (`handle_*`), carries
//! out its outputs (`poll_*`) and publishes [`Routes`] snapshots through a
//! [`RoutePublisher`] for lock-free readers.
//!
//! # Time
//!
//! Time is an argument: every method that depends on time takes `now: Instant`, which the
//! reactor reads once before and once after each poll and passes to every call of that
//! half-turn (`docs/design.md` §3.4). `now` must never go backwards between calls. Tests
//! build a virtual clock as one base `Instant` plus offsets, so every deadline is exact.
//!
//! # Call order
//!
//! 1. Build with [`Router::new`]; register each comm with [`Router::add_comm`] once its
//!    connect handshake has exchanged NIC lists.
//! 2. Feed inputs as they happen: [`Router::handle_lane_failure`] (and
//!    [`Router::handle_brownout`] for a pair that failed by browning out),
//!    [`Router::handle_probe`] (the answer to every [`ProbeRequest`]; ask
//!    [`Router::check_probe_rate`] first when the probe's payload crossed),
//!    [`Router::handle_nic_down`],
//!    [`Router::handle_nic_up`], and [`Router::handle_timeout`] when the deadline from
//!    [`Router::poll_timeout`] has passed.
//! 3. After each input, drain [`Router::poll_move`], [`Router::poll_probe`] and
//!    [`Router::poll_event`] until they return `None`, then re-arm the timer from
//!    [`Router::poll_timeout`] and publish [`Router::snapshot`].
//!
//! The router updates its own view the moment it queues a [`Move`]: the reactor must carry
//! out every move it polls (in order), or report the lane as failed, which selects again.
#![deny(missing_docs, missing_debug_implementations)]

pub mod capacity;
pub(crate) mod rng;
mod router;
mod snapshot;
#[cfg(test)]
mod tests;

use std::fmt;
use std::time::Duration;

use crate::topology::PathType;

pub use crate::config::RouterConfig;
pub use crate::topology::RailRule;
pub use router::Router;
pub use snapshot::{
    CommRoutes, LaneRoute, LaneStatus, LocalNicRoutes, RemoteNicRoutes, RoutePublisher, Routes,
};

/// How long the reactor should wait for a probe's answer before reporting it failed with
/// `handle_probe(pair, false, now)`. The router keeps no probe timer of its own: the deadline
/// belongs to the reactor, which owns the probe connection.
pub const DEFAULT_PROBE_DEADLINE: Duration = Duration::from_millis(200);

/// A communicator, as the reactor numbers it (a slab key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommId(pub usize);

/// A lane of one comm: its index in the comm's lane list given to [`Router::add_comm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LaneId(pub usize);

/// A NIC on one node. Local NIC ids are shared by all comms of this process; remote NIC ids
/// are only meaningful together with the [`PeerId`] of the node that announced them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NicId(pub u32);

/// A remote node. The reactor gives every comm to the same node the same `PeerId`, so remote
/// NIC load and pair health are shared between those comms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u32);

/// One path a lane can run on: a local NIC to a NIC of a peer node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pair {
    /// The NIC on this node.
    pub local: NicId,
    /// The node at the other end.
    pub peer: PeerId,
    /// The NIC on that node.
    pub remote: NicId,
}

impl fmt::Display for Pair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nic{} -> peer{}/nic{}",
            self.local.0, self.peer.0, self.remote.0
        )
    }
}

/// A NIC of this node as one comm sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalNic {
    /// The NIC.
    pub id: NicId,
    /// Its rail, if known.
    pub rail: Option<u32>,
    /// Its PCIe path type to the GPU this comm serves; `None` when the topology is unknown
    /// (the distance limit then counts as met, the pair ranks as the limit itself, and
    /// [`Event::TopologyUnknown`] says so once).
    pub distance: Option<PathType>,
}

/// A NIC of the peer node, as announced in the connect handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteNic {
    /// The NIC, numbered by the peer.
    pub id: NicId,
    /// Its rail, if known.
    pub rail: Option<u32>,
    /// Its link speed in Mb/s, as the peer announced it; `None` counts it as fast as the
    /// local end of each pair.
    pub speed_mbps: Option<u64>,
}

/// What [`Router::add_comm`] needs to know about a comm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommSpec {
    /// The node at the other end.
    pub peer: PeerId,
    /// This node's NICs that the comm may use, with their distance to the comm's GPU.
    pub local_nics: Vec<LocalNic>,
    /// The peer's NICs from the handshake.
    pub remote_nics: Vec<RemoteNic>,
    /// The (local, remote) NIC of each lane as NCCL set it up; lane `i` is `LaneId(i)`.
    /// These are the original pairs that fail-back returns to; they are not checked against
    /// the rail rule or distance limit (P8: NCCL's choice stays while nothing fails).
    pub lanes: Vec<(NicId, NicId)>,
}

impl CommSpec {
    /// A comm NCCL connected over one lane, from local NIC `local` to the peer's NIC
    /// `remote`. `locals`: this node's NICs' rails; `distance[x]`: the path type from
    /// `local`'s GPU to NIC `x`; `remotes`: the peer's NICs' rails and link speeds (Mb/s),
    /// in its numbering.
    pub fn one_lane(
        peer: PeerId,
        locals: &[Option<u32>],
        distance: &[Option<PathType>],
        remotes: &[(Option<u32>, Option<u64>)],
        (local, remote): (NicId, NicId),
    ) -> CommSpec {
        let id = |i: usize| NicId(i as u32);
        CommSpec {
            peer,
            local_nics: (locals.iter().enumerate())
                .map(|(i, &rail)| LocalNic {
                    id: id(i),
                    rail,
                    distance: distance.get(i).copied().flatten(),
                })
                .collect(),
            remote_nics: (remotes.iter().enumerate())
                .map(|(j, &(rail, speed_mbps))| RemoteNic {
                    id: id(j),
                    rail,
                    speed_mbps,
                })
                .collect(),
            lanes: vec![(local, remote)],
        }
    }
}

/// Why a lane failed (an input to [`Router::handle_lane_failure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailReason {
    /// The lane stopped making progress (P1), as judged per lane: it received nothing
    /// for the completion timeout, it browned out (delivering far below its best rate
    /// with data waiting, for the completion timeout), a handshake, probe or close on
    /// it passed its deadline, or the receiver sent a `Stalled` frame (it let the lane
    /// go for a path failure the sender may not see itself, as in a one-way failure).
    /// Also any other lane error that is not the NIC's own, such as a peer that closed
    /// or reset the lane, or a protocol error (`conn::lane::Cause::error`).
    Timeout,
    /// An error completion, async port/device event or socket error.
    NicError,
    /// Carrier lost on the local NIC.
    LinkDown,
    /// A probe of the lane's pair failed.
    Probe,
}

impl FailReason {
    /// All reasons, in counter order.
    pub const ALL: [FailReason; 4] = [
        FailReason::Timeout,
        FailReason::NicError,
        FailReason::LinkDown,
        FailReason::Probe,
    ];

    /// A short lowercase name, fit for a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::Timeout => "timeout",
            FailReason::NicError => "nic_error",
            FailReason::LinkDown => "link_down",
            FailReason::Probe => "probe",
        }
    }
}

/// Why the router moves a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveReason {
    /// The lane's pair failed; it moves to a backup pair.
    Failover(FailReason),
    /// The lane's original pair passed its fail-back test; it moves home.
    Failback,
    /// An end of the lane's pair is drained: a planned move, the old pair still working.
    Drain,
    /// The lane ran on a backup pair whose local NIC turned out to carry less than it was
    /// weighed by; another survivor can take it. A planned move, the old pair still
    /// working.
    Rebalance,
}

/// An order to move one lane to another pair (or, for a stranded lane whose original pair
/// recovered, to reconnect it on that same pair: then `from == to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Move {
    /// The comm the lane belongs to.
    pub comm: CommId,
    /// The lane.
    pub lane: LaneId,
    /// The pair the lane was on.
    pub from: Pair,
    /// The pair the lane must run on now.
    pub to: Pair,
    /// Why.
    pub reason: MoveReason,
}

/// A request to test whether `pair` answers now. The reactor must answer every request
/// exactly once with [`Router::handle_probe`], reporting failure when no answer came within
/// its deadline ([`DEFAULT_PROBE_DEADLINE`]). A lane waiting for a backup waits for these
/// answers, so an unanswered probe stalls its failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct ProbeRequest {
    /// The pair to test.
    pub pair: Pair,
    /// Probes of this pair that failed in a row before this one. A probe that crosses a
    /// busy link may miss its deadline behind queued traffic, so the reactor gives each
    /// retry a longer deadline.
    pub retry: u32,
}

/// The rule that kept a candidate pair from being chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclusion {
    /// A static rule (rail rule, distance limit) excludes the pair: the one rule
    /// `railover doctor` shows too ([`crate::topology::pair_eligibility`]).
    Rule(crate::topology::Exclusion),
    /// The local NIC has no carrier.
    Down,
    /// An operator drained one of the pair's NICs (ours or the peer's).
    Drained,
    /// One end of the pair cannot register the comm's memory (GPU memory out of that
    /// NIC's reach): that NIC is out for this comm.
    Memory,
    /// The pair failed recently (a lane error or a failed probe) and has not passed a
    /// probe since; it is re-probed with backoff while a lane waits for it.
    Unhealthy {
        /// Probes of the pair that failed in a row.
        failed_probes: u32,
    },
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Exclusion::Rule(e) => e.fmt(f),
            Exclusion::Down => f.write_str("local NIC down"),
            Exclusion::Drained => f.write_str("NIC drained"),
            Exclusion::Memory => f.write_str("its NIC cannot register the comm's memory"),
            Exclusion::Unhealthy { failed_probes: 0 } => f.write_str("pair unhealthy"),
            Exclusion::Unhealthy { failed_probes: n } => write!(
                f,
                "pair unhealthy: {n} probe{} failed in a row",
                if n == 1 { "" } else { "s" }
            ),
        }
    }
}

/// An end of a pair: our NIC or the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Our NIC ([`Pair::local`]).
    Local,
    /// The peer's NIC ([`Pair::remote`]).
    Remote,
}

impl End {
    /// This end's NIC of `pair`.
    pub fn of(self, pair: Pair) -> NicId {
        match self {
            End::Local => pair.local,
            End::Remote => pair.remote,
        }
    }
}

/// Something the reactor should log or act on, from [`Router::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Event {
    /// No candidate pair passed the checks for a failed lane; the comm cannot continue on
    /// it (P5: the reactor returns an error to NCCL and logs a WARN naming each candidate
    /// and the rule that excluded it). Reported at once when no candidate is even up (every
    /// one excluded by rail rule, distance or carrier), otherwise only once
    /// [`RouterConfig::giveup`] has passed since the failure with no candidate passing a
    /// probe. Reported once per failure; the lane stays stranded and is moved if a pair
    /// becomes eligible.
    NoEligiblePair {
        /// The comm.
        comm: CommId,
        /// The stranded lane.
        lane: LaneId,
        /// Every candidate pair of the comm, with the first rule that excluded it (checked
        /// in the order rail, distance, carrier, health).
        exclusions: Vec<(Pair, Exclusion)>,
    },
    /// A candidate passed the distance limit only because its distance to the GPU is not
    /// known. Reported once per local NIC for the router's lifetime.
    TopologyUnknown {
        /// The NIC whose distance is unknown.
        nic: NicId,
    },
}

impl fmt::Display for Event {
    /// The text of the log line: for a stranded lane, every candidate and the rule that
    /// excluded it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::NoEligiblePair {
                comm,
                lane,
                exclusions,
            } => {
                write!(f, "comm {} lane {}: no eligible NIC pair", comm.0, lane.0)?;
                for (i, (pair, why)) in exclusions.iter().enumerate() {
                    f.write_str(if i == 0 { ": " } else { "; " })?;
                    write!(f, "{pair} ({why})")?;
                }
                Ok(())
            }
            Event::TopologyUnknown { nic } => write!(
                f,
                "nic{}: PCIe distance to the GPU unknown, distance limit not applied",
                nic.0
            ),
        }
    }
}

/// Failover counts, one per [`FailReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReasonCounts {
    /// [`FailReason::Timeout`].
    pub timeout: u64,
    /// [`FailReason::NicError`].
    pub nic_error: u64,
    /// [`FailReason::LinkDown`].
    pub link_down: u64,
    /// [`FailReason::Probe`].
    pub probe: u64,
}

impl ReasonCounts {
    /// The count for one reason.
    pub fn get(&self, reason: FailReason) -> u64 {
        match reason {
            FailReason::Timeout => self.timeout,
            FailReason::NicError => self.nic_error,
            FailReason::LinkDown => self.link_down,
            FailReason::Probe => self.probe,
        }
    }

    /// The sum over all reasons.
    pub fn total(&self) -> u64 {
        FailReason::ALL.iter().map(|&r| self.get(r)).sum()
    }

    fn bump(&mut self, reason: FailReason) {
        let slot = match reason {
            FailReason::Timeout => &mut self.timeout,
            FailReason::NicError => &mut self.nic_error,
            FailReason::LinkDown => &mut self.link_down,
            FailReason::Probe => &mut self.probe,
        };
        *slot += 1;
    }
}

/// Plain counters kept by the router; `telemetry` gives them metric names
/// (`docs/design.md` §7.2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Lanes moved to a backup pair, by the reason their pair failed.
    pub failovers: ReasonCounts,
    /// Lanes moved back to their original pair.
    pub failbacks: u64,
    /// Probe requests queued.
    pub probes_requested: u64,
    /// Probe answers that said the pair works.
    pub probes_ok: u64,
    /// Probe answers that said it does not (or came too late).
    pub probes_failed: u64,
    /// [`Event::NoEligiblePair`] events queued.
    pub no_eligible_pair: u64,
    /// Lanes moved off a drained NIC (planned moves).
    pub drain_moves: u64,
    /// Lanes moved off a backup NIC found slower than it was weighed by (planned moves).
    pub rebalance_moves: u64,
}

/// Why a NIC may not be drained now: a comm running on it would have no pair left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainRefused {
    /// The NIC asked for.
    pub nic: NicId,
    /// A comm that would be left with nowhere to go.
    pub comm: CommId,
    /// Each of that comm's pairs, with what keeps it out.
    pub exclusions: Vec<(Pair, Exclusion)>,
}

impl fmt::Display for DrainRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "comm {} has no other pair to go to", self.comm.0)?;
        for (i, (pair, why)) in self.exclusions.iter().enumerate() {
            f.write_str(if i == 0 { ": " } else { "; " })?;
            write!(f, "{pair} ({why})")?;
        }
        Ok(())
    }
}

/// A request the router refused, naming what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// `add_comm` with an id that is already registered.
    #[error("comm {0:?} is already registered")]
    DuplicateComm(CommId),
    /// The comm is not registered (never added, or removed).
    #[error("comm {0:?} is not registered")]
    UnknownComm(CommId),
    /// The comm has no such lane.
    #[error("comm {comm:?} has no lane {lane:?}")]
    UnknownLane {
        /// The comm.
        comm: CommId,
        /// The lane asked for.
        lane: LaneId,
    },
    /// `add_comm` with no lanes.
    #[error("comm {0:?} has no lanes")]
    NoLanes(CommId),
    /// A lane names a NIC missing from the comm's NIC lists.
    #[error("comm {comm:?} lane {lane:?} uses NIC {nic:?}, which is not in its {side} NIC list")]
    UnknownNic {
        /// The comm.
        comm: CommId,
        /// The lane.
        lane: LaneId,
        /// The NIC it names.
        nic: NicId,
        /// "local" or "remote".
        side: &'static str,
    },
}
