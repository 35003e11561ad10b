//! The reactor: the one thread per process that owns every socket and drives every
//! comm's protocol machine.
//!
//! What producers (NCCL's threads, through [`crate::plugin`]) can rely on:
//! * a command pushed with [`CommandQueue::push`] is seen by the reactor's next turn; if
//!   the reactor is parked in `epoll`, `push` wakes it (one `eventfd` write), otherwise
//!   it costs no system call;
//! * only the reactor touches a comm's machine, lanes and buffers; outcomes reach NCCL
//!   through each request's atomic state;
//! * after the last context is finalised, [`Reactor::run`] returns and the thread is
//!   joined, so the library can be unloaded.
//!
//! Not guaranteed, merely today's behaviour: the reactor busy-polls for
//! `RAILOVER_SPIN_US` after its last progress while requests are in flight, then parks.

pub mod budget;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;
use slab::Slab;

use crate::conn::wire::{self, Header, Hello, Kind, NicAddr, Purpose, Welcome};
use crate::conn::{
    ConnError, Control, Placement, RecvEvent, RecvMachine, SendEvent, SendMachine, Transmit,
};
use crate::ffi::buffer::UserBuf;
use crate::plugin::comm::{CommShared, ListenShared, PendingConnect, Side};
use crate::plugin::request::Request;
use crate::plugin::Error;
use crate::transport::tcp::{self, stream::FrameReader, stream::FrameWriter, stream::Inbound};
use budget::SpinBudget;

/// How long a new connection may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a closed comm's lane may keep flushing its last acks.
const LINGER: Duration = Duration::from_secs(2);

const WAKER: Token = Token(usize::MAX);
const LISTENER_BIT: usize = 1 << (usize::BITS - 2);

/// Work for the reactor.
#[derive(Debug)]
pub enum Command {
    Listen {
        listener: TcpListener,
        shared: Arc<ListenShared>,
    },
    CloseListen {
        shared: Arc<ListenShared>,
    },
    Connect {
        stream: TcpStream,
        token: [u8; 16],
        pending: Arc<PendingConnect>,
    },
    Send {
        comm: Arc<CommShared>,
        req: Arc<Request>,
        buf: UserBuf,
    },
    Recv {
        comm: Arc<CommShared>,
        req: Arc<Request>,
        buf: UserBuf,
    },
    CloseComm {
        comm: Arc<CommShared>,
    },
    Shutdown,
}

/// The producers' side of the reactor.
#[derive(Debug)]
pub struct CommandQueue {
    q: Mutex<VecDeque<Command>>,
    /// Commands queued and not yet taken; read without the lock by the parking check.
    len: AtomicUsize,
    parked: AtomicBool,
    waker: Waker,
}

impl CommandQueue {
    /// Queues a command; wakes the reactor only if it is parked.
    pub fn push(&self, c: Command) {
        self.q.lock().push_back(c);
        // Dekker-style hand-off with the reactor's `park`: both sides write their flag
        // with SeqCst before reading the other's, so at least one sees the other.
        self.len.fetch_add(1, Ordering::SeqCst);
        if self.parked.swap(false, Ordering::SeqCst) {
            let _ = self.waker.wake();
        }
    }

    fn take(&self) -> VecDeque<Command> {
        let cmds = std::mem::take(&mut *self.q.lock());
        self.len.fetch_sub(cmds.len(), Ordering::SeqCst);
        cmds
    }
}

/// Counters the reactor keeps for telemetry and tests.
#[derive(Debug, Default)]
pub struct ReactorStats {
    /// Connections refused or dropped before a valid handshake (garbage, wrong token).
    pub rejected_connections: AtomicU64,
    /// Lanes closed because the peer broke the protocol.
    pub protocol_errors: AtomicU64,
    /// Lanes lost to socket errors or an unexpected close.
    pub lane_failures: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
}

