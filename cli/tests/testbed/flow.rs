//! A `fault-peer` receiver in node B and sender in node A streaming checksummed messages
//! through the plugin on every rail, and what their output lines say.

use std::time::Duration;

use railover_testkit::fault_line::{Command, Event, Summary};
use railover_testkit::kept::{self, Interval};
use railover_testkit::testbed::proc::Proc;
use railover_testkit::testbed::{Side, Testbed};

pub const EXE: &str = env!("CARGO_BIN_EXE_railover");

/// How a flow is run.
#[derive(Debug, Clone)]
pub struct FlowOpts {
    pub per_dev: usize,
    /// Comms in all, over the rails in turn (instead of `per_dev`).
    pub comms: Option<usize>,
    /// The sender keeps every comm within this many messages of the slowest.
    pub lockstep: Option<usize>,
    /// Interval of the `tick` lines.
    pub tick_ms: u64,
    /// Only these rails get comms (`None`: every rail).
    pub devs: Option<Vec<usize>>,
    /// The receiver numbers its comms from this one (0: from 0, and no option passed).
    pub first_comm: u32,
    /// The sender sends this many messages per comm, then END (`None`: until `seconds`).
    pub messages: Option<usize>,
    pub size: usize,
    pub depth: usize,
    /// The sender sends for this long.
    pub seconds: f64,
    /// After that, how long the endpoints wait for what is in flight.
    pub grace: f64,
    /// Extra environment for both plugin processes.
    pub env: Vec<(&'static str, String)>,
}

impl Default for FlowOpts {
    fn default() -> Self {
        FlowOpts {
            per_dev: 2,
            comms: None,
            lockstep: None,
            tick_ms: 100,
            devs: None,
            first_comm: 0,
            messages: None,
            size: 512 << 10,
            depth: 8,
            seconds: 8.0,
            grace: 5.0,
            env: Vec::new(),
        }
    }
}

impl FlowOpts {
    fn args(&self) -> Vec<String> {
        [
            match self.comms {
                Some(c) => ("--comms", c.to_string()),
                None => ("--per-dev", self.per_dev.to_string()),
            },
            ("--tick-ms", self.tick_ms.to_string()),
            ("--size", self.size.to_string()),
            ("--depth", self.depth.to_string()),
            ("--seconds", self.seconds.to_string()),
            ("--grace", self.grace.to_string()),
        ]
        .into_iter()
        .chain(self.devs.as_ref().map(|d| {
            let list: Vec<String> = d.iter().map(usize::to_string).collect();
            ("--devs", list.join(","))
        }))
        .chain(self.lockstep.map(|k| ("--lockstep", k.to_string())))
        .chain((self.first_comm > 0).then(|| ("--first-comm", self.first_comm.to_string())))
        .chain(self.messages.map(|n| ("--messages", n.to_string())))
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

/// A running receiver/sender pair.
#[derive(Debug)]
pub struct Flow {
    pub recv: Proc,
    pub send: Proc,
    /// Device (rail) of each comm.
    pub dev_of: Vec<usize>,
    pub opts: FlowOpts,
}

/// A `fault-peer` in `role` (`recv` or `send`) inside `side`'s namespace.
pub fn spawn(tb: &Testbed, side: Side, role: &str, o: &FlowOpts) -> Proc {
    let mut c = tb.command(side, EXE);
    c.arg("fault-peer").arg(role).args(o.args());
    if role == "recv" {
        // It keeps its comms until told: the sender's last acknowledgements arrive.
        c.arg("--linger");
    }
    // Only the testbed's interfaces (rv0, rv1, ...) become the plugin's NICs.
    c.env("RAILOVER_IFNAME", "rv");
    c.envs(o.env.iter().map(|(k, v)| (k, v)));
    Proc::spawn(c, role).expect("spawn fault-peer")
}

/// Whether `line` is an event that `pred` accepts.
pub fn is(line: &str, pred: impl Fn(&Event) -> bool) -> bool {
    Event::parse(line).is_some_and(|e| pred(&e))
}

/// The events among `p`'s lines.
pub fn events(p: &Proc) -> Vec<Event> {
    p.lines().iter().filter_map(|l| Event::parse(l)).collect()
}

/// The receiver listens, or its setup failed.
pub fn listening_or_failed(l: &str) -> bool {
    is(l, |e| {
        matches!(e, Event::Listening { .. } | Event::SetupFailed { .. })
    })
}

impl Flow {
    /// Starts both ends and connects every comm; panics (with the peers' stderr) if
    /// that does not happen within 30 s.
    pub fn start(tb: &Testbed, opts: FlowOpts) -> Flow {
        Flow::start_after(tb, opts, || {})
    }

    /// As [`Flow::start`], with `between` run once the receiver listens (its handles
    /// made) and before the sender starts and connects: a fault there is one that NCCL's
    /// lazy connects, and communicators created mid-job, meet.
    pub fn start_after(tb: &Testbed, opts: FlowOpts, between: impl FnOnce()) -> Flow {
        let t = Duration::from_secs(30);
        let recv = spawn(tb, Side::B, "recv", &opts);
        let listening = recv.wait_line(t, listening_or_failed);
        assert!(
            listening
                .as_deref()
                .is_some_and(|l| is(l, |e| matches!(e, Event::Listening { .. }))),
            "receiver did not listen: {listening:?}\n{}",
            recv.stderr_tail(20)
        );
        let events = events(&recv);
        let names = events.iter().find_map(|e| match e {
            Event::Devices { names, .. } => Some(names.clone()),
            _ => None,
        });
        let want: Vec<String> = (0..tb.rails()).map(Testbed::ifname).collect();
        assert_eq!(
            names,
            Some(want),
            "the plugin's devices are not the testbed's rails"
        );
        let handles: Vec<_> = events
            .into_iter()
            .filter_map(|e| match e {
                Event::Handle(h) => Some(h),
                _ => None,
            })
            .collect();
        let dev_of = handles.iter().map(|h| h.dev as usize).collect();
        between();
        let mut send = spawn(tb, Side::A, "send", &opts);
        for h in handles {
            send.send(&Command::Handle(h).to_line());
        }
        send.send(&Command::Go.to_line());
        for p in [&recv, &send] {
            let c = p.wait_line(t, |l| {
                is(l, |e| {
                    matches!(e, Event::Connected { .. } | Event::SetupFailed { .. })
                })
            });
            assert!(
                c.as_deref()
                    .is_some_and(|l| is(l, |e| matches!(e, Event::Connected { .. }))),
                "{} did not connect: {c:?}\n{}",
                p.name,
                p.stderr_tail(20)
            );
        }
        Flow {
            recv,
            send,
            dev_of,
            opts,
        }
    }

    pub fn comms_on(&self, rails: &[usize]) -> Vec<usize> {
        (0..self.dev_of.len())
            .filter(|&c| rails.contains(&self.dev_of[c]))
            .collect()
    }

    /// Waits until the receiver has printed `n` ticks (warm-up), bounded.
    pub fn wait_ticks(&self, n: usize) {
        let ok = self.recv.wait_count(Duration::from_secs(30), n, is_tick);
        assert!(
            ok,
            "receiver stopped ticking\n{}",
            self.recv.stderr_tail(20)
        );
    }

    /// Waits for `k` more receiver ticks (about k × 100 ms of running traffic).
    pub fn wait_more_ticks(&self, k: usize) {
        let have = self.recv.lines().iter().filter(|l| is_tick(l)).count();
        self.wait_ticks(have + k);
    }

    /// Waits for both ends to finish by themselves (they must, within their own
    /// bounds); `None` for an end that hung.
    pub fn finish(mut self) -> (Report, Report) {
        let bound = Duration::from_secs_f64(self.opts.seconds + 3.0 * self.opts.grace + 10.0);
        // Both ends say how it went before either closes, as a job's ranks finish their
        // last collective before any of them tears down.
        let summary = |l: &str| is(l, |e| matches!(e, Event::Summary(_)));
        for p in [&self.recv, &self.send] {
            p.wait_line(bound, summary);
        }
        self.recv.send(&Command::Close.to_line());
        self.recv.close_stdin();
        let rs = self.recv.wait_exit(bound);
        self.send.send(&Command::Close.to_line());
        self.send.close_stdin();
        let ss = self.send.wait_exit(bound);
        (
            Report::parse(&self.recv, rs.map(|s| s.code().unwrap_or(-1))),
            Report::parse(&self.send, ss.map(|s| s.code().unwrap_or(-1))),
        )
    }
}

/// Whether `line` is a tick.
pub fn is_tick(line: &str) -> bool {
    is(line, |e| matches!(e, Event::Tick { .. }))
}

/// One tick: wall-clock ms and bytes per comm since the previous tick.
#[derive(Debug, Clone)]
pub struct Tick {
    pub t: u128,
    pub bytes: Vec<u64>,
    /// Per comm, its longest wait between completions in the tick (ms).
    pub gaps: Vec<u32>,
}

/// One request error as the endpoint printed it.
#[derive(Debug, Clone)]
pub struct ReqError {
    pub t: u128,
    pub comm: usize,
    pub code: i32,
}

/// What one endpoint printed, parsed.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub role: String,
    /// `None`: the process had to be killed after its bound (it hung).
    pub exit: Option<i32>,
    pub ticks: Vec<Tick>,
    pub errors: Vec<ReqError>,
    /// Damaged-data events, as printed.
    pub bad: Vec<Event>,
    /// All zero when the endpoint printed none.
    pub summary: Summary,
    pub stderr_tail: String,
    /// Everything the endpoint wrote to stderr (the plugin's log).
    pub stderr: String,
    /// Running lanes per local NIC over time (`lanes` lines, printed by the sender).
    pub lanes: Vec<(u128, Vec<usize>)>,
    /// The ticks as intervals, for [`kept`].
    pub intervals: Vec<Interval>,
    /// Receiver: (comm, data messages before its END).
    pub ends: Vec<(usize, u64)>,
}

impl Report {
    pub fn parse(p: &Proc, exit: Option<i32>) -> Report {
        let mut r = Report {
            role: p.name.clone(),
            exit,
            stderr_tail: p.stderr_tail(40),
            stderr: p.stderr_tail(usize::MAX),
            ..Report::default()
        };
        let events = events(p);
        r.intervals = kept::intervals(&events);
        for e in events {
            match e {
                Event::Tick { t, bytes, gaps, .. } => r.ticks.push(Tick {
                    t: t.into(),
                    bytes,
                    gaps,
                }),
                Event::Error { t, comm, code, .. } => r.errors.push(ReqError {
                    t: t.into(),
                    comm,
                    code,
                }),
                Event::Lanes { t, counts } => r
                    .lanes
                    .push((t.into(), counts.into_iter().map(|c| c as usize).collect())),
                Event::Bad { .. } => r.bad.push(e),
                Event::End { comm, msgs, .. } => r.ends.push((comm, msgs)),
                Event::Summary(s) => r.summary = s,
                _ => {}
            }
        }
        r
    }

