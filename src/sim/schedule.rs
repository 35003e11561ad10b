//! Seeded scenarios: the comms, their messages, and a fault schedule, all from one seed.

use std::fmt;
use std::time::Duration;

use crate::routing::rng::SplitMix64;

/// Bytes of the largest message.
pub(crate) const MAX_MESSAGE: usize = 256 << 10;

/// Something done to the network at a time (relative to the start of traffic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Carrier of a NIC (both directions); its node's reactor hears of it.
    Carrier { node: usize, nic: usize, up: bool },
    /// A black hole on a NIC's transmit and/or receive side: nothing crosses, no event.
    Hole {
        node: usize,
        nic: usize,
        tx: bool,
        rx: bool,
        on: bool,
    },
    /// A brown-out: the NIC's rate divided by `factor` (`None`: restored).
    Slow {
        node: usize,
        nic: usize,
        factor: Option<u32>,
    },
    /// The node's process dies.
    Kill { node: usize },
    /// The switch of rail `rail` fails (`up`: it is back): NIC `rail` of every node at
    /// once. A dark switch drops every port's carrier, and each node's reactor hears of
    /// it; a `silent` one keeps the links up and forwards nothing (a black hole both ways
    /// on every node's NIC, no event).
    Switch { rail: usize, up: bool, silent: bool },
    /// An operator drains (`on`) or undrains a NIC of a node: its reactor is asked, as
    /// the control socket would ask it, and may refuse. The network does not change.
    Drain { node: usize, nic: usize, on: bool },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Fault {
    pub at: Duration,
    pub action: Action,
}

/// One send comm from node `from` to node `to`, on NIC `nic` at both ends.
#[derive(Debug, Clone)]
pub(crate) struct CommPlan {
    pub from: usize,
    pub to: usize,
    pub nic: usize,
    pub sizes: Vec<usize>,
    /// Extra room in each receive buffer beyond the message.
    pub slack: Vec<usize>,
    /// Message `k` is posted `k * gap` after traffic starts (or when a slot frees).
    pub gap: Duration,
    /// Requests in flight per side at most (a grouped receive is one request).
    pub window: usize,
    /// How NCCL groups the receives and orders the sends.
    pub matching: Matching,
}

/// How the receives of a comm are grouped and tagged, and in which order its sends come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Matching {
    /// The number of buffers of each receive NCCL posts, 1 to 8, in order; they sum to
    /// the number of messages (buffer `k` is the one message `k` is meant for).
    pub groups: Vec<usize>,
    /// Each buffer's tag; a send is meant for a buffer with its tag.
    pub tags: Vec<i32>,
    /// Bytes buffer `k` lacks for message `k`, so a send into it is cut (mostly 0).
    pub short: Vec<usize>,
    /// Send `j` carries message `order[j]` (its size and tag), a permutation inside each
    /// group: a group's sends come in any order.
    pub order: Vec<usize>,
}

impl Matching {
    /// One receive per message, every tag 0, sends in order: NCCL's plain send/recv.
    pub(crate) fn singles(n: usize) -> Matching {
        Matching {
            groups: vec![1; n],
            tags: vec![0; n],
            short: vec![0; n],
            order: (0..n).collect(),
        }
    }

    fn is_singles(&self) -> bool {
        *self == Matching::singles(self.order.len())
    }