/// Handle kept by the runtime: the queue and the thread to join.
#[derive(Debug)]
pub struct ReactorHandle {
    pub queue: Arc<CommandQueue>,
    pub stats: Arc<ReactorStats>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ReactorHandle {
    /// Starts the reactor thread. `nics` is this process's NIC list as peers should see it.
    pub fn spawn(nics: Vec<NicAddr>, spin: Duration) -> io::Result<ReactorHandle> {
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let queue = Arc::new(CommandQueue {
            q: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            waker,
        });
        let stats = Arc::new(ReactorStats::default());
        let mut reactor = Reactor {
            poll,
            queue: queue.clone(),
            stats: stats.clone(),
            nics,
            budget: SpinBudget::new(spin),
            listeners: Slab::new(),
            listener_ids: HashMap::new(),
            lanes: Slab::new(),
            comms: Slab::new(),
            dirty: Vec::new(),
            again: Vec::new(),
            next_deadline: None,
            shutdown: false,
        };
        let thread = std::thread::Builder::new()
            .name("railover-reactor".into())
            .spawn(move || reactor.run())?;
        Ok(ReactorHandle {
            queue,
            stats,
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

/// A message's buffer and the request NCCL tests.
#[derive(Debug)]
struct Pending {
    buf: UserBuf,
    req: Arc<Request>,
}

#[derive(Debug)]
enum Machine {
    Send(SendMachine<Pending>),
    Recv(RecvMachine<Pending>),
}

#[derive(Debug)]
struct Comm {
    shared: Arc<CommShared>,
    lane: Option<usize>,
    machine: Machine,
}

#[derive(Debug)]
enum Role {
    /// Accepted; waiting for the connector's `Hello`.
    Handshake { listener: u64 },
    /// Connecting; waiting for the listener's `Welcome`.
    Connecting { pending: Arc<PendingConnect> },
    /// Carrying a comm.
    Comm(usize),
    /// Flushing its last bytes before it closes.
    Closing,
}

#[derive(Debug)]
struct Lane {
    sock: TcpStream,
    reader: FrameReader,
    writer: FrameWriter,
    role: Role,
    deadline: Option<Instant>,
}

struct Listener {
    sock: TcpListener,
    shared: Arc<ListenShared>,
}

struct Reactor {
    poll: Poll,
    queue: Arc<CommandQueue>,
    stats: Arc<ReactorStats>,
    nics: Vec<NicAddr>,
    budget: SpinBudget,
    listeners: Slab<Listener>,
    listener_ids: HashMap<u64, usize>,
    lanes: Slab<Lane>,
    comms: Slab<Comm>,
    /// Lanes with queued output to flush at the end of the turn.
    dirty: Vec<usize>,
    /// Lanes that stopped on their per-call budget and must be served again.
    again: Vec<usize>,
    next_deadline: Option<Instant>,
    shutdown: bool,
}

impl Reactor {
    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        while !self.shutdown {
            let now = Instant::now();
            let cmds = self.queue.take();
            if !cmds.is_empty() {
                self.budget.progress(now);
            }
            for c in cmds {
                self.command(c, now);
            }
            if self.shutdown {
                break;
            }
            for k in std::mem::take(&mut self.again) {
                self.service_lane(k, now);
            }
            self.flush_dirty();

            let busy = !self.again.is_empty() || self.requests_in_flight();
            let mut timeout = self.budget.timeout(now, busy, self.next_deadline);
            if !self.again.is_empty() {
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
            for ev in events.iter() {
                match ev.token() {
                    WAKER => {}
                    Token(t) if t & LISTENER_BIT != 0 => self.accept_all(t & !LISTENER_BIT, now),
                    Token(k) => self.service_lane(k, now),
                }
            }
            if self.next_deadline.is_some_and(|d| d <= now) {
                self.expire(now);
            }
            self.flush_dirty();
        }
        self.close_everything();
    }

    fn requests_in_flight(&self) -> bool {
        self.comms.iter().any(|(_, c)| match &c.machine {
            Machine::Send(m) => m.pending() > 0,
            Machine::Recv(m) => m.pending() > 0,
        })
    }

    fn command(&mut self, c: Command, now: Instant) {
        match c {
            Command::Listen {
                mut listener,
                shared,
            } => {
                let entry = self.listeners.vacant_entry();
                let key = entry.key();
                if let Err(e) = self.poll.registry().register(
                    &mut listener,
                    Token(key | LISTENER_BIT),
                    Interest::READABLE,
                ) {
                    tracing::warn!("railover: cannot watch a listener: {e}");
                    return;
                }
                self.listener_ids.insert(shared.id, key);
                entry.insert(Listener {
                    sock: listener,
                    shared,
                });
            }
            Command::CloseListen { shared } => {
                if let Some(key) = self.listener_ids.remove(&shared.id) {
                    let mut l = self.listeners.remove(key);
                    let _ = self.poll.registry().deregister(&mut l.sock);
                }
                // Accepted comms NCCL never took die with their listener.
                let orphans: Vec<_> = shared.ready.lock().drain(..).collect();
                for comm in orphans {
                    self.close_comm(&comm, now);
                }
            }
            Command::Connect {
                stream,
                token,
                pending,
            } => {
                let hello = Hello {
                    token,
                    purpose: Purpose::Data,
                    nics: self.nics.clone(),
                };
                match self.add_lane(
                    stream,
                    Role::Connecting {
                        pending: pending.clone(),
                    },
                    now,
                ) {
                    Ok(k) => {
                        self.lanes[k].writer.push_ctrl(&hello.encode());
                        self.dirty.push(k);
                    }
                    Err(e) => *pending.result.lock() = Some(Err(e.into())),
                }
            }
            Command::Send { comm, req, buf } => {
                let Some(c) = self.comm_of(&comm) else {
                    req.fail(Error::InvalidArgument("send on a closed comm".into()));
                    return;
                };
                if let Machine::Send(m) = &mut self.comms[c].machine {
                    m.post(buf.len() as u64, Pending { buf, req });
                }
                self.pump(c);
            }
            Command::Recv { comm, req, buf } => {
                let Some(c) = self.comm_of(&comm) else {
                    req.fail(Error::InvalidArgument("receive on a closed comm".into()));
                    return;
                };
                if let Machine::Recv(m) = &mut self.comms[c].machine {
                    m.post(buf.len() as u64, Pending { buf, req });
                }
                self.pump(c);
            }
            Command::CloseComm { comm } => self.close_comm(&comm, now),
            Command::Shutdown => self.shutdown = true,
        }
    }

    fn comm_of(&self, shared: &Arc<CommShared>) -> Option<usize> {
        self.comms
            .get(shared.key)
            .filter(|c| Arc::ptr_eq(&c.shared, shared))
            .map(|_| shared.key)
    }

    fn add_lane(&mut self, mut sock: TcpStream, role: Role, now: Instant) -> io::Result<usize> {
        let entry = self.lanes.vacant_entry();
        let key = entry.key();
        self.poll.registry().register(
            &mut sock,
            Token(key),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        let deadline = now + HANDSHAKE_TIMEOUT;
        self.next_deadline = Some(self.next_deadline.map_or(deadline, |d| d.min(deadline)));
        entry.insert(Lane {
            sock,
            reader: FrameReader::default(),
            writer: FrameWriter::default(),
            role,
            deadline: Some(deadline),
        });
        Ok(key)
    }

    fn drop_lane(&mut self, k: usize) {
        if let Some(mut lane) = self.lanes.try_remove(k) {
            let _ = self.poll.registry().deregister(&mut lane.sock);
        }
    }

    fn accept_all(&mut self, key: usize, now: Instant) {
        loop {
            let Some(l) = self.listeners.get(key) else {
                return;
            };
            match l.sock.accept() {
                Ok((stream, _)) => {
                    let listener = l.shared.id;
                    if let Err(e) = tcp::tune_stream(&stream) {
                        tracing::debug!("railover: cannot tune an accepted socket: {e}");
                    }
                    if let Err(e) = self.add_lane(stream, Role::Handshake { listener }, now) {
                        tracing::warn!("railover: cannot watch an accepted socket: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: leave the rest in the backlog for the next event.
                    tracing::warn!("railover: accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// Reads everything the lane has, feeding the machines; then queues its output.
    fn service_lane(&mut self, k: usize, now: Instant) {
        loop {
            let Some(lane) = self.lanes.get_mut(k) else {
                return;
            };
            match lane.reader.next(&mut lane.sock) {
                Ok(Some(item)) => {
                    if let Err(e) = self.inbound(k, item, now) {
                        self.lane_failed(k, e);
                        return;
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
                        tcp::stream::ReadError::Io(e) => ConnError::Io(e.to_string()),
                        tcp::stream::ReadError::Wire(e) => ConnError::Protocol(e.to_string()),
                    };
                    self.lane_failed(k, e);
                    return;
                }
            }
        }
        self.dirty.push(k);
    }

    fn inbound(&mut self, k: usize, item: Inbound, now: Instant) -> Result<(), ConnError> {
        let lane = &mut self.lanes[k];
        match &lane.role {
            Role::Handshake { listener } => {
                let listener = *listener;
                match item {
                    Inbound::Frame(h, body) if h.kind == Kind::Hello => {
                        self.hello(k, listener, &body, now)
                    }
                    Inbound::Eof => Err(ConnError::PeerClosed),
                    _ => Err(ConnError::Protocol("expected Hello".into())),
                }
            }
            Role::Connecting { pending } => {
                let pending = pending.clone();
                match item {
                    Inbound::Frame(h, body) if h.kind == Kind::Welcome => {
                        let _peer = Welcome::decode(&body)
                            .map_err(|e| ConnError::Protocol(e.to_string()))?;
                        let shared = self.new_comm(Side::Send, k);
                        *pending.result.lock() = Some(Ok(shared));
                        Ok(())
                    }
                    Inbound::Frame(h, _) if h.kind == Kind::Refuse => Err(ConnError::Protocol(
                        "the listener refused the connection (wrong comm token)".into(),
                    )),
                    Inbound::Eof => Err(ConnError::PeerClosed),
                    _ => Err(ConnError::Protocol("expected Welcome".into())),
                }
            }
            Role::Closing => {
                // Drain and ignore whatever the peer still sends.
                if let Inbound::Data { .. } = item {
                    lane.reader.place(None);
                }
                if matches!(item, Inbound::Eof) {
                    return Err(ConnError::PeerClosed);
                }
                Ok(())
            }
            Role::Comm(c) => {
                let c = *c;
                self.comm_inbound(c, k, item)?;
                self.pump(c);
                Ok(())
            }
        }
    }

    fn comm_inbound(&mut self, c: usize, k: usize, item: Inbound) -> Result<(), ConnError> {
        let comm = &mut self.comms[c];
        match (&mut comm.machine, item) {
            (_, Inbound::Eof) => Err(ConnError::PeerClosed),
            (_, Inbound::Frame(h, _)) if h.kind == Kind::Close => Err(ConnError::PeerClosed),
            (Machine::Send(m), Inbound::Frame(h, _)) if h.kind == Kind::Cts => {
                m.handle_cts(h.seq, h.len)
            }
            (Machine::Send(m), Inbound::Frame(h, _)) if h.kind == Kind::Ack => m.handle_ack(h.seq),
            (Machine::Recv(m), Inbound::Data { seq, len }) => {
                let dst = match m.handle_data(seq, len)? {
                    Placement::Deliver { seq, .. } => {
                        Some(m.message(seq).expect("delivering a posted receive").buf)
                    }
                    Placement::Discard { .. } => None,
                };
                self.lanes[k].reader.place(dst);
                Ok(())
            }
            (Machine::Recv(m), Inbound::PayloadDone { seq, len }) => {
                self.stats.bytes_received.fetch_add(len, Ordering::Relaxed);
                if m.message(seq).is_some() {
                    m.payload_done(seq, len)
                } else {
                    Ok(()) // a discarded duplicate
                }
            }
            (Machine::Recv(m), Inbound::Frame(h, _)) if h.kind == Kind::Truncated => {
                m.handle_truncated(h.seq, h.len)
            }
            (_, other) => Err(ConnError::Protocol(format!("unexpected {other:?}"))),
        }
    }

    /// The listener side of the handshake: check the token, create the receive comm.
    fn hello(
        &mut self,
        k: usize,
        listener: u64,
        body: &[u8],
        now: Instant,
    ) -> Result<(), ConnError> {
        let hello = Hello::decode(body).map_err(|e| ConnError::Protocol(e.to_string()))?;
        let shared = self
            .listener_ids
            .get(&listener)
            .map(|&key| self.listeners[key].shared.clone())
            .ok_or_else(|| ConnError::Protocol("listener is closed".into()))?;
        if hello.token != shared.token || hello.purpose != Purpose::Data {
            self.stats
                .rejected_connections
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!("railover: refused a connection presenting a wrong comm token");
            let lane = &mut self.lanes[k];
            let mut h = Header::new(Kind::Refuse, 0, 0);
            h.aux = wire::REFUSE_TOKEN;
            lane.writer.push_ctrl(&h.encode());
            lane.role = Role::Closing;
            lane.deadline = Some(now + LINGER);
            return Ok(());
        }
        let comm = self.new_comm(Side::Recv, k);
        self.lanes[k].writer.push_ctrl(
            &Welcome {
                nics: self.nics.clone(),
            }
            .encode(0),
        );
        shared.ready.lock().push_back(comm);
        Ok(())
    }

    fn new_comm(&mut self, side: Side, lane: usize) -> Arc<CommShared> {
        let entry = self.comms.vacant_entry();
        let key = entry.key();
        let shared = Arc::new(CommShared::new(side, key, self.queue.clone()));
        let machine = match side {
            Side::Send => Machine::Send(SendMachine::default()),
            Side::Recv => Machine::Recv(RecvMachine::default()),
        };
        entry.insert(Comm {
            shared: shared.clone(),
            lane: Some(lane),
            machine,
        });
        let l = &mut self.lanes[lane];
        l.role = Role::Comm(key);
        l.deadline = None;
        shared
    }

    /// Moves the machine's output onto its lane and its outcomes onto the requests.
    fn pump(&mut self, c: usize) {
        let comm = &mut self.comms[c];
        let mut lane = comm.lane.and_then(|k| self.lanes.get_mut(k));
        match &mut comm.machine {
            Machine::Send(m) => {
                while let Some(t) = m.poll_transmit() {
                    let Some(lane) = lane.as_deref_mut() else {
                        continue;
                    };
                    match t {
                        Transmit::Data { seq, len } => {
                            let buf = m.message(seq).expect("transmitting a queued message").buf;
                            lane.writer
                                .push_ctrl(&Header::new(Kind::Data, seq, len).encode());
                            lane.writer.push_payload(buf, len as usize);
                            self.stats.bytes_sent.fetch_add(len, Ordering::Relaxed);
                        }
                        Transmit::Truncated { seq, len } => {
                            lane.writer
                                .push_ctrl(&Header::new(Kind::Truncated, seq, len).encode());
                        }
                    }
                }
                while let Some(ev) = m.poll_event() {
                    match ev {
                        SendEvent::Completed { len, token, .. } => token.req.complete(len),
                        SendEvent::Failed { token, error, .. } => token.req.fail(error.into()),
                    }
                }
            }
            Machine::Recv(m) => {
                while let Some(ctl) = m.poll_transmit() {
                    let Some(lane) = lane.as_deref_mut() else {
                        continue;
                    };
                    let h = match ctl {
                        Control::Cts { seq, capacity } => Header::new(Kind::Cts, seq, capacity),
                        Control::Ack { delivered } => Header::new(Kind::Ack, delivered, 0),
                    };
                    lane.writer.push_ctrl(&h.encode());
                }
                while let Some(ev) = m.poll_event() {
                    match ev {
                        RecvEvent::Completed { len, token, .. } => token.req.complete(len),
                        RecvEvent::Failed { token, error, .. } => token.req.fail(error.into()),
                    }
                }
            }
        }
        if let Some(k) = comm.lane {
            self.dirty.push(k);
        }
    }

    fn flush_dirty(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for k in dirty.drain(..) {
            let Some(lane) = self.lanes.get_mut(k) else {
                continue;
            };
            if lane.writer.is_empty() {
                if matches!(lane.role, Role::Closing) {
                    self.drop_lane(k);
                }
                continue;
            }
            match lane.writer.flush(&mut lane.sock) {
                Ok(()) => {
                    if lane.writer.wants_more() {
                        self.again.push(k);
                    } else if lane.writer.is_empty() && matches!(lane.role, Role::Closing) {
                        self.drop_lane(k);
                    }
                }
                Err(e) => self.lane_failed(k, ConnError::Io(e.to_string())),
            }
        }
        self.dirty = dirty;
    }

    /// A lane is unusable: settle whatever depended on it and close it.
    fn lane_failed(&mut self, k: usize, error: ConnError) {
        let Some(lane) = self.lanes.get(k) else {
            return;
        };
        match &lane.role {
            Role::Handshake { .. } => {
                self.stats
                    .rejected_connections
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!("railover: dropped an incoming connection before its handshake completed: {error}");
            }
            Role::Connecting { pending } => {
                tracing::warn!("railover: connect failed: {error}");
                *pending.result.lock() = Some(Err(error.into()));
            }
            Role::Comm(c) => {
                let c = *c;
                if matches!(error, ConnError::Protocol(_)) {
                    self.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats.lane_failures.fetch_add(1, Ordering::Relaxed);
                }
                let comm = &mut self.comms[c];
                let busy = match &comm.machine {
                    Machine::Send(m) => m.pending() > 0,
                    Machine::Recv(m) => m.pending() > 0,
                };
                if busy || !matches!(error, ConnError::PeerClosed) {
                    tracing::warn!("railover: comm lost its connection: {error}");
                }
                comm.shared.set_failed(error.clone().into());
                match &mut comm.machine {
                    Machine::Send(m) => m.handle_lane_lost(error),
                    Machine::Recv(m) => m.handle_lane_lost(error),
                }
                comm.lane = None;
                self.drop_lane(k);
                self.pump(c);
                return;
            }
            Role::Closing => {}
        }
        self.drop_lane(k);
    }

    fn close_comm(&mut self, shared: &Arc<CommShared>, now: Instant) {
        let Some(c) = self.comm_of(shared) else {
            return;
        };
        let comm = self.comms.remove(c);
        let reason = || Error::InvalidArgument("comm closed with the request outstanding".into());
        match comm.machine {
            Machine::Send(mut m) => {
                m.handle_lane_lost(ConnError::PeerClosed);
                while let Some(
                    SendEvent::Completed { token, .. } | SendEvent::Failed { token, .. },
                ) = m.poll_event()
                {
                    token.req.fail(reason());
                }
            }
            Machine::Recv(mut m) => {
                m.handle_lane_lost(ConnError::PeerClosed);
                while let Some(
                    RecvEvent::Completed { token, .. } | RecvEvent::Failed { token, .. },
                ) = m.poll_event()
                {
                    token.req.fail(reason());
                }
            }
        }
        if let Some(k) = comm.lane {
            // Let the last acks and CTS reach the peer, but do not wait for it.
            let lane = &mut self.lanes[k];
            lane.role = Role::Closing;
            lane.deadline = Some(now + LINGER);
            self.next_deadline = Some(
                self.next_deadline
                    .map_or(now + LINGER, |d| d.min(now + LINGER)),
            );
            self.dirty.push(k);
        }
    }

    /// Fails handshakes that took too long and drops lingering lanes.
    fn expire(&mut self, now: Instant) {
        let overdue: Vec<usize> = self
            .lanes
            .iter()
            .filter(|(_, l)| l.deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| k)
            .collect();
        for k in overdue {
            self.lane_failed(k, ConnError::Io("handshake or close timed out".into()));
        }
        self.next_deadline = self.lanes.iter().filter_map(|(_, l)| l.deadline).min();
    }

    fn close_everything(&mut self) {
        let keys: Vec<usize> = self.comms.iter().map(|(k, _)| k).collect();
        for c in keys {
            let shared = self.comms[c].shared.clone();
            self.close_comm(&shared, Instant::now());
        }
        let lanes: Vec<usize> = self.lanes.iter().map(|(k, _)| k).collect();
        for k in lanes {
            if let Some(Role::Connecting { pending }) = self.lanes.get(k).map(|l| &l.role) {
                *pending.result.lock() = Some(Err(Error::Internal("plugin finalised".into())));
            }
            self.drop_lane(k);
        }
        for (_, mut l) in std::mem::take(&mut self.listeners) {
            let _ = self.poll.registry().deregister(&mut l.sock);
        }
    }
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
