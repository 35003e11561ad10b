//! The 128-byte handle NCCL ships from the listener to the connector.
//!
//! ```text
//!  0       4   5   6     8                24                40          48          56  57            128
//!  | RLVR  |ver|fam| port | address (16)   | comm token (16) | connect id | listen id | n | n NICs | zeros |
//! ```
//! The connect id is written by the connecting side into its own copy, which NCCL hands
//! back on every retry of `connect`. The listener's process adds its failover listeners,
//! one per NIC (family 4 or 6, address, port, rail), as many as fit, and its listen id:
//! when NCCL's own pair cannot carry the connect (a NIC or cable down), the connector
//! reaches the same listener over a healthy same-rail pair instead. A handle whose tail
//! is zeros names no NICs, and such a connect goes NCCL's way only.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use super::Error;
use crate::conn::wire::NicAddr;

const MAGIC: [u8; 4] = *b"RLVR";
const VERSION: u8 = 1;
/// Where the listener's failover NICs start (after the listen id and their count).
const NICS_AT: usize = 57;
/// A rail that does not fit in a byte, or none.
const NO_RAIL: u8 = 0xFF;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetHandle {
    pub addr: SocketAddr,
    pub token: [u8; 16],
    pub connect_id: u64,
    /// The listener's id in its process: a connect over a failover listener names it.
    pub listen_id: u64,
    /// The listener process's failover listeners, index for index with its NICs (the
    /// first ones, as many as the handle holds); their link speeds are not sent.
    pub nics: Vec<NicAddr>,
}

