//! The engine: everything the reactor does that is not I/O. It owns the comms (their
//! machines, paths, shared state and routes), every lane's machine and frame codecs and
//! what the lane carries, the NCCL listeners' secrets, the handshake caps, the router and
//! its driving, pacing and metric sampling. It owns no socket, no `Poll` and no clock.
//!
//! Contract with the reactor (mio style):
//! * lane keys are the engine's: a lane the reactor accepts is filed under
//!   [`Engine::next_lane`] and handed over with [`Engine::accepted`]; lanes the engine
//!   opens itself go through [`Io::connect`] with their key;
//! * every call that may touch a socket borrows an [`Io`]; the engine calls it in the
//!   order the effects must happen (a fence before its close, the `Stalled` frame
//!   before the silent lane is let go, the last acks before the lanes at shutdown);
//! * time is an argument: [`Engine::poll_timeout`] says when to call
//!   [`Engine::handle_timeout`] next;
//! * after feeding commands and readiness, the reactor calls [`Engine::drive`], which
//!   carries out the router's decisions and flushes what the turn queued.

mod dials;
mod drain;
mod failover;
pub mod gate;
#[cfg(any(test, feature = "fuzz-harness"))]
#[doc(hidden)]
pub mod harness;
mod lanes;
mod lateness;
mod paths;
mod rescue;
mod timers;

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use slab::Slab;

use crate::conn::auth::{self, CommId, Initiator, Session};
use crate::conn::comm::CommMachine;
use crate::conn::lane::{io_error, Cause, LaneMachine};
use crate::conn::path::{migration_limit, PathMachine};
use crate::conn::wire::{Group, Header, Kind, NicAddr, CTS_IN_PLACE};
use crate::conn::ConnError;
use crate::conn::Transmit;
use crate::handoff::{
    CommShared, CommandQueue, Error, ListenShared, PendingConnect, Request, Rescue, Side,
};
use crate::routing::rng::SplitMix64;
use crate::routing::{
    self, FailReason, Move, NicId, Pair, PeerId, RoutePublisher, Router, RouterConfig,
};
use crate::telemetry::metrics::Telemetry;
use crate::telemetry::sampler::{LanePlaced, Sampler};
use crate::topology::PathType;
use crate::transport::fair::FairShare;
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, Placing, ReadError};
use crate::transport::memory::UserBuf;
use crate::transport::LaneProgress;

/// One local NIC as the reactor needs it.
#[derive(Debug, Clone)]
pub struct LocalNic {
    pub name: String,
    pub ip: IpAddr,
    pub rail: Option<u32>,
    /// Link speed in Mb/s, when the system reports one: the router weighs backups by it.
    pub speed_mbps: Option<u64>,
}

/// Everything the reactor is started with.
#[derive(Debug, Clone)]
pub struct Setup {
    pub nics: Vec<LocalNic>,
    /// `distance[n][x]`: PCIe path type from NIC `n`'s GPU to NIC `x` (None: unknown).
    pub distance: Vec<Vec<Option<PathType>>>,
    pub spin: Duration,
    pub completion_timeout: Duration,
    pub probe_timeout: Duration,
    /// Bytes a probe must move across the pair within `probe_timeout`.
    pub probe_bytes: usize,
    /// Whether busy lanes of a NIC are paced to even shares.
    pub fair_share: bool,
    /// How many stripes a send comm is cut into, so that a failed NIC's comms spread over
    /// every survivor (see `conn::path`); `None`: two per other NIC.
    pub stripes: Option<usize>,
    pub router: RouterConfig,
    /// Where counters and events are recorded (the reactor batches them).
    pub telemetry: Arc<Telemetry>,
    /// How long sends may find no receive for their tags before one WARN per comm names
    /// them (`RAILOVER_UNMATCHED_WARN_MS`).
    pub unmatched_warn: Duration,
    /// Handshake randomness from this seed instead of the OS: only for the deterministic
    /// simulation, whose runs must replay exactly. `None` in production.
    pub entropy_seed: Option<u64>,
}

/// Counters the reactor keeps for telemetry and tests.
#[derive(Debug, Default)]
pub struct ReactorStats {
    /// Connections refused or dropped before a valid handshake (garbage, wrong key,
    /// deadline, cap).
    pub rejected_connections: AtomicU64,
    /// Of those: handshakes that failed to authenticate (wrong key, unknown comm,
    /// replayed or altered).
    pub refused_handshakes: AtomicU64,
    /// Of those: connections dropped to keep the handshake caps.
    pub evicted_handshakes: AtomicU64,
    /// Connections in their handshake now, and the most there ever were at once.
    pub handshakes_pending: AtomicU64,
    pub handshakes_peak: AtomicU64,
    /// Lanes closed because the peer broke the protocol.
    pub protocol_errors: AtomicU64,
    /// Lanes lost to socket errors or an unexpected close.
    pub lane_failures: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    /// Comms that failed because no eligible NIC pair remained.
    pub gave_up: AtomicU64,
    /// NICs excluded for a comm because they could not register its memory.
    pub memory_exclusions: AtomicU64,
    /// Bytes sent again after a move.
    pub replayed_bytes: AtomicU64,
    /// Duplicates the receivers dropped.
    pub duplicates: AtomicU64,
    /// Carrier changes seen on local NICs.
    pub link_events: AtomicU64,
    /// Reactor turns run by NCCL's threads (`RAILOVER_PROGRESS=caller`), and by the
    /// reactor thread.
    pub caller_turns: AtomicU64,
    pub thread_turns: AtomicU64,
}

