//! The `railover doctor` report: what this node looks like to railover, and what is wrong.
//!
//! [`DoctorReport::build`] is pure (a topology and the settings in, a report out);
//! `railover doctor` reads the environment and prints [`DoctorReport::render_text`] or the
//! JSON form (`serde_json` of the report).

use std::fmt::Write as _;

use serde::Serialize;

use super::backup::{Candidate, RailRule};
use super::pci::{PciAddr, PcieLink};
use super::{Device, LinkState, NicKind, Origin, Path, PathType, RailSource, Topology};

/// The two policy settings the report applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DoctorSettings {
    /// `RAILOVER_RAIL_RULE`.
    pub rail_rule: RailRule,
    /// `RAILOVER_DISTANCE_LIMIT`.
    pub distance_limit: PathType,
}

impl Default for DoctorSettings {
    /// `same` and `PHB`, railover's defaults.
    fn default() -> Self {
        DoctorSettings {
            rail_rule: RailRule::Same,
            distance_limit: PathType::Phb,
        }
    }
}

/// The whole report. Serialises to the `--json` output.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    pub origin: Origin,
    pub rail_source: RailSource,
    pub settings: DoctorSettings,
    /// The bandwidth assumed for the inter-socket (SYS) link, GB/s.
    pub inter_socket_gbps: f64,
    pub gpus: Vec<GpuEntry>,
    pub nics: Vec<NicEntry>,
    pub warnings: Vec<Warning>,
    /// True when the node has NICs and every NIC has at least one eligible backup.
    pub healthy: bool,
}

/// A GPU line.
#[derive(Debug, Clone, Serialize)]
pub struct GpuEntry {
    pub name: String,
    pub pci_addr: PciAddr,
    pub numa_node: Option<u32>,
    pub pcie: Option<PcieLink>,
}

/// A NIC section.
#[derive(Debug, Clone, Serialize)]
pub struct NicEntry {
    pub name: String,
    pub kind: NicKind,
    pub rail: Option<u32>,
    pub numa_node: Option<u32>,
    pub pci_addr: Option<PciAddr>,
    pub pci_path: Option<std::path::PathBuf>,
    pub netdev: Option<String>,
    pub link_layer: Option<String>,
    pub state: LinkState,
    pub state_detail: Option<String>,
    pub speed_mbps: Option<u64>,
    pub pcie: Option<PcieLink>,
    pub gids: Vec<String>,
    pub address: Option<String>,
    pub nearest_gpu: Option<NearestGpu>,
    /// Where backup distances are measured from (a GPU name, or this NIC).
    pub backup_reference: String,
    /// All other NICs: eligible first, in preference order, then the excluded ones.
    pub backups: Vec<Candidate>,
    /// Where its comms would go if it failed.
    pub spread: Spread,
}

/// Where a NIC's comms go if it fails. railover stripes each of them over every eligible
/// survivor, so that the survivors end up equally loaded (P3, `docs/design.md` §1).
///
/// `kept_fraction` is the share of its bandwidth a network-bound collective keeps, under
/// the model of `railover sim`: equal NICs, equally loaded, paced by the busiest NIC. The
/// failed NIC's share split over `k` survivors leaves each carrying (k+1)/k shares, so the
/// collective keeps k/(k+1): (N−1)/N when all N−1 other NICs are eligible, 1/2 when one is
/// (as with a comm moved whole onto one survivor), 0 when none is (its comms fail).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spread {
    /// The survivors its comms would be striped over: the backups the rail rule and the
    /// distance limit allow (`backup::pair_eligibility`, as the router applies it) whose
    /// port is not down now, in the router's preference order.
    pub survivors: Vec<String>,
    /// Allowed backups left out because their port is down now, as the router leaves out a
    /// NIC without carrier.
    pub down_now: Vec<String>,
    /// `k`: how many survivors.
    pub count: usize,
    /// The node's NIC count `N`, this one included.
    pub nics: usize,
    /// k/(k+1); 0 when k is 0.
    pub kept_fraction: f64,
}

