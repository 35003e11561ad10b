//! The verbs fabric's QP settings (`RAILOVER_IB_*`, `RAILOVER_QPS_PER_LANE`), parsed into
//! types ([`super`] calls [`VerbsSettings::from_lookup`]). They follow NCCL's `NCCL_IB_*`
//! namesakes, except for the QP timing defaults (see [`VerbsSettings::default`]).
//!
//! A `RAILOVER_IB_*` variable that is unset takes its `NCCL_IB_*` twin's value, read as
//! NCCL reads it, so that a cluster's lossless traffic class, service level and GID choice
//! apply without being set twice (`RAILOVER_HCA` takes `NCCL_IB_HCA` likewise, in
//! [`super`]). The QP timing twins are the exception ([`NcclIbEnv`]
//! records both what was taken and what was not).

use std::fmt;

use super::{parse_keyword, parse_u64, shown_value, ConfigError};

/// Which address family a RoCE GID must carry (`NCCL_IB_ADDR_FAMILY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AddrFamily {
    /// An IPv4-mapped GID.
    #[default]
    Inet,
    /// An IPv6 GID (global before link-local).
    Inet6,
}

impl fmt::Display for AddrFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddrFamily::Inet => "AF_INET",
            AddrFamily::Inet6 => "AF_INET6",
        })
    }
}

/// When verbs lanes write a payload straight into the receive buffer
/// (`RAILOVER_ZERO_COPY`) instead of copying it through their rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroCopy {
    /// Payloads of 4 KiB and more whose receive buffer the receiver offered; the rest,
    /// and messages sent again after a lane died, through the rings.
    #[default]
    Auto,
    /// Every payload, resent ones included, waiting for the receiver's offer when there
    /// is none yet: the CPU never touches a payload, as memory it cannot read (a GPU's)
    /// requires.
    Always,
    /// Every payload through the rings.
    Off,
}

impl fmt::Display for ZeroCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ZeroCopy::Auto => "auto",
            ZeroCopy::Always => "always",
            ZeroCopy::Off => "off",
        })
    }
}

/// Whether verbs NICs take GPU memory (`RAILOVER_GDR`), reported to NCCL as
/// `NCCL_PTR_CUDA` (and `NCCL_PTR_DMABUF` where dma-buf registration works).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gdr {
    /// When the system can register it: nvidia-peermem loaded (`NCCL_PTR_CUDA`), or the
    /// NIC's driver takes dma-buf memory (`NCCL_PTR_CUDA | NCCL_PTR_DMABUF`).
    #[default]
    Auto,
    /// `NCCL_PTR_CUDA` whatever the checks say: for a peer-memory client railover does
    /// not know by name. A registration that then fails fails its comm.
    Force,
    /// Host memory only.
    Off,
}

impl fmt::Display for Gdr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Gdr::Auto => "auto",
            Gdr::Force => "force",
            Gdr::Off => "off",
        })
    }
}

/// How a port's GID is chosen: a fixed index, or by RoCE version and address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidPolicy {
    /// `RAILOVER_IB_GID_INDEX`: `None` is `auto`.
    pub index: Option<u32>,
    /// `index` came from `NCCL_IB_GID_INDEX`, which NCCL applies to RoCE ports only: a
    /// site may set it for its RoCE ports in an environment its InfiniBand ports share,
    /// where it would skip an IB port that lacks that GID.
    pub index_from_nccl: bool,
    /// `RAILOVER_IB_ROCE_VERSION`: 1 or 2.
    pub roce_version: u8,
    /// `RAILOVER_IB_ADDR_FAMILY`.
    pub family: AddrFamily,
}

impl Default for GidPolicy {
    fn default() -> Self {
        GidPolicy {
            index: None,
            index_from_nccl: false,
            roce_version: 2,
            family: AddrFamily::Inet,
        }
    }
}

