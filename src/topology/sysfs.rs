//! Discovery from a sysfs tree, following NCCL's `xml.cc` (`docs/design.md` §8.2).
//!
//! Reads, under the root given (normally `/sys`):
//! * `class/infiniband/<dev>/`: `device` (the PCI device), `ports/<n>/{state,link_layer,
//!   rate,gids/*,gid_attrs/ndevs/*}`;
//! * `class/net/<if>/`: `device`, `carrier`, `operstate`, `speed`, `address`, `dev_port`,
//!   `type` (interfaces without a `device` link are virtual and skipped);
//! * `bus/pci/devices/*`: `class` and `vendor`, to find NVIDIA GPUs;
//! * for every PCI device and the bridges above it: `numa_node`, `max_link_speed`,
//!   `max_link_width`, and the ids `vendor`, `device`, `subsystem_vendor`,
//!   `subsystem_device` of switches (to recognise Broadcom switches, which NCCL flattens).
//!
//! Unreadable attributes become "unknown" rather than errors: sysfs files such as
//! `carrier` fail to read on a down interface by design.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::graph::{pci_id, Graph, NodeIdx};
use super::pci::{is_nccl_bdf, PciAddr, PcieLink};
use super::{Gpu, LinkState, Nic, NicKind, Parts, TopologyError};

/// Which NICs discovery lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fabric {
    /// RDMA ports when the node has at least one, else physical netdevs: the same choice
    /// NCCL makes between its IB and Socket transports.
    #[default]
    Auto,
    /// RDMA ports only.
    Rdma,
    /// Every physical netdev (those with a PCI `device`), including those under RDMA ports.
    Tcp,
}

const NVIDIA_VENDOR: &str = "0x10de";

/// A netdev as sysfs shows it.
struct Netdev {
    name: String,
    pci_path: PathBuf,
    state: LinkState,
    state_detail: String,
    speed_mbps: Option<u64>,
    address: Option<String>,
    dev_port: Option<u32>,
    link_layer: &'static str,
}

pub(crate) fn discover(root: &Path, fabric: Fabric) -> Result<Parts, TopologyError> {
    let netdevs = netdevs(root)?;
    let rdma = rdma_nics(root, &netdevs)?;
    let use_rdma = match fabric {
        Fabric::Auto => !rdma.is_empty(),
        Fabric::Rdma => true,
        Fabric::Tcp => false,
    };
    let nics: Vec<Nic> = if use_rdma {
        rdma
    } else {
        netdevs.iter().map(netdev_nic).collect()
    };

    let mut graph = Graph::default();
    let mut parts_nics = Vec::new();
    for nic in nics {
        let node = nic.pci_path.as_deref().map(|p| attach(&mut graph, p));
        parts_nics.push((nic, node));
    }
    let mut gpus = Vec::new();
    for path in gpu_paths(root)? {
        let Some(addr) = last_component(&path).and_then(PciAddr::parse) else {
            continue;
        };
        let node = attach(&mut graph, &path);
        gpus.push((
            Gpu {
                name: String::new(),
                pci_addr: addr,
                numa_node: numa(&path),
                pcie: Some(link_of(&path)),
                pci_path: Some(path),
            },
            node,
        ));
    }
    graph.flatten_bcm_switches();
    Ok(Parts {
        graph,
        nics: parts_nics,
        gpus,
    })
}

fn netdev_nic(n: &Netdev) -> Nic {
    Nic {
        name: n.name.clone(),
        device: n.name.clone(),
        port: None,
        kind: NicKind::Netdev,
        netdev: Some(n.name.clone()),
        pci_addr: last_component(&n.pci_path).and_then(PciAddr::parse),
        numa_node: numa(&n.pci_path),
        pcie: Some(link_of(&n.pci_path)),
        pci_path: Some(n.pci_path.clone()),
        link_layer: Some(n.link_layer.to_string()),
        state: n.state,
        state_detail: Some(n.state_detail.clone()),
        speed_mbps: n.speed_mbps,
        gids: Vec::new(),
        address: n.address.clone(),
        rail: None,
    }
}