    /// Grouped receives from a seed of their own (the rest of the schedule is drawn as
    /// before): groups of 1 to 8, tags from a small set so that groups repeat them and
    /// share them, sends shuffled inside their group, and now and then a buffer smaller
    /// than its message.
    fn grouped(rng: &mut SplitMix64, sizes: &[usize]) -> Matching {
        let n = sizes.len();
        let mut groups = Vec::new();
        let mut left = n;
        while left > 0 {
            let g = 1 + rng.below(left.min(8));
            groups.push(g);
            left -= g;
        }
        let alphabet = 1 + rng.below(4);
        let tags = (0..n).map(|_| rng.below(alphabet) as i32).collect();
        let short = (sizes.iter())
            .map(|&len| {
                if len > 0 && rng.below(8) == 0 {
                    1 + rng.below(len)
                } else {
                    0
                }
            })
            .collect();
        let mut order = Vec::with_capacity(n);
        let mut first = 0;
        for &g in &groups {
            let mut part: Vec<usize> = (first..first + g).collect();
            for i in (1..g).rev() {
                part.swap(i, rng.below(i + 1));
            }
            order.extend(part);
            first += g;
        }
        Matching {
            groups,
            tags,
            short,
            order,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub seed: u64,
    pub kind: &'static str,
    /// Nodes (reactors), each with `nics` NICs, NIC `i` on rail `i`.
    pub nodes: usize,
    pub nics: usize,
    /// The rail rule is `any` (else `same`: NIC `i` is on rail `i` on both nodes).
    pub rail_any: bool,
    pub comms: Vec<CommPlan>,
    /// Sorted by time.
    pub faults: Vec<Fault>,
    /// The fabric behaves as verbs lanes do: readiness is an edge (only news wakes a
    /// lane), and a lane's `write` reaps what arrived, consuming its event. Odd seeds;
    /// chosen without drawing from the generator, so schedules stay as they were.
    pub reaping: bool,
    /// Each NIC's link speed (Mb/s), as its node's sysfs would report it; empty: unknown.
    pub speeds: Vec<u64>,
}

const KINDS: &[&str] = &[
    "calm",
    "down-one-side",
    "down-both-sides",
    "black-hole",
    "brown-out",
    "backup-fails-during-migration",
    "backup-fails-during-fail-back-watch",
    "several-nics",
    "flapping",
    "killed-peer",
    "no-eligible-pair",
];

struct Gen {
    rng: SplitMix64,
}

impl Gen {
    fn below(&mut self, n: usize) -> usize {
        self.rng.below(n)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo as usize, hi as usize) as u64)
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn size(&mut self) -> usize {
        match self.below(20) {
            0 => 0,
            1 => MAX_MESSAGE,
            // Log-uniform: many small messages, a few large.
            _ => {
                let bits = self.range(0, 18);
                self.range(1 << bits >> 1, (1usize << bits).min(MAX_MESSAGE))
            }
        }
    }
}

/// Seeds come in families of this many: seeds `FAMILY_SPAN..2 * FAMILY_SPAN` are
/// [`Family::RailSwitch`]'s, the next span [`Family::ManyComms`]'s, the next
/// [`Family::Drains`]'s, and every other seed
/// is [`Family::TwoNodes`]'s (so the seeds below `FAMILY_SPAN` have the schedules they
/// had before there were families).
pub(crate) const FAMILY_SPAN: u64 = 1_000_000;

/// What a seed's scenario is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    /// Two nodes, 2 to 8 comms, one of the fault patterns of `KINDS`.
    TwoNodes,
    /// Four nodes all-to-all, 1 to 3 comms per ordered pair, and a rail's switch failing
    /// mid-run: NIC `i` of every node at once.
    RailSwitch,
    /// 256 comms (two nodes, or a ring of four in both directions) and one NIC cut.
    ManyComms,
    /// Two nodes, 2 to 8 comms each way; an operator drains a NIC mid-run and undrains it
    /// later, sometimes with another NIC's carrier lost meanwhile.
    Drains,
}

impl Family {
    pub(crate) fn of(seed: u64) -> Family {
        match seed / FAMILY_SPAN {
            1 => Family::RailSwitch,
            2 => Family::ManyComms,
            3 => Family::Drains,
            _ => Family::TwoNodes,
        }
    }

    /// The family's `n`th seed.
    pub(crate) fn seed(self, n: u64) -> u64 {
        match self {
            Family::TwoNodes if n < FAMILY_SPAN => n,
            Family::TwoNodes => n + 3 * FAMILY_SPAN,
            Family::RailSwitch => FAMILY_SPAN + n % FAMILY_SPAN,
            Family::ManyComms => 2 * FAMILY_SPAN + n % FAMILY_SPAN,
            Family::Drains => 3 * FAMILY_SPAN + n % FAMILY_SPAN,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::TwoNodes => "two nodes",
            Family::RailSwitch => "rail switch",
            Family::ManyComms => "many comms",
            Family::Drains => "drains",
        })
    }
}

/// A comm from `from` to `to` with `lo` to `hi` messages, on a NIC of `nics`.
fn comm(g: &mut Gen, from: usize, to: usize, nics: usize, lo: usize, hi: usize) -> CommPlan {
    let n = g.range(lo, hi);
    let sizes: Vec<usize> = (0..n).map(|_| g.size()).collect();
    let slack = (0..n)
        .map(|_| if g.chance(30) { g.range(1, 64) } else { 0 })
        .collect();
    CommPlan {
        from,
        to,
        nic: g.below(nics),
        matching: Matching::singles(sizes.len()),
        sizes,
        slack,
        gap: g.ms(5, 300),
        window: g.range(1, 4),
    }
}

