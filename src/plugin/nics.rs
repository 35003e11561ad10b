//! What the runtime knows about its NICs beyond the interface list: rails and PCIe
//! distances, from `RAILOVER_RAILS`, the topology, or the automatic rule.

use crate::config::Config;
use crate::topology::{PathType, Topology};
use crate::transport::tcp::TcpNic;

use super::Error;

/// Rails for `nics`, in order of precedence:
/// 1. `RAILOVER_RAILS`, which must then name every NIC;
/// 2. the topology's rails, when it knows one for every NIC;
/// 3. the automatic rule: the i-th NIC in PCI order (virtual NICs after, by name) is rail i.
pub fn rails(
    nics: &[TcpNic],
    cfg: &Config,
    topo: Option<&Topology>,
) -> Result<Vec<Option<u32>>, Error> {
    if let Some(map) = &cfg.rails {
        return nics
            .iter()
            .map(|n| {
                map.entries().iter().find(|(name, _)| name == &n.name).map(|&(_, r)| Some(r)).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "RAILOVER_RAILS does not give a rail for NIC {}: every NIC railover uses needs one",
                        n.name
                    ))
                })
            })
            .collect();
    }
    if let Some(t) = topo {
        let from_topo: Vec<Option<u32>> = nics
            .iter()
            .map(|n| t.nic_by_name(&n.name).and_then(|id| t.nic(id).rail))
            .collect();
        if from_topo.iter().all(Option::is_some) && !from_topo.is_empty() {
            return Ok(from_topo);
        }
    }
    let mut order: Vec<usize> = (0..nics.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |n: &TcpNic| (n.pci_path.is_none(), n.pci_path.clone(), n.name.clone());
        key(&nics[a]).cmp(&key(&nics[b]))
    });
    let mut rails = vec![None; nics.len()];
    for (rail, &i) in order.iter().enumerate() {
        rails[i] = Some(rail as u32);
    }
    Ok(rails)
}

/// `distance[n][x]`: the PCIe path type from NIC `n`'s nearest GPU (or from `n` itself on
/// a node without GPUs) to NIC `x`; `None` where the topology does not place them.
pub fn distances(nics: &[TcpNic], topo: Option<&Topology>) -> Vec<Vec<Option<PathType>>> {
    let Some(t) = topo else {
        return vec![vec![None; nics.len()]; nics.len()];
    };
    let ids: Vec<_> = nics.iter().map(|n| t.nic_by_name(&n.name)).collect();
    ids.iter()
        .map(|from| {
            ids.iter()
                .map(|to| {
                    let (from, to) = ((*from)?, (*to)?);
                    t.path(t.backup_reference(from), to).map(|p| p.kind)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn nic(name: &str, pci: Option<&str>) -> TcpNic {
        TcpNic {
            name: name.into(),
            ip: "10.0.0.1".parse().unwrap(),
            pci_path: pci.map(String::from),
            speed_mbps: 10_000,
            loopback: false,
        }
    }

    fn cfg(rails: Option<&str>) -> Config {
        let map: HashMap<&str, String> = rails
            .map(|r| ("RAILOVER_RAILS", r.to_string()))
            .into_iter()
            .collect();
        Config::from_lookup(|k| map.get(k).cloned()).unwrap()
    }

    #[test]
    fn automatic_rule_orders_by_pci_then_name() {
        let nics = [
            nic("rv1", None),
            nic("eth1", Some("/sys/devices/pci0000:00/0000:00:05.0")),
            nic("rv0", None),
            nic("eth0", Some("/sys/devices/pci0000:00/0000:00:03.0")),
        ];
        assert_eq!(
            rails(&nics, &cfg(None), None).unwrap(),
            vec![Some(3), Some(1), Some(2), Some(0)]
        );
    }

    #[test]
    fn explicit_map_wins_and_must_be_complete() {
        let nics = [nic("rv0", None), nic("rv1", None)];
        assert_eq!(
            rails(&nics, &cfg(Some("rv0:5,rv1:4,other:1")), None).unwrap(),
            vec![Some(5), Some(4)]
        );
        let err = rails(&nics, &cfg(Some("rv0:5")), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rv1") && err.contains("RAILOVER_RAILS"),
            "{err}"
        );
    }

    #[test]
    fn unknown_topology_gives_unknown_distances() {
        let nics = [nic("a", None), nic("b", None)];
        assert_eq!(
            distances(&nics, None),
            vec![vec![None, None], vec![None, None]]
        );
    }
}
