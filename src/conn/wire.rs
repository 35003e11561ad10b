//! The railover wire format: a fixed 24-byte header, then a kind-specific body.
//!
//! ```text
//!  0      2   3    4        8                16               24
//!  | "RO" |ver|kind|  aux   |      seq       |      len       | body…
//! ```
//! All integers are little-endian except the magic. `len` is the payload length for
//! `Data`, the receive capacity for `Cts` (its top byte places the receive in a grouped
//! receive, `aux` is its tag: see [`Group`]), and the body
//! length for the handshake frames (`Hello`, `Challenge`, `Proof`, `Welcome`); see
//! [`crate::conn::auth`] for how a handshake proves who is calling. Parsing checks every length before it reads, so a
//! stranger's bytes produce a [`WireError`], never a panic.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// The first two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"RO";
/// Version of this format; a peer speaking another one is refused. 2: authenticated
/// handshake (`Challenge`, `Proof`), no token on the wire. 3: striped comms (a comm runs
/// over several lanes at once; `Retire` ends one of them). 4: grouped receives (a `Cts`
/// carries its receive's tag and place in a group of up to [`MAX_GROUP`]). 5: payloads
/// written in place (`Place`, and [`DATA_PLACED`] on a `Data`), and `Fence`. 6: a `Cts`
/// may require its payload in place ([`CTS_IN_PLACE`]). 7: the sender matches each send
/// to a receive by NCCL's IB rules (`conn::matching`) and cuts a send larger than its
/// receive to the receive's size, so `Truncated` (code 7) is gone; a `Welcome`'s `aux`
/// names the listener's NICs that cannot register the comm's memory. 8: `Drained`.
/// 9: each NIC of a `Hello` or `Welcome` list carries its link speed.
pub const VERSION: u8 = 9;
pub const HEADER_LEN: usize = 24;
/// Upper bound on a handshake body: far above any real NIC list.
pub const MAX_BODY: u64 = 4096;
/// Largest payload one message may carry (NCCL's `maxP2pBytes` bound).
pub const MAX_DATA: u64 = 1 << 40;

/// `Data.aux` flag: the payload is already in the receive buffer (the sender's NIC wrote
/// it there, as a `Place` frame allowed); no payload bytes follow the header.
pub const DATA_PLACED: u32 = 1;
/// `Stalled.len`: the receiver's NIC cannot register the receive buffer (0: it heard
/// nothing on the lane for the completion timeout).
pub const STALLED_MEMORY: u64 = 1;
/// Body of a `Place` frame: the address to write at, then the receiver's fence count
/// when it made the offer (see `Fence`), both little endian.
pub const PLACE_BODY: u64 = 16;

/// Most receives one grouped receive holds (NCCL's `maxRecvs`).
pub const MAX_GROUP: u8 = 8;
/// Where a `Cts` keeps its [`Group`]: the top byte of `len`, above any capacity.
const GROUP_SHIFT: u32 = 56;
/// `Cts.len` flag, below the group: the receive buffer is GPU memory, which only a NIC
/// writes; the payload must come in place, never through the stream.
pub const CTS_IN_PLACE: u64 = 1 << 55;
const CAPACITY_MASK: u64 = CTS_IN_PLACE - 1;

/// A receive's place in a grouped receive (NCCL's `irecv` with `n` buffers): the next
/// `count` sends fill the group's receives, each the one whose tag equals the send's.
/// On the wire: `aux` is the tag, the top byte of `len` is `(count - 1) << 4 | index`,
/// so a single receive's `Cts` reads as a plain capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub tag: i32,
    /// Its position in the group, below `count`.
    pub index: u8,
    /// Receives in the group, 1 to [`MAX_GROUP`].
    pub count: u8,
}

impl Group {
    /// A receive of its own, with tag 0.
    pub const SINGLE: Group = Group {
        tag: 0,
        index: 0,
        count: 1,
    };

    /// The `Cts` header announcing receive `seq` of `capacity` bytes in this group.
    pub fn cts(self, seq: u64, capacity: u64) -> Header {
        let g = u64::from((self.count - 1) << 4 | self.index);
        Header {
            kind: Kind::Cts,
            aux: self.tag as u32,
            seq,
            len: capacity | g << GROUP_SHIFT,
        }
    }

