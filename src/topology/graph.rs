//! The PCIe tree NCCL builds, and path typing over it (`docs/design.md` §8.2).
//!
//! Nodes are CPUs (one per NUMA node), PCI switches (one node per switch: NCCL folds the
//! downstream and upstream ports into one node named after the upstream port) and devices
//! (GPUs, NICs). Every non-CPU node has one parent and one link to it, whose bandwidth is
//! that node's PCIe link. CPUs are joined pairwise by a SYS link.

use super::pci::PciAddr;
use super::{Path, PathType};

/// Inter-socket bandwidth assumed when nothing says better, in GB/s: NCCL's value for
/// Intel Sapphire Rapids (`SRP_QPI_BW`). sysfs does not show the CPU model.
pub const DEFAULT_INTER_SOCKET_GBPS: f64 = 22.0;

/// Index of a node in a [`Graph`].
pub(crate) type NodeIdx = usize;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NodeKind {
    Cpu {
        numa: i64,
    },
    /// `id` is NCCL's 64-bit PCI id: vendor, device, subsystem vendor, subsystem device,
    /// 16 bits each, used to recognise Broadcom switches.
    Switch {
        addr: PciAddr,
        id: u64,
    },
    Device {
        addr: Option<PciAddr>,
    },
    /// A switch level folded into its parent by [`Graph::flatten_bcm_switches`].
    Removed,
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub kind: NodeKind,
    pub parent: Option<NodeIdx>,
    /// Bandwidth of the link to `parent`, GB/s.
    pub up_gbps: f64,
}

/// The tree. Built by `sysfs` or `xml`, then read-only.
#[derive(Debug, Clone)]
pub(crate) struct Graph {
    nodes: Vec<Node>,
    pub inter_socket_gbps: f64,
}

impl Default for Graph {
    fn default() -> Self {
        Graph {
            nodes: Vec::new(),
            inter_socket_gbps: DEFAULT_INTER_SOCKET_GBPS,
        }
    }
}

impl Graph {
    /// The CPU node of `numa`, created on first use.
    pub fn cpu(&mut self, numa: i64) -> NodeIdx {
        if let Some(i) = self
            .nodes
            .iter()
            .position(|n| n.kind == NodeKind::Cpu { numa })
        {
            return i;
        }
        self.push(NodeKind::Cpu { numa }, None, 0.0)
    }

    /// Looks up the switch node for `addr` (function ignored, as NCCL does).
    pub fn find_switch(&self, addr: PciAddr) -> Option<NodeIdx> {
        let key = addr.without_function();
        self.nodes.iter().position(
            |n| matches!(n.kind, NodeKind::Switch { addr: a, .. } if a.without_function() == key),
        )
    }

    /// Adds a switch node under `parent` unless one for `addr` exists already.
    pub fn switch(&mut self, addr: PciAddr, id: u64, parent: NodeIdx, up_gbps: f64) -> NodeIdx {
        match self.find_switch(addr) {
            Some(i) => i,
            None => self.push(NodeKind::Switch { addr, id }, Some(parent), up_gbps),
        }
    }

    /// Adds a device node under `parent`. A device with an address shares its node with any
    /// other function of the same PCI device (NCCL merges the ports of a multi-function NIC).
    pub fn device(&mut self, addr: Option<PciAddr>, parent: NodeIdx, up_gbps: f64) -> NodeIdx {
        if let Some(key) = addr.map(PciAddr::without_function) {
            if let Some(i) = self.nodes.iter().position(|n| {
                matches!(n.kind, NodeKind::Device { addr: Some(a) } if a.without_function() == key)
            }) {
                return i;
            }
        }
        self.push(NodeKind::Device { addr }, Some(parent), up_gbps)
    }

    fn push(&mut self, kind: NodeKind, parent: Option<NodeIdx>, up_gbps: f64) -> NodeIdx {
        self.nodes.push(Node {
            kind,
            parent,
            up_gbps,
        });
        self.nodes.len() - 1
    }

