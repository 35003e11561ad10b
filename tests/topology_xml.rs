//! The topology XML and sysfs agree on the same machine: the fixture pair is
//! `fixture::machines::dgx_h100` (sysfs) and `tests/fixtures/topology/dgx-h100.xml` (the
//! same node as NCCL_TOPO_DUMP_FILE would write it).

use railover::topology::{PathType, RailError, RailSource, Topology, TopologyError};
use railover_testkit::fixture::machines;

const DGX_XML: &str = include_str!("fixtures/topology/dgx-h100.xml");

#[test]
fn xml_and_sysfs_give_the_same_distances() {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    let sys = Topology::discover(dir.path()).unwrap();
    let xml = Topology::from_xml(DGX_XML, "dgx-h100.xml").unwrap();

    let names = |t: &Topology| t.nics().iter().map(|n| n.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&sys), names(&xml));
    let gpus = |t: &Topology| t.gpus().iter().map(|g| g.pci_addr).collect::<Vec<_>>();
    assert_eq!(gpus(&sys), gpus(&xml));
    assert_eq!(sys.inter_socket_gbps(), xml.inter_socket_gbps());

    let mut pairs = 0;
    for a in sys.nic_ids() {
        let xa = xml.nic_by_name(&sys.nic(a).name).unwrap();
        assert_eq!(sys.nic(a).pci_addr, xml.nic(xa).pci_addr);
        assert_eq!(sys.nic(a).numa_node, xml.nic(xa).numa_node);
        assert_eq!(sys.nic(a).rail, xml.nic(xa).rail);
        for g in sys.gpu_ids() {
            assert_eq!(
                sys.path(a, g),
                xml.path(xa, g),
                "{} GPU{}",
                sys.nic(a).name,
                g.0
            );
            pairs += 1;
        }
        for b in sys.nic_ids() {
            let xb = xml.nic_by_name(&sys.nic(b).name).unwrap();
            assert_eq!(sys.path(a, b), xml.path(xa, xb));
            pairs += 1;
        }
        let nearest = |t: &Topology, n| t.nearest_gpu(n).map(|(g, p)| (t.gpu(g).pci_addr, p));
        assert_eq!(nearest(&sys, a), nearest(&xml, xa));
    }
    assert_eq!(pairs, 8 * 8 + 8 * 8);
    // And the values are the DGX pins, not merely equal.
    let g0 = xml.gpu_by_name("GPU0").unwrap();
    let p = xml.path(g0, xml.nic_by_name("mlx5_4").unwrap()).unwrap();
    assert_eq!((p.kind, p.hops, p.bandwidth_gbps), (PathType::Sys, 5, 22.0));
}

#[test]
fn xml_rail_attributes_set_rails() {
    let xml = DGX_XML.replace("<net name=\"mlx5_", "<net rail=\"RAIL\" name=\"mlx5_");
    // rail = 7 - index, so the map is not the automatic one.
    let mut text = String::new();
    for (i, part) in xml.split("RAIL").enumerate() {
        text.push_str(part);
        if i < 8 {
            text.push_str(&(7 - i).to_string());
        }
    }
    let t = Topology::from_xml(&text, "railed.xml").unwrap();
    assert_eq!(t.rail_source(), RailSource::Xml);
    assert_eq!(t.nic(t.nic_by_name("mlx5_0").unwrap()).rail, Some(7));
    assert_eq!(t.nic(t.nic_by_name("mlx5_7").unwrap()).rail, Some(0));
}

#[test]
fn xml_rail_beyond_what_the_handshake_carries_is_refused() {
    let text = DGX_XML.replace("<net name=\"mlx5_", "<net rail=\"2147483648\" name=\"mlx5_");
    let e = Topology::from_xml(&text, "big.xml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2147483648") && e.contains("0 to 2147483647"),
        "{e}"
    );
}

#[test]
fn partial_xml_rails_name_the_missing_nics() {
    let text = DGX_XML.replacen("<net name=\"mlx5_0\"", "<net rail=\"0\" name=\"mlx5_0\"", 1);
    match Topology::from_xml(&text, "partial.xml") {
        Err(TopologyError::Rail(RailError::Partial { missing, .. })) => {
            assert_eq!(missing.len(), 7);
            assert_eq!(missing[0], "mlx5_1");
        }
        other => panic!("expected a partial-rail error, got {other:?}"),
    }
}

#[test]
fn conflicting_xml_rails_name_the_nic() {
    let text = DGX_XML.replacen(
        "<nic>\n          <net name=\"mlx5_0\"",
        "<nic rail=\"1\">\n          <net rail=\"0\" name=\"mlx5_0\"",
        1,
    );
    let e = Topology::from_xml(&text, "conflict.xml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("mlx5_0") && e.contains("rail"), "{e}");
}

#[test]
fn malformed_xml_is_an_error() {
    assert!(matches!(
        Topology::from_xml("<system><cpu>", "bad.xml"),
        Err(TopologyError::Xml(_))
    ));
    let e = Topology::from_xml(
        "<system><cpu numaid=\"0\"><pci busid=\"zz\"/></cpu></system>",
        "bad.xml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("line 1") && e.contains("zz"), "{e}");
    assert!(Topology::from_xml("<root/>", "bad.xml").is_err());
}
