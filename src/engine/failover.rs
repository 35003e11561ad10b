//! The engine's failover duties: noticing a dead lane (silence past the completion
//! timeout, a socket error, the local carrier going down), asking the router where to
//! go, probing candidate pairs, opening replacement lanes and replaying on them, and
//! giving up with a clear error when nothing is left. Policy lives in `routing`; this
//! file only carries out its decisions.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::*;
use crate::conn::health;
use crate::conn::lane::{congested_limit, sample_interval, Cause};
use crate::conn::path::{migration_limit, Loss, Moved, Placed, Replaced};
use crate::conn::wire::{Purpose, STALLED_MEMORY};
use crate::routing::{CommId, CommSpec, End, Event, NicId, PeerId};
use crate::routing::{FailReason, MoveReason};
use crate::telemetry::metrics::{Failback, Failover, GiveUp, NicPair};
use crate::telemetry::sampler::{NicNow, Totals};
use crate::transport::fair::LaneSample;
use crate::transport::verbs::register::USER_REGISTRATIONS;

impl Engine {
    /// A send comm was just connected: tell the router about both NIC lists. `elsewhere`:
    /// why NCCL's pair could not carry the connect, which another pair did.
    pub(super) fn register_route(
        &mut self,
        c: usize,
        nic: usize,
        to: SocketAddr,
        remote: Vec<NicAddr>,
        elsewhere: Option<FailReason>,
        now: Instant,
    ) {
        let peer = match self.peers.iter().position(|p| *p == remote) {
            Some(p) => p,
            None => {
                self.peers.push(remote.clone());
                self.peers.len() - 1
            }
        };
        let Some(remote_idx) = remote.iter().position(|r| r.addr.ip() == to.ip()) else {
            tracing::warn!(
                "railover: the peer's NIC list does not include {to}; this comm cannot fail over"
            );
            return;
        };
        let rails: Vec<_> = self.setup.nics.iter().map(|n| n.rail).collect();
        let remotes: Vec<_> = (remote.iter())
            .map(|r| (r.rail, r.mbps.map(u64::from)))
            .collect();
        let distance = self.setup.distance.get(nic).map_or(&[][..], |d| &d[..]);
        let (local, remote) = (NicId(nic as u32), NicId(remote_idx as u32));
        let peer = PeerId(peer as u32);
        let mut spec = CommSpec::one_lane(peer, &rails, distance, &remotes, (local, remote));
        let stripes = self.stripes();
        spec.lanes = vec![(local, remote); stripes];
        let added = match elsewhere {
            None => self.router.add_comm(CommId(c), spec, now),
            Some(why) => self.router.add_comm_elsewhere(CommId(c), spec, why, now),
        };
        match added {
            Ok(()) => {
                let original = Pair {
                    local,
                    peer,
                    remote,
                };
                let leaving = self.router.drained(original) || elsewhere.is_some();
                let comm = &mut self.comms[c];
                comm.route = Some(Route { peer });
                // A comm connected over another pair starts out as if on NCCL's, which
                // it leaves at once: its stripes go where the router places them, in one
                // move reported as a failover from NCCL's pair, and the lane that carried
                // the handshake is let go.
                comm.path.route(original, stripes);
                if leaving {
                    // The router may probe the candidates before it moves the stripes
                    // off: the first messages wait for that, not cross the drained NIC
                    // (or go out on the handshake's lane, to be replayed after the move).
                    comm.path.handle_leaving(now + 2 * self.setup.probe_timeout);
                }
                self.routes_dirty = true;
            }
            Err(e) => tracing::warn!("railover: comm {c} cannot fail over: {e}"),
        }
    }

    /// How many stripes a send comm is cut into: two per other NIC, so that a failed NIC's
    /// comm spreads over every other NIC, and in halves of a survivor's share where their
    /// capacities differ (one stripe per survivor could only split it evenly or not at all).
    fn stripes(&self) -> usize {
        self.setup
            .stripes
            .unwrap_or(2 * self.setup.nics.len().saturating_sub(1))
            .max(1)
    }

