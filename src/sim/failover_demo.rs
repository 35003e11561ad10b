//! `railover demo`: the failover, live. Two plugin processes (`fault-peer`) stream 16
//! comms (`--comms`, 1 … 256) of checksummed messages over four NICs, held in lockstep
//! as one collective's channels (no comm more than 8 messages past the slowest); NIC 0 of
//! the sending node is cut, then restored, and the table shows what each NIC carried and
//! when traffic moved and moved back. The summary ends with what the slowest comm kept
//! of its rate after the cut (a collective waits for its slowest channel, so that is what
//! a job keeps) beside what the aggregate of the NIC counters kept, measured as
//! `railover bench --failover` does ([`railover_testkit::kept`]).
//!
//! As root the nodes are two network namespaces joined by four tc-shaped veth pairs and
//! the cut is `ip link set down`. Otherwise both processes share loopback, each with four
//! NICs on 127.100.<i>.1 (`RAILOVER_LOOPBACK_NICS`), and the cut is injected inside the
//! sending plugin: its lanes on that NIC fall silent as with a pulled cable, so the
//! receiving side must notice by itself.

use std::process::Command;
use std::time::{Duration, Instant};

use railover_testkit::fault_line::{self, Event, Link};
use railover_testkit::kept::{self, Kept, Phases, Window};
use railover_testkit::testbed::proc::Proc;
use railover_testkit::testbed::{unix_ms, Side, Testbed};

use crate::failover_bench::{check_intact, exclude, NATIVE, TICK_MS};

/// Where the two nodes live and how a link is cut.
pub enum Mode {
    Namespaces,
    Loopback,
}

/// The running nodes' link controls and per-NIC counters.
enum Bed {
    Namespaces(Testbed),
    Loopback,
}

impl Bed {
    fn nic(&self, i: usize) -> String {
        match self {
            Bed::Namespaces(_) => format!("rv{i}"),
            Bed::Loopback => format!("lo.{i}"),
        }
    }

    fn command(&self, side: Side) -> std::io::Result<Command> {
        let exe = std::env::current_exe()?;
        let exe = exe.to_str().unwrap_or("railover");
        Ok(match self {
            Bed::Namespaces(tb) => {
                let mut c = tb.command(side, exe);
                c.env("RAILOVER_IFNAME", "rv");
                c
            }
            Bed::Loopback => {
                let mut c = Command::new(exe);
                c.env("RAILOVER_LOOPBACK_NICS", RAILS.to_string())
                    .env_remove("RAILOVER_IFNAME");
                c
            }
        })
    }

    fn link(&self, send: &mut Proc, up: bool) {
        match self {
            Bed::Namespaces(tb) if up => tb.link_up(Side::A, 0),
            Bed::Namespaces(tb) => tb.link_down(Side::A, 0),
            Bed::Loopback => send.send(
                &fault_line::Command::Link {
                    link: if up { Link::Up } else { Link::Down },
                    dev: 0,
                }
                .to_line(),
            ),
        }
    }

    /// Bytes each NIC of node A has sent so far.
    fn tx_bytes(&self, send: &Proc) -> Vec<u64> {
        match self {
            Bed::Namespaces(tb) => tb.tx_bytes(Side::A),
            Bed::Loopback => send
                .lines()
                .iter()
                .rev()
                .find_map(|l| match Event::parse(l)? {
                    Event::NicBytes { tx, .. } => Some(tx),
                    _ => None,
                })
                .unwrap_or_else(|| vec![0; RAILS]),
        }
    }
}

const RAILS: usize = 4;
const RATE_MBIT: u64 = 200;
const SAMPLE: Duration = Duration::from_millis(500);
/// The sender's lockstep window: no comm posts more than this many messages past the
/// slowest comm's completed count (as `railover bench --failover` by default).
const LOCKSTEP: usize = 8;
const DEPTH: usize = 8;
/// Bytes in flight per node at most (comms × depth × message size): a message size of
/// this over the comms keeps each comm at about 24 messages a second or more on the
/// shaped links whatever their number, so the slowest comm's progress over a steady
/// window is counted in dozens of messages, not a handful.
const IN_FLIGHT: usize = 32 << 20;