impl Scenario {
    /// A scenario of `comms` over `nodes` nodes of `nics` NICs, faults still to come; the
    /// fabric reaps as verbs lanes do on odd seeds.
    fn new(
        seed: u64,
        kind: &'static str,
        nodes: usize,
        nics: usize,
        rail_any: bool,
        comms: Vec<CommPlan>,
    ) -> Scenario {
        Scenario {
            seed,
            kind,
            nodes,
            nics,
            rail_any,
            comms,
            faults: Vec::new(),
            reaping: seed % 2 == 1,
            speeds: Vec::new(),
        }
    }

    pub(crate) fn generate(seed: u64) -> Scenario {
        let mut g = Gen {
            rng: SplitMix64::new(seed ^ 0x5157_u64.rotate_left(40)),
        };
        let mut s = match Family::of(seed) {
            Family::TwoNodes => two_nodes(&mut g, seed),
            Family::RailSwitch => rail_switch(&mut g, seed),
            Family::ManyComms => many_comms(&mut g, seed),
            Family::Drains => drains(&mut g, seed),
        };
        s.faults.sort_by_key(|f| f.at);
        // Grouped receives on half the seeds (those with bit 1 set, independent of the
        // fabric's), from a generator of their own so the rest of the schedule is as
        // before.
        if seed & 2 != 0 {
            let mut rng = SplitMix64::new(seed ^ 0x6d61_7463_6869_6e67);
            for c in &mut s.comms {
                c.matching = Matching::grouped(&mut rng, &c.sizes);
            }
        }
        s
    }
}

fn two_nodes(g: &mut Gen, seed: u64) -> Scenario {
    let nics = g.range(2, 4);
    let rail_any = g.chance(25);
    let mut comms = Vec::new();
    for from in 0..2 {
        for _ in 0..g.range(1, 4) {
            comms.push(comm(g, from, 1 - from, nics, 2, 8));
        }
    }
    let kind = if g.chance(4) {
        KINDS[0]
    } else {
        KINDS[g.range(1, KINDS.len() - 1)]
    };
    let mut s = Scenario::new(seed, kind, 2, nics, rail_any, comms);
    s.faults = faults(g, &s);
    s
}

fn rail_switch(g: &mut Gen, seed: u64) -> Scenario {
    let nodes = 4;
    let nics = g.range(2, 4);
    let rail_any = g.chance(25);
    let mut comms = Vec::new();
    for from in 0..nodes {
        for to in (0..nodes).filter(|&to| to != from) {
            for _ in 0..g.range(1, 3) {
                comms.push(comm(g, from, to, nics, 2, 6));
            }
        }
    }
    let mut s = Scenario::new(seed, "rail-switch", nodes, nics, rail_any, comms);
    s.faults = switch_faults(g, &s);
    s
}

fn many_comms(g: &mut Gen, seed: u64) -> Scenario {
    let nics = g.range(2, 4);
    let rail_any = g.chance(25);
    let ring = g.chance(50);
    // 256 comms either way: 128 each way between two nodes, or 32 each way between
    // each pair of neighbours on a ring of four.
    let (kind, nodes, per_pair) = if ring {
        ("single-nic-cut, ring", 4, 32)
    } else {
        ("single-nic-cut", 2, 128)
    };
    let pairs: Vec<(usize, usize)> = if ring {
        (0..nodes)
            .flat_map(|n| [(n, (n + 1) % nodes), ((n + 1) % nodes, n)])
            .collect()
    } else {
        vec![(0, 1), (1, 0)]
    };
    let mut comms = Vec::new();
    for (from, to) in pairs {
        for _ in 0..per_pair {
            comms.push(comm(g, from, to, nics, 1, 4));
        }
    }
    let mut s = Scenario::new(seed, kind, nodes, nics, rail_any, comms);
    let mut f = Vec::new();
    let node = g.below(nodes);
    let nic = target(g, &s, node);
    let at = g.ms(20, 1200);
    let len = if g.chance(15) {
        None
    } else {
        Some(g.ms(100, 2500))
    };
    outage(g, &mut f, at, len, node, nic);
    s.faults = f;
    s
}