    /// Lane `k` is unusable: let it go and settle whatever depended on it. The one
    /// teardown path, whatever the cause (socket or protocol error, silence, brown-out,
    /// deadline, carrier loss, injected cut).
    pub(super) fn fail_lane(&mut self, k: usize, cause: Cause, now: Instant, io: &mut dyn Io) {
        let Some(lane) = self.lanes.get_mut(k) else {
            return;
        };
        let silent = lane.m.silent(now);
        let role = std::mem::replace(&mut lane.role, Role::Closing);
        // Reset rather than close: a send lane's unacknowledged data is replayed on the
        // next lane (draining it into a sick link would only compete with the probes that
        // test whether it healed), and nothing a replacement lane still holds (a Proof)
        // may reach the receiver later and displace the lane that replaces it.
        let fence = !cause.cut
            && match &role {
                Role::Migrating { .. } => true,
                Role::Comm(c) => self
                    .comms
                    .get(*c)
                    .is_some_and(|m| m.shared.side == Side::Send),
                _ => false,
            };
        if fence {
            io.fence(k);
        }
        let Cause {
            error,
            reason,
            brownout,
            cut,
            ..
        } = cause;
        match role {
            Role::ProbeSink | Role::Closing => {}
            Role::Handshake { .. } => {
                self.stats
                    .rejected_connections
                    .fetch_add(1, Ordering::Relaxed);
                if !matches!(error, ConnError::PeerClosed) {
                    self.turned_away(&format!("dropped before it authenticated: {error}"), now);
                }
            }
            Role::Connecting(mut d) => {
                // The listener dropped us before we authenticated: its handshake caps, or
                // its deadline while it was swamped. A connect that can still make it in
                // time tries again rather than fail NCCL's communicator setup.
                let again = matches!(error, ConnError::PeerClosed)
                    .then(|| d.again(now))
                    .flatten();
                // No answer from the listener's NIC, or a socket error: another same-rail
                // pair may carry it (`rescue`). A listener that answered and refused
                // would refuse on any pair.
                let unreachable = matches!(error, ConnError::Io(_) | ConnError::Stalled(_));
                let time_left = !d.left(now).is_zero();
                match again {
                    Some(at) => {
                        tracing::info!(
                            "railover: connect to {}: the listener dropped attempt {} before it authenticated; trying again",
                            d.to,
                            d.attempt + 1
                        );
                        d.attempt += 1;
                        self.redials.push((at, d));
                    }
                    None if unreachable && time_left && self.next_via(&mut d, reason) => {
                        self.redials.push((now, d));
                    }
                    None => {
                        tracing::warn!("railover: connect failed: {error}");
                        *d.pending.result.lock() = Some(Err(error.into()));
                    }
                }
            }
            Role::Probe { pair, .. } => {
                tracing::debug!("railover: probe of {pair}: {error}");
                self.probe_failed(pair, now);
            }
            Role::Migrating { comm: c, mv } => {
                // A handshake that missed its limit on a path whose lanes the peer keeps
                // acknowledging lost to congestion (a storm of handshakes behind full
                // queues), not to the pair: its stripes are dialled again on the same
                // pair rather than failing the pair under every comm on it.
                let congested = matches!(error, ConnError::Io(_))
                    && reason == FailReason::Timeout
                    && self.pair_delivering(mv.to, now);
                if congested {
                    tracing::info!(
                        "railover: comm {c}: new lane on {} missed its handshake limit on a path that delivers; dialling again",
                        mv.to
                    );
                    let stripes = (self.comms.get_mut(c))
                        .map(|comm| comm.path.handle_opening_failed(k))
                        .unwrap_or_default();
                    self.release_lane(k, cut, io);
                    for lane in stripes {
                        self.start_migration(Move { lane, ..mv }, now, io);
                    }
                    // A new comm's first messages no longer wait (`PathMachine::holding`).
                    if self.comms.contains(c) {
                        self.pump(c);
                    }
                    return;
                }
                tracing::warn!("railover: comm {c}: new lane on {} failed: {error}", mv.to);
                if let Some(comm) = self.comms.get_mut(c) {
                    let stripes = comm.path.handle_opening_failed(k);
                    if matches!(error, ConnError::Gone(_)) {
                        // The receiver failed or closed the comm: no pair can help.
                        self.fail_comm(c, error, io);
                    } else {
                        if let (Some(_), Some(&s)) = (comm.route, stripes.first()) {
                            let _ = self.router.handle_lane_failure(CommId(c), s, reason, now);
                        }
                        self.pump(c);
                    }
                }
            }
            Role::Comm(c) => {
                let receiver = (self.comms.get(c)).is_some_and(|m| m.shared.side == Side::Recv);
                if receiver {
                    if !cut
                        && matches!(
                            error,
                            ConnError::Io(_) | ConnError::Stalled(_) | ConnError::Memory(_)
                        )
                    {
                        let memory = matches!(error, ConnError::Memory(_));
                        self.tell_sender(c, k, memory, io);
                    }
                    // A write in place the sender still has on the way would land after
                    // the replay completed its receive: sealed, the lane takes none.
                    io.seal(k);
                }
                self.release_lane(k, cut, io);
                let comm = &mut self.comms[c];
                let pair = comm.path.carrier(k).and_then(|l| l.pair);
                if let (Some(floor), Some(pair)) = (brownout, pair) {
                    self.router.handle_brownout(pair, floor);
                }
                // The receiver fences its end of the lane before it reads a replay: each
                // lane of the comm (and each that joins) says so ahead of what it carries
                // from now on.
                if comm.shared.side == Side::Send {
                    if let Some(epoch) = comm.path.carrier(k).map(|l| l.epoch) {
                        if comm.fenced.len() == MAX_FENCED {
                            comm.fenced.remove(0);
                        }
                        comm.fenced.push(epoch);
                        comm.fences += 1;
                        let frame = Header::new(Kind::Fence, epoch, 0).encode();
                        for (other, _) in comm.path.lanes() {
                            if let Some(l) = self.lanes.get_mut(other).filter(|_| other != k) {
                                l.writer.push_ctrl(&frame);
                                self.dirty.push(other);
                            }
                        }
                    }
                }
                // What the lane held goes out again on the lanes left.
                let again = comm.machine.handle_lane_down(k);
                comm.replayed += again;
                self.stats
                    .replayed_bytes
                    .fetch_add(again, Ordering::Relaxed);
                self.comm_lane_lost(c, k, pair, (error, reason, silent), now, io);
                return;
            }
        }
        // After the accounting: whoever sees the socket close may read the counters.
        self.release_lane(k, cut, io);
    }

    /// Lets lane `k` go: closed, or after a cut kept open and never served (as a dead
    /// cable leaves it) until the NIC is restored.
    fn release_lane(&mut self, k: usize, cut: bool, io: &mut dyn Io) {
        if !cut {
            self.drop_lane(k, io);
            return;
        }
        self.leave_path(k);
        self.fair.forget(k);
        self.leave_gate(k);
        self.timers.forget(k);
        self.dials.forget(k);
        if let Some(lane) = self.lanes.try_remove(k) {
            self.last_look(lane, k, io);
            io.bury(k);
        }
    }

    /// Local NIC `i` lost its link (carrier, or an injected `cut`): the router stops
    /// using it and every lane on it fails.
    fn nic_lost(&mut self, i: usize, cut: bool, now: Instant, io: &mut dyn Io) {
        self.nic_up[i] = false;
        self.metrics.link(i, false, now);
        self.routes_dirty = true;
        self.router.handle_nic_down(NicId(i as u32), now);
        let name = self.setup.nics[i].name.clone();
        let on_nic: Vec<usize> = self
            .lanes
            .iter()
            .filter(|(_, l)| l.nic == Some(i))
            .map(|(k, _)| k)
            .collect();
        for k in on_nic {
            let error = ConnError::Io(format!("link down on {name}"));
            let cause = Cause {
                cut,
                ..Cause::new(error, FailReason::LinkDown)
            };
            self.fail_lane(k, cause, now, io);
        }
    }