impl NetHandle {
    pub fn encode(&self) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        let ip = match self.addr.ip() {
            IpAddr::V4(v4) => {
                b[5] = 4;
                v4.to_ipv6_mapped().octets()
            }
            IpAddr::V6(v6) => {
                b[5] = 6;
                v6.octets()
            }
        };
        b[6..8].copy_from_slice(&self.addr.port().to_be_bytes());
        b[8..24].copy_from_slice(&ip);
        b[24..40].copy_from_slice(&self.token);
        b[40..48].copy_from_slice(&self.connect_id.to_le_bytes());
        b[48..56].copy_from_slice(&self.listen_id.to_le_bytes());
        let mut at = NICS_AT;
        let mut n = 0u8;
        for nic in &self.nics {
            let ip = match nic.addr.ip() {
                IpAddr::V4(v4) => v4.octets().to_vec(),
                IpAddr::V6(v6) => v6.octets().to_vec(),
            };
            let len = 1 + ip.len() + 2 + 1;
            if at + len > b.len() {
                // Later NICs do not fit; the indices of those that do stay right.
                break;
            }
            b[at] = if ip.len() == 4 { 4 } else { 6 };
            b[at + 1..at + 1 + ip.len()].copy_from_slice(&ip);
            let p = at + 1 + ip.len();
            b[p..p + 2].copy_from_slice(&nic.addr.port().to_be_bytes());
            b[p + 2] = nic
                .rail
                .and_then(|r| u8::try_from(r).ok())
                .unwrap_or(NO_RAIL);
            at += len;
            n += 1;
        }
        b[56] = n;
        b
    }

    pub fn decode(b: &[u8; 128]) -> Result<NetHandle, Error> {
        let bad = |what: &str| Error::InvalidArgument(format!("not a railover handle: {what}"));
        if b[0..4] != MAGIC {
            return Err(bad("magic"));
        }
        if b[4] != VERSION {
            return Err(bad("version"));
        }
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[8..24]);
        let ip6 = Ipv6Addr::from(ip);
        let ip = match b[5] {
            4 => IpAddr::V4(ip6.to_ipv4_mapped().ok_or_else(|| bad("IPv4 address"))?),
            6 => IpAddr::V6(ip6),
            _ => return Err(bad("address family")),
        };
        let port = u16::from_be_bytes([b[6], b[7]]);
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[24..40]);
        let u64_at = |at: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(v)
        };
        let mut nics = Vec::new();
        let mut at = NICS_AT;
        for _ in 0..b[56] {
            let len = match b.get(at) {
                Some(4) => 4,
                Some(6) => 16,
                _ => return Err(bad("failover NIC family")),
            };
            let entry = b
                .get(at + 1..at + 1 + len + 3)
                .ok_or_else(|| bad("failover NIC list"))?;
            let ip = match len {
                4 => IpAddr::from(<[u8; 4]>::try_from(&entry[..4]).expect("4 bytes")),
                _ => IpAddr::from(<[u8; 16]>::try_from(&entry[..16]).expect("16 bytes")),
            };
            let port = u16::from_be_bytes([entry[len], entry[len + 1]]);
            let rail = entry[len + 2];
            nics.push(NicAddr {
                addr: SocketAddr::new(ip, port),
                rail: (rail != NO_RAIL).then_some(u32::from(rail)),
                mbps: None,
            });
            at += 1 + len + 3;
        }
        Ok(NetHandle {
            addr: SocketAddr::new(ip, port),
            token,
            connect_id: u64_at(40),
            listen_id: u64_at(48),
            nics,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(addr: &str, rail: Option<u32>) -> NicAddr {
        NicAddr {
            addr: addr.parse().unwrap(),
            rail,
            mbps: None,
        }
    }

    #[test]
    fn roundtrip_v4_and_v6_and_zero_tail() {
        for addr in ["127.0.0.1:1234", "[::1]:65535"] {
            let h = NetHandle {
                addr: addr.parse().unwrap(),
                token: [7; 16],
                connect_id: 99,
                listen_id: 0,
                nics: Vec::new(),
            };
            let b = h.encode();
            assert_eq!(NetHandle::decode(&b).unwrap(), h);
            assert!(b[48..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn eight_ipv4_failover_nics_fit_and_what_does_not_fit_is_left_off_the_end() {
        let eight: Vec<NicAddr> = (0..8)
            .map(|i| nic(&format!("10.0.{i}.2:{}", 40000 + i), Some(i)))
            .collect();
        let h = NetHandle {
            addr: "10.0.0.2:5000".parse().unwrap(),
            token: [1; 16],
            connect_id: 0,
            listen_id: 0x0102_0304_0506_0708,
            nics: eight.clone(),
        };
        assert_eq!(NetHandle::decode(&h.encode()).unwrap(), h);
        // IPv6 entries take 20 bytes: three fit in the 71 left, and a fourth is dropped,
        // keeping the first three at their indices. A rail beyond a byte reads unknown.
        let v6 = vec![
            nic("[fd00::1]:1", Some(0)),
            nic("[fd00::2]:2", Some(300)),
            nic("[fd00::3]:3", None),
            nic("[fd00::4]:4", Some(3)),
        ];
        let h6 = NetHandle {
            nics: v6.clone(),
            ..h.clone()
        };
        let back = NetHandle::decode(&h6.encode()).unwrap();
        assert_eq!(back.nics.len(), 3);
        assert_eq!(back.nics[0], v6[0]);
        assert_eq!(back.nics[1], nic("[fd00::2]:2", None));
        assert_eq!(back.nics[2], v6[2]);
        // IPv4 entries take 8 bytes: eight fit, a ninth is left off.
        let nine: Vec<_> = (0..9)
            .map(|i| nic(&format!("10.1.{i}.2:7"), Some(i)))
            .collect();
        let back = NetHandle::decode(
            &NetHandle {
                nics: nine.clone(),
                ..h
            }
            .encode(),
        )
        .unwrap();
        assert_eq!(back.nics, nine[..8]);
    }

    #[test]
    fn a_nic_list_running_past_the_handle_is_refused() {
        let h = NetHandle {
            addr: "10.0.0.2:5000".parse().unwrap(),
            token: [1; 16],
            connect_id: 0,
            listen_id: 1,
            nics: vec![nic("10.0.0.2:1", Some(0))],
        };
        let mut b = h.encode();
        b[56] = 20;
        assert!(NetHandle::decode(&b).is_err(), "zeros are no NIC family");
        b[56] = 1;
        b[NICS_AT] = 5;
        assert!(NetHandle::decode(&b).is_err());
    }

    #[test]
    fn rejects_foreign_bytes() {
        assert!(NetHandle::decode(&[0u8; 128]).is_err());
        let mut b = NetHandle {
            addr: "127.0.0.1:1".parse().unwrap(),
            token: [0; 16],
            connect_id: 0,
            listen_id: 0,
            nics: Vec::new(),
        }
        .encode();
        b[5] = 9;
        assert!(NetHandle::decode(&b).is_err());
        b[5] = 4;
        b[4] = 2;
        assert!(NetHandle::decode(&b).is_err());
    }
}
