//! `railover fault-peer`: one endpoint of the fault-injection tier (`tests/fault.rs`).
//!
//! Started inside a network namespace (`ip netns exec <ns> railover fault-peer ...`), it
//! drives the plugin through the exported `ncclNetPlugin_v12` table as NCCL's proxy does:
//! several comms per device, a fixed number of requests in flight on each, messages whose
//! every byte is derived from (comm, sequence number) so the receiver detects loss,
//! duplication, reordering and corruption. It reports on stdout, one JSON line per event
//! ([`railover_testkit::fault_line`]), and stops by itself. `tcp-send` / `tcp-recv` move
//! plain TCP bytes instead, so the testbed can be checked without the plugin. The full
//! protocol is in `docs/fault-tier.md`.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use railover::engine::ReactorStats;
use railover::ffi::types::{NCCL_PTR_CUDA, NCCL_PTR_HOST};
use railover::transport::frames;
use railover::transport::verbs::{flush, lane, register};
use railover_testkit::driver::{Buffer, Code, Ctx, RecvComm, Request, SendComm};
use railover_testkit::fault_line::{Command, Event, Handle, Link, Op, Summary, HANDLE_LEN};
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: u32 = 0x5246_5031;
const HDR: usize = 32;
const FLAG_END: u32 = 1;
const MAX_BAD_LINES: u32 = 20;

#[derive(Debug, Clone)]
struct Opts {
    per_dev: usize,
    /// Comms in all, over the devices in turn; `None`: `per_dev` × devices.
    comms: Option<usize>,
    /// Sender: no comm posts more than this many messages past the slowest comm's
    /// completed count; `None`: every comm runs free.
    lockstep: Option<u64>,
    /// Devices that get comms; `None`: all.
    devs: Option<Vec<usize>>,
    /// Receiver: the number of its first comm.
    first_comm: u32,
    /// Sender: messages per comm before its END; `None`: as many as `seconds` allow.
    messages: Option<u64>,
    size: usize,
    depth: usize,
    seconds: f64,
    grace: f64,
    tick: Duration,
    addr: Option<SocketAddr>,
    rounds: u64,
    ping_size: usize,
    /// Register data buffers as GPU memory where the device takes it.
    gpu: bool,
    linger: bool,
}

/// Test machinery for `tests/fault.rs` and the demo, hence hidden from `railover --help`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Exit status: 0 all delivered, 1 corruption/loss/duplication/reordering \
seen, 3 request errors or stalls (no corruption), 2 usage, 4 setup failed"
)]
pub struct Args {
    /// What this endpoint does
    #[arg(value_enum)]
    pub role: Role,
    /// recv/send: comms per device
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = at_least(1))]
    pub per_dev: usize,
    /// recv: comms in all, comm c on the c-th device in turn (instead of --per-dev)
    #[arg(long, value_name = "C", value_parser = at_least(1), conflicts_with = "per_dev")]
    pub comms: Option<usize>,
    /// send: lockstep, as a collective split over the comms: no comm posts more than K
    /// messages past the slowest comm's completed count [default: every comm runs free]
    #[arg(long, value_name = "K", value_parser = at_least(1))]
    pub lockstep: Option<usize>,
    /// recv: only these devices get comms, e.g. 0,2 [default: all]
    #[arg(long, value_name = "LIST", value_parser = dev_list)]
    pub devs: Option<Devs>,
    /// recv: number the comms from N in the handles and the messages, so that several
    /// receivers serving one sender give no two comms the same number
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub first_comm: u32,
    /// send: N messages per comm, then its END, instead of sending until --seconds
    /// (which still bounds it)
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    pub messages: Option<usize>,
    /// recv/send: message size, at least 32 bytes; K, M, G are powers of 1024, KB, MB, GB
    /// of 1000
    #[arg(long, value_name = "BYTES", default_value = "512K", value_parser = message_size)]
    pub size: usize,
    /// recv/send: requests in flight per comm
    #[arg(long, value_name = "D", default_value_t = 8, value_parser = at_least(1))]
    pub depth: usize,
    /// Send for S seconds; recv gives up at S + 2 x grace
    #[arg(long, value_name = "S", default_value_t = 5.0, value_parser = non_negative)]
    pub seconds: f64,
    /// recv/send: after sending stops, how long to wait for what is in flight, seconds
    #[arg(long, value_name = "S", default_value_t = 5.0, value_parser = non_negative)]
    pub grace: f64,
    /// Interval of `tick` lines, milliseconds
    #[arg(long, value_name = "MS", default_value_t = 100)]
    pub tick_ms: u64,
    /// tcp-recv: address to listen on
    #[arg(long, value_name = "IP:PORT", overrides_with = "to")]
    pub bind: Option<SocketAddr>,
    /// tcp-send: address to connect to
    #[arg(long, value_name = "IP:PORT", overrides_with = "bind")]
    pub to: Option<SocketAddr>,
    /// ping/pong: timed round trips, after 3 untimed ones (both ends need the same)
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = at_least(1))]
    pub rounds: usize,
    /// ping/pong: bytes each way per round trip (no header: any size from 1)
    #[arg(long, value_name = "BYTES", default_value = "8", value_parser = ping_size)]
    pub ping_size: usize,
    /// recv/send: register data buffers as NCCL_PTR_CUDA on every device whose
    /// ptrSupport has it, as NCCL does with GPU buffers (host memory underneath, so that
    /// the payloads can still be checked; the plugin must not touch it with the CPU)
    #[arg(long)]
    pub gpu: bool,
    /// recv: after the summary, keep the comms open until `close` (or EOF) on stdin, at
    /// most --grace seconds, as a job keeps its comms until both ends are done: the last
    /// acknowledgements still reach the sender. Without it the receiver exits at once.
    #[arg(long)]
    pub linger: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Listen on every device, print `handle` lines, receive and verify
    Recv,
    /// Read `handle` lines and then `go` from stdin, connect, send
    Send,
    /// Latency: one comm each way on the first of --devs (default 0); print the
    /// `handle`, read the peer's and `go` from stdin, then time --rounds round trips
    Ping,
    /// The other end of ping: echo every message back
    Pong,
    /// Plain TCP sink on --bind (testbed self-checks)
    TcpRecv,
    /// Plain TCP source to --to (testbed self-checks)
    TcpSend,
}

/// A comma-separated device list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Devs(pub Vec<usize>);

fn dev_list(v: &str) -> Result<Devs, String> {
    v.split(',')
        .map(|d| d.trim().parse().ok())
        .collect::<Option<_>>()
        .map(Devs)
        .ok_or_else(|| "expected device numbers separated by commas, e.g. 0,2".into())
}

fn at_least(lo: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |v| match v.parse::<usize>() {
        Ok(n) if n >= lo => Ok(n),
        _ => Err(format!("expected an integer from {lo}")),
    }
}

fn message_size(v: &str) -> Result<usize, String> {
    let n = crate::size::parse_within(v, HDR as u64, usize::MAX as u64)?;
    usize::try_from(n).map_err(|e| e.to_string())
}

