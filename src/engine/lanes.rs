//! Lanes from their first byte to a comm: accepting under the handshake caps, reading
//! items into the lane machines, and the handshake dispatch (Hello, Proof, Welcome) that
//! turns a lane into a comm, a probe's answer or a comm's replacement lane.

use super::*;
use crate::conn::auth::{AuthError, Secret};
use crate::conn::comm::Heard;
use crate::conn::lane::Step;
use crate::conn::path::Timeouts;
use crate::conn::wire::{Purpose, Welcome};
use crate::routing::FailReason;

impl Engine {
    /// The key the next lane will have: the reactor files an accepted socket under it
    /// before [`Engine::accepted`].
    pub fn next_lane(&self) -> usize {
        self.lanes.vacant_key()
    }

    /// Whether local NIC `nic` is cut by fault injection (it answers nothing).
    pub fn nic_cut(&self, nic: usize) -> bool {
        self.injected_down.get(nic).copied().unwrap_or(false)
    }

    /// Whether the reactor may accept a connection waiting on its listener `listener`
    /// now. Idle connections past their grace may be dropped to make room; without room
    /// the connection stays in the kernel's backlog until a handshake ends
    /// ([`gate`]'s rules).
    pub fn may_accept(&mut self, listener: usize, now: Instant, io: &mut dyn Io) -> bool {
        let room = self.gate.room(listener, now);
        for (t, old) in room.evict {
            self.evict(t, old, now, io);
        }
        room.ok
    }

    /// Lane `k` (filed under [`Engine::next_lane`]) was accepted on the reactor's
    /// listener `listener` (NCCL's listen `id`, or `None` for a failover listener), on
    /// local NIC `nic`, after [`Engine::may_accept`]. It enters the handshake gate, and
    /// its Hello is read at once.
    pub fn accepted(
        &mut self,
        k: usize,
        listener: usize,
        id: Option<u64>,
        nic: Option<usize>,
        now: Instant,
        io: &mut dyn Io,
    ) {
        // A lane its fabric is still setting up (a verbs QP: a device context, memory
        // registration and a round trip of QP numbers) gets as long as our own connects
        // do for that part; the pre-authentication deadline starts when it is ready.
        let setting_up = !io.ready(k);
        let deadline = if setting_up {
            HANDSHAKE_TIMEOUT
        } else {
            preauth_deadline(self.setup.completion_timeout)
        };
        self.add_lane(k, Role::Handshake { listener: id }, now, deadline);
        let ticket = self.gate.admit(k, listener, now);
        let remote = io.peer(k);
        let lane = &mut self.lanes[k];
        lane.nic = nic;
        lane.remote = remote;
        lane.setting_up = setting_up;
        lane.m.listening();
        lane.ticket = Some(ticket);
        let st = &self.stats;
        st.handshakes_pending
            .store(self.gate.len() as u64, Ordering::Relaxed);
        st.handshakes_peak
            .store(self.gate.peak() as u64, Ordering::Relaxed);
        // A connector writes its Hello at once: reading it now vouches for a real
        // handshake before the next accept asks the gate for room.
        self.service_lane(k, now, io);
    }

    /// Out of descriptors: drops the oldest connection that has not presented a usable
    /// Hello, if any.
    pub fn evict_oldest(&mut self, now: Instant, io: &mut dyn Io) -> bool {
        let Some((t, old)) = self.gate.oldest_idle() else {
            return false;
        };
        self.evict(t, old, now, io);
        true
    }

    /// Drops lane `k`, still in its handshake under `ticket`, to keep the caps.
    fn evict(&mut self, ticket: u64, k: usize, now: Instant, io: &mut dyn Io) {
        // The gate already let it go; the lane must still be the one it admitted.
        match self.lanes.get_mut(k) {
            Some(l) if l.ticket == Some(ticket) => l.ticket = None,
            _ => return,
        }
        self.stats
            .rejected_connections
            .fetch_add(1, Ordering::Relaxed);
        self.stats
            .evicted_handshakes
            .fetch_add(1, Ordering::Relaxed);
        self.drop_lane(k, io);
        self.turned_away(
            "too many idle connections in their handshake; dropped the oldest idle one",
            now,
        );
    }

