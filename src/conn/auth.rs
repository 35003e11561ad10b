//! Who may open a lane: a challenge-response handshake, and the comm's session secret.
//! Sans-IO like the rest of `conn`: frames in, frames out, randomness passed in.
//!
//! ```text
//!  connector                                          listener
//!  Hello {purpose, comm id, nonce_c, eph_c, nics}  ─▶
//!                                 ◀─ Challenge {nonce_l, eph_l, mac_l}
//!  Proof {mac_c}                                    ─▶
//!                                 ◀─ Welcome (or Refuse)
//! ```
//! Both MACs are HMAC-SHA256 under the purpose's key, over a hash of the whole Hello
//! body and the listener's fresh nonce and key, so no message of one connection is worth
//! anything in another (a replayed Hello meets a new nonce; a replayed Proof no longer
//! matches). The key of a `Data` lane (NCCL's connect) is derived from the token in the
//! NCCL handle; that handshake also runs an ephemeral X25519 exchange from which both
//! ends derive the comm's **session secret**. `Probe` and `Migrate` lanes name the comm
//! by its public id and are keyed by the session secret, so holding the handle is not
//! enough to replace a lane. Neither the token nor the session secret crosses the wire.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use x25519_dalek::{PublicKey, StaticSecret};

use super::wire::{Challenge, Hello, NicAddr, Proof, Purpose, WireError, HEADER_LEN};

type HmacSha256 = Hmac<Sha256>;

/// Fresh random bytes one side of a handshake consumes: a nonce, then an ephemeral key.
pub type Random = [u8; 64];

/// A comm's public name in probe and migration Hellos: anyone who saw its first
/// handshake can compute it, which is harmless; the session key is what counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommId(pub [u8; 16]);

/// The comm's session secret, agreed by its first handshake.
#[derive(Clone, PartialEq, Eq)]
pub struct Session {
    id: CommId,
    key: [u8; 32],
}

impl Session {
    pub fn id(&self) -> CommId {
        self.id
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// What the listener holds for the lane a Hello asks for.
#[derive(Clone)]
pub enum Secret {
    /// An NCCL listener's handle token: it may open new comms.
    Token([u8; 16]),
    /// A receive comm's session: it may take probes and replacement lanes.
    Session(Session),
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Token(_) => f.write_str("Token(..)"),
            Secret::Session(s) => s.fmt(f),
        }
    }
}

