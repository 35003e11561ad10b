//! Turning what an operator types into NIC indices.
//!
//! A spec is, tried in this order:
//! * `rail:N`: every NIC on rail N;
//! * a NIC's name: `eth1`, `mlx5_0:1`;
//! * a PCI address, `0000:3b:00.0` or, with domain 0000 left out as `lspci` does,
//!   `3b:00.0` (hex in any case), matched against the last component of each NIC's `pci`;
//! * a verbs device name without its port, `mlx5_0`: every port of it (as `NCCL_IB_HCA`
//!   names them).

use super::NicIdent;

/// What the syntax is, for error messages.
pub const SPEC_ACCEPTED: &str =
    "a NIC name (eth1, mlx5_0), a PCI address (0000:3b:00.0 or 3b:00.0) or rail:N";

/// Why a spec names no NIC of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// Well formed, but this process has no such NIC (another process may).
    NotHere,
    /// Not a spec at all; says why.
    Malformed(String),
}

/// Names → NIC indices: an interface/device name (`eth1`, `mlx5_0`), a PCI address
/// (`0000:3b:00.0` or `3b:00.0`; `pci` holds a sysfs path or address, its last
/// component is matched), or `rail:N` (every NIC on rail N). `Err` says what was given
/// and what this process has.
pub fn resolve(spec: &str, nics: &[NicIdent]) -> Result<Vec<usize>, String> {
    lookup(spec, nics).map_err(|miss| match miss {
        Miss::NotHere => format!(
            "no NIC {spec:?} in this process, which has {}",
            inventory(nics)
        ),
        Miss::Malformed(why) => format!("{spec:?} is not a NIC: {why}; expected {SPEC_ACCEPTED}"),
    })
}

/// [`resolve`] with the reason kept apart from the message.
pub fn lookup(spec: &str, nics: &[NicIdent]) -> Result<Vec<usize>, Miss> {
    if spec.is_empty() {
        return Err(Miss::Malformed("it is empty".into()));
    }
    if let Some(n) = spec
        .get(..5)
        .filter(|p| p.eq_ignore_ascii_case("rail:"))
        .map(|_| &spec[5..])
    {
        let rail = crate::config::strict_u64(n)
            .and_then(|r| u32::try_from(r).ok())
            .ok_or_else(|| Miss::Malformed(format!("{n:?} is not a rail number")))?;
        return found(
            nics.iter()
                .enumerate()
                .filter(|(_, n)| n.rail == Some(rail))
                .map(|(i, _)| i)
                .collect(),
        );
    }
    let by_name: Vec<usize> = nics
        .iter()
        .enumerate()
        .filter(|(_, n)| n.name == spec)
        .map(|(i, _)| i)
        .collect();
    if !by_name.is_empty() {
        return Ok(by_name);
    }
    if let Some(addr) = pci_address(spec) {
        return found(
            nics.iter()
                .enumerate()
                .filter(|(_, n)| {
                    n.pci
                        .as_deref()
                        .and_then(last_component)
                        .and_then(pci_address)
                        == Some(addr.clone())
                })
                .map(|(i, _)| i)
                .collect(),
        );
    }
    // `mlx5_0` for the ports `mlx5_0:1`, `mlx5_0:2`.
    found(
        nics.iter()
            .enumerate()
            .filter(|(_, n)| {
                n.name
                    .strip_prefix(spec)
                    .and_then(|rest| rest.strip_prefix(':'))
                    .is_some_and(|port| crate::config::strict_u64(port).is_some())
            })
            .map(|(i, _)| i)
            .collect(),
    )
}

fn found(v: Vec<usize>) -> Result<Vec<usize>, Miss> {
    if v.is_empty() {
        Err(Miss::NotHere)
    } else {
        Ok(v)
    }
}

fn last_component(pci: &str) -> Option<&str> {
    pci.trim_end_matches('/').rsplit('/').next()
}

/// `dddd:bb:dd.f` in lower case, from either that or `bb:dd.f` (domain 0000), or `None`
/// when `s` is neither.
fn pci_address(s: &str) -> Option<String> {
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (*d, *b, *df),
        [b, df] => ("0000", *b, *df),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let hex = |x: &str, len: usize| x.len() == len && x.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(domain, 4) && hex(bus, 2) && hex(dev, 2) && func.len() == 1) {
        return None;
    }
    if !matches!(func.as_bytes()[0], b'0'..=b'7') {
        return None;
    }
    Some(format!("{domain}:{bus}:{dev}.{func}").to_ascii_lowercase())
}

