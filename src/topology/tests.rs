//! Path pins on the reference machines of [`super::fixture::machines`], plus rails and
//! backup candidates on the same trees.

use super::fixture::{machines, NetdevOpts, PciOpts, PortOpts, SysfsBuilder};
use super::*;

fn dgx() -> (tempfile::TempDir, Topology) {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    (dir, t)
}

fn nic(t: &Topology, name: &str) -> NicId {
    t.nic_by_name(name)
        .unwrap_or_else(|| panic!("no NIC {name}"))
}

fn gpu(t: &Topology, name: &str) -> GpuId {
    t.gpu_by_name(name)
        .unwrap_or_else(|| panic!("no GPU {name}"))
}

fn pin(p: Option<Path>, kind: PathType, hops: u32, bw: f64) {
    let p = p.expect("path");
    assert_eq!(
        (p.kind, p.hops, p.bandwidth_gbps),
        (kind, hops, bw),
        "{p:?}"
    );
}

#[test]
fn dgx_discovers_eight_nics_eight_gpus_in_pci_order() {
    let (_d, t) = dgx();
    let names: Vec<&str> = t.nics().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    );
    assert_eq!(t.gpus().len(), 8);
    assert_eq!(t.gpus()[0].pci_addr.to_string(), "0000:13:00.0");
    let n0 = t.nic(nic(&t, "mlx5_0"));
    assert_eq!(n0.kind, NicKind::Rdma);
    assert_eq!(n0.port, Some(1));
    assert_eq!(n0.netdev.as_deref(), Some("ibp0s0"));
    assert_eq!(n0.link_layer.as_deref(), Some("InfiniBand"));
    assert_eq!(n0.state, LinkState::Up);
    assert_eq!(n0.speed_mbps, Some(400_000));
    assert_eq!(n0.numa_node, Some(0));
    assert_eq!(n0.gids.len(), 1, "the zero GID is skipped");
    assert_eq!(n0.pcie.as_ref().unwrap().bandwidth_gbps, 48.0);
    assert!(n0
        .pci_path
        .as_ref()
        .unwrap()
        .ends_with("devices/pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:01.0/0000:14:00.0"));
    assert_eq!(t.nic(nic(&t, "mlx5_7")).numa_node, Some(1));
    // Automatic rails: PCI order.
    let rails: Vec<Option<u32>> = t.nics().iter().map(|n| n.rail).collect();
    assert_eq!(rails, (0..8).map(Some).collect::<Vec<_>>());
    assert_eq!(t.rail_source(), RailSource::Automatic);
}

#[test]
fn dgx_paths() {
    let (_d, t) = dgx();
    let g0 = gpu(&t, "GPU0");
    // Same switch: PIX although three bridge functions lie between (docs/design.md §8.2).
    pin(t.path(g0, nic(&t, "mlx5_0")), PathType::Pix, 2, 48.0);
    pin(t.path(g0, nic(&t, "mlx5_1")), PathType::Pix, 2, 48.0);
    // Other switch, same socket.
    pin(t.path(g0, nic(&t, "mlx5_2")), PathType::Phb, 4, 48.0);
    pin(t.path(g0, nic(&t, "mlx5_3")), PathType::Phb, 4, 48.0);
    // Other socket: the inter-socket link is the bottleneck.
    pin(t.path(g0, nic(&t, "mlx5_4")), PathType::Sys, 5, 22.0);
    pin(t.path(g0, nic(&t, "mlx5_7")), PathType::Sys, 5, 22.0);
    // NIC–NIC.
    pin(
        t.path(nic(&t, "mlx5_0"), nic(&t, "mlx5_1")),
        PathType::Pix,
        2,
        48.0,
    );
    pin(
        t.path(nic(&t, "mlx5_5"), nic(&t, "mlx5_6")),
        PathType::Phb,
        4,
        48.0,
    );
    pin(
        t.path(nic(&t, "mlx5_1"), nic(&t, "mlx5_6")),
        PathType::Sys,
        5,
        22.0,
    );
    pin(
        t.path(nic(&t, "mlx5_3"), nic(&t, "mlx5_3")),
        PathType::Pix,
        0,
        48.0,
    );
    // Symmetry over all GPU–NIC and NIC–NIC pairs.
    for a in t.nic_ids() {
        for g in t.gpu_ids() {
            assert_eq!(t.path(a, g), t.path(g, a));
        }
        for b in t.nic_ids() {
            assert_eq!(t.path(a, b), t.path(b, a));
        }
    }
    // Nearest GPU: the first GPU on the NIC's switch.
    let (g, p) = t.nearest_gpu(nic(&t, "mlx5_5")).unwrap();
    assert_eq!(t.gpu(g).name, "GPU4");
    assert_eq!(p.kind, PathType::Pix);
}

