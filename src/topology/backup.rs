//! Pair eligibility: the static rules a backup NIC pair must pass (P2, `docs/design.md`
//! §5.2), in one place for the router (at failure time) and `railover doctor` (what the
//! router would do).
//!
//! * **Rail rule** ([`RailRule`]). On a rail-optimised cluster a backup pair (local `x`,
//!   remote `y`) must have `rail(x) == rail(y)`, both known, or traffic would cross the
//!   spine. [`RailRule::Any`] accepts every pair. Seen from one node (the doctor) the
//!   remote end is not known yet; by the cluster convention every rail has a NIC on every
//!   node, so the remote end is taken to be the peer's NIC on `x`'s rail.
//! * **Distance limit** (a [`PathType`]): the path type from the failed NIC's nearest GPU
//!   (the GPU whose traffic it carried; the failed NIC itself on a node without GPUs) to
//!   `x` must be <= the limit. NCCL's GPUDirect RDMA default is PXB: past it, traffic is
//!   staged through host memory. An **unknown** distance passes: the plugin cannot check
//!   it, so it allows the pair, ranks it as the limit itself (allowed, not preferred) and
//!   reports it once (`routing::Event::TopologyUnknown`).
//!
//! [`pair_eligibility`] applies both. Carrier and health (is the pair up and answering
//! now?) are run-time checks the router adds on top.

use std::fmt;

use serde::Serialize;

use super::{Device, NicId, Path, PathType, Topology};

/// Which NICs may back each other up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RailRule {
    /// Both ends of a backup pair on the same rail (see the module doc for one node).
    #[default]
    Same,
    /// Any NIC pair.
    Any,
}

impl RailRule {
    /// `same` or `any`, as `RAILOVER_RAIL_RULE` spells them.
    pub fn as_str(self) -> &'static str {
        match self {
            RailRule::Same => "same",
            RailRule::Any => "any",
        }
    }
}

impl fmt::Display for RailRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The static rule that excludes a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Exclusion {
    /// Rail rule `same`, and the two ends are not on one known rail.
    RailMismatch {
        local: Option<u32>,
        remote: Option<u32>,
    },
    /// The local NIC's path from the reference GPU is `kind`, beyond `limit`.
    DistanceLimit { kind: PathType, limit: PathType },
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Exclusion::RailMismatch { local: None, .. } => {
                f.write_str("rail rule same: the local NIC has no rail")
            }
            Exclusion::RailMismatch { remote: None, .. } => {
                f.write_str("rail rule same: the remote NIC has no rail")
            }
            Exclusion::RailMismatch {
                local: Some(l),
                remote: Some(r),
            } => write!(f, "rail rule same: local rail {l} != remote rail {r}"),
            Exclusion::DistanceLimit { kind, limit } => {
                write!(f, "distance limit {limit}: its path is {kind}")
            }
        }
    }
}

/// A pair the static rules allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Allowed {
    /// Where the pair ranks by distance: its own path type, or the limit itself when the
    /// distance is unknown.
    pub rank: PathType,
    /// The distance is unknown, so the limit was not applied (worth reporting).
    pub distance_unknown: bool,
}

/// The static rules for a backup pair: `rule` on the two ends' rails, then `limit` on the
/// local NIC's `distance` (path type from the failed NIC's GPU; `None` when unknown, which
/// passes: see the module doc). The error is the first rule that excludes the pair.
pub fn pair_eligibility(
    rule: RailRule,
    limit: PathType,
    local_rail: Option<u32>,
    remote_rail: Option<u32>,
    distance: Option<PathType>,
) -> Result<Allowed, Exclusion> {
    let rail_ok = match rule {
        RailRule::Any => true,
        RailRule::Same => local_rail.is_some() && local_rail == remote_rail,
    };
    if !rail_ok {
        return Err(Exclusion::RailMismatch {
            local: local_rail,
            remote: remote_rail,
        });
    }
    match distance {
        Some(kind) if kind > limit => Err(Exclusion::DistanceLimit { kind, limit }),
        Some(kind) => Ok(Allowed {
            rank: kind,
            distance_unknown: false,
        }),
        None => Ok(Allowed {
            rank: limit,
            distance_unknown: true,
        }),
    }
}

/// One possible backup for a failed NIC.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub nic: NicId,
    /// The candidate's name, for reports.
    pub name: String,
    /// The path from the reference device (the failed NIC's nearest GPU, or the failed NIC
    /// when there is no GPU) to the candidate; `None` when unknown.
    pub path: Option<Path>,
    /// `None` when the candidate is eligible.
    pub excluded_by: Option<Exclusion>,
    /// Eligible although its distance is unknown (the limit could not be applied).
    pub distance_unknown: bool,
}

impl Candidate {
    /// True when no rule excludes the candidate.
    pub fn eligible(&self) -> bool {
        self.excluded_by.is_none()
    }
}

impl Topology {
    /// The device backup distances for `nic` are measured from: its nearest GPU, or the NIC
    /// itself when there is no GPU (or it has no place in the PCI tree).
    pub fn backup_reference(&self, nic: NicId) -> Device {
        match self.nearest_gpu(nic) {
            Some((g, _)) => Device::Gpu(g),
            None => Device::Nic(nic),
        }
    }

