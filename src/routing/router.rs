//! The router state machine: health table, selection, spreading, fail-back.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::capacity::{pcie_factor, Capacities, TOLERANCE};

/// A lane on a backup NIC found slower than it was weighed by moves on only where its
/// load per unit of capacity drops by more than this: small gains are not worth a move,
/// and a margin keeps two NICs from trading lanes back and forth as estimates wobble.
pub const REBALANCE_MARGIN: f64 = 0.2;
use super::rng::SplitMix64;
use super::snapshot::{CommRoutes, LaneRoute, LaneStatus, LocalNicRoutes, RemoteNicRoutes, Routes};
use crate::config::RouterConfig;
use crate::topology::pair_eligibility;

use super::{
    CommId, CommSpec, DrainRefused, End, Event, Exclusion, FailReason, LaneId, LocalNic, Move,
    MoveReason, NicId, Pair, PeerId, ProbeRequest, RemoteNic, RouterError, Stats,
};

/// Chooses the NIC pair of every lane of every comm of this process, and moves lanes when
/// pairs fail and recover. Sans-IO: see the [module docs](super) for the call order.
///
/// # Selection (P2, P3)
///
/// When a lane's pair fails, every other (local, remote) pair of its comm is a candidate.
/// A candidate must pass, in order, the rail rule and the distance limit (the static rules
/// of [`pair_eligibility`], shared with `railover doctor`; an unknown distance passes and
/// ranks as the limit), the local NIC's carrier, the drains and the health check. Health is "good" when the pair carries lanes without a
/// reported failure, or answered a probe within `health_ttl`; "bad" after a failure, for
/// `health_ttl` (a lane failure) or for the re-probe backoff (a failed probe); otherwise
/// "unknown". An original pair under its fail-back watch is a candidate like any other:
/// the watch only governs moving lanes *home*. Unknown candidates are probed first
/// ([`Router::poll_probe`]), and the lane waits until none of its candidates is unknown, so
/// that it is spread over every pair that works rather than over the first to answer. It
/// then goes to the good candidate with the least load per unit of capacity at its busier
/// end: the lanes on its local NIC (across all comms, this lane included) over what that
/// NIC can carry for this comm's GPU (link speed or measured rate, times the PCIe path's
/// factor: [`super::capacity`]), or the lanes on its remote NIC over the link speed the
/// peer announced. An end of unknown capacity counts as fast as the other, as
/// rail-matched NICs are. Candidates within
/// [`TOLERANCE`] of the least are told apart by load alone (then the sum of both ends'
/// lanes, then the nearer local NIC), so equal NICs measured a few per cent apart share
/// equally; the seeded RNG breaks remaining ties. With `weighted` off every capacity
/// counts as equal. Every other lane on a failed pair moves at
/// once too, because they share its path.
///
/// # Giving up (P5)
///
/// A lane is given up ([`Event::NoEligiblePair`]) at once only when no candidate is even
/// up: every one is excluded by the rail rule, the distance limit or its local carrier.
/// While some candidate is up but unhealthy, the lane waits: each failed probe holds the
/// pair "bad" for a backoff (`retry_base`, doubling to `retry_max`), after which it is
/// probed again, until `giveup` has passed since the failure. One probe missed behind a
/// busy link therefore never ends a comm.
///
/// # Fail-back (P7)
///
/// While any lane is away from its original pair, that pair is probed every
/// `failback_interval` (first probe one interval after it failed). After
/// `failback_probes_k` consecutive good answers, and once the pair has been quiet (no
/// failure, no failed probe) for its hold-down, all its lanes move back. The hold-down is
/// zero until the pair fails within `holddown_max` of a fail-back (a flap); then it is
/// `holddown_base`, doubling with each further flap up to `holddown_max`, and halving for
/// every `holddown_max` the pair then stays in service without failing. Probing never
/// stops while a lane is away.
///
/// # Implementation notes
///
/// The only timers are the fail-back probes, one per original pair with lanes away, each
/// due one interval after the previous probe was sent (or after the pair failed). The
/// hold-down needs no timer of its own: it is checked when a good answer arrives, so a
/// fail-back lands on the first probe answered once the hold-down has passed. Probe
/// deadlines belong to the reactor ([`DEFAULT_PROBE_DEADLINE`](super::DEFAULT_PROBE_DEADLINE)).
/// Every collection is ordered, so the same inputs and seed give the same outputs.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    rng: SplitMix64,
    comms: BTreeMap<CommId, Comm>,
    pairs: BTreeMap<Pair, PairState>,
    down: BTreeSet<NicId>,
    /// NICs an operator drained, ours and peers': no lane goes to a pair using one, and
    /// lanes on one leave it in planned moves.
    drains: Drains,
    /// What each local NIC can carry: selection divides load by it.
    capacity: Capacities,
    topology_reported: BTreeSet<NicId>,
    moves: VecDeque<Move>,
    probes: VecDeque<ProbeRequest>,
    events: VecDeque<Event>,
    stats: Stats,
    /// When waiting lanes must be looked at again: a candidate's "bad" verdict expires (it
    /// is re-probed) or a give-up deadline passes.
    wake_at: Option<Instant>,
    /// The latest `now` seen, to catch a clock that goes backwards in debug builds.
    last_now: Option<Instant>,
}

/// The NICs an operator drained: ours, and each peer's as it told us.
#[derive(Debug, Default)]
struct Drains {
    local: BTreeSet<NicId>,
    remote: BTreeSet<(PeerId, NicId)>,
}

impl Drains {
    /// Whether either end of `pair` is drained.
    fn hold(&self, pair: Pair) -> bool {
        self.local.contains(&pair.local) || self.remote.contains(&(pair.peer, pair.remote))
    }
}

#[derive(Debug)]
struct Comm {
    peer: PeerId,
    local: Vec<LocalNic>,
    remote: Vec<RemoteNic>,
    lanes: Vec<Lane>,
    /// NICs that cannot register the comm's memory, at our end or the peer's: no lane of
    /// the comm goes to a pair with one of them again.
    unreachable: Vec<(End, NicId)>,
}

impl Comm {
    /// Whether an end of `pair` cannot register the comm's memory.
    fn unreachable(&self, pair: Pair) -> bool {
        (self.unreachable.iter()).any(|&(end, nic)| end.of(pair) == nic)
    }
}

#[derive(Debug)]
struct Lane {
    original: Pair,
    current: Pair,
    state: LaneState,
}

