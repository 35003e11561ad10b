//! Topology: pure data about NICs, GPUs, PCI paths, NUMA nodes and rails.
//! No sockets, no threads, no environment reads: every input (the sysfs root, an XML text,
//! a rail map) is an argument, so tests run on fixture trees.
//!
//! * [`Topology::discover`] reads a sysfs tree (`/sys`, or a fixture root);
//!   [`Topology::from_xml`] reads an `NCCL_TOPO_FILE`-style XML.
//! * [`Topology::path`] types the path between two devices exactly as NCCL does from the
//!   same sysfs (PIX < PXB < PHB < SYS), with hop count and bottleneck bandwidth.
//! * [`Topology::apply_rail_env`] / [`Topology::apply_rails`] and the automatic rule decide each NIC's rail
//!   (see [`rails`]).
//! * [`pair_eligibility`] is the static rule for a backup pair (rail rule, distance limit),
//!   shared by the router and the doctor; [`Topology::backup_candidates`] applies it to
//!   the NICs that may take over from a failed one (see [`backup`]).
//! * [`report`] turns all of that into the `railover doctor` report.
//!
//! # What this layer cannot see
//! Paths are PCIe-only. On a real machine NCCL may route a PHB/SYS GPU→NIC path through a
//! peer GPU over NVLink (PXN); sysfs does not show NVLink, so neither does this module.

pub mod backup;
// The tests' fixture trees live in testkit/; these unit tests cannot link that crate (it
// links a second copy of this library's exported tables), so they compile its file in.
// Not every builder method has a user among them.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../testkit/src/fixture.rs"]
mod fixture;
mod graph;
pub mod pci;
pub mod rails;
pub mod report;
mod sysfs;
mod xml;

use std::fmt;
use std::path::PathBuf;

use serde::{Serialize, Serializer};
use thiserror::Error;

pub use backup::{pair_eligibility, Allowed, Candidate, Exclusion, RailRule};
pub use graph::DEFAULT_INTER_SOCKET_GBPS;
pub use pci::{PciAddr, PcieLink};
pub use rails::{RailError, RailMap, RailSource};
pub use sysfs::Fabric;

use graph::{Graph, NodeIdx};

/// NCCL's ordered scale of PCIe path types (only the PCIe part of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathType {
    /// Both devices behind the same PCIe switch.
    Pix,
    /// Behind cascaded PCIe switches, without crossing a CPU.
    Pxb,
    /// Through the CPU's host bridge (same socket).
    Phb,
    /// Across the inter-socket link.
    Sys,
}

impl PathType {
    pub const ALL: [PathType; 4] = [PathType::Pix, PathType::Pxb, PathType::Phb, PathType::Sys];

    /// NCCL's name for the path type.
    pub fn as_str(self) -> &'static str {
        match self {
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
        }
    }

    /// Parses NCCL's name (case-insensitive).
    pub fn parse(s: &str) -> Option<PathType> {
        PathType::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for PathType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Why a topology could not be built.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// A sysfs directory that exists could not be listed or a link could not be resolved.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The topology XML is malformed or lacks a required attribute.
    #[error("topology XML: {0}")]
    Xml(String),
    /// The rail map (environment or XML) is inconsistent with the NICs.
    #[error(transparent)]
    Rail(#[from] RailError),
}

/// What a path between two devices looks like to NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Path {
    /// The worst link type on the path.
    pub kind: PathType,
    /// Links between the two PCI devices in the sysfs-derived graph (device → switch →
    /// CPU → CPU → switch → device). NCCL's extra NIC→NET and GPU→DEV links are not
    /// counted. Two ports of one NIC are 0 hops apart.
    pub hops: u32,
    /// The narrowest link on the path, GB/s (a PCIe link counts `width × rate / 80`; the
    /// inter-socket link counts [`Topology::inter_socket_gbps`]).
    pub bandwidth_gbps: f64,
}

/// Index of a NIC in [`Topology::nics`] (PCI order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct NicId(pub usize);