fn netdevs(root: &Path) -> Result<Vec<Netdev>, TopologyError> {
    let dir = root.join("class/net");
    let mut out = Vec::new();
    for name in list_dir(&dir)? {
        let d = dir.join(&name);
        // Virtual interfaces (lo, bridges, veth) have no PCI device.
        let Some(pci_path) = pci_function(&d.join("device")) else {
            continue;
        };
        let carrier = attr(&d.join("carrier"));
        let operstate = attr(&d.join("operstate"));
        let state = match (carrier.as_deref(), operstate.as_deref()) {
            (Some("1"), _) => LinkState::Up,
            (Some("0"), _) => LinkState::Down,
            (_, Some("up")) => LinkState::Up,
            (_, Some("down" | "lowerlayerdown" | "notpresent")) => LinkState::Down,
            _ => LinkState::Unknown,
        };
        let state_detail = format!(
            "carrier {}, operstate {}",
            carrier.as_deref().unwrap_or("?"),
            operstate.as_deref().unwrap_or("?")
        );
        out.push(Netdev {
            speed_mbps: attr(&d.join("speed"))
                .and_then(|s| s.parse::<i64>().ok())
                .filter(|&s| s > 0)
                .map(|s| s as u64),
            address: attr(&d.join("address")),
            dev_port: attr(&d.join("dev_port")).and_then(|s| s.parse().ok()),
            link_layer: if attr(&d.join("type")).as_deref() == Some("32") {
                "InfiniBand"
            } else {
                "Ethernet"
            },
            name,
            pci_path,
            state,
            state_detail,
        });
    }
    Ok(out)
}

fn rdma_nics(root: &Path, netdevs: &[Netdev]) -> Result<Vec<Nic>, TopologyError> {
    let dir = root.join("class/infiniband");
    let mut out = Vec::new();
    for dev in list_dir(&dir)? {
        let d = dir.join(&dev);
        // Soft-RoCE (rxe) devices have no PCI device; they are NICs all the same.
        let pci_path = pci_function(&d.join("device"));
        let ports = numeric_entries(&d.join("ports"))?;
        let multi = ports.len() > 1;
        for (port, pdir) in ports {
            let state_text = attr(&pdir.join("state"));
            let state = match state_text.as_deref() {
                Some(s) if s.ends_with("ACTIVE") => LinkState::Up,
                Some(_) => LinkState::Down,
                None => LinkState::Unknown,
            };
            let netdev = port_netdev(&pdir, pci_path.as_deref(), port, netdevs);
            let nd = netdev
                .as_deref()
                .and_then(|n| netdevs.iter().find(|x| x.name == n));
            let mut gids = Vec::new();
            for (_, g) in numeric_entries(&pdir.join("gids"))? {
                if let Some(gid) = attr(&g) {
                    if gid.chars().any(|c| c != '0' && c != ':') {
                        gids.push(gid);
                    }
                }
            }
            out.push(Nic {
                name: if multi {
                    format!("{dev}:{port}")
                } else {
                    dev.clone()
                },
                device: dev.clone(),
                port: Some(port),
                kind: NicKind::Rdma,
                pci_addr: pci_path
                    .as_deref()
                    .and_then(last_component)
                    .and_then(PciAddr::parse),
                numa_node: pci_path.as_deref().and_then(numa),
                pcie: pci_path.as_deref().map(link_of),
                pci_path: pci_path.clone(),
                link_layer: attr(&pdir.join("link_layer")),
                state,
                state_detail: state_text,
                speed_mbps: attr(&pdir.join("rate"))
                    .and_then(|r| parse_rate_mbps(&r))
                    .or_else(|| nd.and_then(|n| n.speed_mbps)),
                gids,
                address: nd.and_then(|n| n.address.clone()),
                netdev,
                rail: None,
            });
        }
    }
    Ok(out)
}

/// The netdev of an RDMA port: the one its GID table names, else the netdev of the same
/// PCI function whose `dev_port` is `port - 1`, else the first of that function.
fn port_netdev(
    pdir: &Path,
    pci_path: Option<&Path>,
    port: u32,
    netdevs: &[Netdev],
) -> Option<String> {
    if let Some(n) = attr(&pdir.join("gid_attrs/ndevs/0")).filter(|n| !n.is_empty()) {
        return Some(n);
    }
    let pci_path = pci_path?;
    let same: Vec<&Netdev> = netdevs.iter().filter(|n| n.pci_path == pci_path).collect();
    same.iter()
        .find(|n| n.dev_port == Some(port - 1))
        .or(same.first())
        .map(|n| n.name.clone())
}

/// `"400 Gb/sec (4X NDR)"` → 400000; `"2.5 Gb/sec (1X SDR)"` → 2500.
fn parse_rate_mbps(rate: &str) -> Option<u64> {
    let gbps: f64 = rate.split_whitespace().next()?.parse().ok()?;
    Some((gbps * 1000.0).round() as u64)
}

