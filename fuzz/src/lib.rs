//! Fuzz targets for railover's parsers and handshake: one function per target, taking
//! arbitrary bytes. Each panics only on a broken invariant, so the same functions run
//! under libFuzzer (`fuzz_targets/*.rs`, see `scripts/fuzz.sh`) and as bounded property
//! tests in `cargo test` (`tests/fuzz_targets.rs` includes this file as a module).
//!
//! Beyond "no panic", each target checks what it can: decoded frames re-encode to the
//! same bytes, generated valid values survive encode → decode, the frame reader parses
//! the same frames whatever the chunking, a handshake is never accepted without the key.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::OnceLock;

use railover::config::{shown_value, strict_u64, Config, ConfigError};
use railover::conn::auth::{
    self, AuthError, CommId, Initiator, Random, Responder, Secret, Session,
};
use railover::conn::wire::{
    Challenge, Group, Header, Hello, Kind, NicAddr, Proof, Purpose, Welcome, WireError,
    DATA_PLACED, HEADER_LEN, MAX_BODY, MAX_DATA, MAX_GROUP,
};
use railover::topology::{PathType, RailRule, Topology};
use railover::transport::frames::{FrameReader, Inbound, ReadError};
use railover::transport::netlink;

/// A fuzz target: panics only when an invariant breaks.
pub type Target = fn(&[u8]);

/// Every target by name, as `scripts/fuzz.sh` and the property tests list them.
pub const TARGETS: &[(&str, Target)] = &[
    ("wire_header", wire_header),
    ("wire_body", wire_body),
    ("frame_reader", frame_reader),
    ("handshake", handshake),
    ("netlink", netlink_parse),
    ("topology_xml", topology_xml),
    ("config", config),
    #[cfg(feature = "fuzz-harness")]
    ("receiver_session", receiver_session),
];

/// A receive comm past a real handshake, fed hostile frame sequences: no receive
/// completes with bytes that were not sent for it, none reports more than its buffer.
#[cfg(feature = "fuzz-harness")]
pub fn receiver_session(data: &[u8]) {
    railover::engine::harness::receiver_session(data);
}

/// Reads structure out of fuzz bytes; past the end every read is zero, so any input is
/// a valid plan.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        for b in &mut a {
            *b = self.u8();
        }
        a
    }
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
    /// A length-prefixed slice (one byte of length).
    pub fn chunk(&mut self) -> &'a [u8] {
        let n = self.u8() as usize;
        self.bytes(n)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }
}

// ---------------------------------------------------------------- wire_header

/// `Header::decode` on arbitrary bytes: a decoded header re-encodes to the same 24
/// bytes and respects its kind's length bound (a `Cts`: its capacity, and a valid group);
/// a header built from the bytes survives encode → decode (or is refused as too long, or
/// a `Cts` for a bad group, exactly when it is).
pub fn wire_header(data: &[u8]) {
    match Header::decode(data) {
        Ok(h) => {
            assert_eq!(&h.encode()[..], &data[..HEADER_LEN], "re-encode {h:?}");
            assert!(bounded_len(&h) <= max_len(h.kind), "{h:?} over its bound");
            assert!(
                h.kind != Kind::Cts || group_ok(&h),
                "{h:?} with a bad group"
            );
        }
        Err(WireError::Short(_)) => assert!(data.len() < HEADER_LEN),
        Err(_) => assert!(data.len() >= HEADER_LEN),
    }
    let mut inp = Input::new(data);
    let kind = Kind::ALL[inp.u8() as usize % Kind::ALL.len()];
    let h = Header {
        kind,
        aux: inp.u32(),
        seq: inp.u64(),
        len: inp.u64() >> (inp.u8() % 64),
    };
    match Header::decode(&h.encode()) {
        Ok(back) => assert_eq!(back, h),
        Err(WireError::Malformed("CTS group")) => {
            assert!(kind == Kind::Cts && !group_ok(&h), "{h:?}")
        }
        Err(WireError::Malformed("Data flags")) => {
            assert!(kind == Kind::Data && h.aux & !DATA_PLACED != 0, "{h:?}")
        }
        Err(WireError::TooLong { len, max, .. }) => {
            assert!(
                len == bounded_len(&h) && len > max && max == max_len(kind),
                "{h:?}"
            )
        }
        Err(e) => panic!("{h:?} encoded, then refused: {e}"),
    }
}

/// The length a header's bound applies to: a `Cts` keeps its group above the capacity.
fn bounded_len(h: &Header) -> u64 {
    match h.kind {
        Kind::Cts => Group::of_cts(h).0,
        _ => h.len,
    }
}

