//! The router's knobs, already parsed into types ([`super`] maps `RAILOVER_*` variables
//! onto them). They live here, below `routing`, so that parsing needs nothing above it.

use std::time::Duration;

use crate::topology::PathType;
use crate::topology::RailRule;

/// Policy settings of the router (`routing::Router`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterConfig {
    /// Which rails a backup pair may connect. Default [`RailRule::Same`].
    pub rail_rule: RailRule,
    /// The furthest PCIe path type from the comm's GPU a backup pair's local NIC may have.
    /// Default [`PathType::Phb`].
    pub distance_limit: PathType,
    /// How often a displaced lane's original pair is probed. Default 1000 ms; a zero value
    /// is treated as 1 ms so the timer cannot spin.
    pub failback_interval: Duration,
    /// How many consecutive good probes the original pair must answer before lanes move
    /// back. Default 3; zero is treated as 1.
    pub failback_probes_k: u32,
    /// The hold-down after the first flap: an original pair that fails again within
    /// `holddown_max` of a fail-back must then stay quiet (no failure, no failed probe) this
    /// long before the next fail-back; each further flap doubles it. Default 5 s.
    pub holddown_base: Duration,
    /// The cap on the hold-down, also the window that makes a failure a flap and the stable
    /// period after which the hold-down halves (below `holddown_base` it drops to zero).
    /// Default 60 s.
    pub holddown_max: Duration,
    /// How long a probe result (good or bad) stays valid for a pair that carries no lanes;
    /// after that the pair is probed again before use. Default 1000 ms.
    pub health_ttl: Duration,
    /// How long a failed lane may wait for a backup pair while some candidate is still up
    /// (its local NIC has carrier) but none has passed a probe; candidates are re-probed
    /// with backoff meanwhile. After this the comm is given up. A lane whose candidates are
    /// all excluded by rule or carrier is given up at once. Default 30 s (NCCL aborts the
    /// job on an error, so waiting is cheaper than failing).
    pub giveup: Duration,
    /// The first re-probe delay after a failed probe of a candidate; it doubles with each
    /// further failure up to `retry_max`. Default 100 ms.
    pub retry_base: Duration,
    /// The cap on the re-probe delay. Default 1 s.
    pub retry_max: Duration,
    /// Whether backup selection weighs each NIC by what it can carry (link speed, PCIe
    /// path, measured rate; `RAILOVER_STRIPE_WEIGHTS=capacity`) or counts lanes alone
    /// (`equal`). Default on.
    pub weighted: bool,
    /// Seed of the tie-break RNG. Tests and `railover sim` fix it; production seeds it from
    /// the OS once.
    pub seed: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            rail_rule: RailRule::Same,
            distance_limit: PathType::Phb,
            failback_interval: Duration::from_millis(1000),
            failback_probes_k: 3,
            holddown_base: Duration::from_secs(5),
            holddown_max: Duration::from_secs(60),
            health_ttl: Duration::from_millis(1000),
            giveup: Duration::from_secs(30),
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            weighted: true,
            seed: 0,
        }
    }
}

impl RouterConfig {
    /// The same settings with values that would stall or spin the router replaced by the
    /// nearest safe ones (see each field).
    pub(crate) fn normalized(mut self) -> Self {
        self.failback_interval = self.failback_interval.max(Duration::from_millis(1));
        self.failback_probes_k = self.failback_probes_k.max(1);
        self.holddown_max = self.holddown_max.max(self.holddown_base);
        self.retry_base = self.retry_base.max(Duration::from_millis(1));
        self.retry_max = self.retry_max.max(self.retry_base);
        self
    }
}
