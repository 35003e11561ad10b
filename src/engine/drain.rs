//! Drains: an operator moves traffic off a local NIC before touching it, and the process
//! says what it is doing (`docs/design.md` §5.8).
//!
//! A drain is a planned move, not a failure: the router moves every stripe on the NIC
//! with [`MoveReason::Drain`](crate::routing::MoveReason::Drain), and the engine carries
//! it out as a fail-back (the old lane carries the comm until the new one is welcomed,
//! then drains what it holds and retires), so nothing waits for detection and nothing is
//! sent twice. Peers hear of it through `Drained` frames on the receive comms, since the
//! sender of a comm is the end that chooses its pairs.

use std::time::Instant;

use super::Engine;
use crate::conn::comm::CommMachine;
use crate::conn::wire::{Header, Kind, HEADER_LEN};
use crate::handoff::operator::{CommCounts, Degraded, DrainSource, NicStatus, ProcessStatus};
use crate::routing::NicId;

/// Who holds one local NIC drained.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct DrainHold {
    socket: bool,
    file: bool,
}

impl DrainHold {
    /// Held by the control socket alone (tests set it without a second NIC).
    #[cfg(test)]
    pub(super) const SOCKET: DrainHold = DrainHold {
        socket: true,
        file: false,
    };

    pub(super) fn any(self) -> bool {
        self.socket || self.file
    }

    fn set(&mut self, source: DrainSource, on: bool) {
        match source {
            DrainSource::Socket => self.socket = on,
            DrainSource::File => self.file = on,
        }
    }

    fn sources(self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.socket {
            v.push(DrainSource::Socket.as_str());
        }
        if self.file {
            v.push(DrainSource::File.as_str());
        }
        v
    }
}

impl Engine {
    /// An operator drains (`on`) or undrains local NIC `i` through `source`. A drain is
    /// refused, changing nothing, when it would leave no NIC up and undrained, or a comm
    /// on the NIC with no other pair to go to; the error says which and why. Returns what
    /// happened, for the operator.
    pub fn drain(
        &mut self,
        i: usize,
        on: bool,
        source: DrainSource,
        now: Instant,
    ) -> Result<String, String> {
        let Some(name) = self.setup.nics.get(i).map(|n| n.name.clone()) else {
            return Err(format!("no NIC {i} here ({} NICs)", self.setup.nics.len()));
        };
        let mut hold = self.drained[i];
        hold.set(source, on);
        let was = self.drained[i].any();
        if hold.any() == was {
            self.drained[i] = hold;
            let state = if was { "drained" } else { "not drained" };
            return Ok(format!("{name} was already {state}"));
        }
        if on {
            let others = (0..self.setup.nics.len())
                .any(|j| j != i && self.nic_up[j] && !self.drained[j].any());
            if !others {
                return Err(format!(
                    "{name} is the last NIC here that is up and not drained; draining it would leave traffic nowhere to go"
                ));
            }
            if let Err(refused) = self.router.check_drain(NicId(i as u32), now) {
                return Err(format!("draining {name} would strand a comm: {refused}"));
            }
        }
        self.drained[i] = hold;
        self.routes_dirty = true;
        if on {
            self.router.handle_drain(NicId(i as u32), now);
        } else {
            self.router.handle_undrain(NicId(i as u32), now);
        }
        let told = self.tell_peers_drained();
        let verb = if on { "drained" } else { "undrained" };
        tracing::warn!(
            "railover: NIC {name} {verb} ({}); {told} receive comm(s) told their senders",
            source.as_str()
        );
        Ok(if on {
            format!("drained {name}: its traffic moves to other NICs")
        } else {
            format!("undrained {name}: traffic returns once its pairs pass the fail-back probes")
        })
    }

    /// Our drained NICs, a bit per index, as a `Drained` frame's `aux` says them.
    pub(super) fn drained_mask(&self) -> u32 {
        (self.drained.iter().enumerate())
            .filter(|(i, h)| *i < 32 && h.any())
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    /// The `Drained` frame that says [`Engine::drained_mask`] to a sender.
    pub(super) fn drained_frame(&self) -> [u8; HEADER_LEN] {
        Header {
            aux: self.drained_mask(),
            ..Header::new(Kind::Drained, 0, 0)
        }
        .encode()
    }

    /// Sends our drained NICs to the sender of every receive comm, on one of its lanes.
    /// Returns how many comms were told.
    fn tell_peers_drained(&mut self) -> usize {
        let frame = self.drained_frame();
        let mut told = 0;
        for (_, comm) in self.comms.iter() {
            if !matches!(comm.machine, CommMachine::Recv(_)) {
                continue;
            }
            let lane = (comm.path.lanes())
                .map(|(k, _)| k)
                .find(|&k| self.lanes.contains(k));
            if let Some(k) = lane {
                self.lanes[k].writer.push_ctrl(&frame);
                self.dirty.push(k);
                told += 1;
            }
        }
        told
    }

    /// The sender's side of a `Drained` frame on a lane of comm `c`: the peer's drained
    /// NICs are `mask`.
    pub(super) fn peer_drained(&mut self, c: usize, mask: u32, now: Instant) {
        let Some(route) = self.comms.get(c).and_then(|comm| comm.route) else {
            return;
        };
        let nics: Vec<NicId> = (0..32)
            .filter(|b| mask & (1 << b) != 0)
            .map(NicId)
            .collect();
        if self.router.handle_remote_drained(route.peer, &nics, now) {
            self.routes_dirty = true;
            tracing::info!(
                "railover: peer {} says its drained NICs are {nics:?}; lanes to them move",
                route.peer.0
            );
        }
    }

    /// What `railover status` shows of this process now.
    pub fn status(&self, now: Instant) -> ProcessStatus {
        let mut per_nic = vec![std::collections::BTreeSet::new(); self.setup.nics.len()];
        for (_, l) in self.lanes.iter() {
            if let (super::Role::Comm(c), Some(n)) = (&l.role, l.nic) {
                if let Some(set) = per_nic.get_mut(n) {
                    set.insert(*c);
                }
            }
        }
        let nics = (self.setup.nics.iter().enumerate())
            .map(|(i, n)| NicStatus {
                index: i,
                name: n.name.clone(),
                rail: n.rail,
                up: self.nic_up[i],
                drained: self.drained[i].any(),
                drained_by: self.drained[i].sources(),
                comms: per_nic[i].len(),
                capacity_mbit: (self.router.capacity(NicId(i as u32), now))
                    .map(|c| (c * 8.0 / 1e6).round() as u64),
            })
            .collect();
        let mut comms = CommCounts { send: 0, recv: 0 };
        let mut degraded = Vec::new();
        for (c, comm) in self.comms.iter() {
            match comm.machine {
                CommMachine::Send(_) => comms.send += 1,
                CommMachine::Recv(_) => comms.recv += 1,
            }
            let Some(since) = comm.path.away_since() else {
                continue;
            };
            let pairs: Vec<String> = (comm.path.lanes())
                .filter_map(|(_, l)| l.pair)
                .map(|p| {
                    let (local, remote) = self.pair_names(p);
                    format!("{local}->{remote}")
                })
                .collect();
            degraded.push(Degraded {
                comm: c,
                since_s: now.saturating_duration_since(since).as_secs_f64(),
                pairs: pairs.join(","),
            });
        }
        let stats = self.router.stats();
        ProcessStatus {
            nics,
            comms,
            failovers: crate::routing::FailReason::ALL
                .iter()
                .map(|&r| stats.failovers.get(r))
                .sum(),
            failbacks: stats.failbacks,
            drains: stats.drain_moves,
            degraded,
        }
    }
}