fn group_ok(h: &Header) -> bool {
    let (_, g) = Group::of_cts(h);
    (1..=MAX_GROUP).contains(&g.count) && g.index < g.count
}

fn max_len(kind: Kind) -> u64 {
    match kind {
        Kind::Hello | Kind::Welcome | Kind::Challenge | Kind::Proof => MAX_BODY,
        Kind::Data | Kind::Cts | Kind::Place => MAX_DATA,
        _ => u64::MAX,
    }
}

// ---------------------------------------------------------------- wire_body

/// The handshake bodies. The first byte picks one; arbitrary bytes that decode must
/// re-encode to themselves (the encoding is canonical), and a value generated from the
/// bytes must survive encode → decode.
pub fn wire_body(data: &[u8]) {
    let mut inp = Input::new(data);
    let which = inp.u8();
    let body = inp.rest();
    match which % 4 {
        0 => {
            if let Ok(v) = Hello::decode(body) {
                assert_eq!(&v.encode()[HEADER_LEN..], body, "{v:?}");
            }
        }
        1 => {
            if let Ok(v) = Welcome::decode(body) {
                assert_eq!(&v.encode(0)[HEADER_LEN..], body, "{v:?}");
            }
        }
        2 => {
            if let Ok(v) = Challenge::decode(body) {
                assert_eq!(&v.encode()[HEADER_LEN..], body, "{v:?}");
            }
        }
        _ => {
            if let Ok(v) = Proof::decode(body) {
                assert_eq!(&v.encode()[HEADER_LEN..], body, "{v:?}");
            }
        }
    }

    let mut inp = Input::new(data);
    let nics = gen_nics(&mut inp);
    let hello = Hello {
        purpose: [Purpose::Data, Purpose::Probe, Purpose::Migrate][inp.u8() as usize % 3],
        comm: inp.array(),
        nonce: inp.array(),
        eph: inp.array(),
        epoch: inp.u64(),
        nics: nics.clone(),
    };
    assert_eq!(
        Hello::decode(body_of(&hello.encode(), Kind::Hello)),
        Ok(hello)
    );
    let delivered = inp.u64();
    let frame = Welcome { nics: nics.clone() }.encode(delivered);
    assert_eq!(Header::decode(&frame).map(|h| h.seq), Ok(delivered));
    assert_eq!(
        Welcome::decode(body_of(&frame, Kind::Welcome)),
        Ok(Welcome { nics })
    );
    let c = Challenge {
        nonce: inp.array(),
        eph: inp.array(),
        mac: inp.array(),
    };
    assert_eq!(
        Challenge::decode(body_of(&c.encode(), Kind::Challenge)),
        Ok(c)
    );
    let p = Proof { mac: inp.array() };
    assert_eq!(Proof::decode(body_of(&p.encode(), Kind::Proof)), Ok(p));
}

/// Up to 64 NICs (what a frame carries), IPv4 and IPv6, with or without a rail and a
/// link speed.
fn gen_nics(inp: &mut Input) -> Vec<NicAddr> {
    let n = inp.u8() as usize % 65;
    (0..n)
        .map(|_| {
            let ip = if inp.u8() & 1 == 0 {
                IpAddr::V4(Ipv4Addr::from(inp.u32()))
            } else {
                IpAddr::V6(Ipv6Addr::from(inp.array::<16>()))
            };
            let addr = SocketAddr::new(ip, inp.u16());
            let rail = match inp.u8() {
                0 => None,
                _ => Some(inp.u32() % (railover::topology::rails::MAX_RAIL + 1)),
            };
            let mbps = match inp.u32() {
                0 => None,
                s => Some(s),
            };
            NicAddr { addr, rail, mbps }
        })
        .collect()
}

/// The body of an encoded frame, after checking its header names it.
fn body_of(frame: &[u8], kind: Kind) -> &[u8] {
    let h = Header::decode(frame).expect("an encoded header decodes");
    assert_eq!(h.kind, kind);
    let body = &frame[HEADER_LEN..];
    assert_eq!(h.len, body.len() as u64);
    body
}

// ---------------------------------------------------------------- frame_reader

/// What the frame reader reports, in a form two runs can compare.
#[derive(Debug, PartialEq, Eq)]
enum Event {
    Frame(Header, Vec<u8>),
    Data { seq: u64, len: u64 },
    PayloadDone { seq: u64, len: u64 },
    Eof,
    Wire(WireError),
    EofMidFrame,
}