fn drains(g: &mut Gen, seed: u64) -> Scenario {
    let nics = g.range(2, 4);
    // Mostly any pair, so that a drain has somewhere to go; same-rail only, a drain of
    // a NIC a comm runs on is refused.
    let rail_any = g.chance(80);
    let mut comms = Vec::new();
    for from in [0, 1] {
        for _ in 0..g.range(1, 4) {
            comms.push(comm(g, from, 1 - from, nics, 2, 8));
        }
    }
    let mut s = Scenario::new(seed, "drain", 2, nics, rail_any, comms);
    let node = g.below(2);
    let nic = target(g, &s, node);
    let at = g.ms(20, 1500);
    let len = g.ms(200, 3000);
    let drain = |at, on| Fault {
        at,
        action: Action::Drain { node, nic, on },
    };
    let mut f = vec![drain(at, true), drain(at + len, false)];
    // Another NIC's carrier lost while drained: with three or more NICs a pair without
    // either is left, so no comm may fail.
    if nics >= 3 && g.chance(40) {
        let other = (nic + g.range(1, nics - 1)) % nics;
        let down_node = g.below(2);
        let down_at = at + g.ms(0, len.as_millis() as u64);
        f.push(carrier(down_at, down_node, other, false));
        f.push(carrier(down_at + g.ms(100, 2000), down_node, other, true));
    }
    s.faults = f;
    s
}

/// A NIC a comm uses at `node` most of the time, else any.
fn target(g: &mut Gen, s: &Scenario, node: usize) -> usize {
    if g.chance(80) {
        let c = &s.comms[g.below(s.comms.len())];
        c.nic
    } else {
        let _ = node;
        g.below(s.nics)
    }
}

fn carrier(at: Duration, node: usize, nic: usize, up: bool) -> Fault {
    Fault {
        at,
        action: Action::Carrier { node, nic, up },
    }
}

fn hole(at: Duration, node: usize, nic: usize, dirs: (bool, bool), on: bool) -> Fault {
    Fault {
        at,
        action: Action::Hole {
            node,
            nic,
            tx: dirs.0,
            rx: dirs.1,
            on,
        },
    }
}

/// A NIC outage from `at` for `len` (`None`: for good), by carrier or black hole.
fn outage(
    g: &mut Gen,
    f: &mut Vec<Fault>,
    at: Duration,
    len: Option<Duration>,
    node: usize,
    nic: usize,
) {
    if g.chance(60) {
        f.push(carrier(at, node, nic, false));
        if let Some(len) = len {
            f.push(carrier(at + len, node, nic, true));
        }
    } else {
        let dirs = match g.below(4) {
            0 => (true, false),
            1 => (false, true),
            _ => (true, true),
        };
        f.push(hole(at, node, nic, dirs, true));
        if let Some(len) = len {
            f.push(hole(at + len, node, nic, dirs, false));
        }
    }
}

