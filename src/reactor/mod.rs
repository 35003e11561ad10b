//! The reactor: the one thread per process that owns every socket and drives every
//! comm's protocol machine.
//!
//! It opens every listener and lane itself, through a [`Fabric`] it is given at
//! [`ReactorHandle::spawn`]; it names no fabric's types and makes no fabric's calls, so
//! lanes may be TCP streams or RC QPs alike.
//!
//! What producers (NCCL's threads, through [`crate::plugin`]) can rely on:
//! * a command pushed with [`CommandQueue::push`] is seen by the reactor's next turn; if
//!   the reactor is parked in `epoll`, `push` wakes it (one `eventfd` write), otherwise
//!   it costs no system call;
//! * only the reactor touches a comm's machine, lanes and buffers; outcomes reach NCCL
//!   through each request's atomic state;
//! * after the last context is finalised, [`Reactor::run`] returns and the thread is
//!   joined, so the library can be unloaded;
//! * if the reactor thread panics, it stops for good: requests in flight and every later
//!   call fail with `ncclInternalError`, closes return at once, one WARN gives the
//!   panic's message ([`CommandQueue::check`]).
//!
//! Not guaranteed, merely today's behaviour: the reactor busy-polls for
//! `RAILOVER_SPIN_US` after its last progress while requests are in flight, then parks.

pub mod budget;
#[cfg(test)]
pub(crate) mod driven;
mod failover;
mod gate;

pub use gate::{PER_LISTENER as HANDSHAKES_PER_LISTENER, TOTAL as HANDSHAKES_TOTAL};

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;
use slab::Slab;

use crate::conn::auth::{self, AuthError, CommId, Initiator, Secret, Session};
use crate::conn::comm::{CommMachine, Out};
use crate::conn::lane::{io_error, Cause, LaneMachine, Step, LINGER};
use crate::conn::path::{PathMachine, Timeouts};
use crate::conn::wire::{Header, Kind, NicAddr, Purpose, Welcome};
use crate::conn::ConnError;
use crate::handoff::{
    panic_message, CommShared, Command, CommandQueue, Error, ListenShared, PendingConnect, Request,
    Side,
};
use crate::routing::rng::SplitMix64;
use crate::routing::{self, FailReason, Move, Pair, RoutePublisher, Router, RouterConfig};
use crate::telemetry::metrics::Telemetry;
use crate::telemetry::sampler::{NicNow, Sampler, Totals};
use crate::topology::PathType;
use crate::transport::fair::FairShare;
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use crate::transport::memory::UserBuf;
use crate::transport::netlink::LinkWatcher;
use crate::transport::Fabric;
use budget::SpinBudget;

/// One local NIC as the reactor needs it.
#[derive(Debug, Clone)]
pub struct LocalNic {
    pub name: String,
    pub ip: IpAddr,
    pub rail: Option<u32>,
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
    pub router: RouterConfig,
    /// Where counters and events are recorded (the reactor batches them).
    pub telemetry: Arc<Telemetry>,
    /// Handshake randomness from this seed instead of the OS: only for the deterministic
    /// simulation, whose runs must replay exactly. `None` in production.
    pub entropy_seed: Option<u64>,
}

/// How long our own connect may wait for the listener's `Welcome`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an accepted connection has to authenticate. Real handshakes take a round
/// trip or two: the reactor answers a Hello whether or not NCCL has called `accept`.
const PREAUTH_DEADLINE: Duration = Duration::from_secs(2);
/// Connections one listener accepts per reactor turn: between batches the reactor reads
/// the Hellos that arrived, so a flood cannot evict a real handshake before it is seen.
const ACCEPT_BATCH: usize = 32;

/// The reactor thread's name (Linux keeps 15 characters: this fits whole in `ps`/`top`).
pub const REACTOR_THREAD: &str = "rlvr-reactor";

const WAKER: Token = Token(usize::MAX);
const NETLINK: Token = Token(usize::MAX - 1);
const LISTENER_BIT: usize = 1 << (usize::BITS - 2);

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
    /// Bytes sent again after a move.
    pub replayed_bytes: AtomicU64,
    /// Duplicates the receivers dropped.
    pub duplicates: AtomicU64,
    /// Carrier changes seen on local NICs.
    pub link_events: AtomicU64,
}

