//! What a schedule allows: when a comm may legitimately fail, when everything is healed,
//! and the bounds the run is held to.

use std::time::Duration;

use super::net::Link;
use super::schedule::{Action, Scenario};

/// The simulation's completion timeout, and the router's give-up window.
pub(crate) const COMPLETION_TIMEOUT: Duration = Duration::from_secs(1);
pub(crate) const GIVEUP: Duration = Duration::from_secs(3);
pub(crate) const HOLDDOWN_MAX: Duration = Duration::from_secs(4);
pub(crate) const FAILBACK_INTERVAL: Duration = Duration::from_millis(500);
pub(crate) const FAILBACK_PROBES: u32 = 3;

/// Every eligible pair faulted at once for this long: a comm may give up. Below the
/// give-up window by what a re-probe of a healed pair takes (backoff and probe).
pub(crate) const DEAD_FOR: Duration = Duration::from_millis(1500);

/// A request must finish this long after it was posted or after the last fault before
/// it finished, whichever is later: detection, the give-up window, the longest probe
/// deadline, and slack.
pub(crate) const HANG_BOUND: Duration = Duration::from_secs(10);

/// After the last fault heals, every surviving send comm is back on its original NIC
/// within this: the longest hold-down, the good probes, a detection, and slack.
pub(crate) fn failback_bound() -> Duration {
    HOLDDOWN_MAX
        + FAILBACK_INTERVAL * (FAILBACK_PROBES + 2)
        + COMPLETION_TIMEOUT
        + Duration::from_secs(2)
}

/// The faults on one NIC.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NicState {
    pub carrier_down: bool,
    pub hole_tx: bool,
    pub hole_rx: bool,
    pub slow: Option<u32>,
    /// Its rail's switch is dark (no carrier) or silent (a black hole both ways).
    pub switch_dark: bool,
    pub switch_silent: bool,
}

impl NicState {
    pub(crate) fn faulted(&self) -> bool {
        *self != NicState::default()
    }

    /// No carrier: the NIC's own, or its switch's port gone dark.
    pub(crate) fn carrier_lost(&self) -> bool {
        self.carrier_down || self.switch_dark
    }

    /// What the network makes of it: (transmit, receive).
    pub(crate) fn links(&self) -> (Link, Link) {
        let one = |hole: bool| {
            if self.carrier_lost() || self.switch_silent || hole {
                Link::Down
            } else if let Some(f) = self.slow {
                Link::Slow(f)
            } else {
                Link::Up
            }
        };
        (one(self.hole_tx), one(self.hole_rx))
    }
}

/// Per node, per NIC.
pub(crate) type State = Vec<Vec<NicState>>;

/// Applies `a` to `st`; `true` if it kills a node.
pub(crate) fn apply(st: &mut State, a: Action) -> bool {
    match a {
        Action::Carrier { node, nic, up } => st[node][nic].carrier_down = !up,
        Action::Hole {
            node,
            nic,
            tx,
            rx,
            on,
        } => {
            let s = &mut st[node][nic];
            if tx {
                s.hole_tx = on;
            }
            if rx {
                s.hole_rx = on;
            }
        }
        Action::Slow { node, nic, factor } => st[node][nic].slow = factor,
        Action::Kill { .. } => return true,
        // An operator's request: the links are as they were.
        Action::Drain { .. } => {}
        Action::Switch { rail, up, silent } => {
            for node in st.iter_mut() {
                if silent {
                    node[rail].switch_silent = !up;
                } else {
                    node[rail].switch_dark = !up;
                }
            }
        }
    }
    false
}

/// The pairs comm `c` may use: (its sender's NIC, its receiver's NIC).
pub(crate) fn eligible(s: &Scenario) -> Vec<(usize, usize)> {
    (0..s.nics)
        .flat_map(|a| (0..s.nics).map(move |b| (a, b)))
        .filter(|&(a, b)| s.rail_any || a == b)
        .collect()
}

/// Every NIC of every node healthy.
pub(crate) fn clean(s: &Scenario) -> State {
    vec![vec![NicState::default(); s.nics]; s.nodes]
}

/// Whether the schedule allows comm `c` to fail: one of its two nodes dies, every
/// eligible pair loses its carrier at one end at once (the router gives up at once), or
/// every eligible pair is faulted at once for [`DEAD_FOR`].
pub(crate) fn may_fail(s: &Scenario, c: usize) -> bool {
    let (from, to) = (s.comms[c].from, s.comms[c].to);
    let pairs = eligible(s);
    let mut st = clean(s);
    let mut dead_since: Option<Duration> = None;
    for (i, f) in s.faults.iter().enumerate() {
        if apply(&mut st, f.action) {
            match f.action {
                Action::Kill { node } if node != from && node != to => {}
                _ => return true,
            }
        }
        if s.faults.get(i + 1).is_some_and(|n| n.at == f.at) {
            continue; // judge the state once every fault of this instant is in
        }
        let cut_local = pairs.iter().all(|&(a, _)| st[from][a].carrier_lost());
        let cut_remote = pairs.iter().all(|&(_, b)| st[to][b].carrier_lost());
        if cut_local || cut_remote {
            return true;
        }
        let dead = pairs
            .iter()
            .all(|&(a, b)| st[from][a].faulted() || st[to][b].faulted());
        match (dead, dead_since) {
            (true, None) => dead_since = Some(f.at),
            (false, Some(t0)) => {
                if f.at - t0 >= DEAD_FOR {
                    return true;
                }
                dead_since = None;
            }
            _ => {}
        }
    }
    dead_since.is_some()
}

/// When the last fault was healed, if the schedule ends with every NIC clean and every
/// node alive.
pub(crate) fn healed_at(s: &Scenario) -> Option<Duration> {
    let mut st = clean(s);
    for f in &s.faults {
        if apply(&mut st, f.action) {
            return None;
        }
    }
    let clean = st.iter().flatten().all(|n| !n.faulted());
    clean.then(|| s.faults.last().map_or(Duration::ZERO, |f| f.at))
}