/// The lanes' sockets, as the reactor lends them to one engine call. `k` is always a
/// key the engine gave the lane; the reactor ignores keys it holds no socket for.
pub trait Io {
    /// Opens a lane from local NIC `nic` to `to` and files it under `k` (watched for
    /// readiness). On an error nothing is filed.
    fn connect(&mut self, k: usize, nic: usize, to: SocketAddr) -> io::Result<()>;
    /// [`crate::transport::Fabric::read`] on lane `k`.
    fn read(&mut self, k: usize, reader: &mut FrameReader) -> Result<Option<Inbound>, ReadError>;
    /// [`crate::transport::Fabric::write`] on lane `k`.
    fn write(&mut self, k: usize, writer: &mut FrameWriter) -> io::Result<()>;
    fn progress(&self, k: usize) -> LaneProgress;
    /// [`crate::transport::Fabric::peer`] of lane `k`.
    fn peer(&self, k: usize) -> Option<IpAddr> {
        let _ = k;
        None
    }
    /// Whether lane `k` can carry frames yet ([`crate::transport::Fabric::ready`]).
    fn ready(&self, k: usize) -> bool;
    /// The peer of accepted lane `k` proved who it is
    /// ([`crate::transport::Fabric::authenticated`]).
    fn authenticated(&mut self, k: usize) {
        let _ = k;
    }
    fn set_pacing(&mut self, k: usize, rate: Option<u64>) -> io::Result<()>;
    /// Nothing lane `k` still holds may reach the peer (see `Fabric::fence`).
    fn fence(&mut self, k: usize);
    /// Nothing more lane `k`'s peer sends lands in place (see `Fabric::seal`).
    fn seal(&mut self, k: usize);
    /// Stops watching lane `k` and closes it.
    fn close(&mut self, k: usize);
    /// Stops watching lane `k` but keeps it open and unserved, as a cut cable leaves it,
    /// until [`Io::unbury`].
    fn bury(&mut self, k: usize);
    /// Closes every buried lane (an injected cut ended).
    fn unbury(&mut self);
}

/// How long our own connect may wait for the listener's `Welcome`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// The least time an accepted connection has to authenticate (its Hello and then its
/// Proof), counted from when its fabric can carry frames; the deadline it gets is
/// `preauth_deadline`: this or twice the completion timeout, whichever is longer. Real
/// handshakes take a round trip or two: the reactor answers a Hello whether or not NCCL
/// has called `accept`. A Hello that names a secret of ours earns no longer deadline by
/// itself (anyone may name one); it means the handshake caps evict the connection after
/// those that have sent no Hello, and it is given the deadline again only while the
/// same path carries our peer's bytes (`Engine::patience`).
const PREAUTH_DEADLINE: Duration = Duration::from_secs(2);

/// A message's buffer and the request NCCL tests: buffer `sub` of it (a grouped
/// receive's request holds several).
#[derive(Debug)]
pub struct Pending {
    pub buf: UserBuf,
    pub req: Arc<Request>,
    pub sub: usize,
}

#[derive(Debug)]
struct Comm {
    shared: Arc<CommShared>,
    machine: CommMachine<Pending>,
    /// The session secret its first handshake agreed; migrations and probes prove it.
    session: Session,
    /// Send side: the comm is registered with the router.
    route: Option<Route>,
    /// Its lanes and their stripes, the lanes being opened, attempts, detection and the
    /// receiver's wait for a replacement.
    path: PathMachine,
    /// Send side: messages handed out so far, to share them over the lanes by stripes.
    turn: u64,
    /// Bytes sent again, and memory regions registered on a backup NIC, since the comm
    /// last settled: for the failover's log line.
    replayed: u64,
    lazily: usize,
    /// Send side: epochs of the lanes given up, newest last. Each lane of the comm is
    /// told (`Fence`) before it carries a replay, so the receiver fences its end of them.
    fenced: Vec<u64>,
    /// Send side: lanes given up so far. A message sent again may be written in place
    /// only with an offer the receiver made after it had heard of them all.
    fences: u64,
    /// Receive side: the epochs of the `Fence`s heard; their number stamps each offer.
    heard: BTreeSet<u64>,
    /// Receive side: our NICs (a bit per index) that could not register this comm's
    /// memory; every `Welcome` of its later lanes says so again.
    refusing: u32,
    /// Send side: receives whose `Cts` asked for the payload in place (GPU memory), the
    /// latest [`IN_PLACE_KEPT`] sequence numbers.
    in_place: BTreeSet<u64>,
}

/// How far below the newest receive a comm remembers that one wanted its payload in
/// place: beyond the sender's window of announced receives.
const IN_PLACE_KEPT: u64 = 1 << 17;

/// Given-up lane epochs a comm keeps telling new lanes about.
const MAX_FENCED: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Route {
    /// The node at the other end, in the router's numbering.
    peer: PeerId,
}

