//! One lane's protocol state, apart from its socket: its handshake, its deadline, and
//! whether it is alive (silence, brown-out, keepalives). No sockets, no clock reads.
//!
//! Call order: the reactor reports what moved with [`LaneMachine::handle_rx`] and
//! [`LaneMachine::handle_tx`], feeds handshake frames to the `handle_*` methods, samples
//! delivery with [`LaneMachine::handle_sample`] and calls
//! [`LaneMachine::handle_timeout`] once [`LaneMachine::poll_timeout`] is due (early or
//! extra calls do nothing). It then moves [`LaneMachine::poll_transmit`]'s control frames
//! onto the lane, in order, before anything else it writes, and fails the lane on
//! [`LaneMachine::poll_failure`]. `now` never goes backwards between calls.

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use super::auth::{Accepted, AuthError, CommId, Initiator, Random, Responder, Secret, Session};
use super::health::{self, Progress, Verdict, MAX_PROBE_DEADLINE};
use super::wire::{self, Header, Kind, NicAddr, Purpose, Welcome};
use super::{ConnError, MemoryUnreachable};
use crate::routing::FailReason;

/// How long a lane that is done may keep flushing its last bytes.
pub const LINGER: Duration = Duration::from_secs(2);

/// How long a lane that is owed an answer (it has data waiting) may stay silent while
/// other lanes of its path (the same local NIC and peer NIC) are heard: the path works,
/// and the lane's own flow is starved by congestion (a TCP flow among hundreds on a link
/// can back off for seconds). Past this it fails anyway, as a lane stuck on a working
/// path. A lane with nothing waiting is not judged by its own silence: thousands of idle
/// lanes share their paths' keepalives (see [`LaneMachine::handle_keeper`]).
pub const CONGESTED_SILENCE: u32 = 8;

/// How many times a handshake that missed its deadline on a path that works is given
/// its time again ([`LaneMachine::extend`]). Behind a congested path's queue (a failover
/// storm on slow or paused links) each leg of a handshake waits as long as the queue:
/// tearing it down and dialling again starts the wait over, and the receiver reads the
/// close as the sender giving up. Bounded, so a handshake that never completes still
/// fails.
pub const HANDSHAKE_PATIENCE: u8 = 8;

/// [`CONGESTED_SILENCE`] completion timeouts.
pub fn congested_limit(timeout: Duration) -> Duration {
    timeout * CONGESTED_SILENCE
}

/// How often a lane's delivery is sampled: a tenth of the completion timeout, within
/// 5–100 ms, so a brown-out is judged within a tenth of the timeout.
pub fn sample_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(5), Duration::from_millis(100))
}

/// How a socket error is classified: a peer that closed or reset the connection is gone
/// (its kernel answered, so the path works); anything else is a path failure.
pub fn io_error(e: &io::Error) -> ConnError {
    let memory = e.get_ref().is_some_and(|i| i.is::<MemoryUnreachable>());
    match e.kind() {
        _ if memory => ConnError::Memory(e.to_string()),
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => ConnError::PeerClosed,
        _ => ConnError::Io(e.to_string()),
    }
}

/// Why a lane fails, and how: the one input of the reactor's `fail_lane`, for real
/// failures and fault injection alike.
#[derive(Debug, Clone, PartialEq)]
pub struct Cause {
    pub error: ConnError,
    pub reason: FailReason,
    /// It browned out: the least rate (bytes/s) a probe of its pair must show from now on.
    pub brownout: Option<f64>,
    /// It fell silent: for how long nothing had been received.
    pub silent: Option<Duration>,
    /// An injected cut: the socket stays open and silent, as a pulled cable leaves it (the
    /// peer must notice by itself), instead of being reset or closed.
    pub cut: bool,
}

impl Cause {
    pub fn new(error: ConnError, reason: FailReason) -> Cause {
        Cause {
            error,
            reason,
            brownout: None,
            silent: None,
            cut: false,
        }
    }

    /// A socket or protocol error, for the reason it implies.
    pub fn error(error: ConnError) -> Cause {
        let reason = match error {
            // A NIC that cannot register the memory is a NIC's error, not a slow path.
            ConnError::Io(_) | ConnError::Memory(_) | ConnError::PeerMemory => FailReason::NicError,
            _ => FailReason::Timeout,
        };
        Cause::new(error, reason)
    }
}

/// A lane's handshake in progress.
#[derive(Debug)]
enum Auth {
    Connector(Initiator),
    Listener(Responder),
}

/// Where a lane is in its life, as far as its frames go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Accepted, waiting for a Hello and then a Proof.
    Listening,
    /// Ours, waiting for the listener's Welcome to a handshake for this purpose.
    Connecting(Purpose),
    /// Answering a probe: its payload crosses before the Welcome.
    ProbeSink,
    /// Carrying a comm.
    Carrying,
    /// Flushing its last bytes; whatever arrives is ignored.
    Closing,
}

/// What an inbound frame or payload asks of the reactor.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing: the machine handled it (a keepalive, a Challenge, a closing lane's rest).
    Handled,
    /// Listener: a Hello; look up the secret it names and call
    /// [`LaneMachine::handle_hello`].
    Hello,
    /// Listener: a Proof; call [`LaneMachine::handle_proof`].
    Proof,
    /// Connector: the listener welcomed the lane and the handshake is complete. `session`:
    /// the one a `Data` handshake agreed; `nics`: the listener's (`Data` only);
    /// `delivered`: what a migration's receiver has.
    Welcomed {
        purpose: Purpose,
        session: Option<Session>,
        nics: Vec<NicAddr>,
        delivered: u64,
        /// The listener's NICs (a bit per index) that cannot register the comm's memory.
        refusing: u32,
    },
    /// Drop this payload unread (a probe's, or one reaching a closing lane).
    Discard,
    /// A probe's payload crossed: send the Welcome; the lane then closes.
    ProbeCrossed,
    /// For the comm's machine.
    Comm,
}