    /// Logs a connection turned away before it authenticated: the first of a burst at
    /// once, the rest as a count every `gate::LOG_INTERVAL`.
    pub fn turned_away(&mut self, what: &str, now: Instant) {
        if let Some(line) = self.turned_away.hit(now, what) {
            tracing::warn!("railover: turned away an incoming connection: {line}");
        }
    }

    pub(super) fn add_lane(&mut self, k: usize, role: Role, now: Instant, limit: Duration) {
        self.timers.forget(k);
        let entry = self.lanes.vacant_entry();
        debug_assert_eq!(entry.key(), k, "a lane filed under another key");
        entry.insert(Lane {
            reader: FrameReader::default(),
            writer: FrameWriter::default(),
            role,
            m: LaneMachine::new(self.setup.completion_timeout, now, limit),
            ticket: None,
            nic: None,
            remote: None,
            queued: None,
            setting_up: false,
            placed: LanePlaced::default(),
            joined: false,
            sampling: false,
        });
        self.rearm(k);
    }

    pub(super) fn drop_lane(&mut self, k: usize, io: &mut dyn Io) {
        self.leave_path(k);
        self.fair.forget(k);
        self.leave_gate(k);
        self.timers.forget(k);
        self.dials.forget(k);
        if let Some(lane) = self.lanes.try_remove(k) {
            self.last_look(lane, k, io);
            io.close(k);
        }
    }

    /// Counts what lane `k`, just taken off the books, wrote in place since the last
    /// tick: its fabric still holds it, and forgets it at the close.
    pub(super) fn last_look(&mut self, mut lane: Lane, k: usize, io: &dyn Io) {
        let placed = io.progress(k).placed;
        self.metrics.placed(lane.nic, &mut lane.placed, placed);
    }

    /// Lane `k` no longer counts against the handshake caps.
    pub(super) fn leave_gate(&mut self, k: usize) {
        if let Some(t) = self.lanes.get_mut(k).and_then(|l| l.ticket.take()) {
            self.gate.leave(t);
            self.stats
                .handshakes_pending
                .store(self.gate.len() as u64, Ordering::Relaxed);
        }
    }

    /// Lane `k` is readable (or was left with reading to do): reads everything it has,
    /// feeding the machines; then queues its output.
    pub fn service_lane(&mut self, k: usize, now: Instant, io: &mut dyn Io) {
        self.read_lane(k, now, io);
        // What it read may have given its machine a nearer deadline (a linger, a probe's).
        self.rearm(k);
    }

    fn read_lane(&mut self, k: usize, now: Instant, io: &mut dyn Io) {
        // A service starts: a readiness edge or a retry. What the last one's reads found
        // (an empty socket) no longer holds.
        if let Some(lane) = self.lanes.get_mut(k) {
            lane.reader.forget_drained();
        }
        loop {
            let Some(lane) = self.lanes.get_mut(k) else {
                return;
            };
            let before = lane.reader.total_read();
            let got = io.read(k, &mut lane.reader);
            if lane.reader.total_read() != before {
                lane.m.handle_rx(now);
                // A stranger's bytes say nothing about our peer's path.
                if let (Some(path), false) =
                    (lane.path(), matches!(lane.role, Role::Handshake { .. }))
                {
                    self.paths.heard(path, now);
                }
            }
            if lane.setting_up && io.ready(k) {
                // Set up: the peer now has the usual time to say who it is (armed when
                // the read is done, see `service_lane`).
                lane.setting_up = false;
                lane.m
                    .expect_by(now + preauth_deadline(self.setup.completion_timeout));
            }
            match got {
                Ok(Some(item)) => {
                    if let Err(e) = self.inbound(k, item, now, io) {
                        self.fail_lane(k, Cause::error(e), now, io);
                        return;
                    }
                    if let Some(lane) = self.lanes.get_mut(k) {
                        lane.sync();
                    }
                }
                Ok(None) => {
                    if lane.reader.wants_more() {
                        self.again.push(k);
                    }
                    break;
                }
                Err(e) => {
                    let e = match e {
                        ReadError::Io(e) => io_error(&e),
                        ReadError::Wire(e) => ConnError::Protocol(e.to_string()),
                    };
                    self.fail_lane(k, Cause::error(e), now, io);
                    return;
                }
            }
        }
        self.dirty.push(k);
    }