/// Index of a GPU in [`Topology::gpus`] (PCI order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct GpuId(pub usize);

/// A device at one end of a [`Path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Nic(NicId),
    Gpu(GpuId),
}

impl From<NicId> for Device {
    fn from(n: NicId) -> Device {
        Device::Nic(n)
    }
}

impl From<GpuId> for Device {
    fn from(g: GpuId) -> Device {
        Device::Gpu(g)
    }
}

/// Which transport a NIC serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NicKind {
    /// An RDMA device port (`/sys/class/infiniband/<dev>/ports/<n>`).
    Rdma,
    /// A plain network interface (`/sys/class/net/<if>`), carried over TCP.
    Netdev,
}

/// Link state of a port, as far as the source shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkState {
    /// RDMA port ACTIVE, or netdev carrier 1.
    Up,
    /// Anything else the source reported (DOWN, INIT, ARMED, carrier 0).
    Down,
    /// The source does not say (an XML topology, or an unreadable attribute).
    Unknown,
}

/// One NIC: an RDMA port, or a netdev where the node has no RDMA port (see [`Fabric`]).
#[derive(Debug, Clone, Serialize)]
pub struct Nic {
    /// Unique name: the RDMA device (`mlx5_0`) or netdev (`eth0`); a multi-port RDMA
    /// device gets `mlx5_0:2` per port (NCCL_IB_HCA's device:port syntax).
    pub name: String,
    /// The RDMA device or netdev name, without the port.
    pub device: String,
    /// RDMA port number, 1-based.
    pub port: Option<u32>,
    pub kind: NicKind,
    /// The netdev of this port (RoCE / IPoIB interface, or the NIC itself for
    /// [`NicKind::Netdev`]).
    pub netdev: Option<String>,
    pub pci_addr: Option<PciAddr>,
    /// Realpath of the PCI device directory in sysfs (under the sysfs root given).
    pub pci_path: Option<PathBuf>,
    /// `None` when sysfs says -1 (no NUMA information).
    pub numa_node: Option<u32>,
    /// The NIC's PCIe link to its parent (min of the device and the port above it).
    pub pcie: Option<PcieLink>,
    /// `InfiniBand` or `Ethernet` for RDMA ports; `Ethernet` for netdevs.
    pub link_layer: Option<String>,
    pub state: LinkState,
    /// The raw state text, e.g. `4: ACTIVE`, `carrier 0`.
    pub state_detail: Option<String>,
    /// Port speed, Mb/s (RDMA `rate`, else netdev `speed`).
    pub speed_mbps: Option<u64>,
    /// Non-zero GIDs of the port, in index order.
    pub gids: Vec<String>,
    /// Hardware address of the netdev (`address`). IP addresses are not in sysfs and are
    /// not collected here.
    pub address: Option<String>,
    /// Rail number, once known (see [`rails`]).
    pub rail: Option<u32>,
}

/// One NVIDIA GPU (PCI class 0x0300/0x0302, vendor 0x10de).
#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    /// `GPU<i>`, `i` in PCI order (what `CUDA_DEVICE_ORDER=PCI_BUS_ID` gives).
    pub name: String,
    pub pci_addr: PciAddr,
    pub pci_path: Option<PathBuf>,
    pub numa_node: Option<u32>,
    /// From sysfs `max_link_*`; NCCL reads the current link from NVML instead.
    pub pcie: Option<PcieLink>,
}

/// Where a topology came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Discovered under this sysfs root.
    Sysfs(PathBuf),
    /// Read from a topology XML (the text's origin, e.g. its file name).
    Xml(String),
}

/// A node's NICs and GPUs and the PCIe tree joining them. Immutable once built, apart from
/// rails ([`Topology::apply_rails`]) and the inter-socket bandwidth assumption.
#[derive(Debug, Clone)]
pub struct Topology {
    nics: Vec<Nic>,
    gpus: Vec<Gpu>,
    nic_nodes: Vec<Option<NodeIdx>>,
    gpu_nodes: Vec<NodeIdx>,
    graph: Graph,
    rail_source: RailSource,
    origin: Origin,
}

