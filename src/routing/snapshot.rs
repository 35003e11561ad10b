//! Immutable route snapshots and their lock-free publication.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{CommId, LaneId, NicId, Pair, PeerId, Stats};

/// What the router had decided at one moment: every comm's lanes and every NIC's load.
/// Built by [`Router::snapshot`](super::Router::snapshot); never changes once built. Lists
/// are sorted by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes {
    /// One entry per registered comm, by `comm`.
    pub comms: Vec<CommRoutes>,
    /// Every local NIC a comm may use or that was reported down, by `nic`.
    pub local_nics: Vec<LocalNicRoutes>,
    /// Every remote NIC a comm may use, by `(peer, nic)`.
    pub remote_nics: Vec<RemoteNicRoutes>,
    /// The router's counters at the same moment.
    pub stats: Stats,
}

impl Routes {
    /// The routes of one comm.
    pub fn comm(&self, comm: CommId) -> Option<&CommRoutes> {
        self.comms
            .binary_search_by_key(&comm, |c| c.comm)
            .ok()
            .map(|i| &self.comms[i])
    }

    /// The state of one local NIC.
    pub fn local_nic(&self, nic: NicId) -> Option<&LocalNicRoutes> {
        self.local_nics
            .binary_search_by_key(&nic, |n| n.nic)
            .ok()
            .map(|i| &self.local_nics[i])
    }
}

/// One comm's lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommRoutes {
    /// The comm.
    pub comm: CommId,
    /// The node at the other end.
    pub peer: PeerId,
    /// Its lanes, by `lane`.
    pub lanes: Vec<LaneRoute>,
}

/// Where one lane runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneRoute {
    /// The lane.
    pub lane: LaneId,
    /// The pair NCCL set it up on, which fail-back returns to.
    pub original: Pair,
    /// The pair it runs on (while not [`LaneStatus::Active`], the pair that failed).
    pub current: Pair,
    /// Whether it runs.
    pub status: LaneStatus,
}

/// Whether a lane runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneStatus {
    /// Running on `current`.
    Active,
    /// Its pair failed; a backup is being chosen (candidates are being probed).
    Moving,
    /// Its pair failed and no candidate was eligible (an `Event::NoEligiblePair` went out).
    Stranded,
}

/// One local NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalNicRoutes {
    /// The NIC.
    pub nic: NicId,
    /// Whether it has carrier.
    pub up: bool,
    /// Running lanes on it, across all comms.
    pub lanes: u32,
}

/// One remote NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteNicRoutes {
    /// The node it belongs to.
    pub peer: PeerId,
    /// The NIC.
    pub nic: NicId,
    /// Running lanes on it, across all comms.
    pub lanes: u32,
}

/// Where the reactor publishes [`Routes`] and anyone reads them without a lock (metrics,
/// `getProperties`, the doctor). Only the reactor publishes; a reader sees either the old or
/// the new snapshot, never a mix.
#[derive(Debug, Default)]
pub struct RoutePublisher {
    current: ArcSwap<Routes>,
}

impl RoutePublisher {
    /// A publisher holding `initial`.
    pub fn new(initial: Routes) -> Self {
        RoutePublisher {
            current: ArcSwap::from_pointee(initial),
        }
    }

    /// Replaces the published snapshot; readers holding the old one keep it until they drop
    /// it.
    pub fn publish(&self, routes: Routes) {
        self.current.store(Arc::new(routes));
    }

    /// The snapshot published last.
    pub fn load(&self) -> Arc<Routes> {
        self.current.load_full()
    }
}
