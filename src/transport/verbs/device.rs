//! Verbs device discovery: which device ports are NICs, their state, speed, GID table
//! and the GID a RoCE path uses.
//!
//! No libibverbs, or no RDMA support in the kernel, is zero devices: nothing fails and
//! nothing is logged above DEBUG, because that is every TCP-only host.

use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use crate::config::{AddrFamily, GidPolicy, HcaFilter};

use super::sys::{self, Context, GidEntry, PortAttr, LINK_LAYER_ETHERNET, LINK_LAYER_INFINIBAND};

/// One port of a verbs device, as discovery found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsNic {
    pub device: String,
    pub port: u8,
    /// Node GUID, host byte order.
    pub guid: u64,
    pub attr: PortAttr,
    /// Port speed in Mbit/s, from the active speed and width.
    pub speed_mbps: u64,
    /// The port's GID table (non-empty entries only).
    pub gids: Vec<GidEntry>,
    /// The GID a path uses ([`pick_gid`]); `None` on a RoCE port without a usable one.
    pub gid_index: Option<u32>,
    /// The netdev behind the chosen GID (RoCE), from sysfs.
    pub netdev: Option<String>,
    /// The PCI device (`/sys/class/infiniband/<dev>/device`, else the netdev's).
    pub pci_path: Option<String>,
}

impl VerbsNic {
    /// `device:port`, as `RAILOVER_HCA` and NCCL name it.
    pub fn label(&self) -> String {
        format!("{}:{}", self.device, self.port)
    }

    pub fn is_active(&self) -> bool {
        self.attr.state == sys::PORT_ACTIVE
    }

    pub fn link_layer(&self) -> &'static str {
        link_layer_name(self.attr.link_layer)
    }

    /// The address of the chosen GID when it is an IP address (RoCE).
    pub fn ip(&self) -> Option<IpAddr> {
        let i = self.gid_index?;
        let g = self.gids.iter().find(|g| g.index == i)?;
        (self.attr.link_layer == LINK_LAYER_ETHERNET).then(|| gid_ip(&g.gid))
    }
}

/// What discovery found, and why there is nothing when there is nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Discovery {
    pub nics: Vec<VerbsNic>,
    /// Why no device could be listed (no libibverbs, no kernel support), if so.
    pub absent: Option<String>,
    /// Ports seen but not used, with the reason (filtered out, not active, no GID).
    pub skipped: Vec<String>,
    /// Ports used with a note: a GID other than the one asked for (logged at WARN).
    pub notes: Vec<String>,
}

/// Lists every port `filter` selects that is ACTIVE with an IB or Ethernet link layer and
/// has a GID `gid` accepts ([`choose_gid`]).
pub fn discover(filter: &HcaFilter, gid: &GidPolicy, sysfs_root: &Path) -> Discovery {
    let listed = match sys::device_list() {
        Ok(l) => l,
        Err(errno) => {
            let why = match errno {
                libc::EOPNOTSUPP => "libibverbs.so.1 is not installed".to_string(),
                libc::ENOSYS => "the kernel has no RDMA support (no ib_uverbs)".to_string(),
                e => format!("no device list ({})", std::io::Error::from_raw_os_error(e)),
            };
            tracing::debug!("railover: no verbs devices: {why}");
            return Discovery {
                absent: Some(why),
                ..Default::default()
            };
        }
    };
    let mut out = Discovery::default();
    for dev in listed {
        let ctx = match Context::open(&dev.name) {
            Ok(c) => c,
            Err(e) => {
                out.skipped.push(format!("{}: cannot open: {e}", dev.name));
                continue;
            }
        };
        let ports = match ctx.query_device() {
            Ok(a) => a.phys_port_cnt,
            Err(e) => {
                out.skipped.push(format!("{}: {e}", dev.name));
                continue;
            }
        };
        for port in 1..=ports {
            let label = format!("{}:{port}", dev.name);
            if !filter.selects(&dev.name, port) {
                out.skipped
                    .push(format!("{label}: not selected by RAILOVER_HCA"));
                continue;
            }
            let attr = match ctx.query_port(port) {
                Ok(a) => a,
                Err(e) => {
                    out.skipped.push(format!("{label}: {e}"));
                    continue;
                }
            };
            if attr.link_layer != LINK_LAYER_INFINIBAND && attr.link_layer != LINK_LAYER_ETHERNET {
                out.skipped.push(format!(
                    "{label}: link layer {}",
                    link_layer_name(attr.link_layer)
                ));
                continue;
            }
            let gids: Vec<GidEntry> = (0..attr.gid_tbl_len.clamp(0, 256) as u32)
                .filter_map(|i| ctx.query_gid(port, i))
                .filter(|g| g.gid != [0; 16])
                .collect();
            let (gid_index, no_gid) = match choose_gid(&gids, attr.link_layer, gid) {
                Ok(c) => {
                    if let Some(why) = c.fallback {
                        tracing::warn!("railover: {label}: {why}");
                        out.notes.push(format!("{label}: {why}"));
                    }
                    (Some(c.index), None)
                }
                Err(why) => (None, Some(why)),
            };
            let dir = sysfs_root.join("class/infiniband").join(&dev.name);
            let netdev = netdev_of(sysfs_root, &dev.name, port, gid_index);
            let pci_path = realpath(&dir.join("device")).or_else(|| {
                let n = netdev.as_ref()?;
                realpath(&sysfs_root.join("class/net").join(n).join("device"))
            });
            let nic = VerbsNic {
                device: dev.name.clone(),
                port,
                guid: dev.guid,
                speed_mbps: speed_mbps(attr.active_speed, attr.active_speed_ex, attr.active_width),
                attr,
                gids,
                gid_index,
                netdev,
                pci_path,
            };
            if !nic.is_active() {
                out.skipped
                    .push(format!("{label}: port not ACTIVE (state {})", attr.state));
                continue;
            }
            if let Some(why) = no_gid {
                out.skipped.push(format!("{label}: {why}"));
                continue;
            }
            out.nics.push(nic);
        }
    }
    out
}