/// What one delivery sample found, for the NIC's fair shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Bytes the peer acknowledged since the previous sample.
    pub moved: u64,
    /// Data waited through the whole interval.
    pub backlogged: bool,
}

/// One lane's protocol machine.
#[derive(Debug)]
pub struct LaneMachine {
    timeout: Duration,
    phase: Phase,
    auth: Option<Auth>,
    /// When an unfinished handshake, probe or linger fails.
    deadline: Option<Instant>,
    /// Times the handshake's deadline was given again ([`HANDSHAKE_PATIENCE`]).
    extended: u8,
    /// Carrying a comm: silence, brown-outs and keepalives are judged.
    carrying: bool,
    last_rx: Instant,
    last_tx: Instant,
    /// When anything last arrived over the lane's path (any lane between the same two
    /// NICs), as the caller reports it.
    path_rx: Option<Instant>,
    /// Whether the path crawled in the last sample, as the caller reports it.
    path_slow: bool,
    /// Brown-out verdicts in a row excused because the path kept up.
    excused: u32,
    /// Bytes waiting (queued or unacknowledged) at the last sample.
    waiting: u64,
    /// Since when samples have found bytes waiting without a break: the lane is owed an
    /// answer, and its own silence counts from here.
    owed_since: Option<Instant>,
    /// It sends its path's keepalives (or, with no path known, its own). One lane per
    /// path does, so idle lanes cost nothing.
    keeper: bool,
    /// Until when it keeps itself alive anyway: a lane that moved data lately sends its
    /// own keepalives for [`congested_limit`] after. On a congested path the keeper may
    /// be a flow stuck in backoff, and the lanes of a collective waiting for its
    /// laggards are idle for a moment, not for good: their keepalives are what the peer
    /// hears of the path then.
    busy_until: Option<Instant>,
    /// Bytes of keepalives it wrote, in all, and the most delivered bytes besides them a
    /// sample has seen: its own keepalives do not make a lane busy.
    keepalive_bytes: u64,
    delivered_data: u64,
    progress: Progress,
    out: VecDeque<Vec<u8>>,
    failed: Option<Cause>,
}

impl LaneMachine {
    /// A lane opened at `now` that must finish its handshake within `limit`; its
    /// completion timeout is `timeout`.
    pub fn new(timeout: Duration, now: Instant, limit: Duration) -> LaneMachine {
        LaneMachine {
            timeout,
            phase: Phase::Listening,
            auth: None,
            deadline: Some(now + limit),
            extended: 0,
            carrying: false,
            last_rx: now,
            last_tx: now,
            path_rx: None,
            path_slow: true,
            excused: 0,
            waiting: 0,
            owed_since: None,
            keeper: true,
            busy_until: None,
            keepalive_bytes: 0,
            delivered_data: 0,
            progress: Progress::new(timeout, sample_interval(timeout)),
            out: VecDeque::new(),
            failed: None,
        }
    }

    /// Our end of a connection: sends `hello`, then proves `auth`'s key.
    pub fn connecting(&mut self, auth: Initiator, hello: Vec<u8>) {
        self.phase = Phase::Connecting(auth.purpose());
        self.auth = Some(Auth::Connector(auth));
        self.out.push_back(hello);
    }

    /// An accepted connection, waiting for its Hello.
    pub fn listening(&mut self) {
        self.phase = Phase::Listening;
        self.auth = Some(Auth::Listener(Responder::default()));
    }

    /// Bytes arrived at `now`.
    pub fn handle_rx(&mut self, now: Instant) {
        self.last_rx = now;
    }

    /// Bytes left at `now`.
    pub fn handle_tx(&mut self, now: Instant) {
        self.last_tx = now;
    }

