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
    /// (the answer it waits for is the listener's NIC's, see
    /// [`Engine::connect_patience`]), and in any case within [`HANDSHAKE_TIMEOUT`] of
    /// NCCL's call.
    pub(super) fn reach_limit(&self, d: &Dial, now: Instant) -> Duration {
        match self.via_candidate(d) {
            Some(_) => d.left(now).min(reach(self.setup.completion_timeout)),
            None => d.left(now),
        }
    }

    /// More time for NCCL's connect `d` on `lane` at its deadline, up to
    /// [`HANDSHAKE_TIMEOUT`] from NCCL's call: the listener's NIC answered (`answered`:
    /// the fabric connected, so what is slow is a busy listener, which another pair would
    /// not help), the lane's path delivers other lanes' bytes, or no other pair is left to
    /// try.
    pub(super) fn connect_patience(
        &self,
        d: &Dial,
        lane: &Lane,
        answered: bool,
        now: Instant,
    ) -> Option<Duration> {
        let stay = answered || self.heard_lately(lane, now) || self.via_candidate(d).is_none();
        let left = d.left(now);
        (stay && !left.is_zero()).then_some(left)
    }

    /// Moves `d` to the next same-rail pair to try, NCCL's pair (or the one just tried)
    /// having failed with `why`. Returns whether there is one.
    pub(super) fn next_via(&self, d: &mut Dial, why: FailReason) -> bool {
        let Some((local, remote)) = self.via_candidate(d) else {
            return false;
        };
        d.tried.push((local, remote));
        let (nic, from) = d.target();
        let to = d.rescue.nics[remote].addr;
        tracing::info!(
            "railover: connect to {} from NIC {}: {why:?} on {nic}->{from}; trying NIC {local}->{to} (same rail) instead",
            d.to,
            d.nic,
        );
        d.via = Some(Via {
            local,
            to,
            why: d.via.map_or(why, |v| v.why),
        });
        true
    }

    /// The pair `d` would try next: a local NIC that is up and a listener NIC on the
    /// same rail, not yet dialled, the nearest to NCCL's device first (PCIe distance),
    /// undrained before drained.
    fn via_candidate(&self, d: &Dial) -> Option<(usize, usize)> {
        if d.tried.is_empty() {
            return None;
        }
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
            let nics = d.rescue.nics.iter().enumerate();
            for (r, _) in nics.filter(|(_, n)| n.rail == Some(rail)) {
                if d.tried.contains(&(l, r)) {
                    continue;
                }
                let far = distance.and_then(|x| x.get(l).copied().flatten());
                let rank = (l < 32 && drained & 1 << l != 0, far.is_none(), far, l, r);
                if best.as_ref().map_or(true, |(b, _)| rank < *b) {
                    best = Some((rank, (l, r)));
                }
            }
        }
        best.map(|(_, pair)| pair)
    }
}