fn ping_size(v: &str) -> Result<usize, String> {
    let n = crate::size::parse_within(v, 1, 1 << 30)?;
    usize::try_from(n).map_err(|e| e.to_string())
}

fn non_negative(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(s) if s >= 0.0 && s.is_finite() => Ok(s),
        _ => Err("expected seconds, 0 or more".into()),
    }
}

impl From<&Args> for Opts {
    fn from(a: &Args) -> Opts {
        Opts {
            per_dev: a.per_dev,
            comms: a.comms,
            lockstep: a.lockstep.map(|k| k as u64),
            devs: a.devs.clone().map(|d| d.0),
            first_comm: a.first_comm,
            messages: a.messages.map(|n| n as u64),
            size: a.size,
            depth: a.depth,
            seconds: a.seconds,
            grace: a.grace,
            tick: Duration::from_millis(a.tick_ms),
            // Either names the one address the role uses, as before.
            addr: a.bind.or(a.to),
            rounds: a.rounds as u64,
            ping_size: a.ping_size,
            gpu: a.gpu,
            linger: a.linger,
        }
    }
}

pub fn run(a: &Args) -> i32 {
    let opts = Opts::from(a);
    match a.role {
        Role::Recv => receiver(&opts),
        Role::Send => sender(&opts),
        Role::Ping => pingpong(&opts, true),
        Role::Pong => pingpong(&opts, false),
        Role::TcpRecv => tcp_recv(&opts),
        Role::TcpSend => tcp_send(&opts),
    }
}

/// Wall-clock milliseconds: comparable between the two endpoints and the test.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn say(e: &Event) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", e.to_line()).and_then(|_| out.flush());
}

fn setup_failed(error: String) {
    say(&Event::SetupFailed { error });
}

// ---- message content ------------------------------------------------------------