    /// The capacity and group a `Cts` header announces ([`Header::decode`] checked them).
    pub fn of_cts(h: &Header) -> (u64, Group) {
        let g = (h.len >> GROUP_SHIFT) as u8;
        let group = Group {
            tag: h.aux as i32,
            index: g & 0xf,
            count: (g >> 4) + 1,
        };
        (h.len & CAPACITY_MASK, group)
    }

    /// Whether a `Cts` asks for its payload in place ([`CTS_IN_PLACE`]).
    pub fn in_place(h: &Header) -> bool {
        h.len & CTS_IN_PLACE != 0
    }

    fn valid(self) -> bool {
        self.count <= MAX_GROUP && self.index < self.count
    }
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Connector → listener: purpose, comm id, nonce, ephemeral key, NIC list.
    Hello,
    /// Listener → connector: accepted; `seq` = messages already delivered.
    Welcome,
    /// Listener → connector: refused; `aux` = reason.
    Refuse,
    /// Receiver → sender: receive `seq` is posted with capacity `len`, tag `aux`, as one
    /// receive of a group ([`Group`]).
    Cts,
    /// Sender → receiver: message `seq`, `len` payload bytes follow.
    Data,
    /// Receiver → sender: `seq` messages delivered (cumulative).
    Ack,
    /// Either side: orderly close of the comm.
    Close,
    /// Either side: "this lane is alive", sent when it has had nothing else to send for a
    /// quarter of the completion timeout.
    Keepalive,
    /// Receiver → sender: "nothing has arrived on this lane for the completion timeout":
    /// the sender may still hear the receiver (a one-way failure) and must move the lane.
    Stalled,
    /// Listener → connector: its nonce and ephemeral key, and its proof of the key.
    Challenge,
    /// Connector → listener: its proof of the key, over the whole handshake.
    Proof,
    /// Sender → receiver: this lane carries nothing more for its comm (its share moved to
    /// other lanes and all it carried was acknowledged); the receiver lets it go without
    /// waiting for a replacement.
    Retire,
    /// Receiver → sender, between the two ends of one verbs lane only: receive `seq`'s
    /// buffer (capacity `len`) may be written in place by this lane's NIC, at the address
    /// in the body with key `aux`; the body also counts the lanes the receiver had fenced
    /// (`Fence`) when it offered, so a message sent again goes in place only with an offer
    /// made after the lane it was lost with was fenced. The fabric sends and consumes it;
    /// the comm never sees it.
    Place,
    /// Sender → receiver: the comm's lane of attempt `seq` (its epoch: 0 for the first
    /// lane) was given up; the receiver fences its end of it before it takes anything
    /// that follows on this lane. What the sender replays follows, so nothing the dead
    /// lane still carries (a payload being written in place) can land after the replay
    /// completed its receive.
    Fence,
    /// Receiver → sender: the receiver's NICs an operator drained, all of them: bit `i`
    /// of `aux` is NIC `i` of its `Welcome` list. The sender moves its lanes off them in
    /// planned moves and leaves them out until a later `Drained` clears the bit. Sent
    /// after a `Welcome` while any is drained, and on one lane of every comm when the set
    /// changes.
    Drained,
}

impl Kind {
    /// Every kind, in wire-code order.
    pub const ALL: [Kind; 15] = [
        Kind::Hello,
        Kind::Welcome,
        Kind::Refuse,
        Kind::Cts,
        Kind::Data,
        Kind::Ack,
        Kind::Close,
        Kind::Keepalive,
        Kind::Stalled,
        Kind::Challenge,
        Kind::Proof,
        Kind::Retire,
        Kind::Place,
        Kind::Fence,
        Kind::Drained,
    ];

