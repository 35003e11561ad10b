//! `railover verbs-check`: the verbs layer against real devices, for the Soft-RoCE tier
//! (`scripts/verbs-tier.sh`) and for a first look at a node with RDMA NICs.
//!
//! `list` prints what discovery finds. `serve` and `connect` set up one verbs lane per rail
//! the way the plugin does, from the same settings: `RAILOVER_QPS_PER_LANE` RC QPs, each
//! addressed and timed as a lane's (`RAILOVER_IB_TIMEOUT`, `_RETRY_CNT`, `_TC`, `_SL`; the
//! header line prints them). The QP addresses are exchanged, in the lane's hello format,
//! over a TCP connection between the rails' own addresses (as the fabric's bootstrap does),
//! so ends with different QP counts refuse each other as lanes do. Then on every QP the
//! client RDMA-WRITEs `--messages` checksummed messages with immediates into the server's
//! region, the server checks every byte and that each arrived on its QP, and writes it all
//! back, the client checks it, and finally the server fences its QPs (ERR) and the
//! client's next write on each QP must fail with an error completion. With `--seal` the
//! server seals its QPs instead, as the plugin does with a receive lane it gives up: its
//! own write on each QP must still complete, and the client's next write on each must
//! be refused (a remote access or invalid request error).
//!
//! Then, on both ends (and alone with `flush`), every rail's device flush QP (the READ
//! that NCCL's `iflush` posts, `Flusher`): READs of a registered host buffer through its
//! key must bring back its bytes, twice with a changed pattern so a stale value cannot
//! pass; a READ under a deregistered key must fail with an error completion that stays;
//! and the device must then hand out a fresh flusher that works.
//!
//! Exit status: 0 when every rail passed, 1 when one failed, 2 on bad arguments or settings.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use railover::config::{Config, ConfigError, VerbsSettings};
use railover::transport::verbs::flush::{SharedFlusher, Ticket, FLUSH_BYTES};
use railover::transport::verbs::lane::{
    check_hello_count, decode_hellos, encode_hellos, hellos_len, local_gid, local_port, needs_grh,
    remote_qp, QpHello,
};
use railover::transport::verbs::sys::{
    wc, CompChannel, Completion, Context, Cq, LocalPort, Mr, Pd, Qp, QpTiming, RemoteQp, UserMr,
    Write as RdmaWrite,
};
use railover::transport::verbs::{self, device, qp_timing, Domain, VerbsNic};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub mode: Mode,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum Mode {
    /// Print the verbs NICs discovery finds (RAILOVER_HCA applies)
    List,
    /// Serve every rail: one lane (RAILOVER_QPS_PER_LANE RC QPs) per accepted connection
    Serve(Pair),
    /// Connect rail i to the i-th peer address
    Connect(Pair),
    /// Only the flush check of every rail's device (serve and connect run it too)
    Flush {
        /// Give up on a rail's READs after this many seconds
        #[arg(long, default_value_t = 30)]
        timeout_s: u64,
    },
}

#[derive(Debug, Clone, clap::Args)]
pub struct Pair {
    /// TCP port of the bootstrap connections
    #[arg(long, default_value_t = 18600)]
    pub port: u16,
    /// Peer addresses, one per rail in discovery order (connect only)
    #[arg(long, value_delimiter = ',')]
    pub peer: Vec<IpAddr>,
    /// Messages per QP
    #[arg(long, default_value_t = 64)]
    pub messages: usize,
    /// Bytes per message
    #[arg(long, default_value_t = 65536)]
    pub size: usize,
    /// Give up on a rail after this many seconds
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Check the seal instead of the fence (both ends must say so)
    #[arg(long)]
    pub seal: bool,
}

