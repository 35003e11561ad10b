//! What each local NIC can carry, as backup selection weighs it (P3, `docs/design.md` §5.3).
//!
//! Survivors are not equal: a 100G port beside 400G ones, a NIC behind the CPU's host
//! bridge (PHB) rather than the GPU's own PCIe switch, a NIC already carrying another
//! failure's stripes. Selection therefore divides a candidate's load by the candidate's
//! capacity, so a failed NIC's stripes go to the survivors in proportion to what they can
//! take, and a collective in lockstep is paced by the largest equal per-comm rate the
//! survivors can carry rather than by the slowest of them.
//!
//! A NIC's capacity is its link speed (sysfs `speed`, the RDMA port's `rate`) until its own
//! traffic shows less. A NIC whose lanes had data waiting in every sample for
//! [`SATURATED_FOR`] delivered all it could, so its smoothed delivered rate then *is* its capacity:
//! a `tc` shaper, a congested switch port or a PCIe bottleneck that no sysfs file shows.
//! That measurement lapses after [`MEASURED_TTL`] without being confirmed, and an
//! unsaturated sample that delivered more than it raises it, so a link that got faster is
//! not held to its old rate. For one comm, the capacity is then scaled by the PCIe path
//! from the comm's GPU to the NIC ([`pcie_factor`]).
//!
//! Sans-IO like the router: samples carry their `now`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::NicId;
use crate::topology::PathType;

/// How long a NIC's lanes must have data waiting, sample after sample, before its delivered
/// rate counts as its capacity. One sample can be backlogged by a burst; half a second of
/// them cannot.
pub const SATURATED_FOR: Duration = Duration::from_millis(500);
/// Weight of the previous value in a NIC's smoothed delivered rate.
pub const SMOOTHING: f64 = 0.75;
/// How long a measured capacity stands without a saturated sample confirming it.
pub const MEASURED_TTL: Duration = Duration::from_secs(30);
/// Candidates whose load per unit of capacity is within this fraction of the best count
/// as equal, and are then told apart by raw load as without weights. Rates measured a few
/// per cent apart on equal NICs must not tilt their shares.
pub const TOLERANCE: f64 = 0.05;

