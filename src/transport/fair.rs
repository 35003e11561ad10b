//! Fair shares between the TCP lanes of one NIC. No sockets, no clock reads: the reactor
//! samples each lane's delivered bytes at a fixed interval, passing the time in, and
//! applies the pacing caps this returns (`SO_MAX_PACING_RATE`).
//!
//! Why: a lane moved onto a NIC by failover is a fresh TCP connection. Where the NIC's
//! queue is a FIFO (no per-flow fair queueing), the incumbent lanes keep it full and the
//! newcomer's congestion control settles at a few per cent of the link for many seconds.
//! NCCL runs at the pace of its slowest connection, so that one lane slows the job.
//! Capping every backlogged lane of a NIC near `capacity / lanes` leaves the newcomer
//! room to grow into; lanes that are not backlogged are never capped, and a NIC with a
//! single backlogged lane is never capped. RDMA NICs arbitrate between queue pairs in
//! hardware and do not need this.
//!
//! Caps must not cost bandwidth. A lane can be backlogged because a remote NIC, not
//! ours, is its bottleneck (incast); capping the others to an even share would then
//! leave our NIC part idle. So caps are judged: if, capped, the NIC delivered less than
//! [`UNDERUSED`] of its capacity for most of [`JUDGE`], the caps are lifted and the NIC is
//! left alone for [`HOLD_OFF`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// Caps of lanes below their share sit this much above it, so that they have room to
/// grow into and the sum of the caps exceeds the NIC's capacity (the capacity estimate
/// can still grow when the link gets faster).
pub const HEADROOM: f64 = 1.15;
/// While some lane of the NIC is below its share, caps of lanes that reach theirs sit
/// only this much above it: what they leave is the room the starved lanes grow into.
/// With every lane at `HEADROOM`, the incumbents would keep 15 % more than their share
/// and a lane moved onto the NIC would settle well below its own (a striped comm runs at
/// the pace of its slowest lane). With no lane starved, all get `HEADROOM`.
pub const AT_SHARE_HEADROOM: f64 = 1.02;
/// A lane delivering at least this fraction of its share counts as reaching it.
pub const REACHED: f64 = 0.9;
/// A capped lane keeps its cap through this many samples in a row without a backlog. A
/// striped comm's lane carries a few messages at a time and can drain between them; if
/// that lifted the NIC's caps, its caps would flap on and off every other sample.
pub const RELEASE: u32 = 5;
/// Per sample, the capacity estimate forgets this fraction of itself, so a NIC that
/// became slower is judged by what it does now within some seconds.
pub const DECAY: f64 = 0.995;
/// Weight of the previous value in the smoothed aggregate rate of a NIC.
pub const SMOOTHING: f64 = 0.75;
/// A cap is rewritten only when it moves by more than this fraction.
pub const HYSTERESIS: f64 = 0.05;
/// How long caps run before they are judged (a moved lane needs some time to grow).
pub const JUDGE: Duration = Duration::from_secs(1);
/// Capped, a NIC that delivers less than this fraction of its capacity is losing
/// bandwidth to the caps.
pub const UNDERUSED: f64 = 0.8;
/// After caps cost bandwidth, how long the NIC runs uncapped before they are tried again.
pub const HOLD_OFF: Duration = Duration::from_secs(5);
/// A NIC whose backlogged lanes' even share is less than this per sample is not capped.
/// So finely shared, a fresh TCP flow's first window (10 segments, about 14 KiB) already
/// carries a share, so nothing starves; and a sample cannot tell a starved lane from one
/// between two messages, while a per-lane cap on hundreds of lanes in lockstep leaves the
/// NIC idle whenever the capped ones wait for the rest.
pub const MIN_SHARE_PER_SAMPLE: f64 = 64.0 * 1024.0;

/// One lane's sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaneSample {
    /// The caller's key for the lane.
    pub key: usize,
    pub nic: usize,
    /// Bytes the lane delivered since the previous sample.
    pub bytes: u64,
    /// Whether the lane had data waiting through the whole interval.
    pub backlogged: bool,
    /// Its share relative to the NIC's other lanes (a striped comm's lane carries the
    /// stripes it has): backlogged lanes are capped in proportion, so that comms, not
    /// lanes, get even rates.
    pub weight: u32,
}

/// A pacing change for one lane: `Some(bytes/s)` caps it, `None` lifts the cap.
pub type Change = (usize, Option<u64>);

/// What one sample decided.
#[derive(Debug, Default, PartialEq)]
pub struct Sampled {
    /// The caps to change.
    pub changes: Vec<Change>,
    /// NICs whose caps were just lifted and held off because they cost bandwidth.
    pub held_off: Vec<usize>,
}