impl Spread {
    /// The spread of a NIC of `topo` whose backup candidates are `backups` (as
    /// [`Topology::backup_candidates`] lists them).
    pub fn of(topo: &Topology, backups: &[Candidate]) -> Spread {
        let (up, down): (Vec<&Candidate>, Vec<&Candidate>) = backups
            .iter()
            .filter(|c| c.eligible())
            .partition(|c| topo.nic(c.nic).state != LinkState::Down);
        let names = |v: Vec<&Candidate>| v.into_iter().map(|c| c.name.clone()).collect();
        let count = up.len();
        Spread {
            survivors: names(up),
            down_now: names(down),
            count,
            nics: topo.nics().len(),
            kept_fraction: if count == 0 {
                0.0
            } else {
                count as f64 / (count + 1) as f64
            },
        }
    }

    /// "comms spread over 3 survivors (mlx5_1, mlx5_2, mlx5_3); a collective keeps 3/4
    /// (75%) of its bandwidth", or why there is nowhere to go.
    pub fn describe(&self) -> String {
        let down = if self.down_now.is_empty() {
            String::new()
        } else {
            format!("; not counted, down now: {}", self.down_now.join(", "))
        };
        if self.count == 0 {
            let why = if self.nics <= 1 {
                "it is the only NIC"
            } else if self.down_now.is_empty() {
                "no other NIC passes the rail rule and the distance limit"
            } else {
                "every allowed backup is down now"
            };
            return format!("no survivor to spread its comms over ({why}): they fail{down}");
        }
        let k = self.count;
        format!(
            "comms spread over {k} survivor{} ({}); a collective keeps {k}/{} ({}) of its bandwidth{down}",
            if k == 1 { "" } else { "s" },
            self.survivors.join(", "),
            k + 1,
            fmt_percent(self.kept_fraction)
        )
    }
}

/// The GPU nearest to a NIC.
#[derive(Debug, Clone, Serialize)]
pub struct NearestGpu {
    pub gpu: String,
    pub path: Path,
}

/// Something the operator should look at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Warning {
    pub kind: WarningKind,
    /// The NIC concerned, when one is.
    pub nic: Option<String>,
    pub message: String,
}

/// The kinds of [`Warning`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WarningKind {
    /// The node has no NIC at all.
    NoNics,
    /// A NIC has no eligible backup; the message says which rule excludes each candidate.
    NoBackup,
    /// NICs differ in link layer (InfiniBand and Ethernet).
    MixedLinkLayers,
    /// NICs differ in port speed.
    MixedSpeeds,
    /// A port is down now.
    PortDown,
    /// The distance limit leaves a NIC without a backup that a looser limit would allow.
    LimitStricterThanHardware,
    /// A NIC is itself further from its nearest GPU than the distance limit.
    NicBeyondLimit,
    /// Several NICs of this node claim one rail.
    SharedRail,
}