/// The message size for `comms` comms: 256 KiB up to 16 comms, then halved as they
/// double, down to 16 KiB.
fn message_size(comms: usize) -> usize {
    let s = (IN_FLIGHT / DEPTH / comms.max(1)).clamp(16 << 10, 256 << 10);
    1 << (usize::BITS - 1 - s.leading_zeros())
}

/// When NIC 0 is cut and restored, seconds after traffic starts: late enough for a
/// steady window before the cut, the restore late enough for one after failover settled
/// (detection, the move, ramp-up), and early enough for fail-back to finish.
fn schedule(seconds: f64) -> (f64, f64) {
    let down = 3.5;
    (down, down + ((seconds - down) * 0.4).max(4.0))
}

/// Whether `line` is an event that `pred` accepts.
fn is(line: &str, pred: impl Fn(&Event) -> bool) -> bool {
    Event::parse(line).is_some_and(|e| pred(&e))
}

fn spawn(bed: &Bed, side: Side, role: &str, seconds: f64, comms: usize) -> std::io::Result<Proc> {
    let mut c = bed.command(side)?;
    // Ticks with per-comm bytes, and lockstep, as the bench's fault-peers have them.
    c.args(["fault-peer", role])
        .args(["--comms", &comms.to_string()])
        .args(["--size", &message_size(comms).to_string()])
        .args(["--depth", &DEPTH.to_string()])
        .args(["--seconds", &format!("{seconds}")])
        .args(["--tick-ms", &TICK_MS.to_string()]);
    if role == "send" {
        c.args(["--lockstep", &LOCKSTEP.to_string()]);
    }
    c.env("RAILOVER_LOG", "info")
        .env("RAILOVER_METRICS_PORT", "off");
    Proc::spawn(c, role)
}

/// The wall-clock millisecond stamped on a plugin log line (`railover WARN <ms>: …`).
pub(crate) fn stamp(line: &str) -> Option<u128> {
    line.split_whitespace()
        .nth(2)?
        .trim_end_matches(':')
        .parse()
        .ok()
}

struct Phase {
    name: &'static str,
    samples: usize,
    mbit: [f64; RAILS],
}

