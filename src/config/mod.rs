//! `RAILOVER_*` environment variables, parsed once into typed values.
//!
//! Everything downstream takes a [`Config`] and never re-reads or re-checks the
//! environment. A bad value is an error that names the variable, the value and what is
//! accepted, so the WARN NCCL prints is enough to fix it.
//!
//! `config` sits just above `topology`, the only module it imports; the router's knobs
//! ([`RouterConfig`]) live here for that reason, and `routing` takes them from here.

pub mod router;
pub mod verbs;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::topology::rails::RailMap;
use crate::topology::{PathType, RailRule};

pub use router::RouterConfig;
pub use verbs::{AddrFamily, Gdr, GidPolicy, NcclIbEnv, VerbsSettings, ZeroCopy};

/// A rejected environment value. The message shows the value through [`shown_value`],
/// so a huge one still leaves room in the WARN line for what is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={} is not valid: expected {accepted}", shown_value(.value))]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub accepted: &'static str,
}

/// Values whose quoted form is longer than this are shortened in error messages.
pub const SHOWN_MAX: usize = 160;
/// How many characters of a shortened value are shown.
const SHOWN_HEAD: usize = 48;

/// `value` as error messages show it: quoted and escaped (`{:?}`); when that is longer
/// than [`SHOWN_MAX`] bytes, its first characters, `…` and the value's length in bytes.
/// NCCL keeps about 1 kB of its last WARN (`ncclGetLastError`): a 100 kB value must
/// neither push out what is accepted nor flood the log.
pub fn shown_value(value: &str) -> String {
    let full = format!("{value:?}");
    if full.len() <= SHOWN_MAX {
        return full;
    }
    let head: String = value.chars().take(SHOWN_HEAD).collect();
    format!("{head:?}\u{2026} ({} bytes)", value.len())
}

/// The number `s` spells in plain decimal digits: no sign, no blanks, no trailing newline
/// (`" 5"`, `"+5"` and `"5\n"` are not numbers); `None` also past `u64::MAX`.
pub fn strict_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The prefix grammar `NCCL_SOCKET_IFNAME` and `NCCL_IB_HCA` share: a leading `^` makes
/// the list an exclusion list, and a leading `=` (after any `^`) makes names exact
/// instead of prefixes. Returns (exclude, exact, the list).
fn list_flags(value: &str) -> (bool, bool, &str) {
    let (exclude, rest) = match value.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, value),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    (exclude, exact, rest)
}

/// Whether list entry `entry` names `name`: exactly, or as a prefix.
fn names(exact: bool, entry: &str, name: &str) -> bool {
    if exact {
        name == entry
    } else {
        name.starts_with(entry)
    }
}

/// Which network interfaces become railover TCP NICs: `NCCL_SOCKET_IFNAME` syntax.
///
/// A comma-separated list of name prefixes; a leading `^` turns the list into an
/// exclusion list; a leading `=` (after any `^`) makes the names exact.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IfFilter {
    /// The list was given (false: the default selection applies).
    pub given: bool,
    pub exclude: bool,
    pub exact: bool,
    pub names: Vec<String>,
}

impl IfFilter {
    /// Parses the `NCCL_SOCKET_IFNAME`-style value. Blanks are not trimmed: interface
    /// names hold none, so a value with blanks anywhere is refused.
    pub fn parse(value: &str) -> Result<IfFilter, String> {
        let (exclude, exact, rest) = list_flags(value);
        let names: Vec<String> = rest
            .split(',')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Err("an empty interface list".into());
        }
        if let Some(bad) = names
            .iter()
            .find(|n| n.len() > 15 || n.contains(|c: char| c.is_whitespace() || c == '/'))
        {
            return Err(format!("{bad:?} is not an interface name"));
        }
        Ok(IfFilter {
            given: true,
            exclude,
            exact,
            names,
        })
    }

    /// Does the explicit list select `ifname`? (Only meaningful when `given`.)
    pub fn matches(&self, ifname: &str) -> bool {
        let listed = self.names.iter().any(|n| names(self.exact, n, ifname));
        listed != self.exclude
    }

    /// Does the list name `ifname` positively (used to allow loopback)?
    pub fn names_positively(&self, ifname: &str) -> bool {
        self.given && !self.exclude && self.matches(ifname)
    }
}

/// Which RDMA devices and ports become verbs NICs: `NCCL_IB_HCA` syntax.
///
/// A comma-separated list of `device[:port]` entries, names as prefixes; a leading `^`
/// excludes the listed ones instead, and a leading `=` (after any `^`) makes names exact.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HcaFilter {
    /// The list was given (false: every device and port).
    pub given: bool,
    pub exclude: bool,
    pub exact: bool,
    /// `(device, port)`; no port means every port of the device.
    pub entries: Vec<(String, Option<u8>)>,
}

impl HcaFilter {
    /// Parses the `NCCL_IB_HCA`-style value. Blanks are not trimmed: device names hold
    /// none, so a value with blanks anywhere is refused; ports are plain decimal numbers.
    pub fn parse(value: &str) -> Result<HcaFilter, String> {
        HcaFilter::parse_fields(value, false).map(|(f, _)| f)
    }

    /// Parses an `NCCL_IB_HCA` value: [`HcaFilter::parse`]'s grammar and what NCCL's
    /// parser takes beyond it, an empty port (every port) and `:RAIL:PLANE` after the
    /// port, so that a site's value means here what it means to NCCL. railover's rails
    /// come from `RAILOVER_RAILS` or PCI order, so those fields are checked but not used;
    /// the flag says whether any was given.
    pub fn parse_nccl(value: &str) -> Result<(HcaFilter, bool), String> {
        HcaFilter::parse_fields(value, true)
    }