/// Why a handshake failed. The listener refuses the lane; the connector drops it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("malformed handshake: {0}")]
    Malformed(#[from] WireError),
    #[error("no {0:?} lane can be opened here (unknown comm, or not an NCCL listener)")]
    NotHere(Purpose),
    #[error("a {0:?} lane needs the comm's session secret; the handle token does not open it")]
    WrongSecret(Purpose),
    #[error("the proof does not match (wrong key, or a replayed or altered handshake)")]
    BadMac,
    #[error("the ephemeral key is of low order")]
    WeakKey,
    #[error("{0} out of order")]
    OutOfOrder(&'static str),
    #[error("a lane attempt already taken (attempt {offered}, newest {current})")]
    Stale { offered: u64, current: u64 },
}

const TRANSCRIPT: &[u8] = b"railover lane v2";

fn mac(key: &[u8; 32], label: &[u8], th: &[u8; 32]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    m.update(th);
    m.finalize().into_bytes().into()
}

fn verify(key: &[u8; 32], label: &[u8], th: &[u8; 32], tag: &[u8; 32]) -> Result<(), AuthError> {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    m.update(th);
    // Constant-time comparison.
    m.verify_slice(tag).map_err(|_| AuthError::BadMac)
}

/// The MAC key a handle token stands for (the token itself is never a key on the wire).
fn token_key(token: &[u8; 16]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(token).expect("HMAC takes any key length");
    m.update(b"railover handle token v2");
    m.finalize().into_bytes().into()
}

fn transcript(hello_body: &[u8], nonce_l: &[u8; 32], eph_l: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(TRANSCRIPT);
    h.update((hello_body.len() as u32).to_le_bytes());
    h.update(hello_body);
    h.update(nonce_l);
    h.update(eph_l);
    h.finalize().into()
}

/// The session of a `Data` handshake: keyed by the token's key and the X25519 secret,
/// named by the transcript.
fn derive_session(
    token_key: &[u8; 32],
    ours: &StaticSecret,
    theirs: &[u8; 32],
    th: &[u8; 32],
) -> Result<Session, AuthError> {
    let shared = ours.diffie_hellman(&PublicKey::from(*theirs));
    if !shared.was_contributory() {
        return Err(AuthError::WeakKey);
    }
    let hk = hkdf::Hkdf::<Sha256>::new(Some(token_key), shared.as_bytes());
    let mut key = [0u8; 32];
    let mut info = b"railover session v2".to_vec();
    info.extend_from_slice(th);
    hk.expand(&info, &mut key)
        .expect("32 bytes is a valid HKDF-SHA256 length");
    Ok(Session {
        id: comm_id(th),
        key,
    })
}

/// A comm's public id: named by its first handshake's transcript, chosen by neither end.
fn comm_id(th: &[u8; 32]) -> CommId {
    let mut id = [0u8; 16];
    id.copy_from_slice(&Sha256::digest([b"railover comm id".as_slice(), th].concat())[..16]);
    CommId(id)
}

/// The id a comm gets from its first handshake, computed from the bytes on the wire
/// (`Hello` and `Challenge` bodies): what any observer of that handshake learns.
pub fn observed_comm_id(hello_body: &[u8], challenge_body: &[u8]) -> Result<CommId, AuthError> {
    let c = Challenge::decode(challenge_body)?;
    Ok(comm_id(&transcript(hello_body, &c.nonce, &c.eph)))
}

fn split(random: &Random) -> ([u8; 32], [u8; 32]) {
    let mut nonce = [0u8; 32];
    let mut eph = [0u8; 32];
    nonce.copy_from_slice(&random[..32]);
    eph.copy_from_slice(&random[32..]);
    (nonce, eph)
}

/// The connector's half.
///
/// Call order: build with [`Initiator::connect`] or [`Initiator::resume`] and send the
/// Hello it returns; give the listener's `Challenge` body to
/// [`Initiator::handle_challenge`] and send the Proof it returns; on `Welcome`, call
/// [`Initiator::finish`], which fails unless the challenge was verified.
pub struct Initiator {
    purpose: Purpose,
    key: [u8; 32],
    hello_body: Vec<u8>,
    eph: Option<StaticSecret>,
    session: Option<Session>,
    proved: bool,
}

impl fmt::Debug for Initiator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Initiator")
            .field("purpose", &self.purpose)
            .field("proved", &self.proved)
            .finish_non_exhaustive()
    }
}

impl Initiator {
    /// A new comm's first lane to NCCL's listener `listen` (its id in its process, which
    /// a failover listener needs to find it), keyed by the handle's token. Returns the
    /// Hello frame.
    pub fn connect(
        token: &[u8; 16],
        listen: u64,
        nics: Vec<NicAddr>,
        random: &Random,
    ) -> (Initiator, Vec<u8>) {
        let (nonce, eph) = split(random);
        let secret = StaticSecret::from(eph);
        let mut comm = [0; 16];
        comm[..8].copy_from_slice(&listen.to_le_bytes());
        let hello = Hello {
            purpose: Purpose::Data,
            comm,
            nonce,
            eph: PublicKey::from(&secret).to_bytes(),
            epoch: 0,
            nics,
        };
        Self::start(hello, token_key(token), Some(secret))
    }

    /// A probe or replacement lane of the comm whose session this is.
    pub fn resume(
        purpose: Purpose,
        session: &Session,
        epoch: u64,
        nics: Vec<NicAddr>,
        random: &Random,
    ) -> (Initiator, Vec<u8>) {
        let (nonce, _) = split(random);
        let hello = Hello {
            purpose,
            comm: session.id.0,
            nonce,
            eph: [0; 32],
            epoch,
            nics,
        };
        Self::start(hello, session.key, None)
    }

