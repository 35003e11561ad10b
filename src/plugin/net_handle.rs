//! The 128-byte handle NCCL ships from the listener to the connector.
//!
//! ```text
//!  0       4   5   6     8                24                40          48      128
//!  | RLVR  |ver|fam| port | address (16)   | comm token (16) | connect id | zeros |
//! ```
//! The connect id is written by the connecting side into its own copy, which NCCL hands
//! back on every retry of `connect`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use super::Error;

const MAGIC: [u8; 4] = *b"RLVR";
const VERSION: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetHandle {
    pub addr: SocketAddr,
    pub token: [u8; 16],
    pub connect_id: u64,
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
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[40..48]);
        Ok(NetHandle {
            addr: SocketAddr::new(ip, port),
            token,
            connect_id: u64::from_le_bytes(id),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_v4_and_v6_and_zero_tail() {
        for addr in ["127.0.0.1:1234", "[::1]:65535"] {
            let h = NetHandle {
                addr: addr.parse().unwrap(),
                token: [7; 16],
                connect_id: 99,
            };
            let b = h.encode();
            assert_eq!(NetHandle::decode(&b).unwrap(), h);
            assert!(b[48..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn rejects_foreign_bytes() {
        assert!(NetHandle::decode(&[0u8; 128]).is_err());
        let mut b = NetHandle {
            addr: "127.0.0.1:1".parse().unwrap(),
            token: [0; 16],
            connect_id: 0,
        }
        .encode();
        b[5] = 9;
        assert!(NetHandle::decode(&b).is_err());
        b[5] = 4;
        b[4] = 2;
        assert!(NetHandle::decode(&b).is_err());
    }
}
