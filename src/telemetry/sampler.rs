//! What the reactor gathers between two metric samples, and the sample itself. The
//! reactor counts in plain numbers; this turns them into increments for the registry.

use std::time::{Duration, Instant};

use super::metrics::{Delta, NicSample, Telemetry};

/// How often counters reach the metrics registry.
pub const INTERVAL: Duration = Duration::from_millis(100);

/// One local NIC at sample time.
#[derive(Debug, Clone, Copy)]
pub struct NicNow<'a> {
    pub name: &'a str,
    pub rail: Option<u32>,
    pub up: bool,
    /// An operator drained it (`railover drain`).
    pub drained: bool,
    /// What it can carry (bytes/s) as backup selection weighs it, when known.
    pub capacity: Option<u64>,
    /// Lanes carrying a comm on it, and how many of those are paced.
    pub lanes: u64,
    pub paced_lanes: u64,
}

/// The reactor's running totals at sample time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    pub replayed_bytes: u64,
    pub duplicates: u64,
    pub rejected_connections: u64,
    pub refused_handshakes: u64,
    pub handshakes_pending: u64,
    pub protocol_errors: u64,
    pub lane_failures: u64,
    pub unmatched_sends: u64,
    pub gave_up: u64,
    pub link_events: u64,
    /// Registrations of NCCL memory with RDMA devices: process-wide, so every reactor of
    /// the process reads the same total (exported as the largest seen, not as a delta).
    pub memory_registrations: u64,
}

/// What one lane's fabric reported written in place at its previous look: the engine
/// keeps one per lane, beside the lane, so a lane key used again starts afresh.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LanePlaced {
    last: u64,
}

/// Time some number of things spent in a state (local NICs down, comms displaced), summed
/// over them: each second with `n` of them in it adds `n` seconds. It reads no clock:
/// every change and every look says when it happens. Looks add the time up to them as well
/// as changes do, so a state that lasts shows while it lasts, not only once it ends.
#[derive(Debug, Clone, Copy)]
pub struct Accrual {
    count: u64,
    /// Accrued up to here.
    since: Instant,
    /// Accrued and not taken yet, in nanoseconds.
    owed: u128,
}

const NANOS_PER_SEC: u128 = 1_000_000_000;

impl Accrual {
    /// Nothing in the state, from `now`.
    pub fn new(now: Instant) -> Accrual {
        Accrual {
            count: 0,
            since: now,
            owed: 0,
        }
    }

    /// How many are in the state now.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// From `now` on, `count` are in the state.
    pub fn set(&mut self, count: u64, now: Instant) {
        self.advance(now);
        self.count = count;
    }

    /// Accrued up to `now` and not taken yet.
    pub fn pending(&self, now: Instant) -> Duration {
        let mut a = *self;
        a.advance(now);
        let secs = a.owed / NANOS_PER_SEC;
        let nanos = (a.owed % NANOS_PER_SEC) as u32;
        Duration::new(u64::try_from(secs).unwrap_or(u64::MAX), nanos)
    }

    /// Whole seconds accrued up to `now` since the last call. The counters it feeds take
    /// whole numbers, so the fraction stays for the next call: however often it is called,
    /// the seconds handed over add up to the time accrued.
    pub fn take_secs(&mut self, now: Instant) -> u64 {
        self.advance(now);
        let secs = self.owed / NANOS_PER_SEC;
        self.owed %= NANOS_PER_SEC;
        u64::try_from(secs).unwrap_or(u64::MAX)
    }

    /// Adds the time from the last change or look up to `now`. A `now` before it (a caller
    /// whose clock reading is older) adds nothing, and the next later one counts from the
    /// last point already accrued, so no interval counts twice.
    fn advance(&mut self, now: Instant) {
        if now > self.since {
            self.owed += (now - self.since).as_nanos() * u128::from(self.count);
            self.since = now;
        }
    }
}

/// Counts since the last sample.
#[derive(Debug)]
pub struct Sampler {
    /// Per local NIC: tx bytes, rx bytes, tx messages, rx messages.
    nic: Vec<[u64; 4]>,
    /// Per local NIC: payload bytes its lanes wrote in place.
    placed: Vec<u64>,
    probe_failures: Vec<u64>,
    /// Per local NIC: its time down, from the engine's link changes.
    down: Vec<Accrual>,
    /// Comms away from their own NIC pair (failed over, or waiting for a pair), and their
    /// time away summed.
    displaced: Accrual,
    last_sample: Instant,
    idle: Duration,
    replayed: Delta,
    duplicates: Delta,
    rejected: Delta,
    refused: Delta,
    protocol_errors: Delta,
    lane_failures: Delta,
    unmatched_sends: Delta,
    gave_up: Delta,
    link_events: Delta,
}