fn gpu_paths(root: &Path) -> Result<Vec<PathBuf>, TopologyError> {
    let dir = root.join("bus/pci/devices");
    let mut out = Vec::new();
    for name in list_dir(&dir)? {
        let d = dir.join(&name);
        let class = attr(&d.join("class")).unwrap_or_default();
        let vendor = attr(&d.join("vendor")).unwrap_or_default();
        let display = class.starts_with("0x0300") || class.starts_with("0x0302");
        if vendor == NVIDIA_VENDOR && display {
            if let Ok(p) = fs::canonicalize(&d) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// The realpath of a `device` link, moved up to the PCI function it belongs to: a virtio
/// NIC's `device` is `…/0000:00:03.0/virtio2`, and the PCI function is its parent. `None`
/// when the link is missing or no PCI function lies above it.
fn pci_function(device_link: &Path) -> Option<PathBuf> {
    let real = fs::canonicalize(device_link).ok()?;
    real.ancestors()
        .find(|p| last_component(p).and_then(PciAddr::parse).is_some())
        .map(Path::to_path_buf)
}

/// Places the PCI device at `path` in the graph, creating the switches and CPU above it.
fn attach(graph: &mut Graph, path: &Path) -> NodeIdx {
    let parent = parent_node(graph, path);
    let addr = last_component(path).and_then(PciAddr::parse);
    graph.device(addr, parent, link_of(path).bandwidth_gbps)
}

/// NCCL's climb: the component two levels up is the parent PCI node (a switch, named after
/// its upstream port), unless either of the two components is not a bus/device address, in
/// which case the parent is the CPU of `path`'s `numa_node`.
fn parent_node(graph: &mut Graph, path: &Path) -> NodeIdx {
    let numa_id = attr(&path.join("numa_node"))
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(-1);
    let up1 = path
        .parent()
        .filter(|p| last_component(p).is_some_and(is_nccl_bdf));
    let up2 = up1
        .and_then(Path::parent)
        .filter(|p| last_component(p).is_some_and(is_nccl_bdf));
    let Some(usp) = up2 else {
        return graph.cpu(numa_id);
    };
    let Some(addr) = last_component(usp).and_then(PciAddr::parse) else {
        return graph.cpu(numa_id);
    };
    if let Some(s) = graph.find_switch(addr) {
        return s;
    }
    let parent = parent_node(graph, usp);
    let id = pci_id(
        attr(&usp.join("vendor")).as_deref(),
        attr(&usp.join("device")).as_deref(),
        attr(&usp.join("subsystem_vendor")).as_deref(),
        attr(&usp.join("subsystem_device")).as_deref(),
    );
    graph.switch(addr, id, parent, link_of(usp).bandwidth_gbps)
}

/// The link NCCL records for the device at `path`: the smaller of its own `max_link_*` and
/// those of the port above it (`../`).
fn link_of(path: &Path) -> PcieLink {
    let up = path.parent().unwrap_or(path);
    PcieLink::from_device_and_port(
        attr(&path.join("max_link_speed")).as_deref(),
        attr(&path.join("max_link_width")).as_deref(),
        attr(&up.join("max_link_speed")).as_deref(),
        attr(&up.join("max_link_width")).as_deref(),
    )
}

fn numa(path: &Path) -> Option<u32> {
    attr(&path.join("numa_node")).and_then(|s| s.parse::<u32>().ok())
}

fn last_component(p: &Path) -> Option<&str> {
    p.file_name().and_then(|s| s.to_str())
}

/// A sysfs attribute, trimmed; `None` when missing or unreadable.
fn attr(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Sorted entry names of a directory; a missing directory is empty.
fn list_dir(dir: &Path) -> Result<Vec<String>, TopologyError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(TopologyError::Io {
                path: dir.to_path_buf(),
                source: e,
            })
        }
    };
    let mut names = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| TopologyError::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        if let Some(n) = entry.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Entries of `dir` whose names are numbers (ports, GID indices), in numeric order.
fn numeric_entries(dir: &Path) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    let map: BTreeMap<u32, PathBuf> = list_dir(dir)?
        .into_iter()
        .filter_map(|n| n.parse::<u32>().ok().map(|i| (i, dir.join(&n))))
        .collect();
    Ok(map.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate_mbps("400 Gb/sec (4X NDR)"), Some(400_000));
        assert_eq!(parse_rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(parse_rate_mbps("garbage"), None);
    }
}
