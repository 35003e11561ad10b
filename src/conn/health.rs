//! Is a lane making progress? No sockets, no clock reads: the caller samples the bytes
//! a lane has moved, at a fixed interval, with `now` as an argument.
//!
//! Silence is caught elsewhere (nothing received for the completion timeout). This
//! catches the brown-out: bytes still trickle, so the lane is not silent, but a lane that
//! has had data queued for a whole completion timeout while moving less than
//! 1/[`SLOW_FACTOR`] of its own best rate is failing. A large message on a link that is
//! slow but steady never trips it: its rate stays near its own best.

use std::time::{Duration, Instant};

/// A lane this many times slower than its best, while backlogged, is browning out.
pub const SLOW_FACTOR: f64 = 20.0;
/// Below this best rate (bytes/s) nothing is judged: too little history to compare.
pub const MIN_PEAK: f64 = 1_000_000.0;

/// What one sample concluded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Fine,
    /// Backlogged and far below its best for the whole judging period.
    Slow {
        rate: f64,
        peak: f64,
    },
}

/// Progress history of one lane.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Consecutive slow samples that make a verdict.
    limit: u32,
    slow: u32,
    peak: f64,
    last: Option<(Instant, u64)>,
}

impl Progress {
    /// Judges over `period` (the completion timeout) with samples every `sample`.
    pub fn new(period: Duration, sample: Duration) -> Progress {
        let limit = (period.as_nanos() / sample.as_nanos().max(1)).max(1) as u32;
        Progress {
            limit,
            slow: 0,
            peak: 0.0,
            last: None,
        }
    }

    /// Whether the samples since the last verdict or recovery were slow.
    pub fn is_slow(&self) -> bool {
        self.slow > 0
    }

    /// The byte total of the last sample (0 before the first).
    pub fn last_total(&self) -> u64 {
        self.last.map_or(0, |(_, total)| total)
    }

    /// One sample: `total` bytes moved so far, and whether the lane had data waiting
    /// through the whole interval since the previous sample.
    pub fn observe(&mut self, now: Instant, total: u64, backlogged: bool) -> Verdict {
        let Some((t0, b0)) = self.last.replace((now, total)) else {
            return Verdict::Fine;
        };
        let dt = now.saturating_duration_since(t0).as_secs_f64();
        if dt <= 0.0 {
            return Verdict::Fine;
        }
        let rate = total.saturating_sub(b0) as f64 / dt;
        if !backlogged {
            self.slow = 0;
            return Verdict::Fine;
        }
        self.peak = self.peak.max(rate);
        if self.peak >= MIN_PEAK && rate * SLOW_FACTOR < self.peak {
            self.slow += 1;
        } else {
            self.slow = 0;
        }
        if self.slow >= self.limit {
            self.slow = 0;
            return Verdict::Slow {
                rate,
                peak: self.peak,
            };
        }
        Verdict::Fine
    }
}

/// The least rate (bytes/s) a health probe must show on a pair that failed by browning
/// out at `peak`: the bar the detector used. A slow link still answers a probe within its
/// deadline when the link is fast enough in absolute terms.
pub fn recovery_floor(peak: f64) -> f64 {
    peak / SLOW_FACTOR
}

/// The rate (bytes/s) of a probe that moved `bytes` in `elapsed` (the router judges it
/// against the floor of a pair that browned out).
pub fn probe_rate(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-6)
}

/// Whether a lane was backlogged through a sample interval: it had `before` bytes
/// waiting (queued or unacknowledged) at the start, moved only `moved` bytes during the
/// interval, less than what was waiting, and still has bytes waiting (`now`). A stream
/// bound by latency (one small message in flight at a time, answered many times per
/// interval) always has something in flight yet is never backlogged: it moves far more
/// than ever waits, so its low byte rate is not mistaken for a failing link.
pub fn backlogged(before: u64, moved: u64, now: u64) -> bool {
    now > 0 && moved < before
}

