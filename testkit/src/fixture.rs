//! Fixture sysfs trees, laid out like the real one, for tests and demos.
//!
//! [`SysfsBuilder`] writes a directory tree under a root of the caller's choosing (a
//! tempdir) with the same shape as `/sys`: PCI functions under `devices/pci<dom>:<bus>/…`,
//! and `class/infiniband/*`, `class/net/*`, `bus/pci/devices/*` as relative symlinks into
//! it, so discovery resolves realpaths exactly as on a real machine. [`machines`] builds
//! the reference machines the tests pin paths on.
//!
//! Only files discovery reads are written. Nothing here touches the real `/sys`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Attributes of a PCI function.
#[derive(Debug, Clone)]
pub struct PciOpts {
    /// `numa_node`; -1 for "none", as sysfs says.
    pub numa: i32,
    /// `max_link_speed`, e.g. `"32.0 GT/s PCIe"`.
    pub speed: String,
    /// `max_link_width`.
    pub width: u32,
    /// `class`, e.g. `"0x030200"`.
    pub class: String,
    pub vendor: String,
    pub device: String,
    pub subsystem_vendor: String,
    pub subsystem_device: String,
}

impl PciOpts {
    /// A function with a PCIe `gen` (1–6) link of `width` lanes on NUMA node `numa`.
    pub fn new(gen: u8, width: u32, numa: i32) -> PciOpts {
        let speed = match gen {
            1 => "2.5 GT/s PCIe",
            2 => "5.0 GT/s PCIe",
            3 => "8.0 GT/s PCIe",
            4 => "16.0 GT/s PCIe",
            5 => "32.0 GT/s PCIe",
            _ => "64.0 GT/s PCIe",
        };
        PciOpts {
            numa,
            speed: speed.to_string(),
            width,
            class: "0x060400".to_string(),
            vendor: "0x8086".to_string(),
            device: "0x0000".to_string(),
            subsystem_vendor: "0x0000".to_string(),
            subsystem_device: "0x0000".to_string(),
        }
    }

    /// The same with `class`, `vendor` and `device` ids.
    pub fn ids(mut self, class: &str, vendor: &str, device: &str) -> PciOpts {
        self.class = class.to_string();
        self.vendor = vendor.to_string();
        self.device = device.to_string();
        self
    }

    /// The same with subsystem ids.
    pub fn subsystem(mut self, vendor: &str, device: &str) -> PciOpts {
        self.subsystem_vendor = vendor.to_string();
        self.subsystem_device = device.to_string();
        self
    }
}

/// One RDMA port.
#[derive(Debug, Clone)]
pub struct PortOpts {
    /// `state`, e.g. `"4: ACTIVE"` or `"1: DOWN"`.
    pub state: String,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// `rate`, e.g. `"400 Gb/sec (4X NDR)"`.
    pub rate: String,
    /// GID 0 (GID 1 is written as all zeros, which discovery skips).
    pub gid: String,
    /// For RoCE: the netdev named in `gid_attrs/ndevs/0`.
    pub roce_netdev: Option<String>,
}

impl PortOpts {
    /// An active InfiniBand port at `gbps`.
    pub fn ib(gbps: u32) -> PortOpts {
        PortOpts {
            state: "4: ACTIVE".into(),
            link_layer: "InfiniBand".into(),
            rate: format!("{gbps} Gb/sec (4X)"),
            gid: "fe80:0000:0000:0000:0000:0000:0000:0001".into(),
            roce_netdev: None,
        }
    }

    /// An active RoCE port at `gbps` over `netdev`.
    pub fn roce(gbps: u32, netdev: &str) -> PortOpts {
        PortOpts {
            link_layer: "Ethernet".into(),
            roce_netdev: Some(netdev.to_string()),
            ..PortOpts::ib(gbps)
        }
    }
}

/// A netdev.
#[derive(Debug, Clone)]
pub struct NetdevOpts {
    pub carrier: bool,
    /// `speed` in Mb/s.
    pub speed_mbps: i64,
    pub address: String,
    pub dev_port: u32,
    /// ARPHRD type: 1 Ethernet, 32 InfiniBand (IPoIB).
    pub arp_type: u32,
}

impl NetdevOpts {
    /// An Ethernet interface with carrier at `speed_mbps`.
    pub fn ethernet(speed_mbps: i64, address: &str) -> NetdevOpts {
        NetdevOpts {
            carrier: true,
            speed_mbps,
            address: address.to_string(),
            dev_port: 0,
            arp_type: 1,
        }
    }
}