#[test]
fn dgx_inter_socket_bandwidth_is_an_assumption_that_can_change() {
    let (_d, mut t) = dgx();
    t.set_inter_socket_gbps(40.0);
    pin(
        t.path(gpu(&t, "GPU0"), nic(&t, "mlx5_4")),
        PathType::Sys,
        5,
        40.0,
    );
}

#[test]
fn dual_socket_paths() {
    let dir = tempfile::tempdir().unwrap();
    machines::dual_socket(dir.path()).unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    assert_eq!(t.nics().len(), 2);
    let (n0, n1) = (nic(&t, "mlx5_0"), nic(&t, "mlx5_1"));
    let (g0, g1) = (gpu(&t, "GPU0"), gpu(&t, "GPU1"));
    assert_eq!(t.nic(n0).netdev.as_deref(), Some("ens1np0"));
    assert_eq!(t.nic(n0).link_layer.as_deref(), Some("Ethernet"));
    assert_eq!(t.nic(n0).address.as_deref(), Some("b8:3f:d2:00:00:00"));
    // Root ports leave no node: a device on a root port hangs off its CPU.
    pin(t.path(g0, n0), PathType::Phb, 2, 24.0);
    pin(t.path(g1, n1), PathType::Phb, 2, 24.0);
    pin(t.path(g0, n1), PathType::Sys, 3, 22.0);
    pin(t.path(g1, n0), PathType::Sys, 3, 22.0);
    pin(t.path(n0, n1), PathType::Sys, 3, 22.0);
    assert_eq!(t.nic_numa(n1), Some(1));
}

#[test]
fn single_switch_paths_take_the_narrowest_link() {
    let dir = tempfile::tempdir().unwrap();
    machines::single_switch(dir.path()).unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    // No RDMA device: the netdevs are the NICs, and `lo` (virtual) is not one.
    let names: Vec<&str> = t.nics().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["eth0", "eth1"]);
    let (e0, e1) = (nic(&t, "eth0"), nic(&t, "eth1"));
    assert_eq!(t.nic(e0).kind, NicKind::Netdev);
    assert_eq!(t.nic(e0).speed_mbps, Some(100_000));
    // eth1: a x16 device behind a x8 downstream port counts x8.
    assert_eq!(t.nic(e1).pcie.as_ref().unwrap().width, 8);
    let (g0, g1) = (gpu(&t, "GPU0"), gpu(&t, "GPU1"));
    pin(t.path(g0, e0), PathType::Pix, 2, 6.0);
    pin(t.path(g0, e1), PathType::Pix, 2, 12.0);
    pin(t.path(g1, e1), PathType::Pix, 2, 12.0);
    pin(t.path(e0, e1), PathType::Pix, 2, 6.0);
    pin(t.path(g0, g1), PathType::Pix, 2, 24.0);
}

#[test]
fn cascaded_switches_in_sysfs_give_pxb() {
    let dir = tempfile::tempdir().unwrap();
    let b = SysfsBuilder::new(dir.path()).unwrap();
    let top = ["0000:00:01.0", "0000:01:00.0"];
    // A second switch (upstream 03:00.0) behind downstream port 02:00.0 of the first.
    let low = [
        top[0],
        top[1],
        "0000:02:00.0",
        "0000:03:00.0",
        "0000:04:00.0",
    ];
    b.gpu(
        &[low[0], low[1], low[2], low[3], low[4], "0000:05:00.0"],
        PciOpts::new(4, 16, 0),
    )
    .unwrap();
    b.rdma_nic(
        "mlx5_0",
        &[top[0], top[1], "0000:02:01.0", "0000:06:00.0"],
        PciOpts::new(4, 16, 0),
        &[PortOpts::ib(200)],
        &[],
    )
    .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    pin(
        t.path(gpu(&t, "GPU0"), nic(&t, "mlx5_0")),
        PathType::Pxb,
        3,
        24.0,
    );
}