impl DoctorReport {
    /// Builds the report for `topo` under `settings`.
    pub fn build(topo: &Topology, settings: DoctorSettings) -> DoctorReport {
        let DoctorSettings {
            rail_rule,
            distance_limit,
        } = settings;
        let mut warnings = Vec::new();
        let mut nics = Vec::new();
        let mut healthy = !topo.nics().is_empty();
        if topo.nics().is_empty() {
            warnings.push(Warning {
                kind: WarningKind::NoNics,
                nic: None,
                message: "no NIC found: railover has nothing to carry traffic on".into(),
            });
        }
        for id in topo.nic_ids() {
            let nic = topo.nic(id);
            let nearest = topo.nearest_gpu(id).map(|(g, path)| NearestGpu {
                gpu: topo.gpu(g).name.clone(),
                path,
            });
            let backup_reference = match topo.backup_reference(id) {
                Device::Gpu(g) => topo.gpu(g).name.clone(),
                Device::Nic(n) => topo.nic(n).name.clone(),
            };
            let backups = topo.backup_candidates(id, rail_rule, distance_limit);
            let spread = Spread::of(topo, &backups);

            if nic.state == LinkState::Down {
                warnings.push(Warning {
                    kind: WarningKind::PortDown,
                    nic: Some(nic.name.clone()),
                    message: format!(
                        "{} is down ({})",
                        nic.name,
                        nic.state_detail.as_deref().unwrap_or("no detail")
                    ),
                });
            }
            if let Some(n) = &nearest {
                if n.path.kind > distance_limit {
                    warnings.push(Warning {
                        kind: WarningKind::NicBeyondLimit,
                        nic: Some(nic.name.clone()),
                        message: format!(
                            "{} is {} from its nearest GPU {}, beyond the distance limit {}: \
                             NCCL's own choice already exceeds the limit",
                            nic.name, n.path.kind, n.gpu, distance_limit
                        ),
                    });
                }
            }
            if !backups.iter().any(Candidate::eligible) {
                healthy = false;
                let why = if backups.is_empty() {
                    "it is the only NIC".to_string()
                } else {
                    backups
                        .iter()
                        .filter_map(|c| c.excluded_by.map(|e| format!("{} ({e})", c.name)))
                        .collect::<Vec<_>>()
                        .join("; ")
                };
                warnings.push(Warning {
                    kind: WarningKind::NoBackup,
                    nic: Some(nic.name.clone()),
                    message: format!("{} has no backup: {why}", nic.name),
                });
                // Would a looser limit have found one? Then the limit, not the hardware, is
                // what leaves this NIC alone.
                let rail_ok: Vec<&Candidate> = backups
                    .iter()
                    .filter(|c| {
                        !matches!(c.excluded_by, Some(super::Exclusion::RailMismatch { .. }))
                    })
                    .collect();
                if let Some(best) = rail_ok.iter().filter_map(|c| c.path.map(|p| (c, p))).next() {
                    warnings.push(Warning {
                        kind: WarningKind::LimitStricterThanHardware,
                        nic: Some(nic.name.clone()),
                        message: format!(
                            "RAILOVER_DISTANCE_LIMIT={distance_limit} is stricter than this \
                             hardware allows for {}: its nearest backup, {}, is {} from {}",
                            nic.name, best.0.name, best.1.kind, backup_reference
                        ),
                    });
                }
            }
            nics.push(NicEntry {
                name: nic.name.clone(),
                kind: nic.kind,
                rail: nic.rail,
                numa_node: nic.numa_node,
                pci_addr: nic.pci_addr,
                pci_path: nic.pci_path.clone(),
                netdev: nic.netdev.clone(),
                link_layer: nic.link_layer.clone(),
                state: nic.state,
                state_detail: nic.state_detail.clone(),
                speed_mbps: nic.speed_mbps,
                pcie: nic.pcie.clone(),
                gids: nic.gids.clone(),
                address: nic.address.clone(),
                nearest_gpu: nearest,
                backup_reference,
                backups,
                spread,
            });
        }

        let mut layers: Vec<&str> = topo
            .nics()
            .iter()
            .filter_map(|n| n.link_layer.as_deref())
            .collect();
        layers.sort_unstable();
        layers.dedup();
        if layers.len() > 1 {
            warnings.push(Warning {
                kind: WarningKind::MixedLinkLayers,
                nic: None,
                message: format!(
                    "mixed link layers ({}): a backup on another link layer cannot reach the \
                     same peers",
                    describe_groups(topo, |n| n.link_layer.clone())
                ),
            });
        }
        let mut speeds: Vec<u64> = topo.nics().iter().filter_map(|n| n.speed_mbps).collect();
        speeds.sort_unstable();
        speeds.dedup();
        if speeds.len() > 1 {
            warnings.push(Warning {
                kind: WarningKind::MixedSpeeds,
                nic: None,
                message: format!(
                    "mixed port speeds ({}): failover to a slower NIC slows the whole collective",
                    describe_groups(topo, |n| n.speed_mbps.map(format_speed))
                ),
            });
        }
        let mut rails: Vec<u32> = topo.nics().iter().filter_map(|n| n.rail).collect();
        rails.sort_unstable();
        rails.dedup();
        for rail in rails {
            let on = topo.nics_on_rail(rail);
            if on.len() > 1 {
                let names: Vec<&str> = on.iter().map(|&n| topo.nic(n).name.as_str()).collect();
                warnings.push(Warning {
                    kind: WarningKind::SharedRail,
                    nic: None,
                    message: format!("{} share rail {rail}", names.join(", ")),
                });
            }
        }

        DoctorReport {
            origin: topo.origin().clone(),
            rail_source: topo.rail_source(),
            settings,
            inter_socket_gbps: topo.inter_socket_gbps(),
            gpus: topo
                .gpus()
                .iter()
                .map(|g| GpuEntry {
                    name: g.name.clone(),
                    pci_addr: g.pci_addr,
                    numa_node: g.numa_node,
                    pcie: g.pcie.clone(),
                })
                .collect(),
            nics,
            warnings,
            healthy,
        }
    }