/// What a lane is for: its one owner.
#[derive(Debug)]
enum Role {
    /// Accepted and not yet authenticated (see `Lane::ticket`). `listener` is the NCCL
    /// listen id, or `None` for a failover listener.
    Handshake { listener: Option<u64> },
    /// Connecting; waiting for the listener's `Welcome`.
    Connecting(Dial),
    /// Carrying a comm.
    Comm(usize),
    /// Probing a candidate pair for the router, since `started`.
    Probe { pair: Pair, started: Instant },
    /// Answering a probe: receiving its payload before the `Welcome`.
    ProbeSink,
    /// Opening a lane for a comm's stripes (the first move that asked for it).
    Migrating { comm: usize, mv: Move },
    /// Flushing its last bytes before it closes.
    Closing,
}

/// NCCL's connect, across the attempts a busy listener may make it take, and the pairs
/// it may try when NCCL's own cannot carry it.
#[derive(Debug)]
struct Dial {
    pending: Arc<PendingConnect>,
    /// NCCL's device: the comm's NIC, whichever pair carries the connect.
    nic: usize,
    /// NCCL's listener.
    to: SocketAddr,
    /// The handle's token: the key of the handshake, never sent.
    token: [u8; 16],
    /// When NCCL asked: every attempt fits in [`HANDSHAKE_TIMEOUT`] from here.
    since: Instant,
    /// Attempts made before this one.
    attempt: u32,
    /// The listener's id and its process's failover listeners (NCCL's handle).
    rescue: Rescue,
    /// Set while the connect goes over another pair than NCCL's.
    via: Option<Via>,
    /// Every pair dialled so far, NCCL's first and the current one last: (local NIC, the
    /// listener's NIC index). Empty when NCCL's listener is not among the handle's NICs:
    /// then no other pair can be told from its own, and the connect stays on it.
    tried: Vec<(usize, usize)>,
}

/// A same-rail pair that carries a connect NCCL's pair could not.
#[derive(Debug, Clone, Copy)]
struct Via {
    local: usize,
    /// The listener's NIC's failover listener.
    to: SocketAddr,
    /// Why NCCL's pair was left.
    why: FailReason,
}

impl Dial {
    /// Where this attempt goes: (local NIC, listener address).
    fn target(&self) -> (usize, SocketAddr) {
        self.via.map_or((self.nic, self.to), |v| (v.local, v.to))
    }

    /// The time left of [`HANDSHAKE_TIMEOUT`] from NCCL's call, at `now`.
    fn left(&self, now: Instant) -> Duration {
        (self.since + HANDSHAKE_TIMEOUT).saturating_duration_since(now)
    }

    /// When to try again after the listener dropped attempt `self.attempt` before the
    /// handshake finished, if there is time left: soon, then backing off to 1 s.
    fn again(&self, now: Instant) -> Option<Instant> {
        let wait = Duration::from_millis(20 << self.attempt.min(6)).min(Duration::from_secs(1));
        Some(now + wait).filter(|&at| at < self.since + HANDSHAKE_TIMEOUT)
    }
}

/// Where a queued lane will be dialled, and its handshake's time limit from then.
#[derive(Debug, Clone, Copy)]
struct Queued {
    to: SocketAddr,
    limit: Duration,
}

#[derive(Debug)]
struct Lane {
    reader: FrameReader,
    writer: FrameWriter,
    role: Role,
    /// Its handshake, deadline and liveness.
    m: LaneMachine,
    /// Its place in the handshake caps (accepted lanes not yet authenticated).
    ticket: Option<u64>,
    /// Local NIC index, when the lane's local address is one of ours.
    nic: Option<usize>,
    /// The peer NIC's address, when the fabric knows it: with `nic`, the lane's path.
    remote: Option<IpAddr>,
    /// A replacement lane waiting for its turn to be dialled ([`dials`]): it has no
    /// socket yet.
    queued: Option<Queued>,
    /// Accepted while its fabric was still setting it up (a verbs QP being connected):
    /// the pre-authentication clock starts when it is ready.
    setting_up: bool,
    /// Its fabric's count of payload bytes written in place, at the last look.
    placed: LanePlaced,
    /// It is one of its path's carrying lanes ([`paths::Paths::join`]).
    joined: bool,
    /// It is in the engine's `sampling` list: it wrote since its delivery was last
    /// sampled, or still had bytes waiting then.
    sampling: bool,
}

impl Lane {
    /// The path the lane takes, when both ends are known.
    fn path(&self) -> Option<paths::PathKey> {
        Some((self.nic?, self.remote?))
    }

    /// Moves the machine's control frames onto the writer; `true` if there were any.
    fn sync(&mut self) -> bool {
        let mut any = false;
        while let Some(f) = self.m.poll_transmit() {
            self.writer.push_ctrl(&f);
            any = true;
        }
        any
    }
}

/// The least a lane's timer is armed past the moment it was handled.
const TIMER_SLACK: Duration = Duration::from_micros(100);

