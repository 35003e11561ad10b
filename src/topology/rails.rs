//! Rails: which NICs of different nodes are wired to the same leaf switch.
//!
//! A NIC's rail comes from, in order of precedence:
//! 1. `RAILOVER_RAILS`: a comma-separated list of `NIC:RAIL` pairs, e.g.
//!    `mlx5_0:0,mlx5_1:1`. `NIC` is a NIC name (`mlx5_0`, `mlx5_0:2` for port 2 of a
//!    multi-port device) or its netdev name; `RAIL` an integer from 0 to 2147483647. It
//!    must name every NIC of the node.
//! 2. `rail` attributes in the topology XML (on `net`, or on `nic` for all its ports): if any
//!    NIC has one, every NIC must.
//! 3. The automatic rule: **the i-th NIC in PCI order is rail i** (ports of one device in
//!    port order). This matches rail-optimised servers (DGX and HGX designs), which wire NIC
//!    *i* of every node to leaf switch *i*. A NIC with no PCI address (a virtual interface)
//!    has no PCI order and gets no rail.
//!
//! A map that names a NIC twice with different rails, names a NIC the node does not have,
//! or leaves a NIC out is an error naming that NIC.

use serde::Serialize;
use thiserror::Error;

use super::{NicId, Topology};

/// The largest rail number: the handshake carries a NIC's rail as a signed 32-bit number
/// (-1 for none), so a larger one would reach the peer as no rail or as a malformed frame.
pub const MAX_RAIL: u32 = i32::MAX as u32;

/// Where the rails of a [`Topology`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RailSource {
    /// The i-th NIC in PCI order is rail i.
    Automatic,
    /// `rail` attributes of the topology XML.
    Xml,
    /// An explicit map (`RAILOVER_RAILS`).
    Env,
}

impl RailSource {
    /// A short description for reports.
    pub fn describe(self) -> &'static str {
        match self {
            RailSource::Automatic => "automatic: the i-th NIC in PCI order is rail i",
            RailSource::Xml => "rail attributes of the topology XML",
            RailSource::Env => "RAILOVER_RAILS",
        }
    }
}

/// A rail map that could not be applied. Every variant names the NIC at fault.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RailError {
    /// An entry is not `NIC:RAIL`.
    #[error(
        "{var}={value:?} is not valid: entry {entry:?} is not NIC:RAIL; accepted: a \
         comma-separated list of NIC:RAIL pairs, RAIL a number from 0 to 2147483647, e.g. \
         mlx5_0:0,mlx5_1:1"
    )]
    Syntax {
        var: String,
        value: String,
        entry: String,
    },
    /// The same NIC is given two different rails.
    #[error("{origin}: NIC {nic} is given rail {first} and also rail {second}")]
    Conflict {
        origin: String,
        nic: String,
        first: u32,
        second: u32,
    },
    /// The map names a NIC this node does not have.
    #[error("{origin}: {nic} is not a NIC on this node (NICs here: {known})")]
    UnknownNic {
        origin: String,
        nic: String,
        known: String,
    },
    /// The map leaves NICs without a rail.
    #[error(
        "{origin} gives no rail for {}: a rail map must name every NIC (or leave rails to \
         the automatic rule: the i-th NIC in PCI order is rail i)",
        missing.join(", ")
    )]
    Partial {
        origin: String,
        missing: Vec<String>,
    },
}

/// A parsed rail map: NIC name → rail, in the order given. Conflicts within the map are
/// rejected when it is built; whether the names exist is checked when it is applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailMap {
    entries: Vec<(String, u32)>,
}

impl RailMap {
    /// Parses `NIC:RAIL,NIC:RAIL,…` given as the variable `var` (which error messages
    /// name). Empty entries are ignored, so a trailing comma is fine; an empty value gives
    /// an empty map, which callers treat as "not set". Nothing is trimmed: NIC names hold
    /// no blanks, and `RAIL` is plain decimal digits (no sign, no blanks, no newline).
    pub fn parse(var: &str, value: &str) -> Result<RailMap, RailError> {
        let mut map = RailMap::default();
        for entry in value.split(',').filter(|e| !e.is_empty()) {
            let syntax = || RailError::Syntax {
                var: var.to_string(),
                value: value.to_string(),
                entry: entry.to_string(),
            };
            let (nic, rail) = entry.rsplit_once(':').ok_or_else(syntax)?;
            if rail.is_empty() || !rail.bytes().all(|b| b.is_ascii_digit()) {
                return Err(syntax());
            }
            let rail: u32 = rail.parse().map_err(|_| syntax())?;
            if nic.is_empty() || nic.contains(char::is_whitespace) || rail > MAX_RAIL {
                return Err(syntax());
            }
            map.insert(var, nic, rail)?;
        }
        Ok(map)
    }

    /// Adds `nic → rail`; a second, different rail for the same name is a conflict
    /// reported against `origin`.
    pub fn insert(&mut self, origin: &str, nic: &str, rail: u32) -> Result<(), RailError> {
        match self.entries.iter().find(|(n, _)| n == nic) {
            Some(&(_, first)) if first != rail => Err(RailError::Conflict {
                origin: origin.to_string(),
                nic: nic.to_string(),
                first,
                second: rail,
            }),
            Some(_) => Ok(()),
            None => {
                self.entries.push((nic.to_string(), rail));
                Ok(())
            }
        }
    }