    fn code(self) -> u8 {
        match self {
            Kind::Hello => 1,
            Kind::Welcome => 2,
            Kind::Refuse => 3,
            Kind::Cts => 4,
            Kind::Data => 5,
            Kind::Ack => 6,
            // 7 was `Truncated`, until version 7.
            Kind::Close => 8,
            Kind::Keepalive => 9,
            Kind::Stalled => 10,
            Kind::Challenge => 11,
            Kind::Proof => 12,
            Kind::Retire => 13,
            Kind::Place => 14,
            Kind::Fence => 15,
            Kind::Drained => 16,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Refuse,
            4 => Kind::Cts,
            5 => Kind::Data,
            6 => Kind::Ack,
            8 => Kind::Close,
            9 => Kind::Keepalive,
            10 => Kind::Stalled,
            11 => Kind::Challenge,
            12 => Kind::Proof,
            13 => Kind::Retire,
            14 => Kind::Place,
            15 => Kind::Fence,
            16 => Kind::Drained,
            _ => return None,
        })
    }
}

/// Why bytes were rejected. Each closes the lane and is counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    #[error("unsupported version {0}")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{kind:?} frame length {len} exceeds {max}")]
    TooLong { kind: Kind, len: u64, max: u64 },
    #[error("truncated {0}")]
    Short(&'static str),
    #[error("malformed {0}")]
    Malformed(&'static str),
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub aux: u32,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    pub fn new(kind: Kind, seq: u64, len: u64) -> Header {
        Header {
            kind,
            aux: 0,
            seq,
            len,
        }
    }

    /// Bytes of body that follow the header in the stream (payload for `Data`, none when
    /// it was written in place).
    pub fn body_len(&self) -> u64 {
        match self.kind {
            Kind::Data if self.placed() => 0,
            Kind::Hello | Kind::Welcome | Kind::Challenge | Kind::Proof | Kind::Data => self.len,
            Kind::Place => PLACE_BODY,
            _ => 0,
        }
    }

    /// A `Data` whose payload the sender's NIC already wrote into the receive buffer.
    pub fn placed(&self) -> bool {
        self.kind == Kind::Data && self.aux & DATA_PLACED != 0
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = VERSION;
        b[3] = self.kind.code();
        b[4..8].copy_from_slice(&self.aux.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses and bounds-checks a header from the first [`HEADER_LEN`] bytes of `b`.
    pub fn decode(b: &[u8]) -> Result<Header, WireError> {
        let b: &[u8; HEADER_LEN] = b
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(WireError::Short("header"))?;
        if b[0..2] != MAGIC {
            return Err(WireError::BadMagic([b[0], b[1]]));
        }
        if b[2] != VERSION {
            return Err(WireError::BadVersion(b[2]));
        }
        let kind = Kind::from_code(b[3]).ok_or(WireError::UnknownKind(b[3]))?;
        let le64 = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let h = Header {
            kind,
            aux: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            seq: le64(8..16),
            len: le64(16..24),
        };
        let (len, max) = match kind {
            Kind::Hello | Kind::Welcome | Kind::Challenge | Kind::Proof => (h.len, MAX_BODY),
            Kind::Data if h.aux & !DATA_PLACED != 0 => {
                return Err(WireError::Malformed("Data flags"))
            }
            Kind::Data | Kind::Place => (h.len, MAX_DATA),
            Kind::Cts => {
                let (capacity, group) = Group::of_cts(&h);
                if !group.valid() {
                    return Err(WireError::Malformed("CTS group"));
                }
                (capacity, MAX_DATA)
            }
            _ => (h.len, u64::MAX),
        };
        if len > max {
            return Err(WireError::TooLong { kind, len, max });
        }
        Ok(h)
    }
}

/// What a new connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The first lane of a new comm (NCCL's connect).
    Data,
    /// A health probe of a NIC pair.
    Probe,
    /// A replacement lane of an existing comm.
    Migrate,
}

/// One NIC as the other side sees it: where its listener is, its rail, and its link
/// speed, so that the other side's backup selection weighs both ends of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NicAddr {
    pub addr: SocketAddr,
    pub rail: Option<u32>,
    /// Link speed in Mb/s; `None` when the NIC does not say.
    pub mbps: Option<u32>,
}

/// The connector's opening frame. It carries no secret: [`crate::conn::auth`] proves
/// the key later, over these bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub purpose: Purpose,
    /// The comm a probe or migration is for (its public id); for `Data`, the id of the
    /// NCCL listener it is for, little-endian in the first 8 bytes (a failover listener
    /// finds it by this; NCCL's own listener is known by its socket).
    pub comm: [u8; 16],
    pub nonce: [u8; 32],
    /// Ephemeral X25519 public key (`Data`); zero otherwise.
    pub eph: [u8; 32],
    /// A migration's attempt number, rising with each lane the sender opens for the
    /// comm: the receiver refuses one it has already taken. Zero otherwise.
    pub epoch: u64,
    pub nics: Vec<NicAddr>,
}