    /// Bytes/s the given comms moved in ticks stamped within (from, to].
    pub fn rate(&self, comms: &[usize], from: u128, to: u128) -> f64 {
        let bytes: u64 = self
            .ticks
            .iter()
            .filter(|t| t.t > from && t.t <= to)
            .map(|t| {
                comms
                    .iter()
                    .map(|&c| t.bytes.get(c).copied().unwrap_or(0))
                    .sum::<u64>()
            })
            .sum();
        bytes as f64 / ((to - from) as f64 / 1000.0)
    }

    /// How long after `fault` the slowest of `comms` was flowing again, in ms: per comm,
    /// the first tick after the fault with bytes from which the comm also delivered in
    /// each of the next three 500-ms windows. One empty tick is not an outage (a comm
    /// sharing a link completes a message only every tick or two), and a message now
    /// and then on a browned-out link is not flowing. `None` when some comm never
    /// flowed again while the flow was watched.
    pub fn resume_after(&self, comms: &[usize], fault: u128) -> Option<u128> {
        const WINDOW: u128 = 500;
        const WINDOWS: u128 = 3;
        let after: Vec<&Tick> = self.ticks.iter().filter(|t| t.t > fault).collect();
        let mut worst = 0;
        for &c in comms {
            let b = |t: &Tick| t.bytes.get(c).copied().unwrap_or(0);
            let flowing = |i: usize| {
                let start = after[i].t;
                b(after[i]) > 0
                    && (0..WINDOWS).all(|w| {
                        let (lo, hi) = (start + w * WINDOW, start + (w + 1) * WINDOW);
                        after[i..].iter().any(|t| t.t > lo && t.t <= hi && b(t) > 0)
                    })
            };
            let i = (0..after.len()).find(|&i| flowing(i))?;
            worst = worst.max(after[i].t - fault);
        }
        Some(worst)
    }