    /// The entries, in the order given.
    pub fn entries(&self) -> &[(String, u32)] {
        &self.entries
    }

    /// True when the map has no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Topology {
    /// Applies a complete rail map. On error nothing changes. `source` says where the map
    /// came from and is what [`Topology::rail_source`] reports afterwards.
    pub fn apply_rails(&mut self, map: &RailMap, source: RailSource) -> Result<(), RailError> {
        let origin = match source {
            RailSource::Env => "RAILOVER_RAILS",
            RailSource::Xml => "topology XML",
            RailSource::Automatic => "automatic rail map",
        };
        let mut rails: Vec<Option<u32>> = vec![None; self.nics.len()];
        for (name, rail) in map.entries() {
            let id = self
                .nic_by_name(name)
                .ok_or_else(|| RailError::UnknownNic {
                    origin: origin.to_string(),
                    nic: name.clone(),
                    known: self.nic_names(),
                })?;
            match rails[id.0] {
                // Named twice (e.g. by NIC name and by netdev name) with different rails.
                Some(first) if first != *rail => {
                    return Err(RailError::Conflict {
                        origin: origin.to_string(),
                        nic: self.nics[id.0].name.clone(),
                        first,
                        second: *rail,
                    })
                }
                _ => rails[id.0] = Some(*rail),
            }
        }
        let missing: Vec<String> = self
            .nics
            .iter()
            .zip(&rails)
            .filter(|(_, r)| r.is_none())
            .map(|(n, _)| n.name.clone())
            .collect();
        if !missing.is_empty() {
            return Err(RailError::Partial {
                origin: origin.to_string(),
                missing,
            });
        }
        for (nic, rail) in self.nics.iter_mut().zip(rails) {
            nic.rail = rail;
        }
        self.rail_source = source;
        Ok(())
    }

    /// Applies the value of `RAILOVER_RAILS` when it is set and not empty; otherwise keeps
    /// the rails the topology was built with (XML or automatic).
    pub fn apply_rail_env(&mut self, value: Option<&str>) -> Result<(), RailError> {
        let Some(value) = value else { return Ok(()) };
        let map = RailMap::parse("RAILOVER_RAILS", value)?;
        if map.is_empty() {
            return Ok(());
        }
        self.apply_rails(&map, RailSource::Env)
    }

    /// The automatic rule: the i-th NIC in PCI order is rail i; NICs without a PCI address
    /// get none.
    pub(crate) fn assign_automatic_rails(&mut self) {
        let mut next = 0;
        for nic in &mut self.nics {
            nic.rail = nic.pci_addr.map(|_| {
                next += 1;
                next - 1
            });
        }
        self.rail_source = RailSource::Automatic;
    }

    /// NICs sharing `rail`, in PCI order.
    pub fn nics_on_rail(&self, rail: u32) -> Vec<NicId> {
        self.nic_ids()
            .filter(|&n| self.nics[n.0].rail == Some(rail))
            .collect()
    }

    fn nic_names(&self) -> String {
        let names: Vec<&str> = self.nics.iter().map(|n| n.name.as_str()).collect();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_multi_port_names() {
        let m = RailMap::parse("RAILOVER_RAILS", "mlx5_0:0,mlx5_1:2:1,").unwrap();
        assert_eq!(
            m.entries(),
            &[("mlx5_0".to_string(), 0), ("mlx5_1:2".to_string(), 1)]
        );
        assert!(RailMap::parse("RAILOVER_RAILS", "").unwrap().is_empty());
    }

    #[test]
    fn nothing_is_trimmed_and_rails_are_plain_digits() {
        for bad in [
            " mlx5_0:0",
            "mlx5_0:0 ",
            "mlx5_0:0, mlx5_1:1",
            "mlx5_0 :0",
            "mlx5_0: 0",
            "mlx5_0:+0",
            "mlx5_0:0\n",
            "mlx5_0:0x1",
            "  ",
        ] {
            let e = RailMap::parse("RAILOVER_RAILS", bad).unwrap_err();
            assert!(matches!(e, RailError::Syntax { .. }), "{bad:?}: {e}");
        }
    }

    #[test]
    fn syntax_errors_name_variable_value_and_format() {
        let e = RailMap::parse("RAILOVER_RAILS", "mlx5_0:0,mlx5_1").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("RAILOVER_RAILS"), "{text}");
        assert!(text.contains("\"mlx5_0:0,mlx5_1\""), "{text}");
        assert!(text.contains("NIC:RAIL"), "{text}");
        assert!(RailMap::parse("RAILOVER_RAILS", "mlx5_0:-1").is_err());
        assert!(RailMap::parse("RAILOVER_RAILS", ":1").is_err());
    }

    #[test]
    fn conflicting_entries_name_the_nic() {
        let e = RailMap::parse("RAILOVER_RAILS", "mlx5_0:0,mlx5_0:3").unwrap_err();
        assert_eq!(
            e,
            RailError::Conflict {
                origin: "RAILOVER_RAILS".into(),
                nic: "mlx5_0".into(),
                first: 0,
                second: 3
            }
        );
        assert!(e.to_string().contains("mlx5_0"));
        // Repeating the same pair is harmless.
        assert!(RailMap::parse("RAILOVER_RAILS", "mlx5_0:0,mlx5_0:0").is_ok());
    }
}
