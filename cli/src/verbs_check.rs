//! `railover verbs-check`: the verbs layer against real devices, for the Soft-RoCE tier
//! (`scripts/verbs-tier.sh`) and for a first look at a node with RDMA NICs.
//!
//! `list` prints what discovery finds. `serve` and `connect` run one RC QP per rail
//! between two hosts: the QP addresses are exchanged over a TCP connection between the
//! rails' own addresses (as the fabric's bootstrap will), then the client RDMA-WRITEs
//! `--messages` checksummed messages with immediates into the server's region, the server
//! checks every byte and writes it all back, the client checks it, and finally the server
//! fences its QP (ERR) and the client's next write must fail with an error completion.
//!
//! Exit status: 0 when every rail passed, 1 when one failed, 2 on bad arguments.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use railover::config::Config;
use railover::transport::verbs::lane::QpHello;
use railover::transport::verbs::sys::{
    wc, CompChannel, Completion, Context, Cq, LocalPort, Mr, Pd, Qp, RemoteQp, Write as RdmaWrite,
};
use railover::transport::verbs::{self, device, VerbsNic, QP_TIMING};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub mode: Mode,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum Mode {
    /// Print the verbs NICs discovery finds (RAILOVER_HCA applies)
    List,
    /// Serve every rail: one RC QP per accepted connection
    Serve(Pair),
    /// Connect rail i to the i-th peer address
    Connect(Pair),
}

#[derive(Debug, Clone, clap::Args)]
pub struct Pair {
    /// TCP port of the bootstrap connections
    #[arg(long, default_value_t = 18600)]
    pub port: u16,
    /// Peer addresses, one per rail in discovery order (connect only)
    #[arg(long, value_delimiter = ',')]
    pub peer: Vec<IpAddr>,
    /// Messages per rail
    #[arg(long, default_value_t = 64)]
    pub messages: usize,
    /// Bytes per message
    #[arg(long, default_value_t = 65536)]
    pub size: usize,
    /// Give up on a rail after this many seconds
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
}

