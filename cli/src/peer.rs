//! The second endpoint of `bench`: the same binary started as a child process (inside
//! the peer namespace on a testbed), driven by one-line commands on its stdin and
//! answering on its stdout, so the two endpoints have separate reactors as two NCCL ranks
//! would. It sends; the parent receives.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use railover_testkit::driver::{Buffer, Code, Ctx, Listener, RecvComm, Request, SendComm};

pub const PEER_COMMAND: &str = "__peer";

/// How long any connect/accept/request may take before the tool gives up.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The child endpoint, seen from the parent.
pub struct Peer {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Peer {
    /// Starts `cmd` (this binary, possibly wrapped in `ip netns exec`) as the peer.
    pub fn spawn(mut cmd: Command) -> std::io::Result<Peer> {
        let mut child = cmd
            .arg(PEER_COMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let to = child.stdin.take().expect("piped");
        let from = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Peer { child, to, from })
    }

    /// The peer's pid (`ip netns exec` execs in place, so it is the peer itself).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn send(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.to, "{line}")
            .and_then(|_| self.to.flush())
            .map_err(|e| format!("the peer process is gone ({e})"))
    }

    pub fn recv(&mut self) -> Result<String, String> {
        let mut s = String::new();
        self.from
            .read_line(&mut s)
            .map_err(|e| format!("reading the peer: {e}"))?;
        if s.is_empty() {
            return Err("the peer process exited early".into());
        }
        Ok(s.trim().to_string())
    }

    /// Sends `line` and expects `ok`.
    pub fn call(&mut self, line: &str) -> Result<(), String> {
        self.send(line)?;
        match self.recv()? {
            r if r == "ok" => Ok(()),
            r => Err(format!("peer answered {r:?} to {line:?}")),
        }
    }

    pub fn finish(mut self) -> bool {
        let _ = self.send("quit");
        matches!(self.child.wait(), Ok(st) if st.success())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Only reached with the child still running on an error path.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Result<[u8; 128], String> {
    let mut out = [0u8; 128];
    if s.len() > 256 || s.len() % 2 != 0 {
        return Err(format!("bad handle {s:?}"));
    }
    for (i, o) in out.iter_mut().enumerate().take(s.len() / 2) {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("bad handle {s:?}"))?;
    }
    Ok(out)
}

/// Connects `handle` on `dev`, polling as NCCL's proxy does.
pub fn connect(ctx: &Ctx, dev: i32, handle: &mut [u8; 128]) -> Result<SendComm, String> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(c) = ctx
            .connect(dev, handle)
            .map_err(|e| format!("connect: {e}"))?
        {
            return Ok(c);
        }
        if Instant::now() > end {
            return Err("connect timed out".into());
        }
        std::thread::yield_now();
    }
}

pub fn accept(l: &Listener) -> Result<RecvComm, String> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(c) = l.accept().map_err(|e| format!("accept: {e}"))? {
            return Ok(c);
        }
        if Instant::now() > end {
            return Err("accept timed out".into());
        }
        std::thread::yield_now();
    }
}

/// How the driving thread spends a round in which nothing moved: it yields the core and
/// calls again, as NCCL's proxy progress loop does (`std::this_thread::yield()` when no
/// request progressed), and never sleeps. With callers driving the reactor
/// (`RAILOVER_PROGRESS=caller`) a sleep here would be a sleep of the plugin's progress
/// too, which NCCL's thread never takes.
fn idle() {
    std::thread::yield_now();
}

/// Tests `req` until done.
pub fn wait(req: &mut Request) -> Result<usize, String> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(n) = req.test().map_err(|e| format!("test: {e}"))? {
            return Ok(n);
        }
        if Instant::now() > end {
            return Err("request timed out".into());
        }
        idle();
    }
}

/// One comm's requests in flight: a ring of `depth` slots, posted and tested in order.
struct Ring {
    reqs: Vec<Option<Request>>,
    posted: u64,
    done: u64,
}

impl Ring {
    fn new(depth: usize) -> Ring {
        Ring {
            reqs: (0..depth).map(|_| None).collect(),
            posted: 0,
            done: 0,
        }
    }
}