    /// One line for failure messages.
    pub fn brief(&self) -> String {
        format!(
            "{}: exit={:?} summary={:?} bad={:?} errors={} first errors={:?}\nstderr:\n{}",
            self.role,
            self.exit,
            self.summary,
            self.bad.iter().take(5).collect::<Vec<_>>(),
            self.errors.len(),
            self.errors.iter().take(5).collect::<Vec<_>>(),
            self.stderr_tail
        )
    }
}

/// P4: nothing lost, duplicated, reordered or corrupted, and every comm ran to its END
/// with no request error.
pub fn assert_delivered_exactly_once(recv: &Report, send: &Report, comms: usize) {
    assert_ran_to_end(recv, comms, Some(send));
    assert_ran_to_end(send, comms, Some(recv));
    assert_eq!(
        recv.summary.msgs, send.summary.msgs,
        "receiver verified a different number of messages than the sender completed"
    );
}

/// One end ran each of its `comms` to END: it did not hang, saw no damaged data and no
/// request error, and exited 0. `other`: the other end, shown when a comm did not finish.
pub fn assert_ran_to_end(r: &Report, comms: usize, other: Option<&Report>) {
    assert!(r.exit.is_some(), "{} hung\n{}", r.role, r.brief());
    assert!(
        r.bad.is_empty(),
        "{} saw damaged data\n{}",
        r.role,
        r.brief()
    );
    assert_eq!(r.summary.req_errors, 0, "request errors\n{}", r.brief());
    assert_eq!(
        r.summary.ended as usize,
        comms,
        "not every comm finished\n{}{}",
        r.brief(),
        other.map_or(String::new(), |o| format!(
            "\nthe other end:\n{}",
            o.brief()
        ))
    );
    assert_eq!(r.exit, Some(0), "{}", r.brief());
}

/// Whatever else happened, no byte was ever damaged.
pub fn assert_no_corruption(recv: &Report, send: &Report) {
    for r in [recv, send] {
        assert!(
            r.bad.is_empty(),
            "{} saw damaged data\n{}",
            r.role,
            r.brief()
        );
        assert_ne!(r.exit, Some(1), "{}", r.brief());
    }
}

/// Lanes per local NIC as the plugin had placed them at time `at` (the last `lanes`
/// line the sender printed by then: it reads the plugin's published route snapshot).
/// `None` when the plugin publishes no placement (before the failover engine).
pub fn lane_placement(r: &Report, at: u128) -> Option<Vec<usize>> {
    r.lanes
        .iter()
        .rev()
        .find(|(t, c)| *t <= at && c.iter().sum::<usize>() > 0)
        .map(|(_, c)| c.clone())
}

/// P3's balance rule: no surviving pair carries more than ⌈lanes/(N−1)⌉+1 lanes, where
/// N−1 is the number of surviving NICs. `placement` is lanes per NIC after the failure.
pub fn check_lane_balance(placement: &[usize], failed: &[usize]) -> Result<(), String> {
    let lanes: usize = placement.iter().sum();
    let survivors = placement.len() - failed.len();
    if survivors == 0 {
        return Err("no surviving NIC".into());
    }
    let limit = lanes.div_ceil(survivors) + 1;
    for (nic, &n) in placement.iter().enumerate() {
        if failed.contains(&nic) && n > 0 {
            return Err(format!("failed NIC {nic} still carries {n} lanes"));
        }
        if n > limit {
            return Err(format!(
                "NIC {nic} carries {n} lanes > {limit} ({placement:?})"
            ));
        }
    }
    Ok(())
}
