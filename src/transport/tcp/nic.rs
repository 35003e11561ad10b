//! TCP NICs: the network interfaces railover may use, chosen with `RAILOVER_IFNAME`.

use std::net::IpAddr;
use std::path::Path;

use crate::config::IfFilter;

/// One interface railover uses as a NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpNic {
    pub name: String,
    pub ip: IpAddr,
    /// Realpath of the PCI device; `None` for virtual interfaces (veth, loopback, bridges).
    pub pci_path: Option<String>,
    /// Link speed in Mbps from sysfs, or the fallback when sysfs has none.
    pub speed_mbps: i32,
    pub loopback: bool,
}

/// Speed reported when sysfs does not know one (virtual links, loopback): NCCL's own
/// Socket transport uses the same value.
pub const FALLBACK_SPEED_MBPS: i32 = 10_000;

/// An interface as the system lists it, before selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub ip: IpAddr,
    pub up: bool,
    pub loopback: bool,
}

/// Lists up interfaces with a usable address (IPv4 preferred, link-local IPv6 skipped).
pub fn interfaces() -> std::io::Result<Vec<Interface>> {
    use nix::net::if_::InterfaceFlags as F;
    let mut out: Vec<Interface> = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
        let Some(addr) = ifa.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            let ip = v6.ip();
            if (ip.segments()[0] & 0xffc0) == 0xfe80 {
                continue;
            }
            IpAddr::V6(ip)
        } else {
            continue;
        };
        let up = ifa.flags.contains(F::IFF_UP);
        let loopback = ifa.flags.contains(F::IFF_LOOPBACK);
        match out.iter_mut().find(|i| i.name == ifa.interface_name) {
            // Keep one address per interface, preferring IPv4.
            Some(existing) => {
                if existing.ip.is_ipv6() && ip.is_ipv4() {
                    existing.ip = ip;
                }
            }
            None => out.push(Interface {
                name: ifa.interface_name,
                ip,
                up,
                loopback,
            }),
        }
    }
    Ok(out)
}

/// Applies `RAILOVER_IFNAME` semantics: the listed (or not excluded) interfaces; without a
/// list every up, non-loopback interface, and loopback only when nothing else exists. A
/// list selects loopback only by naming it. Sorted by name so every process of a node numbers its NICs alike.
pub fn select(all: &[Interface], filter: &IfFilter) -> Vec<Interface> {
    let eligible = |i: &&Interface| i.up;
    let mut chosen: Vec<Interface> = if filter.given {
        all.iter()
            .filter(eligible)
            .filter(|i| filter.matches(&i.name))
            .filter(|i| !i.loopback || filter.names_positively(&i.name))
            .cloned()
            .collect()
    } else {
        all.iter()
            .filter(eligible)
            .filter(|i| !i.loopback)
            .cloned()
            .collect()
    };
    // An explicit list that matches nothing stays empty: quietly using loopback instead
    // would hide the misconfiguration.
    if chosen.is_empty() && !filter.given {
        chosen = all
            .iter()
            .filter(eligible)
            .filter(|i| i.loopback)
            .cloned()
            .collect();
    }
    chosen.sort_by(|a, b| a.name.cmp(&b.name));
    chosen
}

/// Fills in what sysfs knows about an interface.
pub fn describe(iface: &Interface, sysfs: &Path) -> TcpNic {
    let dir = sysfs.join("class/net").join(&iface.name);
    let pci_path = std::fs::canonicalize(dir.join("device"))
        .ok()
        .and_then(|p| p.to_str().map(String::from));
    let speed_mbps = std::fs::read_to_string(dir.join("speed"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(FALLBACK_SPEED_MBPS);
    TcpNic {
        name: iface.name.clone(),
        ip: iface.ip,
        pci_path,
        speed_mbps,
        loopback: iface.loopback,
    }
}

/// `n` NICs on loopback, `lo.<i>` at `127.100.<i>.1`: every 127/8 address is local, so this
/// gives a multi-NIC node without root (the demo's loopback variant and tests). Processes
/// of one host share these addresses; their listeners take distinct ports.
pub fn loopback_nics(n: usize) -> Vec<TcpNic> {
    (0..n)
        .map(|i| TcpNic {
            name: format!("lo.{i}"),
            ip: IpAddr::V4(std::net::Ipv4Addr::new(127, 100, i as u8, 1)),
            pci_path: None,
            speed_mbps: FALLBACK_SPEED_MBPS,
            loopback: true,
        })
        .collect()
}

/// Discovers this process's TCP NICs.
pub fn discover(filter: &IfFilter, sysfs: &Path) -> std::io::Result<Vec<TcpNic>> {
    Ok(select(&interfaces()?, filter)
        .iter()
        .map(|i| describe(i, sysfs))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: &str, up: bool) -> Interface {
        Interface {
            name: name.into(),
            ip: ip.parse().unwrap(),
            up,
            loopback: name == "lo",
        }
    }

    fn names(v: &[Interface]) -> Vec<&str> {
        v.iter().map(|i| i.name.as_str()).collect()
    }

    fn sample() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1", true),
            iface("eth1", "10.0.1.2", true),
            iface("eth0", "10.0.0.2", true),
            iface("docker0", "172.17.0.1", true),
            iface("eth2", "10.0.2.2", false),
        ]
    }

    #[test]
    fn default_is_every_up_non_loopback_interface() {
        assert_eq!(
            names(&select(&sample(), &IfFilter::default())),
            ["docker0", "eth0", "eth1"]
        );
    }

    #[test]
    fn loopback_only_when_nothing_else_or_named() {
        let only_lo = vec![
            iface("lo", "127.0.0.1", true),
            iface("eth0", "10.0.0.1", false),
        ];
        assert_eq!(names(&select(&only_lo, &IfFilter::default())), ["lo"]);
        let f = IfFilter::parse("lo").unwrap();
        assert_eq!(names(&select(&sample(), &f)), ["lo"]);
        let f = IfFilter::parse("^docker").unwrap();
        assert_eq!(names(&select(&sample(), &f)), ["eth0", "eth1"]);
    }

    #[test]
    fn prefix_and_exact_lists() {
        let f = IfFilter::parse("eth").unwrap();
        assert_eq!(names(&select(&sample(), &f)), ["eth0", "eth1"]);
        let f = IfFilter::parse("=eth1").unwrap();
        assert_eq!(names(&select(&sample(), &f)), ["eth1"]);
        let f = IfFilter::parse("=eth").unwrap();
        assert!(
            select(&sample(), &f).is_empty(),
            "exact match selects nothing"
        );
    }

    #[test]
    fn describe_reads_sysfs_with_fallbacks() {
        let dir = std::env::temp_dir().join(format!("railover-nic-{}", std::process::id()));
        let net = dir.join("class/net/eth0");
        let dev = dir.join("devices/pci0000:00/0000:00:03.0");
        std::fs::create_dir_all(&net).unwrap();
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(net.join("speed"), "25000\n").unwrap();
        std::os::unix::fs::symlink(&dev, net.join("device")).unwrap();
        let nic = describe(&iface("eth0", "10.0.0.2", true), &dir);
        assert_eq!(nic.speed_mbps, 25000);
        assert_eq!(
            nic.pci_path.as_deref(),
            dev.canonicalize().unwrap().to_str()
        );
        let virt = describe(&iface("veth0", "10.0.0.3", true), &dir);
        assert_eq!(
            (virt.speed_mbps, virt.pci_path),
            (FALLBACK_SPEED_MBPS, None)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