/// Drives `count` messages on each of several comms from one thread, as NCCL's proxy
/// progress thread drives all of its connections: post while a slot is free, test only
/// the oldest request of each comm. `post(comm, slot)` returns `None` for "call again".
pub fn drive(
    comms: usize,
    depth: usize,
    count: u64,
    mut post: impl FnMut(usize, usize) -> Result<Option<Request>, Code>,
) -> Result<(), String> {
    let mut rings: Vec<Ring> = (0..comms).map(|_| Ring::new(depth)).collect();
    let end = Instant::now() + PATIENCE;
    let mut finished = 0;
    while finished < comms {
        let mut moved = false;
        for (c, r) in rings.iter_mut().enumerate() {
            if r.done == count {
                continue;
            }
            let slot = (r.posted % depth as u64) as usize;
            if r.posted < count && r.reqs[slot].is_none() {
                if let Some(q) = post(c, slot).map_err(|e| format!("post: {e}"))? {
                    r.reqs[slot] = Some(q);
                    r.posted += 1;
                    moved = true;
                }
            }
            let oldest = (r.done % depth as u64) as usize;
            if let Some(q) = r.reqs[oldest].as_mut() {
                if q.test().map_err(|e| format!("test: {e}"))?.is_some() {
                    r.reqs[oldest] = None;
                    r.done += 1;
                    moved = true;
                    if r.done == count {
                        finished += 1;
                    }
                }
            }
        }
        if !moved {
            if Instant::now() > end {
                return Err("stream stalled".into());
            }
            idle();
        }
    }
    Ok(())
}

/// The raw-TCP sender: `count` messages on each socket, in turn, with at most `depth`
/// unconsumed per socket (the receiver returns one credit byte per message), so the
/// baseline has the same flow control depth as the plugin's clear-to-send.
pub fn raw_send(socks: &mut [TcpStream], bufs: &[Vec<Vec<u8>>], count: u64) -> std::io::Result<()> {
    let depth = bufs[0].len();
    let mut out = vec![0usize; socks.len()];
    let mut credits = vec![0u8; depth];
    for m in 0..count * socks.len() as u64 {
        let c = (m % socks.len() as u64) as usize;
        let k = m / socks.len() as u64;
        if out[c] == depth {
            let n = socks[c].read(&mut credits[..out[c]])?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            out[c] -= n;
        }
        socks[c].write_all(&bufs[c][(k % depth as u64) as usize])?;
        out[c] += 1;
    }
    for (c, s) in socks.iter_mut().enumerate() {
        while out[c] > 0 {
            let n = s.read(&mut credits[..out[c]])?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            out[c] -= n;
        }
    }
    Ok(())
}

/// The raw-TCP receiver's side of [`raw_send`].
pub fn raw_recv(
    socks: &mut [TcpStream],
    bufs: &mut [Vec<Vec<u8>>],
    count: u64,
) -> std::io::Result<()> {
    let depth = bufs[0].len();
    for m in 0..count * socks.len() as u64 {
        let c = (m % socks.len() as u64) as usize;
        let k = m / socks.len() as u64;
        socks[c].read_exact(&mut bufs[c][(k % depth as u64) as usize])?;
        socks[c].write_all(&[1])?;
    }
    Ok(())
}

/// Echoes `count` 8-byte pings: the next receive stays posted while the reply goes out,
/// as an NCCL send/receive loop does.
fn pong(s: &SendComm, r: &RecvComm, count: u64) -> Result<(), String> {
    let e = |e: Code| e.to_string();
    let sb = s.register(8).map_err(e)?;
    let mut rbs = [r.register(8).map_err(e)?, r.register(8).map_err(e)?];
    let mut next = post_recv(r, &mut rbs[0], 8)?;
    for i in 0..count {
        wait(&mut next)?;
        if i + 1 < count {
            next = post_recv(r, &mut rbs[((i + 1) % 2) as usize], 8)?;
        }
        let mut sr = post_send(s, &sb, 8)?;
        wait(&mut sr)?;
    }
    Ok(())
}

/// Posts a receive, retrying while the plugin has no slot.
pub fn post_recv(r: &RecvComm, b: &mut Buffer, len: usize) -> Result<Request, String> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(q) = r.irecv(b, len).map_err(|e| format!("irecv: {e}"))? {
            return Ok(q);
        }
        if Instant::now() > end {
            return Err("irecv: no slot".into());
        }
        std::thread::yield_now();
    }
}

/// Posts a send, retrying while the plugin has no slot.
pub fn post_send(s: &SendComm, b: &Buffer, len: usize) -> Result<Request, String> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(q) = s.isend(b, len).map_err(|e| format!("isend: {e}"))? {
            return Ok(q);
        }
        if Instant::now() > end {
            return Err("isend: no slot".into());
        }
        std::thread::yield_now();
    }
}