fn faults(g: &mut Gen, s: &Scenario) -> Vec<Fault> {
    let mut f = Vec::new();
    let node = g.below(2);
    let t1 = g.ms(20, 1500);
    match s.kind {
        "calm" => {}
        "down-one-side" => {
            let nic = target(g, s, node);
            let len = g.ms(50, 2500);
            f.push(carrier(t1, node, nic, false));
            f.push(carrier(t1 + len, node, nic, true));
        }
        "down-both-sides" => {
            let nic = target(g, s, node);
            let skew = g.ms(0, 50);
            let len = g.ms(100, 2500);
            f.push(carrier(t1, node, nic, false));
            f.push(carrier(t1 + skew, 1 - node, nic, false));
            f.push(carrier(t1 + len, node, nic, true));
            f.push(carrier(t1 + skew + g.ms(0, 500) + len, 1 - node, nic, true));
        }
        "black-hole" => {
            let nic = target(g, s, node);
            let dirs = match g.below(3) {
                0 => (true, false),
                1 => (false, true),
                _ => (true, true),
            };
            let len = g.ms(100, 3000);
            f.push(hole(t1, node, nic, dirs, true));
            f.push(hole(t1 + len, node, nic, dirs, false));
        }
        "brown-out" => {
            let nic = target(g, s, node);
            let factor = g.range(10, 200) as u32;
            f.push(Fault {
                at: t1,
                action: Action::Slow {
                    node,
                    nic,
                    factor: Some(factor),
                },
            });
            f.push(Fault {
                at: t1 + g.ms(200, 3000),
                action: Action::Slow {
                    node,
                    nic,
                    factor: None,
                },
            });
        }
        "backup-fails-during-migration" => {
            // The first failure, then another NIC fails just as the first is detected:
            // at once for a carrier loss, after the completion timeout for a black hole.
            let nic = target(g, s, node);
            let silent = g.chance(40);
            let first_len = g.ms(500, 3000);
            if silent {
                f.push(hole(t1, node, nic, (true, true), true));
                f.push(hole(t1 + first_len, node, nic, (true, true), false));
            } else {
                f.push(carrier(t1, node, nic, false));
                f.push(carrier(t1 + first_len, node, nic, true));
            }
            let detect = if silent { g.ms(900, 1300) } else { g.ms(0, 30) };
            for _ in 0..g.range(1, s.nics - 1) {
                let other = (nic + g.range(1, s.nics - 1)) % s.nics;
                let side = if g.chance(70) { node } else { 1 - node };
                let len = g.ms(100, 1500);
                outage(g, &mut f, t1 + detect, Some(len), side, other);
            }
        }
        "backup-fails-during-fail-back-watch" => {
            // The original heals and waits out its fail-back test; meanwhile every other
            // NIC of the sender fails, so the original is the one pair left.
            let c = &s.comms[g.below(s.comms.len())];
            let (node, nic) = (c.from, c.nic);
            let t2 = t1 + g.ms(200, 1500);
            f.push(carrier(t1, node, nic, false));
            f.push(carrier(t2, node, nic, true));
            let t3 = t2 + g.ms(50, 1500);
            let len = g.ms(300, 2000);
            for other in (0..s.nics).filter(|&o| o != nic) {
                f.push(carrier(t3, node, other, false));
                f.push(carrier(t3 + len, node, other, true));
            }
        }
        "several-nics" => {
            let m = g.range(2, s.nics);
            let first = g.below(s.nics);
            for k in 0..m {
                let side = if g.chance(70) { node } else { 1 - node };
                let at = t1
                    + if g.chance(50) {
                        Duration::ZERO
                    } else {
                        g.ms(0, 800)
                    };
                let len = g.ms(100, 2500);
                outage(g, &mut f, at, Some(len), side, (first + k) % s.nics);
            }
        }
        "flapping" => {
            let nic = target(g, s, node);
            let mut t = t1;
            for _ in 0..g.range(3, 8) {
                f.push(carrier(t, node, nic, false));
                t += g.ms(20, 400);
                f.push(carrier(t, node, nic, true));
                t += g.ms(20, 400);
            }
        }
        "killed-peer" => {
            f.push(Fault {
                at: g.ms(10, 2500),
                action: Action::Kill { node },
            });
        }
        "no-eligible-pair" => {
            let len = if g.chance(50) {
                None
            } else {
                Some(g.ms(3500, 6000))
            };
            let by_carrier = g.chance(50);
            for nic in 0..s.nics {
                if by_carrier {
                    f.push(carrier(t1, node, nic, false));
                    if let Some(len) = len {
                        f.push(carrier(t1 + len, node, nic, true));
                    }
                } else {
                    f.push(hole(t1, node, nic, (true, true), true));
                    if let Some(len) = len {
                        f.push(hole(t1 + len, node, nic, (true, true), false));
                    }
                }
            }
        }
        other => unreachable!("unknown kind {other}"),
    }
    // Sometimes an unrelated fault on top: a short outage or brown-out elsewhere.
    if !matches!(s.kind, "calm" | "killed-peer") && g.chance(25) {
        let side = g.below(2);
        let nic = g.below(s.nics);
        let at = g.ms(20, 2500);
        if g.chance(50) {
            let len = g.ms(50, 1500);
            outage(g, &mut f, at, Some(len), side, nic);
        } else {
            f.push(Fault {
                at,
                action: Action::Slow {
                    node: side,
                    nic,
                    factor: Some(g.range(10, 100) as u32),
                },
            });
            f.push(Fault {
                at: at + g.ms(100, 2000),
                action: Action::Slow {
                    node: side,
                    nic,
                    factor: None,
                },
            });
        }
    }
    f
}