/// The longest deadline a probe gets, however busy its NIC and however often it missed.
pub const MAX_PROBE_DEADLINE: Duration = Duration::from_secs(4);

/// Reactor turns a probe waits for at each end: ours sends the Hello, then the Proof and
/// payload, then reads the answer; the peer's answers the Hello, then reads the payload
/// and answers. The peer's turns are taken to be as late as ours: both ends of a job's
/// comms carry the same load.
const PROBE_TURNS: u32 = 6;

/// How long a probe of a pair may take before it counts as failed. A probe shares its
/// local NIC with the lanes already on it, so it gets `base` plus the time the NIC needs,
/// at its measured `rate` (bytes/s, 0 when unknown), to move what is `queued` on it and
/// the probe's own `probe_bytes`, plus [`PROBE_TURNS`] times how `late` the reactor has
/// lately been running what was due (a reactor busy with thousands of comms answers a
/// healthy pair late). Each earlier miss (`retry`) doubles that, so a probe
/// that lost to traffic it could not see (another process's, a congested switch) is
/// judged again more patiently. Capped at [`MAX_PROBE_DEADLINE`] and never below `base`.
pub fn probe_deadline(
    base: Duration,
    retry: u32,
    queued: u64,
    probe_bytes: usize,
    rate: f64,
    late: Duration,
) -> Duration {
    let drain = if rate > 0.0 {
        Duration::from_secs_f64(((queued + probe_bytes as u64) as f64 / rate).min(60.0))
    } else {
        Duration::ZERO
    };
    let late = late.min(MAX_PROBE_DEADLINE) * PROBE_TURNS;
    ((base + drain + late) * (1u32 << retry.min(6)))
        .min(MAX_PROBE_DEADLINE)
        .max(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Feeds `rates` (bytes per 250-ms sample) and returns the sample index of a verdict.
    fn run(rates: &[(u64, bool)]) -> Option<usize> {
        let t0 = Instant::now();
        let mut p = Progress::new(1000 * MS, 250 * MS);
        let mut total = 0;
        assert_eq!(p.observe(t0, 0, true), Verdict::Fine);
        for (i, &(bytes, backlog)) in rates.iter().enumerate() {
            total += bytes;
            if let Verdict::Slow { .. } = p.observe(t0 + 250 * MS * (i as u32 + 1), total, backlog)
            {
                return Some(i);
            }
        }
        None
    }

    #[test]
    fn a_brown_out_is_judged_after_one_full_period() {
        // 30 MB/s (7.5 MB per sample), then 1 %: slow from sample 4; four slow samples
        // (one completion timeout) make the verdict at sample 7, not before.
        let mut r = vec![(7_500_000, true); 4];
        r.extend(vec![(75_000, true); 8]);
        assert_eq!(run(&r), Some(7));
    }

    #[test]
    fn a_slow_but_steady_link_is_fine() {
        // 0.5 MB/s all along, backlogged: never slower than itself.
        assert_eq!(run(&vec![(125_000, true); 40]), None);
        // A fast link that is simply idle (no backlog) is not judged either.
        let mut r = vec![(7_500_000, true); 4];
        r.extend(vec![(0, false); 20]);
        assert_eq!(run(&r), None);
    }

    #[test]
    fn recovery_or_a_gap_in_the_backlog_resets_the_count() {
        let mut r = vec![(7_500_000, true); 4];
        r.extend([
            (75_000, true),
            (75_000, true),
            (75_000, true),
            (7_000_000, true),
        ]);
        r.extend([
            (75_000, true),
            (75_000, true),
            (75_000, false),
            (75_000, true),
        ]);
        assert_eq!(run(&r), None);
    }

    #[test]
    fn a_dead_backlogged_lane_is_judged_too() {
        let mut r = vec![(7_500_000, true); 2];
        r.extend(vec![(0, true); 4]);
        assert_eq!(run(&r), Some(5));
    }

    #[test]
    fn a_probe_of_a_browned_out_pair_must_show_the_rate_it_lost() {
        // The lane moved 16 MB/s at best and failed delivering under 1/20 of that.
        let floor = recovery_floor(16_000_000.0);
        assert_eq!(floor, 800_000.0);
        // 256 KiB in 0.83 s crosses a 200 ms deadline on a fast link's 1 %, below it.
        let rate = probe_rate(262_144, 830 * MS);
        assert!(rate < floor && (rate - 315_836.0).abs() < 1.0, "{rate}");
        // In 10 ms it clears the floor.
        assert!(probe_rate(262_144, 10 * MS) >= floor);
        // A zero elapsed time is not a division by zero.
        assert!(probe_rate(1, Duration::ZERO).is_finite());
    }

    #[test]
    fn a_latency_bound_stream_is_not_backlogged_a_stuck_queue_is() {
        // 0-byte round trips: a 24-byte frame in flight at every sample, thousands of
        // them answered in between.
        assert!(!backlogged(24, 360_000, 24));
        // A brown-out: 4 MiB waiting, 25 kB moved, still waiting.
        assert!(backlogged(4 << 20, 25_000, (4 << 20) - 25_000));
        // A saturated healthy link is backlogged too (its rate then decides).
        assert!(backlogged(8 << 20, 2_500_000, 8 << 20));
        // Drained by the end of the interval, or nothing waited at its start.
        assert!(!backlogged(4 << 20, 25_000, 0));
        assert!(!backlogged(0, 0, 512));
    }

    #[test]
    fn a_probe_on_a_busy_nic_gets_the_time_the_queue_needs() {
        let base = 200 * MS;
        // Idle NIC, or no measured rate: the base deadline.
        assert_eq!(
            probe_deadline(base, 0, 0, 262_144, 0.0, Duration::ZERO),
            base
        );
        // 25 MB/s with 4.75 MB queued ahead of a 256 KiB probe: 200 ms more.
        let d = probe_deadline(base, 0, 4_737_856, 262_144, 25e6, Duration::ZERO);
        assert_eq!(d, 400 * MS);
        // Each miss doubles it, never past the cap.
        assert_eq!(probe_deadline(base, 1, 0, 0, 0.0, Duration::ZERO), 400 * MS);
        assert_eq!(
            probe_deadline(base, 3, 0, 0, 0.0, Duration::ZERO),
            1600 * MS
        );
        assert_eq!(
            probe_deadline(base, 4, 0, 0, 0.0, Duration::ZERO),
            3200 * MS
        );
        assert_eq!(
            probe_deadline(base, 5, 0, 0, 0.0, Duration::ZERO),
            MAX_PROBE_DEADLINE
        );
        assert_eq!(
            probe_deadline(base, 30, 0, 0, 0.0, Duration::ZERO),
            MAX_PROBE_DEADLINE
        );
        assert_eq!(
            probe_deadline(base, 2, 4_737_856, 262_144, 25e6, Duration::ZERO),
            1600 * MS
        );
        assert_eq!(
            probe_deadline(base, 3, 4_737_856, 262_144, 25e6, Duration::ZERO),
            3200 * MS
        );
        // A tiny base still grows to what a loaded link needs.
        assert_eq!(
            probe_deadline(10 * MS, 6, 0, 0, 0.0, Duration::ZERO),
            640 * MS
        );
        assert_eq!(
            probe_deadline(10 * MS, 9, 0, 0, 0.0, Duration::ZERO),
            640 * MS
        );
        // A base above the cap is kept: the cap only limits what is added.
        assert_eq!(
            probe_deadline(5000 * MS, 2, 0, 0, 0.0, Duration::ZERO),
            5000 * MS
        );
        // A reactor running 100 ms late: six of its turns more, then doubled per miss.
        assert_eq!(probe_deadline(base, 0, 0, 0, 0.0, 100 * MS), 800 * MS);
        assert_eq!(probe_deadline(base, 1, 0, 0, 0.0, 100 * MS), 1600 * MS);
        assert_eq!(probe_deadline(base, 0, 0, 0, 0.0, 10 * MS), 260 * MS);
    }
}