#[test]
fn broadcom_gen4_two_level_switch_is_one_switch() {
    let dir = tempfile::tempdir().unwrap();
    let b = SysfsBuilder::new(dir.path()).unwrap();
    let bcm = PciOpts::new(4, 16, 0)
        .ids("0x060400", "0x1000", "0xc010")
        .subsystem("0x1000", "0xa064");
    b.pci(&["0000:00:01.0", "0000:01:00.0"], &bcm).unwrap();
    b.pci(&["0000:00:01.0", "0000:01:00.0", "0000:02:00.0"], &bcm)
        .unwrap();
    b.pci(
        &[
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:03:00.0",
        ],
        &bcm,
    )
    .unwrap();
    b.gpu(
        &[
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:03:00.0",
            "0000:04:00.0",
            "0000:05:00.0",
        ],
        PciOpts::new(4, 16, 0),
    )
    .unwrap();
    b.rdma_nic(
        "mlx5_0",
        &[
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:01.0",
            "0000:06:00.0",
        ],
        PciOpts::new(4, 16, 0),
        &[PortOpts::ib(200)],
        &[],
    )
    .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    pin(
        t.path(gpu(&t, "GPU0"), nic(&t, "mlx5_0")),
        PathType::Pix,
        2,
        24.0,
    );
}

#[test]
fn multi_port_device_names_each_port() {
    let dir = tempfile::tempdir().unwrap();
    let b = SysfsBuilder::new(dir.path()).unwrap();
    let mut down = PortOpts::roce(100, "ens1f1np1");
    down.state = "1: DOWN".into();
    b.rdma_nic(
        "mlx5_0",
        &["0000:00:01.0", "0000:01:00.0"],
        PciOpts::new(4, 16, -1),
        &[PortOpts::roce(100, "ens1f0np0"), down],
        &[
            (
                "ens1f0np0",
                NetdevOpts::ethernet(100_000, "aa:00:00:00:00:00"),
            ),
            (
                "ens1f1np1",
                NetdevOpts::ethernet(100_000, "aa:00:00:00:00:01"),
            ),
        ],
    )
    .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    let names: Vec<&str> = t.nics().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0:1", "mlx5_0:2"]);
    let p2 = t.nic(nic(&t, "mlx5_0:2"));
    assert_eq!(p2.netdev.as_deref(), Some("ens1f1np1"));
    assert_eq!(p2.state, LinkState::Down);
    assert_eq!(p2.numa_node, None);
    // Ports of one device share a PCI node.
    pin(
        t.path(nic(&t, "mlx5_0:1"), nic(&t, "mlx5_0:2")),
        PathType::Pix,
        0,
        24.0,
    );
    // The netdev name finds the NIC too.
    assert_eq!(t.nic_by_name("ens1f1np1"), Some(nic(&t, "mlx5_0:2")));
    // Fabric::Tcp lists the netdevs instead.
    let tcp = Topology::discover_fabric(dir.path(), Fabric::Tcp).unwrap();
    assert_eq!(tcp.nics().len(), 2);
    assert_eq!(tcp.nics()[0].name, "ens1f0np0");
}

