//! What each path has shown lately. A path is one local NIC and one peer NIC's address;
//! every lane between them shares its fate when a cable, port or link fails. Thousands
//! of comms put many lanes on one path, and on a congested path one TCP lane can go
//! quiet for longer than the completion timeout (its flow backed off) while its
//! neighbours keep moving: the path works, and moving that lane would only add to the
//! storm. So a lane's silence, and a failed probe, are judged against its path:
//!
//! * *heard*: bytes arrived over the path (peer to us works);
//! * *delivered*: the peer acknowledged bytes sent over it (us to peer works too).
//!
//! A lane browning out is judged against its path too: each delivery sample adds up what
//! the path's lanes moved, and a path whose total keeps up with its own best (within
//! [`health::SLOW_FACTOR`]) is congested where a lane crawls, not failing.
//!
//! Keepalives are per path too: of the lanes carrying comms over a path, one (its
//! *keeper*, the first to join) sends them, and the rest are judged by what the path
//! hears. Thousands of idle comms then cost a keepalive per path, not per lane.
//!
//! No clock reads: `now` is an argument. Entries older than the caller's horizon and
//! with no lane are forgotten on [`Paths::forget_before`], so the map holds only paths
//! in use.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

use crate::conn::health;

/// A local NIC index and the peer NIC's address.
pub(super) type PathKey = (usize, IpAddr);

#[derive(Debug, Clone, Default)]
struct Seen {
    heard: Option<Instant>,
    delivered: Option<Instant>,
    /// This sample so far: bytes the path's lanes moved, and whether any was backlogged.
    moved: u64,
    backlogged: bool,
    /// The best rate (bytes/s) the path showed while backlogged, and whether its last
    /// sample fell below that by [`health::SLOW_FACTOR`] with data waiting.
    peak: f64,
    slow: bool,
    /// The lanes carrying comms over the path, in the order they joined: the first is
    /// its keeper.
    lanes: Vec<usize>,
}

#[derive(Debug, Default)]
pub(super) struct Paths {
    seen: HashMap<PathKey, Seen>,
    /// When the current delivery sample began.
    sample_from: Option<Instant>,
}

impl Paths {
    /// Lane `k` carries a comm over `path` from now on. Whether it is the path's keeper
    /// (the only lane of the path that sends keepalives).
    pub fn join(&mut self, path: PathKey, k: usize) -> bool {
        let lanes = &mut self.seen.entry(path).or_default().lanes;
        lanes.push(k);
        lanes.len() == 1
    }

    /// Lane `k` left `path`. When it was the keeper and others remain: the new keeper.
    pub fn leave(&mut self, path: PathKey, k: usize) -> Option<usize> {
        let lanes = &mut self.seen.get_mut(&path)?.lanes;
        let i = lanes.iter().position(|&l| l == k)?;
        lanes.remove(i);
        (i == 0).then(|| lanes.first().copied()).flatten()
    }

    /// The lanes carrying comms over `path`.
    pub fn lanes(&self, path: PathKey) -> &[usize] {
        self.seen.get(&path).map_or(&[], |s| &s.lanes)
    }

    /// Bytes arrived over `path` at `now`.
    pub fn heard(&mut self, path: PathKey, now: Instant) {
        self.seen.entry(path).or_default().heard = Some(now);
    }

    /// The peer acknowledged bytes sent over `path`, seen at `now`.
    pub fn delivered(&mut self, path: PathKey, now: Instant) {
        self.seen.entry(path).or_default().delivered = Some(now);
    }

    /// One lane of `path` moved `moved` bytes in this sample (`backlogged`: with data
    /// waiting throughout).
    pub fn sampled(&mut self, path: PathKey, moved: u64, backlogged: bool) {
        let s = self.seen.entry(path).or_default();
        s.moved += moved;
        s.backlogged |= backlogged;
    }

    /// The sample that began at the previous call ends at `now`: each path's total is
    /// judged against its best, for [`Paths::slow`] until the next call.
    pub fn end_sample(&mut self, now: Instant) {
        let from = self.sample_from.replace(now);
        let dt = from.map_or(0.0, |f| now.saturating_duration_since(f).as_secs_f64());
        for s in self.seen.values_mut() {
            let (moved, backlogged) = (
                std::mem::take(&mut s.moved),
                std::mem::take(&mut s.backlogged),
            );
            if dt <= 0.0 || !backlogged {
                s.slow = false;
                continue;
            }
            let rate = moved as f64 / dt;
            s.peak = s.peak.max(rate);
            s.slow = s.peak >= health::MIN_PEAK && rate * health::SLOW_FACTOR < s.peak;
        }
    }

