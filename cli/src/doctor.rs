//! `railover doctor`: what this node looks like to railover, and what is misconfigured.
//! For each NIC it also shows the spread railover would use if that NIC failed: the
//! survivors its comms would be striped over and the share of bandwidth a collective keeps
//! (`report::Spread`).
//!
//! The only place in the topology work that reads the environment:
//! * `RAILOVER_SYSFS_ROOT` (default `/sys`; `--sysfs-root` overrides): where to discover;
//! * `NCCL_TOPO_FILE` (`--topo-file` overrides): a topology XML to take distances from, as
//!   NCCL would; link states then still come from sysfs, matched by NIC name;
//! * `RAILOVER_RAILS`, `RAILOVER_RAIL_RULE` (`same`|`any`, default `same`),
//!   `RAILOVER_DISTANCE_LIMIT` (`PIX`|`PXB`|`PHB`|`SYS`, default `PHB`); all three go
//!   through [`Config`] as in the plugin, so every `RAILOVER_*` value is checked once.
//!
//! It also lists the node's verbs NICs (every port of every RDMA device libibverbs
//! reports): port state, link layer, speed, the GID table with the GID a RoCE path would
//! use, and the rail. These do not change the exit code: the verbs fabric carries no lanes
//! yet.
//!
//! Exit codes: 0 healthy; 1 when a NIC has no possible backup (or there is no NIC); 2 on a
//! bad argument, a bad setting or an unreadable topology.

use std::path::PathBuf;

use railover::config::Config;
use railover::topology::report::{DoctorReport, DoctorSettings};
use railover::topology::{RailSource, Topology};
use railover::transport::verbs::device::{self, Discovery};
use railover::transport::verbs::{gpu, Domain, GpuMemory};

#[derive(Debug, Clone, Default, clap::Args)]
#[command(
    after_help = "Settings read from the environment: RAILOVER_RAILS=NIC:RAIL,...  \
RAILOVER_RAIL_RULE=same|any  RAILOVER_DISTANCE_LIMIT=PIX|PXB|PHB|SYS\n\
Exit status: 0 healthy; 1 when a NIC has no possible backup (or there is no NIC); 2 on a \
bad argument, a bad setting or an unreadable topology."
)]
pub struct Args {
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
    /// sysfs to read [default: $RAILOVER_SYSFS_ROOT, else /sys]
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,
    /// NCCL topology XML to take distances from [default: $NCCL_TOPO_FILE]
    #[arg(long, value_name = "XML")]
    pub topo_file: Option<PathBuf>,
}

/// Runs `railover doctor`; returns the exit code.
pub fn run(args: &Args) -> i32 {
    let env = |k: &str| std::env::var(k).ok();
    match report(args, &env) {
        Ok(report) => {
            let verbs = verbs_section(args, &env);
            if args.json {
                #[derive(serde::Serialize)]
                struct Full<'a> {
                    #[serde(flatten)]
                    report: &'a DoctorReport,
                    verbs: &'a VerbsSection,
                }
                let full = Full {
                    report: &report,
                    verbs: &verbs,
                };
                match serde_json::to_string_pretty(&full) {
                    Ok(s) => emit(&format!("{s}\n")),
                    Err(e) => {
                        eprintln!("railover doctor: cannot encode JSON: {e}");
                        return 2;
                    }
                }
            } else {
                emit(&report.render_text());
                emit(&render_verbs(&verbs));
            }
            report.exit_code()
        }
        Err(e) => {
            eprintln!("railover doctor: {e}");
            2
        }
    }
}

