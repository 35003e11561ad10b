//! A two-node testbed for the fault tier: two network namespaces ("node A", "node B")
//! joined by one veth pair per rail, each end shaped with `tc tbf` so the link, not the
//! CPU, is the bottleneck. Faults are link down/up, rate cuts and flaps on either end.
//!
//! Everything lives in namespaces this value created (names unique per process and
//! testbed) and is removed on drop, panics included; namespaces left by an earlier run
//! whose process is gone are removed when the next testbed starts. Addresses are
//! `10.77.<rail>.1` (A) and `10.77.<rail>.2` (B), present only inside those namespaces.

pub mod proc;

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Namespace names start with this, then `A-`/`B-`, the pid and a counter.
pub const PREFIX: &str = "rvf";

/// Per-link rate (Mbit/s): four links together stay well below what the plugin moves
/// on this 2-core machine (about 2.7 Gbit/s unshaped, measured with `fault-peer`), so
/// the links, not the CPU, set the pace. See docs/fault-tier.md.
pub const DEFAULT_RATE_MBIT: u64 = 250;

/// `tbf` burst: 8 ms of traffic at the link's rate, within these bounds. A real link
/// that degrades does not bank credit, so a slowed link must not let a large burst
/// through at full speed (a health probe would pass on the burst alone).
const BURST_TIME_MS: u64 = 8;
const BURST_MIN: u64 = 16 << 10;
const BURST_MAX: u64 = 256 << 10;
/// `tbf` queue: the most time a packet may wait before it is dropped. 50 ms at the
/// link's rate is a shallow, tail-dropping switch port: what the fault tier runs on.
/// A lossless link (RoCE with PFC pauses rather than drops) is a queue deep enough for
/// all that is in flight: [`Testbed::with_queue`].
pub const DEFAULT_QUEUE: Duration = Duration::from_millis(50);

/// The `tbf` burst, in bytes, for a rate in kbit/s.
fn burst_bytes(kbit: u64) -> u64 {
    (kbit * 1000 / 8 * BURST_TIME_MS / 1000).clamp(BURST_MIN, BURST_MAX)
}

/// The sum of the `dropped N` fields of `tc -s qdisc show`.
fn dropped(stats: &str) -> u64 {
    let words: Vec<&str> = stats.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0].trim_start_matches('(') == "dropped")
        .filter_map(|w| w[1].trim_end_matches(',').parse::<u64>().ok())
        .sum()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

/// Why the fault tier cannot run here, or `None` when it can.
pub fn unavailable() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    if euid != "0" {
        return Some(format!(
            "not root (euid {euid}): namespaces and tc need root"
        ));
    }
    for (tool, args) in [("ip", &["netns", "list"][..]), ("tc", &["-V"][..])] {
        match Command::new(tool).args(args).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                return Some(format!(
                    "`{tool} {}` failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
            Err(e) => return Some(format!("`{tool}` not usable ({e}): install iproute2")),
        }
    }
    None
}

/// Prints `SKIP: <why>` and returns true when the tier cannot run.
pub fn skip_unless_available() -> bool {
    match unavailable() {
        Some(why) => {
            println!("SKIP: {why}");
            true
        }
        None => false,
    }
}