    /// Every other NIC of the node as a backup candidate for `nic` under
    /// [`pair_eligibility`], the remote end taken as the peer's NIC on the candidate's rail.
    /// Eligible ones come first in the router's distance order (unknown distances rank as
    /// the limit), then by bandwidth (widest first) and PCI order; then the excluded ones.
    pub fn backup_candidates(&self, nic: NicId, rule: RailRule, limit: PathType) -> Vec<Candidate> {
        let reference = self.backup_reference(nic);
        let mut out: Vec<(Option<PathType>, Candidate)> = self
            .nic_ids()
            .filter(|&x| x != nic)
            .map(|x| {
                let path = self.path(reference, x);
                let rail = self.nic(x).rail;
                let verdict = pair_eligibility(rule, limit, rail, rail, path.map(|p| p.kind));
                let candidate = Candidate {
                    nic: x,
                    name: self.nic(x).name.clone(),
                    path,
                    excluded_by: verdict.err(),
                    distance_unknown: verdict.is_ok_and(|a| a.distance_unknown),
                };
                (verdict.ok().map(|a| a.rank), candidate)
            })
            .collect();
        out.sort_by(|(ra, a), (rb, b)| {
            let key = |r: &Option<PathType>, c: &Candidate| (r.is_none(), *r, c.path.is_none());
            key(ra, a)
                .cmp(&key(rb, b))
                .then_with(|| match (a.path, b.path) {
                    (Some(pa), Some(pb)) => pa
                        .kind
                        .cmp(&pb.kind)
                        .then(pb.bandwidth_gbps.total_cmp(&pa.bandwidth_gbps)),
                    _ => std::cmp::Ordering::Equal,
                })
                .then(a.nic.cmp(&b.nic))
        });
        out.into_iter().map(|(_, c)| c).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PathType::{Phb, Pix, Pxb, Sys};

    fn allowed(rank: PathType, distance_unknown: bool) -> Result<Allowed, Exclusion> {
        Ok(Allowed {
            rank,
            distance_unknown,
        })
    }

    #[test]
    fn an_unknown_distance_is_allowed_under_every_limit_and_ranks_as_the_limit() {
        for limit in PathType::ALL {
            for rule in [RailRule::Same, RailRule::Any] {
                assert_eq!(
                    pair_eligibility(rule, limit, Some(3), Some(3), None),
                    allowed(limit, true),
                    "{rule} {limit}"
                );
            }
        }
    }

    #[test]
    fn a_known_distance_passes_up_to_the_limit_and_no_further() {
        assert_eq!(
            pair_eligibility(RailRule::Any, Phb, None, None, Some(Phb)),
            allowed(Phb, false)
        );
        assert_eq!(
            pair_eligibility(RailRule::Any, Phb, None, None, Some(Pix)),
            allowed(Pix, false)
        );
        assert_eq!(
            pair_eligibility(RailRule::Any, Pxb, None, None, Some(Phb)),
            Err(Exclusion::DistanceLimit {
                kind: Phb,
                limit: Pxb
            })
        );
        assert_eq!(
            pair_eligibility(RailRule::Any, Sys, None, None, Some(Sys)),
            allowed(Sys, false)
        );
    }

    #[test]
    fn the_same_rail_rule_needs_one_known_rail_and_comes_before_distance() {
        let same = |l, r, d| pair_eligibility(RailRule::Same, Pix, l, r, d);
        assert_eq!(same(Some(1), Some(1), Some(Pix)), allowed(Pix, false));
        let mismatch = |local, remote| Err(Exclusion::RailMismatch { local, remote });
        assert_eq!(
            same(Some(1), Some(2), Some(Pix)),
            mismatch(Some(1), Some(2))
        );
        assert_eq!(same(None, None, None), mismatch(None, None));
        assert_eq!(same(Some(1), None, None), mismatch(Some(1), None));
        // Both rules broken: the rail rule is the one named.
        assert_eq!(
            same(Some(1), Some(2), Some(Sys)),
            mismatch(Some(1), Some(2))
        );
        // `any` ignores rails altogether.
        assert_eq!(
            pair_eligibility(RailRule::Any, Pix, None, Some(2), Some(Pix)),
            allowed(Pix, false)
        );
    }

    #[test]
    fn exclusions_say_which_rule_and_why() {
        let text = |e: Exclusion| e.to_string();
        assert_eq!(
            text(Exclusion::RailMismatch {
                local: None,
                remote: Some(1)
            }),
            "rail rule same: the local NIC has no rail"
        );
        assert_eq!(
            text(Exclusion::RailMismatch {
                local: Some(1),
                remote: None
            }),
            "rail rule same: the remote NIC has no rail"
        );
        assert_eq!(
            text(Exclusion::RailMismatch {
                local: Some(0),
                remote: Some(1)
            }),
            "rail rule same: local rail 0 != remote rail 1"
        );
        assert_eq!(
            text(Exclusion::DistanceLimit {
                kind: Sys,
                limit: Phb
            }),
            "distance limit PHB: its path is SYS"
        );
    }
}