impl Lane {
    /// Away from home: on another pair, or waiting for one.
    fn displaced(&self) -> bool {
        self.current != self.original || self.state != LaneState::Active
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneState {
    Active,
    /// It must leave its pair since `since`, for a backup: its pair failed (`failed`), or
    /// one of the pair's NICs is drained (`None`: a planned move, while the lane still
    /// runs where it is). `reported` once `NoEligiblePair` went out.
    Pending {
        failed: Option<FailReason>,
        since: Instant,
        reported: bool,
    },
}

#[derive(Debug, Default)]
struct PairState {
    health: Health,
    probing: bool,
    /// Present while lanes whose original pair this is are away from it.
    watch: Option<Watch>,
    holddown: Duration,
    last_failure: Option<Instant>,
    last_failback: Option<Instant>,
    /// Probes that failed in a row; reset by a good probe or the carrier returning.
    failed_probes: u32,
    /// The least rate (bytes/s) a probe of the pair must show, once it has failed by
    /// browning out (see [`Router::handle_brownout`]).
    probe_floor: Option<f64>,
}

impl PairState {
    /// The pair failed at `now`: unhealthy, and a fail-back test under way starts over.
    fn failed_at(&mut self, now: Instant) {
        self.health = Health::Bad(now);
        self.last_failure = Some(now);
        if let Some(w) = &mut self.watch {
            w.streak = 0;
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
enum Health {
    #[default]
    Unknown,
    Good(Instant),
    Bad(Instant),
}

#[derive(Debug, Clone, Copy)]
struct Watch {
    next_probe: Instant,
    streak: u32,
}

/// Lanes on each NIC and pair, counting only lanes running (not waiting for a backup).
#[derive(Debug, Default)]
struct Loads {
    local: BTreeMap<NicId, u32>,
    remote: BTreeMap<(PeerId, NicId), u32>,
    pair: BTreeMap<Pair, u32>,
}

impl Loads {
    fn add(&mut self, pair: Pair) {
        *self.local.entry(pair.local).or_default() += 1;
        *self.remote.entry((pair.peer, pair.remote)).or_default() += 1;
        *self.pair.entry(pair).or_default() += 1;
    }

    fn remove(&mut self, pair: Pair) {
        let ends = [
            self.local.get_mut(&pair.local),
            self.remote.get_mut(&(pair.peer, pair.remote)),
            self.pair.get_mut(&pair),
        ];
        for n in ends.into_iter().flatten() {
            *n = n.saturating_sub(1);
        }
    }

    /// Lanes on the pair's local NIC and on its remote NIC.
    fn ends(&self, pair: Pair) -> (u32, u32) {
        let l = self.local.get(&pair.local).copied().unwrap_or(0);
        let r = self
            .remote
            .get(&(pair.peer, pair.remote))
            .copied()
            .unwrap_or(0);
        (l, r)
    }

    fn cost(&self, pair: Pair) -> (u32, u32) {
        let (l, r) = self.ends(pair);
        (l.max(r), l + r)
    }
}

enum Verdict {
    Excluded(Exclusion),
    Unknown {
        probing: bool,
    },
    /// Passes every check. `cost` is the load per unit of capacity the pair would have
    /// with one more lane; among candidates whose cost is near the least, the key orders
    /// by load, then distance.
    Eligible {
        cost: f64,
        key: (u32, u32, u8),
    },
}

struct Candidate {
    pair: Pair,
    verdict: Verdict,
    /// Passed the distance limit only because the distance is unknown.
    topology_unknown: bool,
}

impl Router {
    /// A router with no comms, every NIC up and the RNG seeded from `config.seed`.
    pub fn new(config: RouterConfig) -> Self {
        let config = config.normalized();
        Router {
            rng: SplitMix64::new(config.seed),
            config,
            comms: BTreeMap::new(),
            pairs: BTreeMap::new(),
            down: BTreeSet::new(),
            drains: Drains::default(),
            capacity: Capacities::default(),
            topology_reported: BTreeSet::new(),
            moves: VecDeque::new(),
            probes: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
            wake_at: None,
            last_now: None,
        }
    }

    /// The settings in force (after [`RouterConfig`]'s safe replacements).
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The pair a lane runs on now (or, while it waits for a backup, the pair that failed).
    pub fn current_pair(&self, comm: CommId, lane: LaneId) -> Option<Pair> {
        self.comms.get(&comm)?.lanes.get(lane.0).map(|l| l.current)
    }

    /// The hold-down an original pair would have to serve if it failed at `now` (zero for a
    /// pair that never flapped). For logs and tests.
    pub fn holddown(&self, pair: Pair, now: Instant) -> Duration {
        self.pairs
            .get(&pair)
            .map_or(Duration::ZERO, |ps| self.decayed_holddown(ps, now))
    }

    /// Registers a comm once its handshake has exchanged NIC lists, with each lane on the
    /// pair NCCL chose. Those pairs count as healthy from `now` (the connect just worked).
    /// A lane whose local NIC is already down fails over at once.
    ///
    /// # Errors
    ///
    /// The id is taken, there are no lanes, or a lane names a NIC missing from the lists;
    /// nothing is registered then.
    pub fn add_comm(
        &mut self,
        comm: CommId,
        spec: CommSpec,
        now: Instant,
    ) -> Result<(), RouterError> {
        self.add(comm, spec, None, now)
    }

    /// Registers a comm whose connect NCCL's pairs could not carry (`why`: the local
    /// carrier was down, or the peer's NIC did not answer), so it was made over another
    /// pair. NCCL's pairs stay the lanes' originals: they count as failed from `now`, the
    /// lanes leave them at once (a failover, placed like any other), and they move home
    /// when those pairs pass their fail-back test. Other comms' lanes on those pairs are
    /// left to their own detection and to the pairs' fail-back probes (a failed probe of
    /// a busy pair moves them): one connect that found no answer is not proof against
    /// lanes that deliver.
    ///
    /// # Errors
    ///
    /// As [`Router::add_comm`].
    pub fn add_comm_elsewhere(
        &mut self,
        comm: CommId,
        spec: CommSpec,
        why: FailReason,
        now: Instant,
    ) -> Result<(), RouterError> {
        self.add(comm, spec, Some(why), now)
    }

    fn add(
        &mut self,
        comm: CommId,
        spec: CommSpec,
        unreachable: Option<FailReason>,
        now: Instant,
    ) -> Result<(), RouterError> {
        self.tick(now);
        if self.comms.contains_key(&comm) {
            return Err(RouterError::DuplicateComm(comm));
        }
        if spec.lanes.is_empty() {
            return Err(RouterError::NoLanes(comm));
        }
        for (i, &(local, remote)) in spec.lanes.iter().enumerate() {
            let unknown = |nic, side| RouterError::UnknownNic {
                comm,
                lane: LaneId(i),
                nic,
                side,
            };
            if !spec.local_nics.iter().any(|n| n.id == local) {
                return Err(unknown(local, "local"));
            }
            if !spec.remote_nics.iter().any(|n| n.id == remote) {
                return Err(unknown(remote, "remote"));
            }
        }
        let mut lanes = Vec::with_capacity(spec.lanes.len());
        for &(local, remote) in &spec.lanes {
            let pair = Pair {
                local,
                peer: spec.peer,
                remote,
            };
            let state = if self.down.contains(&local) {
                LaneState::Pending {
                    failed: Some(FailReason::LinkDown),
                    since: now,
                    reported: false,
                }
            } else if let Some(why) = unreachable {
                self.pairs.entry(pair).or_default().failed_at(now);
                LaneState::Pending {
                    failed: Some(why),
                    since: now,
                    reported: false,
                }
            } else if self.drained(pair) {
                LaneState::Pending {
                    failed: None,
                    since: now,
                    reported: false,
                }
            } else {
                let ps = self.pairs.entry(pair).or_default();
                if ps.watch.is_none() {
                    ps.health = Health::Good(now);
                }
                LaneState::Active
            };
            lanes.push(Lane {
                original: pair,
                current: pair,
                state,
            });
        }
        let displaced: Vec<Pair> = lanes
            .iter()
            .filter(|l| l.displaced())
            .map(|l| l.original)
            .collect();
        self.comms.insert(
            comm,
            Comm {
                peer: spec.peer,
                local: spec.local_nics,
                remote: spec.remote_nics,
                lanes,
                unreachable: Vec::new(),
            },
        );
        for pair in displaced {
            self.watch(pair, now);
        }
        self.settle(now);
        Ok(())
    }

    /// Forgets a comm (NCCL closed it, or the reactor failed it after
    /// [`Event::NoEligiblePair`]). Its queued moves and events are dropped. Returns whether
    /// it was registered.
    pub fn remove_comm(&mut self, comm: CommId) -> bool {
        if self.comms.remove(&comm).is_none() {
            return false;
        }
        self.moves.retain(|m| m.comm != comm);
        self.events.retain(|e| match e {
            Event::NoEligiblePair { comm: c, .. } => *c != comm,
            Event::TopologyUnknown { .. } => true,
        });
        self.drop_idle_watches();
        true
    }

    /// Reports that a lane's current pair failed: no progress within the completion timeout,
    /// an error completion, a socket error. The pair is marked unhealthy and every running
    /// lane on it, of any comm, is moved (they share its path). A report for a lane that is
    /// already waiting for a backup, or whose move is queued but not yet polled, is ignored:
    /// it describes a pair the lane is leaving.
    ///
    /// # Errors
    ///
    /// The comm or lane is not registered.
    pub fn handle_lane_failure(
        &mut self,
        comm: CommId,
        lane: LaneId,
        reason: FailReason,
        now: Instant,
    ) -> Result<(), RouterError> {
        self.tick(now);
        let l = &self.comm_with_lane(comm, lane)?.lanes[lane.0];
        let (state, pair) = (l.state, l.current);
        // A lane still waiting to leave a drained pair runs on it, so its failure counts.
        let running = matches!(
            state,
            LaneState::Active | LaneState::Pending { failed: None, .. }
        );
        if !running || self.moves.iter().any(|m| m.comm == comm && m.lane == lane) {
            return Ok(());
        }
        self.fail_pair(pair, reason, now);
        self.settle(now);
        Ok(())
    }

    /// A lane of `comm` failed because one end of its pair cannot register the comm's
    /// memory (GPU memory too far from that NIC): unlike a lane failure, the pair is fine
    /// for other comms and answers probes, so the NIC at that `end` is excluded for this
    /// comm alone, for good, and the lane waits for a pair without it, with every other
    /// lane of the comm that runs through that NIC (the stripes that shared its
    /// connection died with it, and the rest would fail the same way).
    pub fn handle_memory_unreachable(
        &mut self,
        comm: CommId,
        lane: LaneId,
        end: End,
        reason: FailReason,
        now: Instant,
    ) -> Result<(), RouterError> {
        self.tick(now);
        let c = self.comm_with_lane(comm, lane)?;
        let nic = end.of(c.lanes[lane.0].current);
        for l in &mut c.lanes {
            if l.state == LaneState::Active && end.of(l.current) == nic {
                l.state = LaneState::Pending {
                    failed: Some(reason),
                    since: now,
                    reported: false,
                };
            }
        }
        if !c.unreachable.contains(&(end, nic)) {
            c.unreachable.push((end, nic));
        }
        self.settle(now);
        Ok(())
    }

    /// Comm `comm`, checked to have lane `lane`.
    /// The comm's peer says again (in a lane's `Welcome`) that its NIC `nic` cannot
    /// register the comm's memory, in case the `Stalled` that said so first was lost with
    /// its lane: that NIC is left out of the comm's candidates from now on. `false` when
    /// it already was, or the comm is not routed.
    pub fn handle_remote_unreachable(&mut self, comm: CommId, nic: NicId) -> bool {
        let Some(c) = self.comms.get_mut(&comm) else {
            return false;
        };
        if c.unreachable.contains(&(End::Remote, nic)) {
            return false;
        }
        c.unreachable.push((End::Remote, nic));
        true
    }

    fn comm_with_lane(&mut self, comm: CommId, lane: LaneId) -> Result<&mut Comm, RouterError> {
        let c = (self.comms.get_mut(&comm)).ok_or(RouterError::UnknownComm(comm))?;
        if lane.0 >= c.lanes.len() {
            return Err(RouterError::UnknownLane { comm, lane });
        }
        Ok(c)
    }

    /// The answer to a [`ProbeRequest`]: `ok` when the pair answered within the reactor's
    /// deadline. A failed probe marks the pair unhealthy (moving any lanes on it, reason
    /// [`FailReason::Probe`]); a good one may complete a fail-back and lets waiting lanes
    /// choose their backup. An answer nobody asked for is still recorded, except a good one
    /// through a local NIC that is down: it was sent before the carrier went, so it proves
    /// nothing and does not count towards fail-back.
    pub fn handle_probe(&mut self, pair: Pair, ok: bool, now: Instant) {
        self.tick(now);
        let stale = self.down.contains(&pair.local);
        let ps = self.pairs.entry(pair).or_default();
        ps.probing = false;
        if ok {
            self.stats.probes_ok += 1;
            if !stale {
                ps.failed_probes = 0;
                ps.health = Health::Good(now);
                if let Some(w) = &mut ps.watch {
                    w.streak += 1;
                }
                self.try_failback(pair, now);
            }
        } else {
            self.stats.probes_failed += 1;
            ps.failed_probes = ps.failed_probes.saturating_add(1);
            self.fail_pair(pair, FailReason::Probe, now);
        }
        self.settle(now);
    }

    /// Reports that `pair` failed by browning out: it still delivered, but below `floor`
    /// (bytes/s, the bar the reactor's detector used). A slow link still answers a probe
    /// within its deadline, so from now on a probe of the pair passes only at `floor` or
    /// better ([`Router::check_probe_rate`]). A later brown-out replaces the floor. Report
    /// the lane failure itself with [`Router::handle_lane_failure`].
    pub fn handle_brownout(&mut self, pair: Pair, floor: f64) {
        self.pairs.entry(pair).or_default().probe_floor = Some(floor);
    }

    /// Whether `pair` failed by browning out, so that only a probe at its floor shows it
    /// healthy (traffic that merely trickles over it does not).
    pub fn browned_out(&self, pair: Pair) -> bool {
        self.pairs
            .get(&pair)
            .is_some_and(|ps| ps.probe_floor.is_some())
    }

    /// Whether a probe whose payload crossed `pair` at `rate` (bytes/s) within its deadline
    /// shows the pair working: always, unless the pair failed by browning out; then the
    /// rate must reach the floor, which is returned as the error. Answer the probe with
    /// [`Router::handle_probe`] either way.
    pub fn check_probe_rate(&self, pair: Pair, rate: f64) -> Result<(), f64> {
        match self.pairs.get(&pair).and_then(|ps| ps.probe_floor) {
            Some(floor) if rate < floor => Err(floor),
            _ => Ok(()),
        }
    }

    /// Carrier lost on a local NIC: every pair using it fails and its lanes move now, with
    /// [`FailReason::LinkDown`]. Until [`Router::handle_nic_up`], no pair using it is a
    /// candidate ([`Exclusion::Down`]) and fail-back onto it waits. Repeats are ignored.
    pub fn handle_nic_down(&mut self, nic: NicId, now: Instant) {
        self.tick(now);
        if !self.down.insert(nic) {
            return;
        }
        let pairs: Vec<Pair> = self
            .pairs
            .keys()
            .filter(|p| p.local == nic)
            .copied()
            .collect();
        for pair in pairs {
            self.fail_pair(pair, FailReason::LinkDown, now);
        }
        self.settle(now);
    }

    /// Carrier back on a local NIC. Pairs using it become "unknown" (probed before use);
    /// fail-back onto it resumes at the next scheduled probe. Repeats are ignored.
    pub fn handle_nic_up(&mut self, nic: NicId, now: Instant) {
        self.tick(now);
        if !self.down.remove(&nic) {
            return;
        }
        for (_, ps) in self.pairs.iter_mut().filter(|(p, _)| p.local == nic) {
            ps.failed_probes = 0;
            if matches!(ps.health, Health::Bad(_)) {
                ps.health = Health::Unknown;
            }
        }
        self.settle(now);
    }

    /// Whether local NIC `nic` may be drained now: every comm with a lane on it must have
    /// another pair that the static rules, memory reach, carriers and drains allow (health
    /// is left to the probes that follow). Otherwise the drain is refused, naming a comm
    /// that would be left nowhere to go and why each of its pairs is out.
    pub fn check_drain(&self, nic: NicId, now: Instant) -> Result<(), DrainRefused> {
        let loads = Loads::default();
        for (&comm, c) in &self.comms {
            if !c.lanes.iter().any(|l| l.current.local == nic) {
                continue;
            }
            let candidates = self.candidates(c, &loads, now);
            let open = |cand: &&Candidate| match cand.verdict {
                Verdict::Excluded(Exclusion::Unhealthy { .. }) => true,
                Verdict::Excluded(_) => false,
                _ => true,
            };
            if candidates
                .iter()
                .filter(|cand| cand.pair.local != nic)
                .any(|cand| open(&cand))
            {
                continue;
            }
            let exclusions = candidates
                .iter()
                .map(|cand| match cand.verdict {
                    _ if cand.pair.local == nic => (cand.pair, Exclusion::Drained),
                    Verdict::Excluded(e) => (cand.pair, e),
                    _ => (cand.pair, Exclusion::Drained),
                })
                .collect();
            return Err(DrainRefused {
                nic,
                comm,
                exclusions,
            });
        }
        Ok(())
    }

    /// An operator drains local NIC `nic` (check first with [`Router::check_drain`]): no
    /// pair using it is a candidate ([`Exclusion::Drained`]) until
    /// [`Router::handle_undrain`], and every lane on it leaves in a planned move
    /// ([`MoveReason::Drain`]) as soon as its candidates have answered their probes. The
    /// lanes keep running where they are meanwhile; a planned move never gives up.
    /// Repeats are ignored.
    pub fn handle_drain(&mut self, nic: NicId, now: Instant) {
        self.tick(now);
        if self.drains.local.insert(nic) {
            self.plan_moves(now);
        }
    }

    /// The drain of local NIC `nic` ends. Lanes still waiting to leave it stay; lanes that
    /// left come home through the fail-back test, as after a failure. Repeats are ignored.
    pub fn handle_undrain(&mut self, nic: NicId, now: Instant) {
        self.tick(now);
        if self.drains.local.remove(&nic) {
            self.unplan_moves(now);
        }
    }

    /// Peer `peer` says which of its NICs are drained now (`nics`, all of them: any other
    /// NIC of the peer is not). Lanes to a newly drained NIC leave it as for a local drain.
    /// Returns whether anything changed.
    pub fn handle_remote_drained(&mut self, peer: PeerId, nics: &[NicId], now: Instant) -> bool {
        self.tick(now);
        let now_drained: BTreeSet<(PeerId, NicId)> = nics.iter().map(|&n| (peer, n)).collect();
        let before: BTreeSet<(PeerId, NicId)> = (self.drains.remote.iter())
            .filter(|(p, _)| *p == peer)
            .copied()
            .collect();
        if before == now_drained {
            return false;
        }
        self.drains.remote.retain(|(p, _)| *p != peer);
        self.drains.remote.extend(now_drained.iter().copied());
        if before.difference(&now_drained).next().is_some() {
            self.unplan_moves(now);
        }
        if now_drained.difference(&before).next().is_some() {
            self.plan_moves(now);
        }
        true
    }

    /// Whether either end of `pair` is drained.
    pub fn drained(&self, pair: Pair) -> bool {
        self.drains.hold(pair)
    }

    /// Whether local NIC `nic` has lost its carrier ([`Router::handle_nic_down`]).
    pub fn nic_down(&self, nic: NicId) -> bool {
        self.down.contains(&nic)
    }

    /// Local NIC `nic`'s link speed (Mb/s, as sysfs or the RDMA port reports it): its
    /// capacity until its traffic shows less (see [`super::capacity`]).
    pub fn set_link_speed(&mut self, nic: NicId, mbps: u64) {
        self.capacity.set_link_speed(nic, mbps);
    }

    /// One traffic sample of local NIC `nic`: `bytes` delivered since its previous sample,
    /// and whether its lanes had data waiting throughout (`saturated`). A NIC saturated
    /// for a while shows its capacity, which selections weigh it by from then on. When
    /// that capacity falls, lanes that failed over onto the NIC move on where another
    /// backup can carry them clearly better ([`MoveReason::Rebalance`]; lanes on their
    /// original pair stay, as NCCL placed them). Returns whether it fell.
    pub fn handle_nic_sample(
        &mut self,
        nic: NicId,
        bytes: u64,
        saturated: bool,
        now: Instant,
    ) -> bool {
        self.tick(now);
        let fell = self.capacity.sample(nic, bytes, saturated, now);
        if fell {
            self.rebalance(nic, now);
        }
        fell
    }

    /// What local NIC `nic` can carry now (bytes/s), as selection weighs it: `None` when
    /// neither its link speed nor its traffic told.
    pub fn capacity(&self, nic: NicId, now: Instant) -> Option<f64> {
        self.capacity.capacity(nic, now)
    }

    /// Fires the timers due at `now`: the fail-back probes of original pairs (skipped, and
    /// the good streak reset, while their local NIC is down), the re-probes of unhealthy
    /// candidates of waiting lanes, and their give-up deadlines. Calling it early, or
    /// twice, does nothing.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.tick(now);
        if self.wake_at.is_some_and(|t| t <= now) {
            self.wake_at = None;
            self.settle(now);
        }
        let due: Vec<Pair> = self
            .pairs
            .iter()
            .filter(|(_, ps)| ps.watch.is_some_and(|w| w.next_probe <= now))
            .map(|(p, _)| *p)
            .collect();
        if due.is_empty() {
            return;
        }
        let away = self.displaced_originals();
        let interval = self.config.failback_interval;
        for pair in due {
            // A drained pair is not probed: nothing goes near a NIC under maintenance, and
            // once undrained it must pass the whole fail-back test again.
            let down = self.down.contains(&pair.local) || self.drained(pair);
            let ps = self
                .pairs
                .get_mut(&pair)
                .expect("due pairs come from the map");
            if !away.contains(&pair) {
                ps.watch = None;
                continue;
            }
            let w = ps.watch.as_mut().expect("due pairs have a watch");
            w.next_probe = now + interval;
            if down {
                w.streak = 0;
            } else if !ps.probing {
                self.request_probe(pair);
            }
        }
        // Time has passed, so old verdicts may have expired; stranded lanes look again.
        self.settle(now);
    }

    /// The earliest instant at which [`Router::handle_timeout`] has work, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pairs
            .values()
            .filter_map(|ps| ps.watch.map(|w| w.next_probe))
            .chain(self.wake_at)
            .min()
    }

    /// The next lane to move, oldest first. The router already counts the lane on `to`.
    #[must_use]
    pub fn poll_move(&mut self) -> Option<Move> {
        self.moves.pop_front()
    }

    /// The next pair to probe, oldest first; answer each with [`Router::handle_probe`].
    #[must_use]
    pub fn poll_probe(&mut self) -> Option<ProbeRequest> {
        self.probes.pop_front()
    }

    /// The next event to log or act on, oldest first.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// An immutable picture of every comm's lanes and every NIC's load, for the reactor to
    /// publish through a [`RoutePublisher`](super::RoutePublisher).
    pub fn snapshot(&self) -> Routes {
        let loads = self.loads();
        let comms = self
            .comms
            .iter()
            .map(|(&comm, c)| CommRoutes {
                comm,
                peer: c.peer,
                lanes: c
                    .lanes
                    .iter()
                    .enumerate()
                    .map(|(i, l)| LaneRoute {
                        lane: LaneId(i),
                        original: l.original,
                        current: l.current,
                        status: match l.state {
                            LaneState::Active => LaneStatus::Active,
                            LaneState::Pending {
                                reported: false, ..
                            } => LaneStatus::Moving,
                            LaneState::Pending { reported: true, .. } => LaneStatus::Stranded,
                        },
                    })
                    .collect(),
            })
            .collect();
        let mut local: BTreeSet<NicId> = self.down.clone();
        let mut remote: BTreeSet<(PeerId, NicId)> = BTreeSet::new();
        for c in self.comms.values() {
            local.extend(c.local.iter().map(|n| n.id));
            remote.extend(c.remote.iter().map(|n| (c.peer, n.id)));
        }
        Routes {
            comms,
            local_nics: local
                .into_iter()
                .map(|nic| LocalNicRoutes {
                    nic,
                    up: !self.down.contains(&nic),
                    lanes: loads.local.get(&nic).copied().unwrap_or(0),
                })
                .collect(),
            remote_nics: remote
                .into_iter()
                .map(|(peer, nic)| RemoteNicRoutes {
                    peer,
                    nic,
                    lanes: loads.remote.get(&(peer, nic)).copied().unwrap_or(0),
                })
                .collect(),
            stats: self.stats,
        }
    }

    // ---- internals ----

    /// Enforces "time never goes backwards" in debug builds.
    fn tick(&mut self, now: Instant) {
        debug_assert!(
            self.last_now.map_or(true, |t| now >= t),
            "routing: time went backwards"
        );
        self.last_now = Some(now);
    }

    /// Sends every running lane on a drained pair to wait for a planned move.
    fn plan_moves(&mut self, now: Instant) {
        let mut originals = Vec::new();
        for c in self.comms.values_mut() {
            for l in &mut c.lanes {
                if l.state == LaneState::Active && self.drains.hold(l.current) {
                    l.state = LaneState::Pending {
                        failed: None,
                        since: now,
                        reported: false,
                    };
                    originals.push(l.original);
                }
            }
        }
        for original in originals {
            self.watch(original, now);
        }
        self.settle(now);
    }

    /// A lane still waiting to leave a pair that is no longer drained stays on it.
    fn unplan_moves(&mut self, now: Instant) {
        for c in self.comms.values_mut() {
            for l in &mut c.lanes {
                let planned = matches!(l.state, LaneState::Pending { failed: None, .. });
                if planned && !self.drains.hold(l.current) {
                    l.state = LaneState::Active;
                }
            }
        }
        self.drop_idle_watches();
        self.settle(now);
    }

    /// Marks `pair` failed at `now` and sends every running lane on it to wait for a backup.
    fn fail_pair(&mut self, pair: Pair, reason: FailReason, now: Instant) {
        let (base, max) = (self.config.holddown_base, self.config.holddown_max);
        let decayed = self
            .pairs
            .get(&pair)
            .map_or(Duration::ZERO, |ps| self.decayed_holddown(ps, now));
        let ps = self.pairs.entry(pair).or_default();
        if let Some(fb) = ps.last_failback.filter(|_| in_service(ps)) {
            ps.holddown = if now.saturating_duration_since(fb) < max {
                // A flap: it failed soon after being trusted again.
                if decayed.is_zero() {
                    base
                } else {
                    (decayed * 2).min(max)
                }
            } else {
                decayed
            };
        }
        ps.failed_at(now);
        let mut originals = Vec::new();
        for c in self.comms.values_mut() {
            for l in &mut c.lanes {
                let planned = matches!(l.state, LaneState::Pending { failed: None, .. });
                if (l.state == LaneState::Active || planned) && l.current == pair {
                    // A lane waiting to leave a drained pair that fails leaves it as a
                    // failover: what it carried must go out again.
                    l.state = LaneState::Pending {
                        failed: Some(reason),
                        since: now,
                        reported: false,
                    };
                    originals.push(l.original);
                }
            }
        }
        for original in originals {
            self.watch(original, now);
        }
    }

    /// The hold-down of `ps`, halved for every `holddown_max` it has been in service since
    /// its last fail-back, and dropped to zero once below `holddown_base`.
    fn decayed_holddown(&self, ps: &PairState, now: Instant) -> Duration {
        let Some(fb) = ps.last_failback.filter(|_| in_service(ps)) else {
            return ps.holddown;
        };
        let periods = now.saturating_duration_since(fb).as_nanos()
            / self.config.holddown_max.as_nanos().max(1);
        let h = u32::try_from(periods)
            .ok()
            .and_then(|p| ps.holddown.checked_div(2u32.checked_pow(p.min(31))?))
            .unwrap_or(Duration::ZERO);
        if h < self.config.holddown_base {
            Duration::ZERO
        } else {
            h
        }
    }

    /// Starts fail-back probing of an original pair, unless it is already under way.
    fn watch(&mut self, original: Pair, now: Instant) {
        let next_probe = now + self.config.failback_interval;
        let ps = self.pairs.entry(original).or_default();
        ps.watch.get_or_insert(Watch {
            next_probe,
            streak: 0,
        });
    }

    /// Moves every displaced lane home to `pair` if it has passed its fail-back test.
    fn try_failback(&mut self, pair: Pair, now: Instant) {
        let Some(ps) = self.pairs.get(&pair) else {
            return;
        };
        let Some(w) = ps.watch else {
            return;
        };
        let quiet_until = ps.last_failure.map_or(now, |f| f + ps.holddown);
        if w.streak < self.config.failback_probes_k
            || self.down.contains(&pair.local)
            || self.drained(pair)
            || now < quiet_until
        {
            return;
        }
        let mut moved = 0;
        for (&comm, c) in &mut self.comms {
            let home = !c.unreachable(pair);
            for (i, l) in c.lanes.iter_mut().enumerate() {
                if home && l.original == pair && l.displaced() {
                    self.moves.push_back(Move {
                        comm,
                        lane: LaneId(i),
                        from: l.current,
                        to: pair,
                        reason: MoveReason::Failback,
                    });
                    l.current = pair;
                    l.state = LaneState::Active;
                    moved += 1;
                }
            }
        }
        self.stats.failbacks += moved;
        let ps = self.pairs.get_mut(&pair).expect("checked above");
        ps.watch = None;
        if moved > 0 {
            ps.last_failback = Some(now);
        }
    }

    /// Chooses a backup for every lane that waits for one and can be decided now, gives up
    /// lanes that cannot wait any longer, and sets when to look again.
    fn settle(&mut self, now: Instant) {
        let waiting: Vec<(CommId, usize, Option<FailReason>, Instant, bool)> = self
            .comms
            .iter()
            .flat_map(|(&comm, c)| {
                c.lanes
                    .iter()
                    .enumerate()
                    .filter_map(move |(i, l)| match l.state {
                        LaneState::Pending {
                            failed,
                            since,
                            reported,
                        } => Some((comm, i, failed, since, reported)),
                        LaneState::Active => None,
                    })
            })
            .collect();
        self.wake_at = None;
        if waiting.is_empty() {
            return;
        }
        let mut loads = self.loads();
        let mut homecoming = false;
        for (comm, lane, failed, since, reported) in waiting {
            let candidates = self.candidates(&self.comms[&comm], &loads, now);
            for c in &candidates {
                if c.topology_unknown && self.topology_reported.insert(c.pair.local) {
                    self.events
                        .push_back(Event::TopologyUnknown { nic: c.pair.local });
                }
            }
            // Past the give-up window nothing in question holds the lane any more: with
            // failed candidates whose verdicts expire in turn, or the fail-back watch
            // probing the original pair again and again, one candidate would always be
            // in question and the lane would wait forever.
            // A planned move never gives up: its lane runs where it is meanwhile.
            let past = failed.is_some() && now >= since + self.config.giveup;
            // A candidate's first answer is awaited, for a balanced choice; a re-probe of
            // one that already failed holds the lane only while nothing else is eligible,
            // or a healthy pair would wait on a sick one's retries.
            let (mut first, mut retrying) = (false, false);
            for c in &candidates {
                if let Verdict::Unknown { probing } = c.verdict {
                    if past {
                        continue;
                    }
                    if !probing {
                        self.request_probe(c.pair);
                    }
                    match self.pairs.get(&c.pair).is_some_and(|p| p.failed_probes > 0) {
                        true => retrying = true,
                        false => first = true,
                    }
                }
            }
            let eligible = candidates
                .iter()
                .any(|c| matches!(c.verdict, Verdict::Eligible { .. }));
            if first || (retrying && !eligible) {
                continue; // decide once the candidates that matter have answered
            }
            if let Some((to, _)) = self.pick(&candidates) {
                let l = &mut self.comms.get_mut(&comm).expect("listed above").lanes[lane];
                self.moves.push_back(Move {
                    comm,
                    lane: LaneId(lane),
                    from: l.current,
                    to,
                    reason: failed.map_or(MoveReason::Drain, MoveReason::Failover),
                });
                homecoming |= to == l.original;
                l.current = to;
                l.state = LaneState::Active;
                match failed {
                    Some(reason) => self.stats.failovers.bump(reason),
                    None => self.stats.drain_moves += 1,
                }
                loads.add(to);
                continue;
            }
            // Nothing eligible now. Unhealthy candidates are probed again when their
            // verdict expires; the lane waits for them until its give-up deadline.
            let retries = candidates
                .iter()
                .filter(|c| matches!(c.verdict, Verdict::Excluded(Exclusion::Unhealthy { .. })))
                .filter_map(|c| self.bad_until(c.pair))
                .min();
            let deadline = since + self.config.giveup;
            let Some(reason) = failed else {
                // Nowhere to go yet: the lane stays on its drained pair, and looks again
                // when a candidate's verdict expires or anything else changes.
                self.wake_at = self.wake_at.into_iter().chain(retries).min();
                continue;
            };
            let give_up = retries.is_none() || now >= deadline;
            if reported || !give_up {
                let next = if reported {
                    retries
                } else {
                    retries.map(|r| r.min(deadline))
                };
                self.wake_at = self.wake_at.into_iter().chain(next).min();
                continue;
            }
            let exclusions = candidates
                .iter()
                .filter_map(|c| match c.verdict {
                    Verdict::Excluded(e) => Some((c.pair, e)),
                    // Its last verdict expired after the window: it had failed.
                    Verdict::Unknown { .. } => Some((
                        c.pair,
                        Exclusion::Unhealthy {
                            failed_probes: self.pairs.get(&c.pair).map_or(0, |p| p.failed_probes),
                        },
                    )),
                    Verdict::Eligible { .. } => None,
                })
                .collect();
            self.events.push_back(Event::NoEligiblePair {
                comm,
                lane: LaneId(lane),
                exclusions,
            });
            self.stats.no_eligible_pair += 1;
            let l = &mut self.comms.get_mut(&comm).expect("listed above").lanes[lane];
            l.state = LaneState::Pending {
                failed: Some(reason),
                since,
                reported: true,
            };
            self.wake_at = self.wake_at.into_iter().chain(retries).min();
        }
        if homecoming {
            // A lane failed over onto its own original pair: it is home, and that pair's
            // fail-back watch ends unless other lanes are still away from it.
            self.drop_idle_watches();
        }
    }

    /// Ends the fail-back watch of every pair that no displaced lane calls home.
    fn drop_idle_watches(&mut self) {
        let away: BTreeSet<Pair> = self.displaced_originals();
        for (pair, ps) in &mut self.pairs {
            if !away.contains(pair) {
                ps.watch = None;
            }
        }
    }

    /// Every pair of `comm`, with the verdict of the checks in the documented order.
    fn candidates(&self, comm: &Comm, loads: &Loads, now: Instant) -> Vec<Candidate> {
        let limit = self.config.distance_limit;
        let mut out = Vec::with_capacity(comm.local.len() * comm.remote.len());
        for x in &comm.local {
            for y in &comm.remote {
                let pair = Pair {
                    local: x.id,
                    peer: comm.peer,
                    remote: y.id,
                };
                let allowed =
                    pair_eligibility(self.config.rail_rule, limit, x.rail, y.rail, x.distance);
                let topology_unknown = allowed.is_ok_and(|a| a.distance_unknown);
                let verdict = match allowed {
                    Err(e) => Verdict::Excluded(Exclusion::Rule(e)),
                    Ok(_) if comm.unreachable(pair) => Verdict::Excluded(Exclusion::Memory),
                    Ok(_) if self.down.contains(&x.id) => Verdict::Excluded(Exclusion::Down),
                    Ok(_) if self.drained(pair) => Verdict::Excluded(Exclusion::Drained),
                    Ok(allowed) => match self.health(pair, loads, now) {
                        Health::Bad(_) => Verdict::Excluded(Exclusion::Unhealthy {
                            failed_probes: self.pairs.get(&pair).map_or(0, |ps| ps.failed_probes),
                        }),
                        Health::Unknown => Verdict::Unknown {
                            probing: self.pairs.get(&pair).is_some_and(|ps| ps.probing),
                        },
                        Health::Good(_) => {
                            let (max, sum) = loads.cost(pair);
                            Verdict::Eligible {
                                cost: self.load_per_capacity(x, y, loads.ends(pair), 1, now),
                                key: (max, sum, allowed.rank as u8),
                            }
                        }
                    },
                };
                out.push(Candidate {
                    pair,
                    verdict,
                    topology_unknown,
                });
            }
        }
        out
    }

    /// Lanes that failed over onto local NIC `nic`, which turned out to carry less than it
    /// was weighed by, move to another backup where that lowers their load per capacity by
    /// more than [`REBALANCE_MARGIN`]: one at a time, each move counted before the next is
    /// weighed, so they stop once the NICs are level. Only healthy candidates are taken
    /// (no probing), never the lane's original pair (fail-back owns the way home), and a
    /// lane waiting for a move stays out of it.
    fn rebalance(&mut self, nic: NicId, now: Instant) {
        if !self.config.weighted {
            return;
        }
        let mut loads = self.loads();
        let movable: Vec<(CommId, usize)> = (self.comms.iter())
            .flat_map(|(&id, c)| {
                (c.lanes.iter().enumerate())
                    .filter(|(_, l)| l.state == LaneState::Active && l.current != l.original)
                    .filter(|(_, l)| l.current.local == nic)
                    .map(move |(i, _)| (id, i))
            })
            .filter(|&(id, i)| !self.moves.iter().any(|m| m.comm == id && m.lane.0 == i))
            .collect();
        for (id, i) in movable {
            let c = &self.comms[&id];
            let lane = &c.lanes[i];
            let (here, original) = (lane.current, lane.original);
            let x = c.local.iter().find(|x| x.id == here.local);
            let y = c.remote.iter().find(|y| y.id == here.remote);
            let (Some(x), Some(y)) = (x, y) else {
                continue;
            };
            let cost_here = self.load_per_capacity(x, y, loads.ends(here), 0, now);
            // Chosen as a failover chooses (near-equal costs are ties), among the others.
            let others: Vec<Candidate> = (self.candidates(c, &loads, now).into_iter())
                .filter(|k| k.pair != here && k.pair != original)
                .collect();
            let Some((to, cost)) = self.pick(&others) else {
                continue;
            };
            if cost >= cost_here * (1.0 - REBALANCE_MARGIN) {
                continue;
            }
            self.moves.push_back(Move {
                comm: id,
                lane: LaneId(i),
                from: here,
                to,
                reason: MoveReason::Rebalance,
            });
            self.stats.rebalance_moves += 1;
            loads.remove(here);
            loads.add(to);
            let l = &mut self.comms.get_mut(&id).expect("listed above").lanes[i];
            l.current = to;
        }
    }

    /// The load per unit of capacity of the pair `x`–`y`, whose ends carry `(l, r)` lanes,
    /// with `extra` lanes more: the busier end, each end's lanes divided by what it can
    /// carry. The local end carries its capacity scaled by the PCIe path from the comm's
    /// GPU (an unknown distance weighs as the limit, as it ranks); the remote end its
    /// announced link speed. An end whose capacity is unknown counts as fast as the other
    /// (rail-matched NICs usually are); with `weighted` off every NIC counts alike, and
    /// the cost is the busier end's lane count.
    fn load_per_capacity(
        &self,
        x: &LocalNic,
        y: &RemoteNic,
        (l, r): (u32, u32),
        extra: u32,
        now: Instant,
    ) -> f64 {
        if !self.config.weighted {
            return f64::from(l.max(r) + extra);
        }
        let path = x.distance.or(Some(self.config.distance_limit));
        let remote = (y.speed_mbps.filter(|&m| m > 0)).map(|m| m as f64 * 1e6 / 8.0);
        let local = (self.capacity.weight(x.id, path, now))
            .or(remote.map(|r| r * pcie_factor(path)))
            .unwrap_or_else(|| pcie_factor(path));
        let remote = remote.unwrap_or(local);
        f64::max(f64::from(l + extra) / local, f64::from(r + extra) / remote)
    }

    /// The pair's health as selection sees it at `now`.
    fn health(&self, pair: Pair, loads: &Loads, now: Instant) -> Health {
        let Some(ps) = self.pairs.get(&pair) else {
            return Health::Unknown;
        };
        match ps.health {
            Health::Good(at)
                if loads.pair.contains_key(&pair) || now < at + self.config.health_ttl =>
            {
                ps.health
            }
            Health::Bad(at) if now < at + self.bad_for(ps) => ps.health,
            _ => Health::Unknown,
        }
    }

    /// How long a failure keeps a pair "bad": `health_ttl` after a lane failure, the
    /// re-probe backoff after failed probes.
    fn bad_for(&self, ps: &PairState) -> Duration {
        match ps.failed_probes {
            0 => self.config.health_ttl,
            n => self
                .config
                .retry_base
                .saturating_mul(1u32 << (n - 1).min(16))
                .min(self.config.retry_max),
        }
    }

    /// When a "bad" pair's verdict expires (it is probed again on its next use).
    fn bad_until(&self, pair: Pair) -> Option<Instant> {
        let ps = self.pairs.get(&pair)?;
        match ps.health {
            Health::Bad(at) => Some(at + self.bad_for(ps)),
            _ => None,
        }
    }

    /// The eligible candidate with the least load per unit of capacity; candidates within
    /// [`TOLERANCE`] of that count as equal and are told apart by raw load, then distance
    /// (with equal capacities, exactly the order of load alone); the seeded RNG breaks
    /// remaining ties. Returns the pair and its cost.
    fn pick(&mut self, candidates: &[Candidate]) -> Option<(Pair, f64)> {
        let eligible = |c: &Candidate| match c.verdict {
            Verdict::Eligible { cost, key } => Some((cost, key)),
            _ => None,
        };
        let least = (candidates.iter().filter_map(eligible))
            .map(|(cost, _)| cost)
            .reduce(f64::min)?;
        let near =
            |c: &Candidate| eligible(c).filter(|&(cost, _)| cost <= least * (1.0 + TOLERANCE));
        let best = candidates.iter().filter_map(near).map(|(_, k)| k).min()?;
        let ties: Vec<(Pair, f64)> = candidates
            .iter()
            .filter_map(|c| {
                near(c)
                    .filter(|&(_, k)| k == best)
                    .map(|(cost, _)| (c.pair, cost))
            })
            .collect();
        Some(ties[self.rng.below(ties.len())])
    }

    fn request_probe(&mut self, pair: Pair) {
        let ps = self.pairs.entry(pair).or_default();
        ps.probing = true;
        let retry = ps.failed_probes;
        self.probes.push_back(ProbeRequest { pair, retry });
        self.stats.probes_requested += 1;
    }

    fn loads(&self) -> Loads {
        let mut loads = Loads::default();
        for c in self.comms.values() {
            for l in &c.lanes {
                if l.state == LaneState::Active {
                    loads.add(l.current);
                }
            }
        }
        loads
    }

    /// Comms with a lane away from its original pair: on a backup, or waiting for one.
    /// A count without a snapshot's allocations, cheap enough to take at every metrics
    /// sample.
    pub fn displaced_comms(&self) -> usize {
        (self.comms.values())
            .filter(|c| c.lanes.iter().any(Lane::displaced))
            .count()
    }

    fn displaced_originals(&self) -> BTreeSet<Pair> {
        self.comms
            .values()
            .flat_map(|c| c.lanes.iter())
            .filter(|l| l.displaced())
            .map(|l| l.original)
            .collect()
    }
}

/// Whether the pair has carried traffic since its last fail-back without failing.
fn in_service(ps: &PairState) -> bool {
    match (ps.last_failback, ps.last_failure) {
        (Some(fb), Some(f)) => f < fb,
        (Some(_), None) => true,
        (None, _) => false,
    }
}