    /// The CPU (NUMA) node above `n`, if any.
    pub fn numa_of(&self, n: NodeIdx) -> Option<i64> {
        let chain = self.chain(n);
        match self.nodes[*chain.last()?].kind {
            NodeKind::Cpu { numa } => Some(numa),
            _ => None,
        }
    }

    /// NCCL's `ncclTopoFlattenBcmSwitches`: a Broadcom PEX switch shows itself as a
    /// two-level hierarchy although it switches at full bandwidth between all ports; fold
    /// each sub-switch carrying the same switch id into its parent switch.
    pub fn flatten_bcm_switches(&mut self) {
        for s in 0..self.nodes.len() {
            let NodeKind::Switch { id, .. } = self.nodes[s].kind else {
                continue;
            };
            let gen = bcm_gen(id, 0);
            if gen == 0 {
                continue;
            }
            let subs: Vec<NodeIdx> = (0..self.nodes.len())
                .filter(|&c| {
                    self.nodes[c].parent == Some(s)
                        && matches!(self.nodes[c].kind, NodeKind::Switch { id, .. } if bcm_gen(id, 1) == gen)
                })
                .collect();
            for sub in subs {
                for n in &mut self.nodes {
                    if n.parent == Some(sub) {
                        n.parent = Some(s);
                    }
                }
                self.nodes[sub].kind = NodeKind::Removed;
                self.nodes[sub].parent = None;
            }
        }
    }

    /// `n` followed by its ancestors up to the root.
    fn chain(&self, mut n: NodeIdx) -> Vec<NodeIdx> {
        let mut out = vec![n];
        while let Some(p) = self.nodes[n].parent {
            out.push(p);
            n = p;
        }
        out
    }

    /// The type of the link from `child` up to its parent (`docs/design.md` §8.2).
    fn up_link_type(&self, child: NodeIdx) -> PathType {
        let parent = self.nodes[child].parent.expect("caller checked the parent");
        match (&self.nodes[child].kind, &self.nodes[parent].kind) {
            (_, NodeKind::Cpu { .. }) | (NodeKind::Cpu { .. }, _) => PathType::Phb,
            (NodeKind::Switch { .. }, NodeKind::Switch { .. }) => PathType::Pxb,
            _ => PathType::Pix,
        }
    }

    /// The path between two device nodes, as NCCL types it: the type is the worst link
    /// type, the bandwidth the narrowest link, the hops the number of links. The same node
    /// twice (two ports of one NIC) is reported as PIX with zero hops: NCCL calls it LOC,
    /// which is below PIX and not on this crate's scale.
    pub fn path(&self, a: NodeIdx, b: NodeIdx) -> Path {
        if a == b {
            return Path {
                kind: PathType::Pix,
                hops: 0,
                bandwidth_gbps: self.nodes[a].up_gbps,
            };
        }
        let ca = self.chain(a);
        let cb = self.chain(b);
        // Lowest common ancestor: the first node of `ca` that is also in `cb`.
        let lca = ca.iter().copied().find(|x| cb.contains(x));
        let (up_a, up_b, sys) = match lca {
            Some(l) => (
                &ca[..ca.iter().position(|&x| x == l).unwrap_or(0)],
                &cb[..cb.iter().position(|&x| x == l).unwrap_or(0)],
                false,
            ),
            // Different roots: both climb to their CPU, and the CPUs share a SYS link.
            None => (&ca[..ca.len() - 1], &cb[..cb.len() - 1], true),
        };
        let mut kind = PathType::Pix;
        let mut bw = f64::INFINITY;
        let mut hops = 0;
        for &n in up_a.iter().chain(up_b) {
            kind = kind.max(self.up_link_type(n));
            bw = bw.min(self.nodes[n].up_gbps);
            hops += 1;
        }
        if sys {
            kind = PathType::Sys;
            bw = bw.min(self.inter_socket_gbps);
            hops += 1;
        }
        Path {
            kind,
            hops,
            bandwidth_gbps: bw,
        }
    }
}