/// Parts handed over by a discoverer; [`Topology::assemble`] orders and names them.
pub(crate) struct Parts {
    pub graph: Graph,
    pub nics: Vec<(Nic, Option<NodeIdx>)>,
    pub gpus: Vec<(Gpu, NodeIdx)>,
}

impl Topology {
    /// Discovers NICs and GPUs under the sysfs root `sysfs_root` (normally `/sys`), choosing
    /// the fabric as NCCL does ([`Fabric::Auto`]) and the automatic rail rule.
    pub fn discover(sysfs_root: &std::path::Path) -> Result<Topology, TopologyError> {
        Topology::discover_fabric(sysfs_root, Fabric::Auto)
    }

    /// As [`Topology::discover`], with the NIC set chosen by `fabric`.
    pub fn discover_fabric(
        sysfs_root: &std::path::Path,
        fabric: Fabric,
    ) -> Result<Topology, TopologyError> {
        let parts = sysfs::discover(sysfs_root, fabric)?;
        let mut t = Topology::assemble(parts, Origin::Sysfs(sysfs_root.to_path_buf()));
        t.assign_automatic_rails();
        Ok(t)
    }

    /// Reads an `NCCL_TOPO_FILE`-style XML text. `origin` names it in errors (a file name).
    /// Rails come from `rail` attributes on `net` (or `nic`) elements when any is present;
    /// then every NIC must have one. Otherwise the automatic rule applies.
    pub fn from_xml(text: &str, origin: &str) -> Result<Topology, TopologyError> {
        let (parts, rails) = xml::parse(text)?;
        let mut t = Topology::assemble(parts, Origin::Xml(origin.to_string()));
        match rails {
            Some(map) => t.apply_rails(&map, RailSource::Xml)?,
            None => t.assign_automatic_rails(),
        }
        Ok(t)
    }

    fn assemble(parts: Parts, origin: Origin) -> Topology {
        let Parts {
            graph,
            mut nics,
            mut gpus,
        } = parts;
        nics.sort_by(|(a, _), (b, _)| {
            (a.pci_addr.is_none(), a.pci_addr, a.port, &a.name).cmp(&(
                b.pci_addr.is_none(),
                b.pci_addr,
                b.port,
                &b.name,
            ))
        });
        gpus.sort_by_key(|(g, _)| g.pci_addr);
        for (i, (g, _)) in gpus.iter_mut().enumerate() {
            g.name = format!("GPU{i}");
        }
        let (nics, nic_nodes) = nics.into_iter().unzip();
        let (gpus, gpu_nodes) = gpus.into_iter().unzip();
        Topology {
            nics,
            gpus,
            nic_nodes,
            gpu_nodes,
            graph,
            rail_source: RailSource::Automatic,
            origin,
        }
    }

    /// All NICs, in PCI order (NICs without a PCI address last, by name).
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// All GPUs, in PCI order.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The NIC `id`. Panics if `id` did not come from this topology.
    pub fn nic(&self, id: NicId) -> &Nic {
        &self.nics[id.0]
    }

    /// The GPU `id`. Panics if `id` did not come from this topology.
    pub fn gpu(&self, id: GpuId) -> &Gpu {
        &self.gpus[id.0]
    }

    /// NIC ids in PCI order.
    pub fn nic_ids(&self) -> impl Iterator<Item = NicId> {
        (0..self.nics.len()).map(NicId)
    }

    /// GPU ids in PCI order.
    pub fn gpu_ids(&self) -> impl Iterator<Item = GpuId> {
        (0..self.gpus.len()).map(GpuId)
    }

    /// Finds a NIC by its [`Nic::name`], or by its netdev name.
    pub fn nic_by_name(&self, name: &str) -> Option<NicId> {
        self.nics
            .iter()
            .position(|n| n.name == name)
            .or_else(|| {
                self.nics
                    .iter()
                    .position(|n| n.netdev.as_deref() == Some(name))
            })
            .map(NicId)
    }

