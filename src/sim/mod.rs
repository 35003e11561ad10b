//! The deterministic simulation tier: real reactors ([`Driven`]), one per node, over an
//! in-memory network ([`net`]) in virtual time, under seeded fault schedules
//! ([`schedule`]), with the promises checked on every step and at the end ([`check`]).
//!
//! Every node has the same NICs, NIC `i` on rail `i`; each comm joins two nodes, one
//! sending and one receiving, as two NCCL ranks drive it. A seed's family
//! ([`schedule::Family`]) sets the scale: two nodes and a handful of comms under one of
//! a dozen fault patterns (seeds below 1,000,000), four nodes all-to-all under a rail's
//! switch failing, which takes NIC `i` of every node at once (from 1,000,000), or 256
//! comms through a NIC cut (from 2,000,000). Faults act on one NIC of one node (carrier,
//! black hole, brown-out), on one rail of every node (a switch gone dark or silent), or
//! kill a node.
//!
//! A failure prints its seed, the schedule and the broken invariant;
//! `RAILOVER_SIM_SEED=<n> cargo test --lib sim -- --nocapture` replays that seed, of any
//! family, with a trace of the network, the faults, the requests and the reactors' own
//! log lines.

mod check;
mod fabric;
mod net;
mod schedule;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::conn::ib_model::{IbModel, Placed};
use crate::conn::matching::Matched;
use crate::handoff::comm::Isend;
use crate::handoff::{
    CommShared, Command, Done, ListenShared, PendingConnect, PendingListen, Request, Rescue, Status,
};
use crate::reactor::driven::Driven;
use crate::reactor::{LocalNic, Setup};
use crate::routing::RouterConfig;
use crate::telemetry::exporter::ExporterConfig;
use crate::telemetry::metrics::Telemetry;
use crate::topology::{PathType, RailRule};
use crate::transport::memory::SimMem;
use check::{COMPLETION_TIMEOUT, HANG_BOUND};
use fabric::{SharedNet, SimFabric, SimLane};
use mio::Token;
use net::{Net, Time, Wire};
use schedule::{Action, Scenario};

/// The byte at `i` of message `seq` of comm `comm`: a receiver can tell a wrong, late,
/// doubled or shifted message from the right one.
fn pattern(comm: usize, seq: usize, i: usize) -> u8 {
    let x = (comm as u64) << 40 ^ (seq as u64) << 20 ^ (i as u64 >> 8);
    let h = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h >> 56) as u8 ^ i as u8
}

fn message(comm: usize, seq: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern(comm, seq, i)).collect()
}

fn telemetry() -> Arc<Telemetry> {
    static T: OnceLock<Arc<Telemetry>> = OnceLock::new();
    T.get_or_init(|| Arc::new(Telemetry::start(&ExporterConfig::off(), None)))
        .clone()
}

fn setup(s: &Scenario, node: usize) -> Setup {
    Setup {
        nics: (0..s.nics)
            .map(|i| LocalNic {
                name: format!("n{node}e{i}"),
                ip: net::ip_of(node, i),
                rail: Some(i as u32),
                speed_mbps: s.speeds.get(i).copied(),
            })
            .collect(),
        distance: vec![vec![Some(PathType::Pix); s.nics]; s.nics],
        spin: Duration::ZERO,
        completion_timeout: COMPLETION_TIMEOUT,
        probe_timeout: Duration::from_millis(200),
        probe_bytes: 64 << 10,
        fair_share: false,
        stripes: None,
        router: RouterConfig {
            rail_rule: if s.rail_any {
                RailRule::Any
            } else {
                RailRule::Same
            },
            distance_limit: PathType::Phb,
            failback_interval: check::FAILBACK_INTERVAL,
            failback_probes_k: check::FAILBACK_PROBES,
            holddown_base: Duration::from_secs(1),
            holddown_max: check::HOLDDOWN_MAX,
            health_ttl: Duration::from_millis(500),
            giveup: check::GIVEUP,
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            weighted: true,
            seed: s.seed.wrapping_mul(2).wrapping_add(node as u64 + 1),
        },
        telemetry: telemetry(),
        unmatched_warn: Duration::from_secs(10),
        entropy_seed: Some(s.seed ^ (node as u64 + 1) << 56),
    }
}

/// A request NCCL would hold, with the memory it lent: a send (`id` is its number, one
/// buffer) or a receive (`id` is its group, a buffer for each message of it).
struct Posted {
    id: usize,
    req: Arc<Request>,
    mems: Vec<Arc<SimMem>>,
    at: Time,
}