/// Every port of every device, whatever its state or the filter (for `railover doctor`).
pub fn inventory(gid: &GidPolicy, sysfs_root: &Path) -> Discovery {
    let mut d = discover(&HcaFilter::default(), gid, sysfs_root);
    // `discover` keeps only the usable ports; the doctor wants them all, so list the
    // skipped ones again from the devices themselves.
    if d.absent.is_none() && !d.skipped.is_empty() {
        let Ok(listed) = sys::device_list() else {
            return d;
        };
        for dev in listed {
            let Ok(ctx) = Context::open(&dev.name) else {
                continue;
            };
            let ports = ctx.query_device().map(|a| a.phys_port_cnt).unwrap_or(0);
            for port in 1..=ports {
                if d.nics
                    .iter()
                    .any(|n| n.device == dev.name && n.port == port)
                {
                    continue;
                }
                let Ok(attr) = ctx.query_port(port) else {
                    continue;
                };
                let gids: Vec<GidEntry> = (0..attr.gid_tbl_len.clamp(0, 256) as u32)
                    .filter_map(|i| ctx.query_gid(port, i))
                    .filter(|g| g.gid != [0; 16])
                    .collect();
                let gid_index = choose_gid(&gids, attr.link_layer, gid)
                    .ok()
                    .map(|c| c.index);
                d.nics.push(VerbsNic {
                    device: dev.name.clone(),
                    port,
                    guid: dev.guid,
                    speed_mbps: speed_mbps(
                        attr.active_speed,
                        attr.active_speed_ex,
                        attr.active_width,
                    ),
                    gid_index,
                    attr,
                    netdev: netdev_of(sysfs_root, &dev.name, port, gid_index),
                    gids,
                    pci_path: None,
                });
            }
        }
        d.nics
            .sort_by(|a, b| (&a.device, a.port).cmp(&(&b.device, b.port)));
    }
    d
}

