//! The reactor: the one owner, per process, of every socket and, through its
//! [`Engine`], of every comm's protocol machine.
//!
//! It opens every listener and lane itself, through a [`Fabric`] it is given at
//! [`ReactorHandle::spawn`]; it names no fabric's types and makes no fabric's calls, so
//! lanes may be TCP streams or RC QPs alike.
//!
//! Its turns run on whichever thread holds it ([`owner`]): NCCL's own, in `test` and the
//! other calls, whenever the reactor is free (`RAILOVER_PROGRESS=caller`, the default),
//! else the reactor thread `rlvr-reactor`, which covers what no caller drives.
//!
//! What producers (NCCL's threads, through [`crate::plugin`]) can rely on:
//! * a command pushed with [`CommandQueue::push`] is seen by the reactor's next turn; if
//!   the reactor thread is parked in `epoll`, `push` wakes it (one `eventfd` write),
//!   otherwise it costs no system call. [`CommandQueue::drive`] then runs that turn on
//!   the caller's thread if nobody holds the reactor, and never waits if somebody does;
//! * only the reactor's owner of the moment touches a comm's machine, lanes and buffers;
//!   outcomes reach NCCL through each request's atomic state;
//! * after the last context is finalised, the reactor thread exits and is joined, so the
//!   library can be unloaded;
//! * if a turn panics, on any thread, the reactor stops for good: requests in flight and
//!   every later call fail with `ncclInternalError`, closes return at once, one WARN
//!   gives the panic's message ([`CommandQueue::check`]).
//!
//! Not guaranteed, merely today's behaviour: the reactor thread busy-polls for
//! `RAILOVER_SPIN_US` after its last progress while requests are in flight and no caller
//! drives, then parks.
//!
//! The reactor keeps only I/O: the thread, `epoll`, the fabric's listeners and lanes,
//! the spin budget and netlink. Everything else (comms, lane machines, handshakes,
//! failover, timers' work) is the [`crate::engine`]'s; the reactor feeds it readiness,
//! commands and the time, and lends it the lanes' sockets through [`engine::Io`].

pub mod budget;
#[cfg(test)]
pub(crate) mod driven;
pub mod owner;

pub use crate::engine::gate::{IDLE_TOTAL as HANDSHAKES_IDLE_TOTAL, TOTAL as HANDSHAKES_TOTAL};
pub use crate::engine::{LocalNic, ReactorStats, Setup};

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Registry, Token, Waker};
use parking_lot::Mutex;
use slab::Slab;

use crate::config::Progress;
use crate::conn::wire::NicAddr;
use crate::engine::{self, Engine};
use crate::handoff::{Command, CommandQueue, Drive, Error, ListenShared};
use crate::routing::RoutePublisher;
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use crate::transport::netlink::LinkWatcher;
use crate::transport::{Fabric, LaneProgress};
use budget::SpinBudget;
use owner::Owner;

/// Connections one listener accepts per reactor turn: between batches the reactor reads
/// the Hellos that arrived, so a flood cannot evict a real handshake before it is seen.
const ACCEPT_BATCH: usize = 32;
/// How soon a listener whose connections wait in the backlog (the handshake gate was
/// full) is tried again when no event comes first.
const BACKLOG_RETRY: Duration = Duration::from_millis(5);
/// NCCL connects dialled per turn. At communicator init an all-to-all job asks for
/// thousands at once; dialling them all in one turn (a socket, a key exchange and a
/// Hello each) held every Hello back until the last was dialled, so the listeners saw
/// hundreds of silent connections and dropped them as idle.
const CONNECTS_PER_TURN: usize = 64;

/// The reactor thread's name (Linux keeps 15 characters: this fits whole in `ps`/`top`).
pub const REACTOR_THREAD: &str = "rlvr-reactor";