/// One send comm and its receive comm, as the two NCCL ranks drive them.
struct Flow {
    from: usize,
    to: usize,
    send: Arc<CommShared>,
    recv: Arc<CommShared>,
    /// The next send and the next group of receives NCCL posts.
    next_send: usize,
    next_group: usize,
    /// Sends `isend` answered "not now", with when NCCL first tried each and the buffer
    /// it holds for it: it tries them again, in order, on every turn.
    waiting: VecDeque<(usize, Time, Arc<SimMem>)>,
    sends: VecDeque<Posted>,
    recvs: VecDeque<Posted>,
    /// NCCL's IB transport, given the same calls: where each send must go.
    model: IbModel,
    /// The model's id of each group of receives posted.
    model_ids: Vec<u64>,
    /// Per buffer (message, sequence number): the send that filled it and the size.
    filled: Vec<Option<(usize, usize)>>,
    /// Per send: the size it moves, once matched.
    send_size: Vec<Option<usize>>,
    /// Per send and per buffer: finished well.
    sent_ok: Vec<bool>,
    recv_ok: Vec<bool>,
    /// Per buffer: its receive failed as a whole although it held other buffers too
    /// (this one may have been filled, and its send completed, as in NCCL's IB transport).
    group_failed: Vec<bool>,
    /// When a request of the comm first failed.
    failed: Option<Time>,
    may_fail: bool,
    nic_seen: usize,
    /// The pairs the sender runs over, as last seen, and the most it ever ran over.
    spread_seen: usize,
    max_spread: usize,
    /// The sender left its original NIC, or spread beyond its one pair, at some point.
    left_home: bool,
}

/// One run of one seed.
struct Sim {
    s: Arc<Scenario>,
    net: SharedNet,
    base: Instant,
    now: Time,
    /// Traffic starts here (after the comms connected); fault times count from it.
    start: Time,
    nodes: Vec<Option<Driven<SimFabric>>>,
    flows: Vec<Flow>,
    state: check::State,
    next_fault: usize,
    last_fault: Time,
    trace: bool,
    violations: Vec<String>,
    /// Every buffer lent to a reactor, kept until the reactors are gone.
    mems: Vec<Arc<SimMem>>,
    /// A spinning timer was reported.
    spun: bool,
    /// The reactors' polls that returned at the end of the last turn.
    polled: Option<Vec<Vec<Token>>>,
    /// Stranded bytes were reported (once a run).
    stranded: bool,
    placements: Vec<Placement>,
    /// What NCCL's side met: `isend` answers "not now", sends cut to their receive, and
    /// grouped receives (of two buffers or more) that finished.
    not_now: u64,
    cut: u64,
    grouped: u64,
}

/// Where a run ended.
#[derive(Debug)]
pub(crate) struct Report {
    pub virtual_time: Duration,
    pub failed_comms: usize,
    pub violations: Vec<String>,
    /// The most pairs any comm's stripes ran over at once.
    pub max_spread: usize,
    /// Per comm: its sender left its original NIC or pair at some point.
    pub left_home: Vec<bool>,
    /// Per comm: a request of it, or the comm itself, failed.
    pub failed: Vec<bool>,
    /// Payloads written in place that landed, and that a fenced or closed receiver end
    /// stopped.
    pub landed: u64,
    pub dropped: u64,
    /// `isend` answers "not now", sends cut to their receive's size, and grouped
    /// receives that finished.
    pub not_now: u64,
    pub cut: u64,
    pub grouped: u64,
    /// Each time a comm's spread changed, where its sender's stripes ran.
    pub placements: Vec<Placement>,
}

/// Where a sender's stripes ran when one of its comms' spread changed.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub comm: usize,
    /// Pairs the comm ran over.
    pub spread: usize,
    /// (local NIC, running stripes of every comm on it) on the sender's node.
    pub stripes: Vec<(u32, u32)>,
}