/// Handle kept by the runtime: the queue and the thread to join.
#[derive(Debug)]
pub struct ReactorHandle {
    pub queue: Arc<CommandQueue>,
    pub stats: Arc<ReactorStats>,
    /// Route snapshots the reactor publishes after every decision; readers never lock.
    pub routes: Arc<RoutePublisher>,
    /// This process's NICs as peers see them (their failover listeners).
    pub wire_nics: Vec<NicAddr>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ReactorHandle {
    /// Starts the reactor thread: one failover listener per NIC, the link watcher, the
    /// router.
    /// `fabric` drives the lanes; its NICs are `setup.nics`, index for index.
    pub fn spawn<F: Fabric>(setup: Setup, fabric: F) -> io::Result<ReactorHandle> {
        let mut reactor = Reactor::new(setup, fabric)?;
        reactor.watch_links()?;
        let (queue, stats, routes) = (
            reactor.queue.clone(),
            reactor.stats.clone(),
            reactor.routes.clone(),
        );
        let wire_nics = reactor.wire.clone();
        let thread = std::thread::Builder::new()
            .name(REACTOR_THREAD.into())
            .spawn(move || run_guarded(reactor))?;
        Ok(ReactorHandle {
            queue,
            stats,
            routes,
            wire_nics,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Stops the thread and waits for it.
    pub fn shutdown(&self) {
        if let Some(t) = self.thread.lock().take() {
            self.queue.push(Command::Shutdown);
            if t.join().is_err() {
                tracing::warn!("railover reactor thread panicked");
            }
        }
    }
}

/// Runs the reactor until shutdown, and fails loudly if it panics. The catch is around
/// the whole loop, not each turn: a panic can leave a machine, a lane or the router
/// half-updated, and running on from there could deliver wrongly (P4). So the state is
/// dropped unread (closing every socket, so peers see the end at once), and the queue is
/// poisoned: requests in flight and every later call fail with `ncclInternalError`
/// instead of waiting forever (P5), and `finalize` still joins this thread.
fn run_guarded<F: Fabric>(mut reactor: Reactor<F>) {
    let queue = reactor.queue.clone();
    let Err(panic) = catch_unwind(AssertUnwindSafe(|| reactor.run())) else {
        return;
    };
    let message = panic_message(&*panic);
    // Dropping touches no user memory; a panic in some Drop must not stop the poisoning.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(reactor)));
    queue.poison(message);
}

/// A message's buffer and the request NCCL tests.
#[derive(Debug)]
struct Pending {
    buf: UserBuf,
    req: Arc<Request>,
}

#[derive(Debug)]
struct Comm {
    shared: Arc<CommShared>,
    machine: CommMachine<Pending>,
    /// The session secret its first handshake agreed; migrations and probes prove it.
    session: Session,
    /// Send side: the comm is registered with the router.
    route: Option<Route>,
    /// Its lane, the replacement being opened, attempts, detection and the receiver's
    /// wait for a replacement.
    path: PathMachine,
}

#[derive(Debug, Clone, Copy)]
struct Route {
    current: Pair,
}

#[derive(Debug)]
enum Role {
    /// Accepted and not yet authenticated (see `Lane::auth`). `listener` is the NCCL
    /// listen id, or `None` for a failover listener.
    Handshake { listener: Option<u64> },
    /// Connecting; waiting for the listener's `Welcome`.
    Connecting {
        pending: Arc<PendingConnect>,
        nic: usize,
        to: SocketAddr,
    },
    /// Carrying a comm.
    Comm(usize),
    /// Probing a candidate pair for the router, since `started`.
    Probe { pair: Pair, started: Instant },
    /// Answering a probe: receiving its payload before the `Welcome`.
    ProbeSink,
    /// Opening a comm's replacement lane.
    Migrating { comm: usize, mv: Move },
    /// Flushing its last bytes before it closes.
    Closing,
}

#[derive(Debug)]
struct Lane<F: Fabric> {
    sock: F::Lane,
    reader: FrameReader,
    writer: FrameWriter,
    role: Role,
    /// Its handshake, deadline and liveness.
    m: LaneMachine,
    /// Its place in the handshake caps (accepted lanes not yet authenticated).
    ticket: Option<u64>,
    /// Local NIC index, when the lane's local address is one of ours.
    nic: Option<usize>,
}

impl<F: Fabric> Lane<F> {
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

struct Listener<F: Fabric> {
    /// `None` only while being registered.
    sock: Option<F::Listener>,
    /// The NCCL listen comm, or `None` for a NIC's failover listener.
    shared: Option<Arc<ListenShared>>,
    nic: usize,
}

struct Reactor<F: Fabric> {
    poll: Poll,
    fabric: F,
    queue: Arc<CommandQueue>,
    stats: Arc<ReactorStats>,
    /// Our NICs as peers see them.
    wire: Vec<NicAddr>,
    nic_up: Vec<bool>,
    budget: SpinBudget,
    listeners: Slab<Listener<F>>,
    listener_ids: HashMap<u64, usize>,
    lanes: Slab<Lane<F>>,
    comms: Slab<Comm>,
    /// Lanes with queued output to flush at the end of the turn.
    dirty: Vec<usize>,
    /// Lanes that stopped on their per-call budget and must be served again.
    again: Vec<usize>,
    /// Listeners with connections to accept, served after the turn's lane events.
    accepting: Vec<usize>,
    next_deadline: Option<Instant>,
    shutdown: bool,
    router: Router,
    routes: Arc<RoutePublisher>,
    routes_dirty: bool,
    /// Remote processes' NIC lists; the index is the router's `PeerId`.
    peers: Vec<Vec<NicAddr>>,
    /// Receive comms by id, for migrations and probes.
    recv_by_id: HashMap<CommId, usize>,
    /// Accepted connections that have not authenticated yet.
    gate: gate::Gate,
    /// Log lines about connections turned away, rate-limited.
    turned_away: gate::LogLimit,
    watcher: Option<LinkWatcher>,
    next_tick: Instant,
    setup: Setup,
    metrics: Sampler,
    /// Local NICs cut by fault injection, and the sockets they swallowed: kept open and
    /// never served, as a dead cable would leave them, until the NIC is restored.
    injected_down: Vec<bool>,
    graveyard: Vec<F::Lane>,
    /// Pacing caps that share each NIC evenly between its backlogged lanes.
    fair: FairShare,
    /// Seeded handshake randomness (simulation only); `None`: the OS's.
    entropy: Option<SplitMix64>,
}

impl<F: Fabric> Reactor<F> {
    /// A reactor over `fabric`, its failover listeners open, not yet running.
    fn new(setup: Setup, mut fabric: F) -> io::Result<Reactor<F>> {
        if fabric.nics().len() != setup.nics.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the fabric has {} NICs, the reactor was given {}",
                    fabric.nics().len(),
                    setup.nics.len()
                ),
            ));
        }
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let mut listeners = Slab::new();
        let mut wire_nics = Vec::new();
        for (i, nic) in setup.nics.iter().enumerate() {
            let (mut l, addr) = fabric.listen(i)?;
            let key = listeners.insert(Listener {
                sock: None,
                shared: None,
                nic: i,
            });
            poll.registry()
                .register(&mut l, Token(key | LISTENER_BIT), Interest::READABLE)?;
            listeners[key].sock = Some(l);
            wire_nics.push(NicAddr {
                addr,
                rail: nic.rail,
            });
        }
        let routes = Arc::new(RoutePublisher::new(routing::Routes::default()));
        let mut router_cfg = setup.router;
        if router_cfg.seed == 0 {
            let mut b = [0u8; 8];
            let _ = getrandom::getrandom(&mut b);
            router_cfg.seed = u64::from_le_bytes(b) | 1;
        }
        let queue = Arc::new(CommandQueue::new(waker));
        let stats = Arc::new(ReactorStats::default());
        let now = Instant::now();
        let entropy = setup.entropy_seed.map(SplitMix64::new);
        Ok(Reactor {
            poll,
            fabric,
            queue,
            stats,
            wire: wire_nics,
            nic_up: vec![true; setup.nics.len()],
            budget: SpinBudget::new(setup.spin),
            listeners,
            listener_ids: HashMap::new(),
            lanes: Slab::new(),
            comms: Slab::new(),
            dirty: Vec::new(),
            again: Vec::new(),
            accepting: Vec::new(),
            next_deadline: None,
            shutdown: false,
            router: Router::new(router_cfg),
            routes,
            routes_dirty: false,
            peers: Vec::new(),
            recv_by_id: HashMap::new(),
            gate: gate::Gate::new(gate::PER_LISTENER, gate::TOTAL),
            turned_away: gate::LogLimit::new(gate::LOG_INTERVAL),
            watcher: None,
            next_tick: now,
            injected_down: vec![false; setup.nics.len()],
            graveyard: Vec::new(),
            fair: FairShare::new(),
            metrics: Sampler::new(setup.nics.len(), now),
            entropy,
            setup,
        })
    }

    /// Watches the kernel's carrier changes of local NICs, when it can.
    fn watch_links(&mut self) -> io::Result<()> {
        let watcher = match LinkWatcher::open() {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(
                    "railover: cannot watch link events ({e}); relying on lane timeouts"
                );
                return Ok(());
            }
        };
        let fd = watcher.raw_fd();
        self.poll.registry().register(
            &mut mio::unix::SourceFd(&fd),
            NETLINK,
            Interest::READABLE,
        )?;
        self.watcher = Some(watcher);
        Ok(())
    }

    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        let mut ready = Vec::with_capacity(1024);
        while !self.shutdown {
            let now = Instant::now();
            self.before_poll(now);
            if self.shutdown {
                break;
            }
            let busy =
                !self.again.is_empty() || !self.accepting.is_empty() || self.requests_in_flight();
            let mut timeout = self.budget.timeout(now, busy, self.next_wakeup());
            if !self.again.is_empty() || !self.accepting.is_empty() {
                timeout = Some(Duration::ZERO);
            }
            if timeout != Some(Duration::ZERO) {
                self.queue.parked.store(true, Ordering::SeqCst);
                if self.queue.len.load(Ordering::SeqCst) > 0 {
                    timeout = Some(Duration::ZERO);
                }
            }
            let polled = self.poll.poll(&mut events, timeout);
            self.queue.parked.store(false, Ordering::SeqCst);
            if events.is_empty() {
                self.metrics.idle(now.elapsed());
            }
            if let Err(e) = polled {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::warn!("railover reactor: epoll failed: {e}");
                }
                continue;
            }
            let now = Instant::now();
            if !events.is_empty() {
                self.budget.progress(now);
            } else if timeout == Some(Duration::ZERO) && self.again.is_empty() {
                // An empty spin turn: let other runnable threads (NCCL's own) have the
                // core, as NCCL's proxy loop does.
                std::thread::yield_now();
            }
            ready.clear();
            ready.extend(events.iter().map(|ev| ev.token()));
            self.after_poll(&ready, now);
        }
        self.close_everything();
        // Anyone still waiting on a close: the comm is gone with the reactor.
        self.queue.stop();
    }

    /// The first half of a turn: queued commands, lanes left over from the last turn,
    /// the router's decisions, and output.
    fn before_poll(&mut self, now: Instant) {
        let cmds = self.queue.take();
        if !cmds.is_empty() {
            self.budget.progress(now);
        }
        for c in cmds {
            self.command(c, now);
        }
        if self.shutdown {
            return;
        }
        for k in std::mem::take(&mut self.again) {
            self.service_lane(k, now);
        }
        self.drive_router(now);
        self.flush_dirty(now);
    }

    /// The second half: what readiness reported, then every timer that is due.
    fn after_poll(&mut self, ready: &[Token], now: Instant) {
        for &token in ready {
            match token {
                WAKER => {}
                NETLINK => self.link_events(now),
                Token(t) if t & LISTENER_BIT != 0 => self.accepting.push(t & !LISTENER_BIT),
                Token(k) => self.service_lane(k, now),
            }
        }
        // After the lanes: a Hello that arrived meanwhile is read before a flood's
        // next batch of connections can push its lane out of the handshake caps.
        let mut accepting = std::mem::take(&mut self.accepting);
        accepting.sort_unstable();
        accepting.dedup();
        for key in accepting {
            self.accept_all(key, now);
        }
        if self.next_deadline.is_some_and(|d| d <= now) {
            self.expire(now);
        }
        if now >= self.next_tick {
            self.tick(now);
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
        self.drive_router(now);
        self.flush_dirty(now);
    }

    /// The earliest time a timer of the reactor (lane deadlines, the periodic tick, the
    /// router's) is due.
    fn next_wakeup(&self) -> Option<Instant> {
        [
            self.next_deadline,
            Some(self.next_tick),
            self.router.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn requests_in_flight(&self) -> bool {
        self.comms.iter().any(|(_, c)| c.machine.pending() > 0)
    }

    fn command(&mut self, c: Command, now: Instant) {
        match c {
            Command::Listen { nic, shared, reply } => reply.finish(self.listen(nic, shared)),
            Command::CloseListen { shared } => self.close_listen(&shared, now),
            Command::Connect {
                nic,
                to,
                token,
                pending,
            } => {
                if let Err(e) = self.connect(nic, to, &token, &pending, now) {
                    *pending.result.lock() = Some(Err(e));
                }
            }
            Command::Send { comm, req, buf } => self.post(&comm, Side::Send, Pending { buf, req }),
            Command::Recv { comm, req, buf } => self.post(&comm, Side::Recv, Pending { buf, req }),
            Command::CloseComm { comm, done } => {
                self.close_comm(&comm, now);
                done.signal();
            }
            Command::InjectLink { nic, up } => self.inject_link(nic, up, now),
            Command::Shutdown => self.shutdown = true,
            Command::Panic(message) => panic!("{message}"),
        }
    }

    /// Opens NCCL's listener on local NIC `nic`.
    fn listen(&mut self, nic: usize, shared: Arc<ListenShared>) -> Result<SocketAddr, Error> {
        let (mut listener, addr) = self.fabric.listen(nic)?;
        let entry = self.listeners.vacant_entry();
        let key = entry.key();
        if let Err(e) = self.poll.registry().register(
            &mut listener,
            Token(key | LISTENER_BIT),
            Interest::READABLE,
        ) {
            tracing::warn!("railover: cannot watch a listener: {e}");
            return Err(e.into());
        }
        self.listener_ids.insert(shared.id, key);
        entry.insert(Listener {
            sock: Some(listener),
            shared: Some(shared),
            nic,
        });
        Ok(addr)
    }

    fn close_listen(&mut self, shared: &ListenShared, now: Instant) {
        if let Some(key) = self.listener_ids.remove(&shared.id) {
            let mut l = self.listeners.remove(key);
            if let Some(sock) = l.sock.as_mut() {
                let _ = self.poll.registry().deregister(sock);
            }
        }
        // Accepted comms NCCL never took die with their listener.
        let orphans: Vec<_> = shared.ready.lock().drain(..).collect();
        for comm in orphans {
            self.close_comm(&comm, now);
        }
    }

    /// Connects from local NIC `nic` to NCCL's listener at `to`, keyed by its `token`.
    fn connect(
        &mut self,
        nic: usize,
        to: SocketAddr,
        token: &[u8; 16],
        pending: &Arc<PendingConnect>,
        now: Instant,
    ) -> Result<(), Error> {
        let random = fresh_random(&mut self.entropy)?;
        let stream = self.fabric.connect(nic, to).inspect_err(|e| {
            tracing::warn!("railover: connect to {to} failed: {e}");
        })?;
        let (auth, hello) = Initiator::connect(token, self.wire.clone(), &random);
        let pending = pending.clone();
        let k = self.add_lane(
            stream,
            Role::Connecting { pending, nic, to },
            now,
            HANDSHAKE_TIMEOUT,
        )?;
        let lane = &mut self.lanes[k];
        lane.nic = Some(nic);
        lane.m.connecting(auth, hello);
        self.dirty.push(k);
        Ok(())
    }

    /// A send or receive NCCL posted on `comm`.
    fn post(&mut self, comm: &Arc<CommShared>, side: Side, p: Pending) {
        let len = p.buf.len() as u64;
        let Some(c) = self.comm_of(comm) else {
            let what = match side {
                Side::Send => "send on a closed comm",
                Side::Recv => "receive on a closed comm",
            };
            return p.req.fail(Error::InvalidArgument(what.into()));
        };
        if let Err(p) = self.comms[c].machine.post(side == Side::Send, len, p) {
            let e = Error::InvalidArgument("send or receive on a comm of the other side".into());
            return p.req.fail(e);
        }
        self.pump(c);
    }

    fn comm_of(&self, shared: &Arc<CommShared>) -> Option<usize> {
        self.comms
            .get(shared.key)
            .filter(|c| Arc::ptr_eq(&c.shared, shared))
            .map(|_| shared.key)
    }

    fn add_lane(
        &mut self,
        mut sock: F::Lane,
        role: Role,
        now: Instant,
        limit: Duration,
    ) -> io::Result<usize> {
        self.arm(now + limit);
        let entry = self.lanes.vacant_entry();
        let key = entry.key();
        self.poll.registry().register(
            &mut sock,
            Token(key),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        entry.insert(Lane {
            sock,
            reader: FrameReader::default(),
            writer: FrameWriter::default(),
            role,
            m: LaneMachine::new(self.setup.completion_timeout, now, limit),
            ticket: None,
            nic: None,
        });
        Ok(key)
    }

    fn drop_lane(&mut self, k: usize) {
        self.fair.forget(k);
        self.leave_gate(k);
        if let Some(mut lane) = self.lanes.try_remove(k) {
            let _ = self.poll.registry().deregister(&mut lane.sock);
            self.fabric.close(lane.sock);
        }
    }

    /// Lane `k` no longer counts against the handshake caps.
    fn leave_gate(&mut self, k: usize) {
        if let Some(t) = self.lanes.get_mut(k).and_then(|l| l.ticket.take()) {
            self.gate.leave(t);
            self.stats
                .handshakes_pending
                .store(self.gate.len() as u64, Ordering::Relaxed);
        }
    }

    /// Logs a connection turned away before it authenticated: the first of a burst at
    /// once, the rest as a count every `gate::LOG_INTERVAL`.
    fn turned_away(&mut self, what: &str, now: Instant) {
        if let Some(line) = self.turned_away.hit(now, what) {
            tracing::warn!("railover: turned away an incoming connection: {line}");
        }
    }

    /// Drops lane `k`, still in its handshake under `ticket`, to keep the caps.
    fn evict(&mut self, ticket: u64, k: usize, now: Instant) {
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
        self.drop_lane(k);
        self.turned_away(
            "too many connections in their handshake; dropped the oldest",
            now,
        );
    }

    /// Accepts up to `ACCEPT_BATCH` connections; a listener with more left is served
    /// again next turn.
    fn accept_all(&mut self, key: usize, now: Instant) {
        for _ in 0..ACCEPT_BATCH {
            let Some(l) = self.listeners.get_mut(key) else {
                return;
            };
            let Some(sock) = l.sock.as_mut() else { return };
            match self.fabric.accept(sock) {
                Ok(Some((stream, nic))) => {
                    if self.injected_down.get(l.nic).copied().unwrap_or(false) {
                        // A cut NIC answers nothing.
                        self.graveyard.push(stream);
                        continue;
                    }
                    let listener = l.shared.as_ref().map(|s| s.id);
                    let nic = nic.or(Some(l.nic));
                    let role = Role::Handshake { listener };
                    match self.add_lane(stream, role, now, PREAUTH_DEADLINE) {
                        Ok(k) => {
                            let (ticket, evict) = self.gate.admit(k, key);
                            let lane = &mut self.lanes[k];
                            lane.nic = nic;
                            lane.m.listening();
                            lane.ticket = Some(ticket);
                            for (t, old) in evict {
                                self.evict(t, old, now);
                            }
                            let st = &self.stats;
                            st.handshakes_pending
                                .store(self.gate.len() as u64, Ordering::Relaxed);
                            st.handshakes_peak
                                .store(self.gate.peak() as u64, Ordering::Relaxed);
                            // A connector writes its Hello at once: reading it now
                            // tells a real handshake from an idle one before the next
                            // accept could push it out.
                            self.service_lane(k, now);
                        }
                        Err(e) => tracing::warn!("railover: cannot watch an accepted socket: {e}"),
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                        // Out of descriptors: a stranger's unfinished handshake yields.
                        if let Some((t, old)) = self.gate.oldest() {
                            self.evict(t, old, now);
                            continue;
                        }
                    }
                    // Leave the rest in the backlog for the next event.
                    self.turned_away(&format!("accept failed: {e}"), now);
                    return;
                }
            }
        }
        self.accepting.push(key);
    }

    /// Reads everything the lane has, feeding the machines; then queues its output.
    fn service_lane(&mut self, k: usize, now: Instant) {
        loop {
            let Some(lane) = self.lanes.get_mut(k) else {
                return;
            };
            let before = lane.reader.total_read();
            let got = self.fabric.read(&mut lane.sock, &mut lane.reader);
            if lane.reader.total_read() != before {
                lane.m.handle_rx(now);
            }
            match got {
                Ok(Some(item)) => {
                    if let Err(e) = self.inbound(k, item, now) {
                        self.fail_lane(k, Cause::error(e), now);
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
                    self.fail_lane(k, Cause::error(e), now);
                    return;
                }
            }
        }
        self.dirty.push(k);
    }

    /// One item from lane `k`: its machine says what it means, the reactor acts on it.
    fn inbound(&mut self, k: usize, item: Inbound, now: Instant) -> Result<(), ConnError> {
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
            (Step::Proof, _) => self.proof(k, body, now),
            (Step::ProbeCrossed, _) => {
                lane.writer.push_ctrl(
                    &Welcome {
                        nics: self.wire.clone(),
                    }
                    .encode(0),
                );
                lane.role = Role::Closing;
                Ok(())
            }
            (Step::Welcomed { nics, session, .. }, Role::Connecting { pending, nic, to }) => {
                let (pending, nic, to) = (pending.clone(), *nic, *to);
                let session = session
                    .ok_or_else(|| ConnError::Protocol("the handshake agreed no session".into()))?;
                let shared = self.new_comm(Side::Send, k, nic, session);
                self.register_route(shared.key, nic, to, nics, now);
                *pending.result.lock() = Some(Ok(shared));
                Ok(())
            }
            (Step::Welcomed { .. }, &Role::Probe { pair, started }) => {
                lane.role = Role::Closing;
                lane.m.linger(now);
                self.probe_answered(pair, started, now);
                Ok(())
            }
            (Step::Welcomed { delivered, .. }, &Role::Migrating { comm, mv }) => {
                self.finish_migration(comm, k, mv, delivered, now)
            }
            (Step::Comm, &Role::Comm(c)) => {
                self.comm_inbound(c, k, item)?;
                self.pump(c);
                Ok(())
            }
            (step, role) => Err(ConnError::Protocol(format!(
                "{step:?} on a lane in {role:?}"
            ))),
        }
    }

    fn comm_inbound(&mut self, c: usize, k: usize, item: Inbound) -> Result<(), ConnError> {
        let comm = &mut self.comms[c];
        match item {
            Inbound::Frame(h, _) => {
                if comm.machine.handle_frame(&h)? {
                    comm.path.handle_resumed();
                }
            }
            Inbound::Data { seq, len } => {
                let dst = comm.machine.handle_data(seq, len)?.map(|p| p.buf.lend());
                if dst.is_none() {
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                self.lanes[k].reader.place(dst);
            }
            Inbound::PayloadDone { seq, len } => {
                self.stats.bytes_received.fetch_add(len, Ordering::Relaxed);
                self.metrics.message(self.lanes[k].nic, false, len);
                comm.machine.handle_payload_done(seq, len)?;
            }
            Inbound::Eof => return Err(ConnError::PeerClosed),
        }
        Ok(())
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
        let token = listener
            .and_then(|id| self.listener_ids.get(&id))
            .and_then(|&key| self.listeners[key].shared.as_ref())
            .map(|s| s.token);
        let (recv_by_id, comms) = (&self.recv_by_id, &self.comms);
        let secret = |purpose, id| match purpose {
            Purpose::Data => token.map(Secret::Token),
            Purpose::Probe | Purpose::Migrate => recv_by_id
                .get(&id)
                .and_then(|&c| comms.get(c))
                .map(|c| Secret::Session(c.session.clone())),
        };
        let lane = &mut self.lanes[k];
        match lane.m.handle_hello(body, secret, &random, now)? {
            None => {
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
    fn proof(&mut self, k: usize, body: &[u8], now: Instant) -> Result<(), ConnError> {
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
        match accepted.purpose {
            Purpose::Data => {
                let shared = listener
                    .and_then(|id| self.listener_ids.get(&id))
                    .and_then(|&key| self.listeners[key].shared.clone());
                let (Some(shared), Some(session)) = (shared, accepted.session) else {
                    // The NCCL listener closed during the handshake.
                    self.refuse(k, &AuthError::NotHere(Purpose::Data), now);
                    return Ok(());
                };
                let nic = self.lanes[k].nic.unwrap_or(0);
                let id = session.id();
                let comm = self.new_comm(Side::Recv, k, nic, session);
                self.recv_by_id.insert(id, comm.key);
                self.lanes[k].writer.push_ctrl(
                    &Welcome {
                        nics: self.wire.clone(),
                    }
                    .encode(0),
                );
                shared.ready.lock().push_back(comm);
            }
            // Its payload crosses before the Welcome (see `LaneMachine::handle_proof`).
            Purpose::Probe => self.lanes[k].role = Role::ProbeSink,
            Purpose::Migrate => match self.recv_by_id.get(&accepted.comm).copied() {
                Some(c) => self.attach_replacement(c, k, accepted.epoch, now),
                None => self.refuse(k, &AuthError::NotHere(Purpose::Migrate), now),
            },
        }
        Ok(())
    }

    /// Refuses a connection that failed to authenticate, and counts it.
    fn refuse(&mut self, k: usize, why: &AuthError, now: Instant) {
        self.lanes[k].m.refuse(now);
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
        let shared = Arc::new(CommShared::new(side, key, self.queue.clone(), nic));
        entry.insert(Comm {
            shared: shared.clone(),
            machine: CommMachine::new(side == Side::Send),
            session,
            route: None,
            path: PathMachine::new(side == Side::Send, timeouts, lane),
        });
        let l = &mut self.lanes[lane];
        l.role = Role::Comm(key);
        l.m.carry();
        l.reader.enlarge();
        shared
    }

    /// Moves the machine's output onto its lane and its outcomes onto the requests.
    fn pump(&mut self, c: usize) {
        let comm = &mut self.comms[c];
        // Without a lane (failover under way) the machine keeps its queue.
        if let Some(lane) = comm.path.lane().and_then(|k| self.lanes.get_mut(k)) {
            while let Some(out) = comm.machine.poll_transmit() {
                match out {
                    Out::Frame(h) => lane.writer.push_ctrl(&h.encode()),
                    Out::Data { seq, len } => {
                        let p = comm
                            .machine
                            .message(seq)
                            .expect("transmitting a queued message");
                        lane.writer
                            .push_ctrl(&Header::new(Kind::Data, seq, len).encode());
                        lane.writer.push_payload(p.buf.lend(), len as usize);
                        self.stats.bytes_sent.fetch_add(len, Ordering::Relaxed);
                        self.metrics.message(lane.nic, true, len);
                    }
                }
            }
        }
        while let Some((p, outcome)) = comm.machine.poll_outcome() {
            match outcome {
                Ok(len) => p.req.complete(len),
                Err(e) => p.req.fail(e.into()),
            }
        }
        if let Some(k) = comm.path.lane() {
            self.dirty.push(k);
        }
    }

    fn flush_dirty(&mut self, now: Instant) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for k in dirty.drain(..) {
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            lane.sync();
            if lane.writer.is_empty() {
                if matches!(lane.role, Role::Closing) {
                    self.drop_lane(k);
                }
                continue;
            }
            let before = lane.writer.total_written();
            let res = self.fabric.write(&mut lane.sock, &mut lane.writer);
            if lane.writer.total_written() != before {
                lane.m.handle_tx(now);
            }
            match res {
                Ok(()) => {
                    if lane.writer.wants_more() {
                        self.again.push(k);
                    } else if lane.writer.is_empty() && matches!(lane.role, Role::Closing) {
                        self.drop_lane(k);
                    }
                }
                Err(e) => self.fail_lane(k, Cause::error(io_error(&e)), now),
            }
        }
        self.dirty = dirty;
    }

    fn close_comm(&mut self, shared: &Arc<CommShared>, now: Instant) {
        let Some(c) = self.comm_of(shared) else {
            return;
        };
        let comm = self.comms.remove(c);
        if comm.route.is_some() {
            self.router.remove_comm(routing::CommId(c));
            self.routes_dirty = true;
        }
        if self.recv_by_id.get(&comm.session.id()) == Some(&c) {
            self.recv_by_id.remove(&comm.session.id());
        }
        let mut m = comm.machine;
        m.handle_lane_lost(ConnError::PeerClosed);
        while let Some((p, _)) = m.poll_outcome() {
            let e = Error::InvalidArgument("comm closed with the request outstanding".into());
            p.req.fail(e);
        }
        if let Some(k) = comm.path.migrating() {
            self.drop_lane(k);
        }
        if let Some(k) = comm.path.lane() {
            let lane = &mut self.lanes[k];
            if lane.writer.holds_payload() {
                // NCCL may free its buffers once close returns: never write from them
                // again. The peer sees the stream end and fails what it still waits for.
                self.drop_lane(k);
            } else {
                // Let the last acks and CTS reach the peer, but do not wait for it.
                lane.role = Role::Closing;
                lane.m.linger(now);
                self.arm(now + LINGER);
                self.dirty.push(k);
            }
        }
    }

    /// Runs the lanes' timers that are due: handshakes, probes and migrations that took
    /// too long, lingering lanes, silence and keepalives.
    fn expire(&mut self, now: Instant) {
        let mut failed = Vec::new();
        for (k, lane) in self.lanes.iter_mut() {
            if lane.m.poll_timeout().is_some_and(|d| d <= now) {
                lane.m.handle_timeout(now);
                if lane.sync() {
                    self.dirty.push(k);
                }
                failed.extend(lane.m.poll_failure().map(|c| (k, c)));
            }
        }
        for (k, cause) in failed {
            self.lane_condemned(k, cause, now);
        }
        self.next_deadline = self
            .lanes
            .iter()
            .filter_map(|(_, l)| l.m.poll_timeout())
            .min();
    }

    /// A lane timer may be due at `at`.
    fn arm(&mut self, at: Instant) {
        self.next_deadline = Some(self.next_deadline.map_or(at, |d| d.min(at)));
    }

    fn close_everything(&mut self) {
        let keys: Vec<usize> = self.comms.iter().map(|(k, _)| k).collect();
        for c in keys {
            let shared = self.comms[c].shared.clone();
            self.close_comm(&shared, Instant::now());
        }
        // A close and the shutdown can arrive in one turn: hand the last acks to the
        // kernel (best effort, no waiting) before the lanes go, or the peer's final
        // sends, already delivered here, would fail for want of their ack.
        self.flush_dirty(Instant::now());
        let lanes: Vec<usize> = self.lanes.iter().map(|(k, _)| k).collect();
        for k in lanes {
            if let Some(Role::Connecting { pending, .. }) = self.lanes.get(k).map(|l| &l.role) {
                *pending.result.lock() = Some(Err(Error::Internal("plugin finalised".into())));
            }
            self.drop_lane(k);
        }
        for (_, mut l) in std::mem::take(&mut self.listeners) {
            if let Some(sock) = l.sock.as_mut() {
                let _ = self.poll.registry().deregister(sock);
            }
        }
        if let Some(w) = &self.watcher {
            let fd = w.raw_fd();
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&fd));
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
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_state_is_thread_safe() {
        assert_send_sync::<CommandQueue>();
        assert_send_sync::<ReactorStats>();
        assert_send_sync::<CommShared>();
        assert_send_sync::<Request>();
        assert_send_sync::<ListenShared>();
    }
}
