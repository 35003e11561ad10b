//! Backup candidates: which local NICs may take over a failed NIC's connections.
//!
//! A candidate `x` for a failed NIC `n` must pass two rules (DESIGN.md P2):
//!
//! * **Rail rule** ([`RailRule`]). On a rail-optimised cluster a backup *pair* (local `x`,
//!   remote `y`) must have `rail(x) == rail(y)`, or traffic would cross the spine. Seen
//!   from one node the remote end is not known yet; by the cluster convention every rail
//!   has a NIC on every node, so under [`RailRule::Same`] a local candidate is eligible
//!   when it has a known rail (the remote end is then the peer's NIC on that rail). A NIC
//!   without a rail is excluded. [`RailRule::Any`] accepts every NIC.
//! * **Distance limit** (a [`PathType`]): the path type from `n`'s nearest GPU (the GPU
//!   whose traffic `n` carried) to `x` must be ≤ the limit. NCCL's GPUDirect RDMA default is
//!   PXB: past it, traffic is staged through host memory. When the node has no GPU the
//!   path from `n` itself is used.
//!
//! Health (is the candidate's link up now?) is not a rule here: the routing layer probes at
//! failure time.

use std::fmt;

use serde::Serialize;

use super::{Device, NicId, Path, PathType, SettingError, Topology};

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

    /// Parses the value of the variable `var` (case-insensitive); the error names the
    /// variable, the value and the accepted values.
    pub fn from_setting(var: &str, value: &str) -> Result<RailRule, SettingError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "same" => Ok(RailRule::Same),
            "any" => Ok(RailRule::Any),
            _ => Err(SettingError {
                var: var.to_string(),
                value: value.to_string(),
                accepted: "same (backup pairs stay on one rail) or any".to_string(),
            }),
        }
    }
}

impl fmt::Display for RailRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a candidate is not eligible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Exclusion {
    /// Rail rule `same`, and the candidate has no rail.
    NoRail,
    /// The path from the reference device is `kind`, beyond `limit`.
    DistanceLimit { kind: PathType, limit: PathType },
    /// The candidate has no place in the PCI tree, so its distance is unknown and counted as
    /// beyond any limit short of SYS.
    UnknownDistance { limit: PathType },
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exclusion::NoRail => f.write_str("rail rule same: it has no rail"),
            Exclusion::DistanceLimit { kind, limit } => {
                write!(f, "distance limit {limit}: its path is {kind}")
            }
            Exclusion::UnknownDistance { limit } => {
                write!(f, "distance limit {limit}: its PCI distance is unknown")
            }
        }
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

    /// Every other NIC of the node as a backup candidate for `nic`, eligible ones first.
    /// Within each group the order is: path type from the reference device (nearest first),
    /// then bandwidth (widest first), then PCI order; unknown paths last.
    pub fn backup_candidates(&self, nic: NicId, rule: RailRule, limit: PathType) -> Vec<Candidate> {
        let reference = self.backup_reference(nic);
        let mut out: Vec<Candidate> = self
            .nic_ids()
            .filter(|&x| x != nic)
            .map(|x| {
                let path = self.path(reference, x);
                let excluded_by = if rule == RailRule::Same && self.nic(x).rail.is_none() {
                    Some(Exclusion::NoRail)
                } else {
                    match path {
                        Some(p) if p.kind > limit => Some(Exclusion::DistanceLimit {
                            kind: p.kind,
                            limit,
                        }),
                        None if limit < PathType::Sys => Some(Exclusion::UnknownDistance { limit }),
                        _ => None,
                    }
                };
                Candidate {
                    nic: x,
                    name: self.nic(x).name.clone(),
                    path,
                    excluded_by,
                }
            })
            .collect();
        out.sort_by(|a, b| {
            let key = |c: &Candidate| (c.excluded_by.is_some(), c.path.is_none());
            key(a)
                .cmp(&key(b))
                .then_with(|| match (a.path, b.path) {
                    (Some(pa), Some(pb)) => pa
                        .kind
                        .cmp(&pb.kind)
                        .then(pb.bandwidth_gbps.total_cmp(&pa.bandwidth_gbps)),
                    _ => std::cmp::Ordering::Equal,
                })
                .then(a.nic.cmp(&b.nic))
        });
        out
    }
}