/// `FrameReader` over a byte stream delivered in arbitrary chunks, with `WouldBlock`,
/// `EINTR` and `enlarge` at arbitrary points: it must report exactly the frames a
/// one-pass parse of the whole stream finds, then the same end (EOF at a boundary, EOF
/// mid-frame, or the same wire error), in a bounded number of calls, and count every
/// byte it read.
pub fn frame_reader(data: &[u8]) {
    let mut inp = Input::new(data);
    let plan_len = inp.u8() as usize % 32;
    let plan = inp.bytes(plan_len);
    let stream = inp.rest();
    let expected = parse_whole(stream);

    let mut sock = Chunked {
        data: stream,
        pos: 0,
        plan,
        step: 0,
        stalled: false,
    };
    let mut r = FrameReader::default();
    let enlarge_at = plan.first().map_or(usize::MAX, |b| (b % 8) as usize);
    let mut idle = 0usize;
    let mut got = Vec::new();
    // Each call that returns nothing consumed a stall; stalls never come twice in a row.
    let bound = 4 * stream.len() + 64;
    for _ in 0..bound {
        match r.next(&mut sock) {
            Ok(None) => {
                assert!(!r.wants_more(), "budget spent on {} bytes", stream.len());
                idle += 1;
                if idle == enlarge_at {
                    r.enlarge();
                }
            }
            Ok(Some(Inbound::Data { seq, len, .. })) => {
                got.push(Event::Data { seq, len });
                r.place(None);
            }
            Ok(Some(Inbound::PayloadDone { seq, len })) => {
                got.push(Event::PayloadDone { seq, len })
            }
            Ok(Some(Inbound::Frame(h, body))) => got.push(Event::Frame(h, body)),
            Ok(Some(Inbound::Eof)) => {
                got.push(Event::Eof);
                break;
            }
            Err(ReadError::Wire(e)) => {
                got.push(Event::Wire(e));
                break;
            }
            Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                got.push(Event::EofMidFrame);
                break;
            }
            Err(ReadError::Io(e)) => panic!("unexpected I/O error {e}"),
        }
    }
    assert_eq!(got, expected, "plan {plan:?}");
    assert_eq!(r.total_read(), sock.pos as u64, "bytes counted");
}

/// The reference: one pass over the whole stream with `Header::decode`.
fn parse_whole(stream: &[u8]) -> Vec<Event> {
    let mut out = Vec::new();
    let mut at = 0usize;
    loop {
        let rest = &stream[at..];
        if rest.is_empty() {
            out.push(Event::Eof);
            return out;
        }
        if rest.len() < HEADER_LEN {
            out.push(Event::EofMidFrame);
            return out;
        }
        let h = match Header::decode(rest) {
            Ok(h) => h,
            Err(e) => {
                out.push(Event::Wire(e));
                return out;
            }
        };
        assert_eq!(&h.encode()[..], &rest[..HEADER_LEN]);
        at += HEADER_LEN;
        let left = (stream.len() - at) as u64;
        if h.kind == Kind::Data {
            out.push(Event::Data {
                seq: h.seq,
                len: h.len,
            });
            // A payload written in place has no bytes in the stream.
            if left < h.body_len() {
                out.push(Event::EofMidFrame);
                return out;
            }
            at += h.body_len() as usize;
            out.push(Event::PayloadDone {
                seq: h.seq,
                len: h.len,
            });
            continue;
        }
        let n = h.body_len();
        if left < n {
            out.push(Event::EofMidFrame);
            return out;
        }
        out.push(Event::Frame(h, stream[at..at + n as usize].to_vec()));
        at += n as usize;
    }
}

/// A socket that hands out its bytes in the sizes `plan` names (cycling): 0 is
/// `WouldBlock`, 1 is `EINTR`, n ≥ 2 is up to n - 1 bytes; an empty plan gives all at once.
struct Chunked<'a> {
    data: &'a [u8],
    pos: usize,
    plan: &'a [u8],
    step: usize,
    /// The last call returned no bytes: the next one makes progress.
    stalled: bool,
}