pub fn run(args: &Args) -> i32 {
    let cfg = match settings(Config::from_env()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    println!("{}", header(&args.mode, &cfg.verbs));
    let found = verbs::discover(&cfg.hca, &cfg.verbs.gid, &cfg.sysfs_root);
    if let Some(why) = &found.absent {
        println!("verbs-check: no verbs devices: {why}");
    }
    for s in &found.skipped {
        println!("verbs-check: skipped {s}");
    }
    for s in &found.notes {
        println!("verbs-check: note {s}");
    }
    for n in &found.nics {
        println!(
            "verbs-check: nic {} {} {} mtu {} speed {} Mb/s gid[{}] {} netdev {}",
            n.label(),
            device::port_state_name(n.attr.state),
            n.link_layer(),
            128u32 << n.attr.active_mtu.min(8),
            n.speed_mbps,
            n.gid_index.map_or("-".into(), |i| i.to_string()),
            n.ip().map_or("-".into(), |ip| ip.to_string()),
            n.netdev.as_deref().unwrap_or("-"),
        );
    }
    let (pair, serve) = match &args.mode {
        Mode::List => return 0,
        Mode::Flush { timeout_s } => {
            if found.nics.is_empty() {
                println!("verbs-check: FAIL: no usable verbs NIC");
                return 1;
            }
            let deadline = Duration::from_secs(*timeout_s);
            return i32::from(flush_checks(&found.nics, &cfg.verbs, deadline) > 0);
        }
        Mode::Serve(p) => (p, true),
        Mode::Connect(p) => (p, false),
    };
    if found.nics.is_empty() {
        println!("verbs-check: FAIL: no usable verbs NIC");
        return 1;
    }
    if !serve && pair.peer.len() != found.nics.len() {
        eprintln!(
            "railover verbs-check: --peer names {} address(es) for {} rail(s)",
            pair.peer.len(),
            found.nics.len()
        );
        return 2;
    }
    if let Err(e) = region_len(pair, qps_per_rail(&cfg.verbs)) {
        eprintln!("railover verbs-check: {e}");
        return 2;
    }
    let results: Vec<(String, io::Result<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = found
            .nics
            .iter()
            .enumerate()
            .map(|(i, nic)| {
                let peer = pair.peer.get(i).copied();
                let v = &cfg.verbs;
                s.spawn(move || (nic.label(), rail(nic, i, serve, peer, pair, v)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rail thread"))
            .collect()
    });
    let mut failed = 0;
    for (label, r) in results {
        match r {
            Ok(summary) => println!("verbs-check: rail {label} PASS: {summary}"),
            Err(e) => {
                failed += 1;
                println!("verbs-check: rail {label} FAIL: {e}");
            }
        }
    }
    let flush_timeout = Duration::from_secs(pair.timeout_s.min(FLUSH_TIMEOUT_S));
    failed += flush_checks(&found.nics, &cfg.verbs, flush_timeout);
    i32::from(failed > 0)
}

/// The longest a rail's flush check waits for one READ within serve and connect.
const FLUSH_TIMEOUT_S: u64 = 30;
/// Bytes of the host buffer the flush check READs from (as NCCL's receive buffer).
const FLUSH_BUF: usize = 4096;

/// The flush check on every rail's device, one line each; returns how many failed.
fn flush_checks(nics: &[VerbsNic], s: &VerbsSettings, timeout: Duration) -> usize {
    let mut failed = 0;
    for nic in nics {
        match flush_check(nic, s, timeout) {
            Ok(summary) => println!("verbs-check: flush {} PASS ({summary})", nic.label()),
            Err(e) => {
                failed += 1;
                println!("verbs-check: flush {} FAIL ({e})", nic.label());
            }
        }
    }
    failed
}

/// The byte at `i` of the flush check's buffer in round `round`: never 0 (what the
/// flusher's landing slots start as), and different in the next round.
fn flush_pattern(round: usize, i: usize) -> u8 {
    1 + ((i.wrapping_mul(7).wrapping_add(round.wrapping_mul(101))) % 255) as u8
}

/// Waits, polling, until flush `t` is done; `Err` with the flusher's error, or at
/// `deadline`.
fn await_flush(f: &SharedFlusher, t: Ticket, deadline: Instant) -> io::Result<()> {
    loop {
        if f.lock().done(t)? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("flush READ {t} did not complete in time"),
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// One READ of `FLUSH_BYTES` at `buf[off..]` through `mr`, which must bring back those
/// bytes.
fn flush_read(
    f: &SharedFlusher,
    buf: &[u8],
    mr: &UserMr,
    off: usize,
    timeout: Duration,
) -> io::Result<()> {
    let t = f.lock().post(buf.as_ptr() as u64 + off as u64, mr.rkey())?;
    await_flush(f, t, Instant::now() + timeout)?;
    let got = f.lock().fetched(t).ok_or_else(|| {
        io::Error::other(format!("flush READ {t} is done but its bytes are gone"))
    })?;
    let want = &buf[off..off + FLUSH_BYTES];
    if got[..] != *want {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("flush READ {t} of byte {off} brought back {got:02x?}, the buffer holds {want:02x?}"),
        ));
    }
    Ok(())
}

/// The flush check of `nic`'s device, as the plugin's `iflush` will use it: a host buffer
/// registered as user memory is (`UserMr`) READ through the device's `Flusher`.
fn flush_check(nic: &VerbsNic, s: &VerbsSettings, timeout: Duration) -> io::Result<String> {
    let dom = Domain::open(&nic.device)?;
    let f = dom.flusher(nic, s)?;
    let (port, qpn, in_flight) = {
        let f = f.lock();
        (f.port(), f.qp_num(), f.reads_in_flight())
    };
    let mut buf = vec![0u8; FLUSH_BUF].into_boxed_slice();
    let mr = UserMr::register(&dom.pd, buf.as_ptr() as usize, buf.len())?;
    // The first and the last byte, then both again after the pattern changed.
    let t0 = Instant::now();
    let mut reads = 0;
    for round in 0..2 {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = flush_pattern(round, i);
        }
        for off in [0, FLUSH_BUF - FLUSH_BYTES] {
            flush_read(&f, &buf, &mr, off, timeout)
                .map_err(|e| io::Error::new(e.kind(), format!("round {round}: {e}")))?;
            reads += 1;
        }
    }
    let took = t0.elapsed();

    // A key that no longer exists: registered, then deregistered.
    let stale = UserMr::register(&dom.pd, buf.as_ptr() as usize, buf.len())?.rkey();
    let t = f.lock().post(buf.as_ptr() as u64, stale)?;
    let failed = match await_flush(&f, t, Instant::now() + timeout) {
        Ok(()) => {
            return Err(io::Error::other(format!(
                "a flush READ under the deregistered key {stale:#x} completed successfully"
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::TimedOut && !f.lock().is_broken() => return Err(e),
        Err(e) => e,
    };
    {
        let mut g = f.lock();
        if !g.is_broken() || g.done(t).is_ok() {
            return Err(io::Error::other(format!(
                "the failed READ's error did not stay: {failed}"
            )));
        }
        if g.post(buf.as_ptr() as u64, mr.rkey()).is_ok() {
            return Err(io::Error::other(
                "a broken flusher accepted another READ".to_string(),
            ));
        }
    }
    // The device replaces its broken flusher; the new one works.
    let fresh = dom.flusher(nic, s)?;
    if Arc::ptr_eq(&fresh, &f) {
        return Err(io::Error::other(
            "the device handed out its broken flusher again",
        ));
    }
    for (i, b) in buf.iter_mut().enumerate() {
        *b = flush_pattern(2, i);
    }
    flush_read(&fresh, &buf, &mr, 0, timeout)
        .map_err(|e| io::Error::new(e.kind(), format!("the fresh flusher: {e}")))?;
    Ok(format!(
        "QP {qpn} on port {port} connected to itself, {in_flight} READ(s) in flight at most: {reads} READs of {FLUSH_BYTES} B from a {FLUSH_BUF} B registered buffer brought back its bytes through two patterns in {:.1} ms; a READ under the deregistered key {stale:#x} failed as {:?} and stayed failed: {failed}; a fresh flusher then read correctly",
        took.as_secs_f64() * 1e3,
        failed.kind()
    ))
}

/// The plugin's configuration, or the line that says which variable is bad and why.
fn settings(parsed: Result<Config, ConfigError>) -> Result<Config, String> {
    parsed.map_err(|e| format!("railover verbs-check: {e}"))
}

/// The first line of a run: the QP settings, in the words of `railover doctor` and of
/// the plugin's INFO line (one lane per rail here, so "per lane" is per rail).
fn header(mode: &Mode, s: &VerbsSettings) -> String {
    match mode {
        Mode::List => format!("verbs-check: list; verbs lanes would use {s}"),
        Mode::Flush { .. } => format!("verbs-check: flush; flush QPs use {s}"),
        Mode::Serve(p) | Mode::Connect(p) => format!(
            "verbs-check: {}, one verbs lane per rail: {s}; {} x {} B each way per QP",
            if matches!(mode, Mode::Serve(_)) {
                "serve"
            } else {
                "connect"
            },
            p.messages,
            p.size
        ),
    }
}

/// QPs each rail opens: as many as a lane (`VerbsLane::new`).
fn qps_per_rail(s: &VerbsSettings) -> usize {
    usize::from(s.qps_per_lane.max(1))
}

/// The bytes of one rail's region: every message of every QP has its own place.
fn region_len(p: &Pair, qps: usize) -> Result<usize, String> {
    p.messages
        .checked_mul(p.size)
        .and_then(|n| n.checked_mul(qps))
        .filter(|&n| p.messages > 0 && p.size > 0 && n <= 1 << 30)
        .ok_or_else(|| {
            format!(
                "--messages ({}) and --size ({}) must be positive, and --messages x --size x \
                 RAILOVER_QPS_PER_LANE ({qps}) at most 1 GiB per rail",
                p.messages, p.size
            )
        })
}

/// The byte at `i` of message `msg` on rail `rail`: differs per rail, message and offset.
/// Message `msg` of a rail is message `msg % messages` of QP `msg / messages`.
fn pattern(rail: usize, msg: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ msg.wrapping_mul(131) ^ rail.wrapping_mul(7)) as u8
}

/// Reads the peer's hello of `qps` QPs as a lane does: the count first, so that a peer
/// with another `RAILOVER_QPS_PER_LANE` is refused (naming both counts) before the rest.
fn read_hellos(sock: &mut impl Read, qps: usize, region: usize) -> io::Result<Vec<QpHello>> {
    let bad = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    let mut b = vec![0u8; hellos_len(qps)];
    sock.read_exact(&mut b[..1])?;
    check_hello_count(b[0], qps).map_err(bad)?;
    sock.read_exact(&mut b[1..])?;
    let theirs = decode_hellos(&b, qps).map_err(bad)?;
    if theirs[0].len != region as u64 {
        return Err(bad(format!(
            "the peer's region is {} bytes, ours {region}: run both sides with the same --messages/--size",
            theirs[0].len
        )));
    }
    Ok(theirs)
}

/// How one QP goes to RTR and RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Transition {
    port: LocalPort,
    remote: RemoteQp,
    psn: u32,
    timing: QpTiming,
}

/// Our QP j joins the peer's QP j, addressed and timed as a lane's QPs are.
fn transitions(
    nic: &VerbsNic,
    s: &VerbsSettings,
    mine: &[QpHello],
    theirs: &[QpHello],
) -> Vec<Transition> {
    let port = local_port(nic, s);
    let grh = needs_grh(nic);
    mine.iter()
        .zip(theirs)
        .map(|(m, t)| Transition {
            port,
            remote: remote_qp(t, grh, m.mtu),
            psn: m.psn,
            timing: qp_timing(s),
        })
        .collect()
}

/// Checks a side's receive completions: every message of every QP once, each on the QP
/// (`qp_nums[j]`) its writer's QP j is joined to.
fn check_receives(got: &[Completion], qp_nums: &[u32], messages: usize) -> io::Result<()> {
    let all = qp_nums.len() * messages;
    let mut seen = vec![false; all];
    for c in got {
        if c.status != wc::SUCCESS {
            return Err(verbs::completion_error(c));
        }
        let msg = c
            .imm
            .ok_or_else(|| io::Error::other("a receive completion without immediate"))?
            as usize;
        if c.opcode != wc::RECV_RDMA_WITH_IMM
            || msg >= all
            || std::mem::replace(&mut seen[msg], true)
        {
            return Err(io::Error::other(format!(
                "unexpected receive completion {c:?}"
            )));
        }
        let qp = qp_nums[msg / messages];
        if c.qp_num != qp {
            return Err(io::Error::other(format!(
                "message {} of QP {} arrived on QP {}, expected QP {qp}",
                msg % messages,
                msg / messages,
                c.qp_num
            )));
        }
    }
    Ok(())
}

/// The verdict on the writes to a sealed peer, one per QP: each must have been refused by
/// the peer (a remote access or invalid request error: Soft-RoCE answers a WRITE to a QP
/// without remote write access with the latter), not timed out.
fn seal_verdict(got: &[Completion], took: Duration) -> io::Result<String> {
    let refused =
        |c: &Completion| c.status == wc::REM_ACCESS_ERR || c.status == wc::REM_INV_REQ_ERR;
    if let Some(c) = got.iter().find(|c| !refused(c)) {
        return Err(io::Error::other(format!(
            "a write to a sealed QP ended otherwise than refused: {}",
            if c.status == wc::SUCCESS {
                format!("it completed (on QP {})", c.qp_num)
            } else {
                verbs::completion_error(c).to_string()
            }
        )));
    }
    let e = got.first().map_or_else(
        || io::Error::other("no completion"),
        verbs::completion_error,
    );
    Ok(format!(
        "the sealed peer's own writes on {} QP(s) completed; ours to it were refused after {:.0} ms: {e}",
        got.len(),
        took.as_secs_f64() * 1e3
    ))
}

/// The verdict on the writes to a fenced peer, one per QP: each must have failed.
fn fence_verdict(got: &[Completion], took: Duration, s: &VerbsSettings) -> io::Result<String> {
    if let Some(ok) = got.iter().find(|c| c.status == wc::SUCCESS) {
        return Err(io::Error::other(format!(
            "a write to a fenced QP completed successfully (on QP {})",
            ok.qp_num
        )));
    }
    let e = got.first().map_or_else(
        || io::Error::other("no completion"),
        verbs::completion_error,
    );
    Ok(format!(
        "writes on {} QP(s) to the fenced peer failed after {:.0} ms (the NIC gives up after {:.1} s) as {:?}: {e}",
        got.len(),
        took.as_secs_f64() * 1e3,
        s.nic_give_up().as_secs_f64(),
        e.kind()
    ))
}

struct Rail {
    // Field order is drop order: the QPs go before the region they read and write.
    qps: Vec<Qp>,
    mr: Mr,
    cq: Arc<Cq>,
    done: Vec<Completion>,
}

impl Rail {
    /// Waits for `n` completions (any status), handling the channel as the reactor will:
    /// drain events, acknowledge, re-arm, then poll.
    fn completions(&mut self, n: usize, deadline: Instant) -> io::Result<Vec<Completion>> {
        loop {
            self.cq.poll(&mut self.done, 64)?;
            if self.done.len() >= n {
                return Ok(self.done.drain(..n).collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} of {n} completions before the deadline", self.done.len()),
                ));
            }
            if self.cq.channel().wait(left.min(Duration::from_secs(1)))? {
                self.cq.drain_and_rearm()?;
            }
        }
    }
}

fn rail(
    nic: &VerbsNic,
    idx: usize,
    serve: bool,
    peer: Option<IpAddr>,
    p: &Pair,
    settings: &VerbsSettings,
) -> io::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(p.timeout_s);
    let qps = qps_per_rail(settings);
    let msgs = qps * p.messages;
    let region = region_len(p, qps).map_err(io::Error::other)?;
    let ip = nic
        .ip()
        .ok_or_else(|| io::Error::other("the port has no IP GID to bootstrap from"))?;
    let mut sock = if serve {
        let l = TcpListener::bind(SocketAddr::new(ip, p.port))?;
        let (s, from) = l.accept()?;
        println!("verbs-check: rail {} accepted {from}", nic.label());
        s
    } else {
        let to = SocketAddr::new(peer.expect("checked"), p.port);
        let mut tries = 0;
        loop {
            // The server may still be starting: retry, bounded by the deadline.
            match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline && tries < 120 => {
                    tries += 1;
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(io::Error::new(e.kind(), format!("bootstrap to {to}: {e}"))),
            }
        }
    };
    sock.set_read_timeout(Some(Duration::from_secs(p.timeout_s)))?;

    let too_many = |_| {
        io::Error::other(format!(
            "{msgs} messages are too many for one rail's queues"
        ))
    };
    let ctx = Context::open(&nic.device)?;
    let pd = Pd::new(&ctx)?;
    let ch = CompChannel::new(&ctx)?;
    let cq = Cq::new(
        &ctx,
        &ch,
        i32::try_from(2 * msgs + 16 * qps).map_err(too_many)?,
    )?;
    let depth = u32::try_from(p.messages + 8).map_err(too_many)?;
    let mut qp_list = Vec::with_capacity(qps);
    for _ in 0..qps {
        qp_list.push(Qp::new_rc(&pd, &cq, depth, depth)?);
    }
    let mr = Mr::new(&pd, region)?;
    let mut r = Rail {
        qps: qp_list,
        mr,
        cq,
        done: Vec::new(),
    };
    let mut mine = Vec::with_capacity(qps);
    for (j, qp) in r.qps.iter().enumerate() {
        qp.to_init(nic.port)?;
        mine.push(QpHello {
            qpn: qp.qp_num(),
            psn: (0x1000 + idx as u32 * 0x100 + j as u32 * 0x10) & 0xff_ffff,
            lid: nic.attr.lid,
            mtu: nic.attr.active_mtu,
            gid: local_gid(nic),
            addr: r.mr.addr(),
            rkey: r.mr.rkey(),
            len: region as u64,
        });
    }
    sock.write_all(&encode_hellos(&mine))?;
    let theirs = read_hellos(&mut sock, qps, region)?;
    let peer_region = theirs[0];
    for qp in &r.qps {
        for i in 0..p.messages + 4 {
            qp.post_recv(i as u64)?;
        }
    }
    for (qp, t) in r.qps.iter().zip(transitions(nic, settings, &mine, &theirs)) {
        qp.to_rtr(&t.port, &t.remote, 1)?;
        qp.to_rts(t.psn, t.timing, 1)?;
    }
    let qp_nums: Vec<u32> = r.qps.iter().map(Qp::qp_num).collect();
    // Both sides at RTS before any write: a one-byte barrier over the bootstrap socket.
    sock.write_all(b"R")?;
    sock.read_exact(&mut [0u8; 1])?;

    // Message k of QP j is message j * messages + k of the rail, at that place in both
    // regions, with that immediate. The QPs take turns, as a lane spreads its writes.
    let write_all = |r: &mut Rail, remote: &QpHello| -> io::Result<Duration> {
        let t = Instant::now();
        for k in 0..p.messages {
            for (j, qp) in r.qps.iter().enumerate() {
                let msg = j * p.messages + k;
                qp.post_write(&RdmaWrite {
                    local: &r.mr,
                    offset: msg * p.size,
                    len: p.size,
                    remote_addr: remote.addr + (msg * p.size) as u64,
                    rkey: remote.rkey,
                    imm: Some(msg as u32),
                    signaled: true,
                    wr_id: msg as u64,
                })?;
            }
        }
        let got = r.completions(msgs, deadline)?;
        if let Some(bad) = got.iter().find(|c| c.status != wc::SUCCESS) {
            return Err(verbs::completion_error(bad));
        }
        Ok(t.elapsed())
    };
    let receive_all = |r: &mut Rail| -> io::Result<()> {
        let got = r.completions(msgs, deadline)?;
        check_receives(&got, &qp_nums, p.messages)
    };
    let check = |r: &Rail, rail_no: usize| -> io::Result<()> {
        let mut buf = vec![0u8; p.size];
        for msg in 0..msgs {
            r.mr.read(msg * p.size, &mut buf)?;
            if let Some(i) = (0..p.size).find(|&i| buf[i] != pattern(rail_no, msg, i)) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "message {} of QP {} byte {i}: {:#04x}, expected {:#04x}",
                        msg % p.messages,
                        msg / p.messages,
                        buf[i],
                        pattern(rail_no, msg, i)
                    ),
                ));
            }
        }
        Ok(())
    };
    let what = format!("{qps} QP(s) x {} x {} B", p.messages, p.size);

    if serve {
        receive_all(&mut r)?;
        check(&r, idx)?;
        // Echo: the checked bytes go back to the client's region, once it cleared it.
        sock.read_exact(&mut [0u8; 1])?;
        let echo = write_all(&mut r, &peer_region)?;
        if p.seal {
            // The seal: our QPs refuse RDMA WRITEs, and still write (one more each).
            for qp in &r.qps {
                qp.refuse_remote_writes()?;
            }
            for (j, qp) in r.qps.iter().enumerate() {
                qp.post_write(&RdmaWrite {
                    local: &r.mr,
                    offset: 0,
                    len: p.size,
                    remote_addr: peer_region.addr,
                    rkey: peer_region.rkey,
                    imm: Some(u32::MAX - 1),
                    signaled: true,
                    wr_id: u64::MAX - j as u64,
                })?;
            }
            let got = r.completions(qps, deadline)?;
            if let Some(bad) = got.iter().find(|c| c.status != wc::SUCCESS) {
                return Err(io::Error::other(format!(
                    "a sealed QP's own write failed: {}",
                    verbs::completion_error(bad)
                )));
            }
        } else {
            // The fence: our QPs go to ERR, then the client's next write on each must fail.
            for qp in &r.qps {
                qp.to_err()?;
            }
        }
        sock.write_all(b"F")?;
        let mut verdict = String::new();
        sock.read_to_string(&mut verdict)?;
        Ok(format!(
            "{what} received and checked, echoed in {:.1} ms; {}",
            echo.as_secs_f64() * 1e3,
            verdict.trim()
        ))
    } else {
        let mut buf = vec![0u8; p.size];
        for msg in 0..msgs {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = pattern(idx, msg, i);
            }
            r.mr.write(msg * p.size, &buf)?;
        }
        let took = write_all(&mut r, &peer_region)?;
        // The echo overwrites our region with the same bytes; clear it first so the check
        // proves they came back.
        r.mr.write(0, &vec![0u8; region])?;
        sock.write_all(b"E")?; // ready for the echo
        receive_all(&mut r)?;
        check(&r, idx)?;
        sock.read_exact(&mut [0u8; 1])?; // the server has fenced (or sealed)
        if p.seal {
            // The sealed server's own write on each QP arrives.
            let got = r.completions(qps, deadline)?;
            if let Some(bad) = got.iter().find(|c| c.status != wc::SUCCESS) {
                return Err(verbs::completion_error(bad));
            }
        }
        let t = Instant::now();
        for (j, qp) in r.qps.iter().enumerate() {
            let at = j * p.messages * p.size;
            qp.post_write(&RdmaWrite {
                local: &r.mr,
                offset: at,
                len: p.size,
                remote_addr: peer_region.addr + at as u64,
                rkey: peer_region.rkey,
                imm: Some(u32::MAX),
                signaled: true,
                wr_id: u64::MAX - j as u64,
            })?;
        }
        let verdict = r.completions(qps, deadline).and_then(|got| {
            if p.seal {
                seal_verdict(&got, t.elapsed())
            } else {
                fence_verdict(&got, t.elapsed(), settings)
            }
        });
        let text = match &verdict {
            Ok(s) => s.clone(),
            Err(e) => format!("FAIL {e}"),
        };
        sock.write_all(text.as_bytes())?;
        drop(sock);
        let mb = (region as f64) / took.as_secs_f64() / 1e6;
        verdict.map(|v| {
            format!(
                "{what} written in {:.1} ms ({mb:.1} MB/s), echo checked; {v}",
                took.as_secs_f64() * 1e3
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use railover::transport::verbs::sys::{GidEntry, PortAttr, LINK_LAYER_ETHERNET};
    use railover::transport::verbs::QP_TIMING;

    fn config(pairs: &[(&'static str, &str)]) -> Result<Config, String> {
        let pairs: Vec<(&str, String)> = pairs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        settings(Config::from_lookup(|k| {
            pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        }))
    }

    const TUNED: &[(&str, &str)] = &[
        ("RAILOVER_IB_TIMEOUT", "20"),
        ("RAILOVER_IB_RETRY_CNT", "7"),
        ("RAILOVER_IB_TC", "106"),
        ("RAILOVER_IB_SL", "3"),
        ("RAILOVER_QPS_PER_LANE", "3"),
    ];

    fn pair(messages: usize, size: usize) -> Pair {
        Pair {
            port: 18600,
            peer: Vec::new(),
            messages,
            size,
            timeout_s: 120,
            seal: false,
        }
    }

    fn roce_nic() -> VerbsNic {
        VerbsNic {
            device: "rxe0".into(),
            port: 1,
            guid: 1,
            attr: PortAttr {
                link_layer: LINK_LAYER_ETHERNET,
                lid: 0,
                active_mtu: 3,
                ..Default::default()
            },
            speed_mbps: 10_000,
            gids: vec![GidEntry {
                index: 1,
                gid: [7; 16],
                gid_type: 2,
                ndev_ifindex: 0,
            }],
            gid_index: Some(1),
            netdev: Some("eth0".into()),
            pci_path: None,
        }
    }

    fn hello(qpn: u32, mtu: u32, len: u64) -> QpHello {
        QpHello {
            qpn,
            psn: qpn * 10,
            lid: 0,
            mtu,
            gid: [qpn as u8; 16],
            addr: 0x1000,
            rkey: 77,
            len,
        }
    }

    fn recv(msg: u32, qp_num: u32) -> Completion {
        Completion {
            wr_id: 0,
            status: wc::SUCCESS,
            opcode: wc::RECV_RDMA_WITH_IMM,
            byte_len: 0,
            imm: Some(msg),
            qp_num,
            vendor_err: 0,
        }
    }

    #[test]
    fn flush_patterns_are_never_zero_and_change_each_round() {
        for round in 0..3 {
            for i in 0..FLUSH_BUF {
                assert_ne!(flush_pattern(round, i), 0, "round {round} byte {i}");
                assert_ne!(
                    flush_pattern(round, i),
                    flush_pattern(round + 1, i),
                    "round {round} byte {i}"
                );
            }
        }
        assert_ne!(flush_pattern(0, 0), flush_pattern(0, FLUSH_BUF - 1));
    }

    #[test]
    fn patterns_differ_per_rail_and_message() {
        assert_ne!(
            (0..64).map(|i| pattern(0, 0, i)).collect::<Vec<_>>(),
            (0..64).map(|i| pattern(1, 0, i)).collect::<Vec<_>>()
        );
        assert_ne!(pattern(0, 1, 0), pattern(0, 0, 0));
    }

    #[test]
    fn bad_settings_fail_naming_variable_value_and_what_is_accepted() {
        let e = config(&[("RAILOVER_QPS_PER_LANE", "17")]).unwrap_err();
        assert!(
            e.starts_with("railover verbs-check: ")
                && e.contains("RAILOVER_QPS_PER_LANE")
                && e.contains("17")
                && e.contains("1 to 16"),
            "{e}"
        );
        let e = config(&[("RAILOVER_IB_TIMEOUT", "32")]).unwrap_err();
        assert!(
            e.contains("RAILOVER_IB_TIMEOUT") && e.contains("1 to 31"),
            "{e}"
        );
    }

    #[test]
    fn the_header_says_what_doctor_and_the_plugin_say() {
        let cfg = config(TUNED).unwrap();
        let line = header(&Mode::Serve(pair(64, 65536)), &cfg.verbs);
        // The same text as `railover doctor`'s "QP settings" and the plugin's INFO line.
        assert!(line.contains(&cfg.verbs.to_string()), "{line}");
        assert!(
            line.starts_with("verbs-check: serve, one verbs lane per rail: ")
                && line.contains(
                    "timeout 20 retry 7 (NIC gives up after 34.4 s), tc 106 sl 3, 3 QP(s) per lane"
                )
                && line.ends_with("; 64 x 65536 B each way per QP"),
            "{line}"
        );
        let line = header(&Mode::Connect(pair(8, 1)), &config(&[]).unwrap().verbs);
        assert!(
            line.contains("connect")
                && line.contains(
                    "timeout 16 retry 6 (NIC gives up after 1.9 s), tc 0 sl 0, 1 QP(s) per lane"
                ),
            "{line}"
        );
        assert!(header(&Mode::List, &cfg.verbs).contains("tc 106 sl 3"));
    }

    #[test]
    fn every_qp_is_set_up_from_the_lane_settings() {
        let cfg = config(TUNED).unwrap();
        let qps = qps_per_rail(&cfg.verbs);
        assert_eq!(qps, 3);
        let nic = roce_nic();
        let mine: Vec<_> = (1..=3).map(|q| hello(q, 3, 64)).collect();
        // The peer's port has the larger MTU: the path takes ours.
        let theirs: Vec<_> = (11..=13).map(|q| hello(q, 5, 64)).collect();
        let t = transitions(&nic, &cfg.verbs, &mine, &theirs);
        assert_eq!(t.len(), qps);
        for (j, t) in t.iter().enumerate() {
            assert_eq!(
                t.port,
                LocalPort {
                    port: 1,
                    sgid_index: 1,
                    traffic_class: 106,
                    service_level: 3
                }
            );
            assert_eq!(
                t.timing,
                QpTiming {
                    timeout: 20,
                    retry_cnt: 7
                }
            );
            assert_eq!(t.psn, mine[j].psn);
            assert_eq!(
                (t.remote.qp_num, t.remote.psn, t.remote.gid, t.remote.mtu),
                (theirs[j].qpn, theirs[j].psn, theirs[j].gid, 3)
            );
            assert!(t.remote.global, "RoCE paths carry a GRH");
        }
        // Unset, the lanes' defaults: what verbs-check used before it read the settings.
        let t = transitions(&nic, &config(&[]).unwrap().verbs, &mine[..1], &theirs[..1]);
        assert_eq!(
            (
                t[0].timing,
                t[0].port.traffic_class,
                t[0].port.service_level
            ),
            (QP_TIMING, 0, 0)
        );
    }

    #[test]
    fn the_region_holds_every_qps_messages_and_stays_bounded() {
        assert_eq!(region_len(&pair(64, 65536), 1), Ok(64 * 65536));
        assert_eq!(region_len(&pair(64, 65536), 4), Ok(4 * 64 * 65536));
        assert_eq!(region_len(&pair(1 << 14, 1 << 16), 1), Ok(1 << 30));
        let e = region_len(&pair(1 << 14, 1 << 16), 2).unwrap_err();
        assert!(
            e.contains("RAILOVER_QPS_PER_LANE (2)") && e.contains("1 GiB"),
            "{e}"
        );
        assert!(region_len(&pair(0, 1), 1).is_err());
        assert!(region_len(&pair(1, 0), 1).is_err());
        assert!(region_len(&pair(usize::MAX, 2), 1).is_err());
    }

    #[test]
    fn hellos_of_another_qp_count_are_refused_naming_both_counts() {
        let two: Vec<_> = (1..=2).map(|q| hello(q, 3, 4096)).collect();
        let wire = encode_hellos(&two);
        let e = read_hellos(&mut &wire[..], 4, 4096).unwrap_err();
        let text = e.to_string();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(
            text.contains("peer opens 2 QP(s)")
                && text.contains("this end 4")
                && text.contains("RAILOVER_QPS_PER_LANE"),
            "{text}"
        );
        // Refused on the count byte alone: a shorter hello never leaves us waiting.
        let e = read_hellos(&mut &wire[..1], 1, 4096).unwrap_err();
        assert!(e.to_string().contains("this end 1"), "{e}");
        // Same count, another region: the sizes differ.
        let e = read_hellos(&mut &wire[..], 2, 8192).unwrap_err();
        assert!(e.to_string().contains("--messages/--size"), "{e}");
        assert_eq!(read_hellos(&mut &wire[..], 2, 4096).unwrap(), two);
    }

    #[test]
    fn receives_must_arrive_once_each_on_their_own_qp() {
        let qps = [10, 11];
        let all: Vec<_> = (0..6).map(|m| recv(m, qps[m as usize / 3])).collect();
        check_receives(&all, &qps, 3).unwrap();
        let mut wrong_qp = all.clone();
        wrong_qp[4].qp_num = 10;
        let e = check_receives(&wrong_qp, &qps, 3).unwrap_err().to_string();
        assert!(
            e.contains("message 1 of QP 1 arrived on QP 10, expected QP 11"),
            "{e}"
        );
        let mut twice = all.clone();
        twice[5] = twice[4];
        assert!(check_receives(&twice, &qps, 3).is_err());
        let mut beyond = all.clone();
        beyond[0].imm = Some(6);
        assert!(check_receives(&beyond, &qps, 3).is_err());
        let mut bare = all.clone();
        bare[0].imm = None;
        assert!(check_receives(&bare, &qps, 3).is_err());
        let mut failed = all;
        failed[2].status = wc::REM_ACCESS_ERR;
        assert!(check_receives(&failed, &qps, 3).is_err());
    }

    #[test]
    fn every_write_to_the_fenced_peer_must_fail() {
        let s = config(&[]).unwrap().verbs;
        let mut got = [recv(0, 10), recv(1, 11)];
        for c in &mut got {
            c.status = wc::RETRY_EXC_ERR;
        }
        let v = fence_verdict(&got, Duration::from_millis(1900), &s).unwrap();
        assert!(
            v.starts_with("writes on 2 QP(s) to the fenced peer failed after 1900 ms")
                && v.contains("gives up after 1.9 s")
                && v.contains("TimedOut"),
            "{v}"
        );
        got[1].status = wc::SUCCESS;
        let e = fence_verdict(&got, Duration::ZERO, &s).unwrap_err();
        assert!(e.to_string().contains("on QP 11"), "{e}");
    }

    #[test]
    fn every_write_to_the_sealed_peer_must_be_refused() {
        let mut got = [recv(0, 10), recv(1, 11)];
        for c in &mut got {
            c.status = wc::REM_ACCESS_ERR;
        }
        let v = seal_verdict(&got, Duration::from_millis(3)).unwrap();
        assert!(
            v.contains("own writes on 2 QP(s) completed") && v.contains("refused after 3 ms"),
            "{v}"
        );
        // A retry timeout is not a refusal: the QP may just be gone.
        got[0].status = wc::REM_INV_REQ_ERR;
        assert!(
            seal_verdict(&got, Duration::ZERO).is_ok(),
            "Soft-RoCE's answer"
        );
        got[1].status = wc::RETRY_EXC_ERR;
        assert!(seal_verdict(&got, Duration::ZERO).is_err());
        got[1].status = wc::SUCCESS;
        let e = seal_verdict(&got, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("completed (on QP 11)"), "{e}");
    }
}