    /// Local NIC `i` has its link again (carrier, or the end of an injected cut).
    fn nic_restored(&mut self, i: usize, now: Instant) {
        self.nic_up[i] = true;
        self.metrics.link(i, true, now);
        self.routes_dirty = true;
        self.router.handle_nic_up(NicId(i as u32), now);
    }

    /// The active lane `k` of comm `c` is gone (already released); it had received
    /// nothing for `silent`. Its path machine says whether to fail over, wait for the
    /// sender's replacement or fail the comm.
    fn comm_lane_lost(
        &mut self,
        c: usize,
        k: usize,
        pair: Option<Pair>,
        (error, reason, silent): (ConnError, FailReason, Duration),
        now: Instant,
        io: &mut dyn Io,
    ) {
        let comm = &mut self.comms[c];
        let peer_gone = matches!(error, ConnError::PeerClosed);
        if matches!(error, ConnError::Protocol(_)) {
            self.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
        } else if !peer_gone {
            self.stats.lane_failures.fetch_add(1, Ordering::Relaxed);
        }
        let routed = comm.route.is_some();
        match comm.path.handle_lane_lost(k, &error, reason, silent, routed, now) {
            Loss::Carry => self.pump(c),
            Loss::Failover(stripe) => {
                tracing::warn!(
                    "railover: comm {c}: lane on {} failed ({}): {error}",
                    pair.map(|p| p.to_string()).unwrap_or_default(),
                    reason.as_str()
                );
                let memory = match &error {
                    ConnError::Memory(_) => Some(End::Local),
                    ConnError::PeerMemory => Some(End::Remote),
                    _ => None,
                };
                let routed = match memory {
                    Some(end) => {
                        self.memory_excluded(c, pair, end);
                        self.router
                            .handle_memory_unreachable(CommId(c), stripe, end, reason, now)
                    }
                    None => self
                        .router
                        .handle_lane_failure(CommId(c), stripe, reason, now),
                };
                if let Err(e) = routed {
                    tracing::warn!("railover: comm {c}: router refused the failure report: {e}");
                }
                self.routes_dirty = true;
                self.pump(c);
            }
            Loss::Wait { path: true, .. } => tracing::warn!("railover: comm {c}: receive lane failed ({}): {error}; waiting for the sender's replacement lane", reason.as_str()),
            Loss::Wait { grace, .. } => tracing::info!(
                "railover: comm {c}: the sender closed the lane; failing in {} ms unless it opens a replacement",
                grace.as_millis()
            ),
            Loss::Fail => {
                if self.comm_busy(c) || !peer_gone {
                    tracing::warn!("railover: comm {c} lost its connection: {error}");
                }
                self.fail_comm(c, error, io);
            }
        }
    }

    /// Whether comm `c` has requests outstanding.
    fn comm_busy(&self, c: usize) -> bool {
        self.comms[c].machine.pending() > 0
    }

    /// Fails every request of comm `c`, now and later.
    pub(super) fn fail_comm(&mut self, c: usize, error: ConnError, io: &mut dyn Io) {
        // A later replacement lane is refused as gone, so its sender fails too.
        self.forget_recv(c, self.comms[c].session.id());
        let comm = &mut self.comms[c];
        comm.shared.set_failed(error.clone().into());
        comm.machine.handle_lane_lost(error);
        let lanes = comm.path.handle_failed();
        let routed = comm.route.take().is_some();
        if routed {
            self.router.remove_comm(CommId(c));
            self.routes_dirty = true;
        }
        for k in lanes {
            self.drop_lane(k, io);
        }
        self.pump(c);
    }

    /// Receive side: the sender opened replacement lane `k`, its attempt `epoch`, for
    /// comm `c`; a stale attempt is refused.
    pub(super) fn attach_replacement(
        &mut self,
        c: usize,
        k: usize,
        epoch: u64,
        now: Instant,
        io: &mut dyn Io,
    ) {
        let comm = &mut self.comms[c];
        let Replaced { outage } = match comm.path.handle_replacement(k, epoch, now) {
            Ok(r) => r,
            Err(e) => return self.refuse(k, &e, now),
        };
        let delivered = comm.machine.replay_point();
        let nic = self.lanes[k].nic.unwrap_or(0);
        comm.shared.moved_to(nic);
        if let Some((after, reason)) = outage {
            tracing::info!(
                "railover: comm {c}: receive lane replaced on NIC {} after {} ms ({})",
                self.setup.nics.get(nic).map_or("?", |n| n.name.as_str()),
                after.as_millis(),
                reason.as_str()
            );
        }
        let _ = io;
        self.carry(k, c);
        let welcome = self.welcome(delivered, self.comms[c].refusing);
        self.lanes[k].writer.push_ctrl(&welcome);
        self.pump(c);
    }