pub fn run(seconds: f64, comms: usize, mode: Mode) -> i32 {
    let bed = match mode {
        Mode::Namespaces => {
            println!("railover demo: failover on a namespace testbed");
            let tb = match Testbed::new(RAILS, RATE_MBIT) {
                Ok(tb) => tb,
                Err(e) => {
                    eprintln!("railover demo: cannot build the testbed: {e}");
                    return 1;
                }
            };
            println!(
                "  node A {} and node B {}: {RAILS} rails rv0..rv3 (veth, tc tbf {RATE_MBIT} Mbit/s each way)",
                tb.ns(Side::A),
                tb.ns(Side::B)
            );
            Bed::Namespaces(tb)
        }
        Mode::Loopback => {
            println!("  nodes A and B: two processes on loopback, {RAILS} NICs each lo.0..lo.3 (127.100.<i>.1);");
            println!("  the cut is injected inside node A's plugin: its lanes on lo.0 fall silent");
            println!("  (loopback has no link rate: the CPU bounds the total, so watch where the traffic goes)");
            Bed::Loopback
        }
    };
    let names: Vec<String> = (0..RAILS).map(|i| bed.nic(i)).collect();
    let t = Duration::from_secs(30);
    let (recv, mut send) = match (|| -> Result<(Proc, Proc), String> {
        let recv = spawn(&bed, Side::B, "recv", seconds, comms).map_err(|e| e.to_string())?;
        recv.wait_line(t, |l| {
            is(l, |e| {
                matches!(e, Event::Listening { .. } | Event::SetupFailed { .. })
            })
        })
        .filter(|l| is(l, |e| matches!(e, Event::Listening { .. })))
        .ok_or_else(|| format!("the receiver did not start:\n{}", recv.stderr_tail(10)))?;
        let mut send = spawn(&bed, Side::A, "send", seconds, comms).map_err(|e| e.to_string())?;
        for l in recv.lines() {
            if let Some(Event::Handle(h)) = Event::parse(&l) {
                send.send(&fault_line::Command::Handle(h).to_line());
            }
        }
        send.send(&fault_line::Command::Go.to_line());
        send.wait_line(t, |l| {
            is(l, |e| {
                matches!(e, Event::Connected { .. } | Event::SetupFailed { .. })
            })
        })
        .filter(|l| is(l, |e| matches!(e, Event::Connected { .. })))
        .ok_or_else(|| format!("the sender did not connect:\n{}", send.stderr_tail(10)))?;
        Ok((recv, send))
    })() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("railover demo: {e}");
            return 1;
        }
    };
    let spread = match comms {
        1 => format!("1 comm (on {})", names[0]),
        c if c % RAILS == 0 => format!("{c} comms ({} per NIC)", c / RAILS),
        c => format!("{c} comms (over the NICs in turn)"),
    };
    println!(
        "  {spread}, {} messages, {DEPTH} in flight each, every byte checked by node B;",
        crate::size::format(message_size(comms) as u64)
    );
    println!(
        "  in lockstep as one collective's channels: no comm more than {LOCKSTEP} messages past the slowest"
    );
    println!();
    let (down_at, up_at) = schedule(seconds);
    let start = Instant::now();
    let start_ms = unix_ms() as u64;
    let mut prev = bed.tx_bytes(&send);
    let mut prev_t = Instant::now();
    let (mut fault_ms, mut heal_ms) = (None, None);
    let mut phases = [
        Phase {
            name: "healthy",
            samples: 0,
            mbit: [0.0; RAILS],
        },
        Phase {
            name: "NIC 0 cut",
            samples: 0,
            mbit: [0.0; RAILS],
        },
        Phase {
            name: "restored",
            samples: 0,
            mbit: [0.0; RAILS],
        },
    ];
    let mut shown = 0;
    println!(
        "{:>7}  {:>8} {:>8} {:>8} {:>8}  {:>8}  event",
        "time s", names[0], names[1], names[2], names[3], "total"
    );
    while start.elapsed().as_secs_f64() < seconds - 0.5 {
        std::thread::sleep(SAMPLE);
        let el = start.elapsed().as_secs_f64();
        let mut event = String::new();
        if fault_ms.is_none() && el >= down_at {
            bed.link(&mut send, false);
            fault_ms = Some(unix_ms());
            event = format!("{} CUT on node A", names[0]);
        } else if heal_ms.is_none() && el >= up_at {
            bed.link(&mut send, true);
            heal_ms = Some(unix_ms());
            event = format!("{} RESTORED", names[0]);
        }
        let now = bed.tx_bytes(&send);
        let dt = prev_t.elapsed().as_secs_f64();
        prev_t = Instant::now();
        let mbit: Vec<f64> = now
            .iter()
            .zip(&prev)
            .map(|(a, b)| a.saturating_sub(*b) as f64 * 8.0 / dt / 1e6)
            .collect();
        prev = now;
        let phase = if heal_ms.is_some() {
            2
        } else if fault_ms.is_some() {
            1
        } else {
            0
        };
        // The sample that straddles a change belongs to neither phase.
        if event.is_empty() {
            phases[phase].samples += 1;
            for (i, m) in mbit.iter().enumerate().take(RAILS) {
                phases[phase].mbit[i] += m;
            }
        }
        // Log lines of moves, as they happen: the first of this sample and how many more.
        let log = send.stderr_tail(usize::MAX);
        let moves: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" failover comm=") || l.contains(" failback comm="))
            .collect();
        let new = &moves[shown.min(moves.len())..];
        if let Some(l) = new.first() {
            let what = l.split("railover: ").last().unwrap_or(l);
            let since = stamp(l).and_then(|t| {
                let base = if l.contains("failback") {
                    heal_ms?
                } else {
                    fault_ms?
                };
                Some(t.saturating_sub(base))
            });
            let since = since.map_or(String::new(), |ms| {
                format!(" [{ms} ms after the link change]")
            });
            if !event.is_empty() {
                event.push_str("; ");
            }
            event.push_str(&format!("{what}{since}"));
            if new.len() > 1 {
                event.push_str(&format!(" (+{} more comms)", new.len() - 1));
            }
        }
        shown = moves.len();
        let total: f64 = mbit.iter().sum();
        println!(
            "{el:>7.1}  {:>8.0} {:>8.0} {:>8.0} {:>8.0}  {total:>8.0}  {event}",
            mbit[0], mbit[1], mbit[2], mbit[3]
        );
    }
    // Let both ends finish and report: node B first, as the sender keeps its comms open
    // (for the receives node B has yet to test) until it is told to close.
    let mut recv = recv;
    let recv_exit = recv
        .wait_exit(Duration::from_secs(30))
        .and_then(|s| s.code());
    send.send(&fault_line::Command::Close.to_line());
    send.close_stdin();
    let send_exit = send
        .wait_exit(Duration::from_secs(30))
        .and_then(|s| s.code());
    let rs = Event::last_summary(&recv.lines());
    let ss = Event::last_summary(&send.lines());
    let problems = check_intact(comms, [(&rs, recv_exit), (&ss, send_exit)]);
    let log = send.stderr_tail(usize::MAX);
    let first = |what: &str, base: Option<u128>| {
        log.lines()
            .filter(|l| l.contains(what))
            .filter_map(stamp)
            .min()
            .zip(base)
            .map(|(t, b)| t.saturating_sub(b))
    };
    let failover_ms = first(" failover comm=", fault_ms);
    let failback_ms = first(" failback comm=", heal_ms);
    let failovers = log
        .lines()
        .filter(|l| l.contains(" failover comm="))
        .count();
    let failbacks = log
        .lines()
        .filter(|l| l.contains(" failback comm="))
        .count();

    println!();
    println!("summary (Mbit/s sent by node A per NIC, mean of each phase)");
    println!(
        "{:>10}  {:>8} {:>8} {:>8} {:>8}  {:>8}",
        "phase", names[0], names[1], names[2], names[3], "total"
    );
    for p in &phases {
        let n = p.samples.max(1) as f64;
        let m: Vec<f64> = p.mbit.iter().map(|x| x / n).collect();
        println!(
            "{:>10}  {:>8.0} {:>8.0} {:>8.0} {:>8.0}  {:>8.0}",
            p.name,
            m[0],
            m[1],
            m[2],
            m[3],
            m.iter().sum::<f64>()
        );
    }
    let ms = |x: Option<u128>| x.map_or("not seen".to_string(), |v| format!("{v} ms"));
    println!();
    println!("  link down -> first comm moved    {}", ms(failover_ms));
    println!("  comms moved (failovers)          {failovers}");
    println!("  link up -> first comm moved back {}", ms(failback_ms));
    println!("  comms moved back (fail-backs)    {failbacks}");
    match &rs {
        Some(s) => println!(
            "  messages verified by node B      {} ({} bytes), corrupted/lost/duplicated: {}",
            s.msgs, s.bytes, s.bad
        ),
        None => println!("  messages verified by node B      ? (node B printed no summary)"),
    }
    if !problems.is_empty() {
        println!("  NOT exactly once: {}", problems.join("; "));
    }
    println!();
    match measure_kept(&recv, &send, seconds, fault_ms, heal_ms) {
        Ok(m) => print_kept(&m, start_ms, matches!(bed, Bed::Loopback)),
        Err(e) => println!("kept after the cut: not measured ({e})"),
    }
    let ok =
        rs.is_some_and(|s| s.bad == 0) && problems.is_empty() && failovers > 0 && failbacks > 0;
    if !ok {
        eprintln!(
            "railover demo: expected moves and clean data; sender log:\n{}",
            send.stderr_tail(20)
        );
    }
    i32::from(!ok)
}