/// Writes a sysfs-shaped tree under `root`.
#[derive(Debug, Clone)]
pub struct SysfsBuilder {
    root: PathBuf,
}

impl SysfsBuilder {
    /// A builder writing under `root` (created if missing), with the `class/net`
    /// directory every sysfs has (the plugin refuses a `RAILOVER_SYSFS_ROOT` without
    /// one), even for a machine with no network interface.
    pub fn new(root: &Path) -> io::Result<SysfsBuilder> {
        fs::create_dir_all(root.join("class/net"))?;
        Ok(SysfsBuilder {
            root: root.to_path_buf(),
        })
    }

    /// The root given to [`SysfsBuilder::new`], to pass to discovery.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Creates (or updates) the PCI function at the end of `chain` — bus addresses from
    /// the root port down, e.g. `["0000:10:01.0", "0000:11:00.0", "0000:12:00.0"]` — with
    /// `opts`. Missing bridges above it are created with the same NUMA node and link.
    /// Returns the function's directory.
    pub fn pci(&self, chain: &[&str], opts: &PciOpts) -> io::Result<PathBuf> {
        let first = chain
            .first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty PCI chain"))?;
        let mut dir = self
            .root
            .join("devices")
            .join(format!("pci{}", &first[..first.len() - 5]));
        let mut rel = PathBuf::from("devices").join(dir.file_name().unwrap_or_default());
        for (i, bdf) in chain.iter().enumerate() {
            dir.push(bdf);
            rel.push(bdf);
            let last = i + 1 == chain.len();
            if last || !dir.exists() {
                fs::create_dir_all(&dir)?;
                let o = if last {
                    opts.clone()
                } else {
                    PciOpts {
                        class: "0x060400".into(),
                        ..opts.clone()
                    }
                };
                write_pci_attrs(&dir, &o)?;
                let link = self.root.join("bus/pci/devices").join(bdf);
                symlink_rel(&link, &Path::new("../../..").join(&rel))?;
            }
        }
        Ok(dir)
    }

    /// An NVIDIA H100-class GPU (class 0x0302) at the end of `chain`.
    pub fn gpu(&self, chain: &[&str], opts: PciOpts) -> io::Result<PathBuf> {
        self.pci(chain, &opts.ids("0x030200", "0x10de", "0x2330"))
    }

    /// An RDMA device `name` on the PCI function at the end of `chain` (a Mellanox
    /// ConnectX, class 0x0207), with `ports` numbered from 1, and for each port that has a
    /// netdev name in `netdevs` that netdev on the same function (`dev_port` = port − 1).
    pub fn rdma_nic(
        &self,
        name: &str,
        chain: &[&str],
        pci: PciOpts,
        ports: &[PortOpts],
        netdevs: &[(&str, NetdevOpts)],
    ) -> io::Result<PathBuf> {
        let dev = self.pci(chain, &pci.ids("0x020700", "0x15b3", "0x1021"))?;
        let ib = dev.join("infiniband").join(name);
        fs::create_dir_all(&ib)?;
        symlink_rel(&ib.join("device"), &Path::new("../../..").join(last(&dev)))?;
        for (i, p) in ports.iter().enumerate() {
            let pd = ib.join("ports").join((i + 1).to_string());
            fs::create_dir_all(pd.join("gids"))?;
            write(&pd.join("state"), &p.state)?;
            let phys = if p.state.ends_with("ACTIVE") {
                "5: LinkUp"
            } else {
                "3: Disabled"
            };
            write(&pd.join("phys_state"), phys)?;
            write(&pd.join("link_layer"), &p.link_layer)?;
            write(&pd.join("rate"), &p.rate)?;
            write(&pd.join("gids/0"), &p.gid)?;
            write(
                &pd.join("gids/1"),
                "0000:0000:0000:0000:0000:0000:0000:0000",
            )?;
            if let Some(nd) = &p.roce_netdev {
                fs::create_dir_all(pd.join("gid_attrs/ndevs"))?;
                write(&pd.join("gid_attrs/ndevs/0"), nd)?;
            }
        }
        let rel = dev
            .strip_prefix(&self.root)
            .unwrap_or(&dev)
            .join("infiniband")
            .join(name);
        symlink_rel(
            &self.root.join("class/infiniband").join(name),
            &Path::new("../..").join(rel),
        )?;
        for (i, (nd, o)) in netdevs.iter().enumerate() {
            let o = NetdevOpts {
                dev_port: i as u32,
                ..o.clone()
            };
            self.netdev_on(&dev, nd, &o)?;
        }
        Ok(dev)
    }

