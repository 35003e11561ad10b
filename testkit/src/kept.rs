//! What a collective keeps across a failover, read from `fault-peer` ticks: rates in
//! steady windows before and after the cut, the slowest comm's rate (in lockstep, the
//! collective's), the kept ratio, and the time series around the cut. Plain arithmetic
//! over the lines, shared by `railover bench --failover` and the fault tier.
//!
//! NCCL splits a collective equally over its channels and a step ends when the slowest
//! is done, so what a job feels after a failover is the slowest comm's rate, not the sum
//! of the NIC counters.

use serde::Serialize;

use crate::fault_line::Event;

/// One tick of an endpoint: the interval (from, to] in Unix-epoch ms, and the bytes each
/// comm and each device moved in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    pub from: u64,
    pub to: u64,
    pub comms: Vec<u64>,
    pub devs: Vec<u64>,
}

/// The ticks among `events` as intervals: each runs from the previous tick (the first
/// from its own start, `t − el`).
pub fn intervals<'a>(events: impl IntoIterator<Item = &'a Event>) -> Vec<Interval> {
    let mut out: Vec<Interval> = Vec::new();
    for e in events {
        if let Event::Tick {
            t, el, bytes, devs, ..
        } = e
        {
            let from = out.last().map_or(t.saturating_sub(*el), |p| p.to);
            out.push(Interval {
                from: from.min(*t),
                to: *t,
                comms: bytes.clone(),
                devs: devs.clone(),
            });
        }
    }
    out
}

/// A span of wall-clock time, Unix-epoch ms: [from, to].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    pub from: u64,
    pub to: u64,
}

impl Window {
    pub fn ms(&self) -> u64 {
        self.to.saturating_sub(self.from)
    }
}

/// When a failover run did what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    /// Traffic started.
    pub start: u64,
    /// The link went down.
    pub cut: u64,
    /// The link came back (`None`: it stayed down).
    pub up: Option<u64>,
    /// Sending stopped.
    pub end: u64,
}

/// What is left out of the steady windows, ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exclude {
    /// After the start: connections ramping up.
    pub warmup: u64,
    /// After the cut: detection, migration and the moved lanes ramping up.
    pub settle: u64,
    /// After the link came back: the fail-back test (interval × probes) and the move.
    pub failback: u64,
    /// Before the end, and before the cut or the link coming back: a tick that
    /// straddles the change belongs to neither side.
    pub guard: u64,
}

/// The steady windows of a run: before the cut, after failover settled, and after
/// fail-back settled (`None` when the link stayed down or the run ended too soon).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Windows {
    pub before: Window,
    pub after: Window,
    pub back: Option<Window>,
}

/// Windows shorter than this are refused: a few ticks say nothing steady.
pub const MIN_WINDOW_MS: u64 = 1000;

/// Picks the steady windows of a run, or says which one is too short to measure.
pub fn windows(p: Phases, x: Exclude) -> Result<Windows, String> {
    let before = Window {
        from: p.start + x.warmup,
        to: p.cut.saturating_sub(x.guard),
    };
    let after_end = p.up.unwrap_or(p.end).min(p.end);
    let after = Window {
        from: p.cut + x.settle,
        to: after_end.saturating_sub(x.guard),
    };
    for (name, w) in [("before the cut", before), ("after failover", after)] {
        if w.to < w.from + MIN_WINDOW_MS {
            return Err(format!(
                "the steady window {name} is {} ms, under {MIN_WINDOW_MS} ms: run longer",
                w.to as i64 - w.from as i64
            ));
        }
    }
    let back =
        p.up.map(|up| Window {
            from: up + x.failback,
            to: p.end.saturating_sub(x.guard),
        })
        .filter(|w| w.to >= w.from + MIN_WINDOW_MS);
    Ok(Windows {
        before,
        after,
        back,
    })
}