    /// Send side: lane `k`, opened for some of comm `c`'s stripes, was accepted; the
    /// receiver has `delivered` messages, and its NICs `refusing` (a bit per index) cannot
    /// register the comm's memory. It carries its share from now on.
    pub(super) fn finish_migration(
        &mut self,
        c: usize,
        k: usize,
        mv: Move,
        (delivered, refusing): (u64, u32),
        now: Instant,
        io: &mut dyn Io,
    ) -> Result<(), ConnError> {
        let _ = io;
        let Some(comm) = self.comms.get_mut(c) else {
            return Err(ConnError::Protocol("migration for a closed comm".into()));
        };
        // Checked before the lane joins: a refused replay point leaves the comm as it was.
        comm.machine.handle_welcome(delivered).map_err(|e| {
            ConnError::Gone(format!(
                "its replay point does not match this comm ({e}); it must have failed the comm"
            ))
        })?;
        comm.path.handle_moved(k, now);
        for nic in (0..32).filter(|b| refusing & 1 << b != 0) {
            if self.router.handle_remote_unreachable(CommId(c), NicId(nic)) {
                let pair = Pair {
                    remote: NicId(nic),
                    ..mv.to
                };
                self.memory_excluded(c, Some(pair), End::Remote);
            }
        }
        let comm = &mut self.comms[c];
        let local = mv.to.local.0 as usize;
        comm.lazily += comm.shared.moved_to(local);
        for &epoch in &comm.fenced {
            (self.lanes[k].writer).push_ctrl(&Header::new(Kind::Fence, epoch, 0).encode());
        }
        self.carry(k, c);
        self.lanes[k].nic = Some(local);
        self.routes_dirty = true;
        self.settled(c, mv.from, now);
        self.pump(c);
        Ok(())
    }

    /// If comm `c`'s move (off `from`) is complete, logs and records how it ended.
    fn settled(&mut self, c: usize, from: Pair, now: Instant) {
        if let Some(moved) = self.comms[c].path.settle(now) {
            self.report_move(c, from, moved);
        }
    }

    /// Logs and records how comm `c`'s move (off `from`) ended.
    fn report_move(&mut self, c: usize, from: Pair, moved: Moved) {
        let comm = &mut self.comms[c];
        let replayed = std::mem::take(&mut comm.replayed);
        // The pair carrying most of the comm names where it went.
        let to = (comm.path.lanes())
            .filter_map(|(_, l)| l.pair.map(|p| (l.stripes.len(), p)))
            .max_by_key(|&(n, p)| (n, std::cmp::Reverse(p)))
            .map_or(from, |(_, p)| p);
        // Where the move began (the failed pair), not the hop that completed it.
        let from = match moved {
            Moved::Failback { from: Some(f), .. }
            | Moved::Failover { from: Some(f), .. }
            | Moved::Drain { from: Some(f), .. }
            | Moved::Rebalance { from: Some(f), .. } => f,
            _ => from,
        };
        comm.lazily += comm.shared.moved_to(to.local.0 as usize);
        comm.shared.spread_over(comm.path.spread());
        let lazily = std::mem::take(&mut comm.lazily);
        self.draining.push(c);
        let (fl, fr) = self.pair_names(from);
        let (tl, tr) = self.pair_names(to);
        let from = NicPair {
            local: &fl,
            remote: &fr,
        };
        let to = NicPair {
            local: &tl,
            remote: &tr,
        };
        let t = self.setup.telemetry.clone();
        match moved {
            Moved::Failback { away, .. } => {
                let f = Failback {
                    comm: c as u64,
                    from,
                    to,
                    away,
                };
                t.record_failback(&f);
                tracing::warn!("{f} replayed={replayed}B");
            }
            Moved::Drain { switch, spread, .. } => {
                t.record_drain_move(from.local);
                t.record_comm_spread(spread);
                tracing::warn!(
                    "railover: drain comm={c} {from} => {to} switch={:.1}ms spread_over={spread} replayed={replayed}B registered_on_backup={lazily}",
                    switch.as_secs_f64() * 1e3
                );
            }
            Moved::Rebalance { switch, spread, .. } => {
                t.record_rebalance_move(from.local);
                t.record_comm_spread(spread);
                tracing::warn!(
                    "railover: rebalance comm={c} {from} => {to} switch={:.1}ms spread_over={spread} replayed={replayed}B registered_on_backup={lazily}",
                    switch.as_secs_f64() * 1e3
                );
            }
            Moved::Failover {
                reason,
                detection,
                resume,
                spread,
                ..
            } => {
                let f = Failover {
                    comm: c as u64,
                    from,
                    to,
                    reason,
                    detection,
                    resume,
                };
                t.record_failover(&f);
                t.record_comm_spread(spread);
                tracing::warn!(
                    "{f} spread_over={spread} replayed={replayed}B registered_on_backup={lazily}"
                );
            }
        }
    }

    /// Carries out what the router decided: probes, moves, give-ups; publishes routes.
    pub(super) fn drive_router(&mut self, now: Instant, io: &mut dyn Io) {
        while let Some(p) = self.router.poll_probe() {
            self.start_probe(p.pair, p.retry, now, io);
        }
        while let Some(mv) = self.router.poll_move() {
            self.routes_dirty = true;
            self.start_migration(mv, now, io);
        }
        while let Some(ev) = self.router.poll_event() {
            match ev {
                Event::NoEligiblePair {
                    comm,
                    lane,
                    ref exclusions,
                } => {
                    if self.comms.get(comm.0).is_some_and(|c| c.path.has_lane()) {
                        // One stripe is stranded; its share goes over the lanes the comm
                        // still has, and it moves if a pair becomes eligible.
                        tracing::warn!(
                            "railover: {ev}; comm {} carries on over its other lanes",
                            comm.0
                        );
                        continue;
                    }
                    let since = self
                        .comms
                        .get(comm.0)
                        .and_then(|c| c.path.detected())
                        .map_or(0, |(t, _)| now.saturating_duration_since(t).as_millis());
                    tracing::warn!("railover: giving up {since} ms after the failure: {ev}");
                    self.stats.gave_up.fetch_add(1, Ordering::Relaxed);
                    if let Some(cur) = self.router.current_pair(comm, lane) {
                        let (l, r) = self.pair_names(cur);
                        let reason = self.comms[comm.0]
                            .path
                            .detected()
                            .map_or(FailReason::Timeout, |d| d.1);
                        self.setup.telemetry.record_give_up(&GiveUp {
                            comm: comm.0 as u64,
                            failed: NicPair {
                                local: &l,
                                remote: &r,
                            },
                            reason,
                            candidates: exclusions.len(),
                        });
                    }
                    if self.comms.contains(comm.0) {
                        self.fail_comm(
                            comm.0,
                            ConnError::Io(format!("no eligible NIC pair left ({ev})")),
                            io,
                        );
                    }
                }
                Event::TopologyUnknown { .. } => tracing::info!("railover: {ev}"),
            }
        }
        if std::mem::take(&mut self.routes_dirty) {
            // Displacement starts and ends with the router's decisions: counted here it
            // is timed to the turn, not to the next sample.
            let displaced = self.router.displaced_comms() as u64;
            self.metrics.set_displaced(displaced, now);
            let snap = self.router.snapshot();
            self.setup
                .telemetry
                .set_comms_without_backup(crate::telemetry::metrics::comms_without_backup(&snap));
            self.routes.publish(snap);
        }
    }