/// Where one NIC stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// No contention: no caps.
    Free,
    /// Caps on for `age` since the last judgement, `under` of it underused.
    Capped { age: Duration, under: Duration },
    /// Caps cost bandwidth: none until `left` has run out.
    HoldOff { left: Duration },
}

#[derive(Debug, Clone, Copy)]
struct Nic {
    /// Aggregate delivery rate (bytes/s), smoothed over a few samples so that one
    /// bursty sample neither inflates the capacity nor looks like idleness.
    rate: f64,
    /// Best smoothed aggregate rate seen (bytes/s), decaying.
    capacity: f64,
    phase: Phase,
}

#[derive(Debug, Default)]
pub struct FairShare {
    /// When the previous sample was taken.
    last: Option<Instant>,
    nics: HashMap<usize, Nic>,
    /// The cap each lane has now.
    caps: HashMap<usize, u64>,
    /// Samples in a row each lane was not backlogged.
    quiet: HashMap<usize, u32>,
}

impl FairShare {
    pub fn new() -> FairShare {
        FairShare::default()
    }

    /// Forgets a closed lane, whose key may be reused.
    pub fn forget(&mut self, key: usize) {
        self.caps.remove(&key);
        self.quiet.remove(&key);
    }

    /// The cap lane `key` has now, if any.
    pub fn cap(&self, key: usize) -> Option<u64> {
        self.caps.get(&key).copied()
    }

    /// The capacity estimate of `nic` (bytes/s).
    pub fn capacity(&self, nic: usize) -> f64 {
        self.nics.get(&nic).map_or(0.0, |n| n.capacity)
    }

    /// Whether caps on `nic` are held off because they cost bandwidth.
    pub fn held_off(&self, nic: usize) -> bool {
        self.nics
            .get(&nic)
            .is_some_and(|n| matches!(n.phase, Phase::HoldOff { .. }))
    }