/// Rates in one window, bytes/s.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rates {
    pub per_comm: Vec<f64>,
    /// The slowest comm's progress: how far every comm has got (the least cumulative
    /// count of any comm) advanced per second. In lockstep this is the collective's rate
    /// per comm. Unlike the least per-comm rate it does not count lockstep slack as
    /// slowness (a comm a few messages behind at the window's start that catches up).
    pub slowest: f64,
    /// The least per-comm rate: free-running, the slowest comm. (A comm that fell behind
    /// during a failover stays the least advanced while it runs faster than the others,
    /// so progress would measure it, not the slowest.)
    pub least: f64,
    pub aggregate: f64,
    /// Time the intervals used cover, ms (whole ticks inside the window only).
    pub covered_ms: u64,
}

/// Rates over the ticks that lie wholly within `w`; `None` when none does. `iv` is a
/// whole run in order: the cumulative counts start at its first tick.
pub fn rates(iv: &[Interval], w: Window) -> Option<Rates> {
    let lo = iv.iter().position(|i| i.from >= w.from)?;
    let hi = lo + iv[lo..].iter().take_while(|i| i.to <= w.to).count();
    let inside = &iv[lo..hi];
    let ms: u64 = inside.iter().map(|i| i.to - i.from).sum();
    if ms == 0 {
        return None;
    }
    let comms = iv.iter().map(|i| i.comms.len()).max().unwrap_or(0);
    let sum = |span: &[Interval], c: usize| -> u64 {
        span.iter()
            .map(|i| i.comms.get(c).copied().unwrap_or(0))
            .sum()
    };
    let moved: Vec<u64> = (0..comms).map(|c| sum(inside, c)).collect();
    let before: Vec<u64> = (0..comms).map(|c| sum(&iv[..lo], c)).collect();
    let least = |v: &mut dyn Iterator<Item = u64>| v.min().unwrap_or(0);
    let progress = least(&mut before.iter().zip(&moved).map(|(b, m)| b + m))
        - least(&mut before.iter().copied());
    let per_s = |b: u64| b as f64 * 1000.0 / ms as f64;
    Some(Rates {
        per_comm: moved.iter().map(|&b| per_s(b)).collect(),
        slowest: per_s(progress),
        least: per_s(moved.iter().copied().min().unwrap_or(0)),
        aggregate: per_s(moved.iter().sum()),
        covered_ms: ms,
    })
}

/// Before and after, and what was kept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Kept {
    pub before: Rates,
    pub after: Rates,
    /// after.slowest / before.slowest: what a collective keeps.
    pub slowest: f64,
    /// after.aggregate / before.aggregate: what the NIC counters keep.
    pub aggregate: f64,
}

/// The kept ratios between two windows; `None` when a window holds no whole tick or
/// nothing moved before. `lockstep`: the comms were coupled, so the slowest comm is the
/// least progress; free-running, it is the least per-comm rate.
pub fn kept(iv: &[Interval], before: Window, after: Window, lockstep: bool) -> Option<Kept> {
    let mut b = rates(iv, before)?;
    let mut a = rates(iv, after)?;
    if !lockstep {
        b.slowest = b.least;
        a.slowest = a.least;
    }
    if b.slowest <= 0.0 || b.aggregate <= 0.0 {
        return None;
    }
    Some(Kept {
        slowest: a.slowest / b.slowest,
        aggregate: a.aggregate / b.aggregate,
        before: b,
        after: a,
    })
}

/// The ideal a collective keeps after one of `n` equal NICs fails: (N−1)/N.
pub fn ideal(n: usize) -> f64 {
    (n as f64 - 1.0) / n as f64
}

/// One point of the comm series: seconds since the origin (the interval's end),
/// Mbit/s.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommPoint {
    pub t: f64,
    /// The slowest comm over the trailing smoothing window.
    pub slowest: f64,
    pub aggregate: f64,
}

/// The slowest comm and the aggregate over time, each point over the trailing `smooth`
/// intervals (a comm completes whole messages, so one tick alone is lumpy).
pub fn comm_series(iv: &[Interval], origin: u64, smooth: usize) -> Vec<CommPoint> {
    let smooth = smooth.max(1);
    (0..iv.len())
        .filter_map(|i| {
            let r = rates(
                iv,
                Window {
                    from: iv[(i + 1).saturating_sub(smooth)].from,
                    to: iv[i].to,
                },
            )?;
            Some(CommPoint {
                t: secs(iv[i].to, origin),
                slowest: r.slowest * 8.0 / 1e6,
                aggregate: r.aggregate * 8.0 / 1e6,
            })
        })
        .collect()
}