    /// The first frame of a probe or replacement lane of a comm with `session`.
    fn opener(
        &mut self,
        purpose: Purpose,
        session: &Session,
        epoch: u64,
    ) -> Result<(Initiator, Vec<u8>), ConnError> {
        let random = fresh_random(&mut self.entropy)?;
        Ok(Initiator::resume(
            purpose,
            session,
            epoch,
            self.wire.clone(),
            &random,
        ))
    }

    fn connect_pair(
        &mut self,
        pair: Pair,
        (auth, hello): (Initiator, Vec<u8>),
        role: Role,
        now: Instant,
        limit: Duration,
        io: &mut dyn Io,
    ) -> Option<usize> {
        let local = pair.local.0 as usize;
        let remote = self.remote_addr(pair)?;
        let k = self.lanes.vacant_key();
        // Replacement lanes are paced per NIC (see `dials`); probes are not.
        let paced = matches!(role, Role::Migrating { .. });
        let queued = paced && !self.dials.may_dial(local);
        if !queued {
            if let Err(e) = io.connect(k, local, remote) {
                tracing::debug!("railover: cannot open {pair}: {e}");
                return None;
            }
        }
        // A queued lane's handshake limit starts when it is dialled; until then only the
        // bound on any connect holds.
        self.add_lane(k, role, now, if queued { HANDSHAKE_TIMEOUT } else { limit });
        let lane = &mut self.lanes[k];
        lane.nic = Some(local);
        lane.remote = Some(remote.ip());
        lane.m.connecting(auth, hello);
        if queued {
            lane.queued = Some(Queued { to: remote, limit });
            self.dials.wait(local, k);
        } else {
            if paced {
                self.dials.dialled(local, k);
            }
            self.dirty.push(k);
        }
        Some(k)
    }

    /// Dials the queued replacement lanes whose NIC has a handshake slot free again.
    pub(super) fn dial_queued(&mut self, now: Instant, io: &mut dyn Io) {
        if self.dials.is_idle() {
            return;
        }
        let (lanes, comms) = (&self.lanes, &self.comms);
        let comm_of = |k: usize| match lanes.get(k).map(|l| &l.role) {
            Some(Role::Migrating { comm, .. }) => Some(*comm),
            _ => None,
        };
        // A lane is its comm's only way back when the comm has no lane up and none of its
        // lanes is in its handshake.
        let first = |k: usize, dialled: &std::collections::BTreeSet<(usize, usize)>| {
            comm_of(k).is_some_and(|c| {
                !comms.get(c).is_some_and(|m| m.path.has_lane())
                    && !dialled.iter().any(|&(_, d)| comm_of(d) == Some(c))
            })
        };
        let due = self.dials.turn(|k| comm_of(k).is_some(), first);
        for (nic, k) in due {
            let Some(q) = self.lanes.get(k).and_then(|l| l.queued) else {
                continue;
            };
            debug_assert_eq!(
                self.lanes[k].nic,
                Some(nic),
                "lane {k} dialled from another NIC"
            );
            match io.connect(k, nic, q.to) {
                Ok(()) => {
                    let lane = &mut self.lanes[k];
                    lane.queued = None;
                    lane.m.expect_by(now + q.limit);
                    self.rearm(k);
                    self.dirty.push(k);
                }
                Err(e) => self.fail_lane(k, Cause::error(io_error(&e)), now, io),
            }
        }
    }

    fn start_probe(&mut self, pair: Pair, retry: u32, now: Instant, io: &mut dyn Io) {
        // A probe proves the session of any live comm to that peer.
        let hello = self
            .comms
            .iter()
            .find(|(_, c)| c.route.is_some_and(|r| r.peer == pair.peer))
            .map(|(_, c)| c.session.clone());
        let hello = hello.and_then(|session| self.opener(Purpose::Probe, &session, 0).ok());
        let Some(hello) = hello else {
            self.probe_failed(pair, now);
            return;
        };
        let limit = self.probe_deadline(pair.local.0 as usize, retry, now, io);
        tracing::debug!("railover: probe of {pair} sent, deadline {limit:?}");
        let role = Role::Probe { pair, started: now };
        // The payload (sent after the Proof, see `challenge`) must cross within the
        // deadline: connecting is not enough (a browned-out link still connects).
        if self
            .connect_pair(pair, hello, role, now, limit, io)
            .is_none()
        {
            self.probe_failed(pair, now);
        }
    }

    /// The deadline of a probe through local NIC `nic`: the probe waits behind what the
    /// NIC's lanes have queued in the kernel, at the rate the NIC has been delivering, and
    /// for reactor turns as late as ours have lately been.
    fn probe_deadline(&self, nic: usize, retry: u32, now: Instant, io: &dyn Io) -> Duration {
        let queued: u64 = self
            .lanes
            .iter()
            .filter(|(_, l)| l.nic == Some(nic) && matches!(l.role, Role::Comm(_)))
            .map(|(k, _)| {
                let p = io.progress(k);
                p.sent.saturating_sub(p.acked)
            })
            .sum();
        health::probe_deadline(
            self.setup.probe_timeout,
            retry,
            queued,
            self.setup.probe_bytes,
            self.fair.capacity(nic),
            self.lateness.recent(now),
        )
    }

