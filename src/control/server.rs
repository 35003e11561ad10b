//! The control thread `rlvr-control`: the socket's connections and the drain file's reads.
//!
//! As the metrics endpoint (`telemetry::exporter`), it waits in `mio::Poll` on the
//! listener, its connections and a `Waker`, so [`Control::shutdown`] can wake and join it
//! whatever clients do. Connections never block it: at most [`MAX_CONNECTIONS`] are open,
//! each has [`CONNECTION_DEADLINE`] from accept to the end of its answer (a client that
//! sent no whole line by then gets a refusal saying so), and a new one at the limit
//! closes the one that has waited longest for its request. After its answer, what a
//! client still sends is read and dropped until it closes: closing a Unix socket with
//! unread bytes would hand the client `ECONNRESET` instead of the end of the answer.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::protocol::{self, Answer, Frame};
use super::watch::Watch;
use super::{
    dir, effective_uid, peer, Control, ControlConfig, Handler, NicIdent, CONNECTION_DEADLINE,
    DRAIN_FILE_EVERY, MAX_CONNECTIONS,
};

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);
/// The longest the thread sleeps with nothing due, so it would see `stop` even if a wake
/// were lost.
const IDLE_WAKE: Duration = Duration::from_secs(5);
/// What a client may send after its request line before it is cut off.
const MAX_TRAILING: usize = 64 * 1024;

pub(super) fn start(
    config: &ControlConfig,
    nics: Vec<NicIdent>,
    handler: Arc<dyn Handler>,
) -> Control {
    let stop = Arc::new(AtomicBool::new(false));
    let idle = |socket: Option<PathBuf>| {
        if let Some(p) = socket {
            let _ = std::fs::remove_file(p);
        }
        Control {
            owner: std::process::id(),
            socket: None,
            stop: stop.clone(),
            waker: None,
            thread: None,
        }
    };
    if config.dir.is_none() && config.drain_file.is_none() {
        return idle(None);
    }
    let poll = match Poll::new() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(
                "railover: no control socket and no drain file watch: cannot create a poll: {e}"
            );
            return idle(None);
        }
    };
    let pid = std::process::id();
    let mut served = None;
    if let Some(d) = &config.dir {
        match open(d, pid) {
            Ok((mut listener, path, uid)) => {
                match poll
                    .registry()
                    .register(&mut listener, LISTENER, Interest::READABLE)
                {
                    Ok(()) => served = Some((listener, path, uid)),
                    Err(e) => {
                        let _ = std::fs::remove_file(&path);
                        warn_no_socket(d, &format!("cannot watch it: {e}"), config);
                    }
                }
            }
            Err(why) => warn_no_socket(d, &why, config),
        }
    }
    let socket = served.as_ref().map(|(_, p, _)| p.clone());
    if served.is_none() && config.drain_file.is_none() {
        return idle(None);
    }
    if let Some(p) = &socket {
        tracing::info!("railover: control socket {}", p.display());
    }
    if let Some(f) = &config.drain_file {
        tracing::info!("railover: watching the drain file {}", f.display());
    }
    let waker = match Waker::new(poll.registry(), WAKER) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(
                "railover: no control socket and no drain file watch: cannot create a waker: {e}"
            );
            return idle(socket);
        }
    };
    let (listener, uid) = match served {
        Some((l, _, uid)) => (Some(l), uid),
        None => (None, 0),
    };
    let server = Server {
        poll,
        listener,
        conns: Slab::with_capacity(MAX_CONNECTIONS),
        nics,
        handler,
        pid,
        uid,
        watch: config.drain_file.clone().map(Watch::new),
        stop: stop.clone(),
    };
    match std::thread::Builder::new()
        .name("rlvr-control".into())
        .spawn(move || server.run())
    {
        Ok(thread) => Control {
            owner: pid,
            socket,
            stop,
            waker: Some(waker),
            thread: Some(thread),
        },
        Err(e) => {
            tracing::warn!(
                "railover: no control socket and no drain file watch: cannot start the \
                 control thread: {e}"
            );
            idle(socket)
        }
    }
}

