//! PCI addresses and PCIe link bandwidth, with NCCL's conventions.

use std::cmp::Ordering;
use std::fmt;

use serde::{Serialize, Serializer};

/// A PCI function address, `DDDD:BB:DD.F`.
///
/// Ordering is numeric (domain, bus, device, function): this is "PCI order" everywhere in
/// this module, the order `nvidia-smi` and `CUDA_DEVICE_ORDER=PCI_BUS_ID` use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PciAddr {
    /// PCI domain (segment); may exceed 16 bits on VMD-style domains.
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0..32).
    pub device: u8,
    /// Function number (0..8).
    pub function: u8,
}

impl PciAddr {
    /// Parses `DDDD:BB:DD.F` (hex; the domain may be longer than four digits).
    /// Returns `None` for anything else, such as `pci0000:00`.
    pub fn parse(s: &str) -> Option<PciAddr> {
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        if domain.len() < 4 || bus.len() != 2 || device.len() != 2 || function.len() != 1 {
            return None;
        }
        let hex = |t: &str| t.bytes().all(|b| b.is_ascii_hexdigit());
        if !(hex(domain) && hex(bus) && hex(device) && hex(function)) {
            return None;
        }
        Some(PciAddr {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u8::from_str_radix(bus, 16).ok()?,
            device: u8::from_str_radix(device, 16).ok()?,
            function: u8::from_str_radix(function, 16).ok()?,
        })
    }

    /// The same address with the function number cleared. NCCL keys PCI switches and NICs
    /// this way, so the functions of one multi-function device share one graph node.
    pub fn without_function(self) -> PciAddr {
        PciAddr {
            function: 0,
            ..self
        }
    }
}

impl Ord for PciAddr {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.domain, self.bus, self.device, self.function).cmp(&(
            other.domain,
            other.bus,
            other.device,
            other.function,
        ))
    }
}

impl PartialOrd for PciAddr {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Serialize for PciAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// NCCL's test for a path component that names a PCI function while climbing a sysfs path:
/// exactly `BBBB:BB:DD.F`, twelve characters, hex digits in place. Anything else (such as
/// `pci0000:00`, or a five-digit VMD domain) means "the CPU root complex is above here".
pub fn is_nccl_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The PCIe link of one device to its parent, as NCCL records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PcieLink {
    /// The link-speed text, as sysfs (`max_link_speed`) or the XML (`link_speed`) gave it,
    /// e.g. `"32.0 GT/s PCIe"`; `None` when neither said.
    pub speed: Option<String>,
    /// Lanes; NCCL takes 16 when sysfs says 0 or nothing.
    pub width: u32,
    /// `width × per-lane rate / 80`, in GB/s (NCCL's formula; Gen3 x16 = 12).
    pub bandwidth_gbps: f64,
}

impl PcieLink {
    /// Builds the link NCCL would record from a speed text and a width text, either of which
    /// may be missing.
    pub fn from_attrs(speed: Option<&str>, width: Option<&str>) -> PcieLink {
        let width = width
            .and_then(|w| w.trim().parse::<u32>().ok())
            .filter(|&w| w != 0)
            .unwrap_or(16);
        let speed = speed
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        let rate = lane_rate(speed.as_deref());
        PcieLink {
            speed,
            width,
            bandwidth_gbps: f64::from(width) * f64::from(rate) / 80.0,
        }
    }

    /// The link NCCL records for a device from its own `max_link_*` attributes and those of
    /// the port above it: speed and width are each the smaller of the two.
    pub fn from_device_and_port(
        dev_speed: Option<&str>,
        dev_width: Option<&str>,
        port_speed: Option<&str>,
        port_width: Option<&str>,
    ) -> PcieLink {
        let speed = match (dev_speed, port_speed) {
            (Some(d), Some(p)) if gts(p).unwrap_or(f64::MAX) < gts(d).unwrap_or(f64::MAX) => {
                Some(p)
            }
            (Some(d), _) => Some(d),
            (None, p) => p,
        };
        let parse_w = |w: Option<&str>| w.and_then(|w| w.trim().parse::<u32>().ok());
        let width = match (parse_w(dev_width), parse_w(port_width)) {
            (Some(d), Some(p)) => Some(d.min(p)),
            (d, p) => d.or(p),
        };
        PcieLink::from_attrs(speed, width.map(|w| w.to_string()).as_deref())
    }
}

/// Parses the leading `"<float> GT/s"` of a link-speed text.
fn gts(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse::<f64>().ok()
}

/// Per-lane rate in NCCL's units (100 Mb/s): 2.5 GT/s → 15, 5 → 30, 8 → 60, 16 → 120,
/// 32 → 240, 64 → 480. NCCL falls back to 60 (Gen3) for anything it does not recognise.
pub fn lane_rate(speed: Option<&str>) -> u32 {
    const TABLE: [(f64, u32); 6] = [
        (2.5, 15),
        (5.0, 30),
        (8.0, 60),
        (16.0, 120),
        (32.0, 240),
        (64.0, 480),
    ];
    speed
        .and_then(gts)
        .and_then(|g| {
            TABLE
                .iter()
                .find(|(t, _)| (t - g).abs() < 1e-6)
                .map(|&(_, r)| r)
        })
        .unwrap_or(60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders_addresses() {
        let a = PciAddr::parse("0000:1a:00.1").unwrap();
        assert_eq!(a.to_string(), "0000:1a:00.1");
        assert_eq!(a.without_function().to_string(), "0000:1a:00.0");
        let b = PciAddr::parse("0000:9a:00.0").unwrap();
        assert!(a < b);
        assert!(PciAddr::parse("pci0000:00").is_none());
        assert!(PciAddr::parse("10000:e0:01.0").is_some());
        assert!(!is_nccl_bdf("10000:e0:01.0"));
        assert!(is_nccl_bdf("0000:e0:01.0"));
        assert!(!is_nccl_bdf("pci0000:e0"));
    }

    #[test]
    fn bandwidth_follows_nccl() {
        assert_eq!(
            PcieLink::from_attrs(Some("8.0 GT/s PCIe"), Some("16")).bandwidth_gbps,
            12.0
        );
        assert_eq!(
            PcieLink::from_attrs(Some("32.0 GT/s PCIe"), Some("16")).bandwidth_gbps,
            48.0
        );
        // Old kernels print no "PCIe" suffix.
        assert_eq!(
            PcieLink::from_attrs(Some("16 GT/s"), Some("8")).bandwidth_gbps,
            12.0
        );
        // Unknown speed → Gen3 rate; width 0 → 16.
        assert_eq!(
            PcieLink::from_attrs(Some("Unknown"), Some("0")).bandwidth_gbps,
            12.0
        );
        assert_eq!(PcieLink::from_attrs(None, None).bandwidth_gbps, 12.0);
    }

    #[test]
    fn link_takes_the_smaller_of_device_and_port() {
        let l = PcieLink::from_device_and_port(
            Some("32.0 GT/s PCIe"),
            Some("16"),
            Some("16.0 GT/s PCIe"),
            Some("8"),
        );
        assert_eq!(l.speed.as_deref(), Some("16.0 GT/s PCIe"));
        assert_eq!(l.width, 8);
        assert_eq!(l.bandwidth_gbps, 12.0);
        let l = PcieLink::from_device_and_port(Some("8.0 GT/s PCIe"), Some("16"), None, None);
        assert_eq!(l.bandwidth_gbps, 12.0);
    }
}
