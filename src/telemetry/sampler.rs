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
}

/// Counts since the last sample.
#[derive(Debug)]
pub struct Sampler {
    /// Per local NIC: tx bytes, rx bytes, tx messages, rx messages.
    nic: Vec<[u64; 4]>,
    probe_failures: Vec<u64>,
    last_sample: Instant,
    idle: Duration,
    replayed: Delta,
    duplicates: Delta,
    rejected: Delta,
    refused: Delta,
    protocol_errors: Delta,
    lane_failures: Delta,
}

impl Sampler {
    pub fn new(nics: usize, now: Instant) -> Sampler {
        Sampler {
            nic: vec![[0; 4]; nics],
            probe_failures: vec![0; nics],
            last_sample: now,
            idle: Duration::ZERO,
            replayed: Delta::default(),
            duplicates: Delta::default(),
            rejected: Delta::default(),
            refused: Delta::default(),
            protocol_errors: Delta::default(),
            lane_failures: Delta::default(),
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

    pub fn probe_failed(&mut self, nic: usize) {
        if let Some(n) = self.probe_failures.get_mut(nic) {
            *n += 1;
        }
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