    /// The process exit code `railover doctor` uses: 0 when healthy, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.healthy {
            0
        } else {
            1
        }
    }

    /// The human-readable report.
    pub fn render_text(&self) -> String {
        let mut o = String::new();
        let s = &self.settings;
        let origin = match &self.origin {
            Origin::Sysfs(p) => format!("sysfs at {}", p.display()),
            Origin::Xml(f) => format!("topology XML {f}"),
        };
        let _ = writeln!(o, "railover doctor: {origin}");
        let _ = writeln!(o, "rails: {}", self.rail_source.describe());
        let rule_text = match s.rail_rule {
            RailRule::Same => {
                "a backup needs a known rail; its remote end is the peer's NIC on that rail"
            }
            RailRule::Any => "any NIC may back up any other",
        };
        let _ = writeln!(o, "rail rule: {} ({rule_text})", s.rail_rule);
        let _ = writeln!(
            o,
            "distance limit: {} (path type from the failed NIC's nearest GPU to the backup must \
             be <= {}; an unknown distance is allowed, as at run time)",
            s.distance_limit, s.distance_limit
        );
        let _ = writeln!(
            o,
            "paths: PCIe only, as NCCL types them from sysfs (NVLink/PXN not visible); hops count \
             PCI links; SYS links assumed {} GB/s",
            fmt_gbps(self.inter_socket_gbps)
        );

        let _ = writeln!(o, "\nGPUs ({})", self.gpus.len());
        for g in &self.gpus {
            let _ = writeln!(
                o,
                "  {:<6} {}  NUMA {}  {}",
                g.name,
                g.pci_addr,
                opt(g.numa_node),
                fmt_pcie(g.pcie.as_ref())
            );
        }

        let _ = writeln!(o, "\nNICs ({})", self.nics.len());
        for n in &self.nics {
            let state = match n.state {
                LinkState::Up => "up",
                LinkState::Down => "DOWN",
                LinkState::Unknown => "state unknown",
            };
            let _ = writeln!(
                o,
                "  {}  rail {}  NUMA {}  {}  {}  {}{}  {}",
                n.name,
                opt(n.rail),
                opt(n.numa_node),
                n.pci_addr.map_or("no PCI device".into(), |a| a.to_string()),
                n.link_layer.as_deref().unwrap_or("link layer unknown"),
                state,
                n.state_detail
                    .as_deref()
                    .map_or(String::new(), |d| format!(" ({d})")),
                n.speed_mbps.map_or("speed unknown".into(), format_speed),
            );
            if let Some(p) = &n.pci_path {
                let _ = writeln!(o, "      pci path: {}", p.display());
            }
            let _ = writeln!(
                o,
                "      pcie: {}{}",
                fmt_pcie(n.pcie.as_ref()),
                n.netdev
                    .as_deref()
                    .map_or(String::new(), |d| format!("  netdev {d}"))
            );
            match &n.nearest_gpu {
                Some(g) => {
                    let _ = writeln!(o, "      nearest GPU: {} ({})", g.gpu, fmt_path(&g.path));
                }
                None => {
                    let _ = writeln!(o, "      nearest GPU: none");
                }
            }
            let eligible: Vec<String> = n
                .backups
                .iter()
                .filter(|c| c.eligible())
                .map(|c| match c.path {
                    Some(p) => format!("{} ({})", c.name, fmt_path(&p)),
                    // As the router does at run time (see `backup::pair_eligibility`).
                    None => format!("{} (allowed: distance unknown)", c.name),
                })
                .collect();
            let _ = writeln!(
                o,
                "      backups from {}: {}",
                n.backup_reference,
                if eligible.is_empty() {
                    "NONE".to_string()
                } else {
                    eligible.join(", ")
                }
            );
            for c in n.backups.iter().filter(|c| !c.eligible()) {
                if let Some(e) = c.excluded_by {
                    let _ = writeln!(o, "      excluded: {} by {e}", c.name);
                }
            }
            let _ = writeln!(o, "      if it fails: {}", n.spread.describe());
        }

        // The NIC whose failure costs most (the first of equals).
        if let Some(worst) = self
            .nics
            .iter()
            .min_by(|a, b| a.spread.kept_fraction.total_cmp(&b.spread.kept_fraction))
        {
            let (k, n) = (worst.spread.count, self.nics.len());
            let _ = if k == 0 {
                writeln!(
                    o,
                    "\nspread: if {} fails, {}",
                    worst.name,
                    worst.spread.describe()
                )
            } else {
                writeln!(
                    o,
                    "\nspread: a failed NIC's comms go to {k} survivor{} or more (fewest: {}); a \
                     collective keeps {k}/{} ({}) of its bandwidth or more ({}/{n} ({}) with all {} \
                     other NICs eligible)",
                    if k == 1 { "" } else { "s" },
                    worst.name,
                    k + 1,
                    fmt_percent(worst.spread.kept_fraction),
                    n - 1,
                    fmt_percent((n - 1) as f64 / n as f64),
                    n - 1
                )
            };
        }

        let _ = writeln!(o, "\nWarnings ({})", self.warnings.len());
        for w in &self.warnings {
            let _ = writeln!(o, "  ! {}", w.message);
        }
        let _ = writeln!(
            o,
            "\n{}",
            if self.healthy {
                "healthy: every NIC has at least one backup"
            } else {
                "UNHEALTHY: a NIC has no possible backup"
            }
        );
        o
    }
}

