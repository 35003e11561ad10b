//! All-to-all: several `fault-peer` senders in node A, each with comms to every one of
//! several `fault-peer` receivers in node B, every pair connecting at the same moment, as
//! a job's ranks do when it starts; and what a mesh must show to have set up cleanly.

use std::time::Duration;

use railover_testkit::fault_line::{Command, Event, Handle};
use railover_testkit::testbed::proc::Proc;
use railover_testkit::testbed::{unix_ms, Side, Testbed};

use super::flow::{assert_ran_to_end, events, is, listening_or_failed, spawn, FlowOpts, Report};

/// Log lines that mean a listener turned a connection away, or a connect was retried or
/// failed because of it: none may appear while a job sets up.
pub const TURNED_AWAY: [&str; 3] = [
    "turned away an incoming connection",
    "before it authenticated; trying again",
    "connect failed",
];

/// How a mesh is run.
#[derive(Debug, Clone)]
pub struct MeshOpts {
    pub senders: usize,
    pub receivers: usize,
    /// Comms between each sender and each receiver; comm c of a pair is on device
    /// c mod rails when this is a multiple of the rails.
    pub per_pair: usize,
    /// Everything else, for every process (each receiver's `comms` and `first_comm` are
    /// the mesh's).
    pub flow: FlowOpts,
}

/// Running senders and receivers, connected.
#[derive(Debug)]
pub struct Mesh {
    pub recvs: Vec<Proc>,
    pub sends: Vec<Proc>,
    /// Unix-epoch ms just before the first sender was told `go`.
    pub go: u128,
    /// Comms on each rail, over the whole mesh (from the receivers' handles).
    pub per_rail: Vec<usize>,
    pub opts: MeshOpts,
}

/// How long one process took to set up: from `go` to its `connected` line, in ms.
#[derive(Debug, Clone)]
pub struct SetupTime {
    pub name: String,
    pub ms: u128,
}

/// Waits for `p`'s line that `ok` accepts; panics with a digest of its log on a setup
/// failure or after `t`.
fn expect(p: &Proc, t: Duration, what: &str, ok: fn(&Event) -> bool) -> Event {
    let line = p.wait_line(t, |l| {
        is(l, |e| ok(e) || matches!(e, Event::SetupFailed { .. }))
    });
    match line.as_deref().and_then(Event::parse) {
        Some(e) if ok(&e) => e,
        _ => {
            let digest: Vec<String> = log_digest(&p.stderr_tail(usize::MAX))
                .iter()
                .take(12)
                .map(|(n, kind)| format!("{n:>6} x {kind}"))
                .collect();
            panic!(
                "{} did not {what}: {line:?}\nits log:\n{}",
                p.name,
                digest.join("\n")
            )
        }
    }
}

impl Mesh {
    /// Starts every receiver, then every sender with its handles, then tells the
    /// senders `go` one right after the other and waits until every process has
    /// connected; panics (with a digest of the process's log) if one does not.
    pub fn start(tb: &Testbed, opts: MeshOpts) -> (Mesh, Vec<SetupTime>) {
        let t = Duration::from_secs(30);
        let per_recv = opts.senders * opts.per_pair;
        let recvs: Vec<Proc> = (0..opts.receivers)
            .map(|r| {
                let o = FlowOpts {
                    comms: Some(per_recv),
                    first_comm: u32::try_from(r * per_recv).expect("comm numbers fit 32 bits"),
                    ..opts.flow.clone()
                };
                let mut p = spawn(tb, Side::B, "recv", &o);
                p.name = format!("recv{r}");
                p
            })
            .collect();
        let want: Vec<String> = (0..tb.rails()).map(Testbed::ifname).collect();
        // Receiver r's comm i is for sender i / per_pair.
        let mut handles: Vec<Vec<Handle>> = vec![Vec::new(); opts.senders];
        let mut per_rail = vec![0; tb.rails()];
        for p in &recvs {
            let listening = p.wait_line(t, listening_or_failed);
            assert!(
                listening
                    .as_deref()
                    .is_some_and(|l| is(l, |e| matches!(e, Event::Listening { .. }))),
                "{} did not listen: {listening:?}\n{}",
                p.name,
                p.stderr_tail(20)
            );
            let mut mine = 0;
            for e in events(p) {
                match e {
                    Event::Devices { names, .. } => {
                        assert_eq!(
                            names, want,
                            "the plugin's devices are not the testbed's rails"
                        )
                    }
                    Event::Handle(h) => {
                        per_rail[h.dev as usize] += 1;
                        handles[mine / opts.per_pair].push(h);
                        mine += 1;
                    }
                    _ => {}
                }
            }
            assert_eq!(mine, per_recv, "{} printed {mine} handles", p.name);
        }
        let mut sends: Vec<Proc> = (0..opts.senders)
            .map(|s| {
                let mut p = spawn(tb, Side::A, "send", &opts.flow);
                p.name = format!("send{s}");
                p
            })
            .collect();
        for (p, hs) in sends.iter_mut().zip(handles) {
            for h in hs {
                p.send(&Command::Handle(h).to_line());
            }
        }
        let go = unix_ms();
        for p in &mut sends {
            p.send(&Command::Go.to_line());
        }
        let mut times = Vec::new();
        for p in recvs.iter().chain(&sends) {
            let Event::Connected { t: at, .. } =
                expect(p, t, "connect", |e| matches!(e, Event::Connected { .. }))
            else {
                unreachable!("expect returns what it was asked for")
            };
            times.push(SetupTime {
                name: p.name.clone(),
                ms: u128::from(at).saturating_sub(go),
            });
        }
        let mesh = Mesh {
            recvs,
            sends,
            go,
            per_rail,
            opts,
        };
        (mesh, times)
    }