/// QP settings of verbs lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerbsSettings {
    pub gid: GidPolicy,
    /// `RAILOVER_IB_TIMEOUT`: local ACK timeout exponent, 4.096 us x 2^timeout per attempt.
    pub timeout: u8,
    /// `RAILOVER_IB_RETRY_CNT`: retransmissions after the first attempt.
    pub retry_cnt: u8,
    /// `RAILOVER_IB_TC`: GRH traffic class (RoCE DSCP/ECN byte).
    pub traffic_class: u8,
    /// `RAILOVER_IB_SL`: service level.
    pub service_level: u8,
    /// `RAILOVER_QPS_PER_LANE`: RC QPs one lane spreads its writes over.
    pub qps_per_lane: u8,
    /// `RAILOVER_ZERO_COPY`: auto, always or off.
    pub zero_copy: ZeroCopy,
    /// `RAILOVER_GDR`: auto, force or off.
    pub gdr: Gdr,
}

impl Default for VerbsSettings {
    /// Timeout 16 with 6 retries: the NIC gives up after 4.096 us x 2^16 x 7 = 1.9 s, above
    /// railover's own 1 s completion timeout, which so decides first. NCCL's 20/7 keep a
    /// dead path for about 34 s; and Soft-RoCE takes a retry count of 7 as "forever".
    fn default() -> Self {
        VerbsSettings {
            gid: GidPolicy::default(),
            timeout: 16,
            retry_cnt: 6,
            traffic_class: 0,
            service_level: 0,
            qps_per_lane: 1,
            zero_copy: ZeroCopy::Auto,
            gdr: Gdr::Auto,
        }
    }
}

/// Which `NCCL_IB_*` values stood in for unset `RAILOVER_*` twins and which were set but
/// not used, for one INFO line at init: a site's NCCL setting quietly taken, or quietly
/// dropped, would each surprise whoever reads the job's log.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NcclIbEnv {
    /// `(variable, value)` of each `NCCL_IB_*` value in use.
    pub taken: Vec<(&'static str, String)>,
    /// `(variable, value, why)` of each `NCCL_IB_*` value set but not (wholly) used.
    pub ignored: Vec<(&'static str, String, &'static str)>,
}

/// Why `NCCL_IB_TIMEOUT` is not inherited: sites raise it so that NCCL rides out a
/// switch reboot before it aborts (NCCL's own 20 with 7 retries already keeps a dead path
/// for about 34 s, 22 for about 137 s), which would hold a dead path far past railover's
/// completion timeout.
const TIMEOUT_IGNORED: &str =
    "railover detects failures in about a second; set RAILOVER_IB_TIMEOUT to override";
/// Why `NCCL_IB_RETRY_CNT` is not inherited (as [`TIMEOUT_IGNORED`]; 7 is also "forever"
/// to Soft-RoCE).
const RETRY_CNT_IGNORED: &str =
    "railover detects failures in about a second; set RAILOVER_IB_RETRY_CNT to override";