/// "InfiniBand: mlx5_0, mlx5_1; Ethernet: eth0" for a NIC property.
fn describe_groups(topo: &Topology, key: impl Fn(&super::Nic) -> Option<String>) -> String {
    let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
    for n in topo.nics() {
        let Some(k) = key(n) else { continue };
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(&n.name),
            None => groups.push((k, vec![&n.name])),
        }
    }
    groups
        .iter()
        .map(|(k, v)| format!("{k}: {}", v.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

fn format_speed(mbps: u64) -> String {
    if mbps % 1000 == 0 {
        format!("{} Gb/s", mbps / 1000)
    } else {
        format!("{mbps} Mb/s")
    }
}

fn fmt_gbps(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// 75%, 87.5%, 66.7%.
fn fmt_percent(x: f64) -> String {
    let tenths = (x * 1000.0).round();
    if tenths % 10.0 == 0.0 {
        format!("{:.0}%", tenths / 10.0)
    } else {
        format!("{:.1}%", tenths / 10.0)
    }
}

fn fmt_path(p: &Path) -> String {
    format!(
        "{}, {} hops, {} GB/s",
        p.kind,
        p.hops,
        fmt_gbps(p.bandwidth_gbps)
    )
}

fn fmt_pcie(l: Option<&PcieLink>) -> String {
    match l {
        Some(l) => format!(
            "{} x{} ({} GB/s)",
            l.speed.as_deref().unwrap_or("speed unknown"),
            l.width,
            fmt_gbps(l.bandwidth_gbps)
        ),
        None => "PCIe unknown".into(),
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}
