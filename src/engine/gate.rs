//! What strangers may cost, and how a burst of real connects is let in: a bound on
//! connections still in their handshake, and a rate limit on the log lines they cause.
//! No sockets, no clock reads: `now` is an argument.
//!
//! A burst is told from a flood by what a connection has sent and how long it has had,
//! not by how many there are. A connection that presented a Hello this listener can
//! serve (vouched) is never dropped to make room; its handshake deadline bounds it. One
//! that has sent nothing usable may be dropped for a newcomer only once it has had
//! [`GRACE`] to do so. When nothing may be dropped, the reactor stops accepting and
//! leaves the rest in the kernel's backlog until a handshake finishes: backpressure,
//! at the pace handshakes complete, never a refusal of a real connect.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Connections that have not yet presented a usable Hello that one listener may hold.
pub const IDLE_PER_LISTENER: usize = 128;
/// ... and all listeners together.
pub const IDLE_TOTAL: usize = 256;
/// Connections in their handshake at once, vouched or not: a job's all-to-all connects
/// thousands of comms at once. Each holds a descriptor and a small handshake buffer.
pub const TOTAL: usize = 4096;
/// How long a new connection has to present its Hello before it may be dropped for a
/// newcomer. A connector writes its Hello with its first bytes; a busy one (thousands of
/// connects at job start) may take a while to get to it.
pub const GRACE: Duration = Duration::from_millis(250);
/// How often the log may mention connections that were turned away.
pub(super) const LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
struct Entry {
    lane: usize,
    listener: usize,
    since: Instant,
    /// It sent a Hello this listener can serve (not yet proven).
    vouched: bool,
}

/// Connections accepted and not yet authenticated, oldest first.
#[derive(Debug)]
pub(super) struct Gate {
    idle_per_listener: usize,
    idle_total: usize,
    total: usize,
    next: u64,
    open: BTreeMap<u64, Entry>,
    /// Not vouched: in all, and per listener.
    idle: usize,
    idle_of: BTreeMap<usize, usize>,
    peak: usize,
}

impl Gate {
    pub fn new(idle_per_listener: usize, idle_total: usize, total: usize) -> Gate {
        Gate {
            idle_per_listener: idle_per_listener.max(1),
            idle_total: idle_total.max(1),
            total: total.max(1),
            next: 0,
            open: BTreeMap::new(),
            idle: 0,
            idle_of: BTreeMap::new(),
            peak: 0,
        }
    }

    /// Whether a connection waiting on `listener` may be accepted at `now`, and the
    /// connections to drop either way (with their tickets): idle ones past their grace,
    /// the oldest first, as many as make room. Without room, leave the newcomer in the
    /// backlog until a handshake ends.
    pub fn room(&mut self, listener: usize, now: Instant) -> Room {
        let mut evict = Vec::new();
        loop {
            let mine = self.idle_of.get(&listener).copied().unwrap_or(0);
            let scope = if mine >= self.idle_per_listener {
                Some(listener)
            } else if self.idle >= self.idle_total || self.open.len() >= self.total {
                None
            } else {
                return Room { evict, ok: true };
            };
            let victim = self
                .open
                .iter()
                .find(|(_, e)| {
                    !e.vouched
                        && scope.map_or(true, |l| e.listener == l)
                        && now.saturating_duration_since(e.since) >= GRACE
                })
                .map(|(&t, e)| (t, e.lane));
            let Some((t, lane)) = victim else {
                return Room { evict, ok: false };
            };
            self.remove(t);
            evict.push((t, lane));
        }
    }

    /// Lane `lane` was accepted on `listener` at `now` (after [`Gate::room`]): its ticket.
    pub fn admit(&mut self, lane: usize, listener: usize, now: Instant) -> u64 {
        let t = self.next;
        self.next += 1;
        self.open.insert(
            t,
            Entry {
                lane,
                listener,
                since: now,
                vouched: false,
            },
        );
        self.idle += 1;
        *self.idle_of.entry(listener).or_default() += 1;
        self.peak = self.peak.max(self.open.len());
        t
    }

    /// The connection presented a Hello this listener can serve.
    pub fn vouch(&mut self, ticket: u64) {
        if let Some(e) = self.open.get_mut(&ticket) {
            if !e.vouched {
                e.vouched = true;
                let l = e.listener;
                self.forget_idle(l);
            }
        }
    }

    /// The connection authenticated, was refused or is gone.
    pub fn leave(&mut self, ticket: u64) {
        self.remove(ticket);
    }

    fn remove(&mut self, ticket: u64) {
        if let Some(e) = self.open.remove(&ticket) {
            if !e.vouched {
                self.forget_idle(e.listener);
            }
        }
    }

    fn forget_idle(&mut self, listener: usize) {
        self.idle -= 1;
        if let Some(n) = self.idle_of.get_mut(&listener) {
            *n -= 1;
            if *n == 0 {
                self.idle_of.remove(&listener);
            }
        }
    }