fn switch(f: &mut Vec<Fault>, at: Duration, len: Option<Duration>, rail: usize, silent: bool) {
    f.push(Fault {
        at,
        action: Action::Switch {
            rail,
            up: false,
            silent,
        },
    });
    if let Some(len) = len {
        f.push(Fault {
            at: at + len,
            action: Action::Switch {
                rail,
                up: true,
                silent,
            },
        });
    }
}

/// A rail's switch fails mid-run (for good now and then), dark or silent; sometimes
/// another switch fails while it is out, one node's NIC on another rail fails, or the
/// switch fails again soon after it came back.
fn switch_faults(g: &mut Gen, s: &Scenario) -> Vec<Fault> {
    let mut f = Vec::new();
    let rail = target(g, s, 0);
    let t1 = g.ms(20, 1500);
    let silent = g.chance(30);
    let len = if g.chance(15) {
        None
    } else {
        Some(g.ms(100, 2500))
    };
    switch(&mut f, t1, len, rail, silent);
    if g.chance(30) {
        let other = (rail + g.range(1, s.nics - 1)) % s.nics;
        match g.below(3) {
            0 => {
                let at = t1 + g.ms(0, 800);
                let len = g.ms(100, 2000);
                let silent = g.chance(30);
                switch(&mut f, at, Some(len), other, silent);
            }
            1 => {
                let node = g.below(s.nodes);
                let at = t1 + g.ms(0, 800);
                let len = g.ms(100, 1500);
                outage(g, &mut f, at, Some(len), node, other);
            }
            _ => {
                if let Some(len) = len {
                    let again = t1 + len + g.ms(20, 400);
                    let len = g.ms(50, 1000);
                    switch(&mut f, again, Some(len), rail, silent);
                }
            }
        }
    }
    f
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Carrier { node, nic, up } => {
                write!(
                    f,
                    "n{node}e{nic} carrier {}",
                    if up { "up" } else { "down" }
                )
            }
            Action::Hole {
                node,
                nic,
                tx,
                rx,
                on,
            } => {
                let dirs = match (tx, rx) {
                    (true, true) => "both ways",
                    (true, false) => "outbound",
                    _ => "inbound",
                };
                if on {
                    write!(f, "n{node}e{nic} black hole ({dirs})")
                } else {
                    write!(f, "n{node}e{nic} black hole healed ({dirs})")
                }
            }
            Action::Slow { node, nic, factor } => match factor {
                Some(x) => write!(f, "n{node}e{nic} brown-out (rate / {x})"),
                None => write!(f, "n{node}e{nic} rate restored"),
            },
            Action::Kill { node } => write!(f, "node {node} killed"),
            Action::Drain { node, nic, on } => {
                write!(
                    f,
                    "n{node}e{nic} {}",
                    if on { "drained" } else { "undrained" }
                )
            }
            Action::Switch { rail, up, silent } => match (up, silent) {
                (false, false) => write!(
                    f,
                    "rail {rail} switch dark (every node's e{rail} carrier down)"
                ),
                (false, true) => write!(
                    f,
                    "rail {rail} switch silent (every node's e{rail} black hole)"
                ),
                (true, _) => write!(f, "rail {rail} switch back"),
            },
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {} ({}): {} nodes x {} NICs, rail rule {}, {} fabric",
            self.seed,
            self.kind,
            self.nodes,
            self.nics,
            if self.rail_any { "any" } else { "same" },
            if self.reaping {
                "verbs-like (edge readiness, reaping writes)"
            } else {
                "socket-like"
            }
        )?;
        for (i, c) in self.comms.iter().enumerate() {
            writeln!(
                f,
                "  comm {i}: node {} -> node {} on NIC {}, window {}, every {} ms, sizes {:?}",
                c.from,
                c.to,
                c.nic,
                c.window,
                c.gap.as_millis(),
                c.sizes
            )?;
            let m = &c.matching;
            if !m.is_singles() {
                writeln!(
                    f,
                    "    receives of {:?} buffers, tags {:?}, short by {:?}; sends carry {:?}",
                    m.groups, m.tags, m.short, m.order
                )?;
            }
        }
        for x in &self.faults {
            writeln!(f, "  at {:>6} ms: {}", x.at.as_millis(), x.action)?;
        }
        Ok(())
    }
}