#[test]
fn rail_map_from_env_overrides_and_validates() {
    let (_d, mut t) = dgx();
    let map = "mlx5_0:7,mlx5_1:6,mlx5_2:5,mlx5_3:4,mlx5_4:3,mlx5_5:2,mlx5_6:1,ibp7s0:0";
    t.apply_rail_env(Some(map)).unwrap();
    assert_eq!(t.rail_source(), RailSource::Env);
    assert_eq!(t.nic(nic(&t, "mlx5_0")).rail, Some(7));
    assert_eq!(t.nic(nic(&t, "mlx5_7")).rail, Some(0));

    let (_d, mut t) = dgx();
    let e = t.apply_rail_env(Some("mlx5_0:0,mlx5_1:1")).unwrap_err();
    assert!(matches!(&e, RailError::Partial { missing, .. } if missing.len() == 6));
    assert!(e.to_string().contains("mlx5_2"), "{e}");
    // Nothing changed.
    assert_eq!(t.rail_source(), RailSource::Automatic);

    let e = t
        .apply_rail_env(Some("mlx5_0:0,mlx5_9:1"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mlx5_9") && e.contains("not a NIC"), "{e}");

    // The same NIC by two names, with two rails.
    let e = t.apply_rail_env(Some("mlx5_0:0,ibp0s0:1")).unwrap_err();
    assert!(matches!(e, RailError::Conflict { ref nic, .. } if nic == "mlx5_0"));

    // Empty means "not set".
    t.apply_rail_env(Some("")).unwrap();
    assert_eq!(t.rail_source(), RailSource::Automatic);
}

#[test]
fn rails_beyond_what_the_handshake_carries_are_refused() {
    // A lane's Hello carries each rail as an i32 with -1 for none: 2^31 would make every
    // handshake malformed, 2^32 - 1 would reach the peer as "no rail".
    assert_eq!(
        RailMap::parse("RAILOVER_RAILS", "eth0:2147483647")
            .unwrap()
            .entries(),
        &[("eth0".to_string(), rails::MAX_RAIL)]
    );
    for big in ["2147483648", "4294967295"] {
        let e = RailMap::parse("RAILOVER_RAILS", &format!("eth0:{big}")).unwrap_err();
        assert!(matches!(e, RailError::Syntax { .. }), "{e}");
        assert!(e.to_string().contains("0 to 2147483647"), "{e}");
    }
}

#[test]
fn backup_candidates_order_and_exclusions() {
    let (_d, t) = dgx();
    let n0 = nic(&t, "mlx5_0");
    let c = t.backup_candidates(n0, RailRule::Same, PathType::Phb);
    let order: Vec<(&str, bool)> = c.iter().map(|c| (c.name.as_str(), c.eligible())).collect();
    assert_eq!(
        order,
        [
            ("mlx5_1", true),
            ("mlx5_2", true),
            ("mlx5_3", true),
            ("mlx5_4", false),
            ("mlx5_5", false),
            ("mlx5_6", false),
            ("mlx5_7", false),
        ]
    );
    assert_eq!(
        c[3].excluded_by,
        Some(Exclusion::DistanceLimit {
            kind: PathType::Sys,
            limit: PathType::Phb
        })
    );
    // PIX keeps only the switch mate; SYS admits all.
    let pix = t.backup_candidates(n0, RailRule::Same, PathType::Pix);
    assert_eq!(pix.iter().filter(|c| c.eligible()).count(), 1);
    let sys = t.backup_candidates(n0, RailRule::Any, PathType::Sys);
    assert!(sys.iter().all(Candidate::eligible));
}

#[test]
fn candidates_without_rail_or_pci_place() {
    let dir = tempfile::tempdir().unwrap();
    machines::single_switch(dir.path()).unwrap();
    let b = SysfsBuilder::new(dir.path()).unwrap();
    b.virtual_netdev("veth0").unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    assert_eq!(t.nics().len(), 2, "virtual interfaces are not NICs");

    // A NIC with no PCI device can still come from an XML (NCCL hangs it off the CPU).
    let xml = r#"<system version="1">
      <cpu numaid="0">
        <pci busid="0000:01:00.0" link_speed="16.0 GT/s PCIe" link_width="16">
          <pci busid="0000:03:00.0" class="0x030200" vendor="0x10de" link_speed="16.0 GT/s PCIe" link_width="16"><gpu dev="0"/></pci>
          <pci busid="0000:04:00.0" link_speed="16.0 GT/s PCIe" link_width="16"><nic><net name="eth0" speed="100000"/></nic></pci>
        </pci>
        <nic><net name="veth0" speed="10000"/></nic>
      </cpu>
    </system>"#;
    let t = Topology::from_xml(xml, "inline").unwrap();
    let veth = nic(&t, "veth0");
    assert_eq!(t.nic(veth).rail, None, "no PCI order, no automatic rail");
    let eth0 = nic(&t, "eth0");
    let c = t.backup_candidates(eth0, RailRule::Same, PathType::Sys);
    assert_eq!(
        c[0].excluded_by,
        Some(Exclusion::RailMismatch {
            local: None,
            remote: None
        })
    );
    let c = t.backup_candidates(eth0, RailRule::Any, PathType::Sys);
    assert!(c[0].eligible());
}

#[test]
fn empty_root_is_an_empty_topology() {
    let dir = tempfile::tempdir().unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    assert!(t.nics().is_empty() && t.gpus().is_empty());
}

/// The spread of `name`'s comms if it fails, under `rule` and `limit`.
fn spread(t: &Topology, name: &str, rule: RailRule, limit: PathType) -> report::Spread {
    report::Spread::of(t, &t.backup_candidates(nic(t, name), rule, limit))
}

fn survivors(s: &report::Spread) -> Vec<&str> {
    s.survivors.iter().map(String::as_str).collect()
}

#[test]
fn spread_over_every_allowed_survivor_by_distance_limit() {
    let (_d, t) = dgx();
    for (limit, want) in [
        (PathType::Pix, &["mlx5_1"][..]),
        // No cascaded switches on this machine: PXB admits what PIX does.
        (PathType::Pxb, &["mlx5_1"][..]),
        (PathType::Phb, &["mlx5_1", "mlx5_2", "mlx5_3"][..]),
        (
            PathType::Sys,
            &[
                "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
            ][..],
        ),
    ] {
        let s = spread(&t, "mlx5_0", RailRule::Same, limit);
        assert_eq!(survivors(&s), want, "{limit}");
        let k = want.len();
        assert_eq!((s.count, s.nics), (k, 8), "{limit}");
        assert_eq!(s.kept_fraction, k as f64 / (k + 1) as f64, "{limit}");
        assert!(s.down_now.is_empty());
    }
    // On the other socket, the survivors are that socket's NICs.
    let s = spread(&t, "mlx5_5", RailRule::Same, PathType::Phb);
    assert_eq!(survivors(&s), ["mlx5_4", "mlx5_6", "mlx5_7"]);
    assert_eq!(
        s.describe(),
        "comms spread over 3 survivors (mlx5_4, mlx5_6, mlx5_7); a collective keeps 3/4 (75%) \
         of its bandwidth"
    );
    let s = spread(&t, "mlx5_5", RailRule::Any, PathType::Sys);
    assert!(
        s.describe().contains("keeps 7/8 (87.5%)"),
        "{}",
        s.describe()
    );
}

#[test]
fn spread_from_the_topology_xml_matches_sysfs() {
    let (_d, live) = dgx();
    let xml = Topology::from_xml(
        include_str!("../../tests/fixtures/topology/dgx-h100.xml"),
        "dgx-h100.xml",
    )
    .unwrap();
    assert_eq!(xml.nics().len(), 8);
    for limit in PathType::ALL {
        for n in live.nics() {
            let a = spread(&live, &n.name, RailRule::Same, limit);
            let b = spread(&xml, &n.name, RailRule::Same, limit);
            assert_eq!(a, b, "{} {limit}", n.name);
            assert!(a.count >= 1, "{} {limit}", n.name);
        }
    }
}

#[test]
fn a_survivor_down_now_is_not_counted() {
    let dir = tempfile::tempdir().unwrap();
    let b = machines::dgx_h100(dir.path()).unwrap();
    b.set("class/infiniband/mlx5_2/ports/1/state", "1: DOWN")
        .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    assert_eq!(t.nic(nic(&t, "mlx5_2")).state, LinkState::Down);
    let s = spread(&t, "mlx5_0", RailRule::Same, PathType::Phb);
    assert_eq!(survivors(&s), ["mlx5_1", "mlx5_3"]);
    assert_eq!(s.down_now, ["mlx5_2"]);
    assert_eq!(s.count, 2);
    assert_eq!(s.kept_fraction, 2.0 / 3.0);
    assert!(
        s.describe()
            .ends_with("keeps 2/3 (66.7%) of its bandwidth; not counted, down now: mlx5_2"),
        "{}",
        s.describe()
    );
    // With PIX its only backup is mlx5_1; down too, nothing is left.
    b.set("class/infiniband/mlx5_1/ports/1/state", "1: DOWN")
        .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    let s = spread(&t, "mlx5_0", RailRule::Same, PathType::Pix);
    assert_eq!((s.count, s.kept_fraction), (0, 0.0));
    assert_eq!(
        s.describe(),
        "no survivor to spread its comms over (every allowed backup is down now): they fail; \
         not counted, down now: mlx5_1"
    );
}

#[test]
fn no_spread_where_the_rules_leave_no_survivor() {
    // Two sockets, one NIC each: only SYS lets them back each other up.
    let dir = tempfile::tempdir().unwrap();
    machines::dual_socket(dir.path()).unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    let s = spread(&t, "mlx5_0", RailRule::Same, PathType::Phb);
    assert_eq!((s.count, s.nics, s.kept_fraction), (0, 2, 0.0));
    assert!(s.survivors.is_empty() && s.down_now.is_empty());
    assert_eq!(
        s.describe(),
        "no survivor to spread its comms over (no other NIC passes the rail rule and the \
         distance limit): they fail"
    );
    let s = spread(&t, "mlx5_0", RailRule::Same, PathType::Sys);
    assert_eq!(survivors(&s), ["mlx5_1"]);
    assert_eq!(s.kept_fraction, 0.5);
    assert!(s
        .describe()
        .starts_with("comms spread over 1 survivor (mlx5_1);"));

    // Rule same and a survivor without a rail: excluded; rule any takes it.
    let xml = r#"<system version="1">
      <cpu numaid="0">
        <pci busid="0000:01:00.0" link_speed="16.0 GT/s PCIe" link_width="16">
          <pci busid="0000:03:00.0" class="0x030200" vendor="0x10de" link_speed="16.0 GT/s PCIe" link_width="16"><gpu dev="0"/></pci>
          <pci busid="0000:04:00.0" link_speed="16.0 GT/s PCIe" link_width="16"><nic><net name="eth0" speed="100000"/></nic></pci>
        </pci>
        <nic><net name="veth0" speed="10000"/></nic>
      </cpu>
    </system>"#;
    let t = Topology::from_xml(xml, "inline").unwrap();
    assert_eq!(spread(&t, "eth0", RailRule::Same, PathType::Sys).count, 0);
    assert_eq!(
        survivors(&spread(&t, "eth0", RailRule::Any, PathType::Sys)),
        ["veth0"]
    );

    // A lone NIC.
    let dir = tempfile::tempdir().unwrap();
    let b = SysfsBuilder::new(dir.path()).unwrap();
    b.eth_nic(
        "eth0",
        &["0000:00:01.0", "0000:01:00.0"],
        PciOpts::new(4, 16, 0),
        &NetdevOpts::ethernet(100_000, "aa:bb:cc:dd:ee:ff"),
    )
    .unwrap();
    let t = Topology::discover(dir.path()).unwrap();
    let s = spread(&t, "eth0", RailRule::Any, PathType::Sys);
    assert_eq!((s.count, s.nics), (0, 1));
    assert!(
        s.describe().contains("(it is the only NIC)"),
        "{}",
        s.describe()
    );
}

#[test]
fn the_report_carries_each_nics_spread() {
    let (_d, t) = dgx();
    let settings = report::DoctorSettings::default();
    let r = report::DoctorReport::build(&t, settings);
    for n in &r.nics {
        assert_eq!(
            n.spread,
            spread(&t, &n.name, settings.rail_rule, settings.distance_limit)
        );
    }
    let text = r.render_text();
    assert!(
        text.contains(
            "      if it fails: comms spread over 3 survivors (mlx5_1, mlx5_2, mlx5_3); a \
             collective keeps 3/4 (75%) of its bandwidth\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("spread: a failed NIC's comms go to 3 survivors or more (fewest: mlx5_0)"),
        "{text}"
    );
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["nics"][7]["spread"]["count"], 3);
    assert_eq!(v["nics"][7]["spread"]["kept_fraction"], 0.75);
    assert_eq!(v["nics"][7]["spread"]["survivors"][0], "mlx5_6");
}
