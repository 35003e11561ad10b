//! How late the reactor has lately been running what was due. Thousands of comms can keep
//! a reactor busy for a hundred milliseconds a turn; everything it answers is then that
//! late, a probe's handshake included, and a probe deadline that ignores it fails healthy
//! pairs (at 4,096 comms on two cores, a restored link's fail-back probes missed their
//! 200 ms in turn for 10 s while the link answered in 10 ms). No clock reads: the engine
//! passes the deadline it asked for and the `now` it was called with.

use std::time::{Duration, Instant};

/// Lateness is the most seen in the window in progress and the one before it, so one
/// slow turn counts for one to two windows.
const WINDOW: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub(super) struct Lateness {
    /// Start of the window in progress.
    start: Option<Instant>,
    current: Duration,
    previous: Duration,
}

impl Lateness {
    /// Something due at `due` was run at `now`.
    pub fn record(&mut self, due: Instant, now: Instant) {
        let start = *self.start.get_or_insert(now);
        if now >= start + WINDOW {
            let windows = now.duration_since(start).as_nanos() / WINDOW.as_nanos();
            self.previous = if windows == 1 {
                self.current
            } else {
                Duration::ZERO
            };
            self.current = Duration::ZERO;
            // At most `now` - `start` windows: fits u32 for any run shorter than a century.
            self.start = Some(start + WINDOW * u32::try_from(windows).unwrap_or(u32::MAX));
        }
        self.current = self.current.max(now.saturating_duration_since(due));
    }

    /// The most anything waited past its deadline lately, as of `now`.
    pub fn recent(&self, now: Instant) -> Duration {
        match self.start {
            None => Duration::ZERO,
            Some(s) if now >= s + 2 * WINDOW => Duration::ZERO,
            Some(s) if now >= s + WINDOW => self.current,
            Some(_) => self.current.max(self.previous),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_late_turn_counts_for_one_to_two_windows_then_is_forgotten() {
        let t0 = Instant::now();
        let mut l = Lateness::default();
        assert_eq!(l.recent(t0), Duration::ZERO);
        l.record(t0, t0 + MS);
        l.record(t0 + 100 * MS, t0 + 250 * MS);
        l.record(t0 + 300 * MS, t0 + 320 * MS);
        assert_eq!(l.recent(t0 + 400 * MS), 150 * MS, "the most, not the last");
        // The next window still remembers it.
        l.record(t0 + 1200 * MS, t0 + 1210 * MS);
        assert_eq!(l.recent(t0 + 1500 * MS), 150 * MS);
        // The one after that does not.
        l.record(t0 + 2300 * MS, t0 + 2305 * MS);
        assert_eq!(l.recent(t0 + 2400 * MS), 10 * MS);
        // Nothing recorded for two windows: nothing late lately.
        assert_eq!(l.recent(t0 + 5000 * MS), Duration::ZERO);
        // A gap of several windows forgets everything before it.
        l.record(t0 + 6000 * MS, t0 + 6001 * MS);
        assert_eq!(l.recent(t0 + 6100 * MS), MS);
        // Early calls (nothing was due yet) count as on time.
        l.record(t0 + 7000 * MS, t0 + 6500 * MS);
        assert_eq!(l.recent(t0 + 6600 * MS), MS);
    }
}