    /// One item from lane `k`: its machine says what it means, the engine acts on it.
    fn inbound(
        &mut self,
        k: usize,
        item: Inbound,
        now: Instant,
        io: &mut dyn Io,
    ) -> Result<(), ConnError> {
        let lane = &mut self.lanes[k];
        let (step, body) = match &item {
            Inbound::Frame(h, body) => (
                lane.m.handle_frame(h, body, self.setup.probe_bytes)?,
                &body[..],
            ),
            Inbound::Data { .. } => (lane.m.handle_payload(false, now)?, &[][..]),
            Inbound::PayloadDone { .. } => (lane.m.handle_payload(true, now)?, &[][..]),
            Inbound::Eof => return Err(ConnError::PeerClosed),
        };
        match (step, &lane.role) {
            (Step::Handled, _) => Ok(()),
            (Step::Discard, _) => {
                lane.reader.place(None);
                Ok(())
            }
            (Step::Hello, &Role::Handshake { listener }) => self.hello(k, listener, body, now),
            (Step::Proof, _) => self.proof(k, body, now, io),
            (Step::ProbeCrossed, _) => {
                let welcome = Welcome {
                    nics: self.wire.clone(),
                };
                lane.writer.push_ctrl(&welcome.encode(0));
                lane.role = Role::Closing;
                Ok(())
            }
            (Step::Welcomed { nics, session, .. }, Role::Connecting(d)) => {
                let (pending, nic, to, via) = (d.pending.clone(), d.nic, d.to, d.via);
                let session = session
                    .ok_or_else(|| ConnError::Protocol("the handshake agreed no session".into()))?;
                let shared = self.new_comm(Side::Send, k, nic, session);
                if let Some(v) = via {
                    tracing::warn!(
                        "railover: comm {} connected to {to} over NIC {}->{} ({:?} on NCCL's NIC {nic}); it moves home when that pair heals",
                        shared.key,
                        v.local,
                        v.to,
                        v.why
                    );
                }
                self.register_route(shared.key, nic, to, nics, via.map(|v| v.why), now);
                *pending.result.lock() = Some(Ok(shared));
                Ok(())
            }
            (Step::Welcomed { .. }, &Role::Probe { pair, started }) => {
                lane.role = Role::Closing;
                lane.m.linger(now);
                self.probe_answered(pair, started, now);
                Ok(())
            }
            (
                Step::Welcomed {
                    delivered,
                    refusing,
                    ..
                },
                &Role::Migrating { comm, mv },
            ) => self.finish_migration(comm, k, mv, (delivered, refusing), now, io),
            (Step::Comm, &Role::Comm(c)) => {
                match self.comm_inbound(c, k, item)? {
                    Took::Item => {}
                    Took::Retired => {
                        // Retired by the sender: its share moved to the comm's other lanes.
                        self.linger(k, now);
                        self.comms[c].machine.handle_lane_down(k);
                    }
                    Took::Drained(mask) => self.peer_drained(c, mask, now),
                    Took::Fence(gone) => {
                        // Fenced before anything behind the Fence on this lane is read:
                        // nothing the given-up lane still carries can land after it.
                        tracing::info!("railover: comm {c}: the sender gave up a lane; fenced this end of it before the replay");
                        io.fence(gone);
                        let cause = Cause::new(ConnError::PeerClosed, FailReason::NicError);
                        self.fail_lane(gone, cause, now, io);
                    }
                }
                self.pump(c);
                Ok(())
            }
            (step, role) => Err(ConnError::Protocol(format!(
                "{step:?} on a lane in {role:?}"
            ))),
        }
    }