/// What the slowest comm and the aggregate kept, from node B's ticks (the bytes it
/// verified), over the same steady windows as `railover bench --failover`.
struct Measured {
    before: Window,
    after: Window,
    kept: Kept,
    /// After fail-back against before the cut, when there was time to measure it.
    back: Option<Kept>,
}

fn measure_kept(
    recv: &Proc,
    send: &Proc,
    seconds: f64,
    cut: Option<u128>,
    up: Option<u128>,
) -> Result<Measured, String> {
    let events =
        |p: &Proc| -> Vec<Event> { p.lines().iter().filter_map(|l| Event::parse(l)).collect() };
    let riv = kept::intervals(&events(recv));
    let siv = kept::intervals(&events(send));
    let (Some(r0), Some(s0)) = (riv.first(), siv.first()) else {
        return Err("no ticks from the fault-peers".into());
    };
    let cut = cut.ok_or("the link was never cut")? as u64;
    let phases = Phases {
        start: r0.from,
        cut,
        up: up.map(|t| t as u64),
        end: s0.from + (seconds * 1000.0) as u64,
    };
    let w = kept::windows(phases, exclude())?;
    let k = kept::kept(&riv, w.before, w.after, true).ok_or("no traffic in the steady windows")?;
    Ok(Measured {
        before: w.before,
        after: w.after,
        back: w.back.and_then(|b| kept::kept(&riv, w.before, b, true)),
        kept: k,
    })
}