    fn parse_fields(value: &str, nccl: bool) -> Result<(HcaFilter, bool), String> {
        let (exclude, exact, rest) = list_flags(value);
        let mut entries = Vec::new();
        let mut rail_fields = false;
        for item in rest.split(',').filter(|s| !s.is_empty()) {
            let mut fields = item.split(':');
            let name = fields.next().unwrap_or_default();
            let port = match fields.next() {
                None => None,
                Some("") if nccl => None,
                Some(p) => Some(
                    parse_u64(p, 1, u64::from(u8::MAX))
                        .ok_or_else(|| format!("{p:?} is not a port number"))?
                        as u8,
                ),
            };
            let extra: Vec<&str> = fields.collect();
            if !extra.is_empty() {
                if !nccl
                    || extra.len() > 2
                    || extra
                        .iter()
                        .any(|f| !f.is_empty() && strict_u64(f).is_none())
                {
                    return Err(format!("{item:?} has more fields than device:port"));
                }
                rail_fields |= extra.iter().any(|f| !f.is_empty());
            }
            if name.is_empty()
                || name.len() > 63
                || name.contains(|c: char| c.is_whitespace() || c == '/')
            {
                return Err(format!("{name:?} is not a device name"));
            }
            entries.push((name.to_string(), port));
        }
        if entries.is_empty() {
            return Err("an empty device list".into());
        }
        let filter = HcaFilter {
            given: true,
            exclude,
            exact,
            entries,
        };
        Ok((filter, rail_fields))
    }

    /// Does the filter select port `port` of device `dev`?
    pub fn selects(&self, dev: &str, port: u8) -> bool {
        if !self.given {
            return true;
        }
        let listed = (self.entries.iter())
            .any(|(n, p)| names(self.exact, n, dev) && p.map_or(true, |p| p == port));
        listed != self.exclude
    }
}

/// `RAILOVER_TRANSPORT`: which fabric carries the lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Verbs when usable devices exist (and the verbs fabric can carry lanes), else TCP.
    #[default]
    Auto,
    Verbs,
    Tcp,
}

/// Who runs the reactor's turns (`RAILOVER_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// NCCL's own threads, in `isend`/`irecv`/`test`/`connect`/`accept`, whenever the
    /// reactor is free; the reactor thread only covers what no caller drives (timers,
    /// failover and keepalives while NCCL is not polling). One busy thread while traffic
    /// flows, and no hand-off between threads on the hot path.
    Caller,
    /// Only the reactor thread: every command crosses to it, and it busy-polls for
    /// `RAILOVER_SPIN_US` while requests are in flight.
    Thread,
}

/// Level of the log lines railover writes to stderr when NCCL's logger is not in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off,
    Warn,
    Info,
    Debug,
    Trace,
}

/// The validated configuration of one process.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `RAILOVER_IFNAME`: which interfaces are NICs.
    pub ifname: IfFilter,
    /// `RAILOVER_SPIN_US`: how long the reactor busy-polls after its last progress
    /// while requests are in flight, before it parks in epoll.
    pub spin: Duration,
    /// `RAILOVER_PROGRESS`: whether NCCL's threads drive the reactor themselves.
    pub progress: Progress,
    /// `RAILOVER_LOG`: stderr log level (NCCL's own logger ignores it).
    pub log: LogLevel,
    /// `RAILOVER_COMPLETION_TIMEOUT_MS`: a lane that receives nothing for this long (its
    /// peer sends keepalives at a quarter of it) is dead.
    pub completion_timeout: Duration,
    /// `RAILOVER_PROBE_TIMEOUT_MS`: how long a candidate pair has to answer a probe.
    pub probe_timeout: Duration,
    /// `RAILOVER_PROBE_BYTES`: the payload a probe must move across the pair within the
    /// probe timeout (so a browned-out pair fails its probes).
    pub probe_bytes: usize,
    /// `RAILOVER_SYSFS_ROOT`: where topology is read from.
    pub sysfs_root: PathBuf,
    /// `RAILOVER_RAILS`: explicit NIC → rail map.
    pub rails: Option<RailMap>,
    /// `RAILOVER_FAIR_SHARE`: pace the busy TCP lanes of a NIC to even shares (on by
    /// default; see `transport::fair`).
    pub fair_share: bool,
    /// `RAILOVER_LOOPBACK_NICS`: when not 0, this many NICs on loopback addresses
    /// (`127.100.<i>.1`) instead of the interfaces: a multi-NIC node without root, for the
    /// demo and tests.
    pub loopback_nics: usize,
    /// `RAILOVER_STRIPES`: how many stripes a send comm is cut into so that, when its NIC
    /// fails, it spreads over several survivors; `None` (`auto`): two per other NIC,
    /// so each survivor takes an equal part. 1 moves a failed NIC's comm whole.
    pub stripes: Option<usize>,
    /// `RAILOVER_TRANSPORT`: `auto`, `verbs` or `tcp`.
    pub transport: TransportChoice,
    /// `RAILOVER_HCA`: which verbs devices and ports are NICs.
    pub hca: HcaFilter,
    /// `RAILOVER_GDR_HCA`: which verbs NICs may move GPU memory (the others report host
    /// memory only, and no comm's GPU memory moves onto them).
    pub gdr_hca: HcaFilter,
    /// `RAILOVER_IB_*` and `RAILOVER_QPS_PER_LANE`: GID choice and QP settings of verbs lanes.
    pub verbs: VerbsSettings,
    /// The `NCCL_IB_*` values taken for unset `RAILOVER_*` twins, and those left alone.
    pub nccl_ib: NcclIbEnv,
    /// `RAILOVER_UNMATCHED_WARN_MS`: how long sends may find no receive for their tags
    /// in the peer's oldest posted receive before one WARN per comm names them (the comm
    /// stays open).
    pub unmatched_warn: Duration,
    /// Failover policy: `RAILOVER_RAIL_RULE`, `RAILOVER_DISTANCE_LIMIT`,
    /// `RAILOVER_FAILBACK_INTERVAL_MS`, `RAILOVER_FAILBACK_PROBES`, `RAILOVER_GIVEUP_MS`,
    /// `RAILOVER_STRIPE_WEIGHTS`.
    pub router: RouterConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ifname: IfFilter::default(),
            spin: Duration::from_micros(200),
            progress: Progress::Caller,
            log: LogLevel::Warn,
            completion_timeout: Duration::from_millis(1000),
            probe_timeout: Duration::from_millis(200),
            probe_bytes: 256 << 10,
            fair_share: true,
            loopback_nics: 0,
            stripes: None,
            transport: TransportChoice::Auto,
            hca: HcaFilter::default(),
            gdr_hca: HcaFilter::default(),
            verbs: VerbsSettings::default(),
            nccl_ib: NcclIbEnv::default(),
            sysfs_root: PathBuf::from("/sys"),
            rails: None,
            unmatched_warn: Duration::from_secs(10),
            router: RouterConfig::default(),
        }
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ifname={:?} spin={:?} progress={:?} log={:?}",
            self.ifname.names, self.spin, self.progress, self.log
        )
    }
}