/// Prepares `dir` and binds this process's socket there; returns also the uid it serves.
fn open(dir: &Path, pid: u32) -> Result<(UnixListener, PathBuf, u32), String> {
    let uid = effective_uid().map_err(|e| format!("cannot tell this process's uid: {e}"))?;
    dir::prepare(dir, uid)?;
    let (listener, path) = dir::bind(dir, pid)?;
    Ok((listener, path, uid))
}

fn warn_no_socket(dir: &Path, why: &str, config: &ControlConfig) {
    let file = match &config.drain_file {
        Some(f) => format!("; the drain file {} is still watched", f.display()),
        None => String::new(),
    };
    tracing::warn!(
        "railover: no control socket in {}: {why}; `railover drain|undrain|status` will not \
         reach this process (set {}=DIR to put it elsewhere){file}",
        dir.display(),
        super::DIR_VAR
    );
}

struct Server {
    poll: Poll,
    listener: Option<UnixListener>,
    conns: Slab<Conn>,
    nics: Vec<NicIdent>,
    handler: Arc<dyn Handler>,
    pid: u32,
    /// The uid served besides root.
    uid: u32,
    watch: Option<Watch>,
    stop: Arc<AtomicBool>,
}

/// What a connection's exchange needs from the server.
struct Ctx<'a> {
    nics: &'a [NicIdent],
    handler: &'a dyn Handler,
    pid: u32,
}

impl Server {
    fn run(mut self) {
        let mut events = Events::with_capacity(64);
        // The drain file is read at once, then every period.
        let mut next_read = Instant::now();
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            if let Some(w) = &mut self.watch {
                if Instant::now() >= next_read {
                    w.tick(&self.nics, &*self.handler);
                    next_read = Instant::now() + DRAIN_FILE_EVERY;
                }
            }
            let now = Instant::now();
            let mut due = now + IDLE_WAKE;
            if self.watch.is_some() {
                due = due.min(next_read);
            }
            if let Some(d) = self.conns.iter().map(|(_, c)| c.deadline).min() {
                due = due.min(d);
            }
            if let Err(e) = self
                .poll
                .poll(&mut events, Some(due.saturating_duration_since(now)))
            {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::warn!("railover: the control thread stopped: poll failed: {e}");
                return;
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    Token(k) => self.serve(k),
                }
            }
            self.expire(Instant::now());
        }
    }

    /// Closes the connections past their deadline. One still reading is served once
    /// more first: its line may have come while a long handler call held the thread, and
    /// it must not be refused as slow for that.
    fn expire(&mut self, now: Instant) {
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(k, _)| k)
            .collect();
        for k in late {
            if matches!(self.conns[k].state, State::Reading) {
                self.serve(k);
            }
            if let Some(mut c) = self.conns.try_remove(k) {
                c.give_up(self.pid, &protocol::too_slow());
            }
        }
    }

    /// The listener is edge-triggered: accept until it would block.
    fn accept_all(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => self.add(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and the like: this connection is lost, the listener is not.
                    // A later readiness edge retries.
                    tracing::debug!("railover: control accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn add(&mut self, mut stream: UnixStream) {
        if self.conns.len() >= MAX_CONNECTIONS {
            // Make room: the connection that has waited longest for its request goes
            // (answers being written are finished first).
            let victim = self
                .conns
                .iter()
                .min_by_key(|(_, c)| (!matches!(c.state, State::Reading), c.deadline))
                .map(|(k, _)| k);
            if let Some(k) = victim {
                let mut c = self.conns.remove(k);
                c.give_up(
                    self.pid,
                    "closed to make room for other clients: send the request line as soon as \
                     you connect",
                );
            }
        }
        // Who asks is checked before anything is read from them.
        let state = match peer(&stream) {
            Ok(p) if protocol::allowed(p.uid, self.uid) => State::Reading,
            Ok(p) => State::answer(&Answer::refusal(
                self.pid,
                protocol::not_allowed(p.uid, self.uid),
            )),
            Err(e) => State::answer(&Answer::refusal(
                self.pid,
                format!("cannot tell who is asking (SO_PEERCRED: {e})"),
            )),
        };
        let entry = self.conns.vacant_entry();
        let token = Token(entry.key());
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::debug!("railover: cannot watch a control connection: {e}");
            return;
        }
        entry.insert(Conn {
            stream,
            deadline: Instant::now() + CONNECTION_DEADLINE,
            input: Vec::new(),
            state,
            client_closed: false,
        });
        // Data may have arrived before registration; edge-triggered readiness would not
        // report it again.
        self.serve(token.0);
    }

    /// Advances connection `k`; drops it when done or broken.
    fn serve(&mut self, k: usize) {
        let Server {
            conns,
            nics,
            handler,
            pid,
            ..
        } = self;
        let Some(c) = conns.get_mut(k) else {
            return;
        };
        let ctx = Ctx {
            nics,
            handler: &**handler,
            pid: *pid,
        };
        let keep = match c.step(&ctx) {
            Ok(keep) => keep,
            Err(e) => {
                tracing::debug!("railover: control connection failed: {e}");
                false
            }
        };
        if !keep {
            conns.remove(k);
        }
    }
}

