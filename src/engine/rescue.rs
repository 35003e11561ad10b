//! Connects that NCCL's own pair cannot carry. NCCL connects lazily (p2p peers on first
//! use, communicators created mid-job), always from the device it picked to the
//! listener's NIC it picked: after a NIC, port or cable fails, every later connect on
//! that device index would fail, and with it the job. So a connect whose local carrier
//! is down, or whose listener's NIC does not answer within [`reach_limit`], goes over a
//! same-rail pair of healthy NICs instead, to the listener process's failover listener,
//! naming NCCL's listener by its id and proving its token as it would have: nothing
//! about authentication changes. The comm keeps NCCL's pair as its original: the router
//! moves its stripes off it at once, as for any failover, and home when it heals.

use super::*;

/// The least time a connect waits for the listener's NIC to answer (a TCP handshake,
/// a verbs bootstrap) before it tries another pair: long enough for two lost SYNs.
const REACH_LEAST: Duration = Duration::from_secs(4);

/// How long an attempt may go without an answer from the listener's NIC before the
/// connect moves to another pair: [`REACH_LEAST`], or twice the completion timeout on a
/// fabric slow enough to need a longer one.
fn reach(completion_timeout: Duration) -> Duration {
    REACH_LEAST.max(completion_timeout * 2)
}

impl Engine {
    /// Why local NIC `nic` cannot carry a new connect: its carrier is down (or cut by
    /// fault injection).
    pub(super) fn nic_unusable(&self, nic: usize) -> Option<FailReason> {
        (self.nic_cut(nic) || self.router.nic_down(NicId(nic as u32)))
            .then_some(FailReason::LinkDown)
    }

    /// The deadline of an attempt of `d`: [`reach`] while another pair is left to try
    /// (the answer it waits for is the listener's NIC's, see [`Engine::dial_patience`]),
    /// and in any case within [`HANDSHAKE_TIMEOUT`] of NCCL's call.
    pub(super) fn reach_limit(&self, d: &Dial, now: Instant) -> Duration {
        let left = (d.since + HANDSHAKE_TIMEOUT).saturating_duration_since(now);
        match self.via_candidate(d) {
            Some(_) => left.min(reach(self.setup.completion_timeout)),
            None => left,
        }
    }

    /// More time for connecting lane `k` at its deadline, up to [`HANDSHAKE_TIMEOUT`]
    /// from NCCL's call: the listener's NIC answered (the fabric connected, so what is
    /// slow is a busy listener, which another pair would not help), its path delivers
    /// other lanes' bytes, or no other pair is left to try.
    pub(super) fn dial_patience(&self, k: usize, now: Instant, io: &dyn Io) -> Option<Duration> {
        let lane = self.lanes.get(k).filter(|l| l.m.deadline_due(now))?;
        let Role::Connecting(d) = &lane.role else {
            return None;
        };
        let left = (d.since + HANDSHAKE_TIMEOUT).saturating_duration_since(now);
        let heard = (lane.path().and_then(|p| self.paths.last_heard(p)))
            .is_some_and(|t| now.saturating_duration_since(t) < self.setup.completion_timeout);
        let stay = io.peer(k).is_some() || heard || self.via_candidate(d).is_none();
        (stay && !left.is_zero()).then_some(left)
    }

    /// Moves `d` to the next same-rail pair to try, NCCL's pair (or the one just tried)
    /// having failed with `why`. Returns whether there is one.
    pub(super) fn next_via(&self, d: &mut Dial, why: FailReason) -> bool {
        let Some((local, remote)) = self.via_candidate(d) else {
            return false;
        };
        let (nic, to) = d.target();
        if let Some(r) = d.rescue.nics.iter().position(|n| n.addr.ip() == to.ip()) {
            d.tried.push((nic, r));
        }
        let to = d.rescue.nics[remote].addr;
        tracing::info!(
            "railover: connect to {} from NIC {}: {why:?} on {nic}->{}; trying NIC {local}->{to} (same rail) instead",
            d.to,
            d.nic,
            d.target().1
        );
        d.via = Some(Via {
            local,
            remote,
            to,
            why: d.via.map_or(why, |v| v.why),
        });
        true
    }

    /// The pair `d` would try next: a local NIC that is up and a listener NIC on the
    /// same rail, neither NCCL's pair nor one tried, the nearest to NCCL's device first
    /// (PCIe distance), undrained before drained.
    fn via_candidate(&self, d: &Dial) -> Option<(usize, usize)> {
        let nics = &d.rescue.nics;
        let nccl = (d.nic, nics.iter().position(|n| n.addr.ip() == d.to.ip())?);
        let current = d.via.map_or(nccl, |v| (v.local, v.remote));
        let distance = self.setup.distance.get(d.nic);
        let drained = self.drained_mask();
        let mut best = None;
        for (l, local) in self.setup.nics.iter().enumerate() {
            let Some(rail) = local.rail else {
                continue;
            };
            if self.nic_unusable(l).is_some() {
                continue;
            }
            for (r, _) in (nics.iter().enumerate()).filter(|(_, n)| n.rail == Some(rail)) {
                let pair = (l, r);
                if pair == nccl || pair == current || d.tried.contains(&pair) {
                    continue;
                }
                let far = distance.and_then(|x| x.get(l).copied().flatten());
                let rank = (l < 32 && drained & 1 << l != 0, far.is_none(), far, l, r);
                if best.as_ref().map_or(true, |(b, _)| rank < *b) {
                    best = Some((rank, pair));
                }
            }
        }
        best.map(|(_, pair)| pair)
    }
}