    /// Whether `path` as a whole crawled in the last sample, with data waiting. An unknown
    /// path says yes: nothing speaks for it.
    pub fn slow(&self, path: Option<PathKey>) -> bool {
        path.and_then(|p| self.seen.get(&p))
            .map_or(true, |s| s.slow)
    }

    pub fn last_heard(&self, path: PathKey) -> Option<Instant> {
        self.seen.get(&path)?.heard
    }

    pub fn last_delivered(&self, path: PathKey) -> Option<Instant> {
        self.seen.get(&path)?.delivered
    }

    /// Forgets paths that carry no lane and showed nothing since `horizon`.
    pub fn forget_before(&mut self, horizon: Instant) {
        self.seen.retain(|_, s| {
            !s.lanes.is_empty()
                || [s.heard, s.delivered]
                    .into_iter()
                    .flatten()
                    .any(|t| t >= horizon)
        });
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::time::Duration;

    #[test]
    fn each_path_keeps_its_own_latest_and_old_paths_are_forgotten() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let a: PathKey = (0, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let b: PathKey = (1, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let mut p = Paths::default();
        p.heard(a, t0);
        p.heard(a, t0 + s);
        p.delivered(b, t0);
        assert_eq!(p.last_heard(a), Some(t0 + s));
        assert_eq!(p.last_delivered(a), None, "heard is not delivered");
        assert_eq!((p.last_heard(b), p.last_delivered(b)), (None, Some(t0)));
        p.forget_before(t0 + s);
        assert_eq!(p.len(), 1);
        assert_eq!(p.last_delivered(b), None);
        assert_eq!(p.last_heard(a), Some(t0 + s));
    }

    #[test]
    fn one_lane_per_path_keeps_it_alive_and_another_takes_over_when_it_leaves() {
        let t0 = Instant::now();
        let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
        let (a, b): (PathKey, PathKey) = ((0, ip), (1, ip));
        let mut p = Paths::default();
        assert!(p.join(a, 7), "the first lane of a path keeps it");
        assert!(!p.join(a, 8));
        assert!(!p.join(a, 9));
        assert!(p.join(b, 10), "each path has its own keeper");
        assert_eq!(p.leave(a, 8), None, "not the keeper: nothing changes");
        assert_eq!(p.leave(a, 7), Some(9), "the next in line keeps it");
        assert_eq!(p.leave(a, 7), None, "gone already");
        // A path with lanes is remembered however long it has been quiet.
        p.forget_before(t0);
        assert_eq!(p.len(), 2);
        assert_eq!(p.leave(a, 9), None, "the last lane left");
        p.forget_before(t0);
        assert_eq!(p.len(), 1);
        assert!(p.join(a, 11), "a path left empty is kept by its next lane");
    }

    #[test]
    fn a_path_is_slow_when_its_total_falls_far_below_its_best_with_data_waiting() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(100);
        let a: PathKey = (0, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let mut p = Paths::default();
        assert!(p.slow(None), "an unknown path speaks for no lane");
        p.end_sample(t0);
        // Two lanes: 3 MB per 100 ms in all, backlogged.
        p.sampled(a, 2_000_000, true);
        p.sampled(a, 1_000_000, false);
        p.end_sample(t0 + ms);
        assert!(!p.slow(Some(a)));
        // One lane starves while the other carries on: the path keeps up.
        p.sampled(a, 0, true);
        p.sampled(a, 2_500_000, true);
        p.end_sample(t0 + 2 * ms);
        assert!(!p.slow(Some(a)));
        // Both crawl: the path is slow.
        p.sampled(a, 50_000, true);
        p.sampled(a, 50_000, true);
        p.end_sample(t0 + 3 * ms);
        assert!(p.slow(Some(a)));
        // Idle (nothing waiting) is not slow.
        p.sampled(a, 0, false);
        p.end_sample(t0 + 4 * ms);
        assert!(!p.slow(Some(a)));
    }
}