/// One client connection.
struct Conn {
    stream: UnixStream,
    deadline: Instant,
    /// What the client sent, while its request line is incomplete.
    input: Vec<u8>,
    state: State,
    client_closed: bool,
}

enum State {
    /// Reading the request line.
    Reading,
    /// Writing the answer; `sent` bytes of it are written.
    Writing { out: Vec<u8>, sent: usize },
    /// Answered; reading and dropping what the client still sends until it closes.
    Draining { dropped: usize },
}

impl State {
    fn answer(a: &Answer) -> State {
        State::Writing {
            out: a.encode(),
            sent: 0,
        }
    }
}

impl Conn {
    /// Advances the exchange as far as the socket allows; `Ok(false)` once it is over.
    fn step(&mut self, ctx: &Ctx<'_>) -> io::Result<bool> {
        let mut buf = [0u8; 1024];
        while matches!(self.state, State::Reading) {
            match self.stream.read(&mut buf) {
                Ok(0) => self.client_closed = true,
                Ok(n) => self.input.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if self.client_closed && self.input.is_empty() {
                // Connected and left without asking anything.
                return Ok(false);
            }
            let answer = match protocol::frame(&self.input, self.client_closed) {
                Frame::Incomplete => continue,
                Frame::TooLong => Answer::refusal(ctx.pid, protocol::too_long()),
                Frame::Line(line) => protocol::execute(line, ctx.nics, ctx.handler, ctx.pid),
            };
            self.input = Vec::new();
            self.state = State::answer(&answer);
        }
        if let State::Writing { out, sent } = &mut self.state {
            while *sent < out.len() {
                match self.stream.write(&out[*sent..]) {
                    Ok(0) => return Ok(false),
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            // The answer is all there: the client reads it, then the end.
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
            if self.client_closed {
                return Ok(false);
            }
            self.state = State::Draining { dropped: 0 };
        }
        if let State::Draining { dropped } = &mut self.state {
            loop {
                match self.stream.read(&mut buf) {
                    Ok(0) => return Ok(false),
                    Ok(n) => {
                        *dropped += n;
                        if *dropped > MAX_TRAILING {
                            return Ok(false);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(false)
    }

    /// Closes a connection before its exchange ended; one still waiting for its request
    /// is told `why` if its socket takes the line at once (a few hundred bytes into an
    /// empty buffer always fit).
    fn give_up(&mut self, pid: u32, why: &str) {
        if matches!(self.state, State::Reading) {
            let _ = self
                .stream
                .write(&Answer::refusal(pid, why.to_string()).encode());
        }
    }
}