/// The listener's answer to a `Hello` it can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: [u8; 32],
    /// Ephemeral X25519 public key (`Data`); zero otherwise.
    pub eph: [u8; 32],
    /// HMAC proving the listener holds the key.
    pub mac: [u8; 32],
}

/// The connector's proof that it holds the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    pub mac: [u8; 32],
}

/// The listener's answer: its NIC list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub nics: Vec<NicAddr>,
}

/// Reasons carried in `Refuse.aux`: the handshake failed to authenticate.
pub const REFUSE_AUTH: u32 = 1;
/// The comm a replacement lane names no longer exists here: it failed or was closed, so
/// no later attempt can succeed either.
pub const REFUSE_GONE: u32 = 2;

const NIC_LEN: usize = 1 + 16 + 2 + 4 + 4;
const MAX_NICS: usize = 64;

fn encode_nics(out: &mut Vec<u8>, nics: &[NicAddr]) {
    let n = nics.len().min(MAX_NICS);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    for nic in &nics[..n] {
        let (fam, ip) = match nic.addr.ip() {
            IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6u8, v6.octets()),
        };
        out.push(fam);
        out.extend_from_slice(&ip);
        out.extend_from_slice(&nic.addr.port().to_le_bytes());
        out.extend_from_slice(&nic.rail.map_or(-1i32, |r| r as i32).to_le_bytes());
        out.extend_from_slice(&nic.mbps.unwrap_or(0).to_le_bytes());
    }
}

fn decode_nics(b: &[u8]) -> Result<(Vec<NicAddr>, &[u8]), WireError> {
    let n = b.get(..2).ok_or(WireError::Short("NIC count"))?;
    let n = u16::from_le_bytes([n[0], n[1]]) as usize;
    if n > MAX_NICS {
        return Err(WireError::Malformed("NIC count"));
    }
    let body = b
        .get(2..2 + n * NIC_LEN)
        .ok_or(WireError::Short("NIC list"))?;
    let mut nics = Vec::with_capacity(n);
    for e in body.chunks_exact(NIC_LEN) {
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&e[1..17]);
        let ip6 = Ipv6Addr::from(ip);
        let ip = match e[0] {
            4 => IpAddr::V4(
                ip6.to_ipv4_mapped()
                    .ok_or(WireError::Malformed("IPv4 address"))?,
            ),
            6 => IpAddr::V6(ip6),
            _ => return Err(WireError::Malformed("address family")),
        };
        let port = u16::from_le_bytes([e[17], e[18]]);
        let rail = i32::from_le_bytes([e[19], e[20], e[21], e[22]]);
        let rail = match rail {
            -1 => None,
            r if r >= 0 => Some(r as u32),
            _ => return Err(WireError::Malformed("rail")),
        };
        let mbps = u32::from_le_bytes([e[23], e[24], e[25], e[26]]);
        nics.push(NicAddr {
            addr: SocketAddr::new(ip, port),
            rail,
            mbps: (mbps > 0).then_some(mbps),
        });
    }
    Ok((nics, &b[2 + n * NIC_LEN..]))
}

fn array<const N: usize>(b: &[u8], at: usize, what: &'static str) -> Result<[u8; N], WireError> {
    b.get(at..at + N)
        .and_then(|s| s.try_into().ok())
        .ok_or(WireError::Short(what))
}

impl Hello {
    const FIXED: usize = 1 + 16 + 32 + 32 + 8;