    /// Comms each receiver serves.
    pub fn per_receiver(&self) -> usize {
        self.opts.senders * self.opts.per_pair
    }

    /// Comms each sender opens.
    pub fn per_sender(&self) -> usize {
        self.opts.receivers * self.opts.per_pair
    }

    /// Waits for every process to finish by itself, as [`super::flow::Flow::finish`]
    /// does for a pair: every summary first, then the receivers close, then the
    /// senders. A process that hung has no exit in its report.
    pub fn finish(mut self) -> (Vec<Report>, Vec<Report>) {
        let f = &self.opts.flow;
        let bound = Duration::from_secs_f64(f.seconds + 3.0 * f.grace + 10.0);
        let summary = |l: &str| is(l, |e| matches!(e, Event::Summary(_)));
        for p in self.recvs.iter().chain(&self.sends) {
            p.wait_line(bound, summary);
        }
        let done = |ps: &mut Vec<Proc>| -> Vec<Report> {
            for p in ps.iter_mut() {
                p.send(&Command::Close.to_line());
                p.close_stdin();
            }
            ps.iter_mut()
                .map(|p| {
                    let st = p.wait_exit(bound);
                    Report::parse(p, st.map(|s| s.code().unwrap_or(-1)))
                })
                .collect()
        };
        let recvs = done(&mut self.recvs);
        let sends = done(&mut self.sends);
        (recvs, sends)
    }
}

/// Every process exited 0 by itself with every comm ended, no request error and no
/// damaged data; each receiver verified `messages` messages on each of its comms (its
/// END came after exactly that many), and each sender completed as many.
pub fn assert_every_comm_delivered(mesh_opts: &MeshOpts, recvs: &[Report], sends: &[Report]) {
    let messages = mesh_opts
        .flow
        .messages
        .expect("a mesh sends a fixed number") as u64;
    let per_recv = mesh_opts.senders * mesh_opts.per_pair;
    let per_send = mesh_opts.receivers * mesh_opts.per_pair;
    for (r, comms) in recvs
        .iter()
        .map(|r| (r, per_recv))
        .chain(sends.iter().map(|s| (s, per_send)))
    {
        assert_ran_to_end(r, comms, None);
        assert_eq!(r.summary.comms as usize, comms, "{}", r.brief());
        assert_eq!(
            r.summary.msgs,
            comms as u64 * messages,
            "{} messages, want {messages} on each of {comms} comms\n{}",
            r.summary.msgs,
            r.brief()
        );
    }
    for r in recvs {
        assert_eq!(r.ends.len(), per_recv, "{}", r.brief());
        if let Some(&(comm, msgs)) = r.ends.iter().find(|e| e.1 != messages) {
            panic!(
                "{}: comm {comm} ended after {msgs} messages, want {messages}",
                r.role
            );
        }
    }
}

/// No listener turned a connection away (refused it, let its handshake time out or
/// dropped it to keep its caps), and no connect had to be retried or failed.
pub fn assert_none_turned_away(reports: &[Report]) {
    for r in reports {
        let s = &r.summary;
        assert_eq!(
            (
                s.rejected_connections,
                s.refused_handshakes,
                s.evicted_handshakes
            ),
            (0, 0, 0),
            "{}: connections turned away (rejected, refused, evicted)\n{}",
            r.role,
            r.brief()
        );
        let said: Vec<&str> = r
            .stderr
            .lines()
            .filter(|l| TURNED_AWAY.iter().any(|w| l.contains(w)))
            .take(5)
            .collect();
        assert!(said.is_empty(), "{}: {said:#?}", r.role);
    }
}

/// The kinds of line in a plugin's log, numbers masked, each with how often it occurred,
/// the most frequent first.
pub fn log_digest(log: &str) -> Vec<(usize, String)> {
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for line in log.lines() {
        let mut kind = String::new();
        let mut digits = false;
        for c in line.chars().take(200) {
            if !c.is_ascii_digit() {
                kind.push(c);
            } else if !digits {
                kind.push('N');
            }
            digits = c.is_ascii_digit();
        }
        *kinds.entry(kind).or_default() += 1;
    }
    let mut v: Vec<(usize, String)> = kinds.into_iter().map(|(k, n)| (n, k)).collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    v
}