/// The netdev behind port `port` of verbs device `device`: the one link events (netlink)
/// name, so a RoCE port's carrier can be followed. In order: the netdev of the chosen GID
/// (`ports/<p>/gid_attrs/ndevs/<i>`), of the port's lowest GID that has one, the PCI
/// function's netdev (`device/net/`: the only one, else the one whose `dev_port` is
/// `port - 1`), and Soft-RoCE's `parent`. `None` for InfiniBand ports without IPoIB.
pub fn netdev_of(
    sysfs_root: &Path,
    device: &str,
    port: u8,
    gid_index: Option<u32>,
) -> Option<String> {
    let dir = sysfs_root.join("class/infiniband").join(device);
    let ndevs = dir.join(format!("ports/{port}/gid_attrs/ndevs"));
    if let Some(n) = gid_index.and_then(|i| read_trim(&ndevs.join(i.to_string()))) {
        return Some(n);
    }
    let mut indices: Vec<u32> = std::fs::read_dir(&ndevs)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    indices.sort_unstable();
    if let Some(n) = indices
        .iter()
        .find_map(|i| read_trim(&ndevs.join(i.to_string())))
    {
        return Some(n);
    }
    let net = dir.join("device/net");
    let mut names: Vec<String> = std::fs::read_dir(&net)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    match names.len() {
        0 => {}
        1 => return names.pop(),
        _ => {
            let want = (u32::from(port).saturating_sub(1)).to_string();
            if let Some(n) = names
                .into_iter()
                .find(|n| read_trim(&net.join(n).join("dev_port")).as_deref() == Some(&want))
            {
                return Some(n);
            }
        }
    }
    read_trim(&dir.join("parent"))
}

