//! `NCCL_TOPO_FILE`-style topology XML (what `NCCL_TOPO_DUMP_FILE` writes).
//!
//! ```xml
//! <system version="1">
//!   <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
//!     <pci busid="0000:11:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
//!       <pci busid="0000:13:00.0" class="0x030200" vendor="0x10de" link_speed=".." link_width="16">
//!         <gpu dev="0" sm="90"/>
//!       </pci>
//!       <pci busid="0000:14:00.0" class="0x020700" link_speed=".." link_width="16">
//!         <nic><net name="mlx5_0" dev="0" port="1" speed="400000" rail="0"/></nic>
//!       </pci>
//!     </pci>
//!   </cpu>
//! </system>
//! ```
//!
//! The nesting is NCCL's graph itself: a `pci` element holding `pci` elements is a switch
//! node, one holding `gpu` is a GPU, one holding `nic` is a NIC with one `net` per port.
//! `link_speed`/`link_width` give each element's link to its parent. `rail` on `net` (or on
//! `nic`, for all its ports) is railover's extension; NCCL ignores unknown attributes.
//! Elements NCCL writes that say nothing about PCIe distance (`nvlink`, `c2c`) are skipped.

use roxmltree::{Document, Node};

use super::graph::{pci_id, Graph, NodeIdx};
use super::pci::{PciAddr, PcieLink};
use super::rails::{RailMap, MAX_RAIL};
use super::{Gpu, LinkState, Nic, NicKind, Parts, TopologyError};

/// NCCL's bandwidth for a NIC placed directly under a CPU (`LOC_BW`).
const LOC_GBPS: f64 = 5000.0;

struct Walk {
    graph: Graph,
    nics: Vec<(Nic, Option<NodeIdx>)>,
    gpus: Vec<(Gpu, NodeIdx)>,
    /// (NIC index, rail) for every NIC that carries a `rail` attribute.
    rails: Vec<(usize, u32)>,
}

pub(crate) fn parse(text: &str) -> Result<(Parts, Option<RailMap>), TopologyError> {
    let doc = Document::parse(text).map_err(|e| TopologyError::Xml(e.to_string()))?;
    let system = doc.root_element();
    if system.tag_name().name() != "system" {
        return Err(TopologyError::Xml(format!(
            "the root element is <{}>, expected <system>",
            system.tag_name().name()
        )));
    }
    let mut w = Walk {
        graph: Graph::default(),
        nics: Vec::new(),
        gpus: Vec::new(),
        rails: Vec::new(),
    };
    let mut cpu_bw = None;
    for cpu in system.children().filter(|n| n.has_tag_name("cpu")) {
        let numa: i64 = match cpu.attribute("numaid") {
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| err(&doc, cpu, &format!("numaid {v:?} is not a number")))?,
            None => -1,
        };
        cpu_bw = cpu_bw.or_else(|| inter_socket_gbps(cpu));
        let idx = w.graph.cpu(numa);
        let numa_node = u32::try_from(numa).ok();
        for child in cpu.children().filter(Node::is_element) {
            walk(&doc, &mut w, child, idx, numa_node)?;
        }
    }
    if let Some(bw) = cpu_bw {
        w.graph.inter_socket_gbps = bw;
    }
    w.graph.flatten_bcm_switches();
    name_multi_port_nics(&mut w.nics);

    let rails = if w.rails.is_empty() {
        None
    } else {
        let mut map = RailMap::default();
        for &(i, rail) in &w.rails {
            map.insert("topology XML", &w.nics[i].0.name, rail)?;
        }
        Some(map)
    };
    Ok((
        Parts {
            graph: w.graph,
            nics: w.nics,
            gpus: w.gpus,
        },
        rails,
    ))
}

fn walk(
    doc: &Document,
    w: &mut Walk,
    el: Node,
    parent: NodeIdx,
    numa: Option<u32>,
) -> Result<(), TopologyError> {
    match el.tag_name().name() {
        "pci" => {
            let busid = el
                .attribute("busid")
                .ok_or_else(|| err(doc, el, "<pci> without busid"))?;
            let addr = PciAddr::parse(busid.trim())
                .ok_or_else(|| err(doc, el, &format!("busid {busid:?} is not DDDD:BB:DD.F")))?;
            let link = PcieLink::from_attrs(el.attribute("link_speed"), el.attribute("link_width"));
            let bw = link.bandwidth_gbps;
            let has = |tag: &str| el.children().any(|c| c.has_tag_name(tag));
            let is_nvidia_gpu = el.attribute("vendor") == Some("0x10de")
                && el
                    .attribute("class")
                    .is_some_and(|c| c.starts_with("0x0300") || c.starts_with("0x0302"));
            if has("gpu") || (is_nvidia_gpu && !has("pci")) {
                let node = w.graph.device(Some(addr), parent, bw);
                w.gpus.push((
                    Gpu {
                        name: String::new(),
                        pci_addr: addr,
                        pci_path: None,
                        numa_node: numa,
                        pcie: Some(link),
                    },
                    node,
                ));
            } else if has("nic") {
                let node = w.graph.device(Some(addr), parent, bw);
                for nic in el.children().filter(|c| c.has_tag_name("nic")) {
                    add_nic(doc, w, nic, Some(node), Some(addr), Some(&link), numa)?;
                }
            } else {
                let id = pci_id(
                    el.attribute("vendor"),
                    el.attribute("device"),
                    el.attribute("subsystem_vendor"),
                    el.attribute("subsystem_device"),
                );
                let node = w.graph.switch(addr, id, parent, bw);
                for child in el.children().filter(Node::is_element) {
                    walk(doc, w, child, node, numa)?;
                }
            }
        }
        "nic" => {
            // A NIC with no PCI device (NCCL hangs it off the CPU at LOC_BW).
            let node = w.graph.device(None, parent, LOC_GBPS);
            add_nic(doc, w, el, Some(node), None, None, numa)?;
        }
        _ => {}
    }
    Ok(())
}