    /// How long nothing has arrived.
    pub fn silent(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_rx)
    }

    /// Bytes arrived over the lane's path at `at` (on this lane or another between the
    /// same two NICs). A silent lane on a path that is heard is congested, not cut: it
    /// fails only after [`congested_limit`].
    pub fn handle_path_rx(&mut self, at: Instant) {
        self.path_rx = self.path_rx.max(Some(at));
    }

    /// Whether this lane sends its path's keepalives (the default: a lane whose path is
    /// not known keeps itself alive). The caller picks one lane per path; the others rely
    /// on it, as their peers rely on its peer's.
    pub fn handle_keeper(&mut self, keeper: bool) {
        self.keeper = keeper;
    }

    /// When the lane or its path was last heard.
    fn heard(&self) -> Instant {
        self.path_rx.map_or(self.last_rx, |p| p.max(self.last_rx))
    }

    /// A frame arrived (handshake frames with their `body`). `probe_bytes`: a probe's
    /// payload size. `Err`: the peer broke the protocol; the lane must fail.
    pub fn handle_frame(
        &mut self,
        h: &Header,
        body: &[u8],
        probe_bytes: usize,
    ) -> Result<Step, ConnError> {
        let unexpected = |what: &str| Err(ConnError::Protocol(what.into()));
        match (h.kind, self.phase) {
            (Kind::Keepalive, _) => Ok(Step::Handled),
            (Kind::Challenge, phase) => {
                let probe = phase == Phase::Connecting(Purpose::Probe);
                self.handle_challenge(body, probe.then_some(probe_bytes))?;
                Ok(Step::Handled)
            }
            (Kind::Proof, Phase::Listening) => Ok(Step::Proof),
            (Kind::Proof, _) => unexpected("unexpected Proof"),
            (Kind::Hello, Phase::Listening) => Ok(Step::Hello),
            (Kind::Welcome, Phase::Connecting(purpose)) => {
                let nics = match purpose {
                    Purpose::Data => {
                        Welcome::decode(body)
                            .map_err(|e| ConnError::Protocol(e.to_string()))?
                            .nics
                    }
                    _ => Vec::new(),
                };
                let session = self.handle_welcome()?;
                Ok(Step::Welcomed {
                    purpose,
                    session,
                    nics,
                    delivered: h.seq,
                    refusing: h.aux,
                })
            }
            (Kind::Refuse, Phase::Connecting(Purpose::Data)) => {
                unexpected("the listener refused the handshake (wrong comm token?)")
            }
            (Kind::Refuse, Phase::Connecting(Purpose::Migrate)) if h.aux == wire::REFUSE_GONE => {
                Err(ConnError::Gone(
                    "it refused the replacement lane: the comm failed or was closed there".into(),
                ))
            }
            (Kind::Refuse, Phase::Connecting(Purpose::Migrate)) => {
                unexpected("the peer refused the replacement lane")
            }
            (_, Phase::Carrying) => Ok(Step::Comm),
            (_, Phase::Closing) => Ok(Step::Handled),
            _ => unexpected(self.expected()),
        }
    }

    /// What a lane in its phase waits for, for the error when something else comes.
    fn expected(&self) -> &'static str {
        match self.phase {
            Phase::Listening => "expected Hello",
            Phase::Connecting(Purpose::Data) => "expected Welcome",
            Phase::Connecting(Purpose::Probe) => "expected Welcome to a probe",
            Phase::Connecting(Purpose::Migrate) => "expected Welcome to a migration",
            Phase::ProbeSink => "expected a probe payload",
            Phase::Carrying | Phase::Closing => "nothing in particular",
        }
    }

    /// A payload's header (`done` false: place it) or its end (`done` true) arrived.
    pub fn handle_payload(&mut self, done: bool, now: Instant) -> Result<Step, ConnError> {
        match (self.phase, done) {
            (Phase::Carrying, _) => Ok(Step::Comm),
            (Phase::Closing, false) | (Phase::ProbeSink, false) => Ok(Step::Discard),
            (Phase::Closing, true) => Ok(Step::Handled),
            (Phase::ProbeSink, true) => {
                self.linger(now);
                Ok(Step::ProbeCrossed)
            }
            (Phase::Listening | Phase::Connecting(_), _) => {
                Err(ConnError::Protocol(self.expected().into()))
            }
        }
    }

    /// Listener: a Hello. `secret` gives the key its purpose calls for. `Err` means the
    /// lane is not listening; a Hello that fails to authenticate is refused (`Ok(Some)`).
    pub fn handle_hello(
        &mut self,
        body: &[u8],
        secret: impl FnOnce(Purpose, CommId) -> Option<Secret>,
        random: &Random,
        now: Instant,
    ) -> Result<Option<AuthError>, ConnError> {
        let Some(Auth::Listener(r)) = self.auth.as_mut() else {
            return Err(ConnError::Protocol(
                "Hello on a lane that is not listening".into(),
            ));
        };
        match r.handle_hello(body, secret, random) {
            Ok(challenge) => {
                self.out.push_back(challenge);
                Ok(None)
            }
            Err(e) => {
                self.refuse(&e, now);
                Ok(Some(e))
            }
        }
    }

    /// Listener: the connector's Proof. `Ok(Ok)`: authenticated; `Ok(Err)`: refused.
    pub fn handle_proof(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<Result<Accepted, AuthError>, ConnError> {
        let Some(Auth::Listener(r)) = self.auth.as_mut() else {
            return Err(ConnError::Protocol("unexpected Proof".into()));
        };
        let accepted = r.handle_proof(body);
        match &accepted {
            // Answered once the probe's payload, sent after the Proof, has crossed the
            // path: a pair that connects but cannot move data is not healthy. The
            // prober's own deadline decides; this one only bounds a prober that stops,
            // and is later than the pre-authentication one it replaces.
            Ok(a) if a.purpose == Purpose::Probe => {
                self.phase = Phase::ProbeSink;
                self.expect_by(now + MAX_PROBE_DEADLINE + LINGER);
            }
            Ok(_) => {}
            Err(e) => self.refuse(e, now),
        }
        if accepted.is_ok() {
            self.auth = None;
        }
        Ok(accepted)
    }

    /// Connector: the listener's Challenge; the Proof follows, then a probe's
    /// `probe_bytes` of payload. The listener reads that payload only once authenticated,
    /// so the probe's own deadline, not the short pre-authentication one, judges it.
    fn handle_challenge(
        &mut self,
        body: &[u8],
        probe_bytes: Option<usize>,
    ) -> Result<(), ConnError> {
        let Some(Auth::Connector(a)) = self.auth.as_mut() else {
            return Err(ConnError::Protocol("unexpected Challenge".into()));
        };
        let proof = a.handle_challenge(body).map_err(|e| {
            ConnError::Protocol(format!("the listener failed to authenticate: {e}"))
        })?;
        self.out.push_back(proof);
        if let Some(n) = probe_bytes {
            self.out
                .push_back(Header::new(Kind::Data, 0, n as u64).encode().to_vec());
            self.out.push_back(vec![0u8; n]);
        }
        Ok(())
    }

    /// Connector: a Welcome arrived, so the handshake must be complete. Returns the
    /// session a `Data` handshake agreed.
    fn handle_welcome(&mut self) -> Result<Option<Session>, ConnError> {
        match self.auth.take() {
            Some(Auth::Connector(a)) => a.finish().map_err(|e| ConnError::Protocol(e.to_string())),
            _ => Err(ConnError::Protocol(
                "Welcome on a lane that did not authenticate".into(),
            )),
        }
    }

    /// Turns the lane away: a Refuse, then it lingers until closed. A replacement lane
    /// for a comm we no longer have is told so, so its sender stops trying.
    pub fn refuse(&mut self, why: &AuthError, now: Instant) {
        self.auth = None;
        let mut h = Header::new(Kind::Refuse, 0, 0);
        h.aux = match why {
            AuthError::NotHere(Purpose::Migrate) => wire::REFUSE_GONE,
            _ => wire::REFUSE_AUTH,
        };
        self.out.push_back(h.encode().to_vec());
        self.linger(now);
    }

    /// Listener: the Hello named a secret of ours and our Challenge went out; the Proof
    /// is awaited.
    pub fn awaits_proof(&self) -> bool {
        self.phase == Phase::Listening
            && matches!(&self.auth, Some(Auth::Listener(r)) if r.purpose().is_some())
    }

    /// Whether what is due at `now` is the handshake, probe or linger deadline (not the
    /// judgement of a carrying lane's silence).
    pub fn deadline_due(&self, now: Instant) -> bool {
        self.failed.is_none() && self.deadline.is_some_and(|d| d <= now)
    }

    /// The deadline due now is given again, until `deadline`: the caller saw that the
    /// other end is there and busy. At most [`HANDSHAKE_PATIENCE`] times; returns how many
    /// so far, or `None` once patience ran out (the deadline then stands).
    pub fn extend(&mut self, deadline: Instant) -> Option<u8> {
        if self.extended >= HANDSHAKE_PATIENCE {
            return None;
        }
        self.extended += 1;
        self.deadline = Some(deadline);
        Some(self.extended)
    }

    /// Fails unless done by `deadline`.
    pub fn expect_by(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
        self.carrying = false;
    }

    /// Done: it may flush its last bytes for [`LINGER`].
    pub fn linger(&mut self, now: Instant) {
        self.phase = Phase::Closing;
        self.expect_by(now + LINGER);
    }

    /// It now carries a comm: no deadline, but silence and brown-outs are judged.
    pub fn carry(&mut self) {
        self.phase = Phase::Carrying;
        self.deadline = None;
        self.carrying = true;
    }

    /// One delivery sample: the peer has acknowledged `delivered` bytes in all, and
    /// `waiting` bytes are queued or unacknowledged. A lane that stayed backlogged far
    /// below its own best rate for the whole completion timeout has browned out.
    pub fn handle_sample(&mut self, now: Instant, delivered: u64, waiting: u64) -> Sample {
        let moved = delivered.saturating_sub(self.progress.last_total());
        let backlogged = health::backlogged(self.waiting, moved, waiting);
        self.waiting = waiting;
        self.owed_since = (waiting > 0).then(|| self.owed_since.unwrap_or(now));
        // Busy: it delivered more than its keepalives, or more than one waits.
        let data = delivered.saturating_sub(self.keepalive_bytes);
        let moved_data = data.saturating_sub(self.delivered_data);
        self.delivered_data = self.delivered_data.max(data);
        if moved_data > 0 || waiting > wire::HEADER_LEN as u64 {
            self.busy_until = Some(now + congested_limit(self.timeout));
        }
        if !self.carrying {
            return Sample { moved, backlogged };
        }
        match self.progress.observe(now, delivered, backlogged) {
            // Its path as a whole keeps up: this lane's flow is starved by congestion,
            // which moving it would not cure. Excused for a while.
            Verdict::Slow { .. } if !self.path_slow && self.excused < CONGESTED_SILENCE => {
                self.excused += 1;
            }
            Verdict::Slow { rate, peak } => {
                let e = ConnError::Stalled(format!(
                    "brown-out: delivering {:.0} kB/s with data waiting, against {:.0} kB/s before{}",
                    rate / 1e3,
                    peak / 1e3,
                    if self.path_slow { "" } else { ", while its path kept up" }
                ));
                self.fail(Cause {
                    brownout: Some(health::recovery_floor(peak)),
                    ..Cause::new(e, FailReason::Timeout)
                });
            }
            Verdict::Fine if !self.progress.is_slow() => self.excused = 0,
            Verdict::Fine => {}
        }
        Sample { moved, backlogged }
    }

    /// Whether the lane's path as a whole (every lane between the same two NICs) crawled
    /// in the last sample, with data waiting. A lane browning out on a path that keeps up
    /// is congested, not failing: it fails only after [`CONGESTED_SILENCE`] verdicts in a
    /// row. Without this report a lane is judged alone.
    pub fn handle_path_slow(&mut self, slow: bool) {
        self.path_slow = slow;
    }

    fn keepalive(&self) -> Duration {
        self.timeout / 4
    }

    /// What an expired deadline was waiting for, for the log: a handshake dropped by
    /// its deadline says how far it got.
    fn overdue(&self) -> &'static str {
        match (&self.phase, &self.auth) {
            (Phase::Listening, Some(Auth::Listener(_))) => "no Proof after our Challenge",
            (Phase::Listening, _) => "no Hello",
            (Phase::Connecting(Purpose::Probe), _) => "the probe was not answered",
            (Phase::Connecting(_), _) => "no Welcome from the listener",
            (Phase::ProbeSink, _) => "the probe's payload did not cross",
            (Phase::Closing, _) => "the close did not finish",
            (Phase::Carrying, _) => "the lane's deadline passed",
        }
    }

    /// When [`LaneMachine::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failed.is_some() {
            return None;
        }
        let live = self.carrying.then(|| {
            let silence = self.heard() + self.timeout;
            let owed = self.owed_from().map(|t| t + congested_limit(self.timeout));
            let keepalive = Some(self.last_tx + self.keepalive()).filter(|&t| self.keeps_alive(t));
            [Some(silence), owed, keepalive].into_iter().flatten().min()
        });
        [self.deadline, live.flatten()].into_iter().flatten().min()
    }

    /// Whether it sends keepalives at `at`: its path's keeper, or busy lately.
    fn keeps_alive(&self, at: Instant) -> bool {
        self.keeper || self.busy_until.is_some_and(|b| at < b)
    }

    /// Since when the lane has been owed an answer and heard nothing: the later of its
    /// last bytes in and the first sample that found its data waiting.
    fn owed_from(&self) -> Option<Instant> {
        self.owed_since.map(|t| t.max(self.last_rx))
    }

    /// Whether [`LaneMachine::handle_timeout`] at `now` would fail the lane for silence,
    /// as things stand: the caller may first read what its sockets hold, so that a
    /// reactor that fell behind does not take unread bytes for a dead path.
    pub fn silent_past_limit(&self, now: Instant) -> bool {
        self.carrying
            && self.failed.is_none()
            && (now.saturating_duration_since(self.heard()) >= self.timeout
                || self.owed_from().is_some_and(|t| {
                    now.saturating_duration_since(t) >= congested_limit(self.timeout)
                }))
    }

    /// Fails an overdue handshake, probe or linger; fails a lane whose path heard nothing
    /// for the completion timeout, or that was owed an answer and heard none for
    /// [`congested_limit`] while its path was heard; the path's keeper, and a lane busy
    /// lately, sends a keepalive after a quarter of the timeout without traffic.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.failed.is_some() {
            return;
        }
        if self.deadline.is_some_and(|d| d <= now) {
            self.deadline = None;
            let e = ConnError::Io(format!("timed out: {}", self.overdue()));
            self.fail(Cause::new(e, FailReason::Timeout));
            return;
        }
        if !self.carrying {
            return;
        }
        let silent = self.silent(now);
        let path_silent = now.saturating_duration_since(self.heard());
        let owed_silent = self
            .owed_from()
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        if path_silent >= self.timeout || owed_silent >= congested_limit(self.timeout) {
            let e = ConnError::Stalled(match path_silent < self.timeout {
                true => format!(
                    "nothing received for {} ms with data waiting, while its path was heard",
                    owed_silent.as_millis()
                ),
                false => format!("nothing received for {} ms", silent.as_millis()),
            });
            self.fail(Cause {
                silent: Some(silent),
                ..Cause::new(e, FailReason::Timeout)
            });
            return;
        }
        // Judged at the keepalive's deadline, as `poll_timeout` was: a lane whose busy
        // window closed between the deadline and now still owes that keepalive (else the
        // deadline would stay in the past and come up again at once).
        let due = self.last_tx + self.keepalive();
        if due <= now && self.keeps_alive(due) && self.out.is_empty() {
            self.out
                .push_back(Header::new(Kind::Keepalive, 0, 0).encode().to_vec());
            self.keepalive_bytes += wire::HEADER_LEN as u64;
            self.last_tx = now;
        }
    }

    fn fail(&mut self, cause: Cause) {
        self.carrying = false;
        self.failed.get_or_insert(cause);
    }

    /// The next control frame to write, in order.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        self.out.pop_front()
    }

    /// Why the lane must be failed, once.
    #[must_use]
    pub fn poll_failure(&mut self) -> Option<Cause> {
        self.failed.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const TIMEOUT: Duration = Duration::from_millis(1000);

    /// A lane carrying a comm since `t0`.
    fn carrying(t0: Instant) -> LaneMachine {
        let mut m = LaneMachine::new(TIMEOUT, t0, Duration::from_secs(30));
        m.carry();
        m
    }

    fn kinds(m: &mut LaneMachine) -> Vec<Kind> {
        std::iter::from_fn(|| m.poll_transmit())
            .map(|f| wire::Header::decode(&f).unwrap().kind)
            .collect()
    }

    #[test]
    fn silence_fails_the_lane_at_the_timeout_not_a_millisecond_before() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        m.handle_rx(t0 + 100 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 250 * MS), "the keepalive first");
        m.handle_timeout(t0 + 1099 * MS);
        assert_eq!(m.poll_failure(), None);
        assert_eq!(kinds(&mut m), [Kind::Keepalive]);
        m.handle_tx(t0 + 1099 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 1100 * MS));
        m.handle_timeout(t0 + 1100 * MS);
        let cause = m.poll_failure().expect("silent for the timeout");
        assert_eq!(cause.reason, FailReason::Timeout);
        assert_eq!(cause.silent, Some(TIMEOUT));
        assert!(matches!(cause.error, ConnError::Stalled(_)), "{cause:?}");
        // Once: a failed lane is judged no more.
        m.handle_timeout(t0 + 5000 * MS);
        assert_eq!((m.poll_failure(), m.poll_timeout()), (None, None));
    }

    #[test]
    fn a_silent_lane_on_a_path_still_heard_is_congested_not_cut() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        // It has data waiting from the start; its neighbours on the same path keep being
        // heard, the lane itself is not.
        m.handle_sample(t0, 0, 4096);
        let mut now = t0;
        while now < t0 + congested_limit(TIMEOUT) - 50 * MS {
            now += 50 * MS;
            m.handle_path_rx(now);
            m.handle_timeout(now);
            assert_eq!(m.poll_failure(), None, "failed at {:?}", now - t0);
            let _ = kinds(&mut m);
            m.handle_tx(now);
        }
        // Stuck on a working path past the limit: it fails, and says so.
        m.handle_path_rx(t0 + congested_limit(TIMEOUT));
        assert_eq!(m.poll_timeout(), Some(t0 + congested_limit(TIMEOUT)));
        m.handle_timeout(t0 + congested_limit(TIMEOUT));
        let cause = m.poll_failure().expect("stuck past the limit");
        assert_eq!(cause.silent, Some(congested_limit(TIMEOUT)));
        assert!(
            cause.error.to_string().contains("while its path was heard"),
            "{cause:?}"
        );

        // When the path falls silent too, the lane fails at the timeout as before.
        let mut m = carrying(t0);
        m.handle_path_rx(t0 + 300 * MS);
        m.handle_timeout(t0 + 1299 * MS);
        assert_eq!(m.poll_failure(), None, "the path was heard 999 ms ago");
        let _ = kinds(&mut m);
        m.handle_tx(t0 + 1299 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 1300 * MS));
        m.handle_timeout(t0 + 1300 * MS);
        let cause = m
            .poll_failure()
            .expect("the path is silent for the timeout");
        assert_eq!(cause.silent, Some(1300 * MS));
        assert!(
            !cause.error.to_string().contains("path was heard"),
            "{cause:?}"
        );
    }

    #[test]
    fn an_idle_lane_relies_on_its_paths_keeper_and_is_judged_once_owed() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        m.handle_keeper(false);
        // Nothing waiting, nothing heard on the lane itself, its path heard through its
        // keeper: neither a keepalive nor a verdict, for far longer than any limit, and
        // looked at once per timeout, not per keepalive.
        let mut now = t0;
        let mut looks = 0;
        while now < t0 + 3 * congested_limit(TIMEOUT) {
            now = m.poll_timeout().expect("a carrying lane has a deadline");
            looks += 1;
            m.handle_path_rx(now - 100 * MS);
            m.handle_timeout(now);
            assert_eq!(m.poll_failure(), None, "failed at {:?}", now - t0);
            assert!(
                kinds(&mut m).is_empty(),
                "a keepalive from a lane that is not the keeper"
            );
        }
        assert!(looks <= 3 * 8 * 2, "{looks} looks in 24 timeouts");
        // Data waits from here on and nothing comes back: stuck on a working path, it
        // fails a congested limit later, not at once for its long idle silence.
        let owed = now;
        m.handle_sample(owed, 0, 4096);
        m.handle_path_rx(owed + TIMEOUT - MS);
        m.handle_timeout(owed + TIMEOUT);
        assert_eq!(m.poll_failure(), None);
        m.handle_path_rx(owed + congested_limit(TIMEOUT) - MS);
        m.handle_timeout(owed + congested_limit(TIMEOUT) - MS);
        assert_eq!(m.poll_failure(), None);
        m.handle_timeout(owed + congested_limit(TIMEOUT));
        let cause = m.poll_failure().expect("owed an answer past the limit");
        assert!(
            cause.error.to_string().contains("with data waiting"),
            "{cause:?}"
        );

        // Its path falling silent fails it at the timeout, keeper or not.
        let mut m = carrying(t0);
        m.handle_keeper(false);
        m.handle_path_rx(t0 + 500 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 1500 * MS));
        m.handle_timeout(t0 + 1500 * MS);
        assert!(
            m.poll_failure().is_some(),
            "its path was silent for the timeout"
        );

        // Made the keeper again (the old one left), it sends the path's keepalives.
        let mut m = carrying(t0);
        m.handle_keeper(false);
        m.handle_path_rx(t0 + 200 * MS);
        m.handle_timeout(t0 + 300 * MS);
        assert!(kinds(&mut m).is_empty());
        m.handle_keeper(true);
        assert_eq!(m.poll_timeout(), Some(t0 + 250 * MS), "overdue: at once");
        m.handle_timeout(t0 + 300 * MS);
        assert_eq!(kinds(&mut m), [Kind::Keepalive]);
    }

    #[test]
    fn a_lane_busy_lately_keeps_itself_alive_for_a_while_then_leaves_it_to_the_keeper() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        m.handle_keeper(false);
        // It moved data at t0 and has nothing waiting since.
        m.handle_sample(t0, 4096, 0);
        let mut now = t0;
        let mut sent = Vec::new();
        while now < t0 + 2 * congested_limit(TIMEOUT) {
            now += 50 * MS;
            m.handle_path_rx(now);
            m.handle_timeout(now);
            assert_eq!(m.poll_failure(), None);
            if !kinds(&mut m).is_empty() {
                m.handle_tx(now);
                sent.push(now - t0);
            }
        }
        assert_eq!(
            sent.len(),
            31,
            "every quarter timeout while busy lately: {sent:?}"
        );
        assert!(
            sent.iter().all(|&t| t < congested_limit(TIMEOUT)),
            "{sent:?}"
        );

        // Its own keepalives, delivered and sampled, do not keep it busy.
        let mut m = carrying(t0);
        m.handle_keeper(false);
        m.handle_sample(t0, 4096, 0);
        let (mut now, mut delivered, mut last) = (t0, 4096u64, t0);
        while now < t0 + 3 * congested_limit(TIMEOUT) {
            now += 100 * MS;
            m.handle_path_rx(now);
            m.handle_timeout(now);
            for _ in kinds(&mut m) {
                m.handle_tx(now);
                // In flight at this sample, delivered by the next.
                m.handle_sample(now, delivered, wire::HEADER_LEN as u64);
                delivered += wire::HEADER_LEN as u64;
                last = now;
            }
            m.handle_sample(now, delivered, 0);
        }
        assert!(
            last < t0 + congested_limit(TIMEOUT),
            "keepalives kept it busy: the last at {:?}",
            last - t0
        );
    }

    #[test]
    fn a_keepalive_due_before_the_busy_window_closed_is_sent_when_looked_at_after() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        m.handle_keeper(false);
        m.handle_sample(t0, 4096, 0);
        m.handle_path_rx(t0);
        // Busy until t0 + 8 s. The last write was at 7.9 s, so a keepalive is due at
        // 8.15 s, when the lane no longer keeps itself alive, and none is armed.
        m.handle_tx(t0 + 7900 * MS);
        m.handle_path_rx(t0 + 7900 * MS);
        assert_eq!(
            m.poll_timeout(),
            Some(t0 + 8900 * MS),
            "only the path's silence"
        );
        // Written at 7.7 s instead: due at 7.95 s, within the window, but looked at late
        // (a busy reactor), at 8.1 s. It goes out, and the deadline moves on.
        let mut m = carrying(t0);
        m.handle_keeper(false);
        m.handle_sample(t0, 4096, 0);
        m.handle_tx(t0 + 7700 * MS);
        m.handle_path_rx(t0 + 7700 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 7950 * MS));
        m.handle_timeout(t0 + 8100 * MS);
        assert_eq!(kinds(&mut m), [Kind::Keepalive]);
        assert!(
            m.poll_timeout().unwrap() > t0 + 8100 * MS,
            "not due again at once"
        );
    }

    #[test]
    fn keepalives_keep_a_slow_transfer_alive() {
        let t0 = Instant::now();
        let (mut a, mut b) = (carrying(t0), carrying(t0));
        // One side is stuck behind a long transfer and hears nothing but keepalives; the
        // other writes nothing but keepalives. Ten timeouts pass without a verdict.
        let mut now = t0;
        let mut sent = 0;
        while now < t0 + 10 * TIMEOUT {
            now += 50 * MS;
            a.handle_timeout(now);
            for k in kinds(&mut a) {
                assert_eq!(k, Kind::Keepalive);
                a.handle_tx(now);
                b.handle_rx(now);
                sent += 1;
            }
            a.handle_rx(now); // a hears b's data
            b.handle_timeout(now);
            b.handle_tx(now); // b's own data keeps leaving
            assert_eq!(b.poll_failure(), None, "at {:?}", now - t0);
            assert!(kinds(&mut b).is_empty(), "b sends data, needs no keepalive");
        }
        assert_eq!(sent, 40, "one keepalive per quarter timeout");
        assert_eq!(a.poll_failure(), None);
    }

    #[test]
    fn a_brown_out_is_judged_through_the_lane_on_the_health_rule() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        let step = sample_interval(TIMEOUT);
        assert_eq!(step, 100 * MS);
        let (mut now, mut delivered) = (t0, 0u64);
        let mut sample = |m: &mut LaneMachine, now: &mut Instant, bytes: u64, waiting: u64| {
            *now += step;
            delivered += bytes;
            m.handle_rx(*now);
            m.handle_tx(*now);
            m.handle_timeout(*now);
            m.handle_sample(*now, delivered, waiting)
        };
        // 30 MB/s with 8 MB always waiting.
        for i in 0..5 {
            let s = sample(&mut m, &mut now, 3_000_000, 8 << 20);
            assert_eq!(s.backlogged, i > 0, "nothing waited before the first");
        }
        // Then 1 % of that, still backlogged: slow for a whole timeout (ten samples)
        // before the verdict, not one sample earlier.
        for i in 0..9 {
            let s = sample(&mut m, &mut now, 30_000, 8 << 20);
            assert_eq!(s.moved, 30_000);
            assert_eq!(m.poll_failure(), None, "sample {i}");
        }
        sample(&mut m, &mut now, 30_000, 8 << 20);
        let cause = m.poll_failure().expect("browned out");
        let floor = cause.brownout.expect("a recovery floor");
        assert!(
            (floor - health::recovery_floor(30e6)).abs() < 1.0,
            "{floor}"
        );
        assert_eq!(cause.silent, None);
    }

    #[test]
    fn a_lane_crawling_on_a_path_that_keeps_up_is_excused_for_a_while() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        let step = 100 * MS;
        let (mut now, mut delivered) = (t0, 0u64);
        let mut sample = |m: &mut LaneMachine, bytes: u64, path_slow: bool| {
            now += step;
            delivered += bytes;
            m.handle_rx(now);
            m.handle_tx(now);
            m.handle_timeout(now);
            m.handle_path_slow(path_slow);
            m.handle_sample(now, delivered, 8 << 20)
        };
        for _ in 0..5 {
            sample(&mut m, 3_000_000, false);
        }
        // It crawls at 1 % while its neighbours on the path keep the path busy: each
        // whole timeout of crawling is one verdict, excused up to the limit.
        for i in 0..10 * CONGESTED_SILENCE {
            sample(&mut m, 30_000, false);
            assert_eq!(m.poll_failure(), None, "sample {i}");
        }
        // The next verdict fails it anyway: stuck on a working path.
        for _ in 0..10 {
            sample(&mut m, 30_000, false);
        }
        let cause = m.poll_failure().expect("excused no more");
        assert!(
            cause.error.to_string().contains("while its path kept up"),
            "{cause:?}"
        );

        // When the path crawls too, the first verdict stands.
        let mut m = carrying(t0);
        let (mut now, mut delivered) = (t0, 0u64);
        let mut sample = |m: &mut LaneMachine, bytes: u64, path_slow: bool| {
            now += step;
            delivered += bytes;
            m.handle_rx(now);
            m.handle_path_slow(path_slow);
            m.handle_sample(now, delivered, 8 << 20)
        };
        for _ in 0..5 {
            sample(&mut m, 3_000_000, false);
        }
        for _ in 0..9 {
            sample(&mut m, 30_000, true);
        }
        assert_eq!(m.poll_failure(), None);
        sample(&mut m, 30_000, true);
        assert!(m.poll_failure().is_some(), "the path browned out with it");
    }

    #[test]
    fn a_slow_steady_or_latency_bound_lane_is_not_browned_out() {
        let t0 = Instant::now();
        let mut m = carrying(t0);
        let mut delivered = 0;
        for i in 1..=100u32 {
            let now = t0 + 100 * MS * i;
            m.handle_rx(now);
            // Steady 0.5 MB/s, backlogged: never slower than itself; then a small
            // message in flight at every sample that moves far more than ever waits.
            delivered += if i <= 50 { 50_000 } else { 400_000 };
            let waiting = if i <= 50 { 1 << 20 } else { 24 };
            m.handle_sample(now, delivered, waiting);
            m.handle_timeout(now);
            assert_eq!(m.poll_failure(), None, "sample {i}");
        }
    }

    #[test]
    fn a_handshake_fails_at_its_deadline_and_a_carrying_lane_has_none() {
        let t0 = Instant::now();
        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 2000 * MS));
        m.handle_timeout(t0 + 1999 * MS);
        assert_eq!(
            m.poll_failure(),
            None,
            "no silence verdict before it carries"
        );
        m.handle_timeout(t0 + 2000 * MS);
        let c = m.poll_failure().expect("the handshake is overdue");
        assert_eq!(c.reason, FailReason::Timeout);
        // The log says how far the handshake got.
        assert!(c.error.to_string().contains("no Hello"), "{}", c.error);

        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        m.handle_rx(t0 + 1500 * MS);
        m.carry();
        m.handle_timeout(t0 + 2000 * MS);
        assert_eq!(m.poll_failure(), None, "the handshake deadline is gone");
        m.linger(t0 + 2100 * MS);
        assert_eq!(m.poll_timeout(), Some(t0 + 2100 * MS + LINGER));
    }

    #[test]
    fn a_listener_awaits_a_proof_only_once_a_hello_named_a_secret_of_ours() {
        let t0 = Instant::now();
        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        m.listening();
        assert!(!m.awaits_proof(), "no Hello yet");
        assert!(!m.deadline_due(t0 + 1999 * MS));
        assert!(m.deadline_due(t0 + 2000 * MS));
        let (_, hello) = Initiator::connect(&[1; 16], 0, Vec::new(), &[2; 64]);
        let body = &hello[wire::HEADER_LEN..];
        let refused = m
            .handle_hello(body, |_, _| Some(Secret::Token([1; 16])), &[3; 64], t0)
            .unwrap();
        assert_eq!(refused, None);
        assert!(m.awaits_proof());
        // Given its time again a bounded number of times, then no more.
        for n in 1..=HANDSHAKE_PATIENCE {
            assert_eq!(m.extend(t0 + u32::from(n) * 4000 * MS), Some(n));
        }
        let last = t0 + u32::from(HANDSHAKE_PATIENCE) * 4000 * MS;
        assert_eq!(m.extend(last + 4000 * MS), None);
        assert!(!m.deadline_due(last - MS));
        assert!(m.deadline_due(last), "the last deadline given stands");
        // A Hello that names nothing of ours is refused: no Proof is awaited.
        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        m.listening();
        assert!(m
            .handle_hello(body, |_, _| None, &[3; 64], t0)
            .unwrap()
            .is_some());
        assert!(!m.awaits_proof());
    }

    #[test]
    fn a_refusal_is_a_refuse_frame_and_a_linger() {
        let t0 = Instant::now();
        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        m.listening();
        let refused = m
            .handle_hello(b"garbage", |_, _| None, &[0; 64], t0)
            .unwrap();
        assert!(refused.is_some());
        assert_eq!(kinds(&mut m), [Kind::Refuse]);
        assert_eq!(m.poll_timeout(), Some(t0 + LINGER));
        // Nothing more is accepted on it, but what still arrives is drained.
        assert!(m.handle_proof(b"", t0).is_err());
        let frame = |kind| Header::new(kind, 0, 0);
        assert!(m.handle_frame(&frame(Kind::Challenge), b"", 0).is_err());
        assert!(m.handle_frame(&frame(Kind::Proof), b"", 0).is_err());
        assert_eq!(m.handle_frame(&frame(Kind::Ack), b"", 0), Ok(Step::Handled));
        assert_eq!(m.handle_payload(false, t0), Ok(Step::Discard));
    }

    #[test]
    fn each_phase_takes_only_its_frames() {
        let t0 = Instant::now();
        let frame = |kind| Header::new(kind, 0, 0);
        let mut m = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        m.listening();
        assert_eq!(
            m.handle_frame(&frame(Kind::Keepalive), b"", 0),
            Ok(Step::Handled)
        );
        assert_eq!(m.handle_frame(&frame(Kind::Hello), b"", 0), Ok(Step::Hello));
        assert!(m.handle_frame(&frame(Kind::Data), b"", 0).is_err());
        assert!(m.handle_payload(true, t0).is_err());
        // A connector welcomed before it was challenged has not authenticated.
        let (auth, hello) = Initiator::connect(&[1; 16], 0, Vec::new(), &[2; 64]);
        let mut c = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        c.connecting(auth, hello);
        assert_eq!(kinds(&mut c), [Kind::Hello]);
        let welcome = Welcome { nics: Vec::new() }.encode(0);
        let h = Header::decode(&welcome).unwrap();
        assert!(c.handle_frame(&h, &welcome[wire::HEADER_LEN..], 0).is_err());
        let refuse = frame(Kind::Refuse);
        let mut c = LaneMachine::new(TIMEOUT, t0, 2000 * MS);
        let (auth, hello) = Initiator::connect(&[1; 16], 0, Vec::new(), &[2; 64]);
        c.connecting(auth, hello);
        assert!(c.handle_frame(&refuse, b"", 0).is_err());
        // A carrying lane hands everything but keepalives to its comm.
        c.carry();
        assert_eq!(c.handle_frame(&frame(Kind::Ack), b"", 0), Ok(Step::Comm));
        assert_eq!(c.handle_payload(true, t0), Ok(Step::Comm));
    }

    #[test]
    fn socket_errors_are_classified_by_who_answered() {
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(io_error(&reset), ConnError::PeerClosed);
        let down = io::Error::from(io::ErrorKind::TimedOut);
        let c = Cause::error(io_error(&down));
        assert_eq!(c.reason, FailReason::NicError);
        assert_eq!(
            Cause::error(ConnError::PeerClosed).reason,
            FailReason::Timeout
        );
        let gpu = io::Error::other(MemoryUnreachable("GPU memory: rxe1 refuses".into()));
        let c = Cause::error(io_error(&gpu));
        assert!(matches!(c.error, ConnError::Memory(_)), "{:?}", c.error);
        assert_eq!(c.reason, FailReason::NicError, "a NIC's refusal");
        assert_eq!(
            Cause::error(ConnError::PeerMemory).reason,
            FailReason::NicError
        );
    }
}