impl Config {
    /// Reads the process environment. A value that is not UTF-8 is an error, not unset.
    /// A `RAILOVER_SYSFS_ROOT` that is set must also look like sysfs
    /// ([`check_sysfs_root`]): the one check that reads the filesystem, made here so that
    /// [`Config::from_lookup`] stays a function of the values. Unset, `/sys` is used as
    /// it is: a container without sysfs only loses PCI topology and link speeds.
    pub fn from_env() -> Result<Config, ConfigError> {
        let env = EnvReader::default();
        let parsed = Config::from_lookup(|k| env.get(k));
        let sysfs_root = env.get(SYSFS_ROOT_VAR);
        let cfg = env.finish(parsed)?;
        if let Some(value) = sysfs_root {
            check_sysfs_root(&cfg.sysfs_root, &value)?;
        }
        Ok(cfg)
    }

    /// Parses from any key lookup (tests pass a map; nothing reads the real environment).
    pub fn from_lookup(
        get: impl Fn(&'static str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut cfg = Config::default();
        if let Some(v) = get("RAILOVER_IFNAME") {
            cfg.ifname = IfFilter::parse(&v).map_err(|_| ConfigError {
                var: "RAILOVER_IFNAME",
                value: v.clone(),
                accepted: "a comma-separated list of interface names or prefixes, optionally starting with ^ (exclude) and/or = (exact)",
            })?;
        }
        if let Some(v) = get("RAILOVER_SPIN_US") {
            let us = parse_u64(&v, 0, 1_000_000).ok_or(ConfigError {
                var: "RAILOVER_SPIN_US",
                value: v.clone(),
                accepted: "an integer number of microseconds from 0 to 1000000",
            })?;
            cfg.spin = Duration::from_micros(us);
        }
        let progress = [("caller", Progress::Caller), ("thread", Progress::Thread)];
        if let Some(p) = parse_keyword(&get, "RAILOVER_PROGRESS", &progress, "caller or thread")? {
            cfg.progress = p;
        }
        if let Some(v) = get("RAILOVER_LOG") {
            cfg.log = match v.to_ascii_lowercase().as_str() {
                "off" | "none" => LogLevel::Off,
                "warn" => LogLevel::Warn,
                "info" => LogLevel::Info,
                "debug" => LogLevel::Debug,
                "trace" => LogLevel::Trace,
                _ => {
                    return Err(ConfigError {
                        var: "RAILOVER_LOG",
                        value: v,
                        accepted: "one of off, warn, info, debug, trace",
                    })
                }
            };
        }
        let ms = |var: &'static str,
                  min: u64,
                  max: u64,
                  accepted: &'static str|
         -> Result<Option<Duration>, ConfigError> {
            match get(var) {
                None => Ok(None),
                Some(v) => parse_u64(&v, min, max)
                    .map(|n| Some(Duration::from_millis(n)))
                    .ok_or(ConfigError {
                        var,
                        value: v,
                        accepted,
                    }),
            }
        };
        if let Some(d) = ms(
            "RAILOVER_COMPLETION_TIMEOUT_MS",
            10,
            600_000,
            "an integer number of milliseconds from 10 to 600000",
        )? {
            cfg.completion_timeout = d;
        }
        if let Some(d) = ms(
            "RAILOVER_PROBE_TIMEOUT_MS",
            1,
            60_000,
            "an integer number of milliseconds from 1 to 60000",
        )? {
            cfg.probe_timeout = d;
        }
        if let Some(d) = ms(
            "RAILOVER_FAILBACK_INTERVAL_MS",
            10,
            3_600_000,
            "an integer number of milliseconds from 10 to 3600000",
        )? {
            cfg.router.failback_interval = d;
        }
        if let Some(d) = ms(
            "RAILOVER_GIVEUP_MS",
            0,
            3_600_000,
            "an integer number of milliseconds from 0 to 3600000",
        )? {
            cfg.router.giveup = d;
        }
        if let Some(d) = ms(
            "RAILOVER_UNMATCHED_WARN_MS",
            1,
            86_400_000,
            "an integer number of milliseconds from 1 to 86400000",
        )? {
            cfg.unmatched_warn = d;
        }
        if let Some(v) = get("RAILOVER_PROBE_BYTES") {
            cfg.probe_bytes = parse_u64(&v, 0, 64 << 20).ok_or(ConfigError {
                var: "RAILOVER_PROBE_BYTES",
                value: v.clone(),
                accepted: "an integer number of bytes from 0 to 67108864",
            })? as usize;
        }
        let on_off = [
            ("on", true),
            ("1", true),
            ("true", true),
            ("off", false),
            ("0", false),
            ("false", false),
        ];
        if let Some(on) = parse_keyword(&get, "RAILOVER_FAIR_SHARE", &on_off, "on or off")? {
            cfg.fair_share = on;
        }
        if let Some(v) = get("RAILOVER_LOOPBACK_NICS") {
            cfg.loopback_nics = parse_u64(&v, 0, 16).ok_or(ConfigError {
                var: "RAILOVER_LOOPBACK_NICS",
                value: v.clone(),
                accepted: "an integer from 0 (use the interfaces) to 16",
            })? as usize;
        }
        if let Some(v) = get("RAILOVER_STRIPES") {
            cfg.stripes = match v.to_ascii_lowercase().as_str() {
                "auto" => None,
                n => Some(parse_u64(n, 1, 64).ok_or(ConfigError {
                    var: "RAILOVER_STRIPES",
                    value: v.clone(),
                    accepted: "auto (two per other NIC) or an integer from 1 to 64",
                })? as usize),
            };
        }
        if let Some(v) = get("RAILOVER_TRANSPORT") {
            cfg.transport =
                match v.to_ascii_lowercase().as_str() {
                    "auto" => TransportChoice::Auto,
                    "verbs" | "ib" => TransportChoice::Verbs,
                    "tcp" => TransportChoice::Tcp,
                    _ => return Err(ConfigError {
                        var: "RAILOVER_TRANSPORT",
                        value: v,
                        accepted:
                            "one of auto (verbs when usable devices exist, else TCP), verbs, tcp",
                    }),
                };
        }
        for (var, filter) in [
            ("RAILOVER_HCA", &mut cfg.hca),
            ("RAILOVER_GDR_HCA", &mut cfg.gdr_hca),
        ] {
            if let Some(v) = get(var) {
                *filter = HcaFilter::parse(&v).map_err(|_| ConfigError {
                    var,
                    value: v.clone(),
                    accepted: "a comma-separated list of RDMA device names or prefixes, each optionally :PORT (e.g. mlx5_0:1), optionally starting with ^ (exclude) and/or = (exact)",
                })?;
            }
        }
        if !cfg.hca.given {
            if let Some(v) = verbs::nccl_value(&get, "NCCL_IB_HCA") {
                let (filter, rail_fields) = HcaFilter::parse_nccl(&v).map_err(|_| ConfigError {
                    var: "NCCL_IB_HCA",
                    value: v.clone(),
                    accepted: "a comma-separated list of RDMA device names or prefixes, each optionally :PORT and NCCL's :RAIL:PLANE (e.g. mlx5_0:1 or mlx5_0:1:0), optionally starting with ^ (exclude) and/or = (exact)",
                })?;
                cfg.hca = filter;
                cfg.nccl_ib.taken.push(("NCCL_IB_HCA", v.clone()));
                if rail_fields {
                    cfg.nccl_ib.ignored.push((
                        "NCCL_IB_HCA",
                        v,
                        "its rail and plane fields: railover's rails come from RAILOVER_RAILS or PCI order",
                    ));
                }
            }
        }
        cfg.verbs = VerbsSettings::from_lookup(&get, &mut cfg.nccl_ib)?;
        if let Some(v) = get("RAILOVER_FAILBACK_PROBES") {
            cfg.router.failback_probes_k = parse_u64(&v, 1, 1000).ok_or(ConfigError {
                var: "RAILOVER_FAILBACK_PROBES",
                value: v.clone(),
                accepted: "an integer from 1 to 1000",
            })? as u32;
        }
        if let Some(v) = get("RAILOVER_STRIPE_WEIGHTS") {
            cfg.router.weighted = match v.to_ascii_lowercase().as_str() {
                "capacity" => true,
                "equal" => false,
                _ => {
                    return Err(ConfigError {
                        var: "RAILOVER_STRIPE_WEIGHTS",
                        value: v,
                        accepted: "capacity (by link speed, PCIe path and measured rate) or equal",
                    })
                }
            };
        }
        if let Some(v) = get("RAILOVER_RAIL_RULE") {
            cfg.router.rail_rule = match v.to_ascii_lowercase().as_str() {
                "same" => RailRule::Same,
                "any" => RailRule::Any,
                _ => {
                    return Err(ConfigError {
                        var: "RAILOVER_RAIL_RULE",
                        value: v,
                        accepted: "same or any",
                    })
                }
            };
        }
        if let Some(v) = get("RAILOVER_DISTANCE_LIMIT") {
            // `PathType::parse` also reads topology files, which may pad; a variable may not.
            let unpadded = Some(v.as_str()).filter(|s| s.trim() == *s);
            cfg.router.distance_limit = unpadded.and_then(PathType::parse).ok_or(ConfigError {
                var: "RAILOVER_DISTANCE_LIMIT",
                value: v.clone(),
                accepted: "one of PIX, PXB, PHB, SYS",
            })?;
        }
        if let Some(v) = get("RAILOVER_RAILS") {
            let map = RailMap::parse("RAILOVER_RAILS", &v).map_err(|_| ConfigError {
                var: "RAILOVER_RAILS",
                value: v.clone(),
                accepted:
                    "a comma-separated list of NIC:RAIL entries, e.g. eth0:0,eth1:1, each NIC once",
            })?;
            cfg.rails = (!map.is_empty()).then_some(map);
        }
        if let Some(v) = get(SYSFS_ROOT_VAR) {
            // Taken as given (a path may hold blanks); whether it looks like sysfs is
            // [`check_sysfs_root`]'s to say, as it reads the filesystem.
            if v.trim().is_empty() {
                return Err(ConfigError {
                    var: SYSFS_ROOT_VAR,
                    value: v,
                    accepted: SYSFS_ROOT_ACCEPTED,
                });
            }
            cfg.sysfs_root = PathBuf::from(v);
        }
        Ok(cfg)
    }
}

/// The variable naming the sysfs tree topology is read from.
pub const SYSFS_ROOT_VAR: &str = "RAILOVER_SYSFS_ROOT";

/// What `RAILOVER_SYSFS_ROOT` accepts, and why this value is not that.
macro_rules! sysfs_accepted {
    ($why:literal) => {
        concat!(
            "an existing directory laid out like /sys, with a class/net directory",
            $why
        )
    };
}
const SYSFS_ROOT_ACCEPTED: &str = sysfs_accepted!("");

/// Checks that `root`, the value `value` of `RAILOVER_SYSFS_ROOT`, is a directory with a
/// `class/net` directory, as every sysfs has: a mistyped root would otherwise start
/// cleanly and quietly change which NICs, rails and PCI paths discovery finds.
pub fn check_sysfs_root(root: &Path, value: &str) -> Result<(), ConfigError> {
    let refuse = |accepted| ConfigError {
        var: SYSFS_ROOT_VAR,
        value: value.to_string(),
        accepted,
    };
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(refuse(sysfs_accepted!(" (this is not a directory)"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(refuse(sysfs_accepted!(" (this one does not exist)")))
        }
        // Unreadable, or too long a path (ENAMETOOLONG).
        Err(_) => return Err(refuse(sysfs_accepted!(" (this path cannot be read)"))),
    }
    match std::fs::metadata(root.join("class/net")) {
        Ok(m) if m.is_dir() => Ok(()),
        _ => Err(refuse(sysfs_accepted!(" (this one has none)"))),
    }
}

/// Reads variables from the process environment for a parser and remembers the first one
/// whose value is not UTF-8. The parser sees that value with its bad bytes replaced by
/// U+FFFD, so most parsers reject it with their own list of what is accepted; a parser
/// that would take it anyway (a path, a name) is overruled by [`EnvReader::finish`].
#[derive(Debug, Default)]
pub struct EnvReader {
    not_utf8: std::cell::RefCell<Option<(&'static str, String)>>,
}

/// What [`EnvReader::finish`] reports for a non-UTF-8 value the variable's parser took.
pub const UTF8_ACCEPTED: &str =
    "valid UTF-8 text (the value holds bytes that are not UTF-8, shown as \u{fffd})";

impl EnvReader {
    /// The value of `var`, if set.
    pub fn get(&self, var: &'static str) -> Option<String> {
        let raw = std::env::var_os(var)?;
        match raw.into_string() {
            Ok(v) => Some(v),
            Err(raw) => {
                let lossy = raw.to_string_lossy().into_owned();
                self.not_utf8
                    .borrow_mut()
                    .get_or_insert((var, lossy.clone()));
                Some(lossy)
            }
        }
    }

    /// The parse result, unless a value read was not UTF-8: then that is the error (the
    /// parser's own, when it rejected that very variable).
    pub fn finish<T>(self, parsed: Result<T, ConfigError>) -> Result<T, ConfigError> {
        let Some((var, value)) = self.not_utf8.into_inner() else {
            return parsed;
        };
        match parsed {
            Err(e) if e.var == var => Err(e),
            _ => Err(ConfigError {
                var,
                value,
                accepted: UTF8_ACCEPTED,
            }),
        }
    }
}

/// `var`'s value among `words` (each keyword with what it means), case ignored (blanks
/// are not: `" on"` is no keyword); `None` when unset, an error naming `accepted` when
/// no keyword matches.
fn parse_keyword<T: Copy>(
    get: &impl Fn(&'static str) -> Option<String>,
    var: &'static str,
    words: &[(&str, T)],
    accepted: &'static str,
) -> Result<Option<T>, ConfigError> {
    let Some(v) = get(var) else {
        return Ok(None);
    };
    let key = v.to_ascii_lowercase();
    match words.iter().find(|(w, _)| *w == key) {
        Some(&(_, t)) => Ok(Some(t)),
        None => Err(ConfigError {
            var,
            value: v,
            accepted,
        }),
    }
}

/// [`strict_u64`] within `min..=max`.
fn parse_u64(s: &str, min: u64, max: u64) -> Option<u64> {
    strict_u64(s).filter(|v| (min..=max).contains(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(cfg(&[]).unwrap(), Config::default());
    }

    #[test]
    fn ifname_syntax() {
        let f = IfFilter::parse("eth,ib").unwrap();
        assert!(f.matches("eth0") && f.matches("ib3") && !f.matches("lo"));
        let f = IfFilter::parse("^docker,lo").unwrap();
        assert!(!f.matches("docker0") && !f.matches("lo") && f.matches("eth0"));
        let f = IfFilter::parse("=eth0").unwrap();
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfFilter::parse("^=eth0").unwrap();
        assert!(!f.matches("eth0") && f.matches("eth01"));
        assert!(f.given && !f.names_positively("eth01"));
        assert!(IfFilter::parse("lo").unwrap().names_positively("lo"));
    }

    #[test]
    fn bad_values_name_variable_value_and_accepted() {
        for (var, value) in [
            ("RAILOVER_IFNAME", "^"),
            ("RAILOVER_IFNAME", "a b"),
            ("RAILOVER_SPIN_US", "fast"),
            ("RAILOVER_SPIN_US", "-1"),
            ("RAILOVER_SPIN_US", "1000001"),
            ("RAILOVER_LOG", "loud"),
            ("RAILOVER_COMPLETION_TIMEOUT_MS", "5"),
            ("RAILOVER_PROBE_TIMEOUT_MS", "soon"),
            ("RAILOVER_PROBE_BYTES", "lots"),
            ("RAILOVER_LOOPBACK_NICS", "17"),
            ("RAILOVER_FAIR_SHARE", "maybe"),
            ("RAILOVER_PROGRESS", "both"),
            ("RAILOVER_FAILBACK_INTERVAL_MS", "0"),
            ("RAILOVER_FAILBACK_PROBES", "0"),
            ("RAILOVER_GIVEUP_MS", "forever"),
            ("RAILOVER_UNMATCHED_WARN_MS", "0"),
            ("RAILOVER_UNMATCHED_WARN_MS", "never"),
            ("RAILOVER_RAIL_RULE", "nearest"),
            ("RAILOVER_STRIPE_WEIGHTS", "fast"),
            ("RAILOVER_DISTANCE_LIMIT", "NVL"),
            ("RAILOVER_RAILS", "eth0"),
            ("RAILOVER_RAILS", "eth0:0,eth0:1"),
            ("RAILOVER_SYSFS_ROOT", " "),
            ("RAILOVER_STRIPES", "0"),
            ("RAILOVER_STRIPES", "65"),
            ("RAILOVER_STRIPES", "many"),
            ("RAILOVER_TRANSPORT", "rdma"),
            ("RAILOVER_TRANSPORT", ""),
            ("RAILOVER_HCA", "^"),
            ("RAILOVER_HCA", "mlx5_0:0"),
            ("RAILOVER_HCA", "mlx5_0:x"),
            ("RAILOVER_HCA", "mlx5_0:256"),
            ("RAILOVER_HCA", ":1"),
            ("RAILOVER_HCA", "mlx5 0"),
            ("RAILOVER_GDR_HCA", "^"),
            ("RAILOVER_GDR_HCA", "mlx5_0:x"),
            ("RAILOVER_IB_GID_INDEX", "256"),
            ("RAILOVER_IB_GID_INDEX", "first"),
            ("RAILOVER_IB_ROCE_VERSION", "3"),
            ("RAILOVER_IB_ADDR_FAMILY", "AF_UNIX"),
            ("RAILOVER_IB_TIMEOUT", "0"),
            ("RAILOVER_IB_TIMEOUT", "32"),
            ("RAILOVER_IB_RETRY_CNT", "8"),
            ("RAILOVER_IB_TC", "256"),
            ("RAILOVER_IB_SL", "16"),
            ("RAILOVER_QPS_PER_LANE", "0"),
            ("RAILOVER_QPS_PER_LANE", "17"),
            ("RAILOVER_ZERO_COPY", "sometimes"),
            ("NCCL_IB_GID_INDEX", "256"),
            ("NCCL_IB_ROCE_VERSION_NUM", "3"),
            ("NCCL_IB_ADDR_FAMILY", "AF_UNIX"),
            ("NCCL_IB_TC", "256"),
            ("NCCL_IB_SL", "16"),
            ("NCCL_IB_HCA", "^"),
            ("NCCL_IB_HCA", "mlx5_0:x"),
            ("NCCL_IB_HCA", "mlx5_0:1:0:0:0"),
            ("NCCL_IB_HCA", "mlx5_0:1:r"),
            ("NCCL_IB_HCA", "mlx5_0, mlx5_1"),
        ] {
            let err = cfg(&[(var, value)]).unwrap_err();
            assert_eq!(err.var, var);
            assert_eq!(err.value, value);
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("{var}={value:?}")) && msg.contains("expected"),
                "{msg}"
            );
        }
    }

    /// Every number is plain decimal digits and every keyword exactly a keyword (any
    /// case): blanks around a value, a sign or a trailing newline make it a bad value.
    #[test]
    fn numbers_and_keywords_are_strict() {
        for (var, good) in [
            ("RAILOVER_SPIN_US", "5"),
            ("RAILOVER_COMPLETION_TIMEOUT_MS", "250"),
            ("RAILOVER_PROBE_TIMEOUT_MS", "5"),
            ("RAILOVER_FAILBACK_INTERVAL_MS", "50"),
            ("RAILOVER_GIVEUP_MS", "5"),
            ("RAILOVER_UNMATCHED_WARN_MS", "5"),
            ("RAILOVER_PROBE_BYTES", "5"),
            ("RAILOVER_LOOPBACK_NICS", "5"),
            ("RAILOVER_FAILBACK_PROBES", "5"),
            ("RAILOVER_STRIPES", "5"),
            ("RAILOVER_IB_GID_INDEX", "5"),
            ("RAILOVER_IB_ROCE_VERSION", "1"),
            ("RAILOVER_IB_TIMEOUT", "5"),
            ("RAILOVER_IB_RETRY_CNT", "5"),
            ("RAILOVER_IB_TC", "5"),
            ("RAILOVER_IB_SL", "5"),
            ("RAILOVER_QPS_PER_LANE", "5"),
            ("RAILOVER_LOG", "info"),
            ("RAILOVER_FAIR_SHARE", "on"),
            ("RAILOVER_PROGRESS", "thread"),
            ("RAILOVER_STRIPES", "auto"),
            ("RAILOVER_TRANSPORT", "tcp"),
            ("RAILOVER_RAIL_RULE", "any"),
            ("RAILOVER_DISTANCE_LIMIT", "SYS"),
            ("RAILOVER_IB_GID_INDEX", "auto"),
            ("RAILOVER_IB_ADDR_FAMILY", "AF_INET6"),
            ("RAILOVER_ZERO_COPY", "always"),
            ("RAILOVER_GDR", "off"),
            ("RAILOVER_IFNAME", "lo"),
            ("RAILOVER_HCA", "mlx5_0:1"),
            ("RAILOVER_GDR_HCA", "mlx5_0:1"),
            ("RAILOVER_RAILS", "eth0:1"),
        ] {
            assert!(cfg(&[(var, good)]).is_ok(), "{var}={good:?} is good");
            let mut bad = vec![
                format!(" {good}"),
                format!("{good} "),
                format!("{good}\n"),
                format!("\t{good}"),
            ];
            if good.ends_with(|c: char| c.is_ascii_digit()) {
                let (head, n) = good.split_at(
                    good.rfind(|c: char| !c.is_ascii_digit())
                        .map_or(0, |i| i + 1),
                );
                bad.extend([
                    format!("{head}+{n}"),
                    format!("{head}-{n}"),
                    format!("{head} {n}"),
                    format!("{head}{n}.0"),
                    format!("{head}{n}_0"),
                    format!("{head}0x{n}"),
                ]);
            }
            for value in bad {
                let err = cfg(&[(var, &value)]).expect_err(&format!("{var}={value:?}"));
                assert_eq!((err.var, err.value.as_str()), (var, value.as_str()));
                let msg = err.to_string();
                assert!(
                    msg.contains(&format!("{var}={value:?}")) && msg.contains("expected"),
                    "{msg}"
                );
            }
        }
        // Leading zeros are still decimal.
        assert_eq!(
            cfg(&[("RAILOVER_SPIN_US", "007")]).unwrap().spin,
            Duration::from_micros(7)
        );
        assert_eq!(strict_u64("18446744073709551615"), Some(u64::MAX));
        assert_eq!(strict_u64("18446744073709551616"), None);
        for s in ["", "+1", "-0", " 1", "1 ", "1\n", "\u{0663}"] {
            assert_eq!(strict_u64(s), None, "{s:?}");
        }
    }

    #[test]
    fn a_huge_value_is_shortened_in_the_message() {
        let value = "a".repeat(100_000);
        let err = cfg(&[("RAILOVER_SPIN_US", &value)]).unwrap_err();
        assert_eq!(err.value, value, "the error keeps the whole value");
        let msg = err.to_string();
        assert!(msg.len() < 1024, "{} bytes", msg.len());
        let head = format!(
            "RAILOVER_SPIN_US=\"{}\"\u{2026} (100000 bytes)",
            "a".repeat(48)
        );
        assert!(msg.starts_with(&head), "{msg}");
        assert!(
            msg.contains("expected an integer number of microseconds"),
            "{msg}"
        );
        // Short values are shown whole, escaped.
        assert_eq!(shown_value("5\n"), "\"5\\n\"");
        assert_eq!(
            shown_value(&"b".repeat(100)),
            format!("{:?}", "b".repeat(100))
        );
        // Cut at a character, never inside one.
        let wide = "\u{e9}".repeat(200);
        assert!(shown_value(&wide).starts_with(&format!("\"{}\"", "\u{e9}".repeat(48))));
    }

    #[test]
    fn sysfs_root_must_exist_and_hold_class_net() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let check = |p: &Path| {
            check_sysfs_root(p, &p.to_string_lossy()).map_err(|e| {
                assert_eq!(e.var, "RAILOVER_SYSFS_ROOT");
                assert_eq!(e.value, p.to_string_lossy());
                let msg = e.to_string();
                assert!(
                    msg.contains(&format!("RAILOVER_SYSFS_ROOT={}", shown_value(&e.value)))
                        && msg.contains("expected an existing directory laid out like /sys, with a class/net directory"),
                    "{msg}"
                );
                msg
            })
        };
        let missing = check(&root.join("nonexistent")).unwrap_err();
        assert!(missing.contains("does not exist"), "{missing}");
        std::fs::write(root.join("file"), "").unwrap();
        let file = check(&root.join("file")).unwrap_err();
        assert!(file.contains("not a directory"), "{file}");
        let bare = check(root).unwrap_err();
        assert!(bare.contains("has none"), "{bare}");
        std::fs::create_dir_all(root.join("class")).unwrap();
        std::fs::write(root.join("class/net"), "").unwrap();
        assert!(check(root).unwrap_err().contains("has none"));
        std::fs::remove_file(root.join("class/net")).unwrap();
        std::fs::create_dir_all(root.join("class/net")).unwrap();
        assert_eq!(check(root), Ok(()));
        // A path longer than the system takes.
        let long = check(Path::new(&"a".repeat(100_000))).unwrap_err();
        assert!(long.len() < 1024, "{long}");
        // Parsing alone never reads the filesystem: the same value parses anywhere.
        let c = cfg(&[("RAILOVER_SYSFS_ROOT", "/nonexistent")]).unwrap();
        assert_eq!(c.sysfs_root, Path::new("/nonexistent"));
    }

    #[test]
    fn hca_syntax_follows_nccl_ib_hca() {
        let all = HcaFilter::default();
        assert!(all.selects("rxe0", 1), "no filter selects everything");
        let f = HcaFilter::parse("mlx5_0:1,mlx5_1").unwrap();
        assert!(f.selects("mlx5_0", 1) && !f.selects("mlx5_0", 2));
        assert!(f.selects("mlx5_1", 2) && !f.selects("mlx5_2", 1));
        // Prefixes unless `=`: mlx5_1 also names mlx5_10.
        assert!(f.selects("mlx5_10", 1));
        let f = HcaFilter::parse("=mlx5_1").unwrap();
        assert!(f.selects("mlx5_1", 1) && !f.selects("mlx5_10", 1));
        let f = HcaFilter::parse("^mlx5_0:2").unwrap();
        assert!(f.selects("mlx5_0", 1) && !f.selects("mlx5_0", 2) && f.selects("rxe0", 1));
        let f = HcaFilter::parse("^=rxe1,rxe2:1").unwrap();
        assert!(f.exclude && f.exact);
        assert!(!f.selects("rxe1", 1) && f.selects("rxe10", 1) && !f.selects("rxe2", 1));
        assert!(f.selects("rxe2", 2));
        for padded in [
            "^=rxe1, rxe2:1",
            " rxe0",
            "rxe0 ",
            "rxe0: 1",
            "rxe0:+1",
            "rxe0:1\n",
        ] {
            assert!(HcaFilter::parse(padded).is_err(), "{padded:?}");
        }
        for padded in ["eth0, eth1", " lo", "lo ", "lo\n", "^ lo"] {
            assert!(IfFilter::parse(padded).is_err(), "{padded:?}");
        }
    }

    #[test]
    fn nccl_ib_twins_reach_the_config() {
        let c = cfg(&[
            ("NCCL_IB_TC", "106"),
            ("RAILOVER_IB_SL", "3"),
            ("NCCL_IB_SL", "5"),
            ("NCCL_IB_TIMEOUT", "22"),
        ])
        .unwrap();
        assert_eq!((c.verbs.traffic_class, c.verbs.service_level), (106, 3));
        assert_eq!(c.verbs.timeout, VerbsSettings::default().timeout);
        assert_eq!(c.nccl_ib.taken, [("NCCL_IB_TC", "106".to_string())]);
        assert_eq!(c.nccl_ib.ignored.len(), 1);
        assert_eq!(c.nccl_ib.ignored[0].0, "NCCL_IB_TIMEOUT");
    }

    #[test]
    fn nccl_ib_hca_stands_in_for_an_unset_railover_hca() {
        let c = cfg(&[("NCCL_IB_HCA", "^=mlx5_0:1,mlx5_1")]).unwrap();
        assert!(c.hca.given && c.hca.exclude && c.hca.exact);
        assert!(!c.hca.selects("mlx5_0", 1) && c.hca.selects("mlx5_0", 2));
        assert!(!c.hca.selects("mlx5_1", 1) && c.hca.selects("mlx5_10", 1));
        assert_eq!(
            c.nccl_ib.taken,
            [("NCCL_IB_HCA", "^=mlx5_0:1,mlx5_1".to_string())]
        );
        assert!(c.nccl_ib.ignored.is_empty());
        assert!(
            c.gdr_hca.selects("mlx5_0", 1),
            "RAILOVER_GDR_HCA has no twin"
        );
        // RAILOVER_HCA wins, and then a bad NCCL_IB_HCA does not matter.
        let c = cfg(&[("RAILOVER_HCA", "rxe0"), ("NCCL_IB_HCA", "^")]).unwrap();
        assert_eq!(c.hca.entries, vec![("rxe0".to_string(), None)]);
        assert!(c.nccl_ib.taken.is_empty());
        // Empty is unset, as NCCL reads it.
        assert_eq!(cfg(&[("NCCL_IB_HCA", "")]).unwrap(), Config::default());
        // NCCL's empty port is every port; its rail and plane fields are checked, not used.
        let c = cfg(&[("NCCL_IB_HCA", "mlx5_0:,mlx5_1:1:0,mlx5_2::3:1")]).unwrap();
        assert_eq!(
            c.hca.entries,
            vec![
                ("mlx5_0".to_string(), None),
                ("mlx5_1".to_string(), Some(1)),
                ("mlx5_2".to_string(), None)
            ]
        );
        assert_eq!(c.nccl_ib.taken.len(), 1);
        assert_eq!(c.nccl_ib.ignored.len(), 1);
        let line = c.nccl_ib.summary().unwrap();
        assert!(
            line.ends_with("; ignored: NCCL_IB_HCA=\"mlx5_0:,mlx5_1:1:0,mlx5_2::3:1\" (its rail and plane fields: railover's rails come from RAILOVER_RAILS or PCI order)"),
            "{line}"
        );
        // RAILOVER_HCA keeps its own grammar.
        for v in ["mlx5_0:", "mlx5_0:1:0"] {
            let e = cfg(&[("RAILOVER_HCA", v)]).unwrap_err();
            assert_eq!((e.var, e.value.as_str()), ("RAILOVER_HCA", v));
        }
        let e = cfg(&[("NCCL_IB_HCA", "mlx5 0")]).unwrap_err();
        assert!(
            e.to_string().starts_with("NCCL_IB_HCA=\"mlx5 0\" is not valid: expected a comma-separated list of RDMA device names"),
            "{e}"
        );
    }

    #[test]
    fn transport_choice_parses() {
        assert_eq!(cfg(&[]).unwrap().transport, TransportChoice::Auto);
        for (v, want) in [
            ("auto", TransportChoice::Auto),
            ("Verbs", TransportChoice::Verbs),
            ("TCP", TransportChoice::Tcp),
        ] {
            assert_eq!(cfg(&[("RAILOVER_TRANSPORT", v)]).unwrap().transport, want);
        }
        let c = cfg(&[("RAILOVER_HCA", "rxe0:1"), ("RAILOVER_GDR_HCA", "^=rxe1")]).unwrap();
        assert_eq!(c.hca.entries, vec![("rxe0".to_string(), Some(1))]);
        assert!(c.gdr_hca.selects("rxe0", 1) && !c.gdr_hca.selects("rxe1", 1));
        assert!(
            cfg(&[]).unwrap().gdr_hca.selects("mlx5_3", 1),
            "every NIC by default"
        );
    }

    #[test]
    fn good_values_parse() {
        let c = cfg(&[
            ("RAILOVER_SPIN_US", "0"),
            ("RAILOVER_LOG", "INFO"),
            ("RAILOVER_IFNAME", "lo"),
        ])
        .unwrap();
        assert_eq!(c.spin, Duration::ZERO);
        assert_eq!(c.log, LogLevel::Info);
        assert_eq!(c.ifname.names, vec!["lo".to_string()]);
        assert!(c.fair_share, "on by default");
        assert_eq!(c.stripes, None, "auto by default");
        assert_eq!(cfg(&[("RAILOVER_STRIPES", "3")]).unwrap().stripes, Some(3));
        assert_eq!(cfg(&[("RAILOVER_STRIPES", "Auto")]).unwrap().stripes, None);
        assert!(!cfg(&[("RAILOVER_FAIR_SHARE", "OFF")]).unwrap().fair_share);
        assert_eq!(Config::default().progress, Progress::Caller);
        let thread = cfg(&[("RAILOVER_PROGRESS", "Thread")]).unwrap();
        assert_eq!(thread.progress, Progress::Thread);
        let c = cfg(&[
            ("RAILOVER_COMPLETION_TIMEOUT_MS", "250"),
            ("RAILOVER_RAIL_RULE", "any"),
            ("RAILOVER_DISTANCE_LIMIT", "sys"),
            ("RAILOVER_FAILBACK_PROBES", "5"),
            ("RAILOVER_GIVEUP_MS", "5000"),
            ("RAILOVER_RAILS", "rv0:1,rv1:0"),
            ("RAILOVER_UNMATCHED_WARN_MS", "2500"),
        ])
        .unwrap();
        assert_eq!(c.router.giveup, Duration::from_millis(5000));
        assert_eq!(c.unmatched_warn, Duration::from_millis(2500));
        assert_eq!(cfg(&[]).unwrap().unmatched_warn, Duration::from_secs(10));
        assert_eq!(c.completion_timeout, Duration::from_millis(250));
        assert_eq!(c.router.rail_rule, RailRule::Any);
        assert_eq!(c.router.distance_limit, PathType::Sys);
        assert_eq!(c.router.failback_probes_k, 5);
        assert!(c.router.weighted, "capacity weights by default");
        let equal = cfg(&[("RAILOVER_STRIPE_WEIGHTS", "Equal")]).unwrap();
        assert!(!equal.router.weighted);
        assert_eq!(
            c.rails.unwrap().entries(),
            &[("rv0".to_string(), 1), ("rv1".to_string(), 0)]
        );
    }
}