fn add_nic(
    doc: &Document,
    w: &mut Walk,
    nic: Node,
    node: Option<NodeIdx>,
    addr: Option<PciAddr>,
    link: Option<&PcieLink>,
    numa: Option<u32>,
) -> Result<(), TopologyError> {
    let nic_rail = rail_attr(doc, nic)?;
    for net in nic.children().filter(|c| c.has_tag_name("net")) {
        let name = net
            .attribute("name")
            .ok_or_else(|| err(doc, net, "<net> without name"))?
            .trim()
            .to_string();
        let port = net.attribute("port").and_then(|p| p.trim().parse().ok());
        let rail = match (rail_attr(doc, net)?, nic_rail) {
            (Some(a), Some(b)) if a != b => {
                return Err(super::RailError::Conflict {
                    origin: "topology XML".into(),
                    nic: name,
                    first: b,
                    second: a,
                }
                .into())
            }
            (a, b) => a.or(b),
        };
        // NCCL writes a `guid` for IB/RoCE ports; a socket net is named after its netdev.
        let rdma = net.attribute("guid").is_some();
        let netdev = if rdma { None } else { Some(name.clone()) };
        if let Some(r) = rail {
            w.rails.push((w.nics.len(), r));
        }
        w.nics.push((
            Nic {
                device: name.clone(),
                name,
                port,
                kind: if rdma { NicKind::Rdma } else { NicKind::Netdev },
                netdev,
                pci_addr: addr,
                pci_path: None,
                numa_node: numa,
                pcie: link.cloned(),
                link_layer: None,
                state: LinkState::Unknown,
                state_detail: None,
                speed_mbps: net.attribute("speed").and_then(|s| s.trim().parse().ok()),
                gids: Vec::new(),
                address: None,
                rail: None,
            },
            node,
        ));
    }
    Ok(())
}

fn rail_attr(doc: &Document, el: Node) -> Result<Option<u32>, TopologyError> {
    el.attribute("rail")
        .map(|r| {
            r.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n <= MAX_RAIL)
                .ok_or_else(|| {
                    err(
                        doc,
                        el,
                        &format!("rail {r:?} is not a number from 0 to {MAX_RAIL}"),
                    )
                })
        })
        .transpose()
}

/// Ports of one device share its name in the XML; give each `device:port`, as sysfs
/// discovery does.
fn name_multi_port_nics(nics: &mut [(Nic, Option<NodeIdx>)]) {
    let names: Vec<String> = nics.iter().map(|(n, _)| n.device.clone()).collect();
    for (nic, _) in nics.iter_mut() {
        if names.iter().filter(|&d| *d == nic.device).count() > 1 {
            if let Some(p) = nic.port {
                nic.name = format!("{}:{p}", nic.device);
            }
        }
    }
}

/// NCCL's `ncclTopoGetInterCpuBw` from the CPU attributes, where the XML has them.
fn inter_socket_gbps(cpu: Node) -> Option<f64> {
    let arch = cpu.attribute("arch")?;
    let num = |a: &str| {
        cpu.attribute(a).and_then(|v| {
            let v = v.trim();
            v.strip_prefix("0x")
                .map_or_else(|| v.parse().ok(), |h| u32::from_str_radix(h, 16).ok())
        })
    };
    Some(match (arch, cpu.attribute("vendor")) {
        ("ppc64", _) => 32.0,
        ("arm64" | "aarch64", _) => 6.0,
        ("x86_64", Some("AuthenticAMD")) => 16.0,
        ("x86_64", Some("GenuineIntel")) => match (num("familyid"), num("modelid")) {
            (Some(6), Some(m)) if m >= 0xcf => 40.0,
            (Some(6), Some(m)) if m >= 0x8f => 22.0,
            (Some(6), Some(m)) if m >= 0x55 => 10.0,
            _ => 6.0,
        },
        _ => return None,
    })
}

fn err(doc: &Document, el: Node, msg: &str) -> TopologyError {
    let pos = doc.text_pos_at(el.range().start);
    TopologyError::Xml(format!("line {}: {msg}", pos.row))
}