impl Read for Chunked<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let token = if self.plan.is_empty() {
            u8::MAX
        } else {
            self.plan[self.step % self.plan.len()]
        };
        self.step += 1;
        if token < 2 && !std::mem::replace(&mut self.stalled, true) {
            return Err(if token == 0 {
                io::ErrorKind::WouldBlock.into()
            } else {
                io::ErrorKind::Interrupted.into()
            });
        }
        self.stalled = false;
        let want = if self.plan.is_empty() {
            usize::MAX
        } else {
            (token as usize).saturating_sub(1).max(1)
        };
        let n = out.len().min(want).min(self.data.len() - self.pos);
        out[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

// ---------------------------------------------------------------- handshake

const TOKEN: [u8; 16] = *b"railover-fuzz-tk";

/// The session of one honest handshake, for the probe and migration lookups (made once:
/// it costs more than most inputs).
fn session() -> Session {
    static SESSION: OnceLock<Session> = OnceLock::new();
    SESSION.get_or_init(honest_session).clone()
}

fn honest_session() -> Session {
    let (mut i, hello) = Initiator::connect(&TOKEN, 0, Vec::new(), &[1; 64]);
    let mut r = Responder::default();
    let ch = r
        .handle_hello(&hello[HEADER_LEN..], lookup(None), &[2; 64])
        .expect("honest Hello");
    let proof = i
        .handle_challenge(&ch[HEADER_LEN..])
        .expect("honest Challenge");
    r.handle_proof(&proof[HEADER_LEN..]).expect("honest Proof");
    i.finish()
        .expect("finished")
        .expect("a Data lane agrees a session")
}

/// What a listener holds: the token for new comms, the session for its one comm.
fn lookup(session: Option<Session>) -> impl FnOnce(Purpose, CommId) -> Option<Secret> {
    move |p, id| match p {
        Purpose::Data => Some(Secret::Token(TOKEN)),
        _ => session.filter(|s| s.id() == id).map(Secret::Session),
    }
}

/// The handshake machines. The first byte picks a scenario:
/// 0. a stranger's Hello and Proof at a `Responder`: never accepted;
/// 1. a stranger's Challenge at an `Initiator`: never proved, `finish` fails;
/// 2. an honest exchange with one byte of one message altered: accepted exactly when
///    nothing was altered, and then both ends agree on comm, session and NICs;
/// 3. an `Initiator` holding another token: refused.
pub fn handshake(data: &[u8]) {
    let mut inp = Input::new(data);
    let scenario = inp.u8() % 4;
    let s = session();
    match scenario {
        0 => {
            let hello = inp.chunk();
            let random: Random = inp.array();
            let proof = inp.rest();
            let mut r = Responder::default();
            if let Ok(ch) = r.handle_hello(hello, lookup(Some(s.clone())), &random) {
                let h = Header::decode(&ch).expect("own Challenge");
                assert_eq!(h.kind, Kind::Challenge);
                Challenge::decode(&ch[HEADER_LEN..]).expect("own Challenge body");
                assert_eq!(
                    r.handle_hello(hello, lookup(Some(s)), &random),
                    Err(AuthError::OutOfOrder("second Hello"))
                );
            }
            let verdict = r.handle_proof(proof);
            assert!(verdict.is_err(), "accepted a stranger: {verdict:?}");
        }
        1 => {
            let random: Random = inp.array();
            let nics = gen_nics(&mut inp);
            let (mut i, _) = start(&mut inp, &s, &TOKEN, nics, &random);
            let verdict = i.handle_challenge(inp.rest());
            assert!(verdict.is_err(), "proved a stranger's challenge");
            assert!(i.finish().is_err());
        }
        2 => {
            let random_c: Random = inp.array();
            let random_l: Random = inp.array();
            let nics = gen_nics(&mut inp);
            let (mut i, hello) = start(&mut inp, &s, &TOKEN, nics.clone(), &random_c);
            let purpose = i.purpose();
            let target = inp.u8() % 4; // 3: alter nothing
            let at = inp.u16() as usize;
            let mask = inp.u8();
            let alter = |which: u8, mut body: Vec<u8>| {
                if which == target && !body.is_empty() {
                    let k = at % body.len();
                    body[k] ^= mask;
                }
                body
            };
            let altered = target < 3 && mask != 0;
            let hello = alter(0, hello[HEADER_LEN..].to_vec());
            let mut r = Responder::default();
            let Ok(ch) = r.handle_hello(&hello, lookup(Some(s.clone())), &random_l) else {
                assert!(altered, "honest Hello refused");
                return;
            };
            let ch = alter(1, ch[HEADER_LEN..].to_vec());
            let Ok(proof) = i.handle_challenge(&ch) else {
                assert!(altered, "honest Challenge refused");
                return;
            };
            let proof = alter(2, proof[HEADER_LEN..].to_vec());
            match r.handle_proof(&proof) {
                Ok(acc) => {
                    assert!(!altered, "accepted an altered handshake");
                    let mine = i.finish().expect("proved");
                    assert_eq!(acc.purpose, purpose);
                    assert_eq!(acc.nics, nics);
                    assert_eq!(acc.session, mine);
                    match purpose {
                        Purpose::Data => assert_eq!(
                            Ok(acc.comm),
                            auth::observed_comm_id(&hello, &ch),
                            "comm id as observers compute it"
                        ),
                        _ => assert_eq!(acc.comm, s.id()),
                    }
                }
                Err(e) => assert!(altered, "honest Proof refused: {e}"),
            }
        }
        _ => {
            let mut token: [u8; 16] = inp.array();
            if token == TOKEN {
                token[0] ^= 1;
            }
            let random_c: Random = inp.array();
            let random_l: Random = inp.array();
            let (mut i, hello) = Initiator::connect(&token, 0, Vec::new(), &random_c);
            let mut r = Responder::default();
            let ch = r
                .handle_hello(&hello[HEADER_LEN..], lookup(None), &random_l)
                .expect("a Hello does not prove anything yet");
            assert_eq!(
                i.handle_challenge(&ch[HEADER_LEN..]),
                Err(AuthError::BadMac)
            );
            assert!(r.handle_proof(inp.rest()).is_err());
        }
    }
}

/// A new comm's lane, or a probe or migration of the session's comm.
fn start(
    inp: &mut Input,
    s: &Session,
    token: &[u8; 16],
    nics: Vec<NicAddr>,
    random: &Random,
) -> (Initiator, Vec<u8>) {
    match inp.u8() % 3 {
        0 => Initiator::connect(token, 0, nics, random),
        1 => Initiator::resume(Purpose::Probe, s, 0, nics, random),
        _ => Initiator::resume(Purpose::Migrate, s, inp.u64(), nics, random),
    }
}

// ---------------------------------------------------------------- netlink

const NLMSG_HDR: usize = 16;
const IFINFO: usize = 16;

/// The rtnetlink parser (`netlink-packet-core`/`-route` views under our carrier rule).
/// Arbitrary datagrams: names hold no NUL, and the events of a truncated datagram are a
/// prefix of the whole one's. Generated well-formed datagrams (several messages, other
/// attributes around the name) give exactly one event per link message.
pub fn netlink_parse(data: &[u8]) {
    let mut inp = Input::new(data);
    let cut = inp.u16() as usize;
    let raw = inp.rest();
    let all = netlink::parse(raw);
    for e in &all {
        assert!(!e.ifname.contains('\0'), "{e:?}");
    }
    let part = netlink::parse(&raw[..cut.min(raw.len())]);
    assert!(
        all.starts_with(&part),
        "truncation changed events: {part:?} vs {all:?}"
    );

    let mut inp = Input::new(data);
    let mut dgram = Vec::new();
    let mut expected = Vec::new();
    for _ in 0..inp.u8() % 8 {
        let kind = [libc::RTM_NEWLINK, libc::RTM_DELLINK, libc::RTM_NEWADDR][inp.u8() as usize % 3];
        let flags = inp.u32();
        // Printable ASCII, as interface names are.
        let name: Vec<u8> = inp.chunk().iter().map(|&b| b'!' + b % 94).collect();
        let mut payload = name.clone();
        payload.push(0);
        let mut attrs = Vec::new();
        let others = inp.u8() % 4;
        let name_at = inp.u8() % (others + 1);
        for i in 0..=others {
            if i == name_at {
                push_attr(&mut attrs, libc::IFLA_IFNAME, &payload);
            }
            if i < others {
                // A hardware address or a kind nobody knows: any payload.
                let akind = match inp.u8() % 2 {
                    0 => libc::IFLA_ADDRESS,
                    _ => 0x3000 | (inp.u16() & 0xff),
                };
                push_attr(&mut attrs, akind, inp.chunk());
            }
        }
        expected_event(&mut expected, kind, flags, &payload);

        let mut ifi = [0u8; IFINFO];
        ifi[8..12].copy_from_slice(&flags.to_ne_bytes());
        let len = NLMSG_HDR + IFINFO + attrs.len();
        dgram.extend_from_slice(&(len as u32).to_ne_bytes());
        dgram.extend_from_slice(&kind.to_ne_bytes());
        dgram.extend_from_slice(&[0; 10]);
        dgram.extend_from_slice(&ifi);
        dgram.extend_from_slice(&attrs);
    }
    let got = netlink::parse(&dgram);
    assert_eq!(got.len(), expected.len(), "{got:?}");
    for (e, (name, up)) in got.iter().zip(&expected) {
        assert_eq!((&e.ifname, e.up), (name, *up));
    }
}

fn push_attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    while out.len() % 4 != 0 {
        out.push(0);
    }
}