const WAKER: Token = Token(usize::MAX);
const NETLINK: Token = Token(usize::MAX - 1);
const FABRIC_CARRIER: Token = Token(usize::MAX - 2);
const LISTENER_BIT: usize = 1 << (usize::BITS - 2);

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
    /// Starts the reactor: one failover listener per NIC, the link watcher, the router,
    /// and the reactor thread. With [`Progress::Caller`], NCCL's threads also run turns
    /// through [`CommandQueue::drive`] ([`owner`]).
    /// `fabric` drives the lanes; its NICs are `setup.nics`, index for index.
    pub fn spawn<F: Fabric>(
        setup: Setup,
        fabric: F,
        progress: Progress,
    ) -> io::Result<ReactorHandle> {
        let names: Vec<String> = setup.nics.iter().map(|n| n.name.clone()).collect();
        let mut reactor = Reactor::new(setup, fabric)?;
        reactor.watch_links()?;
        reactor.seed_carriers(&names);
        let (queue, stats, routes) = (
            reactor.queue.clone(),
            reactor.engine.stats().clone(),
            reactor.engine.routes().clone(),
        );
        let wire_nics = reactor.engine.wire().to_vec();
        let owner = Arc::new(Owner::new(reactor));
        let callers = progress == Progress::Caller;
        if callers {
            let weak: Weak<dyn Drive> = Arc::downgrade(&owner) as Weak<Owner<F>>;
            queue.driven_by(weak);
        }
        let thread = std::thread::Builder::new()
            .name(REACTOR_THREAD.into())
            .spawn(move || owner.run_thread(callers))?;
        Ok(ReactorHandle {
            queue,
            stats,
            routes,
            wire_nics,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Stops the reactor and waits for its thread.
    pub fn shutdown(&self) {
        if let Some(t) = self.thread.lock().take() {
            self.queue.push(Command::Shutdown);
            // It may be sleeping while callers drive: let it see the shutdown now.
            t.thread().unpark();
            if t.join().is_err() {
                tracing::warn!("railover reactor thread panicked");
            }
        }
    }
}

/// The lanes' sockets, filed under the engine's lane keys, and the fabric that drives
/// them: what the reactor lends the engine as its [`engine::Io`].
struct Sockets<F: Fabric> {
    registry: Registry,
    fabric: F,
    lanes: Vec<Option<F::Lane>>,
    /// Sockets of lanes on a NIC cut by fault injection: kept open and never served, as
    /// a dead cable would leave them, until the NIC is restored.
    graveyard: Vec<F::Lane>,
    /// Lanes holding bytes no event will announce ([`Fabric::unread`]): read next turn.
    unread: Vec<usize>,
}

impl<F: Fabric> Sockets<F> {
    /// Files `sock` under lane key `k`, watched for readiness.
    fn adopt(&mut self, k: usize, mut sock: F::Lane) -> io::Result<()> {
        let interest = Interest::READABLE | Interest::WRITABLE;
        self.registry.register(&mut sock, Token(k), interest)?;
        if self.lanes.len() <= k {
            self.lanes.resize_with(k + 1, || None);
        }
        self.lanes[k] = Some(sock);
        Ok(())
    }

    /// Lane `k`'s socket, no longer watched.
    fn take(&mut self, k: usize) -> Option<F::Lane> {
        let mut sock = self.lanes.get_mut(k)?.take()?;
        let _ = self.registry.deregister(&mut sock);
        Some(sock)
    }

    fn missing() -> io::Error {
        io::Error::new(io::ErrorKind::NotFound, "no socket for this lane")
    }
}

impl<F: Fabric> engine::Io for Sockets<F> {
    fn connect(&mut self, k: usize, nic: usize, to: SocketAddr) -> io::Result<()> {
        let sock = self.fabric.connect(nic, to)?;
        self.adopt(k, sock)
    }

    fn read(&mut self, k: usize, reader: &mut FrameReader) -> Result<Option<Inbound>, ReadError> {
        match self.lanes.get_mut(k).and_then(Option::as_mut) {
            Some(sock) => {
                let got = self.fabric.read(sock, reader);
                if matches!(got, Ok(None)) && self.fabric.unread(sock) {
                    self.unread.push(k);
                }
                got
            }
            None => Err(ReadError::Io(Self::missing())),
        }
    }

    fn write(&mut self, k: usize, writer: &mut FrameWriter) -> io::Result<()> {
        match self.lanes.get_mut(k).and_then(Option::as_mut) {
            Some(sock) => {
                let res = self.fabric.write(sock, writer);
                if self.fabric.unread(sock) {
                    self.unread.push(k);
                }
                res
            }
            None => Err(Self::missing()),
        }
    }

    fn progress(&self, k: usize) -> LaneProgress {
        match self.lanes.get(k).and_then(Option::as_ref) {
            Some(sock) => self.fabric.progress(sock),
            None => LaneProgress::default(),
        }
    }

    fn peer(&self, k: usize) -> Option<IpAddr> {
        self.fabric.peer(self.lanes.get(k)?.as_ref()?)
    }

    fn ready(&self, k: usize) -> bool {
        (self.lanes.get(k).and_then(Option::as_ref)).is_some_and(|sock| self.fabric.ready(sock))
    }

    fn authenticated(&mut self, k: usize) {
        if let Some(sock) = self.lanes.get_mut(k).and_then(Option::as_mut) {
            self.fabric.authenticated(sock);
        }
    }

    fn set_pacing(&mut self, k: usize, rate: Option<u64>) -> io::Result<()> {
        match self.lanes.get_mut(k).and_then(Option::as_mut) {
            Some(sock) => self.fabric.set_pacing(sock, rate),
            None => Err(Self::missing()),
        }
    }

    fn fence(&mut self, k: usize) {
        if let Some(sock) = self.lanes.get_mut(k).and_then(Option::as_mut) {
            self.fabric.fence(sock);
        }
    }

    fn seal(&mut self, k: usize) {
        if let Some(sock) = self.lanes.get_mut(k).and_then(Option::as_mut) {
            self.fabric.seal(sock);
        }
    }

    fn close(&mut self, k: usize) {
        if let Some(sock) = self.take(k) {
            self.fabric.close(sock);
        }
    }

    fn bury(&mut self, k: usize) {
        if let Some(sock) = self.take(k) {
            self.graveyard.push(sock);
        }
    }

    fn unbury(&mut self) {
        for sock in std::mem::take(&mut self.graveyard) {
            self.fabric.close(sock);
        }
    }
}

struct Listener<F: Fabric> {
    sock: F::Listener,
    /// The NCCL listen id, or `None` for a NIC's failover listener.
    id: Option<u64>,
    nic: usize,
}

struct Reactor<F: Fabric> {
    poll: Poll,
    io: Sockets<F>,
    engine: Engine,
    queue: Arc<CommandQueue>,
    budget: SpinBudget,
    listeners: Slab<Listener<F>>,
    /// Listeners with connections to accept, served after the turn's lane events.
    accepting: Vec<usize>,
    /// Listeners whose connections wait in the kernel's backlog until the handshake gate
    /// has room: tried again every turn (at least every [`BACKLOG_RETRY`]).
    backlogged: Vec<usize>,
    shutdown: bool,
    watcher: Option<LinkWatcher>,
    /// The reactor thread's event buffer, and the callers': small, so one `test` serves
    /// a bounded share.
    events: Events,
    caller_events: Events,
    /// The tokens of the turn's events, handed to `after_poll`.
    ready: Vec<Token>,
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
        let mut wire = Vec::new();
        for (i, nic) in setup.nics.iter().enumerate() {
            let (mut sock, addr) = fabric.listen(i)?;
            let token = Token(listeners.vacant_key() | LISTENER_BIT);
            poll.registry()
                .register(&mut sock, token, Interest::READABLE)?;
            listeners.insert(Listener {
                sock,
                id: None,
                nic: i,
            });
            wire.push(NicAddr {
                addr,
                rail: nic.rail,
                mbps: nic.speed_mbps.map(|s| u32::try_from(s).unwrap_or(u32::MAX)),
            });
        }
        let queue = Arc::new(CommandQueue::new(waker));
        let budget = SpinBudget::new(setup.spin);
        let engine = Engine::new(setup, queue.clone(), wire, Instant::now());
        let io = Sockets {
            registry: poll.registry().try_clone()?,
            fabric,
            lanes: Vec::new(),
            graveyard: Vec::new(),
            unread: Vec::new(),
        };
        Ok(Reactor {
            poll,
            io,
            engine,
            queue,
            budget,
            listeners,
            accepting: Vec::new(),
            backlogged: Vec::new(),
            shutdown: false,
            watcher: None,
            events: Events::with_capacity(1024),
            caller_events: Events::with_capacity(owner::CALLER_EVENTS),
            ready: Vec::with_capacity(1024),
        })
    }

    /// Watches the kernel's carrier changes of local NICs, when it can.
    fn watch_links(&mut self) -> io::Result<()> {
        for fd in self.io.fabric.carrier_fds() {
            let r = self.poll.registry().register(
                &mut mio::unix::SourceFd(&fd),
                FABRIC_CARRIER,
                Interest::READABLE,
            );
            if let Err(e) = r {
                tracing::warn!("railover: cannot watch the fabric's port events ({e})");
            }
        }
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

    /// NICs (netdevs named `names`, index for index) whose carrier is already down when
    /// the reactor starts: no link event will say so, and a connect NCCL makes from one
    /// goes over another pair at once instead of waiting for an answer that cannot come.
    /// A NIC that is not a netdev (a verbs device) is left to its fabric's port events.
    fn seed_carriers(&mut self, names: &[String]) {
        let now = Instant::now();
        for (i, name) in names.iter().enumerate() {
            let carrier = std::fs::read_to_string(format!("/sys/class/net/{name}/carrier"));
            if carrier.is_ok_and(|c| c.trim() == "0") {
                self.engine.carrier(i, false, now, &mut self.io);
            }
        }
    }

    /// One turn of the reactor thread: it may busy-poll (the spin budget) or park in
    /// `epoll` until the next event or deadline.
    fn thread_turn(&mut self) {
        self.engine
            .stats()
            .thread_turns
            .fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        self.before_poll(now);
        if self.shutdown {
            return;
        }
        let again =
            self.engine.has_again() || !self.accepting.is_empty() || !self.io.unread.is_empty();
        let busy = || again || self.requests_in_flight();
        let mut timeout = self.budget.timeout(now, busy, self.next_wakeup());
        if again {
            timeout = Some(Duration::ZERO);
        } else if !self.backlogged.is_empty() {
            timeout = Some(timeout.map_or(BACKLOG_RETRY, |t| t.min(BACKLOG_RETRY)));
        }
        if timeout != Some(Duration::ZERO) {
            self.queue.parked.store(true, Ordering::SeqCst);
            if self.queue.len.load(Ordering::SeqCst) > 0 {
                timeout = Some(Duration::ZERO);
            }
        }
        let polled = self.poll.poll(&mut self.events, timeout);
        self.queue.parked.store(false, Ordering::SeqCst);
        if self.events.is_empty() {
            self.engine.idle(now.elapsed());
        }
        if let Err(e) = polled {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!("railover reactor: epoll failed: {e}");
            }
            return;
        }
        if self.events.is_empty() && timeout == Some(Duration::ZERO) && !self.engine.has_again() {
            // An empty spin turn: let other runnable threads (NCCL's own) have the
            // core, as NCCL's proxy loop does.
            std::thread::yield_now();
        }
        self.serve(false);
    }

    /// One turn on a caller's thread (NCCL's, in `test` and the rest): what is queued,
    /// what `epoll` has ready now (at most [`owner::CALLER_EVENTS`]), the timers due. It
    /// never waits and never yields: NCCL's loop decides when to call again.
    fn caller_turn(&mut self, now: Instant) {
        self.engine
            .stats()
            .caller_turns
            .fetch_add(1, Ordering::Relaxed);
        self.before_poll(now);
        if self.shutdown {
            return;
        }
        let polled = self
            .poll
            .poll(&mut self.caller_events, Some(Duration::ZERO));
        match polled {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => tracing::warn!("railover reactor: epoll failed: {e}"),
        }
        self.serve(true);
    }

    /// The second half of either turn: what `epoll` reported into the caller's (`caller`)
    /// or the thread's event buffer, then the timers due.
    fn serve(&mut self, caller: bool) {
        let events = if caller {
            &self.caller_events
        } else {
            &self.events
        };
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        ready.extend(events.iter().map(|ev| ev.token()));
        let now = Instant::now();
        if !ready.is_empty() {
            self.budget.progress(now);
        }
        self.after_poll(&ready, now);
        self.ready = ready;
    }

    /// The first half of a turn: queued commands, lanes left over from the last turn,
    /// the router's decisions, and output.
    fn before_poll(&mut self, now: Instant) {
        let mut cmds = self.queue.take();
        if !cmds.is_empty() {
            self.budget.progress(now);
        }
        let mut connects = 0;
        while let Some(c) = cmds.pop_front() {
            if matches!(c, Command::Connect { .. }) {
                if connects == CONNECTS_PER_TURN {
                    cmds.push_front(c);
                    break;
                }
                connects += 1;
            }
            self.command(c, now);
        }
        // The rest waits for the next turn, in order: lanes dialled in this one write
        // their Hellos first.
        self.queue.put_back(cmds);
        if self.shutdown {
            return;
        }
        self.engine.start_turn();
        for k in self.engine.take_again() {
            self.engine.service_lane(k, now, &mut self.io);
        }
        let mut unread = std::mem::take(&mut self.io.unread);
        unread.sort_unstable();
        unread.dedup();
        for k in unread {
            self.engine.service_lane(k, now, &mut self.io);
        }
        self.engine.drive(now, &mut self.io);
    }

    /// The second half: what readiness reported, then every timer that is due.
    fn after_poll(&mut self, ready: &[Token], now: Instant) {
        for &token in ready {
            match token {
                WAKER => {}
                NETLINK => self.link_events(now),
                FABRIC_CARRIER => {
                    for (i, up) in self.io.fabric.carrier_events() {
                        self.engine.carrier(i, up, now, &mut self.io);
                    }
                }
                Token(t) if t & LISTENER_BIT != 0 => self.accepting.push(t & !LISTENER_BIT),
                Token(k) => self.engine.service_lane(k, now, &mut self.io),
            }
        }
        // After the lanes: a Hello that arrived meanwhile is read before a flood's
        // next batch of connections can push its lane out of the handshake caps.
        let mut accepting = std::mem::take(&mut self.accepting);
        accepting.append(&mut self.backlogged);
        accepting.sort_unstable();
        accepting.dedup();
        for key in accepting {
            self.accept_all(key, now);
        }
        self.engine.handle_timeout(now, &mut self.io);
        self.engine.drive(now, &mut self.io);
    }

    /// The earliest time a timer of the engine is due.
    fn next_wakeup(&self) -> Option<Instant> {
        self.engine.poll_timeout()
    }

    fn requests_in_flight(&self) -> bool {
        self.engine.busy()
    }

    fn command(&mut self, c: Command, now: Instant) {
        let (engine, io) = (&mut self.engine, &mut self.io);
        match c {
            Command::Listen { nic, shared, reply } => reply.finish(self.listen(nic, shared)),
            Command::CloseListen { shared } => self.close_listen(&shared, now),
            Command::Connect {
                nic,
                to,
                token,
                rescue,
                pending,
            } => engine.connect(nic, to, &token, rescue, &pending, now, io),
            Command::Send {
                comm,
                req,
                buf,
                seq,
            } => engine.post_send(&comm, &req, buf, seq, io),
            Command::Recv { comm, req, bufs } => engine.post_recv(&comm, &req, bufs, io),
            Command::CloseComm { comm, done } => {
                engine.close_comm(&comm, now, io);
                done.signal();
            }
            Command::InjectLink { nic, up } => engine.inject_link(nic, up, now, io),
            Command::Drain {
                nic,
                on,
                source,
                reply,
            } => {
                // The asker may have given up waiting; nothing to do then.
                let _ = reply.send(engine.drain(nic, on, source, now));
            }
            Command::Status { reply } => {
                let _ = reply.send(engine.status(now));
            }
            Command::Shutdown => self.shutdown = true,
            Command::Panic(message) => panic!("{message}"),
        }
    }

    /// Opens NCCL's listener on local NIC `nic`.
    fn listen(&mut self, nic: usize, shared: Arc<ListenShared>) -> Result<SocketAddr, Error> {
        let (mut sock, addr) = self.io.fabric.listen(nic)?;
        let token = Token(self.listeners.vacant_key() | LISTENER_BIT);
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut sock, token, Interest::READABLE)
        {
            tracing::warn!("railover: cannot watch a listener: {e}");
            return Err(e.into());
        }
        self.listeners.insert(Listener {
            sock,
            id: Some(shared.id),
            nic,
        });
        self.engine.listening(shared);
        Ok(addr)
    }

    fn close_listen(&mut self, shared: &ListenShared, now: Instant) {
        let key = self.listeners.iter().find(|(_, l)| l.id == Some(shared.id));
        if let Some(key) = key.map(|(k, _)| k) {
            let mut l = self.listeners.remove(key);
            let _ = self.poll.registry().deregister(&mut l.sock);
        }
        self.engine.close_listen(shared, now, &mut self.io);
    }

    /// Accepts up to `ACCEPT_BATCH` connections; a listener with more left is served
    /// again next turn.
    fn accept_all(&mut self, key: usize, now: Instant) {
        for _ in 0..ACCEPT_BATCH {
            if !self.listeners.contains(key) {
                return;
            }
            // Backpressure: a full handshake gate leaves the connection in the backlog.
            if !self.engine.may_accept(key, now, &mut self.io) {
                self.backlogged.push(key);
                return;
            }
            let Some(l) = self.listeners.get_mut(key) else {
                return;
            };
            match self.io.fabric.accept(&mut l.sock) {
                Ok(Some((sock, nic))) => {
                    if self.engine.nic_cut(l.nic) {
                        // A cut NIC answers nothing.
                        self.io.graveyard.push(sock);
                        continue;
                    }
                    let (id, nic) = (l.id, nic.or(Some(l.nic)));
                    let k = self.engine.next_lane();
                    match self.io.adopt(k, sock) {
                        Ok(()) => self.engine.accepted(k, key, id, nic, now, &mut self.io),
                        Err(e) => tracing::warn!("railover: cannot watch an accepted socket: {e}"),
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    // Out of descriptors: a stranger's unfinished handshake yields.
                    let emfile = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if emfile && self.engine.evict_oldest(now, &mut self.io) {
                        continue;
                    }
                    // Leave the rest in the backlog for the next event.
                    self.engine.turned_away(&format!("accept failed: {e}"), now);
                    return;
                }
            }
        }
        self.accepting.push(key);
    }

    /// Carrier changes of local NICs, straight from the kernel.
    fn link_events(&mut self, now: Instant) {
        let Some(w) = self.watcher.as_mut() else {
            return;
        };
        for ev in w.drain() {
            // The fabric knows what netdev its NICs sit on (a verbs port's RoCE netdev).
            let nic = (self.engine.nic_named(&ev.ifname))
                .or_else(|| self.io.fabric.nic_of_link(&ev.ifname));
            if let Some(i) = nic {
                self.engine.carrier(i, ev.up, now, &mut self.io);
            }
        }
    }

    /// An operator's drain of local NIC `i`, as the simulation asks it.
    #[cfg(test)]
    fn drain(&mut self, i: usize, on: bool, now: Instant) -> Result<String, String> {
        let source = crate::handoff::DrainSource::Socket;
        self.engine.drain(i, on, source, now)
    }

    /// Local NIC `i`'s carrier is now `up`, as the simulation reports it.
    #[cfg(test)]
    fn carrier(&mut self, i: usize, up: bool, now: Instant) {
        self.engine.carrier(i, up, now, &mut self.io);
    }

    fn close_everything(&mut self) {
        self.engine.close_everything(Instant::now(), &mut self.io);
        for (_, mut l) in std::mem::take(&mut self.listeners) {
            let _ = self.poll.registry().deregister(&mut l.sock);
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