    /// Finds a GPU by name (`GPU3`) or PCI address (`0000:1b:00.0`).
    pub fn gpu_by_name(&self, name: &str) -> Option<GpuId> {
        self.gpus
            .iter()
            .position(|g| g.name == name || g.pci_addr.to_string() == name)
            .map(GpuId)
    }

    /// Where this topology came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Where the NICs' rails came from.
    pub fn rail_source(&self) -> RailSource {
        self.rail_source
    }

    /// The inter-socket bandwidth assumed for SYS paths, GB/s.
    pub fn inter_socket_gbps(&self) -> f64 {
        self.graph.inter_socket_gbps
    }

    /// Replaces the inter-socket bandwidth assumption (default
    /// [`DEFAULT_INTER_SOCKET_GBPS`]), e.g. with NCCL's value for the CPU in use.
    pub fn set_inter_socket_gbps(&mut self, gbps: f64) {
        self.graph.inter_socket_gbps = gbps;
    }

    /// The path between two devices, or `None` when either has no place in the PCI tree
    /// (a NIC without a PCI device, such as a virtual interface). `path(a, a)` is 0 hops.
    pub fn path(&self, a: impl Into<Device>, b: impl Into<Device>) -> Option<Path> {
        let na = self.node_of(a.into())?;
        let nb = self.node_of(b.into())?;
        Some(self.graph.path(na, nb))
    }

    fn node_of(&self, d: Device) -> Option<NodeIdx> {
        match d {
            Device::Nic(n) => self.nic_nodes.get(n.0).copied().flatten(),
            Device::Gpu(g) => self.gpu_nodes.get(g.0).copied(),
        }
    }

    /// The GPU nearest to `nic`: smallest path type, then widest bandwidth, then fewest
    /// hops, then PCI order. `None` when the node has no GPU or the NIC has no PCI place.
    pub fn nearest_gpu(&self, nic: NicId) -> Option<(GpuId, Path)> {
        self.gpu_ids()
            .filter_map(|g| self.path(nic, g).map(|p| (g, p)))
            .min_by(|(ga, a), (gb, b)| {
                a.kind
                    .cmp(&b.kind)
                    .then(b.bandwidth_gbps.total_cmp(&a.bandwidth_gbps))
                    .then(a.hops.cmp(&b.hops))
                    .then(ga.cmp(gb))
            })
    }

    /// Copies what only a running system shows from `live` onto NICs of the same name: link
    /// state, and, where this topology lacks them, link layer, netdev, GIDs, address, speed,
    /// NUMA node and PCI path. For a topology read from XML, whose distances are NCCL's but
    /// which says nothing about link state. NICs `live` does not have are left as they are.
    pub fn merge_live_state(&mut self, live: &Topology) {
        for nic in &mut self.nics {
            let Some(id) = live.nic_by_name(&nic.name) else {
                continue;
            };
            let l = live.nic(id);
            nic.state = l.state;
            nic.state_detail.clone_from(&l.state_detail);
            nic.link_layer = nic.link_layer.take().or_else(|| l.link_layer.clone());
            nic.netdev = nic.netdev.take().or_else(|| l.netdev.clone());
            if nic.gids.is_empty() {
                nic.gids.clone_from(&l.gids);
            }
            nic.address = nic.address.take().or_else(|| l.address.clone());
            nic.speed_mbps = nic.speed_mbps.or(l.speed_mbps);
            nic.numa_node = nic.numa_node.or(l.numa_node);
            nic.pci_path = nic.pci_path.take().or_else(|| l.pci_path.clone());
        }
    }

    /// The NUMA node a NIC hangs from in the PCI tree (its CPU node), which is what NCCL
    /// uses; falls back to the NIC's own `numa_node`.
    pub fn nic_numa(&self, nic: NicId) -> Option<i64> {
        self.node_of(Device::Nic(nic))
            .and_then(|n| self.graph.numa_of(n))
            .or(self.nics[nic.0].numa_node.map(i64::from))
    }
}

#[cfg(test)]
mod tests;