/// This process's NICs as an error message lists them: `eth0 (rail 0, 0000:3b:00.0)`.
pub fn inventory(nics: &[NicIdent]) -> String {
    if nics.is_empty() {
        return "no NIC".into();
    }
    nics.iter()
        .map(|n| {
            let mut extra = Vec::new();
            if let Some(r) = n.rail {
                extra.push(format!("rail {r}"));
            }
            if let Some(a) = n.pci.as_deref().and_then(last_component) {
                extra.push(a.to_string());
            }
            if extra.is_empty() {
                n.name.clone()
            } else {
                format!("{} ({})", n.name, extra.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn nic(name: &str, pci: Option<&str>, rail: Option<u32>) -> NicIdent {
        NicIdent {
            name: name.into(),
            pci: pci.map(String::from),
            rail,
        }
    }

    pub(crate) fn node() -> Vec<NicIdent> {
        vec![
            nic(
                "eth0",
                Some("/sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0"),
                Some(0),
            ),
            nic("eth1", Some("0000:5E:00.1"), Some(1)),
            nic(
                "mlx5_0:1",
                Some("/sys/devices/pci0000:80/0001:86:00.0/"),
                Some(0),
            ),
            nic("mlx5_0:2", None, Some(1)),
            nic("veth9", None, None),
        ]
    }

    #[test]
    fn names_resolve_exactly() {
        let n = node();
        assert_eq!(resolve("eth0", &n), Ok(vec![0]));
        assert_eq!(resolve("eth1", &n), Ok(vec![1]));
        assert_eq!(resolve("mlx5_0:2", &n), Ok(vec![3]));
        assert_eq!(resolve("veth9", &n), Ok(vec![4]));
        // A device without its port: every port.
        assert_eq!(resolve("mlx5_0", &n), Ok(vec![2, 3]));
        // Not prefixes.
        assert_eq!(lookup("eth", &n), Err(Miss::NotHere));
        assert_eq!(lookup("mlx5", &n), Err(Miss::NotHere));
        assert_eq!(lookup("ETH0", &n), Err(Miss::NotHere));
        // Multi-byte text where `rail:` would end is no panic.
        assert_eq!(lookup("\u{e9}\u{e9}\u{e9}", &n), Err(Miss::NotHere));
    }

    #[test]
    fn pci_addresses_match_the_last_component() {
        let n = node();
        assert_eq!(resolve("0000:3b:00.0", &n), Ok(vec![0]));
        assert_eq!(resolve("3b:00.0", &n), Ok(vec![0]));
        assert_eq!(resolve("3B:00.0", &n), Ok(vec![0]));
        assert_eq!(resolve("5e:00.1", &n), Ok(vec![1]));
        // Another domain must be named with it; a trailing slash is no component.
        assert_eq!(resolve("0001:86:00.0", &n), Ok(vec![2]));
        assert_eq!(lookup("86:00.0", &n), Err(Miss::NotHere));
        // Not the bridge on the way.
        assert_eq!(lookup("00:01.0", &n), Err(Miss::NotHere));
        assert_eq!(lookup("3b:00.8", &n), Err(Miss::NotHere));
    }

    #[test]
    fn rails_name_every_nic_on_them() {
        let n = node();
        assert_eq!(resolve("rail:0", &n), Ok(vec![0, 2]));
        assert_eq!(resolve("RAIL:1", &n), Ok(vec![1, 3]));
        assert_eq!(lookup("rail:2", &n), Err(Miss::NotHere));
        for bad in ["rail:", "rail:x", "rail:-1", "rail: 1", "rail:4294967296"] {
            let e = resolve(bad, &n).unwrap_err();
            assert!(
                e.contains("not a rail number") && e.contains("rail:N"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn unknown_names_say_what_was_given_and_what_is_here() {
        let n = node();
        let e = resolve("eth7", &n).unwrap_err();
        assert!(e.contains("\"eth7\""), "{e}");
        assert!(
            e.contains("eth0 (rail 0, 0000:3b:00.0)")
                && e.contains("eth1 (rail 1, 0000:5E:00.1)")
                && e.contains("veth9"),
            "{e}"
        );
        let e = resolve("eth0", &[]).unwrap_err();
        assert!(e.contains("no NIC"), "{e}");
        let e = resolve("", &n).unwrap_err();
        assert!(e.contains("empty") && e.contains("rail:N"), "{e}");
    }
}