    /// Header plus body, ready to write.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(Self::FIXED + 64);
        body.push(match self.purpose {
            Purpose::Data => 0,
            Purpose::Probe => 1,
            Purpose::Migrate => 2,
        });
        body.extend_from_slice(&self.comm);
        body.extend_from_slice(&self.nonce);
        body.extend_from_slice(&self.eph);
        body.extend_from_slice(&self.epoch.to_le_bytes());
        encode_nics(&mut body, &self.nics);
        frame_with_body(Header::new(Kind::Hello, 0, 0), &body)
    }

    pub fn decode(body: &[u8]) -> Result<Hello, WireError> {
        let purpose = match body.first() {
            Some(0) => Purpose::Data,
            Some(1) => Purpose::Probe,
            Some(2) => Purpose::Migrate,
            Some(_) => return Err(WireError::Malformed("purpose")),
            None => return Err(WireError::Short("purpose")),
        };
        let comm = array(body, 1, "comm id")?;
        let nonce = array(body, 17, "nonce")?;
        let eph = array(body, 49, "ephemeral key")?;
        let epoch = u64::from_le_bytes(array(body, 81, "epoch")?);
        let (nics, rest) = decode_nics(&body[Self::FIXED..])?;
        if !rest.is_empty() {
            return Err(WireError::Malformed("trailing bytes after Hello"));
        }
        Ok(Hello {
            purpose,
            comm,
            nonce,
            eph,
            epoch,
            nics,
        })
    }
}

impl Challenge {
    const LEN: usize = 96;

    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(Self::LEN);
        body.extend_from_slice(&self.nonce);
        body.extend_from_slice(&self.eph);
        body.extend_from_slice(&self.mac);
        frame_with_body(Header::new(Kind::Challenge, 0, 0), &body)
    }

    pub fn decode(body: &[u8]) -> Result<Challenge, WireError> {
        if body.len() > Self::LEN {
            return Err(WireError::Malformed("trailing bytes after Challenge"));
        }
        Ok(Challenge {
            nonce: array(body, 0, "nonce")?,
            eph: array(body, 32, "ephemeral key")?,
            mac: array(body, 64, "MAC")?,
        })
    }
}

impl Proof {
    pub fn encode(&self) -> Vec<u8> {
        frame_with_body(Header::new(Kind::Proof, 0, 0), &self.mac)
    }

    pub fn decode(body: &[u8]) -> Result<Proof, WireError> {
        if body.len() > 32 {
            return Err(WireError::Malformed("trailing bytes after Proof"));
        }
        Ok(Proof {
            mac: array(body, 0, "MAC")?,
        })
    }
}

impl Welcome {
    /// Header (with `seq` = messages delivered) plus body.
    pub fn encode(&self, delivered: u64) -> Vec<u8> {
        self.encode_refusing(delivered, 0)
    }

    /// As [`Welcome::encode`], with `aux` naming the listener's NICs (a bit per index)
    /// that cannot register the comm's memory: the sender leaves them out for the comm
    /// even when the `Stalled` that said so first was lost with its lane.
    pub fn encode_refusing(&self, delivered: u64, refusing: u32) -> Vec<u8> {
        let mut body = Vec::with_capacity(64);
        encode_nics(&mut body, &self.nics);
        let mut h = Header::new(Kind::Welcome, delivered, 0);
        h.aux = refusing;
        frame_with_body(h, &body)
    }

    pub fn decode(body: &[u8]) -> Result<Welcome, WireError> {
        let (nics, rest) = decode_nics(body)?;
        if !rest.is_empty() {
            return Err(WireError::Malformed("trailing bytes after Welcome"));
        }
        Ok(Welcome { nics })
    }
}