/// What the peer holds between commands.
#[derive(Default)]
struct State {
    ctx: Option<Ctx>,
    fwd: Vec<SendComm>,
    back: Option<RecvComm>,
    raw: Vec<TcpStream>,
    /// Per comm, `depth` registered send buffers of the current size point.
    plugin_bufs: Vec<Vec<Buffer>>,
    /// Per socket, `depth` plain buffers of the current size point.
    raw_bufs: Vec<Vec<Vec<u8>>>,
    size: usize,
}

impl State {
    fn ctx(&mut self) -> Result<&Ctx, String> {
        if self.ctx.is_none() {
            self.ctx = Some(Ctx::init().map_err(|e| format!("init: {e}"))?);
        }
        Ok(self.ctx.as_ref().expect("just set"))
    }

    fn command(&mut self, w: &[&str], reply: &mut dyn FnMut(String)) -> Result<bool, String> {
        let num = |s: &str| s.parse::<u64>().map_err(|_| format!("bad number {s:?}"));
        match w {
            ["raw", addr] => {
                let s = TcpStream::connect(addr).map_err(|e| format!("raw connect {addr}: {e}"))?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                self.raw.push(s);
            }
            ["fwd", dev, handle] => {
                let mut h = unhex(handle)?;
                let dev = num(dev)? as i32;
                let c = connect(self.ctx()?, dev, &mut h)?;
                self.fwd.push(c);
            }
            ["back", dev] => {
                let dev = num(dev)? as i32;
                let (h, l) = self
                    .ctx()?
                    .listen(dev)
                    .map_err(|e| format!("listen: {e}"))?;
                reply(format!("handle {}", hex(&h)));
                self.back = Some(accept(&l)?);
            }
            ["prep", size, depth] => {
                let (size, depth) = (num(size)? as usize, num(depth)? as usize);
                self.plugin_bufs.clear();
                self.raw_bufs.clear();
                for s in &self.fwd {
                    let mut v = Vec::new();
                    for _ in 0..depth {
                        let mut b = s.register(size.max(1)).map_err(|e| e.to_string())?;
                        b.bytes_mut().expect("idle buffer").fill(7);
                        v.push(b);
                    }
                    self.plugin_bufs.push(v);
                }
                self.raw_bufs = (0..self.raw.len())
                    .map(|_| (0..depth).map(|_| vec![7u8; size]).collect())
                    .collect();
                self.size = size;
            }
            ["xstream", count] => {
                let count = num(count)?;
                let (fwd, bufs, size) = (&self.fwd, &self.plugin_bufs, self.size);
                let depth = bufs.first().map_or(1, Vec::len);
                drive(fwd.len(), depth, count, |c, k| {
                    fwd[c].isend(&bufs[c][k], size)
                })?;
            }
            ["xraw", count] => {
                raw_send(&mut self.raw, &self.raw_bufs, num(count)?)
                    .map_err(|e| format!("raw send: {e}"))?;
            }
            ["pong", count] => {
                let s = self.fwd.first().ok_or("no comm")?;
                let r = self.back.as_ref().ok_or("no back comm")?;
                pong(s, r, num(count)?)?;
            }
            ["raw-pong", count] => {
                let s = self.raw.first_mut().ok_or("no socket")?;
                let mut b = [0u8; 8];
                for _ in 0..num(count)? {
                    s.read_exact(&mut b).map_err(|e| format!("raw ping: {e}"))?;
                    s.write_all(&b).map_err(|e| format!("raw pong: {e}"))?;
                }
            }
            ["quit"] => return Ok(false),
            _ => return Err(format!("unknown command {:?}", w.join(" "))),
        }
        reply("ok".into());
        Ok(true)
    }
}

/// The child's side: a loop over commands from the parent.
pub fn serve() -> i32 {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut reply = |s: String| {
        let _ = writeln!(out, "{s}").and_then(|_| out.flush());
    };
    let mut st = State::default();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        match st.command(&w, &mut reply) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                eprintln!("railover peer: {e}");
                reply(format!("error {e}"));
                return 1;
            }
        }
    }
    st.plugin_bufs.clear();
    st.fwd.clear();
    st.back = None;
    if let Some(c) = st.ctx.take() {
        let _ = c.finalize();
    }
    0
}