/// Writes to stdout; a closed pipe (`railover doctor | head`) is not an error worth a panic.
fn emit(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// Everything but the printing: arguments and settings in, report out.
fn report(args: &Args, env: &dyn Fn(&str) -> Option<String>) -> Result<Box<DoctorReport>, String> {
    let from_env = |k: &str| env(k).filter(|s| !s.is_empty()).map(PathBuf::from);
    let sysfs_root = args
        .sysfs_root
        .clone()
        .or_else(|| from_env("RAILOVER_SYSFS_ROOT"));
    let topo_file = args
        .topo_file
        .clone()
        .or_else(|| from_env("NCCL_TOPO_FILE"));
    // The plugin's own parser, so the doctor applies the settings the router would.
    let config = Config::from_lookup(env).map_err(|e| e.to_string())?;
    let settings = DoctorSettings {
        rail_rule: config.router.rail_rule,
        distance_limit: config.router.distance_limit,
    };
    let root = sysfs_root.unwrap_or_else(|| PathBuf::from("/sys"));
    let live = Topology::discover(&root).map_err(|e| e.to_string())?;
    let mut topo = match topo_file {
        Some(path) => {
            let f = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read topology XML {f}: {e}"))?;
            let mut t = Topology::from_xml(&text, &f).map_err(|e| format!("{f}: {e}"))?;
            t.merge_live_state(&live);
            t
        }
        None => live,
    };
    // `Config` parsed `RAILOVER_RAILS` already (and checked it); a blank value is `None`.
    if let Some(map) = &config.rails {
        topo.apply_rails(map, RailSource::Env)
            .map_err(|e| e.to_string())?;
    }
    Ok(Box::new(DoctorReport::build(&topo, settings)))
}

/// The verbs part of the report.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct VerbsSection {
    /// Why there are no verbs devices at all (no libibverbs, no kernel support).
    absent: Option<String>,
    /// The QP settings verbs lanes would use (`RAILOVER_IB_*`, `RAILOVER_QPS_PER_LANE`).
    settings: String,
    nics: Vec<VerbsNicReport>,
    /// Ports whose GID is not the kind asked for, and what was used instead.
    notes: Vec<String>,
    /// What `ibv_fork_init` made of registered memory across `fork()`; `None` without
    /// verbs devices.
    fork_safety: Option<String>,
    /// The site's `NCCL_IB_*` values taken for unset `RAILOVER_*` twins, and those
    /// ignored, as the plugin logs them at init.
    nccl_ib: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct VerbsNicReport {
    name: String,
    state: &'static str,
    link_layer: &'static str,
    speed_mbps: u64,
    mtu: u32,
    lid: u16,
    netdev: Option<String>,
    rail: Option<u32>,
    /// Whether NCCL may hand it GPU memory (`ptrSupport`), and why; `None` when not probed.
    gpu: Option<GpuMemory>,
    /// The GID index a path uses; `None` on a RoCE port without a usable GID.
    gid_index: Option<u32>,
    gids: Vec<GidReport>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct GidReport {
    index: u32,
    gid: String,
    kind: &'static str,
}

fn verbs_section(args: &Args, env: &dyn Fn(&str) -> Option<String>) -> VerbsSection {
    let root = args
        .sysfs_root
        .clone()
        .or_else(|| {
            env("RAILOVER_SYSFS_ROOT")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("/sys"));
    // `report` has checked the settings already; an error here cannot happen.
    let config = Config::from_lookup(env).unwrap_or_default();
    let found = device::inventory(&config.verbs.gid, &root);
    let topo = Topology::discover(&root).ok();
    let mut v = summarize(&found, &config, topo.as_ref());
    // As the plugin decides `ptrSupport`: RAILOVER_GDR_HCA, peer memory in sysfs, a
    // dma-buf probe per device.
    let peer = gpu::peermem(&root);
    for (report, nic) in v.nics.iter_mut().zip(&found.nics) {
        let selected = config.gdr_hca.selects(&nic.device, nic.port);
        let g = gpu::of_device(config.verbs.gdr, selected, peer, || {
            Domain::open(&nic.device)
        });
        report.gpu = Some(g);
    }
    if !v.nics.is_empty() {
        v.fork_safety = Some(railover::transport::verbs::sys::fork_safety().to_string());
    }
    v
}

fn summarize(found: &Discovery, config: &Config, topo: Option<&Topology>) -> VerbsSection {
    // Rails as the plugin assigns them: RAILOVER_RAILS, the topology, else PCI/name order.
    let as_nics: Vec<railover::transport::tcp::TcpNic> = found
        .nics
        .iter()
        .map(|n| railover::transport::tcp::TcpNic {
            name: n.device.clone(),
            ip: n
                .ip()
                .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
            pci_path: n.pci_path.clone(),
            speed_mbps: i32::try_from(n.speed_mbps).unwrap_or(i32::MAX),
            loopback: false,
        })
        .collect();
    let rails = railover::plugin::nics::rails(&as_nics, config, topo)
        .unwrap_or_else(|_| vec![None; as_nics.len()]);
    VerbsSection {
        absent: found.absent.clone(),
        settings: config.verbs.to_string(),
        notes: found.notes.clone(),
        fork_safety: None,
        nccl_ib: config.nccl_ib.summary(),
        nics: found
            .nics
            .iter()
            .zip(rails)
            .map(|(n, rail)| VerbsNicReport {
                name: n.label(),
                state: device::port_state_name(n.attr.state),
                link_layer: n.link_layer(),
                speed_mbps: n.speed_mbps,
                mtu: 128u32 << n.attr.active_mtu.min(8),
                lid: n.attr.lid,
                netdev: n.netdev.clone(),
                rail,
                gpu: None,
                gid_index: n.gid_index,
                gids: n
                    .gids
                    .iter()
                    .map(|g| GidReport {
                        index: g.index,
                        gid: std::net::Ipv6Addr::from(g.gid).to_string(),
                        kind: device::gid_type_name(g.gid_type),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn render_verbs(v: &VerbsSection) -> String {
    use std::fmt::Write as _;
    let mut o = String::from(
        "\nVerbs NICs (RDMA; RAILOVER_TRANSPORT=auto or verbs carries lanes over the ACTIVE ones with an IP address):\n",
    );
    let _ = writeln!(o, "  QP settings: {}", v.settings);
    if let Some(n) = &v.nccl_ib {
        let _ = writeln!(o, "  {n}");
    }
    if v.nics.is_empty() {
        let why = v.absent.as_deref().unwrap_or("libibverbs lists no device");
        let _ = writeln!(o, "  none: {why}");
        return o;
    }
    for n in &v.nics {
        let _ = writeln!(
            o,
            "  {:<12} {:<7} {:<10} {:>7} Mb/s  mtu {:<4} lid {:<5} netdev {:<8} rail {}",
            n.name,
            n.state,
            n.link_layer,
            n.speed_mbps,
            n.mtu,
            n.lid,
            n.netdev.as_deref().unwrap_or("-"),
            n.rail.map_or("-".into(), |r| r.to_string()),
        );
        if let Some(g) = &n.gpu {
            let _ = writeln!(o, "    {}: {}", g.summary(), g.why);
        }
        for g in &n.gids {
            let mark = if Some(g.index) == n.gid_index {
                "*"
            } else {
                " "
            };
            let _ = writeln!(o, "    {mark}gid[{}] {:<6} {}", g.index, g.kind, g.gid);
        }
        if n.gid_index.is_none() && n.link_layer == "Ethernet" {
            let _ = writeln!(
                o,
                "    no RoCE v1/v2 GID: this port cannot carry RoCE traffic"
            );
        }
    }
    if let Some(f) = &v.fork_safety {
        let _ = writeln!(o, "  fork safety: {f}");
    }
    for n in &v.notes {
        let _ = writeln!(o, "  note: {n}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use railover::topology::{PathType, RailRule};
    use railover_testkit::fixture::machines;

    fn run_with(
        root: &std::path::Path,
        vars: &[(&str, &str)],
    ) -> Result<Box<DoctorReport>, String> {
        let root = root.to_string_lossy().to_string();
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = move |k: &str| {
            if k == "RAILOVER_SYSFS_ROOT" {
                return Some(root.clone());
            }
            vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        report(&Args::default(), &env)
    }

    #[test]
    fn verbs_nics_show_state_gids_and_rails() {
        use railover::transport::verbs::sys::{GidEntry, PortAttr};
        use railover::transport::verbs::VerbsNic;
        let nic = |dev: &str, pci: &str, ip: [u8; 4]| {
            let mapped = std::net::Ipv4Addr::from(ip).to_ipv6_mapped().octets();
            let gids = vec![
                GidEntry {
                    index: 0,
                    gid: "fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets(),
                    gid_type: 2,
                    ndev_ifindex: 2,
                },
                GidEntry {
                    index: 1,
                    gid: mapped,
                    gid_type: 2,
                    ndev_ifindex: 2,
                },
            ];
            VerbsNic {
                device: dev.into(),
                port: 1,
                guid: 1,
                attr: PortAttr {
                    state: 4,
                    active_mtu: 3,
                    link_layer: 2,
                    ..Default::default()
                },
                speed_mbps: 100_000,
                gid_index: device::pick_gid(&gids, 2),
                gids,
                netdev: Some(format!("{dev}-eth")),
                pci_path: Some(pci.into()),
            }
        };
        let found = Discovery {
            nics: vec![
                nic(
                    "mlx5_1",
                    "/sys/devices/pci0000:00/0000:00:05.0",
                    [10, 0, 1, 1],
                ),
                nic(
                    "mlx5_0",
                    "/sys/devices/pci0000:00/0000:00:03.0",
                    [10, 0, 0, 1],
                ),
            ],
            ..Default::default()
        };
        let v = summarize(&found, &Config::default(), None);
        let rails: Vec<_> = v.nics.iter().map(|n| (n.name.as_str(), n.rail)).collect();
        assert_eq!(
            rails,
            [("mlx5_1:1", Some(1)), ("mlx5_0:1", Some(0))],
            "PCI order"
        );
        let text = render_verbs(&v);
        assert!(
            text.contains("mlx5_0:1") && text.contains("ACTIVE") && text.contains("Ethernet"),
            "{text}"
        );
        assert!(text.contains("*gid[1] RoCEv2 ::ffff:10.0.0.1"), "{text}");
        assert!(text.contains(" gid[0] RoCEv2 fe80::1"), "{text}");
        assert!(text.contains("mtu 1024"), "{text}");
        assert!(
            text.contains("QP settings: gid auto (RoCE v2, AF_INET), timeout 16 retry 6"),
            "{text}"
        );
        let mut tuned = Config::default();
        tuned.verbs.timeout = 20;
        tuned.verbs.gid.index = Some(1);
        tuned.verbs.qps_per_lane = 4;
        let text = render_verbs(&summarize(
            &Discovery {
                notes: vec!["rxe0:1: no RoCE v2 GID with an AF_INET address".into()],
                ..found.clone()
            },
            &tuned,
            None,
        ));
        assert!(
            text.contains("QP settings: gid index 1, timeout 20 retry 6")
                && text.contains("4 QP(s) per lane")
                && text.contains("note: rxe0:1: no RoCE v2 GID"),
            "{text}"
        );
        assert!(!text.contains("NCCL_IB_"), "none set: {text}");
        // The site's NCCL_IB_* values, as the plugin takes and ignores them.
        let site = |k: &str| match k {
            "NCCL_IB_TC" => Some("106".to_string()),
            "NCCL_IB_TIMEOUT" => Some("22".to_string()),
            _ => None,
        };
        let text = render_verbs(&summarize(
            &found,
            &Config::from_lookup(site).unwrap(),
            None,
        ));
        assert!(
            text.contains("taken from NCCL_IB_*: NCCL_IB_TC=")
                && text.contains("ignored: NCCL_IB_TIMEOUT=")
                && text.contains("tc 106"),
            "{text}"
        );
        let none = render_verbs(&summarize(
            &Discovery {
                absent: Some("libibverbs.so.1 is not installed".into()),
                ..Default::default()
            },
            &Config::default(),
            None,
        ));
        assert!(
            none.contains("none: libibverbs.so.1 is not installed"),
            "{none}"
        );
    }

    #[test]
    fn bad_settings_name_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let Err(e) = run_with(dir.path(), &[("RAILOVER_DISTANCE_LIMIT", "far")]) else {
            panic!("accepted a bad limit")
        };
        assert!(
            e.contains("RAILOVER_DISTANCE_LIMIT") && e.contains("\"far\""),
            "{e}"
        );
        let Err(e) = run_with(dir.path(), &[("RAILOVER_RAIL_RULE", "rail")]) else {
            panic!("accepted a bad rule")
        };
        assert!(
            e.contains("RAILOVER_RAIL_RULE") && e.contains("same"),
            "{e}"
        );
        let Err(e) = run_with(dir.path(), &[("RAILOVER_IB_RETRY_CNT", "9")]) else {
            panic!("accepted a bad retry count")
        };
        assert!(
            e.contains("RAILOVER_IB_RETRY_CNT") && e.contains("0 to 7"),
            "{e}"
        );
    }

    #[test]
    fn settings_reach_the_report() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let Ok(report) = run_with(
            dir.path(),
            &[
                ("RAILOVER_DISTANCE_LIMIT", "sys"),
                ("RAILOVER_RAIL_RULE", "any"),
            ],
        ) else {
            panic!("no report")
        };
        assert_eq!(report.settings.distance_limit, PathType::Sys);
        assert_eq!(report.settings.rail_rule, RailRule::Any);
        assert!(report.healthy);
    }

    #[test]
    fn the_rail_map_is_the_one_config_parsed() {
        let dir = tempfile::tempdir().unwrap();
        machines::dual_socket(dir.path()).unwrap();
        let report = |rails: &str| run_with(dir.path(), &[("RAILOVER_RAILS", rails)]);
        let r = report("mlx5_0:1,mlx5_1:0").unwrap();
        assert_eq!(r.rail_source, RailSource::Env);
        let rails: Vec<_> = r.nics.iter().map(|n| (n.name.as_str(), n.rail)).collect();
        assert_eq!(rails, [("mlx5_0", Some(1)), ("mlx5_1", Some(0))]);
        // Empty is unset, as in the plugin; blanks are refused, as every padded value is.
        assert_eq!(report("").unwrap().rail_source, RailSource::Automatic);
        let e = report(" ").unwrap_err();
        assert!(e.contains("RAILOVER_RAILS=\" \""), "{e}");
        let e = report("mlx5_0").unwrap_err();
        assert!(
            e.contains("RAILOVER_RAILS") && e.contains("NIC:RAIL"),
            "{e}"
        );
    }
}