    /// Takes one sample of every live lane at `now` and says which caps to change.
    /// Lanes not in `lanes` are forgotten; the first sample only sets the clock.
    pub fn sample(&mut self, now: Instant, lanes: &[LaneSample]) -> Sampled {
        let dt = self
            .last
            .replace(now)
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let secs = dt.as_secs_f64();
        let mut out = Sampled::default();
        let live: HashSet<usize> = lanes.iter().map(|l| l.key).collect();
        self.caps.retain(|k, _| live.contains(k));
        self.quiet.retain(|k, _| live.contains(k));
        if secs <= 0.0 {
            return out;
        }
        // A lane competes for the NIC while backlogged, and while capped through a short
        // pause in its backlog.
        let mut active = HashSet::new();
        for l in lanes {
            let quiet = self.quiet.entry(l.key).or_default();
            *quiet = if l.backlogged { 0 } else { *quiet + 1 };
            if l.backlogged || (self.caps.contains_key(&l.key) && *quiet < RELEASE) {
                active.insert(l.key);
            }
        }
        let mut per_nic: HashMap<usize, (f64, usize, u64)> = HashMap::new();
        for l in lanes {
            let e = per_nic.entry(l.nic).or_default();
            e.0 += l.bytes as f64 / secs;
            if active.contains(&l.key) {
                e.1 += 1;
                e.2 += u64::from(l.weight.max(1));
            }
        }
        for (&nic, &(rate, backlogged, _)) in &per_nic {
            let n = self.nics.entry(nic).or_insert(Nic {
                rate,
                capacity: 0.0,
                phase: Phase::Free,
            });
            n.rate = SMOOTHING * n.rate + (1.0 - SMOOTHING) * rate;
            let underused = n.rate < UNDERUSED * n.capacity * DECAY;
            n.capacity = (n.capacity * DECAY).max(n.rate);
            // Per lane, not per stripe: how many stripes each lane carries says how the NIC
            // is shared out, not how finely.
            let share = n.capacity * secs / backlogged.max(1) as f64;
            let fine = share < MIN_SHARE_PER_SAMPLE;
            let contended = backlogged >= 2 && !fine;
            n.phase = match n.phase {
                Phase::Free if contended => Phase::Capped {
                    age: Duration::ZERO,
                    under: Duration::ZERO,
                },
                Phase::Free => Phase::Free,
                Phase::Capped { .. } if !contended => Phase::Free,
                Phase::Capped { age, under } => {
                    let age = age + dt;
                    let under = if underused { under + dt } else { under };
                    if age < JUDGE {
                        Phase::Capped { age, under }
                    } else if under * 2 > age {
                        out.held_off.push(nic);
                        Phase::HoldOff { left: HOLD_OFF }
                    } else {
                        Phase::Capped {
                            age: Duration::ZERO,
                            under: Duration::ZERO,
                        }
                    }
                }
                Phase::HoldOff { left } if left > dt => Phase::HoldOff { left: left - dt },
                Phase::HoldOff { .. } => Phase::Free,
            };
        }
        self.nics.retain(|n, _| per_nic.contains_key(n));
        let share_of = |l: &LaneSample, capacity: f64| {
            let (_, _, weights) = per_nic[&l.nic];
            capacity * f64::from(l.weight.max(1)) / weights.max(1) as f64
        };
        let starved: HashSet<usize> = (lanes.iter())
            .filter(|l| active.contains(&l.key))
            .filter(|l| (l.bytes as f64 / secs) < REACHED * share_of(l, self.nics[&l.nic].capacity))
            .map(|l| l.nic)
            .collect();
        for l in lanes {
            let nic = self.nics[&l.nic];
            let want = if active.contains(&l.key) && matches!(nic.phase, Phase::Capped { .. }) {
                let share = share_of(l, nic.capacity);
                let reached = (l.bytes as f64 / secs) >= REACHED * share;
                let headroom = if reached && starved.contains(&l.nic) {
                    AT_SHARE_HEADROOM
                } else {
                    HEADROOM
                };
                let share = share * headroom;
                Some((share as u64).max(1))
            } else {
                None
            };
            let have = self.caps.get(&l.key).copied();
            let change = match (have, want) {
                (None, None) => false,
                (Some(_), None) | (None, Some(_)) => true,
                (Some(h), Some(w)) => (w as f64 - h as f64).abs() > HYSTERESIS * h as f64,
            };
            if change {
                match want {
                    Some(w) => self.caps.insert(l.key, w),
                    None => self.caps.remove(&l.key),
                };
                out.changes.push((l.key, want));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DT: Duration = Duration::from_millis(100);

    /// One sample, `DT` after the previous one (the first at a fixed start).
    fn step(f: &mut FairShare, lanes: &[LaneSample]) -> Sampled {
        let now = match f.last {
            Some(t) => t + DT,
            None => {
                let t0 = Instant::now();
                f.sample(t0, &[]);
                t0 + DT
            }
        };
        f.sample(now, lanes)
    }

    fn lane(key: usize, nic: usize, bytes: u64, backlogged: bool) -> LaneSample {
        LaneSample {
            key,
            nic,
            bytes,
            backlogged,
            weight: 1,
        }
    }

    #[test]
    fn a_lone_lane_is_never_capped() {
        let mut f = FairShare::new();
        for _ in 0..10 {
            assert!(step(&mut f, &[lane(1, 0, 1_000_000, true)])
                .changes
                .is_empty());
        }
        assert_eq!(f.cap(1), None);
        assert_eq!(f.capacity(0), 10_000_000.0);
    }

    #[test]
    fn a_nic_shared_too_finely_to_judge_per_sample_is_not_capped() {
        let mut f = FairShare::new();
        // 300 lanes on 25 MB/s: 8 KiB each per sample; a third have moved nothing (in
        // lockstep, waiting for the others).
        let s: Vec<LaneSample> = (0..300)
            .map(|k| lane(k, 0, if k % 3 == 0 { 0 } else { 12_500 }, true))
            .collect();
        for _ in 0..20 {
            assert!(step(&mut f, &s).changes.is_empty());
        }
        assert_eq!(f.cap(0), None);
        // The same NIC with three lanes is judged.
        let s = [
            lane(1, 0, 1_200_000, true),
            lane(2, 0, 1_200_000, true),
            lane(3, 0, 100_000, true),
        ];
        assert_eq!(step(&mut f, &s).changes.len(), 3);
    }

    #[test]
    fn lanes_carrying_many_stripes_each_are_judged_per_lane() {
        // Eight lanes of six stripes each on 25 MB/s: about 300 KiB per lane and sample,
        // though only 50 KiB per stripe. Two incumbents hog the NIC: all are capped.
        let s: Vec<LaneSample> = (0..8)
            .map(|k| LaneSample {
                weight: 6,
                ..lane(k, 0, if k < 2 { 1_200_000 } else { 16_000 }, true)
            })
            .collect();
        let mut f = FairShare::new();
        assert_eq!(step(&mut f, &s).changes.len(), 8);
        assert!(f.cap(0).unwrap() < 1_200_000 * 10);
    }

    #[test]
    fn backlogged_lanes_of_one_nic_are_capped_near_an_even_share() {
        let mut f = FairShare::new();
        // Two incumbents move 12.5 MB/s together; a newcomer trickles.
        let s = [
            lane(1, 0, 600_000, true),
            lane(2, 0, 600_000, true),
            lane(3, 0, 50_000, true),
        ];
        let changes = step(&mut f, &s).changes;
        assert_eq!(changes.len(), 3);
        let even = 12_500_000.0 / 3.0;
        // The incumbents reach their share and keep little above it; the newcomer gets
        // the headroom to grow into.
        for (k, headroom) in [
            (1, AT_SHARE_HEADROOM),
            (2, AT_SHARE_HEADROOM),
            (3, HEADROOM),
        ] {
            let cap = f.cap(k).unwrap() as f64;
            assert!((cap - even * headroom).abs() < 2.0, "lane {k}: {cap}");
        }
        // The caps leave room: two incumbents at their caps use less than the NIC.
        assert!(2.0 * f.cap(1).unwrap() as f64 <= 12_500_000.0 * 0.8);
    }

    #[test]
    fn a_lane_carrying_more_of_its_comm_gets_a_larger_cap() {
        let mut f = FairShare::new();
        // A survivor NIC: its own comm's lane (3 stripes) and one stripe of a failed NIC's
        // comm. Capped per stripe, both comms run at the same rate.
        let own = LaneSample {
            weight: 3,
            ..lane(1, 0, 900_000, true)
        };
        let moved = lane(2, 0, 300_000, true);
        step(&mut f, &[own, moved]);
        let (a, b) = (f.cap(1).unwrap() as f64, f.cap(2).unwrap() as f64);
        assert!((a / b - 3.0).abs() < 1e-3, "{a} vs {b}");
        assert!((a + b - 12_000_000.0 * HEADROOM).abs() < 4.0);
        // Starved behind the incumbent, the moved lane gets the headroom: its comm's
        // other lanes wait for it.
        let moved = lane(2, 0, 100_000, true);
        step(&mut f, &[own, moved]);
        assert!(f.cap(2).unwrap() as f64 > f.cap(1).unwrap() as f64 / 3.0 * 1.1);
    }

    #[test]
    fn lanes_that_are_not_backlogged_or_on_other_nics_are_left_alone() {
        let mut f = FairShare::new();
        let s = [
            lane(1, 0, 600_000, true),
            lane(2, 0, 10, false),
            lane(3, 1, 600_000, true),
            lane(4, 1, 600_000, true),
        ];
        step(&mut f, &s);
        assert_eq!(f.cap(1), None, "the only backlogged lane of NIC 0");
        assert_eq!(f.cap(2), None, "not backlogged");
        assert_eq!(f.cap(3), Some((12_000_000.0 * HEADROOM / 2.0) as u64));
        assert_eq!(f.cap(4), f.cap(3));
    }

    #[test]
    fn caps_are_lifted_when_the_contention_ends() {
        let mut f = FairShare::new();
        step(
            &mut f,
            &[lane(1, 0, 500_000, true), lane(2, 0, 500_000, true)],
        );
        assert!(f.cap(1).is_some() && f.cap(2).is_some());
        // Lane 2 goes away, lane 1 runs alone: its cap is lifted.
        let changes = step(&mut f, &[lane(1, 0, 500_000, true)]).changes;
        assert_eq!(changes, vec![(1, None)]);
        assert_eq!(f.cap(2), None, "a closed lane is forgotten");
    }

    #[test]
    fn a_short_pause_in_a_lanes_backlog_keeps_the_caps() {
        let mut f = FairShare::new();
        let both = |paused: bool| [lane(1, 0, 600_000, true), lane(2, 0, 200_000, !paused)];
        step(&mut f, &both(false));
        let caps = (f.cap(1), f.cap(2));
        assert!(caps.0.is_some() && caps.1.is_some());
        // Lane 2 drains between its messages: for a few samples nothing changes.
        for _ in 1..RELEASE {
            assert!(step(&mut f, &both(true)).changes.is_empty());
        }
        assert_eq!((f.cap(1), f.cap(2)), caps);
        // Quiet for longer: it no longer competes, and lane 1 alone is uncapped.
        let changes = step(&mut f, &both(true)).changes;
        assert!(
            changes.contains(&(1, None)) && changes.contains(&(2, None)),
            "{changes:?}"
        );
    }

    #[test]
    fn small_moves_do_not_rewrite_a_cap_and_a_faster_link_raises_it() {
        let mut f = FairShare::new();
        let two = |b: u64| [lane(1, 0, b, true), lane(2, 0, b, true)];
        step(&mut f, &two(500_000));
        let first = f.cap(1).unwrap();
        // A slightly lower sample: the estimate barely decays, nothing is rewritten.
        assert!(step(&mut f, &two(490_000)).changes.is_empty());
        assert_eq!(f.cap(1), Some(first));
        // Both lanes run at their caps (their sum exceeds the old estimate), so the
        // estimate and the caps climb towards a faster link.
        let mut cap = first;
        for _ in 0..40 {
            let b = (cap as f64 * DT.as_secs_f64()) as u64;
            step(&mut f, &two(b));
            cap = f.cap(1).unwrap();
        }
        assert!(cap as f64 > first as f64 * 2.0, "{first} -> {cap}");
    }

    #[test]
    fn caps_that_leave_the_nic_idle_are_lifted_and_held_off() {
        let mut f = FairShare::new();
        // Lane 2's bottleneck is elsewhere (a remote NIC): it stays at 1 MB/s, while lane
        // 1 alone could fill the 10 MB/s NIC. Uncapped they fill it.
        let s = |a: u64| [lane(1, 0, a, true), lane(2, 0, 100_000, true)];
        step(&mut f, &s(900_000));
        let cap = f.cap(1).expect("contended: capped");
        assert!(cap < 6_000_000, "{cap}");
        // Capped, lane 1 runs at its cap and the NIC sits partly idle for a whole
        // judging period: the caps go, and stay off.
        let capped = (cap as f64 * DT.as_secs_f64()) as u64;
        let mut lifted = None;
        for i in 0..20 {
            let sampled = step(&mut f, &s(capped));
            if sampled.changes.contains(&(1, None)) {
                assert_eq!(sampled.held_off, vec![0], "the lift is reported");
                lifted = Some(i);
                break;
            }
        }
        let i = lifted.expect("caps lifted");
        assert!(
            (9..=11).contains(&i),
            "judged after about {JUDGE:?}: sample {i}"
        );
        assert!(f.held_off(0));
        let hold = (HOLD_OFF.as_millis() / DT.as_millis()) as usize;
        for _ in 0..hold - 1 {
            step(&mut f, &s(900_000));
            assert_eq!(f.cap(1), None, "held off");
        }
        // Then they are tried again.
        step(&mut f, &s(900_000));
        step(&mut f, &s(900_000));
        assert!(f.cap(1).is_some());
    }

    #[test]
    fn one_bursty_sample_does_not_look_like_idleness_afterwards() {
        let mut f = FairShare::new();
        let two = |b: u64| [lane(1, 0, b, true), lane(2, 0, b, true)];
        step(&mut f, &two(500_000));
        // Acks arrive in a burst: one sample shows twice the link's rate.
        step(&mut f, &two(1_000_000));
        for _ in 0..40 {
            step(&mut f, &two(500_000));
            assert!(!f.held_off(0), "a steady, full NIC judged underused");
        }
        assert!(f.cap(1).is_some());
    }

    #[test]
    fn caps_that_keep_the_nic_busy_stay() {
        let mut f = FairShare::new();
        // Two incumbents fill the NIC; a newcomer trickles, then grows into the room the
        // caps leave while the NIC stays busy.
        step(
            &mut f,
            &[lane(1, 0, 500_000, true), lane(2, 0, 500_000, true)],
        );
        let mut newcomer = 10_000u64;
        for _ in 0..50 {
            let cap = f.cap(1).unwrap_or(u64::MAX);
            let inc = ((cap as f64 * DT.as_secs_f64()) as u64).min(500_000);
            let room = 1_000_000u64.saturating_sub(2 * inc);
            newcomer = (newcomer * 2).min(room.max(newcomer));
            step(
                &mut f,
                &[
                    lane(1, 0, inc, true),
                    lane(2, 0, inc, true),
                    lane(3, 0, newcomer, true),
                ],
            );
            assert!(!f.held_off(0));
            assert!(f.cap(3).is_some());
        }
        assert!(newcomer >= 200_000, "the newcomer grew to {newcomer}");
    }

    #[test]
    fn a_slower_link_is_forgotten_slowly_and_never_collapses() {
        let mut f = FairShare::new();
        let two = |b: u64| [lane(1, 0, b, true), lane(2, 0, b, true)];
        step(&mut f, &two(1_000_000));
        // The link halves: the estimate decays towards the new aggregate, never below.
        for _ in 0..2000 {
            step(&mut f, &two(500_000));
        }
        let c = f.capacity(0);
        assert!((c - 10_000_000.0).abs() < 1.0, "{c}");
        assert!(f.cap(1).unwrap() as f64 >= 10_000_000.0 * HEADROOM / 2.0 - 1.0);
    }
}
