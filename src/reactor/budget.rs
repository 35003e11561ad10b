//! How long the reactor may wait in `epoll`: busy-poll while requests are in flight and
//! progress is recent, then park until the next deadline. The clock is an argument.

use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SpinBudget {
    spin: Duration,
    last_progress: Option<Instant>,
}

impl SpinBudget {
    pub fn new(spin: Duration) -> SpinBudget {
        SpinBudget {
            spin,
            last_progress: None,
        }
    }

    /// Something moved at `now` (a command, bytes, a completion).
    pub fn progress(&mut self, now: Instant) {
        self.last_progress = Some(now);
    }

    /// The poll timeout for this turn: `Some(ZERO)` to spin, otherwise the time until
    /// `deadline` rounded *up* to a whole millisecond (so a 0.3 ms wait does not become a
    /// zero timeout and a spin), or `None` to sleep until an event. `busy` (requests in
    /// flight) is asked only while progress is recent: at thousands of comms the answer
    /// costs a look at each, which an idle reactor waking for its timers need not pay.
    pub fn timeout(
        &self,
        now: Instant,
        busy: impl FnOnce() -> bool,
        deadline: Option<Instant>,
    ) -> Option<Duration> {
        let recent =
            (self.last_progress).is_some_and(|t| now.saturating_duration_since(t) < self.spin);
        if recent && busy() {
            return Some(Duration::ZERO);
        }
        deadline.map(|d| {
            let left = d.saturating_duration_since(now);
            let ms = left.as_nanos().div_ceil(1_000_000);
            Duration::from_millis(ms as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_only_while_busy_and_recent() {
        let t0 = Instant::now();
        let mut b = SpinBudget::new(Duration::from_micros(200));
        let asked = std::cell::Cell::new(0);
        let busy = |b: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                b
            }
        };
        assert_eq!(
            b.timeout(t0, busy(true), None),
            None,
            "no progress yet: park"
        );
        assert_eq!(
            asked.get(),
            0,
            "and nobody asked whether requests are in flight"
        );
        b.progress(t0);
        assert_eq!(
            b.timeout(t0 + Duration::from_micros(199), busy(true), None),
            Some(Duration::ZERO)
        );
        assert_eq!(
            b.timeout(t0 + Duration::from_micros(200), busy(true), None),
            None,
            "budget spent"
        );
        assert_eq!(b.timeout(t0, busy(false), None), None, "idle: park");
        assert_eq!(asked.get(), 2, "asked only while progress was recent");
    }

    #[test]
    fn park_timeout_rounds_up_to_whole_milliseconds() {
        let t0 = Instant::now();
        let b = SpinBudget::new(Duration::ZERO);
        let d = |us| Some(t0 + Duration::from_micros(us));
        assert_eq!(
            b.timeout(t0, || true, d(300)),
            Some(Duration::from_millis(1))
        );
        assert_eq!(
            b.timeout(t0, || true, d(1000)),
            Some(Duration::from_millis(1))
        );
        assert_eq!(
            b.timeout(t0, || true, d(1001)),
            Some(Duration::from_millis(2))
        );
        assert_eq!(
            b.timeout(t0 + Duration::from_secs(1), || true, d(5)),
            Some(Duration::ZERO),
            "overdue"
        );
    }
}