/// The share of a NIC's link rate a GPU can move through it, by PCIe path type. NCCL issue
/// #2310 measured 234 Gb/s through a host bridge (PHB) where the GPU's own switch (PIX)
/// gave 400; crossing the inter-socket link (SYS) costs more again.
pub fn pcie_factor(path: Option<PathType>) -> f64 {
    match path {
        None | Some(PathType::Pix) | Some(PathType::Pxb) => 1.0,
        Some(PathType::Phb) => 0.6,
        Some(PathType::Sys) => 0.5,
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Nic {
    /// Link speed in bytes/s, when known.
    nominal: Option<f64>,
    /// Smoothed delivered rate, bytes/s.
    rate: Option<f64>,
    /// Since when every sample was saturated.
    saturated_since: Option<Instant>,
    /// Capacity shown by the NIC's own traffic, and when it was last confirmed.
    measured: Option<(f64, Instant)>,
    /// When the previous sample was taken.
    last: Option<Instant>,
}

/// Link speeds and measured capacities of this node's NICs.
#[derive(Debug, Default)]
pub struct Capacities {
    nics: BTreeMap<NicId, Nic>,
}

impl Capacities {
    /// Records `nic`'s link speed (Mb/s), as sysfs or the RDMA port reports it.
    pub fn set_link_speed(&mut self, nic: NicId, mbps: u64) {
        let n = self.nics.entry(nic).or_default();
        n.nominal = (mbps > 0).then_some(mbps as f64 * 1e6 / 8.0);
    }

    /// One sample of `nic`: it delivered `bytes` since the previous sample, and
    /// `saturated` says whether its lanes had data waiting throughout. Returns whether the
    /// NIC's capacity fell by more than [`TOLERANCE`] (a rise is not news: it only makes
    /// the NIC a better candidate for the next move).
    pub fn sample(&mut self, nic: NicId, bytes: u64, saturated: bool, now: Instant) -> bool {
        let n = self.nics.entry(nic).or_default();
        let before = n.capacity(now);
        let last = n.last.replace(now);
        let Some(dt) = last.map(|l| now.saturating_duration_since(l).as_secs_f64()) else {
            return false;
        };
        if dt <= 0.0 {
            return false;
        }
        let fresh = bytes as f64 / dt;
        let rate = match n.rate {
            Some(r) => SMOOTHING * r + (1.0 - SMOOTHING) * fresh,
            None => fresh,
        };
        n.rate = Some(rate);
        if saturated && bytes > 0 {
            let since = *n.saturated_since.get_or_insert(last.unwrap_or(now));
            if now.saturating_duration_since(since) >= SATURATED_FOR {
                n.measured = Some((rate, now));
            }
        } else {
            n.saturated_since = None;
            match &mut n.measured {
                Some((m, _)) if rate > *m => *m = rate,
                Some((_, at)) if now >= *at + MEASURED_TTL => n.measured = None,
                _ => {}
            }
        }
        match (before, n.capacity(now)) {
            (Some(b), Some(a)) => a < b * (1.0 - TOLERANCE),
            (None, Some(_)) => true,
            _ => false,
        }
    }

    /// What `nic` can carry now, bytes/s: the lesser of its link speed and what its
    /// traffic showed; `None` when neither is known.
    pub fn capacity(&self, nic: NicId, now: Instant) -> Option<f64> {
        self.nics.get(&nic)?.capacity(now)
    }

    /// The capacity selection weighs `nic` by for a comm whose GPU reaches it over `path`:
    /// a NIC with no known capacity counts as fast as the fastest known one, so unknown
    /// NICs are all equal; `None` when no NIC here has a known capacity.
    pub fn weight(&self, nic: NicId, path: Option<PathType>, now: Instant) -> Option<f64> {
        let own = self.capacity(nic, now).or_else(|| {
            (self.nics.values())
                .filter_map(|n| n.capacity(now))
                .reduce(f64::max)
        });
        own.map(|c| c.max(1.0) * pcie_factor(path))
    }
}

impl Nic {
    fn capacity(&self, now: Instant) -> Option<f64> {
        let measured = self
            .measured
            .filter(|&(_, at)| now < at + MEASURED_TTL)
            .map(|(m, _)| m);
        match (self.nominal, measured) {
            (Some(n), Some(m)) => Some(n.min(m)),
            (n, m) => n.or(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(100);

    /// Feeds `n` samples of `mbit` Mbit/s every 100 ms from `t`; returns the time after.
    fn feed(
        c: &mut Capacities,
        nic: u32,
        mbit: f64,
        saturated: bool,
        n: u32,
        t: Instant,
    ) -> Instant {
        let mut now = t;
        for _ in 0..n {
            now += MS;
            c.sample(NicId(nic), (mbit * 1e6 / 8.0 * 0.1) as u64, saturated, now);
        }
        now
    }

    fn mbit(c: &Capacities, nic: u32, now: Instant) -> f64 {
        c.capacity(NicId(nic), now).map_or(0.0, |b| b * 8.0 / 1e6)
    }

    #[test]
    fn link_speed_is_the_capacity_until_traffic_shows_less() {
        let t = Instant::now();
        let mut c = Capacities::default();
        c.set_link_speed(NicId(0), 10_000);
        assert_eq!(mbit(&c, 0, t), 10_000.0);
        // Busy but never backed up: demand, not capacity.
        let t = feed(&mut c, 0, 100.0, false, 50, t);
        assert_eq!(mbit(&c, 0, t), 10_000.0);
        // Backed up for less than SATURATED_FOR: a burst.
        let t = feed(&mut c, 0, 100.0, true, 4, t);
        assert_eq!(mbit(&c, 0, t), 10_000.0);
        // One more: the NIC delivers all it can.
        let t = feed(&mut c, 0, 100.0, true, 1, t);
        assert!((mbit(&c, 0, t) - 100.0).abs() < 1.0, "{}", mbit(&c, 0, t));
    }

    #[test]
    fn a_measured_capacity_rises_with_more_traffic_and_lapses_unconfirmed() {
        let t = Instant::now();
        let mut c = Capacities::default();
        c.set_link_speed(NicId(0), 10_000);
        let t = feed(&mut c, 0, 100.0, true, 20, t);
        assert!((mbit(&c, 0, t) - 100.0).abs() < 1.0);
        // The link got faster: more delivered, not backed up.
        let t = feed(&mut c, 0, 300.0, false, 20, t);
        assert!(mbit(&c, 0, t) > 290.0, "{}", mbit(&c, 0, t));
        // Idle long enough: back to the link speed.
        let t = feed(&mut c, 0, 0.0, false, 310, t);
        assert_eq!(mbit(&c, 0, t), 10_000.0);
    }

    #[test]
    fn weights_scale_with_capacity_and_pcie_path() {
        let t = Instant::now();
        let mut c = Capacities::default();
        c.set_link_speed(NicId(0), 400_000);
        c.set_link_speed(NicId(1), 100_000);
        let w = |nic, path| c.weight(NicId(nic), path, t).unwrap();
        assert_eq!(w(0, Some(PathType::Pix)) / w(1, Some(PathType::Pix)), 4.0);
        assert_eq!(w(0, Some(PathType::Pxb)), w(0, None));
        assert_eq!(w(0, Some(PathType::Phb)) / w(0, Some(PathType::Pix)), 0.6);
        assert!(w(0, Some(PathType::Sys)) < w(0, Some(PathType::Phb)));
        // An unknown NIC counts as fast as the fastest known one.
        assert_eq!(w(7, None), w(0, None));
        assert_eq!(Capacities::default().weight(NicId(0), None, t), None);
    }

    #[test]
    fn a_fall_is_reported_only_past_the_tolerance() {
        let t = Instant::now();
        let mut c = Capacities::default();
        c.set_link_speed(NicId(0), 1_000);
        let mut changes = 0;
        let mut now = t;
        for _ in 0..40 {
            now += MS;
            changes += u32::from(c.sample(NicId(0), 1_250_000, true, now));
        }
        // 100 Mbit/s against a 1 Gbit/s link: one fall when it counts as saturated,
        // none while the smoothed rate settles within the tolerance.
        assert_eq!(changes, 1);
        // Faster again, unsaturated: a rise, not reported.
        for _ in 0..20 {
            now += MS;
            changes += u32::from(c.sample(NicId(0), 5_000_000, false, now));
        }
        assert_eq!(changes, 1);
        assert!(c.capacity(NicId(0), now).unwrap() > 40e6);
    }
}