    /// A probe's payload crossed within its deadline. A slow link still passes a
    /// deadline (and a tbf-like shaper lets a burst through at full speed), so the router,
    /// which knows the pairs that failed by browning out, judges the rate too.
    pub(super) fn probe_answered(&mut self, pair: Pair, started: Instant, now: Instant) {
        let took = now.saturating_duration_since(started);
        tracing::debug!("railover: probe of {pair} answered in {took:?}");
        let rate = health::probe_rate(self.setup.probe_bytes, took);
        match self.router.check_probe_rate(pair, rate) {
            Ok(()) => self.router.handle_probe(pair, true, now),
            Err(floor) => {
                tracing::debug!(
                    "railover: probe of {pair}: {:.0} kB/s, below the {:.0} kB/s it must show after its brown-out",
                    rate / 1e3,
                    floor / 1e3
                );
                self.probe_failed(pair, now);
            }
        }
    }

    /// A probe of `pair` did not pass. It is evidence against the pair only if the pair's
    /// own traffic is not evidence for it: a probe that lost to a storm of handshakes or
    /// a congested link, on a path whose lanes the peer acknowledged within the
    /// completion timeout, says nothing about the path (unless it browned out, when only
    /// a probe at its floor counts).
    pub(super) fn probe_failed(&mut self, pair: Pair, now: Instant) {
        if self.pair_delivering(pair, now) && !self.router.browned_out(pair) {
            tracing::debug!("railover: probe of {pair} missed, but its lanes deliver: healthy");
            self.router.handle_probe(pair, true, now);
            return;
        }
        tracing::debug!("railover: probe of {pair} failed");
        self.metrics.probe_failed(pair.local.0 as usize);
        self.router.handle_probe(pair, false, now);
    }

    /// Whether the peer acknowledged bytes sent over `pair`'s path within the
    /// completion timeout.
    pub(super) fn pair_delivering(&self, pair: Pair, now: Instant) -> bool {
        let delivered = (self.remote_addr(pair))
            .and_then(|a| self.paths.last_delivered((pair.local.0 as usize, a.ip())));
        delivered.is_some_and(|t| now.saturating_duration_since(t) < self.setup.completion_timeout)
    }

    /// Carries out the router's move of one stripe of a comm: onto a lane the comm already
    /// has on that pair, onto one being opened there, or onto a new lane.
    fn start_migration(&mut self, mv: Move, now: Instant, io: &mut dyn Io) {
        let c = mv.comm.0;
        let Some(comm) = self.comms.get_mut(c) else {
            return;
        };
        let left = (comm.path.lanes())
            .find(|(_, l)| l.stripes.contains(&mv.lane))
            .map(|(k, _)| k);
        let (placed, abandoned) = comm.path.handle_move(mv.lane, mv.to, mv.reason, now);
        if let Some(failover) = comm.path.take_interrupted() {
            self.report_move(c, mv.from, failover);
        }
        if let Some(old) = abandoned {
            if self.lanes.contains(old) {
                io.fence(old);
            }
            self.drop_lane(old, io);
        }
        // The stripe left a lane, which may now have nothing to carry: on a healthy pair
        // (a fail-back) it drains and retires; on a failed pair what it holds may never
        // arrive (a brown-out, a one-way failure under another comm), so it is let go
        // now and what it held goes out again on the comm's other lanes.
        self.draining.push(c);
        if let (MoveReason::Failover(reason), Some(k)) = (mv.reason, left) {
            let idle = self.comms[c]
                .path
                .carrier(k)
                .is_some_and(|l| l.stripes.is_empty());
            if idle && self.lanes.contains(k) {
                let e = ConnError::Io(format!("its pair {} failed", mv.from));
                self.fail_lane(k, Cause::new(e, reason), now, io);
            }
        }
        let epoch = match placed {
            Placed::Waiting(_) => return,
            Placed::Joined(_) => {
                self.settled(c, mv.from, now);
                self.pump(c);
                return;
            }
            Placed::Open { epoch } => epoch,
        };
        let session = self.comms[c].session.clone();
        let hello = self.opener(Purpose::Migrate, &session, epoch);
        let limit = migration_limit(self.setup.completion_timeout, self.setup.probe_timeout);
        let role = Role::Migrating { comm: c, mv };
        match hello.map(|h| self.connect_pair(mv.to, h, role, now, limit, io)) {
            Ok(Some(k)) => self.comms[c].path.handle_opening(k, mv.to, mv.lane, epoch),
            _ => {
                let _ = self
                    .router
                    .handle_lane_failure(CommId(c), mv.lane, FailReason::Probe, now);
            }
        }
    }

    /// Applies the NICs' fair shares (see `transport::fair`) to the lanes as pacing caps.
    fn pace(&mut self, shares: &[LaneSample], now: Instant, io: &mut dyn Io) {
        if !self.setup.fair_share {
            return;
        }
        let sampled = self.fair.sample(now, shares);
        for n in sampled.held_off {
            tracing::info!(
                "railover: {}: pacing caps left the NIC underused (another bottleneck?); uncapped for a while",
                self.setup.nics[n].name
            );
        }
        for (k, cap) in sampled.changes {
            if self.lanes.contains(k) {
                if let Err(e) = io.set_pacing(k, cap) {
                    tracing::debug!("railover: pacing lane {k}: {e}");
                }
            }
        }
    }

    /// Tells the router what each local NIC delivered since the last sample and whether it
    /// was saturated (most of its bytes came from lanes with data waiting throughout), so
    /// that backups are weighed by what they showed they can carry.
    fn weigh_nics(&mut self, shares: &[LaneSample], now: Instant) {
        let mut nics = vec![(0u64, 0u64); self.setup.nics.len()];
        for s in shares {
            if let Some((bytes, waiting)) = nics.get_mut(s.nic) {
                *bytes += s.bytes;
                if s.backlogged {
                    *waiting += s.bytes;
                }
            }
        }
        for (i, (bytes, waiting)) in nics.into_iter().enumerate() {
            let saturated = bytes > 0 && 2 * waiting >= bytes;
            let nic = NicId(i as u32);
            if self.router.handle_nic_sample(nic, bytes, saturated, now) {
                let mbit = self.router.capacity(nic, now).unwrap_or(0.0) * 8.0 / 1e6;
                tracing::info!(
                    "railover: {} carries about {mbit:.0} Mbit/s while backed up; backups are weighed by that now",
                    self.setup.nics[i].name
                );
            }
        }
    }

