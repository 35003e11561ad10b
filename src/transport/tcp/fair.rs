//! Fair shares between the TCP lanes of one NIC. No sockets, no clock reads: the reactor
//! samples each lane's delivered bytes at a fixed interval and applies the pacing caps
//! this returns (`SO_MAX_PACING_RATE`).
//!
//! Why: a lane moved onto a NIC by failover is a fresh TCP connection. Where the NIC's
//! queue is a FIFO (no per-flow fair queueing), the incumbent lanes keep it full and the
//! newcomer's congestion control settles at a few per cent of the link for many seconds.
//! NCCL runs at the pace of its slowest connection, so that one lane slows the job.
//! Capping every backlogged lane of a NIC near `capacity / lanes` leaves the newcomer
//! room to grow into; lanes that are not backlogged are never capped, and a NIC with a
//! single backlogged lane is never capped. RDMA NICs arbitrate between queue pairs in
//! hardware and do not need this.

use std::collections::HashMap;
use std::time::Duration;

/// Caps sit this much above the even share, so that the sum of the caps exceeds the
/// NIC's capacity and the capacity estimate can still grow when the link gets faster.
pub const HEADROOM: f64 = 1.15;
/// Per sample, the capacity estimate forgets this fraction of itself, so a NIC that
/// became slower is judged by what it does now within some seconds.
pub const DECAY: f64 = 0.995;
/// A cap is rewritten only when it moves by more than this fraction.
pub const HYSTERESIS: f64 = 0.05;

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
}

/// A pacing change for one lane: `Some(bytes/s)` caps it, `None` lifts the cap.
pub type Change = (usize, Option<u64>);

#[derive(Debug, Default)]
pub struct FairShare {
    /// Best aggregate delivery rate seen per NIC (bytes/s), decaying.
    capacity: HashMap<usize, f64>,
    /// The cap each lane has now.
    caps: HashMap<usize, u64>,
}

impl FairShare {
    pub fn new() -> FairShare {
        FairShare::default()
    }

    /// Forgets a closed lane, whose key may be reused.
    pub fn forget(&mut self, key: usize) {
        self.caps.remove(&key);
    }

    /// The cap lane `key` has now, if any.
    pub fn cap(&self, key: usize) -> Option<u64> {
        self.caps.get(&key).copied()
    }

    /// The capacity estimate of `nic` (bytes/s).
    pub fn capacity(&self, nic: usize) -> f64 {
        self.capacity.get(&nic).copied().unwrap_or(0.0)
    }

    /// Takes one sample of every live lane, `dt` after the previous one, and returns
    /// the caps to change. Lanes not in `lanes` are forgotten.
    pub fn sample(&mut self, dt: Duration, lanes: &[LaneSample]) -> Vec<Change> {
        let secs = dt.as_secs_f64();
        let mut changes = Vec::new();
        self.caps.retain(|k, _| lanes.iter().any(|l| l.key == *k));
        if secs <= 0.0 {
            return changes;
        }
        let mut per_nic: HashMap<usize, (f64, usize)> = HashMap::new();
        for l in lanes {
            let e = per_nic.entry(l.nic).or_default();
            e.0 += l.bytes as f64 / secs;
            e.1 += usize::from(l.backlogged);
        }
        for (&nic, &(rate, _)) in &per_nic {
            let c = self.capacity.entry(nic).or_insert(0.0);
            *c = (*c * DECAY).max(rate);
        }
        self.capacity.retain(|n, _| per_nic.contains_key(n));
        for l in lanes {
            let (_, backlogged) = per_nic[&l.nic];
            let want = if l.backlogged && backlogged >= 2 {
                let share = self.capacity[&l.nic] * HEADROOM / backlogged as f64;
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
                changes.push((l.key, want));
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DT: Duration = Duration::from_millis(100);

    fn lane(key: usize, nic: usize, bytes: u64, backlogged: bool) -> LaneSample {
        LaneSample {
            key,
            nic,
            bytes,
            backlogged,
        }
    }

    #[test]
    fn a_lone_lane_is_never_capped() {
        let mut f = FairShare::new();
        for _ in 0..10 {
            assert!(f.sample(DT, &[lane(1, 0, 1_000_000, true)]).is_empty());
        }
        assert_eq!(f.cap(1), None);
        assert_eq!(f.capacity(0), 10_000_000.0);
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
        let changes = f.sample(DT, &s);
        assert_eq!(changes.len(), 3);
        let even = 12_500_000.0 / 3.0;
        for k in [1, 2, 3] {
            let cap = f.cap(k).unwrap() as f64;
            assert!((cap - even * HEADROOM).abs() < 2.0, "lane {k}: {cap}");
        }
        // The caps leave room: two incumbents at their caps use less than the NIC.
        assert!(2.0 * f.cap(1).unwrap() as f64 <= 12_500_000.0 * 0.8);
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
        f.sample(DT, &s);
        assert_eq!(f.cap(1), None, "the only backlogged lane of NIC 0");
        assert_eq!(f.cap(2), None, "not backlogged");
        assert_eq!(f.cap(3), Some((12_000_000.0 * HEADROOM / 2.0) as u64));
        assert_eq!(f.cap(4), f.cap(3));
    }

    #[test]
    fn caps_are_lifted_when_the_contention_ends() {
        let mut f = FairShare::new();
        f.sample(DT, &[lane(1, 0, 500_000, true), lane(2, 0, 500_000, true)]);
        assert!(f.cap(1).is_some() && f.cap(2).is_some());
        // Lane 2 goes away, lane 1 runs alone: its cap is lifted.
        let changes = f.sample(DT, &[lane(1, 0, 500_000, true)]);
        assert_eq!(changes, vec![(1, None)]);
        assert_eq!(f.cap(2), None, "a closed lane is forgotten");
    }

    #[test]
    fn small_moves_do_not_rewrite_a_cap_and_a_faster_link_raises_it() {
        let mut f = FairShare::new();
        let two = |b: u64| [lane(1, 0, b, true), lane(2, 0, b, true)];
        f.sample(DT, &two(500_000));
        let first = f.cap(1).unwrap();
        // A slightly lower sample: the estimate barely decays, nothing is rewritten.
        assert!(f.sample(DT, &two(490_000)).is_empty());
        assert_eq!(f.cap(1), Some(first));
        // Both lanes run at their caps (their sum exceeds the old estimate), so the
        // estimate and the caps climb towards a faster link.
        let mut cap = first;
        for _ in 0..20 {
            let b = (cap as f64 * DT.as_secs_f64()) as u64;
            f.sample(DT, &two(b));
            cap = f.cap(1).unwrap();
        }
        assert!(cap as f64 > first as f64 * 2.0, "{first} -> {cap}");
    }

    #[test]
    fn a_slower_link_is_forgotten_slowly_and_never_collapses() {
        let mut f = FairShare::new();
        let two = |b: u64| [lane(1, 0, b, true), lane(2, 0, b, true)];
        f.sample(DT, &two(1_000_000));
        // The link halves: the estimate decays towards the new aggregate, never below.
        for _ in 0..2000 {
            f.sample(DT, &two(500_000));
        }
        let c = f.capacity(0);
        assert!((c - 10_000_000.0).abs() < 1.0, "{c}");
        assert!(f.cap(1).unwrap() as f64 >= 10_000_000.0 * HEADROOM / 2.0 - 1.0);
    }
}