/// Wall-clock milliseconds, the clock the `fault-peer` lines carry.
pub fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// Runs a command to completion; an error names the command and its stderr.
pub fn sh(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn list_namespaces() -> Vec<String> {
    sh("ip", &["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// Removes testbed namespaces whose creating process no longer exists.
pub fn remove_stale() -> Vec<String> {
    let me = std::process::id();
    let mut removed = Vec::new();
    for ns in list_namespaces() {
        let Some(rest) = ns.strip_prefix(PREFIX) else {
            continue;
        };
        let mut parts = rest.split('-');
        let (Some(side), Some(pid), Some(_n)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if !matches!(side, "A" | "B") || pid == me {
            continue;
        }
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue; // another live run (e.g. a second worktree): not ours to touch
        }
        if sh("ip", &["netns", "del", &ns]).is_ok() {
            removed.push(ns);
        }
    }
    removed
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Two namespaces joined by `rails` shaped veth pairs. Dropping it removes everything.
#[derive(Debug)]
pub struct Testbed {
    ns: [String; 2],
    rails: usize,
    rate_mbit: u64,
    /// How long the shapers queue a packet before dropping it.
    queue: Duration,
}

impl Testbed {
    /// Builds the testbed with [`DEFAULT_QUEUE`]; on any failure what was built is
    /// removed again.
    pub fn new(rails: usize, rate_mbit: u64) -> Result<Testbed, String> {
        Self::with_queue(rails, rate_mbit, DEFAULT_QUEUE)
    }

    /// Builds the testbed with shapers that queue a packet for up to `queue`.
    pub fn with_queue(rails: usize, rate_mbit: u64, queue: Duration) -> Result<Testbed, String> {
        assert!((1..=16).contains(&rails), "1..16 rails");
        let stale = remove_stale();
        if !stale.is_empty() {
            println!("testbed: removed stale namespaces {stale:?}");
        }
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let tb = Testbed {
            ns: [
                format!("{PREFIX}A-{pid}-{n}"),
                format!("{PREFIX}B-{pid}-{n}"),
            ],
            rails,
            rate_mbit,
            queue,
        };
        // From here on, `tb` going out of scope (error or panic) tears down what exists.
        for ns in &tb.ns {
            sh("ip", &["netns", "add", ns])?;
            sh("ip", &["-n", ns, "link", "set", "lo", "up"])?;
        }
        for r in 0..rails {
            let dev = Self::ifname(r);
            sh(
                "ip",
                &[
                    "link", "add", "name", &dev, "netns", &tb.ns[0], "type", "veth", "peer",
                    "name", &dev, "netns", &tb.ns[1],
                ],
            )?;
            for side in [Side::A, Side::B] {
                let ns = tb.ns(side);
                let addr = format!("{}/24", Self::addr(side, r));
                sh("ip", &["-n", ns, "addr", "add", &addr, "dev", &dev])?;
                sh("ip", &["-n", ns, "link", "set", "dev", &dev, "up"])?;
                tb.tbf("add", side, r, rate_mbit * 1000)?;
            }
        }
        tb.wait_carrier(Duration::from_secs(5))?;
        Ok(tb)
    }

    pub fn rails(&self) -> usize {
        self.rails
    }

    pub fn rate_mbit(&self) -> u64 {
        self.rate_mbit
    }

    pub fn queue(&self) -> Duration {
        self.queue
    }

    pub fn ns(&self, side: Side) -> &str {
        match side {
            Side::A => &self.ns[0],
            Side::B => &self.ns[1],
        }
    }

    /// The interface of `rail`, the same name in both namespaces; the plugin sorts
    /// its devices by name, so device i is rail i (for up to 10 rails).
    pub fn ifname(rail: usize) -> String {
        format!("rv{rail}")
    }

    pub fn addr(side: Side, rail: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, rail as u8, if side == Side::A { 1 } else { 2 })
    }

    /// A command that runs `program` inside `side`'s namespace.
    pub fn command(&self, side: Side, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns(side), program]);
        c
    }

    /// `tc` inside `side`'s namespace.
    fn tc(&self, side: Side, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["-n", self.ns(side)];
        all.extend_from_slice(args);
        sh("tc", &all)
    }

    fn tbf(&self, verb: &str, side: Side, rail: usize, kbit: u64) -> Result<String, String> {
        let dev = Self::ifname(rail);
        let rate = format!("{kbit}kbit");
        let burst = format!("{}b", burst_bytes(kbit));
        let latency = format!("{}us", self.queue.as_micros());
        self.tc(
            side,
            &[
                "qdisc", verb, "dev", &dev, "root", "tbf", "rate", &rate, "burst", &burst,
                "latency", &latency,
            ],
        )
    }

    /// Removes the shaper of one end, dropping what it queued.
    fn drop_shaper(&self, side: Side, rail: usize) -> Result<String, String> {
        self.tc(side, &["qdisc", "del", "dev", &Self::ifname(rail), "root"])
    }

    /// `tc qdisc show` for one end, to check the shaping is in place.
    pub fn qdisc(&self, side: Side, rail: usize) -> String {
        self.tc(side, &["qdisc", "show", "dev", &Self::ifname(rail)])
            .unwrap_or_default()
    }

    pub fn link_down(&self, side: Side, rail: usize) {
        self.set_link(side, rail, "down");
    }

    pub fn link_up(&self, side: Side, rail: usize) {
        self.set_link(side, rail, "up");
    }

    fn set_link(&self, side: Side, rail: usize, state: &str) {
        sh(
            "ip",
            &[
                "-n",
                self.ns(side),
                "link",
                "set",
                "dev",
                &Self::ifname(rail),
                state,
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Changes the rate of one end (kbit/s): a brown-out is 1% of the link rate. The
    /// shaper is replaced, not changed, dropping what it queued: `tc ... change` keeps
    /// queued packets, and one larger than the new, smaller burst never leaves, which
    /// would stop the link instead of slowing it.
    pub fn set_rate_kbit(&self, side: Side, rail: usize, kbit: u64) {
        self.drop_shaper(side, rail)
            .and_then(|_| self.tbf("add", side, rail, kbit))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Holds the TCP connections leaving `side` on `rail` from local port `sport` to
    /// `kbit`, while the rest of the link keeps the testbed's rate: a bottleneck that
    /// only that connection meets, as when its far end is congested by others (incast).
    /// The link's shaper becomes an `htb` with two classes and a `u32` port filter.
    pub fn squeeze_flow(&self, side: Side, rail: usize, sport: u16, kbit: u64) {
        let dev = Self::ifname(rail);
        let rate = format!("{}kbit", self.rate_mbit * 1000);
        let slow = format!("{kbit}kbit");
        let port = sport.to_string();
        let class = |id: &str, parent: &str, r: &str| {
            self.tc(
                side,
                &[
                    "class", "add", "dev", &dev, "parent", parent, "classid", id, "htb", "rate", r,
                    "ceil", r,
                ],
            )
        };
        let htb = [
            "qdisc", "add", "dev", &dev, "root", "handle", "1:", "htb", "default", "10",
        ];
        let filter = [
            "filter", "add", "dev", &dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "sport", &port, "0xffff", "flowid", "1:20",
        ];
        self.drop_shaper(side, rail)
            .and_then(|_| self.tc(side, &htb))
            .and_then(|_| class("1:1", "1:", &rate))
            .and_then(|_| class("1:10", "1:1", &rate))
            .and_then(|_| class("1:20", "1:1", &slow))
            .and_then(|_| self.tc(side, &filter))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The local ports of the TCP connections `side` has open from `rail`'s address to
    /// the other end's.
    pub fn tcp_ports(&self, side: Side, rail: usize) -> Vec<u16> {
        let me = Self::addr(side, rail).to_string();
        let peer = Self::addr(Self::other(side), rail).to_string();
        let out = sh(
            "ip",
            &[
                "netns",
                "exec",
                self.ns(side),
                "ss",
                "-Htn",
                "state",
                "established",
            ],
        )
        .unwrap_or_default();
        let mut ports: Vec<u16> = out
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                let (local, remote) = (w.get(2)?, w.get(3)?);
                let (lip, lport) = local.rsplit_once(':')?;
                let (rip, _) = remote.rsplit_once(':')?;
                (lip == me && rip == peer).then(|| lport.parse().ok())?
            })
            .collect();
        ports.sort_unstable();
        ports
    }

    /// Puts one end back to the testbed's rate.
    pub fn restore_rate(&self, side: Side, rail: usize) {
        self.set_rate_kbit(side, rail, self.rate_mbit * 1000);
    }

    /// Silently drops everything `side` sends on `rail` while the carrier stays up: a
    /// blackhole route to the other end's address (no tc actions are needed, which
    /// minimal kernels lack). Only completion timeouts can notice this fault.
    pub fn blackhole(&self, side: Side, rail: usize) {
        let peer = format!("{}/32", Self::addr(Self::other(side), rail));
        sh(
            "ip",
            &["-n", self.ns(side), "route", "add", "blackhole", &peer],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Removes what `blackhole` added.
    pub fn unblackhole(&self, side: Side, rail: usize) {
        let peer = format!("{}/32", Self::addr(Self::other(side), rail));
        sh(
            "ip",
            &["-n", self.ns(side), "route", "del", "blackhole", &peer],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    pub fn other(side: Side) -> Side {
        match side {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }

    /// Takes the link down for `period`, then up for `period`, `count` times (blocking).
    /// Fault pacing, not synchronisation: the timing is the fault.
    pub fn flap(&self, side: Side, rail: usize, period: Duration, count: usize) {
        for _ in 0..count {
            self.link_down(side, rail);
            std::thread::sleep(period);
            self.link_up(side, rail);
            std::thread::sleep(period);
        }
    }

    /// Is the interface administratively and operationally up (carrier present)?
    pub fn link_is_up(&self, side: Side, rail: usize) -> bool {
        let out = sh(
            "ip",
            &[
                "-j",
                "-n",
                self.ns(side),
                "link",
                "show",
                "dev",
                &Self::ifname(rail),
            ],
        )
        .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        v[0]["operstate"] == "UP"
    }

    /// Polls until every link has carrier on both ends.
    pub fn wait_carrier(&self, timeout: Duration) -> Result<(), String> {
        let end = Instant::now() + timeout;
        loop {
            let down: Vec<(Side, usize)> = (0..self.rails)
                .flat_map(|r| [(Side::A, r), (Side::B, r)])
                .filter(|&(s, r)| !self.link_is_up(s, r))
                .collect();
            if down.is_empty() {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(format!("links without carrier after {timeout:?}: {down:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Bytes sent by `side` on each rail's interface so far (kernel counters).
    pub fn tx_bytes(&self, side: Side) -> Vec<u64> {
        let out = sh("ip", &["-j", "-s", "-n", self.ns(side), "link", "show"]).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        (0..self.rails)
            .map(|r| {
                let name = Self::ifname(r);
                v.as_array()
                    .and_then(|a| a.iter().find(|l| l["ifname"] == name.as_str()))
                    .and_then(|l| l["stats64"]["tx"]["bytes"].as_u64())
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Packets `side`'s shapers dropped so far, summed over its rails (the counters of
    /// a shaper start again when a fault replaces it).
    pub fn shaper_drops(&self, side: Side) -> u64 {
        (0..self.rails)
            .map(|r| {
                let out = self
                    .tc(side, &["-s", "qdisc", "show", "dev", &Self::ifname(r)])
                    .unwrap_or_default();
                dropped(&out)
            })
            .sum()
    }

    /// Interface names in `side`'s namespace (for the self-checks).
    pub fn interfaces(&self, side: Side) -> Vec<String> {
        let out = sh("ip", &["-j", "-n", self.ns(side), "addr", "show"]).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|l| {
                        let addrs: Vec<String> = l["addr_info"]
                            .as_array()
                            .map(|x| {
                                x.iter()
                                    .filter(|a| a["family"] == "inet")
                                    .map(|a| {
                                        format!(
                                            "{}/{}",
                                            a["local"].as_str().unwrap_or(""),
                                            a["prefixlen"]
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        format!("{} {}", l["ifname"].as_str().unwrap_or(""), addrs.join(","))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The namespace names, for checking they are gone after drop.
    pub fn names(&self) -> [String; 2] {
        self.ns.clone()
    }

    /// Whether a namespace of that name exists now.
    pub fn exists(name: &str) -> bool {
        list_namespaces().iter().any(|n| n == name)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Processes still inside were started by this testbed's tests: stop them by pid
        // so the namespaces and veths really go away.
        for ns in &self.ns {
            if let Ok(pids) = sh("ip", &["netns", "pids", ns]) {
                for pid in pids.split_whitespace() {
                    let _ = sh("kill", &["-KILL", pid]);
                }
            }
        }
        for r in 0..self.rails {
            // Deleting one end deletes the pair.
            let _ = sh("ip", &["-n", &self.ns[0], "link", "del", &Self::ifname(r)]);
        }
        for ns in &self.ns {
            let _ = sh("ip", &["netns", "del", ns]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_are_summed_over_the_qdiscs_of_a_device() {
        let stats = "qdisc tbf 8001: root refcnt 2 rate 200Mbit burst 200Kb lat 50ms \n \
                     Sent 9811 bytes 61 pkt (dropped 206, overlimits 3 requeues 0) \n \
                     backlog 0b 0p requeues 0\n\
                     qdisc ingress ffff: parent ffff:fff1 ---------------- \n \
                     Sent 0 bytes 0 pkt (dropped 7, overlimits 0 requeues 0) \n";
        assert_eq!(dropped(stats), 213);
        assert_eq!(dropped(""), 0);
    }
}