impl NcclIbEnv {
    /// The INFO line's text, or `None` when no `NCCL_IB_*` variable was set.
    pub fn summary(&self) -> Option<String> {
        let taken: Vec<String> = self
            .taken
            .iter()
            .map(|(var, v)| format!("{var}={}", shown_value(v)))
            .collect();
        let ignored: Vec<String> = self
            .ignored
            .iter()
            .map(|(var, v, why)| format!("{var}={} ({why})", shown_value(v)))
            .collect();
        let mut parts = Vec::new();
        if !taken.is_empty() {
            parts.push(format!("taken from NCCL_IB_*: {}", taken.join(", ")));
        }
        if !ignored.is_empty() {
            parts.push(format!("ignored: {}", ignored.join(", ")));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The value of the `NCCL_IB_*` variable `var`; empty is unset, as NCCL reads it.
pub(super) fn nccl_value(
    get: &impl Fn(&'static str) -> Option<String>,
    var: &'static str,
) -> Option<String> {
    get(var).filter(|v| !v.is_empty())
}

/// `s` as NCCL reads a numeric variable (`strtoll(s, NULL, 0)`): decimal, `0x` hex, or
/// octal after a leading `0`, with an optional `-`, so that `NCCL_IB_TC=010` means 8 to
/// railover as it does to NCCL. Stricter than `strtoll`, which reads `"5x"` as 5 and
/// `"x"` as 0: a value NCCL would misread is refused rather than misread alike.
fn nccl_int(s: &str) -> Option<i64> {
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s),
    };
    let (radix, digits) = match body.strip_prefix("0x").or(body.strip_prefix("0X")) {
        Some(hex) => (16, hex),
        None if body.len() > 1 && body.starts_with('0') => (8, &body[1..]),
        None => (10, body),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let n = i64::from_str_radix(digits, radix).ok()?;
    Some(if neg { -n } else { n })
}

impl VerbsSettings {
    /// How long the NIC retries a write to a dead peer before it fails it:
    /// 4.096 us x 2^timeout x (retry_cnt + 1).
    pub fn nic_give_up(&self) -> std::time::Duration {
        let ns = 4096u64 << self.timeout;
        std::time::Duration::from_nanos(ns * (u64::from(self.retry_cnt) + 1))
    }

    /// Parses the settings from `get`, taking `NCCL_IB_*` twins for unset variables and
    /// recording in `noted` what was taken from them and what was not.
    pub fn from_lookup(
        get: &impl Fn(&'static str) -> Option<String>,
        noted: &mut NcclIbEnv,
    ) -> Result<VerbsSettings, ConfigError> {
        let mut s = VerbsSettings::default();
        let int = |var: &'static str, min: u64, max: u64, accepted: &'static str| {
            get(var)
                .map(|v| {
                    parse_u64(&v, min, max).ok_or(ConfigError {
                        var,
                        value: v.clone(),
                        accepted,
                    })
                })
                .transpose()
        };
        // NCCL's twin of an unset variable, within `min..=max` as NCCL reads numbers.
        let nccl = |var: &'static str,
                    min: i64,
                    max: i64,
                    accepted: &'static str,
                    noted: &mut NcclIbEnv|
         -> Result<Option<i64>, ConfigError> {
            let Some(v) = nccl_value(get, var) else {
                return Ok(None);
            };
            let n = nccl_int(&v)
                .filter(|n| (min..=max).contains(n))
                .ok_or_else(|| ConfigError {
                    var,
                    value: v.clone(),
                    accepted,
                })?;
            noted.taken.push((var, v));
            Ok(Some(n))
        };
        if let Some(v) = get("RAILOVER_IB_GID_INDEX") {
            s.gid.index = match v.to_ascii_lowercase().as_str() {
                "auto" | "-1" => None,
                n => Some(parse_u64(n, 0, 255).ok_or(ConfigError {
                    var: "RAILOVER_IB_GID_INDEX",
                    value: v.clone(),
                    accepted: "auto (by RAILOVER_IB_ROCE_VERSION and RAILOVER_IB_ADDR_FAMILY) or a GID index from 0 to 255",
                })? as u32),
            };
        } else if let Some(n) = nccl(
            "NCCL_IB_GID_INDEX",
            -1,
            255,
            "-1 (auto) or a GID index from 0 to 255, in decimal, 0x hex or 0-led octal as NCCL reads it",
            noted,
        )? {
            // NCCL's -1 is auto, as railover's default.
            s.gid.index = u32::try_from(n).ok();
            s.gid.index_from_nccl = s.gid.index.is_some();
        }
        if let Some(n) = int("RAILOVER_IB_ROCE_VERSION", 1, 2, "1 or 2")? {
            s.gid.roce_version = n as u8;
        } else if let Some(n) = nccl(
            "NCCL_IB_ROCE_VERSION_NUM",
            1,
            2,
            "1 or 2, in decimal, 0x hex or 0-led octal as NCCL reads it",
            noted,
        )? {
            s.gid.roce_version = n as u8;
        }
        if let Some(v) = get("RAILOVER_IB_ADDR_FAMILY") {
            s.gid.family = match v.to_ascii_uppercase().as_str() {
                "AF_INET" | "INET" | "IPV4" => AddrFamily::Inet,
                "AF_INET6" | "INET6" | "IPV6" => AddrFamily::Inet6,
                _ => {
                    return Err(ConfigError {
                        var: "RAILOVER_IB_ADDR_FAMILY",
                        value: v,
                        accepted: "AF_INET or AF_INET6",
                    })
                }
            };
        } else if let Some(v) = nccl_value(get, "NCCL_IB_ADDR_FAMILY") {
            // Exactly NCCL's two spellings: NCCL reads any other value as AF_INET, so
            // railover taking, say, `inet6` would choose a GID NCCL would not.
            s.gid.family = match v.as_str() {
                "AF_INET" => AddrFamily::Inet,
                "AF_INET6" => AddrFamily::Inet6,
                _ => {
                    return Err(ConfigError {
                        var: "NCCL_IB_ADDR_FAMILY",
                        value: v,
                        accepted: "AF_INET or AF_INET6, in capitals as NCCL reads it",
                    })
                }
            };
            noted.taken.push(("NCCL_IB_ADDR_FAMILY", v));
        }
        if let Some(n) = int(
            "RAILOVER_IB_TIMEOUT",
            1,
            31,
            "an ACK timeout exponent from 1 to 31 (4.096 us x 2^n per attempt)",
        )? {
            s.timeout = n as u8;
        } else if let Some(v) = nccl_value(get, "NCCL_IB_TIMEOUT") {
            noted.ignored.push(("NCCL_IB_TIMEOUT", v, TIMEOUT_IGNORED));
        }
        if let Some(n) = int("RAILOVER_IB_RETRY_CNT", 0, 7, "a retry count from 0 to 7")? {
            s.retry_cnt = n as u8;
        } else if let Some(v) = nccl_value(get, "NCCL_IB_RETRY_CNT") {
            noted
                .ignored
                .push(("NCCL_IB_RETRY_CNT", v, RETRY_CNT_IGNORED));
        }
        // NCCL's -1 for these is its default, 0, as railover's.
        if let Some(n) = int("RAILOVER_IB_TC", 0, 255, "a traffic class from 0 to 255")? {
            s.traffic_class = n as u8;
        } else if let Some(n) = nccl(
            "NCCL_IB_TC",
            -1,
            255,
            "-1 (the default, 0) or a traffic class from 0 to 255, in decimal, 0x hex or 0-led octal as NCCL reads it",
            noted,
        )? {
            s.traffic_class = n.max(0) as u8;
        }
        if let Some(n) = int("RAILOVER_IB_SL", 0, 15, "a service level from 0 to 15")? {
            s.service_level = n as u8;
        } else if let Some(n) = nccl(
            "NCCL_IB_SL",
            -1,
            15,
            "-1 (the default, 0) or a service level from 0 to 15, in decimal, 0x hex or 0-led octal as NCCL reads it",
            noted,
        )? {
            s.service_level = n.max(0) as u8;
        }
        if let Some(n) = int("RAILOVER_QPS_PER_LANE", 1, 16, "an integer from 1 to 16")? {
            s.qps_per_lane = n as u8;
        }
        if let Some(z) = parse_keyword(
            get,
            "RAILOVER_ZERO_COPY",
            &[
                ("auto", ZeroCopy::Auto),
                ("always", ZeroCopy::Always),
                ("off", ZeroCopy::Off),
            ],
            "auto (in place from 4 KiB), always (every payload in place) or off (through the rings)",
        )? {
            s.zero_copy = z;
        }
        if let Some(g) = parse_keyword(
            get,
            "RAILOVER_GDR",
            &[("auto", Gdr::Auto), ("force", Gdr::Force), ("off", Gdr::Off)],
            "auto (plain GPU addresses with nvidia-peermem, dma-bufs where the NIC registers them), force or off (host memory only)",
        )? {
            s.gdr = g;
        }
        if s.gdr == Gdr::Force && s.zero_copy == ZeroCopy::Off {
            return Err(ConfigError {
                var: "RAILOVER_ZERO_COPY",
                value: "off".into(),
                accepted: "auto or always while RAILOVER_GDR=force: GPU memory can only be moved in place by the NIC",
            });
        }
        Ok(s)
    }
}

impl fmt::Display for VerbsSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.gid.index {
            Some(i) => write!(f, "gid index {i}")?,
            None => write!(
                f,
                "gid auto (RoCE v{}, {})",
                self.gid.roce_version, self.gid.family
            )?,
        }
        write!(
            f,
            ", timeout {} retry {} (NIC gives up after {:.1} s), tc {} sl {}, {} QP(s) per lane, zero copy {}, gdr {}",
            self.timeout,
            self.retry_cnt,
            self.nic_give_up().as_secs_f64(),
            self.traffic_class,
            self.service_level,
            self.qps_per_lane,
            self.zero_copy,
            self.gdr
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn parse(pairs: &[(&'static str, &str)]) -> Result<VerbsSettings, ConfigError> {
        parse_noting(pairs).map(|(s, _)| s)
    }

    /// The settings and what they took from, or left of, the `NCCL_IB_*` variables.
    fn parse_noting(
        pairs: &[(&'static str, &str)],
    ) -> Result<(VerbsSettings, NcclIbEnv), ConfigError> {
        let pairs: Vec<(&str, String)> = pairs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let mut noted = NcclIbEnv::default();
        let get = |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        VerbsSettings::from_lookup(&get, &mut noted).map(|s| (s, noted))
    }

    #[test]
    fn defaults_and_good_values() {
        assert_eq!(parse(&[]).unwrap(), VerbsSettings::default());
        let s = parse(&[
            ("RAILOVER_IB_GID_INDEX", "3"),
            ("RAILOVER_IB_ROCE_VERSION", "1"),
            ("RAILOVER_IB_ADDR_FAMILY", "af_inet6"),
            ("RAILOVER_IB_TIMEOUT", "20"),
            ("RAILOVER_IB_RETRY_CNT", "7"),
            ("RAILOVER_IB_TC", "106"),
            ("RAILOVER_IB_SL", "3"),
            ("RAILOVER_QPS_PER_LANE", "4"),
            ("RAILOVER_ZERO_COPY", "Always"),
            ("RAILOVER_GDR", "FORCE"),
        ])
        .unwrap();
        assert_eq!(
            s.gid,
            GidPolicy {
                index: Some(3),
                index_from_nccl: false,
                roce_version: 1,
                family: AddrFamily::Inet6
            }
        );
        assert_eq!(
            (s.timeout, s.retry_cnt, s.traffic_class, s.service_level),
            (20, 7, 106, 3)
        );
        assert_eq!(s.qps_per_lane, 4);
        assert_eq!(s.zero_copy, ZeroCopy::Always);
        assert_eq!(s.gdr, Gdr::Force);
        assert!(
            s.to_string()
                .ends_with("4 QP(s) per lane, zero copy always, gdr force"),
            "{s}"
        );
        assert_eq!(
            parse(&[("RAILOVER_IB_GID_INDEX", "Auto")])
                .unwrap()
                .gid
                .index,
            None
        );
    }

    #[test]
    fn nccl_ib_twins_stand_in_for_unset_variables() {
        let (s, noted) = parse_noting(&[
            ("NCCL_IB_GID_INDEX", "3"),
            ("NCCL_IB_ROCE_VERSION_NUM", "1"),
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
            ("NCCL_IB_TC", "106"),
            ("NCCL_IB_SL", "3"),
        ])
        .unwrap();
        assert_eq!(
            s.gid,
            GidPolicy {
                index: Some(3),
                index_from_nccl: true,
                roce_version: 1,
                family: AddrFamily::Inet6
            }
        );
        assert_eq!((s.traffic_class, s.service_level), (106, 3));
        assert_eq!(
            noted.taken,
            [
                ("NCCL_IB_GID_INDEX", "3".to_string()),
                ("NCCL_IB_ROCE_VERSION_NUM", "1".to_string()),
                ("NCCL_IB_ADDR_FAMILY", "AF_INET6".to_string()),
                ("NCCL_IB_TC", "106".to_string()),
                ("NCCL_IB_SL", "3".to_string()),
            ]
        );
        assert!(noted.ignored.is_empty());
        assert_eq!(
            noted.summary().unwrap(),
            "taken from NCCL_IB_*: NCCL_IB_GID_INDEX=\"3\", NCCL_IB_ROCE_VERSION_NUM=\"1\", \
             NCCL_IB_ADDR_FAMILY=\"AF_INET6\", NCCL_IB_TC=\"106\", NCCL_IB_SL=\"3\""
        );
        // Numbers as NCCL's strtoll(.., 0) reads them; -1 is NCCL's "unset".
        let (s, noted) = parse_noting(&[
            ("NCCL_IB_GID_INDEX", "-1"),
            ("NCCL_IB_TC", "0x68"),
            ("NCCL_IB_SL", "010"),
        ])
        .unwrap();
        assert_eq!(
            (s.gid.index, s.traffic_class, s.service_level),
            (None, 0x68, 8)
        );
        assert_eq!(noted.taken.len(), 3, "{noted:?}");
        let s = parse(&[("NCCL_IB_TC", "-1"), ("NCCL_IB_SL", "-1")]).unwrap();
        assert_eq!((s.traffic_class, s.service_level), (0, 0));
        // Empty is unset to NCCL, and so here.
        let (s, noted) = parse_noting(&[("NCCL_IB_TC", ""), ("NCCL_IB_TIMEOUT", "")]).unwrap();
        assert_eq!(s, VerbsSettings::default());
        assert_eq!(noted, NcclIbEnv::default());
        assert_eq!(noted.summary(), None);
    }

    #[test]
    fn a_railover_variable_wins_over_its_nccl_twin() {
        let (s, noted) = parse_noting(&[
            ("RAILOVER_IB_GID_INDEX", "auto"),
            ("NCCL_IB_GID_INDEX", "3"),
            ("RAILOVER_IB_ROCE_VERSION", "2"),
            ("NCCL_IB_ROCE_VERSION_NUM", "1"),
            ("RAILOVER_IB_ADDR_FAMILY", "AF_INET"),
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
            ("RAILOVER_IB_TC", "41"),
            ("NCCL_IB_TC", "106"),
            ("RAILOVER_IB_SL", "1"),
            // A bad twin does not matter when the railover variable is set.
            ("NCCL_IB_SL", "high"),
            ("RAILOVER_IB_TIMEOUT", "18"),
            ("NCCL_IB_TIMEOUT", "22"),
            ("RAILOVER_IB_RETRY_CNT", "5"),
            ("NCCL_IB_RETRY_CNT", "7"),
        ])
        .unwrap();
        assert_eq!(s.gid, GidPolicy::default());
        assert_eq!(
            (s.traffic_class, s.service_level, s.timeout, s.retry_cnt),
            (41, 1, 18, 5)
        );
        assert_eq!(
            noted,
            NcclIbEnv::default(),
            "nothing taken, nothing to note"
        );
    }

    #[test]
    fn a_bad_nccl_value_is_named_as_nccl_s() {
        for (var, value) in [
            ("NCCL_IB_GID_INDEX", "256"),
            ("NCCL_IB_GID_INDEX", "-2"),
            ("NCCL_IB_GID_INDEX", "auto"),
            ("NCCL_IB_GID_INDEX", " 3"),
            ("NCCL_IB_GID_INDEX", "3\n"),
            ("NCCL_IB_ROCE_VERSION_NUM", "3"),
            ("NCCL_IB_ROCE_VERSION_NUM", "0"),
            ("NCCL_IB_ADDR_FAMILY", "af_inet6"),
            ("NCCL_IB_ADDR_FAMILY", "AF_UNIX"),
            ("NCCL_IB_TC", "256"),
            ("NCCL_IB_TC", "0x"),
            ("NCCL_IB_TC", "08"),
            ("NCCL_IB_TC", "+106"),
            ("NCCL_IB_TC", "106abc"),
            ("NCCL_IB_SL", "16"),
            ("NCCL_IB_SL", "0x10"),
        ] {
            let e = parse(&[(var, value)]).unwrap_err();
            assert_eq!((e.var, e.value.as_str()), (var, value));
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("{var}={value:?} is not valid: expected ")),
                "{msg}"
            );
        }
        let e = parse(&[("NCCL_IB_TC", "256")]).unwrap_err();
        assert!(e.accepted.contains("0 to 255"), "{e}");
    }

    #[test]
    fn nccl_qp_timing_is_not_inherited_but_noted() {
        let (s, noted) =
            parse_noting(&[("NCCL_IB_TIMEOUT", "22"), ("NCCL_IB_RETRY_CNT", "7")]).unwrap();
        assert_eq!(s, VerbsSettings::default(), "railover's 16 and 6 stay");
        assert!(noted.taken.is_empty());
        assert_eq!(
            noted.summary().unwrap(),
            "ignored: NCCL_IB_TIMEOUT=\"22\" (railover detects failures in about a second; \
             set RAILOVER_IB_TIMEOUT to override), NCCL_IB_RETRY_CNT=\"7\" (railover detects \
             failures in about a second; set RAILOVER_IB_RETRY_CNT to override)"
        );
        // Not parsed, as not used: any value is only noted.
        let (s, noted) =
            parse_noting(&[("NCCL_IB_TIMEOUT", "long"), ("NCCL_IB_TC", "106")]).unwrap();
        assert_eq!((s.timeout, s.traffic_class), (16, 106));
        let line = noted.summary().unwrap();
        assert!(
            line.starts_with(
                "taken from NCCL_IB_*: NCCL_IB_TC=\"106\"; ignored: NCCL_IB_TIMEOUT=\"long\" ("
            ),
            "{line}"
        );
    }

    #[test]
    fn gpu_memory_needs_the_nic_to_move_it() {
        let e = parse(&[("RAILOVER_GDR", "yes")]).unwrap_err();
        assert_eq!((e.var, e.value.as_str()), ("RAILOVER_GDR", "yes"));
        assert!(e.accepted.contains("force"), "{e}");
        let e = parse(&[("RAILOVER_GDR", "force"), ("RAILOVER_ZERO_COPY", "off")]).unwrap_err();
        assert_eq!(e.var, "RAILOVER_ZERO_COPY", "{e}");
        assert_eq!(
            parse(&[("RAILOVER_GDR", "off"), ("RAILOVER_ZERO_COPY", "off")])
                .unwrap()
                .gdr,
            Gdr::Off
        );
    }

    #[test]
    fn the_nic_gives_up_as_the_readme_says() {
        // 4.096 us x 2^16 x 7 = 1.879 s; NCCL's 20/7: 4.096 us x 2^20 x 8 = 34.4 s.
        let d = VerbsSettings::default().nic_give_up();
        assert_eq!(d, Duration::from_nanos(4096 * 65536 * 7));
        assert!(d > Duration::from_millis(1800) && d < Duration::from_millis(1900));
        let nccl = VerbsSettings {
            timeout: 20,
            retry_cnt: 7,
            ..Default::default()
        };
        assert_eq!(nccl.nic_give_up().as_secs(), 34);
        let text = VerbsSettings::default().to_string();
        assert!(
            text.contains("RoCE v2, AF_INET") && text.contains("1.9 s"),
            "{text}"
        );
    }
}