    fn start(hello: Hello, key: [u8; 32], eph: Option<StaticSecret>) -> (Initiator, Vec<u8>) {
        let frame = hello.encode();
        let me = Initiator {
            purpose: hello.purpose,
            key,
            hello_body: frame[HEADER_LEN..].to_vec(),
            eph,
            session: None,
            proved: false,
        };
        (me, frame)
    }

    pub fn purpose(&self) -> Purpose {
        self.purpose
    }

    /// Checks that the listener holds the key; returns the Proof frame to send.
    pub fn handle_challenge(&mut self, body: &[u8]) -> Result<Vec<u8>, AuthError> {
        if self.proved {
            return Err(AuthError::OutOfOrder("second Challenge"));
        }
        let c = Challenge::decode(body)?;
        let th = transcript(&self.hello_body, &c.nonce, &c.eph);
        verify(&self.key, b"listener", &th, &c.mac)?;
        if let Some(eph) = &self.eph {
            self.session = Some(derive_session(&self.key, eph, &c.eph, &th)?);
        }
        self.eph = None;
        self.proved = true;
        Ok(Proof {
            mac: mac(&self.key, b"connector", &th),
        }
        .encode())
    }

    /// The listener welcomed the lane: the handshake is complete. Returns the session a
    /// `Data` handshake agreed (`None` for probes and migrations).
    pub fn finish(self) -> Result<Option<Session>, AuthError> {
        if !self.proved {
            return Err(AuthError::OutOfOrder("Welcome before Challenge"));
        }
        Ok(self.session)
    }
}

/// The NCCL listener a `Data` Hello names (see [`Initiator::connect`]).
pub fn listen_id(comm: &CommId) -> u64 {
    let mut id = [0; 8];
    id.copy_from_slice(&comm.0[..8]);
    u64::from_le_bytes(id)
}

/// What a listener learns from a handshake that authenticated.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub purpose: Purpose,
    /// The comm: the probed or migrated one, or the new one of a `Data` lane.
    pub comm: CommId,
    /// The new comm's session (`Data` only).
    pub session: Option<Session>,
    /// A migration's attempt number (see [`Hello::epoch`]), authenticated with the rest.
    pub epoch: u64,
    pub nics: Vec<NicAddr>,
}

enum Listening {
    Hello,
    Proof {
        key: [u8; 32],
        th: [u8; 32],
        accepted: Accepted,
    },
    Done,
}

/// The listener's half.
///
/// Call order: [`Responder::handle_hello`] with the Hello body and a lookup of the key
/// the purpose calls for, send the Challenge it returns; then
/// [`Responder::handle_proof`]. Any error means: refuse the lane.
pub struct Responder {
    state: Listening,
}

impl fmt::Debug for Responder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Responder")
            .field("purpose", &self.purpose())
            .finish_non_exhaustive()
    }
}

impl Default for Responder {
    fn default() -> Self {
        Responder {
            state: Listening::Hello,
        }
    }
}

impl Responder {
    /// The purpose the Hello claimed (not yet proven), once it has arrived.
    pub fn purpose(&self) -> Option<Purpose> {
        match &self.state {
            Listening::Proof { accepted, .. } => Some(accepted.purpose),
            _ => None,
        }
    }

    /// A Hello arrived. `secret` says what this listener holds for that purpose and comm
    /// id (`None`: nothing, refuse). Returns the Challenge frame to send.
    pub fn handle_hello(
        &mut self,
        body: &[u8],
        secret: impl FnOnce(Purpose, CommId) -> Option<Secret>,
        random: &Random,
    ) -> Result<Vec<u8>, AuthError> {
        if !matches!(self.state, Listening::Hello) {
            return Err(AuthError::OutOfOrder("second Hello"));
        }
        self.state = Listening::Done;
        let hello = Hello::decode(body)?;
        let (nonce, eph_seed) = split(random);
        let (key, eph_l, session) = match (hello.purpose, secret(hello.purpose, CommId(hello.comm)))
        {
            (_, None) => return Err(AuthError::NotHere(hello.purpose)),
            (Purpose::Data, Some(Secret::Token(t))) => {
                let key = token_key(&t);
                let ours = StaticSecret::from(eph_seed);
                let eph_l = PublicKey::from(&ours).to_bytes();
                let th = transcript(body, &nonce, &eph_l);
                let session = derive_session(&key, &ours, &hello.eph, &th)?;
                (key, eph_l, Some(session))
            }
            (Purpose::Probe | Purpose::Migrate, Some(Secret::Session(s))) => (s.key, [0; 32], None),
            (p, Some(_)) => return Err(AuthError::WrongSecret(p)),
        };
        let th = transcript(body, &nonce, &eph_l);
        let comm = session.as_ref().map_or(CommId(hello.comm), |s| s.id);
        self.state = Listening::Proof {
            key,
            th,
            accepted: Accepted {
                purpose: hello.purpose,
                comm,
                session,
                epoch: hello.epoch,
                nics: hello.nics,
            },
        };
        Ok(Challenge {
            nonce,
            eph: eph_l,
            mac: mac(&key, b"listener", &th),
        }
        .encode())
    }

