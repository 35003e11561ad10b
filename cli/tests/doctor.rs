//! `railover doctor` run as a process on fixture sysfs trees.

use std::path::Path;
use std::process::{Command, Output};

use railover_testkit::fixture::machines;

fn doctor(root: &Path, args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_railover"));
    cmd.arg("doctor")
        .args(args)
        .env("RAILOVER_SYSFS_ROOT", root);
    for v in [
        "NCCL_TOPO_FILE",
        "RAILOVER_RAILS",
        "RAILOVER_RAIL_RULE",
        "RAILOVER_DISTANCE_LIMIT",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.output().expect("run railover")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn dgx_is_healthy_and_lists_backups() {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    let o = doctor(dir.path(), &[], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains("mlx5_0  rail 0  NUMA 0  0000:14:00.0  InfiniBand  up"),
        "{t}"
    );
    assert!(
        t.contains("nearest GPU: GPU0 (PIX, 2 hops, 48 GB/s)"),
        "{t}"
    );
    assert!(
        t.contains("backups from GPU0: mlx5_1 (PIX, 2 hops, 48 GB/s), mlx5_2 (PHB"),
        "{t}"
    );
    assert!(
        t.contains("excluded: mlx5_4 by distance limit PHB: its path is SYS"),
        "{t}"
    );
    assert!(
        t.contains(
            "if it fails: comms spread over 3 survivors (mlx5_1, mlx5_2, mlx5_3); a collective \
             keeps 3/4 (75%) of its bandwidth"
        ),
        "{t}"
    );
    assert!(t.contains("healthy"), "{t}");
}

#[test]
fn spread_follows_the_distance_limit_in_text_and_json() {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    for (limit, k, kept) in [("PIX", 1, 0.5), ("PHB", 3, 0.75), ("SYS", 7, 0.875)] {
        let o = doctor(
            dir.path(),
            &["--json"],
            &[("RAILOVER_DISTANCE_LIMIT", limit)],
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for n in v["nics"].as_array().unwrap() {
            let s = &n["spread"];
            assert_eq!(s["count"], k, "{limit} {n}");
            assert_eq!(s["survivors"].as_array().unwrap().len(), k, "{limit} {n}");
            assert_eq!(s["nics"], 8);
            assert_eq!(s["kept_fraction"], kept, "{limit} {n}");
            // The survivors are exactly the eligible backups (all ports are up).
            let eligible: Vec<&serde_json::Value> = n["backups"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c["excluded_by"].is_null())
                .map(|c| &c["name"])
                .collect();
            let survivors: Vec<&serde_json::Value> =
                s["survivors"].as_array().unwrap().iter().collect();
            assert_eq!(survivors, eligible, "{limit} {n}");
        }
    }
    let o = doctor(dir.path(), &[], &[("RAILOVER_DISTANCE_LIMIT", "SYS")]);
    let t = text(&o);
    assert!(
        t.contains(
            "spread: a failed NIC's comms go to 7 survivors or more (fewest: mlx5_0); a collective \
             keeps 7/8 (87.5%) of its bandwidth or more"
        ),
        "{t}"
    );
}

#[test]
fn json_report_has_every_nic() {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    let o = doctor(
        dir.path(),
        &["--json"],
        &[("RAILOVER_DISTANCE_LIMIT", "PIX")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["healthy"], true);
    assert_eq!(v["settings"]["distance_limit"], "PIX");
    assert_eq!(v["settings"]["rail_rule"], "same");
    let nics = v["nics"].as_array().unwrap();
    assert_eq!(nics.len(), 8);
    assert_eq!(nics[2]["name"], "mlx5_2");
    assert_eq!(nics[2]["rail"], 2);
    assert_eq!(nics[2]["nearest_gpu"]["gpu"], "GPU2");
    assert_eq!(nics[2]["nearest_gpu"]["path"]["kind"], "PIX");
    let backups = nics[2]["backups"].as_array().unwrap();
    assert_eq!(backups[0]["name"], "mlx5_3");
    assert!(backups[0]["excluded_by"].is_null());
    assert_eq!(backups[1]["excluded_by"]["rule"], "distance_limit");
    assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
}

#[test]
fn dual_socket_needs_sys_and_says_the_limit_is_too_strict() {
    let dir = tempfile::tempdir().unwrap();
    machines::dual_socket(dir.path()).unwrap();
    // Default limit PHB: the only other NIC is across the socket link.
    let o = doctor(dir.path(), &[], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("mlx5_0 has no backup: mlx5_1 (distance limit PHB: its path is SYS)"),
        "{t}"
    );
    assert!(
        t.contains("RAILOVER_DISTANCE_LIMIT=PHB is stricter than this hardware allows"),
        "{t}"
    );
    assert!(t.contains("UNHEALTHY"), "{t}");
    assert!(
        t.contains(
            "if it fails: no survivor to spread its comms over (no other NIC passes the rail \
             rule and the distance limit): they fail"
        ),
        "{t}"
    );
    assert!(t.contains("spread: if mlx5_0 fails, no survivor"), "{t}");
    let o = doctor(dir.path(), &["--json"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["nics"][1]["spread"]["count"], 0);
    assert_eq!(v["nics"][1]["spread"]["kept_fraction"], 0.0);
    // With SYS it is healthy, and each NIC's comms would go to the other.
    let o = doctor(dir.path(), &[], &[("RAILOVER_DISTANCE_LIMIT", "SYS")]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains(
            "if it fails: comms spread over 1 survivor (mlx5_0); a collective keeps 1/2 (50%)"
        ),
        "{t}"
    );
}

#[test]
fn warnings_for_down_ports_and_mixed_speeds() {
    let dir = tempfile::tempdir().unwrap();
    let b = machines::single_switch(dir.path()).unwrap();
    b.set("class/net/eth1/carrier", "0").unwrap();
    b.set("class/net/eth1/operstate", "down").unwrap();
    let o = doctor(dir.path(), &["--json"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let kinds: Vec<&str> = v["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"port_down"), "{kinds:?}");
    assert!(kinds.contains(&"mixed_speeds"), "{kinds:?}");
    assert!(!kinds.contains(&"mixed_link_layers"), "{kinds:?}");
    assert_eq!(v["nics"][1]["state"], "down");
    // eth1 is still an allowed backup of eth0 (exit 0), but a down one takes no comms.
    assert_eq!(v["nics"][0]["spread"]["count"], 0);
    assert_eq!(v["nics"][0]["spread"]["down_now"][0], "eth1");
}

#[test]
fn rail_map_errors_name_the_nic_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    machines::dual_socket(dir.path()).unwrap();
    let o = doctor(dir.path(), &[], &[("RAILOVER_RAILS", "mlx5_0:0")]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("RAILOVER_RAILS gives no rail for mlx5_1"), "{t}");
    let o = doctor(dir.path(), &[], &[("RAILOVER_RAILS", "mlx5_0=0")]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("RAILOVER_RAILS=\"mlx5_0=0\"") && t.contains("NIC:RAIL"),
        "{t}"
    );
    let o = doctor(dir.path(), &[], &[("RAILOVER_RAILS", "mlx5_0:1,mlx5_1:0")]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("mlx5_0  rail 1"), "{t}");
}

#[test]
fn bad_limit_exits_2_with_the_variable_named() {
    let dir = tempfile::tempdir().unwrap();
    machines::dgx_h100(dir.path()).unwrap();
    let o = doctor(dir.path(), &[], &[("RAILOVER_DISTANCE_LIMIT", "NEAR")]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains(
            "RAILOVER_DISTANCE_LIMIT=\"NEAR\" is not valid: expected one of PIX, PXB, PHB, SYS"
        ),
        "{t}"
    );
}

#[test]
fn topo_file_gives_distances_and_sysfs_gives_state() {
    let dir = tempfile::tempdir().unwrap();
    let b = machines::dgx_h100(dir.path()).unwrap();
    b.set("class/infiniband/mlx5_3/ports/1/state", "1: DOWN")
        .unwrap();
    let xml = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/topology/dgx-h100.xml"
    );
    let o = doctor(dir.path(), &["--json", "--topo-file", xml], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["origin"]["xml"]
        .as_str()
        .unwrap()
        .ends_with("dgx-h100.xml"));
    assert_eq!(v["nics"][3]["state"], "down");
    assert_eq!(v["nics"][0]["state"], "up");
    assert_eq!(v["nics"][0]["nearest_gpu"]["path"]["kind"], "PIX");
}

#[test]
fn single_nic_has_no_backup() {
    let dir = tempfile::tempdir().unwrap();
    let b = railover_testkit::fixture::SysfsBuilder::new(dir.path()).unwrap();
    b.eth_nic(
        "eth0",
        &["0000:00:01.0", "0000:01:00.0"],
        railover_testkit::fixture::PciOpts::new(4, 16, 0),
        &railover_testkit::fixture::NetdevOpts::ethernet(100_000, "aa:bb:cc:dd:ee:ff"),
    )
    .unwrap();
    let o = doctor(dir.path(), &[], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("eth0 has no backup: it is the only NIC"), "{t}");
    // No NIC at all is unhealthy too.
    let empty = tempfile::tempdir().unwrap();
    assert_eq!(doctor(empty.path(), &[], &[]).status.code(), Some(1));
}

#[test]
fn usage_and_unknown_arguments() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(doctor(dir.path(), &["--help"], &[]).status.code(), Some(0));
    assert_eq!(doctor(dir.path(), &["--bogus"], &[]).status.code(), Some(2));
    let o = Command::new(env!("CARGO_BIN_EXE_railover"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("doctor"));
    let o = Command::new(env!("CARGO_BIN_EXE_railover"))
        .args(["sim", "--nics", "8", "--nodes", "4", "--size", "1G"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(
        s.contains("railover spread") && s.contains("NCCL native failover"),
        "{s}"
    );
}

#[test]
fn mixed_link_layers_are_reported() {
    use railover_testkit::fixture::{PciOpts, PortOpts};
    let dir = tempfile::tempdir().unwrap();
    let b = machines::dual_socket(dir.path()).unwrap();
    // An InfiniBand NIC next to the two RoCE ones.
    b.rdma_nic(
        "mlx5_2",
        &["0000:18:01.0", "0000:19:00.0"],
        PciOpts::new(4, 16, 0),
        &[PortOpts::ib(400)],
        &[],
    )
    .unwrap();
    let o = doctor(dir.path(), &[], &[]);
    let t = text(&o);
    assert!(
        t.contains("mixed link layers (Ethernet: mlx5_0, mlx5_1; InfiniBand: mlx5_2)"),
        "{t}"
    );
    assert!(t.contains("mixed port speeds"), "{t}");
    // mlx5_0 and mlx5_2 share socket 0 (PHB), mlx5_1 is alone on socket 1.
    assert!(t.contains("mlx5_1 has no backup"), "{t}");
    assert_eq!(o.status.code(), Some(1), "{t}");
}

#[test]
fn an_unknown_distance_is_allowed_as_the_router_allows_it() {
    let dir = tempfile::tempdir().unwrap();
    let b = machines::dual_socket(dir.path()).unwrap();
    // Soft-RoCE: a NIC with no PCI device, so no distance to any GPU.
    b.set("class/infiniband/rxe0/ports/1/state", "4: ACTIVE")
        .unwrap();
    let o = doctor(dir.path(), &[], &[("RAILOVER_RAIL_RULE", "any")]);
    let t = text(&o);
    // The two PCI NICs are SYS apart (beyond PHB), yet each has a backup: rxe0.
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains("backups from GPU0: rxe0 (allowed: distance unknown)"),
        "{t}"
    );
    assert!(
        t.contains("excluded: mlx5_1 by distance limit PHB: its path is SYS"),
        "{t}"
    );
    let o = doctor(
        dir.path(),
        &["--json"],
        &[
            ("RAILOVER_RAIL_RULE", "any"),
            ("RAILOVER_DISTANCE_LIMIT", "PIX"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let backups = v["nics"][0]["backups"].as_array().unwrap();
    assert_eq!(backups[0]["name"], "rxe0");
    assert!(backups[0]["excluded_by"].is_null());
    assert_eq!(backups[0]["distance_unknown"], true);
    assert_eq!(backups[1]["excluded_by"]["rule"], "distance_limit");
}