fn print_kept(m: &Measured, start_ms: u64, loopback: bool) {
    let s = |t: u64| (t as f64 - start_ms as f64) / 1000.0;
    let mbit = |b: f64| b * 8.0 / 1e6;
    let k = &m.kept;
    println!(
        "kept after the cut (bytes node B verified; steady {:.1}-{:.1} s against {:.1}-{:.1} s)",
        s(m.after.from),
        s(m.after.to),
        s(m.before.from),
        s(m.before.to)
    );
    println!(
        "  slowest comm (a collective's pace) {:>7.1} -> {:>7.1} Mbit/s",
        mbit(k.before.slowest),
        mbit(k.after.slowest)
    );
    println!(
        "  aggregate (all comms)              {:>7.1} -> {:>7.1} Mbit/s",
        mbit(k.before.aggregate),
        mbit(k.after.aggregate)
    );
    if loopback {
        println!("  (on loopback the CPU, not the NICs, bounds the rate: losing one costs little)");
    }
    if let Some(b) = &m.back {
        println!(
            "  after fail-back: slowest comm {:.2}x, aggregate {:.2}x of before the cut",
            b.slowest, b.aggregate
        );
    }
    println!(
        "  slowest comm kept {:.2}x of its rate (ideal (N-1)/N = {:.2}, NCCL's native failover {NATIVE:.2}); aggregate kept {:.2}x",
        k.slowest,
        kept::ideal(RAILS),
        k.aggregate
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_shrink_as_comms_grow_past_sixteen() {
        for (comms, kib) in [
            (1, 256),
            (4, 256),
            (16, 256),
            (17, 128),
            (32, 128),
            (64, 64),
        ] {
            assert_eq!(message_size(comms), kib << 10, "{comms} comms");
        }
        assert_eq!(message_size(crate::demo::MAX_COMMS), 16 << 10);
    }

    #[test]
    fn the_schedule_leaves_steady_windows_to_measure_from_the_shortest_run() {
        for seconds in [12.0, 15.0, 60.0] {
            let (down, up) = schedule(seconds);
            let ms = |s: f64| (s * 1000.0) as u64;
            let p = Phases {
                start: 0,
                cut: ms(down),
                up: Some(ms(up)),
                end: ms(seconds),
            };
            let w = kept::windows(p, exclude());
            assert!(w.is_ok(), "{seconds} s: {w:?}");
        }
        // The default run also measures after fail-back.
        let (down, up) = schedule(15.0);
        let p = Phases {
            start: 0,
            cut: (down * 1000.0) as u64,
            up: Some((up * 1000.0) as u64),
            end: 15_000,
        };
        assert!(kept::windows(p, exclude()).unwrap().back.is_some());
    }
}