impl Sampler {
    pub fn new(nics: usize, now: Instant) -> Sampler {
        Sampler {
            nic: vec![[0; 4]; nics],
            placed: vec![0; nics],
            probe_failures: vec![0; nics],
            down: vec![Accrual::new(now); nics],
            displaced: Accrual::new(now),
            last_sample: now,
            idle: Duration::ZERO,
            replayed: Delta::default(),
            duplicates: Delta::default(),
            rejected: Delta::default(),
            refused: Delta::default(),
            protocol_errors: Delta::default(),
            lane_failures: Delta::default(),
            unmatched_sends: Delta::default(),
            gave_up: Delta::default(),
            link_events: Delta::default(),
        }
    }

    /// A message of `len` bytes left (`tx`) or arrived on local NIC `nic`.
    pub fn message(&mut self, nic: Option<usize>, tx: bool, len: u64) {
        if let Some(n) = nic.and_then(|n| self.nic.get_mut(n)) {
            let i = usize::from(!tx);
            n[i] += len;
            n[i + 2] += 1;
        }
    }

    /// A lane on local NIC `nic` has written `total` payload bytes in place since it
    /// opened, by its fabric's count (`transport::LaneProgress::placed`); `lane` is what it
    /// reported before. Call it on every look at the lane's progress and once more just
    /// before the lane is closed, so that nothing it wrote since the last look is lost. A
    /// total below the previous one (the fabric no longer knows the lane) adds nothing.
    pub fn placed(&mut self, nic: Option<usize>, lane: &mut LanePlaced, total: u64) {
        let new = total.saturating_sub(lane.last);
        lane.last = lane.last.max(total);
        if let Some(n) = nic.and_then(|n| self.placed.get_mut(n)) {
            *n += new;
        }
    }

    /// Per local NIC, bytes written in place since the last sample (not handed over yet).
    pub fn placed_pending(&self) -> &[u64] {
        &self.placed
    }

    pub fn probe_failed(&mut self, nic: usize) {
        if let Some(n) = self.probe_failures.get_mut(nic) {
            *n += 1;
        }
    }

    /// Local NIC `nic` went down (`up` false) or came back at `now`: its downtime counts
    /// from the one to the other. Saying the same again changes nothing.
    pub fn link(&mut self, nic: usize, up: bool, now: Instant) {
        if let Some(d) = self.down.get_mut(nic) {
            d.set(u64::from(!up), now);
        }
    }

    /// Per local NIC, time down not handed over yet, up to `now`.
    pub fn down_pending(&self, now: Instant) -> Vec<Duration> {
        self.down.iter().map(|d| d.pending(now)).collect()
    }

    /// From `now` on, `comms` comms are displaced.
    pub fn set_displaced(&mut self, comms: u64, now: Instant) {
        self.displaced.set(comms, now);
    }

    /// Comms displaced now.
    pub fn displaced_comms(&self) -> u64 {
        self.displaced.count()
    }

    /// Time comms spent displaced, summed over them, not handed over yet, up to `now`.
    pub fn displaced_pending(&self, now: Instant) -> Duration {
        self.displaced.pending(now)
    }

    /// The reactor waited `d` for events that did not come.
    pub fn idle(&mut self, d: Duration) {
        self.idle += d;
    }