pub fn run(args: &Args) -> i32 {
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("railover verbs-check: {e}");
            return 2;
        }
    };
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
    if pair.messages == 0 || pair.size == 0 || pair.messages.saturating_mul(pair.size) > 1 << 30 {
        eprintln!(
            "railover verbs-check: --messages and --size must be positive, at most 1 GiB in all"
        );
        return 2;
    }
    let results: Vec<(String, io::Result<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = found
            .nics
            .iter()
            .enumerate()
            .map(|(i, nic)| {
                let peer = pair.peer.get(i).copied();
                s.spawn(move || (nic.label(), rail(nic, i, serve, peer, pair)))
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
    i32::from(failed > 0)
}

/// The byte at `i` of message `seq` on rail `rail`: differs per rail, message and offset.
fn pattern(rail: usize, seq: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ seq.wrapping_mul(131) ^ rail.wrapping_mul(7)) as u8
}

struct Rail {
    // Field order is drop order: the QP goes before the region it reads and writes.
    qp: Qp,
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
) -> io::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(p.timeout_s);
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

    let ctx = Context::open(&nic.device)?;
    let pd = Pd::new(&ctx)?;
    let ch = CompChannel::new(&ctx)?;
    let total = p.messages * p.size;
    let cq = Cq::new(&ctx, &ch, (2 * p.messages + 16) as i32)?;
    let qp = Qp::new_rc(&pd, &cq, (p.messages + 8) as u32, (p.messages + 8) as u32)?;
    let mr = Mr::new(&pd, total)?;
    let mut r = Rail {
        qp,
        mr,
        cq,
        done: Vec::new(),
    };
    r.qp.to_init(nic.port)?;
    let psn = (0x1000 + idx as u32 * 0x100) & 0xff_ffff;
    let gid_index = nic.gid_index.unwrap_or(0);
    let gid = nic
        .gids
        .iter()
        .find(|g| g.index == gid_index)
        .map_or([0; 16], |g| g.gid);
    let mine = QpHello {
        qpn: r.qp.qp_num(),
        psn,
        lid: nic.attr.lid,
        mtu: nic.attr.active_mtu,
        gid,
        addr: r.mr.addr(),
        rkey: r.mr.rkey(),
        len: total as u64,
    };
    sock.write_all(&mine.encode())?;
    let mut b = [0u8; QpHello::LEN];
    sock.read_exact(&mut b)?;
    let theirs = QpHello::decode(&b);
    if theirs.len != total as u64 {
        return Err(io::Error::other(format!(
            "the peer's region is {} bytes, ours {total}: run both sides with the same --messages/--size",
            theirs.len
        )));
    }
    for i in 0..p.messages + 4 {
        r.qp.post_recv(i as u64)?;
    }
    let global = nic.attr.link_layer == railover::transport::verbs::sys::LINK_LAYER_ETHERNET
        || nic.attr.flags & railover::transport::verbs::sys::QPF_GRH_REQUIRED != 0;
    r.qp.to_rtr(
        &LocalPort {
            port: nic.port,
            sgid_index: gid_index as u8,
            traffic_class: 0,
            service_level: 0,
        },
        &RemoteQp {
            qp_num: theirs.qpn,
            psn: theirs.psn,
            lid: theirs.lid,
            gid: theirs.gid,
            global,
            mtu: mine.mtu.min(theirs.mtu),
        },
    )?;
    r.qp.to_rts(psn, QP_TIMING)?;
    // Both sides at RTS before any write: a one-byte barrier over the bootstrap socket.
    sock.write_all(b"R")?;
    sock.read_exact(&mut [0u8; 1])?;

    let write_all = |r: &mut Rail, remote: &QpHello| -> io::Result<Duration> {
        let t = Instant::now();
        for seq in 0..p.messages {
            r.qp.post_write(&RdmaWrite {
                local: &r.mr,
                offset: seq * p.size,
                len: p.size,
                remote_addr: remote.addr + (seq * p.size) as u64,
                rkey: remote.rkey,
                imm: Some(seq as u32),
                signaled: true,
                wr_id: seq as u64,
            })?;
        }
        let got = r.completions(p.messages, deadline)?;
        if let Some(bad) = got.iter().find(|c| c.status != wc::SUCCESS) {
            return Err(verbs::completion_error(bad));
        }
        Ok(t.elapsed())
    };
    let receive_all = |r: &mut Rail| -> io::Result<()> {
        let got = r.completions(p.messages, deadline)?;
        let mut seen = vec![false; p.messages];
        for c in &got {
            if c.status != wc::SUCCESS {
                return Err(verbs::completion_error(c));
            }
            let seq = c
                .imm
                .ok_or_else(|| io::Error::other("a receive completion without immediate"))?
                as usize;
            if c.opcode != wc::RECV_RDMA_WITH_IMM
                || seq >= p.messages
                || std::mem::replace(&mut seen[seq], true)
            {
                return Err(io::Error::other(format!(
                    "unexpected receive completion {c:?}"
                )));
            }
        }
        Ok(())
    };
    let check = |r: &Rail, rail_no: usize| -> io::Result<()> {
        let mut buf = vec![0u8; p.size];
        for seq in 0..p.messages {
            r.mr.read(seq * p.size, &mut buf)?;
            if let Some(i) = (0..p.size).find(|&i| buf[i] != pattern(rail_no, seq, i)) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "message {seq} byte {i}: {:#04x}, expected {:#04x}",
                        buf[i],
                        pattern(rail_no, seq, i)
                    ),
                ));
            }
        }
        Ok(())
    };

    if serve {
        receive_all(&mut r)?;
        check(&r, idx)?;
        // Echo: the checked bytes go back to the client's region, once it cleared it.
        sock.read_exact(&mut [0u8; 1])?;
        let echo = write_all(&mut r, &theirs)?;
        // The fence: our QP goes to ERR, then the client's next write must fail.
        r.qp.to_err()?;
        sock.write_all(b"F")?;
        let mut verdict = String::new();
        sock.read_to_string(&mut verdict)?;
        Ok(format!(
            "{} x {} B received and checked, echoed in {:.1} ms; {}",
            p.messages,
            p.size,
            echo.as_secs_f64() * 1e3,
            verdict.trim()
        ))
    } else {
        let mut msg = vec![0u8; p.size];
        for seq in 0..p.messages {
            for (i, b) in msg.iter_mut().enumerate() {
                *b = pattern(idx, seq, i);
            }
            r.mr.write(seq * p.size, &msg)?;
        }
        let took = write_all(&mut r, &theirs)?;
        // The echo overwrites our region with the same bytes; clear it first so the check
        // proves they came back.
        r.mr.write(0, &vec![0u8; total])?;
        sock.write_all(b"E")?; // ready for the echo
        receive_all(&mut r)?;
        check(&r, idx)?;
        let t = Instant::now();
        sock.read_exact(&mut [0u8; 1])?; // the server has fenced
        r.qp.post_write(&RdmaWrite {
            local: &r.mr,
            offset: 0,
            len: p.size,
            remote_addr: theirs.addr,
            rkey: theirs.rkey,
            imm: Some(u32::MAX),
            signaled: true,
            wr_id: u64::MAX,
        })?;
        let failed = r.completions(1, deadline)?;
        let c = failed[0];
        let verdict = if c.status == wc::SUCCESS {
            Err(io::Error::other(
                "a write to a fenced QP completed successfully",
            ))
        } else {
            let e = verbs::completion_error(&c);
            Ok(format!(
                "write to the fenced peer failed after {:.0} ms as {:?}: {e}",
                t.elapsed().as_secs_f64() * 1e3,
                e.kind()
            ))
        };
        let text = match &verdict {
            Ok(s) => s.clone(),
            Err(e) => format!("FAIL {e}"),
        };
        sock.write_all(text.as_bytes())?;
        drop(sock);
        let mb = (total as f64) / took.as_secs_f64() / 1e6;
        verdict.map(|v| {
            format!(
                "{} x {} B written in {:.1} ms ({mb:.1} MB/s), echo checked; {v}",
                p.messages,
                p.size,
                took.as_secs_f64() * 1e3
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_per_rail_and_message() {
        assert_ne!(
            (0..64).map(|i| pattern(0, 0, i)).collect::<Vec<_>>(),
            (0..64).map(|i| pattern(1, 0, i)).collect::<Vec<_>>()
        );
        assert_ne!(pattern(0, 1, 0), pattern(0, 0, 0));
    }
}