    /// The oldest connection that has not vouched for itself (to free a descriptor when
    /// none is left), however young: a real connect waits in the backlog instead.
    pub fn oldest_idle(&mut self) -> Option<(u64, usize)> {
        let (t, lane) = self
            .open
            .iter()
            .find(|(_, e)| !e.vouched)
            .map(|(&t, e)| (t, e.lane))?;
        self.remove(t);
        Some((t, lane))
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// The most connections ever held in their handshake at once.
    pub fn peak(&self) -> usize {
        self.peak
    }
}

/// What [`Gate::room`] decided.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Room {
    /// Connections the gate let go: drop them.
    pub evict: Vec<(u64, usize)>,
    /// Whether the newcomer may be accepted now.
    pub ok: bool,
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

    const MS: Duration = Duration::from_millis(1);

    /// Asks for room on `listener` and admits `lane` when there is: the lanes dropped,
    /// and the ticket (None: left in the backlog).
    fn offer(
        g: &mut Gate,
        lane: usize,
        listener: usize,
        now: Instant,
    ) -> (Vec<usize>, Option<u64>) {
        let r = g.room(listener, now);
        let dropped = r.evict.iter().map(|&(_, l)| l).collect();
        (dropped, r.ok.then(|| g.admit(lane, listener, now)))
    }

    #[test]
    fn an_idle_connection_past_its_grace_goes_first_and_a_young_one_waits() {
        let t0 = Instant::now();
        let late = t0 + GRACE;
        let mut g = Gate::new(3, 5, 100);
        // Listener 0: lanes 10, 11, 12; lane 11 presented a Hello.
        let t: Vec<u64> = (10..13)
            .map(|l| offer(&mut g, l, 0, t0).1.unwrap())
            .collect();
        g.vouch(t[1]);
        // Two idle on listener 0, under its cap of 3: no one goes.
        assert_eq!(offer(&mut g, 13, 0, t0), (vec![], Some(3)));
        // At the cap, every idle one still young: the newcomer waits in the backlog.
        assert_eq!(offer(&mut g, 14, 0, t0 + GRACE - MS), (vec![], None));
        // Past their grace the oldest idle one (10) makes room; the vouched 11 stays.
        assert_eq!(offer(&mut g, 14, 0, late).0, vec![10]);
        assert_eq!(offer(&mut g, 15, 0, late).0, vec![12]);
        assert_eq!(offer(&mut g, 16, 0, late).0, vec![13]);
        // 14, 15 and 16 are young now: 17 waits.
        assert_eq!(offer(&mut g, 17, 0, late), (vec![], None));
        assert_eq!(g.len(), 4);
        // Another listener fills the idle total (5); its overflow takes the oldest idle
        // connection past its grace from anyone: 14 (listener 0).
        let later = late + GRACE;
        assert_eq!(offer(&mut g, 20, 1, later).0, Vec::<usize>::new());
        assert_eq!(offer(&mut g, 21, 1, later).0, Vec::<usize>::new());
        assert_eq!(offer(&mut g, 22, 1, later).0, vec![14]);
        assert_eq!(g.peak(), 6);
    }

    #[test]
    fn a_vouched_connection_is_never_dropped_and_the_total_applies_backpressure() {
        let t0 = Instant::now();
        let mut g = Gate::new(2, 2, 3);
        let a = offer(&mut g, 1, 0, t0).1.unwrap();
        let b = offer(&mut g, 2, 0, t0).1.unwrap();
        g.vouch(a);
        g.vouch(b);
        // Vouching frees the idle caps, not the total.
        let c = offer(&mut g, 3, 1, t0).1.unwrap();
        g.vouch(c);
        for late in [t0, t0 + 100 * GRACE] {
            assert_eq!(offer(&mut g, 4, 0, late), (vec![], None), "full of vouched");
        }
        // One finishes: the next is let in.
        g.leave(a);
        assert!(offer(&mut g, 4, 0, t0).1.is_some());
        // Out of descriptors, only an idle connection is given up, however young.
        assert_eq!(g.oldest_idle().map(|(_, l)| l), Some(4));
        assert_eq!(g.oldest_idle(), None, "the rest vouched");
        assert_eq!(g.len(), 2);
        // Vouching twice or leaving twice changes nothing.
        g.vouch(b);
        g.leave(a);
        assert_eq!(g.len(), 2);
        assert_eq!((g.idle, g.idle_of.len()), (0, 0));
    }

    #[test]
    fn a_burst_of_4096_real_connects_is_admitted_without_a_drop() {
        // Each connector's Hello arrives a little after its accept; the gate admits at
        // that pace and drops nothing.
        let t0 = Instant::now();
        let mut g = Gate::new(IDLE_PER_LISTENER, IDLE_TOTAL, TOTAL);
        let mut waiting: std::collections::VecDeque<u64> = Default::default();
        let (mut admitted, mut step) = (0, 0u32);
        while admitted < 4096 {
            let now = t0 + step * MS;
            step += 1;
            // Hellos arrive for the connections accepted more than 2 ms ago.
            while waiting.len() > 2 * 64 {
                g.vouch(waiting.pop_front().unwrap());
            }
            for _ in 0..64 {
                let r = g.room(admitted % 1024, now);
                assert!(r.evict.is_empty(), "a real connect was dropped");
                if !r.ok {
                    break;
                }
                waiting.push_back(g.admit(admitted, admitted % 1024, now));
                admitted += 1;
            }
            assert!(step < 10_000, "stuck at {admitted}");
        }
        assert!(g.len() <= TOTAL);
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