/// One point of the device series: seconds since the origin, Mbit/s per device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DevPoint {
    pub t: f64,
    pub mbit: Vec<f64>,
}

/// Each device's rate in each interval.
pub fn dev_series(iv: &[Interval], origin: u64) -> Vec<DevPoint> {
    iv.iter()
        .filter(|i| i.to > i.from)
        .map(|i| DevPoint {
            t: secs(i.to, origin),
            mbit: i
                .devs
                .iter()
                .map(|&b| b as f64 * 8.0 / 1e3 / (i.to - i.from) as f64)
                .collect(),
        })
        .collect()
}

fn secs(t: u64, origin: u64) -> f64 {
    (t as f64 - origin as f64) / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tick(t: u64, el: u64, bytes: &[u64]) -> Event {
        Event::Tick {
            t,
            el,
            bytes: bytes.to_vec(),
            devs: vec![],
            gaps: vec![],
        }
    }

    /// 250 ms ticks from 10 000 ms, comms moving `per_tick(t)` bytes each.
    fn run(until: u64, per_tick: impl Fn(u64) -> Vec<u64>) -> Vec<Interval> {
        let events: Vec<Event> = (1..)
            .map(|k| 10_000 + 250 * k)
            .take_while(|&t| t <= until)
            .map(|t| tick(t, t - 10_000, &per_tick(t)))
            .collect();
        intervals(&events)
    }

    #[test]
    fn intervals_chain_ticks_and_skip_other_lines() {
        let ev = [
            tick(1_250, 250, &[1]),
            Event::Lanes {
                t: 1_300,
                counts: vec![1],
            },
            tick(1_510, 510, &[2]),
        ];
        let iv = intervals(&ev);
        assert_eq!(iv.len(), 2);
        assert_eq!((iv[0].from, iv[0].to), (1_000, 1_250));
        assert_eq!((iv[1].from, iv[1].to), (1_250, 1_510));
        assert_eq!(iv[1].comms, vec![2]);
    }

    #[test]
    fn rates_use_whole_ticks_inside_the_window_only() {
        // 1000 B per 250 ms tick = 4000 B/s per comm.
        let iv = run(20_000, |_| vec![1000, 2000]);
        let r = rates(
            &iv,
            Window {
                from: 11_100,
                to: 12_100,
            },
        )
        .unwrap();
        // Ticks ending 11 500 … 12 000 lie wholly inside: 750 ms.
        assert_eq!(r.covered_ms, 750);
        assert_eq!(r.per_comm, vec![4000.0, 8000.0]);
        assert_eq!((r.slowest, r.aggregate), (4000.0, 12_000.0));
        assert_eq!(
            rates(
                &iv,
                Window {
                    from: 11_100,
                    to: 11_200
                }
            ),
            None
        );
    }

    #[test]
    fn lockstep_slack_is_not_slowness() {
        // Two comms in lockstep take turns leading by two messages.
        let iv = run(11_000, |t| {
            if (t / 250) % 2 == 0 {
                vec![3, 1]
            } else {
                vec![1, 3]
            }
        });
        // Ticks 2-4: comm 0 moves 3+1+3, comm 1 only 1+3+1, but it started 2 behind
        // (1 against 3) and both end 8 messages in: everyone advanced 7.
        let r = rates(
            &iv,
            Window {
                from: 10_250,
                to: 11_000,
            },
        )
        .unwrap();
        assert_eq!(r.per_comm[1] * 0.75, 5.0);
        assert_eq!(r.slowest * 0.75, 7.0);
    }

    #[test]
    fn kept_is_the_slowest_comms_ratio_not_the_aggregates() {
        // Four comms; from 15 000 comm 0 shares a survivor with comm 1 (half rate each),
        // comms 2 and 3 run on: free-running, the aggregate keeps 3/4, a collective 1/2.
        let iv = run(20_000, |t| {
            if t <= 15_000 {
                vec![100; 4]
            } else {
                vec![50, 50, 100, 100]
            }
        });
        let k = kept(
            &iv,
            Window {
                from: 11_000,
                to: 15_000,
            },
            Window {
                from: 15_000,
                to: 20_000,
            },
            true,
        )
        .unwrap();
        assert_eq!(k.slowest, 0.5);
        assert_eq!(k.aggregate, 0.75);
        assert_eq!(k.before.slowest, 400.0);
        // Nothing moved before: no ratio.
        let idle = run(12_000, |_| vec![0, 0]);
        let w = Window {
            from: 10_000,
            to: 12_000,
        };
        assert_eq!(kept(&idle, w, w, true), None);
        assert_eq!(ideal(4), 0.75);
    }

    #[test]
    fn free_running_the_slowest_is_the_least_rate_not_the_comm_that_fell_behind() {
        // Comm 0 stalls during a failover, then runs at 60 while the others run at 40:
        // it stays the least advanced, but the slowest comm now runs at 40.
        let iv = run(20_000, |t| match t {
            t if t <= 14_000 => vec![50; 4],
            t if t <= 15_000 => vec![0, 60, 60, 60],
            _ => vec![60, 40, 40, 40],
        });
        let before = Window {
            from: 11_000,
            to: 14_000,
        };
        let after = Window {
            from: 15_000,
            to: 20_000,
        };
        let free = kept(&iv, before, after, false).unwrap();
        assert_eq!(free.slowest, 0.8);
        let coupled = kept(&iv, before, after, true).unwrap();
        // Progress follows the comm catching up (faster than before) until it has.
        assert!(coupled.slowest > 1.0, "{}", coupled.slowest);
    }

    #[test]
    fn windows_leave_out_warmup_settling_failback_and_guards() {
        let x = Exclude {
            warmup: 1500,
            settle: 2500,
            failback: 4500,
            guard: 250,
        };
        let p = Phases {
            start: 0,
            cut: 5000,
            up: Some(13_000),
            end: 20_000,
        };
        let w = windows(p, x).unwrap();
        assert_eq!(
            w.before,
            Window {
                from: 1500,
                to: 4750
            }
        );
        assert_eq!(
            w.after,
            Window {
                from: 7500,
                to: 12_750
            }
        );
        assert_eq!(
            w.back,
            Some(Window {
                from: 17_500,
                to: 19_750
            })
        );
        // The link stays down: after runs to the end, no fail-back window.
        let w = windows(Phases { up: None, ..p }, x).unwrap();
        assert_eq!(
            w.after,
            Window {
                from: 7500,
                to: 19_750
            }
        );
        assert_eq!(w.back, None);
        // Too little time after the cut is an error that says so.
        let e = windows(
            Phases {
                up: Some(8000),
                ..p
            },
            x,
        )
        .unwrap_err();
        assert!(
            e.contains("after failover") && e.contains("run longer"),
            "{e}"
        );
        // Fail-back too late to measure: no window, not an error.
        let w = windows(
            Phases {
                up: Some(15_000),
                ..p
            },
            x,
        )
        .unwrap();
        assert_eq!(w.back, None);
    }

    #[test]
    fn series_smooth_the_slowest_comm_and_convert_devices_to_mbit() {
        // Comm 1 delivers only every other tick: per tick its minimum is 0, over two
        // ticks it is steady.
        let iv = run(11_000, |t| {
            vec![1000, if (t / 250) % 2 == 0 { 2000 } else { 0 }]
        });
        let raw = comm_series(&iv, 10_000, 1);
        assert!(raw.iter().any(|p| p.slowest == 0.0));
        let smooth = comm_series(&iv, 10_000, 2);
        for p in &smooth[1..] {
            assert!((p.slowest - 0.032).abs() < 1e-9, "{p:?}");
        }
        assert_eq!(smooth[0].t, 0.25);
        let iv = [Interval {
            from: 0,
            to: 500,
            comms: vec![],
            devs: vec![62_500, 0],
        }];
        // 62 500 B in 0.5 s = 1 Mbit/s.
        assert_eq!(dev_series(&iv, 0)[0].mbit, vec![1.0, 0.0]);
    }
}
