//! The verbs fabric's QP settings (`RAILOVER_IB_*`, `RAILOVER_QPS_PER_LANE`), parsed into
//! types ([`super`] calls [`VerbsSettings::from_lookup`]). They follow NCCL's `NCCL_IB_*`
//! namesakes, except for the QP timing defaults (see [`VerbsSettings::default`]).

use std::fmt;

use super::{parse_keyword, parse_u64, ConfigError};

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
    /// `RAILOVER_IB_ROCE_VERSION`: 1 or 2.
    pub roce_version: u8,
    /// `RAILOVER_IB_ADDR_FAMILY`.
    pub family: AddrFamily,
}

impl Default for GidPolicy {
    fn default() -> Self {
        GidPolicy {
            index: None,
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

impl VerbsSettings {
    /// How long the NIC retries a write to a dead peer before it fails it:
    /// 4.096 us x 2^timeout x (retry_cnt + 1).
    pub fn nic_give_up(&self) -> std::time::Duration {
        let ns = 4096u64 << self.timeout;
        std::time::Duration::from_nanos(ns * (u64::from(self.retry_cnt) + 1))
    }

    pub fn from_lookup(
        get: &impl Fn(&'static str) -> Option<String>,
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
        if let Some(v) = get("RAILOVER_IB_GID_INDEX") {
            s.gid.index = match v.to_ascii_lowercase().as_str() {
                "auto" | "-1" => None,
                n => Some(parse_u64(n, 0, 255).ok_or(ConfigError {
                    var: "RAILOVER_IB_GID_INDEX",
                    value: v.clone(),
                    accepted: "auto (by RAILOVER_IB_ROCE_VERSION and RAILOVER_IB_ADDR_FAMILY) or a GID index from 0 to 255",
                })? as u32),
            };
        }
        if let Some(n) = int("RAILOVER_IB_ROCE_VERSION", 1, 2, "1 or 2")? {
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
        }
        if let Some(n) = int(
            "RAILOVER_IB_TIMEOUT",
            1,
            31,
            "an ACK timeout exponent from 1 to 31 (4.096 us x 2^n per attempt)",
        )? {
            s.timeout = n as u8;
        }
        if let Some(n) = int("RAILOVER_IB_RETRY_CNT", 0, 7, "a retry count from 0 to 7")? {
            s.retry_cnt = n as u8;
        }
        if let Some(n) = int("RAILOVER_IB_TC", 0, 255, "a traffic class from 0 to 255")? {
            s.traffic_class = n as u8;
        }
        if let Some(n) = int("RAILOVER_IB_SL", 0, 15, "a service level from 0 to 15")? {
            s.service_level = n as u8;
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
            "auto (GPU memory when nvidia-peermem or dma-buf registration is there), force or off (host memory only)",
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
        let pairs: Vec<(&str, String)> = pairs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        VerbsSettings::from_lookup(&|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
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