    /// A lane's machine condemned it (silence, brown-out, a deadline).
    pub(super) fn lane_condemned(&mut self, k: usize, cause: Cause, now: Instant, io: &mut dyn Io) {
        if let (Some(Role::Comm(c)), Some(silent)) =
            (self.lanes.get(k).map(|l| &l.role), cause.silent)
        {
            let c = *c;
            self.comms[c].path.handle_silence(silent);
        }
        self.fail_lane(k, cause, now, io);
    }

    /// Comm `c`'s lane on `pair` failed because the NIC at `end` cannot register the
    /// comm's memory: said and counted; the router leaves that NIC out for the comm.
    fn memory_excluded(&mut self, c: usize, pair: Option<Pair>, end: End) {
        let Some(pair) = pair else {
            return;
        };
        let nic = match end {
            End::Local => self.setup.nics[pair.local.0 as usize].name.clone(),
            End::Remote => format!("peer{}/nic{}", pair.peer.0, pair.remote.0),
        };
        tracing::warn!(
            "railover: comm {c}: {nic} cannot register the comm's memory (GPU memory out of its reach?); the comm leaves it for the next candidate pair"
        );
        self.stats.memory_exclusions.fetch_add(1, Ordering::Relaxed);
        self.setup.telemetry.record_memory_exclusion(&nic);
    }

    /// A receiver lets lane `k` of comm `c` go for a path failure: it tells the sender
    /// first (`memory`: because our NIC cannot register the comm's memory). In a one-way
    /// failure the sender still hears us and would otherwise never notice; after a short
    /// carrier flap it would read only our close and take the comm for ended. Best
    /// effort, one small write, before the close.
    fn tell_sender(&mut self, c: usize, k: usize, memory: bool, io: &mut dyn Io) {
        let lane = &mut self.lanes[k];
        let why = if memory { STALLED_MEMORY } else { 0 };
        if memory {
            if let (Some(n @ 0..32), Some(comm)) = (lane.nic, self.comms.get_mut(c)) {
                comm.refusing |= 1 << n;
            }
            let nic = (lane.nic.and_then(|n| self.setup.nics.get(n)))
                .map_or("this lane's NIC", |n| n.name.as_str());
            tracing::warn!(
                "railover: comm {c}: {nic} cannot register the comm's receive buffers (GPU memory out of its reach?); the sender is told to leave it out"
            );
        }
        // Offers still queued would go first, and one this NIC cannot register would fail
        // the write again before the Stalled is out.
        lane.writer.drop_offers();
        lane.writer
            .push_ctrl(&Header::new(Kind::Stalled, 0, why).encode());
        let _ = io.write(k, &mut lane.writer);
    }

    /// Periodic work: lane timers (silence, keepalives), delivery samples (brown-outs,
    /// fair shares), stranded receivers.
    pub(super) fn tick(&mut self, now: Instant, io: &mut dyn Io) {
        self.next_tick = now + sample_interval(self.setup.completion_timeout);
        if let Some(horizon) = now.checked_sub(congested_limit(self.setup.completion_timeout)) {
            self.paths.forget_before(horizon);
        }
        self.expire(now, io);
        let mut dead = Vec::new();
        let mut shares: Vec<LaneSample> = Vec::new();
        // Only lanes that wrote or had bytes waiting: an idle lane has nothing to show
        // (its first sample after it writes again sees nothing backlogged, as it would
        // have here). A paced lane stays, so its cap is released in turn.
        let mut sampling = std::mem::take(&mut self.sampling);
        // A key can be listed twice: a lane that left the list's care (it was dropped)
        // and a new lane filed under its key. Sampled twice, its bytes would count
        // twice in its NIC's fair shares.
        sampling.sort_unstable();
        sampling.dedup();
        sampling.retain(|&k| {
            let Some(lane) = self.lanes.get_mut(k) else {
                return false;
            };
            let Role::Comm(c) = lane.role else {
                lane.sampling = false;
                return false;
            };
            // A lane's pacing share is the stripes it carries of its comm.
            let weight = (self.comms.get(c))
                .and_then(|m| m.path.carrier(k))
                .map_or(1, |l| l.stripes.len().max(1) as u32);
            // Delivery progress: what the peer has acknowledged. A large socket buffer
            // can hold every byte in flight, so the userspace queue alone would not show
            // a stuck path.
            let p = io.progress(k);
            self.metrics.placed(lane.nic, &mut lane.placed, p.placed);
            let waiting = lane.writer.queued_bytes() + p.sent.saturating_sub(p.acked);
            lane.m.handle_path_slow(self.paths.slow(lane.path()));
            let s = lane.m.handle_sample(now, p.acked, waiting);
            if let Some(path) = lane.path() {
                self.paths.sampled(path, s.moved, s.backlogged);
                if s.moved > 0 {
                    self.paths.delivered(path, now);
                }
            }
            if let Some(nic) = lane.nic {
                shares.push(LaneSample {
                    key: k,
                    nic,
                    bytes: s.moved,
                    backlogged: s.backlogged,
                    weight,
                });
            }
            dead.extend(lane.m.poll_failure().map(|c| (k, c)));
            lane.sampling = s.moved > 0 || waiting > 0 || self.fair.cap(k).is_some();
            lane.sampling
        });
        self.sampling = sampling;
        self.paths.end_sample(now);
        self.pace(&shares, now, io);
        self.weigh_nics(&shares, now);
        for (k, cause) in dead {
            self.lane_condemned(k, cause, now, io);
        }
        // One pass over the comms for their path timers. A new comm on a drained pair whose
        // stripes the router did not move in time: its first messages go out on the lane
        // it has. A receiver whose sender never came back: the peer is gone or has no pair
        // left.
        let nic_up = self.nic_up.iter().any(|&up| up);
        let (mut released, mut abandoned) = (Vec::new(), Vec::new());
        for (c, comm) in self.comms.iter_mut() {
            if comm.path.handle_hold_timeout(now) {
                released.push(c);
            }
            if let Some(gone) = comm.path.handle_timeout(now, nic_up) {
                abandoned.push((c, gone));
            }
        }
        for c in released {
            self.pump(c);
        }
        for (c, gone) in abandoned {
            if self.comm_busy(c) || !matches!(gone.error, ConnError::PeerClosed) {
                tracing::warn!(
                    "railover: comm {c}: no replacement lane arrived in time; failing its receives: {}",
                    gone.error
                );
            }
            if gone.path {
                self.stats.gave_up.fetch_add(1, Ordering::Relaxed);
            }
            self.fail_comm(c, gone.error, io);
        }
    }