    /// The connector's Proof: the lane is authenticated, or must be refused.
    pub fn handle_proof(&mut self, body: &[u8]) -> Result<Accepted, AuthError> {
        match std::mem::replace(&mut self.state, Listening::Done) {
            Listening::Proof { key, th, accepted } => {
                let p = Proof::decode(body)?;
                verify(&key, b"connector", &th, &p.mac)?;
                Ok(accepted)
            }
            _ => Err(AuthError::OutOfOrder("Proof")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: [u8; 16] = [7; 16];

    fn random(seed: u8) -> Random {
        let mut r = [0u8; 64];
        for (i, b) in r.iter_mut().enumerate() {
            *b = seed.wrapping_mul(31).wrapping_add(i as u8);
        }
        r
    }

    fn nics() -> Vec<NicAddr> {
        vec![NicAddr {
            addr: "127.0.0.1:4000".parse().unwrap(),
            rail: Some(0),
            mbps: None,
        }]
    }

    fn body(frame: &[u8]) -> &[u8] {
        &frame[HEADER_LEN..]
    }

    fn token_lookup(token: [u8; 16]) -> impl FnOnce(Purpose, CommId) -> Option<Secret> {
        move |p, _| (p == Purpose::Data).then_some(Secret::Token(token))
    }

    fn session_lookup(s: &Session) -> impl FnOnce(Purpose, CommId) -> Option<Secret> + '_ {
        move |p, id| (p != Purpose::Data && id == s.id).then(|| Secret::Session(s.clone()))
    }

    /// A full `Data` handshake; both sessions.
    fn connect(seed: u8) -> (Session, Session) {
        let (mut i, hello) = Initiator::connect(&TOKEN, 0, nics(), &random(seed));
        let mut r = Responder::default();
        let ch = r
            .handle_hello(body(&hello), token_lookup(TOKEN), &random(seed + 1))
            .unwrap();
        assert_eq!(r.purpose(), Some(Purpose::Data));
        let proof = i.handle_challenge(body(&ch)).unwrap();
        let a = r.handle_proof(body(&proof)).unwrap();
        assert_eq!(a.purpose, Purpose::Data);
        assert_eq!(a.nics, nics());
        let theirs = a.session.unwrap();
        assert_eq!(a.comm, theirs.id());
        (i.finish().unwrap().unwrap(), theirs)
    }

    #[test]
    fn both_ends_agree_on_a_session_the_wire_does_not_carry() {
        let (mut i, hello) = Initiator::connect(&TOKEN, 0, nics(), &random(1));
        let mut r = Responder::default();
        let ch = r
            .handle_hello(body(&hello), token_lookup(TOKEN), &random(2))
            .unwrap();
        let proof = i.handle_challenge(body(&ch)).unwrap();
        let theirs = r.handle_proof(body(&proof)).unwrap().session.unwrap();
        let ours = i.finish().unwrap().unwrap();
        assert_eq!(ours, theirs);
        // An observer computes the id, but neither token nor key is on the wire.
        assert_eq!(
            observed_comm_id(body(&hello), body(&ch)).unwrap(),
            ours.id()
        );
        let wire = [hello, ch, proof].concat();
        for secret in [&TOKEN[..], &ours.key[..], &token_key(&TOKEN)[..]] {
            assert!(
                !wire.windows(secret.len()).any(|w| w == secret),
                "a secret appears on the wire"
            );
        }
        // Different randomness, different session.
        let (other, _) = {
            let (mut i, hello) = Initiator::connect(&TOKEN, 0, nics(), &random(3));
            let mut r = Responder::default();
            let ch = r
                .handle_hello(body(&hello), token_lookup(TOKEN), &random(4))
                .unwrap();
            let proof = i.handle_challenge(body(&ch)).unwrap();
            r.handle_proof(body(&proof)).unwrap();
            (i.finish().unwrap().unwrap(), ())
        };
        assert_ne!(other, ours);
        assert_ne!(other.id(), ours.id());
    }

    #[test]
    fn a_wrong_token_is_refused_on_both_sides() {
        // The connector's token is wrong: the listener refuses its proof.
        let (mut i, hello) = Initiator::connect(&[8; 16], 0, nics(), &random(1));
        let mut r = Responder::default();
        let ch = r
            .handle_hello(body(&hello), token_lookup(TOKEN), &random(2))
            .unwrap();
        // ... and the connector already sees that the listener does not share its key.
        assert_eq!(i.handle_challenge(body(&ch)), Err(AuthError::BadMac));
        // A connector that answers anyway with a proof under its own key.
        let c = Challenge::decode(body(&ch)).unwrap();
        let th = transcript(body(&hello), &c.nonce, &c.eph);
        let forged = Proof {
            mac: mac(&token_key(&[8; 16]), b"connector", &th),
        }
        .encode();
        assert_eq!(
            r.handle_proof(body(&forged)).unwrap_err(),
            AuthError::BadMac
        );
        // A listener with no token for this purpose refuses at the Hello.
        let mut r = Responder::default();
        assert_eq!(
            r.handle_hello(body(&hello), |_, _| None, &random(2)),
            Err(AuthError::NotHere(Purpose::Data))
        );
    }

    #[test]
    fn a_replayed_transcript_is_refused() {
        let (mut i, hello) = Initiator::connect(&TOKEN, 0, nics(), &random(1));
        let mut r = Responder::default();
        let ch = r
            .handle_hello(body(&hello), token_lookup(TOKEN), &random(2))
            .unwrap();
        let proof = i.handle_challenge(body(&ch)).unwrap();
        r.handle_proof(body(&proof)).unwrap();
        // The same Hello and Proof sent again meet a fresh nonce.
        let mut again = Responder::default();
        let ch2 = again
            .handle_hello(body(&hello), token_lookup(TOKEN), &random(9))
            .unwrap();
        assert_ne!(ch, ch2);
        assert_eq!(
            again.handle_proof(body(&proof)).unwrap_err(),
            AuthError::BadMac
        );
        // A replayed Challenge does not satisfy a new connector either.
        let (mut i2, _) = Initiator::connect(&TOKEN, 0, nics(), &random(5));
        assert_eq!(i2.handle_challenge(body(&ch)), Err(AuthError::BadMac));
        // Nor does a second Proof on a lane that already authenticated.
        assert_eq!(
            r.handle_proof(body(&proof)).unwrap_err(),
            AuthError::OutOfOrder("Proof")
        );
    }

    #[test]
    fn a_tampered_mac_or_hello_is_refused() {
        for flip in [
            /* proof mac */ 0usize, /* hello nics */ 1, /* challenge mac */ 2,
        ] {
            let (mut i, mut hello) = Initiator::connect(&TOKEN, 0, nics(), &random(1));
            let mut r = Responder::default();
            if flip == 1 {
                // An on-path change to the NIC list (the port's low byte).
                let n = hello.len();
                hello[n - 6] ^= 1;
            }
            let mut ch = r
                .handle_hello(body(&hello), token_lookup(TOKEN), &random(2))
                .unwrap();
            if flip == 2 {
                let n = ch.len();
                ch[n - 1] ^= 0x80;
            }
            if flip != 0 {
                // The connector's transcript differs from the listener's: it notices.
                assert_eq!(i.handle_challenge(body(&ch)), Err(AuthError::BadMac));
                continue;
            }
            let mut proof = i.handle_challenge(body(&ch)).unwrap();
            proof[HEADER_LEN + 5] ^= 1;
            assert_eq!(
                r.handle_proof(body(&proof)).map(|_| ()),
                Err(AuthError::BadMac),
                "case {flip}"
            );
        }
    }

    #[test]
    fn probes_and_migrations_need_the_session_not_the_token() {
        let (sender, receiver) = connect(1);
        for purpose in [Purpose::Probe, Purpose::Migrate] {
            // The real sender, on its seventh replacement attempt.
            let (mut i, hello) = Initiator::resume(purpose, &sender, 7, nics(), &random(3));
            let mut r = Responder::default();
            let ch = r
                .handle_hello(body(&hello), session_lookup(&receiver), &random(4))
                .unwrap();
            let proof = i.handle_challenge(body(&ch)).unwrap();
            let a = r.handle_proof(body(&proof)).unwrap();
            assert_eq!((a.purpose, a.comm, a.epoch), (purpose, receiver.id(), 7));
            assert!(a.session.is_none());
            assert_eq!(i.finish().unwrap(), None);

            // A handle holder: right comm id, key from the token.
            let forged = Session {
                id: receiver.id(),
                key: token_key(&TOKEN),
            };
            let (mut i, hello) = Initiator::resume(purpose, &forged, 1, nics(), &random(5));
            let mut r = Responder::default();
            let ch = r
                .handle_hello(body(&hello), session_lookup(&receiver), &random(6))
                .unwrap();
            assert_eq!(i.handle_challenge(body(&ch)), Err(AuthError::BadMac));
            let c = Challenge::decode(body(&ch)).unwrap();
            let th = transcript(body(&hello), &c.nonce, &c.eph);
            let guess = Proof {
                mac: mac(&token_key(&TOKEN), b"connector", &th),
            }
            .encode();
            assert_eq!(r.handle_proof(body(&guess)).unwrap_err(), AuthError::BadMac);

            // A listener that would answer a probe with only a token never serves it.
            let mut r = Responder::default();
            assert_eq!(
                r.handle_hello(body(&hello), |_, _| Some(Secret::Token(TOKEN)), &random(6)),
                Err(AuthError::WrongSecret(purpose))
            );
            // An unknown comm id is refused at the Hello.
            let mut r = Responder::default();
            let (_, other) = connect(20);
            assert_ne!(other.id(), receiver.id());
            assert_eq!(
                r.handle_hello(body(&hello), session_lookup(&other), &random(6))
                    .unwrap_err(),
                AuthError::NotHere(purpose)
            );
        }
    }

    #[test]
    fn out_of_order_frames_and_garbage_are_errors() {
        let mut r = Responder::default();
        assert_eq!(
            r.handle_proof(&[0; 32]).unwrap_err(),
            AuthError::OutOfOrder("Proof")
        );
        let (i, hello) = Initiator::connect(&TOKEN, 0, nics(), &random(1));
        assert_eq!(
            i.finish().unwrap_err(),
            AuthError::OutOfOrder("Welcome before Challenge")
        );
        let mut r = Responder::default();
        assert!(matches!(
            r.handle_hello(&body(&hello)[..40], token_lookup(TOKEN), &random(2)),
            Err(AuthError::Malformed(_))
        ));
        // One Hello per lane, even after a failed one.
        assert_eq!(
            r.handle_hello(body(&hello), token_lookup(TOKEN), &random(2))
                .unwrap_err(),
            AuthError::OutOfOrder("second Hello")
        );
        // A low-order ephemeral key (all zeros) cannot make a session.
        let mut h = Hello::decode(body(&hello)).unwrap();
        h.eph = [0; 32];
        let mut r = Responder::default();
        assert_eq!(
            r.handle_hello(body(&h.encode()), token_lookup(TOKEN), &random(2))
                .unwrap_err(),
            AuthError::WeakKey
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for len in 0..200usize {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let mut r = Responder::default();
            let _ = r.handle_hello(&bytes, token_lookup(TOKEN), &random(1));
            let _ = r.handle_proof(&bytes);
            let (mut i, _) = Initiator::connect(&TOKEN, 0, nics(), &random(2));
            let _ = i.handle_challenge(&bytes);
        }
    }
}