impl Sim {
    fn note(&self, what: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("{:>10.3} ms  sim  {}", self.now.as_secs_f64() * 1e3, what());
        }
    }

    fn violate(&mut self, what: String) {
        self.note(|| format!("VIOLATION: {what}"));
        if self.violations.len() < 20 {
            self.violations
                .push(format!("at {} ms: {what}", self.now.as_millis()));
        }
    }

    /// The wire up to now, and what its writes in place did wrong.
    fn advance(&mut self) {
        let faults = {
            let mut net = self.net.lock();
            net.advance(self.now);
            std::mem::take(&mut net.faults)
        };
        for f in faults {
            self.violate(f);
        }
    }

    fn alive(&self, node: usize) -> bool {
        self.nodes[node].is_some()
    }

    /// Every reactor's poll, as it returns now.
    fn poll(&self) -> Vec<Vec<Token>> {
        let edge = self.s.reaping;
        (self.nodes.iter())
            .map(|d| {
                d.as_ref()
                    .map_or(Vec::new(), |d| d.poll(|l| !edge || l.take_news()))
            })
            .collect()
    }

    /// One turn of everything at `self.now`. The reactors act on the polls that returned
    /// at the end of the last turn: what the wire delivered since lands while they act,
    /// as bytes do between a real poll and the work it triggers, and is reported by the
    /// next poll unless a lane's own call took it in first.
    fn turn(&mut self) {
        let now = self.now;
        let polled = match self.polled.take() {
            Some(p) => p,
            None => self.poll(),
        };
        self.advance();
        let at = self.base + now;
        for (n, ready) in polled.iter().enumerate() {
            let Some(d) = self.nodes[n].as_mut() else {
                continue;
            };
            d.step(at, ready);
            let lost = d.unannounced();
            if !lost.is_empty() && !std::mem::replace(&mut self.stranded, true) {
                self.violate(format!(
                    "node {n}: lanes {lost:?} hold bytes that no event will announce and that are not put down to be read"
                ));
            }
        }
        self.advance();
        self.polled = Some(self.poll());
    }

    /// The next time anything is due, after a turn at `self.now`.
    fn next_time(&self, extra: Option<Time>) -> Time {
        let mut t = self.net.lock().next_event();
        for d in self.nodes.iter().flatten() {
            // A lane to read now: one put down to be read, or news a poll would report.
            if d.has_unread() || (self.s.reaping && d.any_lane(SimLane::has_news)) {
                return self.now;
            }
            let w = d
                .next_wakeup()
                .map(|w| w.saturating_duration_since(self.base));
            t = [t, w].into_iter().flatten().min();
        }
        t = [t, extra].into_iter().flatten().min();
        t.unwrap_or(self.now + Duration::from_millis(100))
            .max(self.now)
    }

    fn connect(&mut self) -> Result<(), String> {
        let mut pending = Vec::new();
        for (i, c) in self.s.comms.clone().iter().enumerate() {
            let (from, to) = (c.from, c.to);
            let token = {
                let mut t = [0u8; 16];
                t[..8].copy_from_slice(&self.s.seed.to_le_bytes());
                t[8..].copy_from_slice(&(i as u64).to_le_bytes());
                t
            };
            let rx = self.nodes[to].as_ref().expect("alive at setup");
            let shared = Arc::new(ListenShared {
                id: i as u64 + 1,
                token,
                nic: c.nic,
                ready: Mutex::new(VecDeque::new()),
                queue: rx.queue().clone(),
            });
            let reply = Arc::new(PendingListen::default());
            rx.queue().push(Command::Listen {
                nic: c.nic,
                shared: shared.clone(),
                reply: reply.clone(),
            });
            self.turn();
            let addr: SocketAddr = match reply.wait(Duration::ZERO) {
                Some(Ok(a)) => a,
                other => return Err(format!("listen for comm {i} failed: {other:?}")),
            };
            let p = Arc::new(PendingConnect::default());
            let tx = self.nodes[from].as_ref().expect("alive at setup");
            tx.queue().push(Command::Connect {
                nic: c.nic,
                to: addr,
                token,
                rescue: Rescue::default(),
                pending: p.clone(),
            });
            pending.push((shared, p));
        }
        let mut done: Vec<Option<(Arc<CommShared>, Arc<CommShared>)>> = vec![None; pending.len()];
        for _ in 0..10_000 {
            self.turn();
            for (i, (l, p)) in pending.iter().enumerate() {
                if done[i].is_some() {
                    continue;
                }
                let Some(r) = p.result.lock().take() else {
                    continue;
                };
                let send = r.map_err(|e| format!("connect of comm {i} failed: {e}"))?;
                let recv = l.ready.lock().pop_front();
                match recv {
                    Some(recv) => done[i] = Some((send, recv)),
                    None => *p.result.lock() = Some(Ok(send)),
                }
            }
            if done.iter().all(Option::is_some) {
                break;
            }
            self.now = self.next_time(None);
            if self.now > Duration::from_secs(5) {
                break;
            }
        }
        if done.iter().any(Option::is_none) {
            return Err("comms did not connect without faults".into());
        }
        for (l, _) in &pending {
            let owner = self.s.comms[l.id as usize - 1].to;
            if let Some(d) = &self.nodes[owner] {
                d.queue().push(Command::CloseListen { shared: l.clone() });
            }
        }
        for (i, pair) in done.into_iter().enumerate() {
            let (send, recv) = pair.expect("checked above");
            let c = &self.s.comms[i];
            self.note(|| {
                format!(
                    "comm {i}: the reactors call it comm {} (node {}) and comm {} (node {})",
                    send.key, c.from, recv.key, c.to
                )
            });
            self.flows.push(Flow {
                from: c.from,
                to: c.to,
                nic_seen: send.nic(),
                spread_seen: 1,
                max_spread: 1,
                left_home: false,
                send,
                recv,
                next_send: 0,
                next_group: 0,
                waiting: VecDeque::new(),
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                model: IbModel::default(),
                model_ids: Vec::new(),
                filled: vec![None; c.sizes.len()],
                send_size: vec![None; c.sizes.len()],
                sent_ok: vec![false; c.sizes.len()],
                recv_ok: vec![false; c.sizes.len()],
                group_failed: vec![false; c.sizes.len()],
                failed: None,
                may_fail: check::may_fail(&self.s, i),
            });
        }
        Ok(())
    }

    /// The time fault `f` of the schedule is due.
    fn fault_time(&self, i: usize) -> Option<Time> {
        self.s.faults.get(i).map(|f| self.start + f.at)
    }

    fn apply_faults(&mut self) {
        while let Some(t) = self.fault_time(self.next_fault).filter(|&t| t <= self.now) {
            let a = self.s.faults[self.next_fault].action;
            self.next_fault += 1;
            self.last_fault = t;
            self.note(|| format!("fault: {a}"));
            if check::apply(&mut self.state, a) {
                let Action::Kill { node } = a else {
                    unreachable!("only a kill kills");
                };
                // The process dies: its sockets close as the kernel closes them.
                drop(self.nodes[node].take());
                continue;
            }
            if let Action::Drain { node, nic, on } = a {
                let at = self.base + self.now;
                if let Some(d) = &mut self.nodes[node] {
                    let said = d.drain(nic, on, at);
                    self.note(|| format!("n{node}: {said:?}"));
                }
                continue;
            }
            // The NICs it touches, and whether their reactors hear of it.
            let (nodes, nic, event) = match a {
                Action::Carrier { node, nic, .. } => (node..node + 1, nic, true),
                Action::Hole { node, nic, .. } | Action::Slow { node, nic, .. } => {
                    (node..node + 1, nic, false)
                }
                Action::Switch { rail, silent, .. } => (0..self.s.nodes, rail, !silent),
                Action::Kill { .. } | Action::Drain { .. } => unreachable!(),
            };
            for node in nodes {
                let st = self.state[node][nic];
                let (tx, rx) = st.links();
                self.net.lock().set_link(node, nic, Some(tx), Some(rx));
                if event {
                    let at = self.base + self.now;
                    if let Some(d) = &mut self.nodes[node] {
                        d.carrier(nic, !st.carrier_lost(), at);
                    }
                }
            }
        }
    }

    /// NCCL's side: posts what is due, tries again the sends that were told "not now",
    /// takes what finished, and checks it.
    fn drive_requests(&mut self) -> Option<Time> {
        let mut next: Option<Time> = None;
        for f in 0..self.flows.len() {
            self.harvest(f);
            let fl = &self.flows[f];
            if !self.alive(fl.from) || !self.alive(fl.to) {
                continue;
            }
            let soon = [self.post_receives(f), self.post_sends(f)];
            next = soon.into_iter().chain([next]).flatten().min();
        }
        next
    }

    /// The first buffer (sequence number) of each group of comm `f`'s receives.
    fn group_first(&self, f: usize, group: usize) -> usize {
        self.s.comms[f].matching.groups[..group].iter().sum()
    }

    /// Buffer `k`'s size: its message, the slack, less what it is short.
    fn capacity(&self, f: usize, k: usize) -> usize {
        let plan = &self.s.comms[f];
        plan.sizes[k] + plan.slack[k] - plan.matching.short[k]
    }

    /// Posts comm `f`'s receives that are due, a group at a time, within the window;
    /// returns when the next one is due.
    fn post_receives(&mut self, f: usize) -> Option<Time> {
        let s = self.s.clone();
        let plan = &s.comms[f];
        let groups = &plan.matching.groups;
        let to = plan.to;
        while self.flows[f].next_group < groups.len() && self.flows[f].recvs.len() < plan.window {
            let group = self.flows[f].next_group;
            let first = self.group_first(f, group);
            let due = self.start + plan.gap * first as u32;
            if due > self.now {
                return Some(due);
            }
            let n = groups[group];
            let caps: Vec<usize> = (first..first + n).map(|k| self.capacity(f, k)).collect();
            let fl = &mut self.flows[f];
            fl.next_group += 1;
            let rreq = Arc::new(Request::group(fl.recv.clone(), n));
            let mems: Vec<Arc<SimMem>> = (caps.iter())
                .map(|&cap| Arc::new(SimMem::new(vec![0xEE; cap])))
                .collect();
            let bufs: Vec<(i32, u64)> = (first..first + n)
                .zip(&caps)
                .map(|(k, &cap)| (plan.matching.tags[k], cap as u64))
                .collect();
            let id = fl.model.irecv(&bufs);
            fl.model_ids.push(id);
            for (k, mem) in (first..).zip(&mems) {
                self.net.lock().expect_writes(
                    mem.clone(),
                    rreq.clone(),
                    format!("comm {f} receive {k}"),
                );
            }
            let fl = &mut self.flows[f];
            // As `plugin::irecv`: a comm that failed hands out failed requests and
            // queues nothing.
            match (fl.recv.failure(), &self.nodes[to]) {
                (Some(e), _) => rreq.fail(e),
                (None, Some(rx)) => rx.queue().push(Command::Recv {
                    comm: fl.recv.clone(),
                    req: rreq.clone(),
                    bufs: (mems.iter().zip(&bufs))
                        .map(|(m, &(tag, _))| (m.user_buf(), tag))
                        .collect(),
                }),
                (None, None) => unreachable!("checked alive"),
            }
            fl.recvs.push_back(Posted {
                id: group,
                req: rreq,
                mems: mems.clone(),
                at: self.now,
            });
            self.mems.extend(mems);
        }
        None
    }

    /// Posts comm `f`'s sends that are due (NCCL holds them from then on) and tries every
    /// send it holds, in order, through the plugin's own `isend`; returns when the next
    /// one is due, or now when one was handed to the reactor.
    fn post_sends(&mut self, f: usize) -> Option<Time> {
        let s = self.s.clone();
        let plan = &s.comms[f];
        let n = plan.sizes.len();
        let mut soon = None;
        let fl = &mut self.flows[f];
        while fl.next_send < n && fl.waiting.len() + fl.sends.len() < plan.window * 8 {
            let due = self.start + plan.gap * fl.next_send as u32;
            if due > self.now {
                soon = Some(due);
                break;
            }
            let j = fl.next_send;
            let len = plan.sizes[plan.matching.order[j]];
            let mem = Arc::new(SimMem::new(message(f, j, len)));
            fl.waiting.push_back((j, self.now, mem));
            fl.next_send += 1;
        }
        let at = self.base + self.now;
        for _ in 0..self.flows[f].waiting.len() {
            let (j, since, mem) = self.flows[f].waiting.pop_front().expect("counted");
            let k = plan.matching.order[j];
            let (tag, len) = (plan.matching.tags[k], plan.sizes[k]);
            let fl = &mut self.flows[f];
            let req = match fl.send.isend(mem.user_buf(), tag, at) {
                Err(e) => {
                    let req = Arc::new(Request::new(fl.send.clone()));
                    req.fail(e);
                    req
                }
                Ok(Isend::NotNow) => {
                    fl.waiting.push_back((j, since, mem));
                    self.not_now += 1;
                    continue;
                }
                Ok(Isend::Failed(req)) => req,
                Ok(Isend::Posted(req, m)) => {
                    self.matched(f, j, m);
                    soon = Some(self.now);
                    req
                }
            };
            self.note(|| format!("comm {f}: send {j} (tag {tag}, {len} B) posted"));
            self.flows[f].sends.push_back(Posted {
                id: j,
                req,
                mems: vec![mem.clone()],
                at: self.now,
            });
            self.mems.push(mem);
        }
        soon
    }

    /// The plugin matched send `j` of comm `f` to `m`: NCCL's IB transport must have put
    /// it in the same buffer, with the same size.
    fn matched(&mut self, f: usize, j: usize, m: Matched) {
        let plan = &self.s.comms[f];
        let k = plan.matching.order[j];
        let (tag, len) = (plan.matching.tags[k], plan.sizes[k]);
        let seq = m.seq as usize;
        let posted = self.flows[f].next_group;
        let group = (0..posted)
            .map(|g| (g, self.group_first(f, g)))
            .find(|&(g, first)| (first..first + plan.matching.groups[g]).contains(&seq));
        let size = len.min(m.capacity as usize);
        let fl = &mut self.flows[f];
        let want = fl.model.isend(tag, len as u64);
        let ours = group.map(|(g, first)| Placed {
            recv: fl.model_ids[g],
            index: seq - first,
            size: size as u64,
        });
        self.note(|| format!("comm {f}: send {j} (tag {tag}) matched receive {seq}"));
        if ours.is_none() || ours != want {
            self.violate(format!(
                "comm {f}: send {j} (tag {tag}, {len} B) went into receive {seq} ({ours:?}); NCCL's IB transport puts it at {want:?}"
            ));
        }
        self.cut += u64::from(size < len);
        let fl = &mut self.flows[f];
        if let Some(slot) = fl.filled.get_mut(seq) {
            *slot = Some((j, size));
        }
        fl.send_size[j] = Some(size);
    }

    fn harvest(&mut self, f: usize) {
        let now = self.now;
        for side in 0..2 {
            let (node, peer) = if side == 0 {
                (self.flows[f].from, self.flows[f].to)
            } else {
                (self.flows[f].to, self.flows[f].from)
            };
            if !self.alive(node) {
                continue;
            }
            if side == 0 {
                self.overdue_sends(f);
            }
            let list = if side == 0 {
                std::mem::take(&mut self.flows[f].sends)
            } else {
                std::mem::take(&mut self.flows[f].recvs)
            };
            let mut keep = VecDeque::new();
            for p in list {
                let what = if side == 0 { "send" } else { "receive" };
                let status = p.req.status();
                if !matches!(status, Ok(Status::Pending)) {
                    // As `plugin::test`: a finished request frees its slot.
                    p.req.comm.release_slot();
                }
                match status {
                    Ok(Status::Pending) => {
                        let since = p.at.max(self.last_fault);
                        if now > since + HANG_BOUND {
                            let other = if side == 0 {
                                &self.flows[f].recv
                            } else {
                                &self.flows[f].send
                            };
                            let peer = match (self.alive(peer), other.failure()) {
                                (false, _) => "its peer is dead".to_string(),
                                (true, Some(e)) => format!("its peer comm failed: {e}"),
                                (true, None) => "its peer comm is alive".to_string(),
                            };
                            self.violate(format!(
                                "comm {f}: {what} {} hangs ({peer}): posted at {} ms, last fault at {} ms",
                                p.id,
                                p.at.as_millis(),
                                self.last_fault.as_millis()
                            ));
                            // Reported once; forget it so the run can end.
                            self.flows[f].failed.get_or_insert(now);
                            continue;
                        }
                        keep.push_back(p);
                    }
                    Ok(Status::Done(n)) if side == 0 => {
                        self.note(|| format!("comm {f}: send {} done ({n} B)", p.id));
                        let want = self.flows[f].send_size[p.id];
                        if want != Some(n as usize) {
                            self.violate(format!(
                                "comm {f}: send {} reports {n} B, its receive took {want:?}",
                                p.id
                            ));
                        }
                        self.flows[f].sent_ok[p.id] = true;
                    }
                    Ok(Status::Done(_)) => self.received(f, &p),
                    Err(e) => {
                        self.note(|| format!("comm {f}: {what} {} failed: {e}", p.id));
                        if side == 1 && p.mems.len() > 1 {
                            let first = self.group_first(f, p.id);
                            let bufs = first..first + p.mems.len();
                            self.flows[f].group_failed[bufs].fill(true);
                        }
                        let fl = &mut self.flows[f];
                        if fl.failed.is_none() {
                            fl.failed = Some(now);
                            if !fl.may_fail {
                                self.violate(format!(
                                    "comm {f}: {what} {} failed ({e}) although an eligible pair stayed healthy and the peer lived",
                                    p.id
                                ));
                            }
                        }
                    }
                }
            }
            if side == 0 {
                self.flows[f].sends = keep;
            } else {
                self.flows[f].recvs = keep;
            }
        }
        // A comm can die with nothing posted: it fails the requests that come later.
        for side in 0..2 {
            let fl = &self.flows[f];
            let (node, comm) = if side == 0 {
                (fl.from, &fl.send)
            } else {
                (fl.to, &fl.recv)
            };
            if fl.failed.is_some() || !self.alive(node) {
                continue;
            }
            if let Some(e) = comm.failure() {
                let may_fail = fl.may_fail;
                self.flows[f].failed = Some(now);
                let what = if side == 0 { "send" } else { "receive" };
                self.note(|| format!("comm {f}: {what} comm failed: {e}"));
                if !may_fail {
                    self.violate(format!(
                        "comm {f}: {what} comm failed ({e}) although an eligible pair stayed healthy and the peer lived"
                    ));
                }
            }
        }
        let (nic, spread) = (self.flows[f].send.nic(), self.flows[f].send.spread());
        let fl = &mut self.flows[f];
        if (nic, spread) != (fl.nic_seen, fl.spread_seen) {
            fl.nic_seen = nic;
            fl.spread_seen = spread;
            fl.max_spread = fl.max_spread.max(spread);
            fl.left_home = true;
            self.note(|| format!("comm {f}: sender now on NIC {nic}, over {spread} pair(s)"));
            if let Some(Some(d)) = self.nodes.get(self.s.comms[f].from) {
                let stripes = d.stripes_per_nic();
                self.placements.push(Placement {
                    comm: f,
                    spread,
                    stripes,
                });
            }
        }
    }

    /// Sends of comm `f` that `isend` has answered "not now" for longer than a request
    /// may hang: they never found their receive.
    fn overdue_sends(&mut self, f: usize) {
        let now = self.now;
        let fl = &self.flows[f];
        let stuck = (fl.waiting.iter())
            .find(|&&(_, since, _)| now > since.max(self.last_fault) + HANG_BOUND)
            .map(|&(j, since, _)| (j, since));
        if let Some((j, since)) = stuck {
            let posted = self.flows[f].next_group;
            self.violate(format!(
                "comm {f}: send {j} found no receive: tried since {} ms, {posted} group(s) of receives posted",
                since.as_millis()
            ));
            let fl = &mut self.flows[f];
            fl.failed.get_or_insert(now);
            fl.waiting.clear();
        }
    }

    /// A grouped receive of comm `f` finished: each buffer holds the bytes of the send
    /// NCCL's IB transport put there, with its size, and nothing after them.
    fn received(&mut self, f: usize, p: &Posted) {
        let first = self.group_first(f, p.id);
        let sizes: Vec<u64> = p.req.sizes().collect();
        self.grouped += u64::from(sizes.len() > 1);
        for (i, (mem, &n)) in p.mems.iter().zip(&sizes).enumerate() {
            let k = first + i;
            self.note(|| format!("comm {f}: receive {k} done ({n} B)"));
            let Some((j, size)) = self.flows[f].filled[k] else {
                self.violate(format!(
                    "comm {f}: receive {k} finished, but no send was matched to it"
                ));
                continue;
            };
            if n != size as u64 {
                self.violate(format!(
                    "comm {f}: receive {k} reports {n} B, send {j} moved {size}"
                ));
            }
            let len = self.s.comms[f].sizes[self.s.comms[f].matching.order[j]];
            let want = &message(f, j, len)[..size];
            let got = mem.bytes();
            if got[..size] != want[..] {
                let at = got.iter().zip(want).position(|(a, b)| a != b);
                self.violate(format!(
                    "comm {f}: receive {k} holds wrong bytes (first at {at:?}): send {j} lost, doubled or out of order"
                ));
            }
            if got[size..].iter().any(|&b| b != 0xEE) {
                self.violate(format!("comm {f}: receive {k} wrote past the message"));
            }
            self.flows[f].recv_ok[k] = true;
        }
    }

    /// Whether NCCL's side has nothing left to wait for.
    fn settled(&self) -> bool {
        self.flows.iter().enumerate().all(|(f, fl)| {
            let ended = !self.alive(fl.from) || !self.alive(fl.to);
            let plan = &self.s.comms[f];
            let all_posted = (fl.next_send >= plan.sizes.len()
                && fl.waiting.is_empty()
                && fl.next_group >= plan.matching.groups.len())
                || fl.failed.is_some()
                || ended;
            let live_pending = |side: usize, q: &VecDeque<Posted>| {
                let node = if side == 0 { fl.from } else { fl.to };
                self.alive(node) && !q.is_empty()
            };
            all_posted && !live_pending(0, &fl.sends) && !live_pending(1, &fl.recvs)
        })
    }

    fn home(&self) -> bool {
        self.flows
            .iter()
            .enumerate()
            .all(|(f, fl)| fl.failed.is_some() || self.at_home(f))
    }

    /// Comm `f` runs on its original NIC alone, on one pair.
    fn at_home(&self, f: usize) -> bool {
        let send = &self.flows[f].send;
        send.nic() == self.s.comms[f].nic && send.spread() == 1
    }

    fn run(&mut self) {
        if let Err(e) = self.connect() {
            self.violate(format!("setup: {e}"));
            return;
        }
        self.start = self.now;
        let healed = check::healed_at(&self.s).map(|t| self.start + t);
        let last = self
            .fault_time(self.s.faults.len().saturating_sub(1))
            .unwrap_or(self.start);
        let end = last + HANG_BOUND.max(check::failback_bound()) + Duration::from_secs(1);
        let mut same = 0u32;
        loop {
            // The wire first, so that what the faults and the reactors do is stamped now.
            self.advance();
            self.apply_faults();
            self.turn();
            let post = self.drive_requests();
            let faults_done = self.next_fault >= self.s.faults.len();
            if faults_done && self.settled() {
                match healed {
                    Some(h) if !self.home() => {
                        if self.now > h + check::failback_bound() {
                            for (f, fl) in self.flows.iter().enumerate() {
                                if fl.failed.is_none() && !self.at_home(f) {
                                    let msg = format!(
                                        "comm {f}: still on NIC {} (over {} pair(s)) {} ms after everything healed, not back on NIC {} alone",
                                        fl.send.nic(),
                                        fl.send.spread(),
                                        (self.now - h).as_millis(),
                                        self.s.comms[f].nic
                                    );
                                    self.violations.push(msg);
                                }
                            }
                            break;
                        }
                    }
                    _ => break,
                }
            }
            if self.now > end {
                self.violate("the run did not settle".into());
                break;
            }
            let next = self.next_time(
                [post, self.fault_time(self.next_fault)]
                    .into_iter()
                    .flatten()
                    .min(),
            );
            if next <= self.now {
                same += 1;
                if same > 64 {
                    // A timer that stays due after its turn would spin the reactor thread.
                    if !self.spun {
                        self.spun = true;
                        self.violate("a reactor timer stays due after 64 turns at one instant: its thread would spin".into());
                    }
                    self.now += Duration::from_millis(1);
                    same = 0;
                }
            } else {
                same = 0;
                self.now = next;
            }
        }
        // NCCL closes its comms; each reactor confirms in its next turn.
        let mut closes = Vec::new();
        for fl in &self.flows {
            for (node, comm) in [(fl.from, &fl.send), (fl.to, &fl.recv)] {
                if let Some(d) = &self.nodes[node] {
                    let done = Arc::new(Done::default());
                    d.queue().push(Command::CloseComm {
                        comm: comm.clone(),
                        done: done.signaller(),
                    });
                    closes.push(done);
                }
            }
        }
        self.turn();
        if closes.iter().any(|d| !d.wait(Duration::ZERO)) {
            self.violations
                .push("a reactor did not confirm a close in its next turn".into());
        }
        // NCCL holds nothing pending, so neither may a reactor.
        for (n, d) in self.nodes.iter().enumerate() {
            if d.as_ref().is_some_and(|d| d.busy()) && self.settled() {
                self.violations.push(format!(
                    "node {n}: the reactor still holds a request NCCL saw finish"
                ));
            }
        }
        // At the end: every send the receiver acknowledged was received.
        for (f, fl) in self.flows.iter().enumerate() {
            if !self.alive(fl.to) {
                continue;
            }
            for (k, filled) in fl.filled.iter().enumerate() {
                if let Some((j, _)) = *filled {
                    if fl.sent_ok[j] && !fl.recv_ok[k] && !fl.group_failed[k] {
                        let msg =
                            format!("comm {f}: send {j} completed but its receive {k} never did");
                        self.violations.push(msg);
                    }
                }
            }
        }
    }
}