fn seed(comm: u32, seq: u64) -> u64 {
    (seq ^ (u64::from(comm) << 48)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03
}

fn next(x: &mut u64) -> [u8; 8] {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    x.to_le_bytes()
}

/// Writes message `seq` of `comm`: a header, then bytes derived from (comm, seq).
fn fill(buf: &mut [u8], comm: u32, seq: u64, flags: u32) {
    let len = buf.len() as u32;
    buf[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    buf[4..8].copy_from_slice(&comm.to_le_bytes());
    buf[8..16].copy_from_slice(&seq.to_le_bytes());
    buf[16..20].copy_from_slice(&len.to_le_bytes());
    buf[20..24].copy_from_slice(&flags.to_le_bytes());
    buf[24..32].fill(0);
    let mut x = seed(comm, seq);
    for chunk in buf[HDR..].chunks_mut(8) {
        let b = next(&mut x);
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// What a received message says about itself, or what is wrong with it.
#[derive(Debug)]
enum Verdict {
    Data,
    End,
    Bad(&'static str, String),
}

fn verify(buf: &[u8], comm: u32, expect_seq: u64) -> Verdict {
    if buf.len() < HDR {
        return Verdict::Bad("size", format!("got={} min={HDR}", buf.len()));
    }
    let u32_at = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().unwrap());
    let seq = u64::from_le_bytes(buf[8..16].try_into().unwrap());
    if u32_at(0) != MAGIC {
        return Verdict::Bad("corrupt", format!("offset=0 magic={:#x}", u32_at(0)));
    }
    if u32_at(4) != comm {
        return Verdict::Bad("misrouted", format!("from_comm={}", u32_at(4)));
    }
    if seq < expect_seq {
        return Verdict::Bad("dup", format!("seq={seq} expected={expect_seq}"));
    }
    if seq > expect_seq {
        return Verdict::Bad("gap", format!("seq={seq} expected={expect_seq}"));
    }
    if u32_at(16) as usize != buf.len() {
        return Verdict::Bad("size", format!("got={} header={}", buf.len(), u32_at(16)));
    }
    let mut x = seed(comm, seq);
    for (i, chunk) in buf[HDR..].chunks(8).enumerate() {
        let b = next(&mut x);
        if chunk != &b[..chunk.len()] {
            return Verdict::Bad("corrupt", format!("offset={}", HDR + 8 * i));
        }
    }
    if u32_at(20) & FLAG_END != 0 {
        Verdict::End
    } else {
        Verdict::Data
    }
}

// ---- bookkeeping shared by both roles --------------------------------------------

#[derive(Debug, Default)]
struct Tally {
    msgs: u64,
    /// Receiver: `iflush` requests that completed.
    flushes: u64,
    bytes: u64,
    bad: u32,
    req_errors: u64,
    codes: BTreeMap<i32, u64>,
    first_error: Option<u64>,
    last_error: Option<u64>,
}

impl Tally {
    fn error(&mut self, comm: usize, op: Op, seq: u64, code: Code) {
        let t = unix_ms();
        self.req_errors += 1;
        *self.codes.entry(code.0).or_default() += 1;
        self.first_error.get_or_insert(t);
        self.last_error = Some(t);
        say(&Event::Error {
            t,
            comm,
            op,
            seq: Some(seq),
            code: code.0,
            detail: None,
        });
    }

    fn bad(&mut self, comm: usize, kind: &str, detail: &str) {
        self.bad += 1;
        if self.bad <= MAX_BAD_LINES {
            say(&Event::Bad {
                t: unix_ms(),
                comm,
                kind: kind.into(),
                detail: detail.into(),
            });
        }
    }

    fn summary(&self, role: &str, comms: usize, ended: usize, failed: usize, stalled: usize) {
        let rt = railover::plugin::runtime().ok();
        // The router's probe tally, from the route snapshot the plugin publishes.
        let probes_failed = rt
            .as_ref()
            .map_or(0, |rt| rt.reactor.routes.load().stats.probes_failed);
        // What the listeners' admission gate did, from the reactor's counters.
        let gate = |c: fn(&ReactorStats) -> &AtomicU64| {
            rt.as_ref()
                .map_or(0, |rt| c(&rt.reactor.stats).load(Ordering::Relaxed))
        };
        let n = |x: usize| x as u64;
        say(&Event::Summary(Summary {
            role: role.into(),
            comms: n(comms),
            msgs: self.msgs,
            bytes: self.bytes,
            ended: n(ended),
            failed: n(failed),
            stalled: n(stalled),
            bad: u64::from(self.bad),
            req_errors: self.req_errors,
            codes: self.codes.iter().map(|(&c, &k)| (c, k)).collect(),
            first_error: self.first_error,
            last_error: self.last_error,
            probes_failed,
            rejected_connections: gate(|s| &s.rejected_connections),
            refused_handshakes: gate(|s| &s.refused_handshakes),
            evicted_handshakes: gate(|s| &s.evicted_handshakes),
            handshakes_peak: gate(|s| &s.handshakes_peak),
            placed_bytes: lane::PLACED_BYTES.load(Ordering::Relaxed),
            registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
            streamed_in: frames::STREAMED_IN.load(Ordering::Relaxed),
            streamed_out: frames::STREAMED_OUT.load(Ordering::Relaxed),
            flushes: self.flushes,
            flush_reads: flush::FLUSH_READS.load(Ordering::Relaxed),
            flushes_excused: flush::FLUSHES_EXCUSED.load(Ordering::Relaxed),
            flushes_queued: flush::FLUSHES_QUEUED.load(Ordering::Relaxed),
            flushes_reposted: flush::FLUSHES_REPOSTED.load(Ordering::Relaxed),
        }));
    }

    fn exit_code(&self, stalled: usize) -> i32 {
        if self.bad > 0 {
            1
        } else if self.req_errors > 0 || stalled > 0 {
            3
        } else {
            0
        }
    }
}

/// Prints a `tick` line every interval with the bytes each comm moved since the last,
/// and each device's bytes when it counts them.
struct Ticker {
    every: Duration,
    start: Instant,
    last: Instant,
    devs: Option<DevCounters>,
    /// Per comm: its last completion, and the longest gap that ended this tick.
    last_done: Vec<Option<Instant>>,
    gaps: Vec<u32>,
}

impl Ticker {
    fn new(every: Duration, devs: Option<DevCounters>) -> Ticker {
        let now = Instant::now();
        Ticker {
            every,
            start: now,
            last: now,
            devs,
            last_done: Vec::new(),
            gaps: Vec::new(),
        }
    }

    /// Comm `i` completed a message now: the wait since its previous one may be the
    /// tick's longest, which shows a pause (a move's switch) the byte counts smooth over.
    fn completed(&mut self, i: usize) {
        if self.last_done.len() <= i {
            self.last_done.resize(i + 1, None);
            self.gaps.resize(i + 1, 0);
        }
        let now = Instant::now();
        if let Some(prev) = self.last_done[i].replace(now) {
            let gap = u32::try_from(now.duration_since(prev).as_millis()).unwrap_or(u32::MAX);
            self.gaps[i] = self.gaps[i].max(gap);
        }
    }

    /// Prints a tick if one is due; says whether it did.
    fn maybe(&mut self, per_comm: &mut [u64]) -> bool {
        let due = self.last.elapsed() >= self.every;
        if due {
            self.flush(per_comm);
        }
        due
    }

    fn flush(&mut self, per_comm: &mut [u64]) {
        self.last = Instant::now();
        say(&Event::Tick {
            t: unix_ms(),
            el: self.start.elapsed().as_millis() as u64,
            bytes: per_comm.to_vec(),
            devs: self.devs.as_mut().map_or_else(Vec::new, DevCounters::delta),
            gaps: self.gaps.clone(),
        });
        per_comm.fill(0);
        self.gaps.fill(0);
    }
}

#[derive(Debug, Clone, Copy)]
enum Dir {
    Tx,
    Rx,
}

impl Dir {
    fn as_str(self) -> &'static str {
        match self {
            Dir::Tx => "tx",
            Dir::Rx => "rx",
        }
    }
}

/// Bytes each local device has moved in one direction, for the ticks' `devs`.
struct DevCounters {
    names: Vec<String>,
    dir: Dir,
    last: Vec<u64>,
}

impl DevCounters {
    fn new(names: Vec<String>, dir: Dir) -> DevCounters {
        let mut d = DevCounters {
            names,
            dir,
            last: Vec::new(),
        };
        d.last = d.read();
        d
    }

    /// The kernel's interface counter where the device is an interface of this
    /// namespace (exact, headers and probes included); otherwise (loopback NICs) the
    /// plugin's own count, which its reactor updates every 100 ms.
    fn read(&self) -> Vec<u64> {
        let mut metrics: Option<String> = None;
        self.names
            .iter()
            .map(|n| {
                let path = format!("/sys/class/net/{n}/statistics/{}_bytes", self.dir.as_str());
                std::fs::read_to_string(path)
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or_else(|| {
                        let text = metrics.get_or_insert_with(|| {
                            railover::plugin::runtime()
                                .map(|rt| rt.telemetry.render())
                                .unwrap_or_default()
                        });
                        plugin_nic_bytes(text, n, self.dir)
                    })
            })
            .collect()
    }

    fn delta(&mut self) -> Vec<u64> {
        let now = self.read();
        let d = now
            .iter()
            .zip(&self.last)
            .map(|(a, b)| a.saturating_sub(*b))
            .collect();
        self.last = now;
        d
    }
}

/// `railover_bytes_total` of one NIC and direction in the plugin's metrics text.
fn plugin_nic_bytes(text: &str, nic: &str, dir: Dir) -> u64 {
    let series = format!(
        "railover_bytes_total{{nic=\"{nic}\",direction=\"{}\"}} ",
        dir.as_str()
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Running lanes per local NIC, from the route snapshot the plugin publishes (read-only
/// observation next to the ABI, for the lane-balance rule); `None` before `init`.
fn lane_counts() -> Option<Vec<u32>> {
    let rt = railover::plugin::runtime().ok()?;
    let routes = rt.reactor.routes.load();
    let mut v = vec![0u32; rt.nics.len()];
    for n in &routes.local_nics {
        if let Some(x) = v.get_mut(n.nic.0 as usize) {
            *x = n.lanes;
        }
    }
    Some(v)
}

/// Prints a [`Event::NicBytes`]: bytes each local NIC has sent so far, as the
/// plugin's own metrics count them (the only per-NIC view when NICs share an interface).
fn say_nic_bytes() {
    let Ok(rt) = railover::plugin::runtime() else {
        return;
    };
    let text = rt.telemetry.render();
    let tx: Vec<u64> = rt
        .nics
        .iter()
        .map(|n| plugin_nic_bytes(&text, &n.tcp.name, Dir::Tx))
        .collect();
    say(&Event::NicBytes { t: unix_ms(), tx });
}

/// Prints a [`Event::Lanes`] (sender: it owns the routes).
fn say_lanes() {
    if let Some(counts) = lane_counts() {
        say(&Event::Lanes {
            t: unix_ms(),
            counts,
        });
    }
}

/// Yield a few times, then sleep briefly: with 2 cores the reactors need the CPU.
#[derive(Default)]
struct Backoff(u32);

impl Backoff {
    fn progress(&mut self) {
        self.0 = 0;
    }
    fn idle(&mut self) {
        self.0 += 1;
        if self.0 < 32 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    /// Sender: no more data; END goes out once all data completed.
    Draining,
    /// Sender: END posted. Receiver: never.
    EndPosted,
    Ended,
    Failed,
}

struct Slot {
    buf: Buffer,
    req: Option<(Request, u64)>,
    /// Receiver: `req` is the `iflush` of a receive of this many bytes into GPU memory,
    /// which is only read once it is done, as NCCL's proxy does.
    flushing: Option<usize>,
}

/// A lane is done: it ended, or it failed and holds no request any more.
fn settled(state: State, slots: &[Slot]) -> bool {
    state == State::Ended || (state == State::Failed && slots.iter().all(|s| s.req.is_none()))
}

/// A comm, the device it is on, and its number (its handle's, which its messages carry).
type OnDev<C> = (C, i32, u32);
/// What an endpoint's setup made: the plugin, its comms, the device names.
type Setup<C> = (Ctx, Vec<OnDev<C>>, Vec<String>);

/// The memory type comm `i`'s buffers on `dev` are registered as (`--gpu`: GPU memory
/// where the device's `ptrSupport` has it, as NCCL chooses), said on stderr.
fn memory_of(ctx: &Ctx, o: &Opts, i: u32, dev: i32) -> c_int {
    if !o.gpu {
        return NCCL_PTR_HOST;
    }
    let support = ctx.properties(dev).map_or(0, |p| p.ptr_support);
    let (ptr, name) = if support & NCCL_PTR_CUDA != 0 {
        (NCCL_PTR_CUDA, "NCCL_PTR_CUDA")
    } else {
        (NCCL_PTR_HOST, "NCCL_PTR_HOST")
    };
    eprintln!(
        "fault-peer: comm {i} on device {dev} (ptrSupport {support}): buffers registered as {name}"
    );
    ptr
}

/// Prints the devices; returns their names.
fn describe_devices(ctx: &Ctx) -> Result<Vec<String>, Code> {
    let n = ctx.devices()?;
    let names: Vec<String> = (0..n)
        .map(|d| {
            ctx.properties(d)
                .map(|p| p.name)
                .unwrap_or_else(|_| "?".into())
        })
        .collect();
    say(&Event::Devices {
        n,
        names: names.clone(),
    });
    Ok(names)
}

// ---- receiver ---------------------------------------------------------------------

struct RecvLane {
    /// The comm's number: its handle's, and the one its messages carry.
    id: u32,
    comm: RecvComm,
    slots: Vec<Slot>,
    /// Its buffers are GPU memory: every receive is flushed before it is read.
    gpu: bool,
    posted: u64,
    done: u64,
    state: State,
}

fn receiver(o: &Opts) -> i32 {
    let setup = || -> Result<Setup<RecvComm>, String> {
        let ctx = Ctx::init().map_err(|e| format!("init: {e}"))?;
        let names = describe_devices(&ctx).map_err(|e| format!("devices: {e}"))?;
        let ndev = names.len() as i32;
        if ndev < 1 {
            return Err("no devices".into());
        }
        let devs = o
            .devs
            .clone()
            .unwrap_or_else(|| (0..ndev as usize).collect());
        if let Some(d) = devs.iter().find(|&&d| d >= ndev as usize) {
            return Err(format!("--devs names device {d} of {ndev}"));
        }
        let m = o.comms.unwrap_or(o.per_dev * devs.len());
        if u64::from(o.first_comm) + m as u64 > 1 << 32 {
            return Err(format!(
                "comms {} to {} do not all fit a message header's 32 bits",
                o.first_comm,
                u64::from(o.first_comm) + m as u64 - 1
            ));
        }
        let mut listeners = Vec::new();
        for i in 0..m {
            let dev = devs[i % devs.len()] as i32;
            let (h, l) = ctx
                .listen(dev)
                .map_err(|e| format!("listen dev {dev}: {e}"))?;
            let id = o.first_comm as usize + i;
            say(&Event::Handle(Handle::new(id, dev, &h)));
            listeners.push((l, dev, id as u32));
        }
        say(&Event::Listening { comms: m });
        let end = Instant::now() + Duration::from_secs(30);
        let mut comms: Vec<Option<OnDev<RecvComm>>> = (0..m).map(|_| None).collect();
        while comms.iter().any(Option::is_none) {
            if Instant::now() > end {
                return Err("accept timed out".into());
            }
            for (c, (l, dev, id)) in comms.iter_mut().zip(&listeners) {
                if c.is_none() {
                    *c = (l.accept().map_err(|e| format!("accept: {e}"))?).map(|c| (c, *dev, *id));
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((ctx, comms.into_iter().map(Option::unwrap).collect(), names))
    };
    let (ctx, comms, names) = match setup() {
        Ok(x) => x,
        Err(e) => {
            setup_failed(e);
            return 4;
        }
    };
    let mut lanes = Vec::new();
    for (comm, dev, id) in comms {
        let ptr = memory_of(&ctx, o, id, dev);
        let slots = (0..o.depth)
            .map(|_| {
                comm.register_as(o.size, ptr).map(|buf| Slot {
                    buf,
                    req: None,
                    flushing: None,
                })
            })
            .collect::<Result<Vec<_>, _>>();
        match slots {
            Ok(slots) => lanes.push(RecvLane {
                id,
                comm,
                slots,
                gpu: ptr == NCCL_PTR_CUDA,
                posted: 0,
                done: 0,
                state: State::Running,
            }),
            Err(e) => {
                setup_failed(format!("regMr: {e}"));
                return 4;
            }
        }
    }
    say(&Event::Connected {
        comms: lanes.len(),
        t: unix_ms(),
        registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
    });

    let mut tally = Tally::default();
    let mut per_comm = vec![0u64; lanes.len()];
    let mut ticker = Ticker::new(o.tick, Some(DevCounters::new(names, Dir::Rx)));
    let give_up = Instant::now() + Duration::from_secs_f64(o.seconds + 2.0 * o.grace);
    let mut backoff = Backoff::default();
    let depth = o.depth as u64;
    loop {
        let mut progress = false;
        for (i, lane) in lanes.iter_mut().enumerate() {
            let id = lane.id as usize;
            // Test: the oldest while healthy, every outstanding one once failed.
            for k in 0..depth {
                let seq = lane.done + k;
                if lane.state == State::Running && k > 0 {
                    break;
                }
                let slot = &mut lane.slots[(seq % depth) as usize];
                let Some((req, s)) = slot.req.as_mut() else {
                    continue;
                };
                let s = *s;
                match req.test() {
                    Ok(None) => {}
                    Ok(Some(got)) => {
                        slot.req = None;
                        progress = true;
                        let flushed = slot.flushing.take();
                        tally.flushes += u64::from(flushed.is_some());
                        let n = flushed.unwrap_or(got);
                        if lane.state == State::Ended {
                            continue;
                        }
                        // A receive into GPU memory is read only once its flush is done.
                        if lane.gpu && n > 0 && flushed.is_none() {
                            match lane.comm.iflush(&mut slot.buf, n) {
                                Ok(Some(r)) => {
                                    slot.req = Some((r, s));
                                    slot.flushing = Some(n);
                                    continue;
                                }
                                Ok(None) => {}
                                Err(c) => {
                                    tally.error(id, Op::Iflush, s, c);
                                    lane.state = State::Failed;
                                    continue;
                                }
                            }
                        }
                        let bytes = slot.buf.bytes().expect("completed buffer is free");
                        match verify(&bytes[..n.min(bytes.len())], lane.id, s) {
                            Verdict::Data => {
                                tally.msgs += 1;
                                tally.bytes += n as u64;
                                per_comm[i] += n as u64;
                                ticker.completed(i);
                            }
                            Verdict::End => {
                                lane.state = State::Ended;
                                say(&Event::End {
                                    t: unix_ms(),
                                    comm: id,
                                    msgs: s,
                                });
                            }
                            Verdict::Bad(kind, detail) => tally.bad(id, kind, &detail),
                        }
                        if lane.state == State::Running {
                            lane.done += 1;
                        }
                    }
                    Err(c) => {
                        slot.req = None;
                        progress = true;
                        if lane.state != State::Ended {
                            tally.error(id, Op::Test, s, c);
                            lane.state = State::Failed;
                        }
                    }
                }
            }
            // Post receives into free slots, in order.
            while lane.state == State::Running && lane.posted < lane.done + depth {
                let seq = lane.posted;
                let slot = &mut lane.slots[(seq % depth) as usize];
                match lane.comm.irecv(&mut slot.buf, o.size) {
                    Ok(Some(r)) => {
                        slot.req = Some((r, seq));
                        lane.posted += 1;
                        progress = true;
                    }
                    Ok(None) => break,
                    Err(c) => {
                        tally.error(id, Op::Irecv, seq, c);
                        lane.state = State::Failed;
                    }
                }
            }
        }
        ticker.maybe(&mut per_comm);
        let settled = lanes.iter().all(|l| settled(l.state, &l.slots));
        if settled || Instant::now() > give_up {
            break;
        }
        if progress {
            backoff.progress();
        } else {
            backoff.idle();
        }
    }
    ticker.flush(&mut per_comm);
    let ended = lanes.iter().filter(|l| l.state == State::Ended).count();
    let failed = lanes.iter().filter(|l| l.state == State::Failed).count();
    let stalled = lanes
        .iter()
        .filter(|l| {
            l.state == State::Running
                || (l.state == State::Failed && l.slots.iter().any(|s| s.req.is_some()))
        })
        .count();
    tally.summary("recv", lanes.len(), ended, failed, stalled);
    let code = tally.exit_code(stalled);
    if o.linger {
        wait_for_close(Duration::from_secs_f64(o.grace));
    }
    // Receives posted past END (and any stuck ones) stay posted: leave them to the
    // process exit rather than closing comms under outstanding requests.
    if lanes
        .iter()
        .any(|l| l.slots.iter().any(|s| s.req.is_some()))
    {
        std::mem::forget(lanes);
        std::mem::forget(ctx);
    } else {
        drop(lanes);
        let _ = ctx.finalize();
    }
    code
}

/// Waits for `close` or the end of stdin, at most `limit`.
fn wait_for_close(limit: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line.map(|l| Command::parse(l.trim())) {
                Ok(Ok(Command::Close)) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(limit);
}

// ---- sender -----------------------------------------------------------------------

struct SendLane {
    /// The comm's number, from its handle: the receiver checks it in every message.
    id: u32,
    comm: SendComm,
    slots: Vec<Slot>,
    posted: u64,
    done: u64,
    state: State,
}

/// Lockstep: how many messages a comm may have posted in all, `window` past the
/// slowest running comm's completed count, as a collective split over the comms cannot
/// run ahead of its slowest part. `None`: free-running, or no comm runs.
fn lockstep_limit(done_of_running: impl Iterator<Item = u64>, window: Option<u64>) -> Option<u64> {
    Some(done_of_running.min()? + window?)
}

/// Whether a running comm may post its next message: a free slot, and within the
/// lockstep limit if there is one.
fn may_post(posted: u64, done: u64, depth: u64, limit: Option<u64>) -> bool {
    posted < done + depth && limit.map_or(true, |l| posted < l)
}

/// The handles on stdin up to `go`, as (comm, dev, bytes) in comm order. The numbers
/// are the receivers' (one receiver: 0..n); no two handles may share one.
fn read_handles() -> Result<Vec<(u32, i32, [u8; HANDLE_LEN])>, String> {
    let mut out = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        match Command::parse(line.trim())? {
            Command::Go => {
                out.sort_by_key(|h: &(u32, i32, [u8; HANDLE_LEN])| h.0);
                if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
                    return Err(format!("two handles for comm {}", w[0].0));
                }
                return Ok(out);
            }
            Command::Handle(h) => {
                let bytes = h
                    .bytes()
                    .ok_or_else(|| format!("handle of comm {} is not 256 hex digits", h.comm))?;
                let comm = u32::try_from(h.comm).map_err(|_| {
                    format!("comm {} does not fit a message header's 32 bits", h.comm)
                })?;
                out.push((comm, h.dev, bytes));
            }
            c => return Err(format!("{c:?} before `go`")),
        }
    }
    Err("stdin closed before `go`".into())
}

fn sender(o: &Opts) -> i32 {
    let setup = || -> Result<Setup<SendComm>, String> {
        let ctx = Ctx::init().map_err(|e| format!("init: {e}"))?;
        let names = describe_devices(&ctx).map_err(|e| format!("devices: {e}"))?;
        let ndev = names.len() as i32;
        let mut handles = read_handles()?;
        if let Some(h) = handles.iter().find(|h| h.1 >= ndev) {
            return Err(format!("comm {} wants device {} of {ndev}", h.0, h.1));
        }
        let end = Instant::now() + Duration::from_secs(30);
        let mut comms: Vec<Option<OnDev<SendComm>>> = handles.iter().map(|_| None).collect();
        while comms.iter().any(Option::is_none) {
            if Instant::now() > end {
                return Err("connect timed out".into());
            }
            for (c, (id, dev, h)) in comms.iter_mut().zip(handles.iter_mut()) {
                if c.is_none() {
                    *c = ctx
                        .connect(*dev, h)
                        .map_err(|e| format!("connect dev {dev}: {e}"))?
                        .map(|c| (c, *dev, *id));
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((ctx, comms.into_iter().map(Option::unwrap).collect(), names))
    };
    let (ctx, comms, names) = match setup() {
        Ok(x) => x,
        Err(e) => {
            setup_failed(e);
            return 4;
        }
    };
    let mut lanes = Vec::new();
    for (comm, dev, id) in comms {
        let ptr = memory_of(&ctx, o, id, dev);
        let mut slots = Vec::new();
        for _ in 0..o.depth {
            match comm.register_as(o.size, ptr) {
                Ok(buf) => slots.push(Slot {
                    buf,
                    req: None,
                    flushing: None,
                }),
                Err(e) => {
                    setup_failed(format!("regMr comm {id}: {e}"));
                    return 4;
                }
            }
        }
        lanes.push(SendLane {
            id,
            comm,
            slots,
            posted: 0,
            done: 0,
            state: State::Running,
        });
    }
    say(&Event::Connected {
        comms: lanes.len(),
        t: unix_ms(),
        registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
    });
    // From here on stdin carries fault injections and, at the end, `close` (or EOF).
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(l) = line else { break };
            match Command::parse(l.trim()) {
                Ok(Command::Close) => break,
                Ok(Command::Link { link, dev }) => {
                    match railover::plugin::inject_link(dev, link == Link::Up) {
                        Ok(()) => say(&Event::Injected {
                            link,
                            dev,
                            t: unix_ms(),
                        }),
                        Err(e) => say(&Event::InjectFailed {
                            link,
                            dev,
                            error: e.to_string(),
                        }),
                    }
                }
                // Late handles or `go`, and lines that are not commands: nothing to do.
                Ok(_) | Err(_) => {}
            }
        }
        let _ = closed_tx.send(());
    });

    let mut tally = Tally::default();
    let mut per_comm = vec![0u64; lanes.len()];
    let mut ticker = Ticker::new(o.tick, Some(DevCounters::new(names, Dir::Tx)));
    let stop = Instant::now() + Duration::from_secs_f64(o.seconds);
    let give_up = stop + Duration::from_secs_f64(o.grace);
    let mut backoff = Backoff::default();
    let depth = o.depth as u64;
    loop {
        let mut progress = false;
        let stopping = Instant::now() >= stop;
        // Taken once a round: the slowest only moves forward, so a stale limit only
        // holds a comm back a little longer.
        let limit = lockstep_limit(
            lanes
                .iter()
                .filter(|l| l.state == State::Running)
                .map(|l| l.done),
            o.lockstep,
        );
        for (i, lane) in lanes.iter_mut().enumerate() {
            let id = lane.id as usize;
            let sent_all = o.messages.is_some_and(|n| lane.posted >= n);
            if (stopping || sent_all) && lane.state == State::Running {
                lane.state = State::Draining;
            }
            let want_end = lane.state == State::Draining && lane.done == lane.posted;
            while lane.state == State::Running
                && may_post(lane.posted, lane.done, depth, limit)
                && o.messages.map_or(true, |n| lane.posted < n)
                || want_end && lane.state == State::Draining && lane.posted < lane.done + depth
            {
                let seq = lane.posted;
                let end = lane.state == State::Draining;
                let len = if end { HDR } else { o.size };
                let slot = &mut lane.slots[(seq % depth) as usize];
                let bytes = slot.buf.bytes_mut().expect("free slot");
                fill(
                    &mut bytes[..len],
                    lane.id,
                    seq,
                    if end { FLAG_END } else { 0 },
                );
                match lane.comm.isend(&slot.buf, len) {
                    Ok(Some(r)) => {
                        slot.req = Some((r, seq));
                        lane.posted += 1;
                        progress = true;
                        if end {
                            lane.state = State::EndPosted;
                        }
                    }
                    Ok(None) => break,
                    Err(c) => {
                        tally.error(id, Op::Isend, seq, c);
                        lane.state = State::Failed;
                    }
                }
            }
            for k in 0..depth {
                let seq = lane.done + k;
                if lane.state != State::Failed && k > 0 {
                    break;
                }
                let slot = &mut lane.slots[(seq % depth) as usize];
                let Some((req, s)) = slot.req.as_mut() else {
                    continue;
                };
                let s = *s;
                match req.test() {
                    Ok(None) => {}
                    Ok(Some(n)) => {
                        slot.req = None;
                        progress = true;
                        if lane.state == State::EndPosted && s + 1 == lane.posted {
                            lane.state = State::Ended;
                        } else if n != o.size {
                            tally.bad(id, "size", &format!("send seq={s} completed={n}"));
                        } else {
                            tally.msgs += 1;
                            tally.bytes += n as u64;
                            per_comm[i] += n as u64;
                            ticker.completed(i);
                        }
                        if lane.state != State::Failed {
                            lane.done += 1;
                        }
                    }
                    Err(c) => {
                        slot.req = None;
                        progress = true;
                        tally.error(id, Op::Test, s, c);
                        lane.state = State::Failed;
                    }
                }
            }
        }
        if ticker.maybe(&mut per_comm) {
            say_lanes();
            say_nic_bytes();
        }
        let settled = lanes.iter().all(|l| settled(l.state, &l.slots));
        if settled || Instant::now() > give_up {
            break;
        }
        if progress {
            backoff.progress();
        } else {
            backoff.idle();
        }
    }
    ticker.flush(&mut per_comm);
    let ended = lanes.iter().filter(|l| l.state == State::Ended).count();
    let failed = lanes.iter().filter(|l| l.state == State::Failed).count();
    let stalled = lanes
        .iter()
        .filter(|l| l.slots.iter().any(|s| s.req.is_some()))
        .count();
    tally.summary("send", lanes.len(), ended, failed, stalled);
    let code = tally.exit_code(stalled);
    // Closing now could fail receives the receiver has not yet tested: keep the comms
    // open until the test says `close` (or closes stdin), for at most the grace time.
    let _ = closed_rx.recv_timeout(Duration::from_secs_f64(o.grace));
    if stalled > 0 {
        std::mem::forget(lanes);
        std::mem::forget(ctx);
    } else {
        drop(lanes);
        let _ = ctx.finalize();
    }
    code
}

// ---- ping/pong: round-trip latency -------------------------------------------------

/// Untimed round trips before the timed ones (first-message lane setup, cold caches).
const WARM_ROUNDS: u64 = 3;
/// How long one post or one request may take before the round trip counts as failed.
const ROUND_PATIENCE: Duration = Duration::from_secs(30);

/// Both ends listen and connect, so each has a comm either way; ping sends round `k`'s
/// bytes and waits for them to come back, pong echoes. Ping prints `{pingpong rounds
/// size round_trip_us one_way_us}` (one way: half the round trip, as ib_write_lat
/// reports), or `{pingpong-failed round error}`; exit 0, 3 on a failed round, 4 setup.
fn pingpong(o: &Opts, ping: bool) -> i32 {
    let setup = || -> Result<(Ctx, SendComm, RecvComm), String> {
        let ctx = Ctx::init().map_err(|e| format!("init: {e}"))?;
        let ndev = describe_devices(&ctx)
            .map_err(|e| format!("devices: {e}"))?
            .len();
        let dev = o
            .devs
            .as_ref()
            .and_then(|d| d.first().copied())
            .unwrap_or(0);
        if dev >= ndev {
            return Err(format!("device {dev} of {ndev}"));
        }
        let dev = dev as i32;
        let (h, listener) = ctx
            .listen(dev)
            .map_err(|e| format!("listen dev {dev}: {e}"))?;
        say(&Event::Handle(Handle::new(0, dev, &h)));
        say(&Event::Listening { comms: 1 });
        let mut handles = read_handles()?;
        let [(_, _, peer)] = handles.as_mut_slice() else {
            return Err(format!("want the peer's one handle, got {}", handles.len()));
        };
        // Both at once: each end's connect completes only once the other accepts.
        let end = Instant::now() + Duration::from_secs(30);
        let (mut send, mut recv) = (None, None);
        while send.is_none() || recv.is_none() {
            if Instant::now() > end {
                return Err("connect/accept timed out".into());
            }
            if send.is_none() {
                send = ctx
                    .connect(dev, peer)
                    .map_err(|e| format!("connect dev {dev}: {e}"))?;
            }
            if recv.is_none() {
                recv = listener.accept().map_err(|e| format!("accept: {e}"))?;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((ctx, send.expect("connected"), recv.expect("accepted")))
    };
    let (ctx, send, recv) = match setup() {
        Ok(x) => x,
        Err(e) => {
            setup_failed(e);
            return 4;
        }
    };
    let size = o.ping_size;
    let bufs = send
        .register(size)
        .and_then(|s| Ok((s, recv.register(size)?)));
    let Ok((mut sbuf, mut rbuf)) = bufs else {
        setup_failed("regMr failed".into());
        return 4;
    };
    say(&Event::Connected {
        comms: 1,
        t: unix_ms(),
        registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
    });
    let mut t0 = Instant::now();
    for round in 0..WARM_ROUNDS + o.rounds {
        if round == WARM_ROUNDS {
            t0 = Instant::now();
        }
        let r = if ping {
            ping_round(&send, &recv, &mut sbuf, &mut rbuf, round)
        } else {
            pong_round(&send, &recv, &mut sbuf, &mut rbuf)
        };
        if let Err(error) = r {
            let line =
                serde_json::json!({"event": "pingpong-failed", "round": round, "error": error});
            println!("{line}");
            return 3;
        }
    }
    if ping {
        let rt = t0.elapsed().as_secs_f64() * 1e6 / o.rounds as f64;
        let line = serde_json::json!({
            "event": "pingpong",
            "rounds": o.rounds,
            "size": size,
            "round_trip_us": (rt * 10.0).round() / 10.0,
            "one_way_us": (rt * 5.0).round() / 10.0,
        });
        println!("{line}");
    }
    // Let the peer see its last message before the comms close under it.
    std::thread::sleep(Duration::from_millis(200));
    drop((send, recv));
    let _ = ctx.finalize();
    0
}

/// Posts with `post` until the plugin takes the request, within [`ROUND_PATIENCE`].
fn post_until(mut post: impl FnMut() -> Result<Option<Request>, Code>) -> Result<Request, String> {
    let end = Instant::now() + ROUND_PATIENCE;
    let mut backoff = Backoff::default();
    loop {
        if let Some(r) = post().map_err(|e| format!("post: {e}"))? {
            return Ok(r);
        }
        if Instant::now() > end {
            return Err("the plugin took no request".into());
        }
        backoff.idle();
    }
}

/// Tests `req` until it completes; its size.
fn complete(req: &mut Request) -> Result<usize, String> {
    let end = Instant::now() + ROUND_PATIENCE;
    let mut backoff = Backoff::default();
    loop {
        if let Some(n) = req.test().map_err(|e| format!("test: {e}"))? {
            return Ok(n);
        }
        if Instant::now() > end {
            return Err("a request did not complete".into());
        }
        backoff.idle();
    }
}

/// The bytes of round `round`: they change every round, so a stale echo shows.
fn round_bytes(buf: &mut [u8], round: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (round as usize).wrapping_mul(31).wrapping_add(i) as u8;
    }
}

fn ping_round(
    send: &SendComm,
    recv: &RecvComm,
    sbuf: &mut Buffer,
    rbuf: &mut Buffer,
    round: u64,
) -> Result<(), String> {
    let size = sbuf.len();
    round_bytes(sbuf.bytes_mut().expect("free buffer"), round);
    let mut r = post_until(|| recv.irecv(rbuf, size))?;
    let mut s = post_until(|| send.isend(sbuf, size))?;
    complete(&mut s)?;
    let n = complete(&mut r)?;
    drop(r);
    let mut want = vec![0u8; size];
    round_bytes(&mut want, round);
    if n != size || rbuf.bytes().expect("completed buffer is free") != &want[..] {
        return Err(format!("the echo of round {round} differs ({n} bytes)"));
    }
    Ok(())
}

fn pong_round(
    send: &SendComm,
    recv: &RecvComm,
    sbuf: &mut Buffer,
    rbuf: &mut Buffer,
) -> Result<(), String> {
    let size = sbuf.len();
    let mut r = post_until(|| recv.irecv(rbuf, size))?;
    let n = complete(&mut r)?;
    drop(r);
    if n != size {
        return Err(format!("got {n} bytes, want {size}"));
    }
    let got = rbuf.bytes().expect("completed buffer is free");
    sbuf.bytes_mut().expect("free buffer").copy_from_slice(got);
    let mut s = post_until(|| send.isend(sbuf, size))?;
    complete(&mut s)?;
    Ok(())
}

// ---- plain TCP, for the testbed's own checks ---------------------------------------

fn tcp_recv(o: &Opts) -> i32 {
    let Some(addr) = o.addr else {
        eprintln!("railover fault-peer tcp-recv: --bind IP:PORT is required");
        return 2;
    };
    let l = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            setup_failed(format!("bind {addr}: {e}"));
            return 4;
        }
    };
    say(&Event::TcpListening {
        addr: l.local_addr().map_or(addr, |a| a),
    });
    let (mut s, _) = match l.accept() {
        Ok(x) => x,
        Err(e) => {
            setup_failed(format!("accept: {e}"));
            return 4;
        }
    };
    let _ = s.set_read_timeout(Some(o.tick / 2));
    say(&Event::Connected {
        comms: 1,
        t: unix_ms(),
        registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
    });
    let end = Instant::now() + Duration::from_secs_f64(o.seconds);
    let mut ticker = Ticker::new(o.tick, None);
    let mut per = [0u64];
    let mut total = 0u64;
    let mut buf = vec![0u8; 256 << 10];
    while Instant::now() < end {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                per[0] += n as u64;
                total += n as u64;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                say(&Event::Error {
                    t: unix_ms(),
                    comm: 0,
                    op: Op::Read,
                    seq: None,
                    code: -1,
                    detail: Some(e.to_string()),
                });
                break;
            }
        }
        ticker.maybe(&mut per);
    }
    ticker.flush(&mut per);
    say(&Event::Summary(Summary {
        role: "tcp-recv".into(),
        bytes: total,
        ..Summary::default()
    }));
    0
}

fn tcp_send(o: &Opts) -> i32 {
    let Some(addr) = o.addr else {
        eprintln!("railover fault-peer tcp-send: --to IP:PORT is required");
        return 2;
    };
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => {
            setup_failed(format!("connect {addr}: {e}"));
            return 4;
        }
    };
    let _ = s.set_write_timeout(Some(Duration::from_millis(50)));
    say(&Event::Connected {
        comms: 1,
        t: unix_ms(),
        registrations: register::USER_REGISTRATIONS.load(Ordering::Relaxed),
    });
    let end = Instant::now() + Duration::from_secs_f64(o.seconds);
    let buf = vec![0x5au8; 64 << 10];
    let mut total = 0u64;
    while Instant::now() < end {
        match s.write(&buf) {
            Ok(n) => total += n as u64,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                say(&Event::Error {
                    t: unix_ms(),
                    comm: 0,
                    op: Op::Write,
                    seq: None,
                    code: -1,
                    detail: Some(e.to_string()),
                });
                break;
            }
        }
    }
    say(&Event::Summary(Summary {
        role: "tcp-send".into(),
        bytes: total,
        ..Summary::default()
    }));
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn verify_detects_each_kind_of_damage() {
        let mut m = vec![0u8; 4096 + 5];
        fill(&mut m, 3, 7, 0);
        assert!(matches!(verify(&m, 3, 7), Verdict::Data));
        assert!(matches!(verify(&m, 3, 8), Verdict::Bad("dup", _)));
        assert!(matches!(verify(&m, 3, 6), Verdict::Bad("gap", _)));
        assert!(matches!(verify(&m, 2, 7), Verdict::Bad("misrouted", _)));
        assert!(matches!(verify(&m[..100], 3, 7), Verdict::Bad("size", _)));
        m[4000] ^= 1;
        assert!(matches!(verify(&m, 3, 7), Verdict::Bad("corrupt", _)));
        let mut e = vec![0u8; HDR];
        fill(&mut e, 0, 9, FLAG_END);
        assert!(matches!(verify(&e, 0, 9), Verdict::End));
    }

    #[test]
    fn lockstep_holds_every_comm_within_k_of_the_slowest() {
        // Comms have completed 3, 10 and 12 messages; K = 8: none may have posted past 11.
        let limit = lockstep_limit([3, 10, 12].into_iter(), Some(8));
        assert_eq!(limit, Some(11));
        assert!(may_post(10, 10, 8, limit), "seq 10 is 7 past the slowest");
        assert!(!may_post(11, 10, 8, limit), "seq 11 would be 8 past");
        assert!(!may_post(12, 12, 8, limit));
        // The slowest itself is held only by its depth.
        assert!(may_post(10, 3, 8, limit));
        assert!(!may_post(11, 3, 8, limit));
        // Free-running: only the depth counts.
        assert_eq!(lockstep_limit([3, 10].into_iter(), None), None);
        assert!(may_post(19, 12, 8, None));
        assert!(!may_post(20, 12, 8, None));
        // No running comm left: nothing to wait for.
        assert_eq!(lockstep_limit(std::iter::empty(), Some(8)), None);
    }

    fn parse(argv: &[&str]) -> Result<Args, String> {
        let argv = ["railover", "fault-peer"].iter().chain(argv);
        match crate::Cli::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .command
        {
            crate::Command::FaultPeer(a) => Ok(a),
            c => panic!("parsed as {c:?}"),
        }
    }

    #[test]
    fn options_parse() {
        let o = Opts::from(&parse(&["recv"]).unwrap());
        assert_eq!((o.per_dev, o.size, o.depth), (1, 512 << 10, 8));
        assert_eq!(
            (o.seconds, o.grace, o.tick),
            (5.0, 5.0, Duration::from_millis(100))
        );
        assert_eq!((o.devs, o.addr), (None, None));
        assert_eq!((o.first_comm, o.messages), (0, None));
        // What the fault tier and the demo pass.
        let a = parse(&[
            "send",
            "--per-dev",
            "2",
            "--size",
            "256k",
            "--depth",
            "4",
            "--seconds",
            "9.5",
            "--grace",
            "0",
            "--tick-ms",
            "50",
            "--devs",
            "0, 2",
        ])
        .unwrap();
        assert_eq!(a.role, Role::Send);
        let o = Opts::from(&a);
        assert_eq!((o.per_dev, o.size, o.depth), (2, 256 << 10, 4));
        assert_eq!(
            (o.seconds, o.grace, o.tick),
            (9.5, 0.0, Duration::from_millis(50))
        );
        assert_eq!(o.devs, Some(vec![0, 2]));
        assert_eq!((o.comms, o.lockstep), (None, None));
        let o = Opts::from(&parse(&["send", "--comms", "8", "--lockstep", "4"]).unwrap());
        assert_eq!((o.comms, o.lockstep), (Some(8), Some(4)));
        // A receiver of a mesh and a sender that stops after a few messages.
        let o = Opts::from(&parse(&["recv", "--comms", "512", "--first-comm", "1024"]).unwrap());
        assert_eq!((o.comms, o.first_comm), (Some(512), 1024));
        let o = Opts::from(&parse(&["send", "--messages", "4"]).unwrap());
        assert_eq!(o.messages, Some(4));
        assert_eq!(
            Opts::from(&parse(&["send", "--size", "1m"]).unwrap()).size,
            1 << 20
        );
        // The verbs tier's latency pair: no header, so 8 bytes is a valid size.
        let o = Opts::from(&parse(&["ping", "--rounds", "40", "--ping-size", "8"]).unwrap());
        assert_eq!((o.rounds, o.ping_size), (40, 8));
        let o = Opts::from(&parse(&["pong"]).unwrap());
        assert_eq!((o.rounds, o.ping_size), (100, 8));
        let a = parse(&["tcp-recv", "--bind", "10.0.0.2:5201"]).unwrap();
        assert_eq!(Opts::from(&a).addr, Some("10.0.0.2:5201".parse().unwrap()));
        let a = parse(&["tcp-send", "--to", "10.0.0.2:5202"]).unwrap();
        assert_eq!(Opts::from(&a).addr, Some("10.0.0.2:5202".parse().unwrap()));
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        for (argv, flag) in [
            (&["recv", "--size", "3"][..], "--size"),
            (&["recv", "--size", "lots"], "--size"),
            (&["recv", "--per-dev", "0"], "--per-dev"),
            (&["recv", "--depth", "0"], "--depth"),
            (&["send", "--lockstep", "0"], "--lockstep"),
            (&["send", "--messages", "0"], "--messages"),
            (&["recv", "--first-comm", "x"], "--first-comm"),
            (&["recv", "--first-comm", "4294967296"], "--first-comm"),
            (&["recv", "--comms", "0"], "--comms"),
            (&["recv", "--comms", "4", "--per-dev", "2"], "--comms"),
            (&["recv", "--devs", "0,x"], "--devs"),
            (&["send", "--grace", "nan"], "--grace"),
            (&["tcp-send", "--to", "nowhere"], "--to"),
            (&["ping", "--rounds", "0"], "--rounds"),
            (&["ping", "--ping-size", "0"], "--ping-size"),
            (&["pong", "--ping-size", "2G"], "--ping-size"),
        ] {
            let e = parse(argv).unwrap_err();
            assert!(e.contains(flag), "{argv:?}: {e}");
        }
        assert!(parse(&[]).is_err(), "the role is required");
        assert!(parse(&["relay"]).is_err());
    }
}