    /// A plain Ethernet NIC (class 0x0200) `name` at the end of `chain`.
    pub fn eth_nic(
        &self,
        name: &str,
        chain: &[&str],
        pci: PciOpts,
        opts: &NetdevOpts,
    ) -> io::Result<PathBuf> {
        let dev = self.pci(chain, &pci.ids("0x020000", "0x8086", "0x1593"))?;
        self.netdev_on(&dev, name, opts)?;
        Ok(dev)
    }

    /// A virtual interface (no PCI device), like `lo` or a veth.
    pub fn virtual_netdev(&self, name: &str) -> io::Result<()> {
        let d = self.root.join("devices/virtual/net").join(name);
        fs::create_dir_all(&d)?;
        write(&d.join("operstate"), "unknown")?;
        write(&d.join("carrier"), "1")?;
        symlink_rel(
            &self.root.join("class/net").join(name),
            &Path::new("../../devices/virtual/net").join(name),
        )
    }

    /// Overwrites one attribute file below the root, e.g.
    /// `("class/infiniband/mlx5_0/ports/1/state", "1: DOWN")`.
    pub fn set(&self, rel: &str, value: &str) -> io::Result<()> {
        write(&self.root.join(rel), value)
    }

    fn netdev_on(&self, dev: &Path, name: &str, o: &NetdevOpts) -> io::Result<()> {
        let d = dev.join("net").join(name);
        fs::create_dir_all(&d)?;
        symlink_rel(&d.join("device"), &Path::new("../../..").join(last(dev)))?;
        write(&d.join("carrier"), if o.carrier { "1" } else { "0" })?;
        write(&d.join("operstate"), if o.carrier { "up" } else { "down" })?;
        write(&d.join("speed"), &o.speed_mbps.to_string())?;
        write(&d.join("address"), &o.address)?;
        write(&d.join("dev_port"), &o.dev_port.to_string())?;
        write(&d.join("type"), &o.arp_type.to_string())?;
        let rel = dev
            .strip_prefix(&self.root)
            .unwrap_or(dev)
            .join("net")
            .join(name);
        symlink_rel(
            &self.root.join("class/net").join(name),
            &Path::new("../..").join(rel),
        )
    }
}

fn write_pci_attrs(dir: &Path, o: &PciOpts) -> io::Result<()> {
    write(&dir.join("class"), &o.class)?;
    write(&dir.join("vendor"), &o.vendor)?;
    write(&dir.join("device"), &o.device)?;
    write(&dir.join("subsystem_vendor"), &o.subsystem_vendor)?;
    write(&dir.join("subsystem_device"), &o.subsystem_device)?;
    write(&dir.join("numa_node"), &o.numa.to_string())?;
    write(&dir.join("max_link_speed"), &o.speed)?;
    write(&dir.join("max_link_width"), &o.width.to_string())
}

fn last(p: &Path) -> &std::ffi::OsStr {
    p.file_name().unwrap_or_default()
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    if let Some(d) = path.parent() {
        fs::create_dir_all(d)?;
    }
    fs::write(path, format!("{value}\n"))
}

/// Creates `link` → `target` (relative), replacing an existing link.
fn symlink_rel(link: &Path, target: &Path) -> io::Result<()> {
    if let Some(d) = link.parent() {
        fs::create_dir_all(d)?;
    }
    if link.symlink_metadata().is_ok() {
        fs::remove_file(link)?;
    }
    std::os::unix::fs::symlink(target, link)
}

/// The reference machines the path tests pin.
pub mod machines {
    use super::*;

