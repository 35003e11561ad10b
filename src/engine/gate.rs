//! What strangers may cost: a cap on connections still in their handshake, and a rate
//! limit on the log lines they cause. No sockets, no clock reads: `now` is an argument.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Connections in their handshake that one listener may hold. A real handshake takes a
/// round trip, so even a job-start burst of connects rarely has more than a few here.
pub const PER_LISTENER: usize = 64;
/// ... and all listeners together, far below any sane `ulimit -n`.
pub const TOTAL: usize = 256;
/// How often the log may mention connections that were turned away.
pub(super) const LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
struct Entry {
    lane: usize,
    listener: usize,
    /// It sent a Hello this listener can serve (not yet proven).
    vouched: bool,
}

/// Connections accepted and not yet authenticated, oldest first.
#[derive(Debug)]
pub(super) struct Gate {
    per_listener: usize,
    total: usize,
    next: u64,
    open: BTreeMap<u64, Entry>,
    peak: usize,
}

impl Gate {
    pub fn new(per_listener: usize, total: usize) -> Gate {
        Gate {
            per_listener: per_listener.max(1),
            total: total.max(1),
            next: 0,
            open: BTreeMap::new(),
            peak: 0,
        }
    }

    /// Lane `lane` was accepted on `listener`. Returns its ticket and the lanes to drop
    /// (with their tickets) to stay within the caps: the oldest first, those that have not presented a
    /// usable Hello before those that have, so an idle flood cannot push out a real
    /// handshake in flight. The newcomer itself is never among them.
    pub fn admit(&mut self, lane: usize, listener: usize) -> (u64, Vec<(u64, usize)>) {
        let mut evict = Vec::new();
        loop {
            let mine = self
                .open
                .values()
                .filter(|e| e.listener == listener)
                .count();
            let scope = if mine >= self.per_listener {
                Some(listener)
            } else if self.open.len() >= self.total {
                None
            } else {
                break;
            };
            let in_scope = |e: &&Entry| scope.map_or(true, |l| e.listener == l);
            let victim = self
                .open
                .iter()
                .filter(|(_, e)| !e.vouched && in_scope(e))
                .chain(self.open.iter().filter(|(_, e)| in_scope(e)))
                .map(|(&t, e)| (t, e.lane))
                .next();
            let Some((t, lane)) = victim else { break };
            self.open.remove(&t);
            evict.push((t, lane));
        }
        let t = self.next;
        self.next += 1;
        self.open.insert(
            t,
            Entry {
                lane,
                listener,
                vouched: false,
            },
        );
        self.peak = self.peak.max(self.open.len());
        (t, evict)
    }

    /// The connection presented a Hello this listener can serve.
    pub fn vouch(&mut self, ticket: u64) {
        if let Some(e) = self.open.get_mut(&ticket) {
            e.vouched = true;
        }
    }

    /// The connection authenticated, was refused or is gone.
    pub fn leave(&mut self, ticket: u64) {
        self.open.remove(&ticket);
    }

    /// The oldest connection in its handshake (to free a descriptor when none is left).
    pub fn oldest(&mut self) -> Option<(u64, usize)> {
        self.open.pop_first().map(|(t, e)| (t, e.lane))
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// The most connections ever held in their handshake at once.
    pub fn peak(&self) -> usize {
        self.peak
    }
}

/// One log line for the first of a burst of events, then one summary per interval.
#[derive(Debug)]
pub(super) struct LogLimit {
    interval: Duration,
    /// When the last line was logged.
    since: Option<Instant>,
    held: u64,
    latest: String,
}

impl LogLimit {
    pub fn new(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            since: None,
            held: 0,
            latest: String::new(),
        }
    }

    /// An event: `Some(line)` to log now, or `None` when it is held for the summary.
    pub fn hit(&mut self, now: Instant, what: &str) -> Option<String> {
        if self
            .since
            .is_some_and(|t| now.saturating_duration_since(t) < self.interval)
        {
            self.held += 1;
            self.latest.clear();
            self.latest.push_str(what);
            return None;
        }
        let line = match std::mem::take(&mut self.held) {
            0 => what.to_string(),
            n => format!(
                "{} in the last {} s (latest: {what})",
                n + 1,
                self.elapsed(now)
            ),
        };
        self.since = Some(now);
        Some(line)
    }