    /// The local NIC called `name`, if it is one of ours.
    pub fn nic_named(&self, name: &str) -> Option<usize> {
        self.setup.nics.iter().position(|n| n.name == name)
    }

    /// Local NIC `i`'s carrier is now `up` (a netlink event, or the simulation's).
    pub fn carrier(&mut self, i: usize, up: bool, now: Instant, io: &mut dyn Io) {
        if self.nic_up[i] == up {
            return;
        }
        self.stats.link_events.fetch_add(1, Ordering::Relaxed);
        let name = &self.setup.nics[i].name;
        if up {
            tracing::warn!("railover: NIC {name} is up again");
            self.nic_restored(i, now);
        } else {
            tracing::warn!("railover: NIC {name} lost its link");
            self.nic_lost(i, false, now, io);
        }
    }

    /// Sends the counters gathered since the last sample to the metrics registry.
    pub(super) fn sample_metrics(&mut self, now: Instant) {
        let router = &self.router;
        let mut nics: Vec<NicNow> = (self.setup.nics.iter().zip(&self.nic_up))
            .zip(&self.drained)
            .enumerate()
            .map(|(i, ((n, &up), hold))| NicNow {
                name: &n.name,
                rail: n.rail,
                up,
                drained: hold.any(),
                capacity: router.capacity(NicId(i as u32), now).map(|c| c as u64),
                lanes: 0,
                paced_lanes: 0,
            })
            .collect();
        for (k, l) in self.lanes.iter() {
            if let (Role::Comm(_), Some(n)) = (&l.role, l.nic.and_then(|n| nics.get_mut(n))) {
                n.lanes += 1;
                n.paced_lanes += u64::from(self.fair.cap(k).is_some());
            }
        }
        let st = &self.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let totals = Totals {
            replayed_bytes: load(&st.replayed_bytes),
            duplicates: load(&st.duplicates),
            rejected_connections: load(&st.rejected_connections),
            refused_handshakes: load(&st.refused_handshakes),
            handshakes_pending: load(&st.handshakes_pending),
            protocol_errors: load(&st.protocol_errors),
            lane_failures: load(&st.lane_failures),
            unmatched_sends: crate::handoff::comm::UNMATCHED_SENDS.load(Ordering::Relaxed),
            gave_up: load(&st.gave_up),
            link_events: load(&st.link_events),
            memory_registrations: USER_REGISTRATIONS.load(Ordering::Relaxed),
        };
        // Some router changes (a probe's answer, its timers) publish no routes of their
        // own; counted again here, they are late by one sample at most. Those come with
        // the router's timers, and every move is counted where it publishes: a router
        // with nothing displaced and no timer has nothing to recount, and at thousands of
        // comms the count is a look at every stripe, ten times a second.
        if self.metrics.displaced_comms() != 0 || self.router.poll_timeout().is_some() {
            let displaced = self.router.displaced_comms() as u64;
            self.metrics.set_displaced(displaced, now);
        }
        let t = &self.setup.telemetry;
        self.metrics.sample(t, now, &nics, &totals);
    }

    /// "eth0->peer0/nic1"-style names for a pair, as the metrics and logs show them.
    pub(super) fn pair_names(&self, p: Pair) -> (String, String) {
        let local = self
            .setup
            .nics
            .get(p.local.0 as usize)
            .map_or_else(|| format!("nic{}", p.local.0), |n| n.name.clone());
        let remote = self.remote_addr(p).map_or_else(
            || format!("peer{}/nic{}", p.peer.0, p.remote.0),
            |a| a.ip().to_string(),
        );
        (local, remote)
    }

    /// Where pair `p`'s peer NIC listens, as its handshake told us.
    fn remote_addr(&self, p: Pair) -> Option<SocketAddr> {
        let nic = self
            .peers
            .get(p.peer.0 as usize)?
            .get(p.remote.0 as usize)?;
        Some(nic.addr)
    }

    /// Fault injection: NIC `i` is cut or restored. A cut fails its lanes through the one
    /// teardown path, as a carrier loss would, but keeps their sockets open and silent:
    /// the peer must detect the silence, as with a pulled cable.
    pub fn inject_link(&mut self, i: usize, up: bool, now: Instant, io: &mut dyn Io) {
        let Some(down) = self.injected_down.get_mut(i) else {
            return;
        };
        if *down != up {
            return;
        }
        *down = !up;
        let name = &self.setup.nics[i].name;
        if up {
            tracing::warn!("railover: NIC {name} restored (fault injection)");
            io.unbury();
            self.nic_restored(i, now);
        } else {
            tracing::warn!("railover: NIC {name} cut (fault injection)");
            self.nic_lost(i, true, now, io);
        }
    }
}