    /// A DGX-H100-like node: 2 sockets, 4 PCIe Gen5 switches (two per socket), each with 2
    /// GPUs and 2 InfiniBand NICs at 400 Gb/s; 8 NICs `mlx5_0`…`mlx5_7` on 8 rails.
    ///
    /// Switch `k` (0–3) hangs from root bus `rb = [0x10, 0x30, 0x90, 0xb0][k]`: root port
    /// `rb:01.0`, upstream port `rb+1:00.0`, downstream ports `rb+2:00.0`–`rb+2:03.0`, and
    /// GPU `2k` at `rb+3:00.0`, NIC `2k` at `rb+4:00.0`, GPU `2k+1` at `rb+5:00.0`, NIC
    /// `2k+1` at `rb+6:00.0`. NUMA node 0 for switches 0–1, 1 for 2–3.
    pub fn dgx_h100(root: &Path) -> io::Result<SysfsBuilder> {
        let b = SysfsBuilder::new(root)?;
        for (k, rb) in [0x10u32, 0x30, 0x90, 0xb0].into_iter().enumerate() {
            let numa = if k < 2 { 0 } else { 1 };
            let bdf = |bus: u32, dev: u32| format!("0000:{bus:02x}:{dev:02x}.0");
            let rp = bdf(rb, 1);
            let usp = bdf(rb + 1, 0);
            for j in 0..4u32 {
                let dsp = bdf(rb + 2, j);
                let ep = bdf(rb + 3 + j, 0);
                let chain = [rp.as_str(), usp.as_str(), dsp.as_str(), ep.as_str()];
                let opts = PciOpts::new(5, 16, numa);
                let idx = 2 * k as u32 + j / 2;
                if j % 2 == 0 {
                    b.gpu(&chain, opts)?;
                } else {
                    let name = format!("mlx5_{idx}");
                    let ipoib = NetdevOpts {
                        arp_type: 32,
                        ..NetdevOpts::ethernet(400_000, &format!("00:00:10:29:fe:80:00:{idx:02x}"))
                    };
                    b.rdma_nic(
                        &name,
                        &chain,
                        opts,
                        &[PortOpts::ib(400)],
                        &[(&format!("ibp{idx}s0"), ipoib)],
                    )?;
                }
            }
        }
        b.virtual_netdev("lo")?;
        Ok(b)
    }

    /// A dual-socket box with one 200 Gb/s RoCE NIC and one GPU per socket, each on its own
    /// root port (no switch), PCIe Gen4 x16: `mlx5_0` (`0000:17:00.0`, netdev `ens1np0`)
    /// and GPU0 (`0000:31:00.0`) on NUMA 0; `mlx5_1` (`0000:97:00.0`, `ens2np0`) and GPU1
    /// (`0000:b1:00.0`) on NUMA 1.
    pub fn dual_socket(root: &Path) -> io::Result<SysfsBuilder> {
        let b = SysfsBuilder::new(root)?;
        for (i, (nic_rp, nic, gpu_rp, gpu)) in [
            (
                "0000:16:01.0",
                "0000:17:00.0",
                "0000:30:01.0",
                "0000:31:00.0",
            ),
            (
                "0000:96:01.0",
                "0000:97:00.0",
                "0000:b0:01.0",
                "0000:b1:00.0",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let numa = i as i32;
            let nd = format!("ens{}np0", i + 1);
            b.rdma_nic(
                &format!("mlx5_{i}"),
                &[nic_rp, nic],
                PciOpts::new(4, 16, numa),
                &[PortOpts::roce(200, &nd)],
                &[(
                    &nd,
                    NetdevOpts::ethernet(200_000, &format!("b8:3f:d2:00:00:0{i}")),
                )],
            )?;
            b.gpu(&[gpu_rp, gpu], PciOpts::new(4, 16, numa))?;
        }
        Ok(b)
    }

    /// A single-switch box with plain Ethernet NICs (TCP only): one Gen4 x16 switch on
    /// NUMA 0 (upstream port `0000:01:00.0`) holding GPU0 (`03:00.0`, Gen4 x16), `eth0`
    /// (`04:00.0`, Gen3 x8 = 6 GB/s, 100 Gb/s), GPU1 (`05:00.0`) and `eth1` (`06:00.0`, a
    /// Gen4 x16 NIC behind a downstream port limited to x8 = 12 GB/s, 25 Gb/s).
    pub fn single_switch(root: &Path) -> io::Result<SysfsBuilder> {
        let b = SysfsBuilder::new(root)?;
        let (rp, usp) = ("0000:00:01.0", "0000:01:00.0");
        b.pci(&[rp, usp], &PciOpts::new(4, 16, 0))?;
        b.pci(&[rp, usp, "0000:02:03.0"], &PciOpts::new(4, 8, 0))?;
        b.gpu(
            &[rp, usp, "0000:02:00.0", "0000:03:00.0"],
            PciOpts::new(4, 16, 0),
        )?;
        b.eth_nic(
            "eth0",
            &[rp, usp, "0000:02:01.0", "0000:04:00.0"],
            PciOpts::new(3, 8, 0),
            &NetdevOpts::ethernet(100_000, "3c:fd:fe:00:00:01"),
        )?;
        b.gpu(
            &[rp, usp, "0000:02:02.0", "0000:05:00.0"],
            PciOpts::new(4, 16, 0),
        )?;
        b.eth_nic(
            "eth1",
            &[rp, usp, "0000:02:03.0", "0000:06:00.0"],
            PciOpts::new(4, 16, 0),
            &NetdevOpts::ethernet(25_000, "3c:fd:fe:00:00:02"),
        )?;
        b.virtual_netdev("lo")?;
        Ok(b)
    }
}