    /// The summary of the events held back, once the interval has passed:
    /// `(count, seconds, latest)`.
    pub fn flush(&mut self, now: Instant) -> Option<(u64, u64, String)> {
        let since = self.since?;
        if self.held == 0 || now.saturating_duration_since(since) < self.interval {
            return None;
        }
        let secs = self.elapsed(now);
        self.since = Some(now);
        Some((
            std::mem::take(&mut self.held),
            secs,
            std::mem::take(&mut self.latest),
        ))
    }

    fn elapsed(&self, now: Instant) -> u64 {
        self.since
            .map_or(0, |t| now.saturating_duration_since(t).as_secs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(v: (u64, Vec<(u64, usize)>)) -> Vec<usize> {
        v.1.into_iter().map(|(_, l)| l).collect()
    }

    #[test]
    fn the_oldest_idle_connection_goes_first_and_the_caps_hold() {
        let mut g = Gate::new(3, 5);
        // Listener 0: lanes 10, 11, 12; lane 11 presented a Hello.
        let t: Vec<u64> = (10..13).map(|l| g.admit(l, 0).0).collect();
        g.vouch(t[1]);
        // Over the per-listener cap: the oldest idle one (10) goes.
        assert_eq!(lanes(g.admit(13, 0)), vec![10]);
        // Then 12, 13, 14 in turn: the vouched 11, though older, stays.
        assert_eq!(lanes(g.admit(14, 0)), vec![12]);
        assert_eq!(lanes(g.admit(15, 0)), vec![13]);
        assert_eq!(lanes(g.admit(16, 0)), vec![14]);
        assert_eq!(g.len(), 3);
        // Another listener fills the total cap; its overflow takes from anyone, idle
        // first: 15 (listener 0) is older than 20.
        assert_eq!(lanes(g.admit(20, 1)), Vec::<usize>::new());
        assert_eq!(lanes(g.admit(21, 1)), Vec::<usize>::new());
        assert_eq!(g.len(), 5);
        assert_eq!(lanes(g.admit(22, 1)), vec![15]);
        assert_eq!(g.len(), 5);
        assert_eq!(g.peak(), 5);
        // When everyone is vouched, the oldest goes.
        let mut g = Gate::new(2, 10);
        let a = g.admit(1, 0).0;
        let b = g.admit(2, 0).0;
        g.vouch(a);
        g.vouch(b);
        assert_eq!(lanes(g.admit(3, 0)), vec![1]);
        // Leaving frees room.
        let mut g = Gate::new(1, 1);
        let (t, _) = g.admit(1, 0);
        g.leave(t);
        assert_eq!(lanes(g.admit(2, 0)), Vec::<usize>::new());
        assert_eq!(g.oldest().map(|(_, l)| l), Some(2));
        assert_eq!(g.len(), 0);
    }

    #[test]
    fn a_burst_logs_one_line_then_one_summary_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut l = LogLimit::new(10 * s);
        assert_eq!(l.hit(t0, "a").as_deref(), Some("a"));
        for i in 0..2000 {
            assert_eq!(l.hit(t0 + s + Duration::from_micros(i), "b"), None);
        }
        // Nothing to say before the interval ends.
        assert_eq!(l.flush(t0 + 9 * s), None);
        assert_eq!(l.flush(t0 + 10 * s), Some((2000, 10, "b".into())));
        assert_eq!(l.flush(t0 + 30 * s), None, "nothing held");
        // After a quiet interval the next event is logged at once.
        assert_eq!(l.hit(t0 + 31 * s, "c").as_deref(), Some("c"));
        // Events held and not yet flushed are folded into the next line.
        assert_eq!(l.hit(t0 + 32 * s, "d"), None);
        assert_eq!(
            l.hit(t0 + 45 * s, "e").as_deref(),
            Some("2 in the last 14 s (latest: e)")
        );
    }
}
