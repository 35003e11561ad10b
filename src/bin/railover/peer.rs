//! The second endpoint of `demo` and `bench`: the same binary started as a child
//! process, driven by one-line commands on its stdin and answering on its stdout, so the
//! two endpoints have separate reactors as two NCCL ranks would.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use railover::ffi::driver::{Buffer, Code, Ctx, Listener, RecvComm, Request, SendComm};

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
    pub fn spawn() -> std::io::Result<Peer> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg(PEER_COMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let to = child.stdin.take().expect("piped");
        let from = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Peer { child, to, from })
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.to, "{line}")
            .and_then(|_| self.to.flush())
            .expect("peer stdin");
    }

    pub fn recv(&mut self) -> String {
        let mut s = String::new();
        self.from.read_line(&mut s).expect("peer stdout");
        if s.is_empty() {
            panic!("the peer process exited early");
        }
        s.trim().to_string()
    }

    pub fn finish(mut self) -> bool {
        self.send("quit");
        matches!(self.child.wait(), Ok(st) if st.success())
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> [u8; 128] {
    let mut out = [0u8; 128];
    for (i, o) in out.iter_mut().enumerate().take(s.len() / 2) {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex handle");
    }
    out
}

/// Connects `handle` on device 0, polling as NCCL's proxy does.
pub fn connect(ctx: &Ctx, handle: &mut [u8; 128]) -> Result<SendComm, Code> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(c) = ctx.connect(0, handle)? {
            return Ok(c);
        }
        assert!(Instant::now() < end, "connect timed out");
        std::thread::yield_now();
    }
}

pub fn accept(l: &Listener) -> Result<RecvComm, Code> {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(c) = l.accept()? {
            return Ok(c);
        }
        assert!(Instant::now() < end, "accept timed out");
        std::thread::yield_now();
    }
}

/// How a waiting application thread spends its time between `test` calls: a few quick
/// retries, then short sleeps. On a machine with fewer cores than busy threads, pure
/// spinning would take the CPU away from the reactors that do the actual work.
#[derive(Debug, Default)]
pub struct Backoff {
    idle: u32,
}

impl Backoff {
    pub fn reset(&mut self) {
        self.idle = 0;
    }

    pub fn idle(&mut self) {
        self.idle += 1;
        if self.idle < 32 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Tests `req` until done.
pub fn wait(req: &mut Request) -> Result<usize, Code> {
    let end = Instant::now() + PATIENCE;
    let mut backoff = Backoff::default();
    loop {
        if let Some(n) = req.test()? {
            return Ok(n);
        }
        assert!(Instant::now() < end, "request timed out");
        backoff.idle();
    }
}

/// Streams `count` messages of `len` bytes with at most `bufs.len()` in flight.
pub fn send_stream(s: &SendComm, bufs: &[Buffer], len: usize, count: u64) -> Result<(), Code> {
    let depth = bufs.len();
    let mut reqs: Vec<Option<Request>> = (0..depth).map(|_| None).collect();
    let mut seq = 0u64;
    let mut done = 0u64;
    let end = Instant::now() + PATIENCE;
    let mut backoff = Backoff::default();
    while done < count {
        assert!(Instant::now() < end, "send stream stalled");
        let slot = (seq % depth as u64) as usize;
        if seq < count && reqs[slot].is_none() {
            if let Some(r) = s.isend(&bufs[slot], len)? {
                reqs[slot] = Some(r);
                seq += 1;
                backoff.reset();
                continue;
            }
        }
        // Test the oldest outstanding, as NCCL does.
        let oldest = (done % depth as u64) as usize;
        if let Some(r) = reqs[oldest].as_mut() {
            if r.test()?.is_some() {
                reqs[oldest] = None;
                done += 1;
                backoff.reset();
                continue;
            }
        }
        backoff.idle();
    }
    Ok(())
}

/// The child's side: a loop over commands from the parent.
pub fn serve(_args: &[String]) -> i32 {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut ctx: Option<Ctx> = None;
    let mut fwd: Option<SendComm> = None;
    let mut back: Option<RecvComm> = None;
    let mut raw: Option<TcpStream> = None;
    let mut reply = |s: String| {
        writeln!(out, "{s}")
            .and_then(|_| out.flush())
            .expect("stdout");
    };
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["raw", addr] => {
                let s = TcpStream::connect(addr).expect("raw connect");
                s.set_nodelay(true).unwrap();
                raw = Some(s);
                reply("ok".into());
            }
            ["raw-stream", len, count] => {
                let (len, count): (usize, u64) = (len.parse().unwrap(), count.parse().unwrap());
                let buf = vec![7u8; len];
                let s = raw.as_mut().expect("raw connected");
                for _ in 0..count {
                    s.write_all(&buf).expect("raw write");
                }
                let mut ack = [0u8; 1];
                s.read_exact(&mut ack).expect("raw ack");
                reply("ok".into());
            }
            ["raw-pong", count] => {
                let s = raw.as_mut().expect("raw connected");
                let mut b = [0u8; 8];
                for _ in 0..count.parse::<u64>().unwrap() {
                    s.read_exact(&mut b).expect("raw ping");
                    s.write_all(&b).expect("raw pong");
                }
                reply("ok".into());
            }
            ["plugin", handle] => {
                let c = Ctx::init().expect("peer init");
                let mut h = unhex(handle);
                let (rh, l) = c.listen(0).expect("peer listen");
                reply(format!("handle {}", hex(&rh)));
                fwd = Some(connect(&c, &mut h).expect("peer connect"));
                back = Some(accept(&l).expect("peer accept"));
                ctx = Some(c);
                reply("ok".into());
            }
            ["stream", len, count, depth] => {
                let (len, count, depth): (usize, u64, usize) = (
                    len.parse().unwrap(),
                    count.parse().unwrap(),
                    depth.parse().unwrap(),
                );
                let s = fwd.as_ref().expect("plugin connected");
                let bufs: Vec<Buffer> = (0..depth)
                    .map(|_| s.register(len.max(1)).unwrap())
                    .collect();
                let r = send_stream(s, &bufs, len, count);
                reply(match r {
                    Ok(()) => "ok".into(),
                    Err(e) => format!("error {e}"),
                });
            }
            ["pong", count] => {
                // Echo pings, keeping the next receive posted while the reply goes out,
                // as an NCCL send/receive loop does.
                let (s, r) = (fwd.as_ref().unwrap(), back.as_ref().unwrap());
                let sb = s.register(8).unwrap();
                let mut rbs = [r.register(8).unwrap(), r.register(8).unwrap()];
                let count = count.parse::<u64>().unwrap();
                let mut next = r.irecv(&mut rbs[0], 8).unwrap().expect("slot");
                for i in 0..count {
                    wait(&mut next).expect("ping");
                    if i + 1 < count {
                        next = r
                            .irecv(&mut rbs[((i + 1) % 2) as usize], 8)
                            .unwrap()
                            .expect("slot");
                    }
                    let mut sr = s.isend(&sb, 8).unwrap().expect("slot");
                    wait(&mut sr).expect("pong");
                }
                reply("ok".into());
            }
            ["quit"] => break,
            _ => {
                eprintln!("railover peer: unknown command {line:?}");
                return 2;
            }
        }
    }
    drop((fwd, back));
    if let Some(c) = ctx {
        let _ = c.finalize();
    }
    0
}