fn expected_event(out: &mut Vec<(String, bool)>, kind: u16, flags: u32, name: &[u8]) {
    if kind != libc::RTM_NEWLINK && kind != libc::RTM_DELLINK {
        return;
    }
    let name = name.split(|&b| b == 0).next().unwrap_or(&[]);
    let running = (libc::IFF_UP | libc::IFF_RUNNING) as u32;
    let up = kind == libc::RTM_NEWLINK && flags & running == running;
    out.push((String::from_utf8_lossy(name).into_owned(), up));
}

// ---------------------------------------------------------------- topology_xml

/// `Topology::from_xml` (`NCCL_TOPO_FILE`). Arbitrary text: an error with a message, or
/// a topology whose paths are symmetric and whose backup lists never name the failed
/// NIC. A generated valid system: parsed with exactly its GPUs and NICs, every pair
/// connected.
pub fn topology_xml(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    check_topology(Topology::from_xml(&text, "fuzz.xml"));

    let mut inp = Input::new(data);
    let mut g = XmlGen {
        xml: String::from("<system version=\"1\">\n"),
        bus: 0,
        gpus: 0,
        nets: 0,
    };
    for numa in 0..1 + inp.u8() % 2 {
        g.xml
            .push_str(&format!("<cpu numaid=\"{numa}\" arch=\"x86_64\">\n"));
        for _ in 0..1 + inp.u8() % 3 {
            g.pci(&mut inp, 0);
        }
        g.xml.push_str("</cpu>\n");
    }
    g.xml.push_str("</system>\n");
    let t =
        Topology::from_xml(&g.xml, "generated.xml").unwrap_or_else(|e| panic!("{e}\n{}", g.xml));
    assert_eq!(t.gpus().len(), g.gpus, "{}", g.xml);
    assert_eq!(t.nics().len(), g.nets, "{}", g.xml);
    for n in t.nic_ids() {
        for gpu in t.gpu_ids() {
            assert!(t.path(n, gpu).is_some(), "{}", g.xml);
        }
    }
    check_topology(Ok(t));
}