fn frame_with_body(mut h: Header, body: &[u8]) -> Vec<u8> {
    h.len = body.len() as u64;
    let mut v = Vec::with_capacity(HEADER_LEN + body.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(body);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_every_kind() {
        let codes: Vec<u8> = Kind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(
            codes,
            (1..=16).filter(|&c| c != 7).collect::<Vec<u8>>(),
            "ALL lists every kind once"
        );
        let mut old = Header::new(Kind::Ack, 0, 0).encode();
        old[3] = 7;
        assert_eq!(
            Header::decode(&old),
            Err(WireError::UnknownKind(7)),
            "Truncated is gone"
        );
        for kind in Kind::ALL {
            let h = Header {
                kind,
                // A Data's aux holds flags, of which only DATA_PLACED is defined.
                aux: if kind == Kind::Data { DATA_PLACED } else { 7 },
                seq: u64::MAX - 3,
                len: 100,
            };
            assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn a_welcome_names_the_nics_that_cannot_register_the_comms_memory() {
        let w = Welcome { nics: Vec::new() };
        let f = w.encode_refusing(5, 0b10);
        let h = Header::decode(&f).unwrap();
        assert_eq!((h.kind, h.seq, h.aux), (Kind::Welcome, 5, 0b10));
        assert_eq!(Header::decode(&w.encode(5)).unwrap().aux, 0);
    }

    #[test]
    fn cts_carries_its_group_and_refuses_a_bad_one() {
        for (count, index, tag) in [(1, 0, 0), (3, 2, -7), (MAX_GROUP, 7, i32::MAX)] {
            let g = Group { tag, index, count };
            let h = Header::decode(&g.cts(9, MAX_DATA).encode()).unwrap();
            assert_eq!(Group::of_cts(&h), (MAX_DATA, g));
            assert!(!Group::in_place(&h));
            let mut placed = g.cts(9, MAX_DATA);
            placed.len |= CTS_IN_PLACE;
            let h = Header::decode(&placed.encode()).unwrap();
            assert_eq!(Group::of_cts(&h), (MAX_DATA, g), "the flag is no capacity");
            assert!(Group::in_place(&h));
        }
        // A single receive's CTS is the plain capacity.
        assert_eq!(Group::SINGLE.cts(4, 100), Header::new(Kind::Cts, 4, 100));
        let bad = |count: u8, index: u8| {
            let mut h = Header::new(Kind::Cts, 0, 1);
            h.len |= u64::from((count - 1) << 4 | index) << GROUP_SHIFT;
            Header::decode(&h.encode())
        };
        assert_eq!(bad(3, 3), Err(WireError::Malformed("CTS group")));
        assert_eq!(bad(9, 0), Err(WireError::Malformed("CTS group")));
        assert!(bad(8, 7).is_ok());
        let over = Header::new(Kind::Cts, 0, MAX_DATA + 1).encode();
        assert!(matches!(
            Header::decode(&over),
            Err(WireError::TooLong { .. })
        ));
    }

    #[test]
    fn largest_rail_and_speed_survive_the_nic_list() {
        let nics = vec![NicAddr {
            addr: "10.0.0.1:1".parse().unwrap(),
            rail: Some(crate::topology::rails::MAX_RAIL),
            mbps: Some(u32::MAX),
        }];
        let f = Welcome { nics: nics.clone() }.encode(0);
        assert_eq!(Welcome::decode(&f[HEADER_LEN..]).unwrap().nics, nics);
    }

    #[test]
    fn a_placed_data_has_no_body_and_a_place_frame_an_address() {
        let mut h = Header::new(Kind::Data, 3, 1 << 20);
        assert_eq!((h.placed(), h.body_len()), (false, 1 << 20));
        h.aux = DATA_PLACED;
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!((d.placed(), d.body_len(), d.len), (true, 0, 1 << 20));
        h.aux = 2;
        assert_eq!(
            Header::decode(&h.encode()),
            Err(WireError::Malformed("Data flags"))
        );
        let p = Header::new(Kind::Place, 9, 4096);
        assert_eq!(p.body_len(), PLACE_BODY);
        assert!(!p.placed(), "only a Data is placed");
        let over = Header::new(Kind::Place, 0, MAX_DATA + 1).encode();
        assert!(matches!(
            Header::decode(&over),
            Err(WireError::TooLong { .. })
        ));
    }

    #[test]
    fn header_rejects_bad_input() {
        let good = Header::new(Kind::Data, 1, 2).encode();
        assert_eq!(Header::decode(&good[..23]), Err(WireError::Short("header")));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Header::decode(&b), Err(WireError::BadMagic(_))));
        let mut b = good;
        b[2] = VERSION + 1;
        assert_eq!(Header::decode(&b), Err(WireError::BadVersion(VERSION + 1)));
        b[2] = VERSION - 1;
        assert_eq!(
            Header::decode(&b),
            Err(WireError::BadVersion(VERSION - 1)),
            "a peer of the last version is refused"
        );
        let mut b = good;
        b[3] = 200;
        assert_eq!(Header::decode(&b), Err(WireError::UnknownKind(200)));
        let h = Header::new(Kind::Data, 0, MAX_DATA + 1).encode();
        assert!(matches!(Header::decode(&h), Err(WireError::TooLong { .. })));
        let h = Header::new(Kind::Hello, 0, MAX_BODY + 1).encode();
        assert!(matches!(Header::decode(&h), Err(WireError::TooLong { .. })));
        // The largest legal data message and a zero-byte one are fine.
        assert!(Header::decode(&Header::new(Kind::Data, 0, MAX_DATA).encode()).is_ok());
        assert_eq!(
            Header::decode(&Header::new(Kind::Data, 0, 0).encode())
                .unwrap()
                .body_len(),
            0
        );
    }

    #[test]
    fn hello_and_welcome_roundtrip() {
        let nics = vec![
            NicAddr {
                addr: "127.0.0.1:4000".parse().unwrap(),
                rail: Some(3),
                mbps: Some(400_000),
            },
            NicAddr {
                addr: "[::1]:5000".parse().unwrap(),
                rail: None,
                mbps: None,
            },
        ];
        let hello = Hello {
            purpose: Purpose::Migrate,
            comm: [9; 16],
            nonce: [3; 32],
            eph: [4; 32],
            epoch: 0x0102_0304_0506_0708,
            nics: nics.clone(),
        };
        let bytes = hello.encode();
        let h = Header::decode(&bytes).unwrap();
        assert_eq!(h.kind, Kind::Hello);
        assert_eq!(h.body_len() as usize, bytes.len() - HEADER_LEN);
        assert_eq!(Hello::decode(&bytes[HEADER_LEN..]).unwrap(), hello);

        let w = Welcome { nics };
        let bytes = w.encode(42);
        let h = Header::decode(&bytes).unwrap();
        assert_eq!((h.kind, h.seq), (Kind::Welcome, 42));
        assert_eq!(Welcome::decode(&bytes[HEADER_LEN..]).unwrap(), w);

        let c = Challenge {
            nonce: [1; 32],
            eph: [2; 32],
            mac: [3; 32],
        };
        let bytes = c.encode();
        assert_eq!(Header::decode(&bytes).unwrap().kind, Kind::Challenge);
        assert_eq!(Challenge::decode(&bytes[HEADER_LEN..]).unwrap(), c);
        let p = Proof { mac: [5; 32] };
        let bytes = p.encode();
        assert_eq!(Header::decode(&bytes).unwrap().kind, Kind::Proof);
        assert_eq!(Proof::decode(&bytes[HEADER_LEN..]).unwrap(), p);
        for cut in 0..bytes.len() - HEADER_LEN {
            assert!(Proof::decode(&bytes[HEADER_LEN..HEADER_LEN + cut]).is_err());
        }
    }

    #[test]
    fn hello_rejects_malformed_bodies() {
        let hello = Hello {
            purpose: Purpose::Data,
            comm: [0; 16],
            nonce: [1; 32],
            eph: [2; 32],
            epoch: 0,
            nics: vec![],
        }
        .encode();
        let body = &hello[HEADER_LEN..];
        for cut in 0..body.len() {
            assert!(
                Hello::decode(&body[..cut]).is_err(),
                "prefix of {cut} bytes accepted"
            );
        }
        let mut extra = body.to_vec();
        extra.push(0);
        assert!(Hello::decode(&extra).is_err());
        let mut bad_purpose = body.to_vec();
        bad_purpose[0] = 7;
        assert_eq!(
            Hello::decode(&bad_purpose),
            Err(WireError::Malformed("purpose"))
        );
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes() {
        // A deterministic sweep over pseudo-random inputs of every small length.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for len in 0..200usize {
            for _ in 0..50 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                let _ = Header::decode(&bytes);
                let _ = Hello::decode(&bytes);
                let _ = Welcome::decode(&bytes);
                let _ = Challenge::decode(&bytes);
                let _ = Proof::decode(&bytes);
                let mut framed = Header::new(Kind::Data, 0, 0).encode().to_vec();
                framed.extend_from_slice(&bytes);
                let _ = Header::decode(&framed);
            }
        }
    }
}