fn read_trim(p: &Path) -> Option<String> {
    let s = std::fs::read_to_string(p).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

fn realpath(p: &Path) -> Option<String> {
    std::fs::canonicalize(p)
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

pub fn link_layer_name(ll: u8) -> &'static str {
    match ll {
        LINK_LAYER_INFINIBAND => "InfiniBand",
        LINK_LAYER_ETHERNET => "Ethernet",
        _ => "unspecified",
    }
}

/// `IBV_PORT_*` as text.
pub fn port_state_name(state: u32) -> &'static str {
    match state {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// `gid_type` as text.
pub fn gid_type_name(t: u32) -> &'static str {
    match t {
        0 => "IB",
        1 => "RoCEv1",
        2 => "RoCEv2",
        _ => "?",
    }
}

/// A GID as an address: IPv4-mapped GIDs as IPv4.
pub fn gid_ip(gid: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// The GID index a path uses with the default policy (RoCE v2, `AF_INET`); see
/// [`choose_gid`].
pub fn pick_gid(gids: &[GidEntry], link_layer: u8) -> Option<u32> {
    choose_gid(gids, link_layer, &GidPolicy::default())
        .ok()
        .map(|c| c.index)
}

/// The GID [`choose_gid`] picked, and why it is not the one asked for, if it is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidChoice {
    pub index: u32,
    pub fallback: Option<String>,
}

/// The GID index a path uses, as NCCL picks it (`NCCL_IB_GID_INDEX`,
/// `NCCL_IB_ROCE_VERSION_NUM`, `NCCL_IB_ADDR_FAMILY`). A fixed index must hold a GID;
/// one taken from `NCCL_IB_GID_INDEX` applies to RoCE ports only, as in NCCL. On
/// InfiniBand `auto` is the lowest index (0). On RoCE `auto` is the lowest index of the
/// asked RoCE version and family (for IPv6, global before link-local); when the port has
/// none, the nearest other RoCE GID with a `fallback` note saying so (the peer must end up
/// with the same version). `Err` says why there is no GID to use.
pub fn choose_gid(
    gids: &[GidEntry],
    link_layer: u8,
    policy: &GidPolicy,
) -> Result<GidChoice, String> {
    let exact = |index| GidChoice {
        index,
        fallback: None,
    };
    let fixed = match policy.index {
        Some(_) if policy.index_from_nccl && link_layer == LINK_LAYER_INFINIBAND => None,
        i => i,
    };
    if let Some(i) = fixed {
        if gids.iter().any(|g| g.index == i)
            || (link_layer == LINK_LAYER_INFINIBAND && gids.is_empty() && i == 0)
        {
            return Ok(exact(i));
        }
        let have: Vec<String> = gids.iter().map(|g| g.index.to_string()).collect();
        let var = if policy.index_from_nccl {
            "NCCL_IB_GID_INDEX"
        } else {
            "RAILOVER_IB_GID_INDEX"
        };
        return Err(format!(
            "{var}={i}, but the port has no GID {i} (it has {})",
            if have.is_empty() {
                "none".to_string()
            } else {
                have.join(", ")
            }
        ));
    }
    if link_layer == LINK_LAYER_INFINIBAND {
        return Ok(exact(gids.iter().map(|g| g.index).min().unwrap_or(0)));
    }
    let want_version = u32::from(policy.roce_version);
    // (version differs, family differs, link-local, older version, index): lowest wins.
    let rank = |g: &GidEntry| {
        if g.gid_type != 1 && g.gid_type != 2 {
            return None;
        }
        let (family, link_local) = match gid_ip(&g.gid) {
            IpAddr::V4(_) => (AddrFamily::Inet, false),
            IpAddr::V6(v6) => (AddrFamily::Inet6, v6.segments()[0] & 0xffc0 == 0xfe80),
        };
        Some((
            g.gid_type != want_version,
            family != policy.family,
            link_local,
            2 - g.gid_type,
            g.index,
        ))
    };
    let Some(best) = gids.iter().filter_map(rank).min() else {
        return Err("no RoCE v1/v2 GID".into());
    };
    let index = best.4;
    if !best.0 && !best.1 {
        return Ok(exact(index));
    }
    let g = gids
        .iter()
        .find(|g| g.index == index)
        .expect("ranked from gids");
    Ok(GidChoice {
        index,
        fallback: Some(format!(
            "no RoCE v{want_version} GID with an {} address (RAILOVER_IB_ROCE_VERSION, RAILOVER_IB_ADDR_FAMILY); using GID {index} ({} {}) instead, which the peer must match",
            policy.family,
            gid_type_name(g.gid_type),
            gid_ip(&g.gid)
        )),
    })
}

/// Port speed in Mbit/s from `active_speed`/`active_speed_ex` and `active_width`
/// (`ibv_query_port_speed` is not in rdma-mummy-sys's stubs).
pub fn speed_mbps(active_speed: u8, active_speed_ex: u32, active_width: u8) -> u64 {
    // Per-lane data rate in Mbit/s, by IB speed bit.
    let lane = match if active_speed_ex != 0 {
        active_speed_ex
    } else {
        active_speed.into()
    } {
        1 => 2_500,
        2 => 5_000,
        4 | 8 => 10_000,
        16 => 14_000,
        32 => 25_000,
        64 => 50_000,
        128 => 100_000,
        256 => 200_000,
        _ => 0,
    };
    let lanes = match active_width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => 0,
    };
    lane * lanes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(index: u32, gid_type: u32, text: &str) -> GidEntry {
        let ip: Ipv6Addr = match text.parse::<IpAddr>().unwrap() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        GidEntry {
            index,
            gid: ip.octets(),
            gid_type,
            ndev_ifindex: 2,
        }
    }

    #[test]
    fn roce_prefers_v2_and_ipv4() {
        // As rxe and mlx5 lay it out: link-local v1/v2, then the address's v1/v2.
        let table = [
            gid(0, 1, "fe80::5054:ff:feaa:1"),
            gid(1, 2, "fe80::5054:ff:feaa:1"),
            gid(2, 1, "192.0.2.1"),
            gid(3, 2, "192.0.2.1"),
            gid(4, 2, "2001:db8::1"),
        ];
        assert_eq!(pick_gid(&table, LINK_LAYER_ETHERNET), Some(3));
        assert_eq!(pick_gid(&table[..3], LINK_LAYER_ETHERNET), Some(1));
        let v6 = [gid(0, 2, "fe80::1"), gid(5, 2, "2001:db8::7")];
        assert_eq!(pick_gid(&v6, LINK_LAYER_ETHERNET), Some(5));
        assert_eq!(pick_gid(&[gid(0, 0, "fe80::1")], LINK_LAYER_ETHERNET), None);
        assert_eq!(pick_gid(&[], LINK_LAYER_ETHERNET), None);
        assert_eq!(pick_gid(&[], LINK_LAYER_INFINIBAND), Some(0));
        assert_eq!(
            gid_ip(&table[3].gid),
            "192.0.2.1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn gid_choice_follows_version_family_and_index() {
        let table = [
            gid(0, 1, "fe80::5054:ff:feaa:1"),
            gid(1, 2, "fe80::5054:ff:feaa:1"),
            gid(2, 1, "192.0.2.1"),
            gid(3, 2, "192.0.2.1"),
            gid(4, 1, "2001:db8::1"),
            gid(5, 2, "2001:db8::1"),
        ];
        let pol = |index, roce_version, family| GidPolicy {
            index,
            index_from_nccl: false,
            roce_version,
            family,
        };
        let pick = |t: &[GidEntry], p: GidPolicy| choose_gid(t, LINK_LAYER_ETHERNET, &p);
        let exact = |index| {
            Ok(GidChoice {
                index,
                fallback: None,
            })
        };
        assert_eq!(pick(&table, pol(None, 2, AddrFamily::Inet)), exact(3));
        assert_eq!(pick(&table, pol(None, 1, AddrFamily::Inet)), exact(2));
        assert_eq!(
            pick(&table, pol(None, 2, AddrFamily::Inet6)),
            exact(5),
            "global first"
        );
        assert_eq!(pick(&table, pol(None, 1, AddrFamily::Inet6)), exact(4));
        assert_eq!(
            pick(&table[..2], pol(None, 1, AddrFamily::Inet6)),
            exact(0),
            "link-local"
        );
        // A fixed index is taken as it is, whatever its type.
        assert_eq!(pick(&table, pol(Some(0), 2, AddrFamily::Inet)), exact(0));
        let e = pick(&table, pol(Some(9), 2, AddrFamily::Inet)).unwrap_err();
        assert!(
            e.contains("RAILOVER_IB_GID_INDEX=9") && e.contains("0, 1, 2, 3, 4, 5"),
            "{e}"
        );
        let e = pick(&[], pol(Some(0), 2, AddrFamily::Inet)).unwrap_err();
        assert!(e.contains("it has none"), "{e}");
    }

    #[test]
    fn an_nccl_gid_index_binds_roce_ports_only() {
        let nccl = GidPolicy {
            index: Some(3),
            index_from_nccl: true,
            ..GidPolicy::default()
        };
        let roce = [gid(0, 1, "fe80::1"), gid(3, 2, "192.0.2.1")];
        assert_eq!(
            choose_gid(&roce, LINK_LAYER_ETHERNET, &nccl).map(|c| c.index),
            Ok(3)
        );
        let e = choose_gid(&roce[..1], LINK_LAYER_ETHERNET, &nccl).unwrap_err();
        assert!(
            e.starts_with("NCCL_IB_GID_INDEX=3, but the port has no GID 3"),
            "{e}"
        );
        // NCCL ignores it on InfiniBand, where the port takes its lowest GID as on auto.
        let ib = [gid(0, 0, "fe80::1")];
        assert_eq!(
            choose_gid(&ib, LINK_LAYER_INFINIBAND, &nccl).map(|c| c.index),
            Ok(0)
        );
        let own = GidPolicy {
            index_from_nccl: false,
            ..nccl
        };
        assert!(choose_gid(&ib, LINK_LAYER_INFINIBAND, &own).is_err());
    }

    #[test]
    fn a_missing_gid_kind_falls_back_with_a_note_or_fails() {
        let pick = |t: &[GidEntry], roce_version, family| {
            choose_gid(
                t,
                LINK_LAYER_ETHERNET,
                &GidPolicy {
                    index: None,
                    index_from_nccl: false,
                    roce_version,
                    family,
                },
            )
        };
        // Only RoCE v1 GIDs, v2 asked: the v1 GID of the asked family, with a note.
        let v1_only = [gid(0, 1, "fe80::1"), gid(1, 1, "192.0.2.1")];
        let c = pick(&v1_only, 2, AddrFamily::Inet).unwrap();
        assert_eq!(c.index, 1);
        let why = c.fallback.unwrap();
        assert!(
            why.contains("no RoCE v2 GID with an AF_INET address")
                && why.contains("using GID 1 (RoCEv1 192.0.2.1)"),
            "{why}"
        );
        // An IPv6-only port, IPv4 asked: the global v2 GID, with a note.
        let v6_only = [gid(0, 2, "fe80::1"), gid(1, 2, "2001:db8::2")];
        let c = pick(&v6_only, 2, AddrFamily::Inet).unwrap();
        assert_eq!(c.index, 1);
        assert!(c.fallback.unwrap().contains("2001:db8::2"));
        // No RoCE GID at all (an IB-type entry on an Ethernet port): none.
        assert_eq!(
            pick(&[gid(0, 0, "fe80::1")], 2, AddrFamily::Inet),
            Err("no RoCE v1/v2 GID".to_string())
        );
        assert!(pick(&[], 1, AddrFamily::Inet6).is_err());
        // InfiniBand: the lowest index, whatever version and family say.
        let ib = [gid(2, 0, "fe80::7"), gid(1, 0, "fe80::8")];
        let c = choose_gid(&ib, LINK_LAYER_INFINIBAND, &GidPolicy::default()).unwrap();
        assert_eq!((c.index, c.fallback), (1, None));
    }

    #[test]
    fn speeds_follow_the_ib_tables() {
        // NDR x4 (ConnectX-7 400G), HDR x4, EDR x4, XDR via the extended field.
        assert_eq!(speed_mbps(128, 0, 2), 400_000);
        assert_eq!(speed_mbps(64, 0, 2), 200_000);
        assert_eq!(speed_mbps(32, 0, 2), 100_000);
        assert_eq!(speed_mbps(0, 256, 2), 800_000);
        assert_eq!(speed_mbps(1, 0, 1), 2_500);
        assert_eq!(speed_mbps(3, 0, 2), 0, "not one speed bit");
    }

    /// A sysfs tree under a fresh temporary directory, from `(path, contents)` pairs.
    fn fake_sysfs(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = root.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn netdev_comes_from_the_chosen_gid_then_the_port_then_the_device() {
        let ib = "class/infiniband";
        let t = fake_sysfs(&[
            // rxe0: GIDs 0/1 link-local, 2/3 the IPv4 address, all on eth0; empty slot 4.
            (&format!("{ib}/rxe0/ports/1/gid_attrs/ndevs/1"), "eth0\n"),
            (&format!("{ib}/rxe0/ports/1/gid_attrs/ndevs/3"), "eth0\n"),
            (&format!("{ib}/rxe0/ports/1/gid_attrs/ndevs/4"), ""),
            (&format!("{ib}/rxe0/parent"), "eth0\n"),
            // A device whose GIDs name different netdevs (a VLAN on index 5).
            (
                &format!("{ib}/mlx5_0/ports/1/gid_attrs/ndevs/3"),
                "ens1f0np0\n",
            ),
            (
                &format!("{ib}/mlx5_0/ports/1/gid_attrs/ndevs/5"),
                "ens1f0np0.100\n",
            ),
            // No GID netdevs: the PCI function's netdevs, by dev_port.
            (&format!("{ib}/mlx4_0/device/net/enp3s0d1/dev_port"), "1\n"),
            (&format!("{ib}/mlx4_0/device/net/enp3s0/dev_port"), "0\n"),
            (&format!("{ib}/mlx5_2/device/net/ib0/dev_port"), "0\n"),
            // Soft-RoCE with an empty GID table: only its parent.
            (&format!("{ib}/rxe9/parent"), "veth9\n"),
            // InfiniBand without IPoIB: nothing.
            (
                &format!("{ib}/mlx5_7/ports/1/gids/0"),
                "fe80:0000:0000:0000:0000:0000:0000:0001\n",
            ),
        ]);
        let root = t.path();
        let of = |dev, port, gid| netdev_of(root, dev, port, gid);
        assert_eq!(of("rxe0", 1, Some(3)).as_deref(), Some("eth0"));
        assert_eq!(of("mlx5_0", 1, Some(5)).as_deref(), Some("ens1f0np0.100"));
        assert_eq!(of("mlx5_0", 1, Some(3)).as_deref(), Some("ens1f0np0"));
        // A chosen GID without a netdev falls back to the port's lowest one.
        assert_eq!(of("mlx5_0", 1, Some(9)).as_deref(), Some("ens1f0np0"));
        assert_eq!(of("mlx5_0", 1, None).as_deref(), Some("ens1f0np0"));
        assert_eq!(
            of("rxe0", 1, Some(4)).as_deref(),
            Some("eth0"),
            "empty slot"
        );
        assert_eq!(of("mlx4_0", 1, None).as_deref(), Some("enp3s0"));
        assert_eq!(of("mlx4_0", 2, None).as_deref(), Some("enp3s0d1"));
        assert_eq!(of("mlx4_0", 3, None), None, "no function for port 3");
        assert_eq!(of("mlx5_2", 1, Some(0)).as_deref(), Some("ib0"));
        assert_eq!(of("rxe9", 1, None).as_deref(), Some("veth9"));
        assert_eq!(of("mlx5_7", 1, Some(0)), None);
        assert_eq!(of("absent0", 1, Some(0)), None);
    }

    #[test]
    fn discovery_without_rdma_is_empty_and_says_why() {
        // The CI machine has no RDMA kernel support: no NICs, a reason, nothing else.
        let d = discover(
            &HcaFilter::default(),
            &GidPolicy::default(),
            Path::new("/sys"),
        );
        if d.absent.is_some() {
            assert!(d.nics.is_empty() && d.skipped.is_empty() && d.notes.is_empty());
        }
    }
}