fn check_topology(t: Result<Topology, railover::topology::TopologyError>) {
    let t = match t {
        Ok(t) => t,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let nics: Vec<_> = t.nic_ids().collect();
    let gpus: Vec<_> = t.gpu_ids().collect();
    for &a in &nics {
        for &b in &nics {
            let ab = t.path(a, b).map(|p| (p.kind, p.hops));
            let ba = t.path(b, a).map(|p| (p.kind, p.hops));
            assert_eq!(ab, ba, "path between NICs {a:?} and {b:?}");
        }
        for &g in &gpus {
            let ab = t.path(a, g).map(|p| (p.kind, p.hops));
            let ba = t.path(g, a).map(|p| (p.kind, p.hops));
            assert_eq!(ab, ba, "path between NIC {a:?} and GPU {g:?}");
        }
        for rule in [RailRule::Same, RailRule::Any] {
            let c = t.backup_candidates(a, rule, PathType::Sys);
            assert!(c.len() < nics.len());
            assert!(c.iter().all(|c| c.nic != a), "{a:?} backs itself up");
        }
    }
}

struct XmlGen {
    xml: String,
    bus: u32,
    gpus: usize,
    nets: usize,
}

impl XmlGen {
    /// One `pci` element: a switch (recursing), a GPU, or a NIC with one or two ports.
    fn pci(&mut self, inp: &mut Input, depth: u32) {
        self.bus += 1;
        let busid = format!("0000:{:02x}:00.0", self.bus % 256);
        let speed =
            ["2.5 GT/s PCIe", "16.0 GT/s PCIe", "32.0 GT/s PCIe", "bogus"][inp.u8() as usize % 4];
        let width = [1, 4, 8, 16][inp.u8() as usize % 4];
        let attrs = format!("busid=\"{busid}\" link_speed=\"{speed}\" link_width=\"{width}\"");
        match inp.u8() % 3 {
            0 if depth < 3 => {
                self.xml
                    .push_str(&format!("<pci {attrs} class=\"0x060400\">\n"));
                for _ in 0..1 + inp.u8() % 3 {
                    self.pci(inp, depth + 1);
                }
                self.xml.push_str("</pci>\n");
            }
            1 => {
                self.gpus += 1;
                self.xml.push_str(&format!(
                    "<pci {attrs} class=\"0x030200\" vendor=\"0x10de\"><gpu dev=\"{}\" sm=\"90\"/></pci>\n",
                    self.gpus - 1
                ));
            }
            _ => {
                self.xml
                    .push_str(&format!("<pci {attrs} class=\"0x020700\"><nic>"));
                for port in 1..=1 + inp.u8() % 2 {
                    self.nets += 1;
                    self.xml.push_str(&format!(
                        "<net name=\"nic{}\" dev=\"{}\" port=\"{port}\" speed=\"400000\"/>",
                        self.bus, self.nets
                    ));
                }
                self.xml.push_str("</nic></pci>\n");
            }
        }
    }
}

// ---------------------------------------------------------------- config

/// Every variable `Config::from_lookup` reads.
pub const VARS: &[&str] = &[
    "RAILOVER_IFNAME",
    "RAILOVER_SPIN_US",
    "RAILOVER_LOG",
    "RAILOVER_COMPLETION_TIMEOUT_MS",
    "RAILOVER_PROBE_TIMEOUT_MS",
    "RAILOVER_FAILBACK_INTERVAL_MS",
    "RAILOVER_GIVEUP_MS",
    "RAILOVER_PROBE_BYTES",
    "RAILOVER_FAIR_SHARE",
    "RAILOVER_PROGRESS",
    "RAILOVER_LOOPBACK_NICS",
    "RAILOVER_FAILBACK_PROBES",
    "RAILOVER_RAIL_RULE",
    "RAILOVER_DISTANCE_LIMIT",
    "RAILOVER_RAILS",
    "RAILOVER_SYSFS_ROOT",
];

/// `Config::from_lookup` with arbitrary values for arbitrary `RAILOVER_*` keys: `Ok`, or
/// an error naming a variable that was set, with its value, whose message shows both (a
/// long value shortened) and stays short enough for one NCCL log line. Parsing is a
/// function of the values (same input, same result); a value that parsed is what the
/// config holds, and a number that parsed is plain decimal digits.
pub fn config(data: &[u8]) {
    let mut inp = Input::new(data);
    let mut env: HashMap<String, String> = HashMap::new();
    for _ in 0..inp.u8() % 8 {
        let key = match inp.u8() {
            k if (k as usize) < VARS.len() * 12 => VARS[k as usize % VARS.len()].to_string(),
            _ => format!("RAILOVER_{}", String::from_utf8_lossy(inp.chunk())),
        };
        let value = String::from_utf8_lossy(inp.chunk()).into_owned();
        env.insert(key, value);
    }
    let parsed = Config::from_lookup(|k| env.get(k).cloned());
    assert_eq!(parsed, Config::from_lookup(|k| env.get(k).cloned()));
    match parsed {
        Err(ConfigError {
            var,
            value,
            accepted,
        }) => {
            assert_eq!(
                env.get(var),
                Some(&value),
                "error names {var}, which was not set"
            );
            let msg = ConfigError {
                var,
                value: value.clone(),
                accepted,
            }
            .to_string();
            assert!(
                msg.contains(&format!("{var}={}", shown_value(&value))),
                "{msg}"
            );
            assert!(msg.len() < 1024, "{} bytes: {msg}", msg.len());
            assert!(!accepted.is_empty());
        }
        Ok(cfg) => {
            let num = |k: &str| env.get(k).map(|v| strict_u64(v).expect("plain digits"));
            if let Some(us) = num("RAILOVER_SPIN_US") {
                assert_eq!(cfg.spin.as_micros(), us as u128);
            }
            if let Some(ms) = num("RAILOVER_COMPLETION_TIMEOUT_MS") {
                assert_eq!(cfg.completion_timeout.as_millis(), ms as u128);
            }
            if let Some(n) = num("RAILOVER_LOOPBACK_NICS") {
                assert_eq!(cfg.loopback_nics as u64, n);
            }
            if let Some(root) = env.get("RAILOVER_SYSFS_ROOT") {
                assert_eq!(cfg.sysfs_root.as_os_str(), root.as_str());
            }
            if let Some(rails) = env.get("RAILOVER_RAILS") {
                let entries = cfg.rails.as_ref().map_or(0, |m| m.entries().len());
                assert!(entries <= rails.split(',').count());
            }
        }
    }
}

// ---------------------------------------------------------------- seeds

/// Real inputs for each target, to start a corpus from: encoded frames, a handshake, a
/// netlink datagram, topology XML, a full environment.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let nics = vec![
        NicAddr {
            addr: "10.0.0.1:4000".parse().expect("literal"),
            rail: Some(0),
            mbps: Some(100_000),
        },
        NicAddr {
            addr: "[fe80::1]:4001".parse().expect("literal"),
            rail: None,
            mbps: None,
        },
    ];
    let (_, hello) = Initiator::connect(&TOKEN, 0, nics.clone(), &[3; 64]);
    let welcome = Welcome { nics }.encode(7);
    let stream: Vec<u8> = [
        hello.clone(),
        Header::new(Kind::Cts, 1, 4096).encode().to_vec(),
        Group {
            tag: 7,
            index: 2,
            count: 8,
        }
        .cts(3, 4096)
        .encode()
        .to_vec(),
        Header::new(Kind::Data, 1, 5).encode().to_vec(),
        b"hello".to_vec(),
        Header {
            kind: Kind::Place,
            aux: 0x1234,
            seq: 2,
            len: 1 << 20,
        }
        .encode()
        .to_vec(),
        0x7f00_dead_0000u64.to_le_bytes().to_vec(),
        Header {
            kind: Kind::Data,
            aux: DATA_PLACED,
            seq: 2,
            len: 1 << 20,
        }
        .encode()
        .to_vec(),
        Header::new(Kind::Ack, 2, 0).encode().to_vec(),
        welcome.clone(),
    ]
    .concat();
    match target {
        "wire_header" => vec![
            hello[..HEADER_LEN].to_vec(),
            Header::new(Kind::Data, 9, 1 << 20).encode().to_vec(),
        ],
        "wire_body" => vec![
            [&[0u8][..], &hello[HEADER_LEN..]].concat(),
            [&[1u8][..], &welcome[HEADER_LEN..]].concat(),
            [&[2u8][..], &[9u8; 96][..]].concat(),
        ],
        "frame_reader" => vec![
            [&[0u8][..], &stream[..]].concat(),
            [&[3u8, 7, 0, 30, 1, 2][..], &stream[..]].concat(),
        ],
        "handshake" => (0u8..4)
            .map(|s| [&[s][..], &[5u8; 200][..]].concat())
            .collect(),
        "netlink" => {
            let mut d = vec![0xff, 0xff, 3];
            let mut ev = Vec::new();
            push_attr(&mut ev, libc::IFLA_IFNAME, b"eth0\0");
            d.extend_from_slice(&((NLMSG_HDR + IFINFO + ev.len()) as u32).to_ne_bytes());
            d.extend_from_slice(&libc::RTM_NEWLINK.to_ne_bytes());
            d.extend_from_slice(&[0; 10]);
            let mut ifi = [0u8; IFINFO];
            ifi[8..12].copy_from_slice(&0x41u32.to_ne_bytes());
            d.extend_from_slice(&ifi);
            d.extend_from_slice(&ev);
            vec![d]
        }
        "topology_xml" => {
            vec![include_bytes!("../../tests/fixtures/topology/dgx-h100.xml").to_vec()]
        }
        "config" => {
            let mut d = vec![VARS.len() as u8];
            let values = [
                "eth",
                "200",
                "info",
                "1000",
                "200",
                "1000",
                "30000",
                "262144",
                "on",
                "0",
                "3",
                "same",
                "PHB",
                "eth0:0,eth1:1",
                "/sys",
            ];
            for (i, v) in values.iter().enumerate() {
                d.push(i as u8);
                d.push(v.len() as u8);
                d.extend_from_slice(v.as_bytes());
            }
            vec![d]
        }
        // Plans for `engine::harness::receiver_session`: op 0 posts (a byte for the
        // group, two per capacity), 1 a Data (seq picker, length, payload), 3 a placed
        // Data, 4 any header, 6 time.
        "receiver_session" => vec![
            // Two single receives of 256 and 512 bytes, a Data of 3 bytes into the first.
            vec![0, 0, 0, 1, 0, 0, 0, 2, 1, 2, 3, 0, 1, b'a', b'b', b'c'],
            // A receive, then a Data claiming to be placed into it.
            vec![0, 0, 0, 1, 3, 2, 1, 0x40, 0, 1],
            // A group of eight, a Fence far beyond any lane, time.
            vec![
                0, 0xA7, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 4, 9, 1, 6, 0, 0x10,
            ],
        ],
        _ => Vec::new(),
    }
}