/// The reactor's state and decisions, without its sockets.
pub struct Engine {
    queue: Arc<CommandQueue>,
    stats: Arc<ReactorStats>,
    /// Our NICs as peers see them.
    wire: Vec<NicAddr>,
    nic_up: Vec<bool>,
    /// Who holds each local NIC drained (`railover drain`, the watched file).
    drained: Vec<drain::DrainHold>,
    lanes: Slab<Lane>,
    comms: Slab<Comm>,
    /// NCCL's listeners by listen id (their tokens, their accept queues).
    listeners: HashMap<u64, Arc<ListenShared>>,
    /// Lanes with queued output to flush at the end of the turn.
    dirty: Vec<usize>,
    /// Lanes that stopped on their per-call budget and must be served again.
    again: Vec<usize>,
    /// Receive comms holding an Ack for the next turn ([`Engine::start_turn`]).
    held: Vec<usize>,
    /// The lanes whose delivery the next tick samples: those that wrote or had bytes
    /// waiting. An idle lane costs no look and no `TIOCOUTQ` until it writes again.
    sampling: Vec<usize>,
    /// Every lane's next deadline, in one heap.
    timers: timers::Timers,
    /// How late what was due ran lately (probe deadlines allow for it).
    lateness: lateness::Lateness,
    router: Router,
    routes: Arc<RoutePublisher>,
    routes_dirty: bool,
    /// Remote processes' NIC lists; the index is the router's `PeerId`.
    peers: Vec<Vec<NicAddr>>,
    /// Receive comms by id, for migrations and probes.
    recv_by_id: HashMap<CommId, usize>,
    /// Accepted connections that have not authenticated yet.
    gate: gate::Gate,
    /// Replacement lanes in their handshake, and those waiting their turn.
    dials: dials::Dials,
    /// What each path (local NIC, peer NIC) has shown lately, to judge a lane's silence
    /// and a failed probe against its neighbours.
    paths: paths::Paths,
    /// Log lines about connections turned away, rate-limited.
    turned_away: gate::LogLimit,
    next_tick: Instant,
    setup: Setup,
    metrics: Sampler,
    /// Local NICs cut by fault injection: their lanes are buried until restored.
    injected_down: Vec<bool>,
    /// Pacing caps that share each NIC evenly between its backlogged lanes.
    fair: FairShare,
    /// Seeded handshake randomness (simulation only); `None`: the OS's.
    entropy: Option<SplitMix64>,
    /// Send comms with a lane whose stripes all left: retired once it drained.
    draining: Vec<usize>,
    /// NCCL's connects to try again, and when: the listener dropped them before they
    /// authenticated (its handshake caps at a burst of connects, or a flood).
    redials: Vec<(Instant, Dial)>,
}

impl Engine {
    /// An engine for NICs `setup.nics`, which peers reach at `wire`, index for index;
    /// comms it creates wake the reactor through `queue`.
    pub fn new(setup: Setup, queue: Arc<CommandQueue>, wire: Vec<NicAddr>, now: Instant) -> Self {
        let mut router_cfg = setup.router;
        if router_cfg.seed == 0 {
            let mut b = [0u8; 8];
            let _ = getrandom::getrandom(&mut b);
            router_cfg.seed = u64::from_le_bytes(b) | 1;
        }
        let n = setup.nics.len();
        let mut router = Router::new(router_cfg);
        for (i, nic) in setup.nics.iter().enumerate() {
            if let Some(mbps) = nic.speed_mbps {
                router.set_link_speed(NicId(i as u32), mbps);
            }
        }
        Engine {
            queue,
            stats: Arc::new(ReactorStats::default()),
            wire,
            nic_up: vec![true; n],
            drained: vec![drain::DrainHold::default(); n],
            lanes: Slab::new(),
            comms: Slab::new(),
            listeners: HashMap::new(),
            dirty: Vec::new(),
            again: Vec::new(),
            held: Vec::new(),
            sampling: Vec::new(),
            timers: timers::Timers::default(),
            lateness: lateness::Lateness::default(),
            router,
            routes: Arc::new(RoutePublisher::new(routing::Routes::default())),
            routes_dirty: false,
            peers: Vec::new(),
            recv_by_id: HashMap::new(),
            paths: paths::Paths::default(),
            dials: dials::Dials::default(),
            gate: gate::Gate::new(gate::IDLE_PER_LISTENER, gate::IDLE_TOTAL, gate::TOTAL),
            turned_away: gate::LogLimit::new(gate::LOG_INTERVAL),
            next_tick: now,
            injected_down: vec![false; n],
            fair: FairShare::new(),
            metrics: Sampler::new(n, now),
            entropy: setup.entropy_seed.map(SplitMix64::new),
            draining: Vec::new(),
            redials: Vec::new(),
            setup,
        }
    }

    pub fn stats(&self) -> &Arc<ReactorStats> {
        &self.stats
    }

    pub fn routes(&self) -> &Arc<RoutePublisher> {
        &self.routes
    }

    /// Our NICs as peers see them.
    pub fn wire(&self) -> &[NicAddr] {
        &self.wire
    }

    /// Whether any comm has a request outstanding.
    pub fn busy(&self) -> bool {
        self.comms.iter().any(|(_, c)| c.machine.pending() > 0)
    }