/// Runs seed `seed`; `trace` prints what happens as it happens.
pub(crate) fn run_seed(seed: u64, trace: bool) -> (Scenario, Report) {
    let s = Scenario::generate(seed);
    let r = run_scenario(&s, trace);
    (s, r)
}

/// Runs scenario `s` (a seed's, or one made by hand); `trace` prints what happens.
pub(crate) fn run_scenario(s: &Scenario, trace: bool) -> Report {
    let s = Arc::new(s.clone());
    let net = Arc::new(Mutex::new(Net::new(
        Wire::default(),
        &vec![s.nics; s.nodes],
    )));
    net.lock().trace = trace;
    let nodes: Vec<Option<Driven<SimFabric>>> = (0..s.nodes)
        .map(|n| {
            Driven::new(
                setup(&s, n),
                SimFabric::new(net.clone(), n, s.nics, s.reaping),
            )
            .map(Some)
            .expect("a simulated reactor starts")
        })
        .collect();
    let mut sim = Sim {
        state: check::clean(&s),
        s: s.clone(),
        net,
        base: Instant::now(),
        now: Duration::ZERO,
        start: Duration::ZERO,
        nodes,
        flows: Vec::new(),
        next_fault: 0,
        last_fault: Duration::ZERO,
        trace,
        violations: Vec::new(),
        mems: Vec::new(),
        spun: false,
        polled: None,
        stranded: false,
        placements: Vec::new(),
        not_now: 0,
        cut: 0,
        grouped: 0,
    };
    sim.run();
    // The reactors go first: they hold views of the lent memory.
    for d in sim.nodes.iter_mut() {
        if let Some(d) = d.take() {
            d.finish();
        }
    }
    sim.mems.clear();
    let (landed, dropped) = {
        let net = sim.net.lock();
        (net.landed, net.dropped)
    };
    let report = Report {
        landed,
        dropped,
        not_now: sim.not_now,
        cut: sim.cut,
        grouped: sim.grouped,
        virtual_time: sim.now,
        failed_comms: sim.flows.iter().filter(|f| f.failed.is_some()).count(),
        max_spread: sim.flows.iter().map(|f| f.max_spread).max().unwrap_or(1),
        left_home: sim.flows.iter().map(|f| f.left_home).collect(),
        failed: sim.flows.iter().map(|f| f.failed.is_some()).collect(),
        violations: std::mem::take(&mut sim.violations),
        placements: std::mem::take(&mut sim.placements),
    };
    report
}

/// A seed that broke something: its schedule and what broke.
pub(crate) struct Failure {
    pub seed: u64,
    pub schedule: String,
    pub broke: Vec<String>,
}

/// Runs `seeds` with the reactors' logs silenced; returns the seeds that broke an
/// invariant or panicked.
fn run_seeds(seeds: impl Iterator<Item = u64>) -> Vec<Failure> {
    let mut failures = Vec::new();
    tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
        for seed in seeds {
            let broke = match std::panic::catch_unwind(|| run_seed(seed, false)) {
                Ok((_, r)) => r.violations,
                Err(p) => vec![format!("panicked: {}", crate::handoff::panic_message(&*p))],
            };
            if !broke.is_empty() {
                failures.push(Failure {
                    seed,
                    schedule: Scenario::generate(seed).to_string(),
                    broke,
                });
            }
        }
    });
    failures
}

#[cfg(test)]
mod tests;