    pub fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_sample) >= INTERVAL
    }

    /// Sends what was gathered since the last sample to `t`.
    pub fn sample(&mut self, t: &Telemetry, now: Instant, nics: &[NicNow<'_>], st: &Totals) {
        let elapsed = now.saturating_duration_since(self.last_sample);
        if !elapsed.is_zero() {
            let idle = self.idle.min(elapsed);
            t.record_reactor_busy(1.0 - idle.as_secs_f64() / elapsed.as_secs_f64());
        }
        self.last_sample = now;
        self.idle = Duration::ZERO;
        for (i, nic) in nics.iter().enumerate() {
            let c = self.nic.get_mut(i).map(std::mem::take).unwrap_or_default();
            let placed = self.placed.get_mut(i).map_or(0, std::mem::take);
            let down = self.down.get_mut(i).map_or(0, |d| d.take_secs(now));
            t.record_nic(&NicSample {
                nic: nic.name,
                rail: nic.rail,
                up: nic.up,
                lanes: nic.lanes,
                paced_lanes: nic.paced_lanes,
                tx_bytes: c[0],
                rx_bytes: c[1],
                tx_messages: c[2],
                rx_messages: c[3],
                placed_bytes: placed,
                down_seconds: down,
                drained: nic.drained,
                capacity: nic.capacity,
            });
            let probes = self.probe_failures.get_mut(i).map_or(0, std::mem::take);
            if probes > 0 {
                t.record_probe_failures(nic.name, probes);
            }
        }
        t.record_replayed(self.replayed.take(st.replayed_bytes));
        t.record_duplicates(self.duplicates.take(st.duplicates));
        t.record_rejected(self.rejected.take(st.rejected_connections));
        t.record_refused_handshakes(self.refused.take(st.refused_handshakes));
        t.set_handshakes_pending(st.handshakes_pending);
        t.record_protocol_errors(self.protocol_errors.take(st.protocol_errors));
        t.record_lane_failures(self.lane_failures.take(st.lane_failures));
        t.record_unmatched_sends(self.unmatched_sends.take(st.unmatched_sends));
        t.record_comms_given_up(self.gave_up.take(st.gave_up));
        t.record_link_events(self.link_events.take(st.link_events));
        t.set_memory_registrations(st.memory_registrations);
        t.record_comm_displaced(self.displaced.take_secs(now));
        let displaced = self.displaced.count();
        t.set_comms_displaced(displaced);
        t.set_degraded(displaced > 0 || nics.iter().any(|n| !n.up));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::exporter::ExporterConfig;

    /// The value of the series `series` (name and labels, exactly) in `t`'s text.
    fn value(t: &Telemetry, series: &str) -> u64 {
        let text = t.render();
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .unwrap()
    }

    fn nics<'a>(names: &[&'a str]) -> Vec<NicNow<'a>> {
        names
            .iter()
            .map(|&name| NicNow {
                name,
                rail: None,
                up: true,
                drained: false,
                capacity: None,
                lanes: 1,
                paced_lanes: 0,
            })
            .collect()
    }

    #[test]
    fn placed_bytes_of_lanes_add_up_per_nic_and_reach_its_counter() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let now = Instant::now();
        let names = ["unit_placed0", "unit_placed1"];
        let mut s = Sampler::new(2, now);
        let (mut a, mut b, mut c) = Default::default();
        s.placed(Some(0), &mut a, 10_000);
        s.placed(Some(0), &mut a, 25_000);
        s.placed(Some(1), &mut b, 4096);
        s.placed(Some(0), &mut c, 8192);
        s.placed(None, &mut c, 9000);
        s.placed(Some(7), &mut c, 9100);
        assert_eq!(s.placed, [33_192, 4096], "unknown NICs are ignored");
        s.sample(&t, now, &nics(&names), &Totals::default());
        assert_eq!(s.placed, [0, 0], "a sample hands everything over");
        let series = |n: &str| format!(r#"railover_placed_bytes_total{{nic="{n}"}}"#);
        assert_eq!(value(&t, &series(names[0])), 33_192);
        assert_eq!(value(&t, &series(names[1])), 4096);

        s.placed(Some(0), &mut a, 25_000);
        s.placed(Some(0), &mut a, 30_000);
        s.sample(&t, now, &nics(&names), &Totals::default());
        assert_eq!(value(&t, &series(names[0])), 38_192, "only what is new");
        assert_eq!(value(&t, &series(names[1])), 4096);
    }

    #[test]
    fn a_lane_dropped_between_samples_counts_once_and_never_backwards() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let now = Instant::now();
        let names = ["unit_dropped0"];
        let series = r#"railover_placed_bytes_total{nic="unit_dropped0"}"#;
        let mut s = Sampler::new(1, now);
        let mut lane = LanePlaced::default();
        s.placed(Some(0), &mut lane, 8000);
        s.sample(&t, now, &nics(&names), &Totals::default());
        assert_eq!(value(&t, series), 8000);
        // It writes 4000 more, and closes before the next look: the last look before
        // the close takes them.
        s.placed(Some(0), &mut lane, 12_000);
        // Once closed its fabric reports nothing for it.
        s.placed(Some(0), &mut lane, 0);
        assert_eq!(s.placed, [4000]);
        // A new lane under the same key starts from zero.
        let mut again = LanePlaced::default();
        s.placed(Some(0), &mut again, 3000);
        s.sample(&t, now, &nics(&names), &Totals::default());
        assert_eq!(value(&t, series), 15_000);
        s.placed(Some(0), &mut lane, 12_000);
        s.sample(&t, now, &nics(&names), &Totals::default());
        assert_eq!(value(&t, series), 15_000, "the old lane's count was taken");
    }

    #[test]
    fn engine_totals_reach_their_counters_as_increases() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let now = Instant::now();
        // Other tests of this binary add to these unlabelled counters too: lower bounds,
        // with values none of them reach.
        let names = [
            "railover_unmatched_sends_total",
            "railover_comms_given_up_total",
            "railover_link_events_total",
        ];
        let before = names.map(|n| value(&t, n));
        let mut s = Sampler::new(0, now);
        let totals = Totals {
            unmatched_sends: 1000,
            gave_up: 2000,
            link_events: 3000,
            ..Totals::default()
        };
        s.sample(&t, now, &[], &totals);
        s.sample(&t, now, &[], &totals);
        for (i, n) in names.iter().enumerate() {
            let added = value(&t, n) - before[i];
            let want = 1000 * (i as u64 + 1);
            assert!(
                (want..2 * want).contains(&added),
                "{n} grew by {added}, not {want}: counted once per increase"
            );
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_nic_down_from_1_s_to_4_s_counts_3_s() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let t0 = Instant::now();
        let names = ["unit_down0", "unit_down1"];
        let mut s = Sampler::new(2, t0);
        s.link(0, false, t0 + ms(1000));
        // Said again while down: the outage still began at 1 s.
        s.link(0, false, t0 + ms(2000));
        s.link(0, true, t0 + ms(4000));
        s.link(0, true, t0 + ms(4500));
        assert_eq!(s.down_pending(t0 + ms(9000)), [ms(3000), Duration::ZERO]);
        s.sample(&t, t0 + ms(9000), &nics(&names), &Totals::default());
        let series = |n: &str| format!(r#"railover_nic_down_seconds_total{{nic="{n}"}}"#);
        assert_eq!(value(&t, &series(names[0])), 3);
        assert_eq!(value(&t, &series(names[1])), 0, "the other NIC was up");
        s.sample(&t, t0 + ms(20_000), &nics(&names), &Totals::default());
        assert_eq!(value(&t, &series(names[0])), 3, "up since: nothing more");
    }

    #[test]
    fn an_outage_under_way_counts_up_to_each_sample() {
        let t = Telemetry::start(&ExporterConfig::off(), None);
        let t0 = Instant::now();
        let names = ["unit_ongoing0"];
        let series = r#"railover_nic_down_seconds_total{nic="unit_ongoing0"}"#;
        let mut s = Sampler::new(1, t0);
        let mut down = nics(&names);
        down[0].up = false;
        s.link(0, false, t0 + ms(1000));
        s.sample(&t, t0 + ms(2500), &down, &Totals::default());
        assert_eq!(value(&t, series), 1, "whole seconds so far");
        assert_eq!(s.down_pending(t0 + ms(2500)), [ms(500)], "the rest is kept");
        // Twenty minutes down: the counter grows at every sample, not at the recovery.
        for minute in 1..=20 {
            let now = t0 + ms(1000 + 60_000 * minute);
            s.sample(&t, now, &down, &Totals::default());
            assert_eq!(value(&t, series), 60 * minute);
        }
        s.link(0, true, t0 + ms(1_201_700));
        s.sample(&t, t0 + ms(1_300_000), &nics(&names), &Totals::default());
        assert_eq!(value(&t, series), 1200);
        assert_eq!(s.down_pending(t0 + ms(1_400_000)), [ms(700)]);
    }

    #[test]
    fn displaced_time_of_two_comms_adds_up() {
        let t0 = Instant::now();
        let mut a = Accrual::new(t0);
        a.set(2, t0 + ms(1000));
        assert_eq!(a.pending(t0 + ms(2000)), ms(2000), "two comms, one second");
        assert_eq!(a.take_secs(t0 + ms(2250)), 2);
        a.set(1, t0 + ms(3000));
        a.set(0, t0 + ms(5000));
        // 2 × 2 s, then 1 × 2 s: 6 s in all, 2 of them taken already.
        assert_eq!(a.take_secs(t0 + ms(9000)), 4);
        assert_eq!(a.pending(t0 + ms(9000)), Duration::ZERO);
        assert_eq!(a.count(), 0);

        let mut s = Sampler::new(0, t0);
        s.set_displaced(2, t0);
        s.set_displaced(3, t0 + ms(1000));
        assert_eq!(s.displaced_comms(), 3);
        assert_eq!(s.displaced_pending(t0 + ms(2000)), ms(5000));
    }

    #[test]
    fn an_older_now_adds_nothing_and_counts_nothing_twice() {
        let t0 = Instant::now();
        let mut a = Accrual::new(t0 + ms(2000));
        a.set(1, t0 + ms(2000));
        a.set(1, t0 + ms(1000));
        assert_eq!(a.pending(t0 + ms(1500)), Duration::ZERO);
        assert_eq!(a.pending(t0 + ms(3000)), ms(1000));
    }

    #[test]
    fn messages_count_per_nic_and_direction_and_unknown_nics_are_ignored() {
        let mut s = Sampler::new(2, Instant::now());
        s.message(Some(1), true, 100);
        s.message(Some(1), false, 7);
        s.message(Some(1), false, 3);
        s.message(Some(5), true, 1);
        s.message(None, true, 1);
        s.probe_failed(9);
        assert_eq!(s.nic, [[0; 4], [100, 10, 1, 2]]);
    }
}