    /// Lanes to serve again this turn (their per-call budget ran out).
    pub fn take_again(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.again)
    }

    pub fn has_again(&self) -> bool {
        !self.again.is_empty() || !self.held.is_empty()
    }

    /// A turn begins, after its commands: the Acks held in the last turn go out with
    /// this one's output (a `Cts` this turn's receives queued carries them), which the
    /// turn's [`Engine::drive`] flushes.
    pub fn start_turn(&mut self) {
        let mut held = std::mem::take(&mut self.held);
        held.sort_unstable();
        held.dedup();
        for c in held {
            if let Some(comm) = self.comms.get_mut(c) {
                comm.machine.release_ack();
                self.pump(c);
            }
        }
    }

    /// The reactor was parked for `idle` without events (for the metrics).
    pub fn idle(&mut self, idle: Duration) {
        self.metrics.idle(idle);
    }

    /// The earliest time a timer (lane deadlines, the periodic tick, the router's) is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.timers.next(),
            Some(self.next_tick),
            self.router.poll_timeout(),
            self.redials.iter().map(|&(at, _)| at).min(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs every timer that is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant, io: &mut dyn Io) {
        if let Some(due) = self.poll_timeout().filter(|&d| d <= now) {
            self.lateness.record(due, now);
        }
        if self.timers.next().is_some_and(|d| d <= now) {
            self.expire(now, io);
        }
        if self.redials.iter().any(|&(at, _)| at <= now) {
            let (due, later) = std::mem::take(&mut self.redials)
                .into_iter()
                .partition(|&(at, _)| at <= now);
            self.redials = later;
            for (_, d) in due {
                self.dial(d, now, io);
            }
        }
        if now >= self.next_tick {
            self.tick(now, io);
            if let Some((n, secs, latest)) = self.turned_away.flush(now) {
                tracing::warn!("railover: turned away {n} more incoming connections in the last {secs} s (latest: {latest})");
            }
        }
        if self.metrics.due(now) {
            self.sample_metrics(now);
        }
        if self.router.poll_timeout().is_some_and(|d| d <= now) {
            self.router.handle_timeout(now);
        }
    }

    /// The end of every half-turn: the router's decisions, lanes that drained, then the
    /// turn's output.
    pub fn drive(&mut self, now: Instant, io: &mut dyn Io) {
        self.drive_router(now, io);
        self.dial_queued(now, io);
        self.retire_drained(now);
        self.flush_dirty(now, io);
    }

    /// NCCL opened listener `shared`; its Hellos prove its token.
    pub fn listening(&mut self, shared: Arc<ListenShared>) {
        self.listeners.insert(shared.id, shared);
    }

    /// NCCL closed listener `shared`: accepted comms NCCL never took die with it.
    pub fn close_listen(&mut self, shared: &ListenShared, now: Instant, io: &mut dyn Io) {
        self.listeners.remove(&shared.id);
        let orphans: Vec<_> = shared.ready.lock().drain(..).collect();
        for comm in orphans {
            self.close_comm(&comm, now, io);
        }
    }

    /// Connects from local NIC `nic` to NCCL's listener at `to`, keyed by its `token`.
    /// When NCCL's pair cannot carry it (the local carrier is down, or the listener's NIC
    /// does not answer), the connect goes over a same-rail pair of `rescue`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        &mut self,
        nic: usize,
        to: SocketAddr,
        token: &[u8; 16],
        rescue: Rescue,
        pending: &Arc<PendingConnect>,
        now: Instant,
        io: &mut dyn Io,
    ) {
        let nccl = (rescue.nics.iter()).position(|n| n.addr.ip() == to.ip());
        let mut d = Dial {
            pending: pending.clone(),
            nic,
            to,
            token: *token,
            since: now,
            attempt: 0,
            rescue,
            via: None,
            tried: nccl.map(|r| (nic, r)).into_iter().collect(),
        };
        if let Some(why) = self.nic_unusable(nic) {
            // Known down: NCCL's pair is not even tried (without a same-rail pair to
            // go to, it is, and fails as it would have).
            self.next_via(&mut d, why);
        }
        self.dial(d, now, io);
    }

    /// One attempt of NCCL's connect `d`: on its pair, or on the pair it was moved to.
    fn dial(&mut self, mut d: Dial, now: Instant, io: &mut dyn Io) {
        let k = self.lanes.vacant_key();
        let random = match fresh_random(&mut self.entropy) {
            Ok(r) => r,
            Err(e) => {
                *d.pending.result.lock() = Some(Err(e.into()));
                return;
            }
        };
        let (nic, to) = loop {
            let (nic, to) = d.target();
            let Err(e) = io.connect(k, nic, to) else {
                break (nic, to);
            };
            tracing::warn!("railover: connect to {to} failed: {e}");
            if !self.next_via(&mut d, FailReason::NicError) {
                *d.pending.result.lock() = Some(Err(e.into()));
                return;
            }
        };
        let (auth, hello) =
            Initiator::connect(&d.token, d.rescue.listen_id, self.wire.clone(), &random);
        let limit = self.reach_limit(&d, now);
        self.add_lane(k, Role::Connecting(d), now, limit);
        let lane = &mut self.lanes[k];
        lane.nic = Some(nic);
        lane.remote = Some(to.ip());
        lane.m.connecting(auth, hello);
        self.dirty.push(k);
    }

    /// A send NCCL posted on `comm`, matched to receive `seq` and cut to its size.
    pub fn post_send(
        &mut self,
        comm: &Arc<CommShared>,
        req: &Arc<Request>,
        buf: UserBuf,
        seq: u64,
        io: &mut dyn Io,
    ) {
        let Some(c) = self.posted_on(comm, Side::Send, req, 1) else {
            return;
        };
        let len = buf.len() as u64;
        let p = Pending {
            buf,
            req: req.clone(),
            sub: 0,
        };
        if let Err(p) = self.comms[c].machine.post_send(seq, len, p) {
            return p.req.settle(0, Err(other_side()));
        }
        if let Some(e) = self.comms[c].machine.take_fault() {
            tracing::warn!("railover: comm {c} failed: {e}");
            return self.fail_comm(c, e, io);
        }
        self.pump(c);
    }

    /// A (grouped) receive NCCL posted on `comm`: its buffers and their tags.
    pub fn post_recv(
        &mut self,
        comm: &Arc<CommShared>,
        req: &Arc<Request>,
        bufs: Vec<(UserBuf, i32)>,
        _io: &mut dyn Io,
    ) {
        let Some(c) = self.posted_on(comm, Side::Recv, req, bufs.len()) else {
            return;
        };
        let subs = (bufs.into_iter().enumerate())
            .map(|(sub, (buf, tag))| {
                let len = buf.len() as u64;
                let p = Pending {
                    buf,
                    req: req.clone(),
                    sub,
                };
                (len, tag, p)
            })
            .collect();
        if let Err(ps) = self.comms[c].machine.post_recv(subs) {
            for p in ps {
                p.req.settle(p.sub, Err(other_side()));
            }
            return;
        }
        self.pump(c);
    }

    /// The comm a request of `side` over `subs` buffers was posted on, or `None` when the
    /// comm is closed (the request failed).
    fn posted_on(
        &self,
        comm: &Arc<CommShared>,
        side: Side,
        req: &Request,
        subs: usize,
    ) -> Option<usize> {
        let c = self.comm_of(comm);
        if c.is_none() {
            let what = match side {
                Side::Send => "send on a closed comm",
                Side::Recv => "receive on a closed comm",
            };
            for sub in 0..subs {
                req.settle(sub, Err(Error::InvalidArgument(what.into())));
            }
        }
        c
    }

    fn comm_of(&self, shared: &Arc<CommShared>) -> Option<usize> {
        self.comms
            .get(shared.key)
            .filter(|c| Arc::ptr_eq(&c.shared, shared))
            .map(|_| shared.key)
    }

    /// Moves the machine's output onto its lanes and its outcomes onto the requests. A
    /// sender shares its messages over its lanes in proportion to their stripes; a
    /// receiver's control frames go on every lane.
    fn pump(&mut self, c: usize) {
        let comm = &mut self.comms[c];
        let lanes = &mut self.lanes;
        // Lanes by share: each stripe is one slot, so a lane with two stripes takes two
        // messages in three when another has one. Only lanes without stripes (draining,
        // or the comm is between moves) still carry it, one slot each. Without a lane
        // (failover under way), or while a new comm's first messages wait to cross no
        // drained NIC (`PathMachine::holding`), the machine keeps its queue.
        let holding = comm.path.holding();
        let live = |k: &usize| !holding && lanes.contains(*k);
        let striped: usize = (comm.path.lanes())
            .filter(|(k, _)| live(k))
            .map(|(_, l)| l.stripes.len())
            .sum();
        let weight = |stripes: usize| if striped == 0 { 1 } else { stripes };
        let slots: usize = (comm.path.lanes())
            .filter(|(k, _)| live(k))
            .map(|(_, l)| weight(l.stripes.len()))
            .sum();
        let sender = comm.shared.side == Side::Send;
        while sender && slots > 0 && comm.machine.wants_lane() {
            let mut at = (comm.turn % slots as u64) as usize;
            comm.turn = comm.turn.wrapping_add(1);
            let k = (comm.path.lanes())
                .filter(|(k, _)| lanes.contains(*k))
                .find(|(_, l)| {
                    let w = weight(l.stripes.len());
                    let here = at < w;
                    at = at.saturating_sub(w);
                    here
                })
                .map(|(k, _)| k)
                .expect("a slot below the total is some lane's");
            let Some(Transmit { seq, len }) = comm.machine.poll_data(k) else {
                break;
            };
            let lane = &mut lanes[k];
            let p = comm
                .machine
                .message(seq)
                .expect("transmitting a queued message");
            let min_gen = if comm.machine.first_try(seq) {
                0
            } else {
                comm.fences
            };
            let place = Placing {
                min_gen,
                must: comm.in_place.contains(&seq),
            };
            lane.writer.push_data(seq, len, p.buf.lend(), Some(place));
            comm.path.handle_carried();
            self.stats.bytes_sent.fetch_add(len, Ordering::Relaxed);
            self.metrics.message(lane.nic, true, len);
            self.dirty.push(k);
        }
        while let Some(h) = comm.machine.poll_control() {
            // A receive is offered to be written in place on each lane that can: the
            // sender picks the lane. One in GPU memory must be.
            let offer = (h.kind == Kind::Cts)
                .then(|| comm.machine.message(h.seq))
                .flatten()
                .map(|p| (Group::of_cts(&h).0, &p.buf));
            let mut h = h;
            if offer.is_some_and(|(_, buf)| !buf.lend().cpu_reachable()) {
                h.len |= CTS_IN_PLACE;
            }
            let frame = h.encode();
            for (k, _) in comm.path.lanes() {
                if let Some(lane) = lanes.get_mut(k) {
                    if let Some((capacity, buf)) = offer {
                        let gen = comm.heard.len() as u64;
                        lane.writer.push_advertise(h.seq, capacity, buf.lend(), gen);
                    }
                    lane.writer.push_ctrl(&frame);
                    self.dirty.push(k);
                }
            }
        }
        while let Some((p, outcome)) = comm.machine.poll_outcome() {
            p.req.settle(p.sub, outcome.map_err(Into::into));
        }
        if comm.machine.holds_ack() {
            self.held.push(c);
        }
    }

    /// Retires the lanes of draining comms that carry no stripe and hold nothing the
    /// receiver has not acknowledged: a `Retire` tells the receiver to let the lane go.
    fn retire_drained(&mut self, now: Instant) {
        if self.draining.is_empty() {
            return;
        }
        let mut draining = std::mem::take(&mut self.draining);
        draining.sort_unstable();
        draining.dedup();
        let mut retire = Vec::new();
        for c in draining {
            let Some(comm) = self.comms.get_mut(c) else {
                continue;
            };
            for k in comm.path.idle() {
                let Some(lane) = self.lanes.get(k) else {
                    comm.path.handle_retired(k);
                    continue;
                };
                if comm.machine.on_lane(k) > 0 || lane.writer.holds_payload() {
                    self.draining.push(c);
                    continue;
                }
                comm.path.handle_retired(k);
                retire.push(k);
            }
        }
        for k in retire {
            self.lanes[k]
                .writer
                .push_ctrl(&Header::new(Kind::Retire, 0, 0).encode());
            self.linger(k, now);
        }
    }

    /// Lane `k` carries nothing more: it closes once its last bytes are out, or at the
    /// linger deadline.
    fn linger(&mut self, k: usize, now: Instant) {
        self.leave_path(k);
        if let Some(lane) = self.lanes.get_mut(k) {
            lane.role = Role::Closing;
            lane.m.linger(now);
            self.dirty.push(k);
            self.rearm(k);
        }
    }

    /// Receive comm `c` (session `id`) takes no more replacement lanes or probes.
    fn forget_recv(&mut self, c: usize, id: auth::CommId) {
        if self.recv_by_id.get(&id) == Some(&c) {
            self.recv_by_id.remove(&id);
        }
    }

    /// NCCL closed `shared`: fail what it still waits for, let its lanes go.
    pub fn close_comm(&mut self, shared: &Arc<CommShared>, now: Instant, io: &mut dyn Io) {
        let Some(c) = self.comm_of(shared) else {
            return;
        };
        let comm = self.comms.remove(c);
        if comm.route.is_some() {
            self.router.remove_comm(routing::CommId(c));
            self.routes_dirty = true;
        }
        self.forget_recv(c, comm.session.id());
        let mut m = comm.machine;
        m.handle_lane_lost(ConnError::PeerClosed);
        while let Some((p, _)) = m.poll_outcome() {
            let e = Error::InvalidArgument("comm closed with the request outstanding".into());
            p.req.settle(p.sub, Err(e));
        }
        for k in comm.path.openings() {
            self.drop_lane(k, io);
        }
        for (k, _) in comm.path.lanes() {
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            if lane.writer.holds_payload() {
                // NCCL may free its buffers once close returns: never write from them
                // again. The peer sees the stream end and fails what it still waits for.
                self.drop_lane(k, io);
            } else {
                // Let the last acks and CTS reach the peer, but do not wait for it.
                self.linger(k, now);
            }
        }
    }

    /// Writes out what the turn queued on its lanes; lanes done closing go.
    fn flush_dirty(&mut self, now: Instant, io: &mut dyn Io) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for k in dirty.drain(..) {
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            if lane.queued.is_some() {
                // No socket yet: its Hello goes out once it is dialled.
                continue;
            }
            lane.sync();
            if lane.writer.is_empty() {
                if matches!(lane.role, Role::Closing) {
                    self.drop_lane(k, io);
                }
                continue;
            }
            let before = lane.writer.total_written();
            let res = io.write(k, &mut lane.writer);
            if lane.writer.total_written() != before {
                lane.m.handle_tx(now);
                if !std::mem::replace(&mut lane.sampling, true) {
                    self.sampling.push(k);
                }
            }
            match res {
                Ok(()) => {
                    if lane.writer.wants_more() {
                        self.again.push(k);
                    } else if lane.writer.is_empty() && matches!(lane.role, Role::Closing) {
                        self.drop_lane(k, io);
                    }
                }
                Err(e) => self.fail_lane(k, Cause::error(io_error(&e)), now, io),
            }
        }
        self.dirty = dirty;
    }

    /// Runs the lanes' timers that are due: handshakes, probes and migrations that took
    /// too long, lingering lanes, silence and keepalives. Only the lanes due are looked
    /// at; each is armed again with its machine's next deadline.
    fn expire(&mut self, now: Instant, io: &mut dyn Io) {
        let mut failed = Vec::new();
        // Paths whose sockets this call read before judging a lane of theirs silent.
        let mut drained: Vec<Option<paths::PathKey>> = Vec::new();
        while let Some(k) = self.timers.pop_due(now) {
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            let due = lane.m.poll_timeout().is_some_and(|d| d <= now);
            // Judged against its path: what its neighbours heard, up to now.
            if let Some(at) = lane.path().and_then(|p| self.paths.last_heard(p)) {
                lane.m.handle_path_rx(at);
            }
            let path = lane.path();
            if due && lane.m.silent_past_limit(now) && !drained.contains(&path) {
                // Read before judging: a reactor that fell behind (thousands of lanes
                // ready at once, a stall) has the proof of life in its sockets, and
                // closing a lane with unread bytes resets it under the sender.
                drained.push(path);
                let lanes = path.map_or_else(|| vec![k], |p| self.paths.lanes(p).to_vec());
                for l in lanes {
                    self.service_lane(l, now, io);
                }
            }
            if due {
                if let Some(more) = self.patience(k, now, io) {
                    if self.lanes[k].m.extend(now + more) == Some(1) {
                        tracing::info!(
                            "railover: a handshake on a congested path that works is given {} ms more",
                            more.as_millis()
                        );
                    }
                }
            }
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            if due {
                if let Some(at) = path.and_then(|p| self.paths.last_heard(p)) {
                    lane.m.handle_path_rx(at);
                }
                lane.m.handle_timeout(now);
                if lane.sync() {
                    self.dirty.push(k);
                }
                failed.extend(lane.m.poll_failure().map(|c| (k, c)));
            }
            if let Some(next) = lane.m.poll_timeout() {
                // A machine still due right after it was handled is looked at again on
                // the next turn, not in this loop: no deadline can spin the reactor.
                self.timers.arm(k, next.max(now + TIMER_SLACK));
            }
        }
        for (k, cause) in failed {
            self.lane_condemned(k, cause, now, io);
        }
    }

    /// How much longer lane `k`'s handshake may take, when what is due is its deadline and
    /// its path shows that the other end is there and busy: a replacement lane of ours
    /// whose pair the peer keeps acknowledging, an accepted lane that named one of our
    /// comms and waits for its Proof while that peer's bytes keep arriving over the same
    /// path, or NCCL's connect whose listener's NIC answered (see
    /// [`Engine::connect_patience`]). A stranger's connection does not come over a path
    /// we hear, so a flood gets no more time than before.
    fn patience(&self, k: usize, now: Instant, io: &dyn Io) -> Option<Duration> {
        let lane = self.lanes.get(k)?;
        if !lane.m.deadline_due(now) {
            return None;
        }
        let timeout = self.setup.completion_timeout;
        match &lane.role {
            Role::Migrating { mv, .. } if lane.queued.is_none() => self
                .pair_delivering(mv.to, now)
                .then(|| migration_limit(timeout, self.setup.probe_timeout)),
            Role::Handshake { .. } if lane.m.awaits_proof() => self
                .heard_lately(lane, now)
                .then(|| lanes::preauth_deadline(timeout)),
            Role::Connecting(d) => self.connect_patience(d, lane, io.peer(k).is_some(), now),
            _ => None,
        }
    }

    /// Whether `lane`'s path (our NIC, the peer's address) carried the peer's bytes within
    /// the last completion timeout.
    fn heard_lately(&self, lane: &Lane, now: Instant) -> bool {
        (lane.path().and_then(|p| self.paths.last_heard(p)))
            .is_some_and(|t| now.saturating_duration_since(t) < self.setup.completion_timeout)
    }

    /// Lane `k`'s machine may have a nearer deadline than the one it is armed for (it was
    /// just given one, or what it read brought one nearer).
    pub(super) fn rearm(&mut self, k: usize) {
        if let Some(at) = self.lanes.get(k).and_then(|l| l.m.poll_timeout()) {
            self.timers.arm(k, at);
        }
    }

    /// Shutdown: closes every comm, hands the last acks to the sockets, then lets every
    /// lane go and fails connects still in flight.
    pub fn close_everything(&mut self, now: Instant, io: &mut dyn Io) {
        let keys: Vec<usize> = self.comms.iter().map(|(k, _)| k).collect();
        for c in keys {
            let shared = self.comms[c].shared.clone();
            self.close_comm(&shared, now, io);
        }
        // A close and the shutdown can arrive in one turn: hand the last acks to the
        // kernel (best effort, no waiting) before the lanes go, or the peer's final
        // sends, already delivered here, would fail for want of their ack.
        self.flush_dirty(now, io);
        let lanes: Vec<usize> = self.lanes.iter().map(|(k, _)| k).collect();
        for k in lanes {
            if let Some(Role::Connecting(d)) = self.lanes.get(k).map(|l| &l.role) {
                *d.pending.result.lock() = Some(Err(Error::Internal("plugin finalised".into())));
            }
            self.drop_lane(k, io);
        }
        for (_, d) in self.redials.drain(..) {
            *d.pending.result.lock() = Some(Err(Error::Internal("plugin finalised".into())));
        }
    }
}

/// Fresh randomness for one handshake: the OS's, or the simulation's seeded stream.
fn fresh_random(seeded: &mut Option<SplitMix64>) -> Result<auth::Random, ConnError> {
    let mut r = [0u8; 64];
    match seeded {
        Some(rng) => r
            .chunks_mut(8)
            .for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes())),
        None => getrandom::getrandom(&mut r)
            .map_err(|e| ConnError::Io(format!("no randomness for a handshake: {e}")))?,
    }
    Ok(r)
}

#[cfg(test)]
mod tests;

/// A send posted on a receive comm, or the other way round.
fn other_side() -> Error {
    Error::InvalidArgument("send or receive on a comm of the other side".into())
}