    /// Our `Welcome`, acknowledging `delivered` messages, naming our NICs that cannot
    /// register the comm's memory (`refusing`, a bit per index); then, while any of our
    /// NICs is drained, a `Drained` frame naming them, so a new lane's sender leaves them
    /// at once.
    pub(super) fn welcome(&self, delivered: u64, refusing: u32) -> Vec<u8> {
        let mut bytes = Welcome {
            nics: self.wire.clone(),
        }
        .encode_refusing(delivered, refusing);
        if self.drained_mask() != 0 {
            bytes.extend_from_slice(&self.drained_frame());
        }
        bytes
    }

    /// One item of comm `c` from its lane `k`.
    fn comm_inbound(&mut self, c: usize, k: usize, item: Inbound) -> Result<Took, ConnError> {
        let comm = &mut self.comms[c];
        match item {
            Inbound::Frame(h, _) => match comm.machine.handle_frame(&h)? {
                Heard::Cts {
                    seq,
                    capacity,
                    group,
                } => {
                    if Group::in_place(&h) {
                        // Remember it before NCCL's `isend` can match a send to it.
                        comm.in_place.insert(seq);
                        let keep = seq.saturating_sub(super::IN_PLACE_KEPT);
                        comm.in_place = comm.in_place.split_off(&keep);
                    }
                    comm.shared.announce(seq, capacity, group)?;
                }
                Heard::Progress => comm.path.handle_resumed(),
                Heard::Retire => {
                    if comm.path.carrier(k).is_none() || !comm.path.handle_retired(k) {
                        // Its last lane: as if the sender had closed it.
                        return Err(ConnError::PeerClosed);
                    }
                    return Ok(Took::Retired);
                }
                Heard::Fence(epoch) => {
                    // Only a lane the sender opened, so one this end has seen, is fenced.
                    if epoch > comm.path.epoch() {
                        return Err(ConnError::Protocol(format!(
                            "Fence of lane attempt {epoch}, beyond the {} opened so far",
                            comm.path.epoch()
                        )));
                    }
                    if !comm.heard.insert(epoch) {
                        return Ok(Took::Item); // heard on another lane already
                    }
                    let gone = (comm.path.lanes())
                        .find(|&(other, l)| other != k && l.epoch == epoch)
                        .map(|(other, _)| other);
                    if let Some(gone) = gone {
                        // Losing it announces every waiting receive again.
                        return Ok(Took::Fence(gone));
                    }
                    // Gone already: offer the waiting receives again, now stamped later.
                    comm.machine.replay_point();
                }
                Heard::Drained(mask) => return Ok(Took::Drained(mask)),
            },
            Inbound::Data { seq, len, placed } => {
                // A payload written in place fills only a buffer this lane offered for it:
                // anything else would complete a receive with bytes that never arrived.
                if placed && !self.lanes[k].writer.offered(seq) {
                    return Err(ConnError::Protocol(format!(
                        "Data {seq} claims to be written in place, but this lane offered no buffer for it"
                    )));
                }
                let dst = comm.machine.handle_data(k, seq, len)?.map(|p| p.buf.lend());
                if dst.is_none() {
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                self.lanes[k].reader.place(dst);
            }
            Inbound::PayloadDone { seq, len } => {
                self.stats.bytes_received.fetch_add(len, Ordering::Relaxed);
                self.metrics.message(self.lanes[k].nic, false, len);
                for other in comm.machine.handle_payload_done(k, seq, len)? {
                    // The message is complete: the other copy must not write into it.
                    if let Some(l) = self.lanes.get_mut(other) {
                        l.reader.discard_rest();
                    }
                }
            }
            Inbound::Eof => return Err(ConnError::PeerClosed),
        }
        Ok(Took::Item)
    }

    /// The listener side of every handshake: a new comm (NCCL's connect), a probe, or a
    /// replacement lane for one of our receive comms. A Hello this listener can serve is
    /// challenged; anything else is refused. Nothing is decided before the Proof.
    fn hello(
        &mut self,
        k: usize,
        listener: Option<u64>,
        body: &[u8],
        now: Instant,
    ) -> Result<(), ConnError> {
        let random = fresh_random(&mut self.entropy)?;
        // A new comm's connect comes to NCCL's listener, or, when NCCL's pair could not
        // carry it, to a failover listener naming NCCL's listener by its id.
        let named = std::cell::Cell::new(listener);
        let (listeners, recv_by_id, comms) = (&self.listeners, &self.recv_by_id, &self.comms);
        let secret = |purpose, id: CommId| match purpose {
            Purpose::Data => {
                let id = listener.unwrap_or_else(|| auth::listen_id(&id));
                named.set(Some(id));
                listeners.get(&id).map(|s| Secret::Token(s.token))
            }
            Purpose::Probe | Purpose::Migrate => recv_by_id
                .get(&id)
                .and_then(|&c| comms.get(c))
                .map(|c| Secret::Session(c.session.clone())),
        };
        let lane = &mut self.lanes[k];
        let outcome = lane.m.handle_hello(body, secret, &random, now)?;
        lane.role = Role::Handshake {
            listener: named.get(),
        };
        match outcome {
            None => {
                // It named a secret of ours, which anyone may name: it keeps its
                // pre-authentication deadline (a real connector answers the Challenge
                // within a round trip), and is only let go after idle strangers.
                if let Some(t) = lane.ticket {
                    self.gate.vouch(t);
                }
            }
            Some(e) => self.refused(k, &e, now),
        }
        Ok(())
    }

    /// The connector's Proof: the lane authenticated (or is refused). Only now does it
    /// become a comm, a probe's answer, or a comm's replacement lane.
    fn proof(
        &mut self,
        k: usize,
        body: &[u8],
        now: Instant,
        io: &mut dyn Io,
    ) -> Result<(), ConnError> {
        let lane = &mut self.lanes[k];
        let Role::Handshake { listener } = lane.role else {
            return Err(ConnError::Protocol("unexpected Proof".into()));
        };
        let accepted = match lane.m.handle_proof(body, now)? {
            Ok(a) => a,
            Err(e) => {
                self.refused(k, &e, now);
                return Ok(());
            }
        };
        self.leave_gate(k);
        io.authenticated(k);
        match accepted.purpose {
            Purpose::Data => {
                let shared = listener.and_then(|id| self.listeners.get(&id)).cloned();
                let (Some(shared), Some(session)) = (shared, accepted.session) else {
                    // The NCCL listener closed during the handshake.
                    self.refuse(k, &AuthError::NotHere(Purpose::Data), now);
                    return Ok(());
                };
                let id = session.id();
                let comm = self.new_comm(Side::Recv, k, shared.nic, session);
                self.recv_by_id.insert(id, comm.key);
                let welcome = self.welcome(0, 0);
                self.lanes[k].writer.push_ctrl(&welcome);
                shared.ready.lock().push_back(comm);
            }
            // Its payload crosses before the Welcome (see `LaneMachine::handle_proof`).
            Purpose::Probe => self.lanes[k].role = Role::ProbeSink,
            Purpose::Migrate => match self.recv_by_id.get(&accepted.comm).copied() {
                Some(c) => self.attach_replacement(c, k, accepted.epoch, now, io),
                None => self.refuse(k, &AuthError::NotHere(Purpose::Migrate), now),
            },
        }
        Ok(())
    }

    /// Refuses a connection that failed to authenticate, and counts it.
    pub(super) fn refuse(&mut self, k: usize, why: &AuthError, now: Instant) {
        self.lanes[k].m.refuse(why, now);
        self.refused(k, why, now);
    }

    /// Counts a connection its machine refused; it lingers until the Refuse is out.
    fn refused(&mut self, k: usize, why: &AuthError, now: Instant) {
        self.stats
            .rejected_connections
            .fetch_add(1, Ordering::Relaxed);
        self.stats
            .refused_handshakes
            .fetch_add(1, Ordering::Relaxed);
        self.leave_gate(k);
        self.lanes[k].role = Role::Closing;
        self.turned_away(&format!("refused its handshake: {why}"), now);
    }

    fn new_comm(
        &mut self,
        side: Side,
        lane: usize,
        nic: usize,
        session: Session,
    ) -> Arc<CommShared> {
        let timeouts = Timeouts {
            completion: self.setup.completion_timeout,
            probe: self.setup.probe_timeout,
            giveup: self.setup.router.giveup,
        };
        let entry = self.comms.vacant_entry();
        let key = entry.key();
        let warn = self.setup.unmatched_warn;
        let shared = Arc::new(CommShared::new(side, key, self.queue.clone(), nic, warn));
        let mut machine = CommMachine::new(side == Side::Send);
        machine.hold_acks();
        entry.insert(Comm {
            shared: shared.clone(),
            machine,
            session,
            route: None,
            path: PathMachine::new(side == Side::Send, timeouts, lane),
            turn: 0,
            replayed: 0,
            lazily: 0,
            fenced: Vec::new(),
            fences: 0,
            heard: std::collections::BTreeSet::new(),
            refusing: 0,
            in_place: std::collections::BTreeSet::new(),
        });
        self.carry(lane, key);
        shared
    }

    /// Lane `k` now carries comm `c`, and joins its path's lanes: it keeps the path
    /// alive if it is the first.
    pub(super) fn carry(&mut self, k: usize, c: usize) {
        let l = &mut self.lanes[k];
        l.role = Role::Comm(c);
        l.m.carry();
        l.reader.enlarge();
        if let (Some(path), false) = (l.path(), l.joined) {
            l.joined = true;
            let keeper = self.paths.join(path, k);
            l.m.handle_keeper(keeper);
            if keeper {
                tracing::debug!("railover: lane {k} keeps path {path:?} alive");
            }
        }
        self.rearm(k);
    }

    /// Lane `k` carries its comm no more (it closes, fails or lingers): another lane of
    /// its path takes over the keepalives if it was the keeper.
    pub(super) fn leave_path(&mut self, k: usize) {
        let Some(l) = self.lanes.get_mut(k).filter(|l| l.joined) else {
            return;
        };
        l.joined = false;
        let Some(path) = l.path() else {
            return;
        };
        if let Some(next) = self.paths.leave(path, k) {
            tracing::debug!("railover: lane {next} keeps path {path:?} alive after lane {k}");
            if let Some(n) = self.lanes.get_mut(next) {
                n.m.handle_keeper(true);
            }
            self.rearm(next);
        }
    }
}

/// How long an accepted lane that can carry frames has to present its Hello. A fabric
/// slow enough to need a longer completion timeout (Soft-RoCE under emulation: 25 ms per
/// RDMA write) needs as much longer for a handshake.
pub(super) fn preauth_deadline(completion_timeout: Duration) -> Duration {
    PREAUTH_DEADLINE.max(completion_timeout * 2)
}

/// What an item of a comm's lane asks of the engine.
enum Took {
    Item,
    /// The sender retired the lane the item came on.
    Retired,
    /// The sender gave up this other lane of the comm: fence it now.
    Fence(usize),
    /// The receiver's drained NICs, a bit per index.
    Drained(u32),
}