/// NCCL's `getBcmGen`: 4 or 5 for a Broadcom PEX switch at this level of its internal
/// hierarchy, else 0.
fn bcm_gen(id: u64, level: u64) -> u32 {
    if id & 0xffff_ffff_ffff_f000 == 0x1000_c010_1000_a000 {
        4
    } else if id & 0xffff_ffff_ffff_f000 == (0x1000_c030_1000_0000 | (level * 0x1000)) {
        5
    } else {
        0
    }
}

/// NCCL's 64-bit PCI id from the four sysfs/XML id attributes (hex text such as `0x10de`).
pub(crate) fn pci_id(
    vendor: Option<&str>,
    device: Option<&str>,
    sub_vendor: Option<&str>,
    sub_device: Option<&str>,
) -> u64 {
    let h = |s: Option<&str>| -> u64 {
        s.and_then(|s| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
            .unwrap_or(0)
            & 0xffff
    };
    h(vendor) << 48 | h(device) << 32 | h(sub_vendor) << 16 | h(sub_device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> PciAddr {
        PciAddr::parse(s).unwrap()
    }

    #[test]
    fn cascaded_switches_give_pxb() {
        let mut g = Graph::default();
        let cpu = g.cpu(0);
        let top = g.switch(addr("0000:01:00.0"), 0, cpu, 24.0);
        let low = g.switch(addr("0000:03:00.0"), 0, top, 24.0);
        let gpu = g.device(Some(addr("0000:05:00.0")), low, 24.0);
        let nic = g.device(Some(addr("0000:06:00.0")), top, 12.0);
        let p = g.path(gpu, nic);
        assert_eq!(p.kind, PathType::Pxb);
        assert_eq!(p.hops, 3);
        assert_eq!(p.bandwidth_gbps, 12.0);
    }

    #[test]
    fn functions_of_one_device_share_a_node() {
        let mut g = Graph::default();
        let cpu = g.cpu(0);
        let a = g.device(Some(addr("0000:05:00.0")), cpu, 24.0);
        let b = g.device(Some(addr("0000:05:00.1")), cpu, 24.0);
        assert_eq!(a, b);
        assert_eq!(g.path(a, b).hops, 0);
    }

    #[test]
    fn bcm_gen4_sub_switch_is_folded() {
        let id = pci_id(
            Some("0x1000"),
            Some("0xc010"),
            Some("0x1000"),
            Some("0xa064"),
        );
        assert_eq!(bcm_gen(id, 0), 4);
        let mut g = Graph::default();
        let cpu = g.cpu(0);
        let top = g.switch(addr("0000:01:00.0"), id, cpu, 24.0);
        let sub = g.switch(addr("0000:03:00.0"), id, top, 24.0);
        let gpu = g.device(Some(addr("0000:05:00.0")), sub, 24.0);
        let nic = g.device(Some(addr("0000:06:00.0")), top, 24.0);
        assert_eq!(g.path(gpu, nic).kind, PathType::Pxb);
        g.flatten_bcm_switches();
        let p = g.path(gpu, nic);
        assert_eq!(p.kind, PathType::Pix);
        assert_eq!(p.hops, 2);
    }

    #[test]
    fn gen5_levels_differ_by_subsystem_device() {
        let top = pci_id(
            Some("0x1000"),
            Some("0xc030"),
            Some("0x1000"),
            Some("0x0100"),
        );
        let sub = pci_id(
            Some("0x1000"),
            Some("0xc030"),
            Some("0x1000"),
            Some("0x1100"),
        );
        assert_eq!(bcm_gen(top, 0), 5);
        assert_eq!(bcm_gen(sub, 1), 5);
        assert_eq!(bcm_gen(sub, 0), 0);
    }
}
