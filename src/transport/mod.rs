//! Fabric-specific code behind one seam, the [`Fabric`] trait: what the reactor needs
//! from a fabric to open lanes and move frames over them. No fabric decides policy; the
//! reactor names no fabric's types and makes no fabric's system calls.
//!
//! Two fabrics implement it: [`tcp`], where a NIC is a network interface and a lane is
//! one TCP stream between a local and a remote interface, and [`verbs`], where a NIC is
//! an RDMA port and a lane an RC QP with its completion channel.
//!
//! Fabric-neutral pieces live here too: the frame codec every lane speaks ([`frames`]),
//! the even sharing of a NIC between its busy lanes ([`fair`]), and the kernel's link
//! events ([`netlink`]; RoCE ports are netdevs as well).

/// Connections the kernel holds for a listener until the reactor accepts them: the
/// reactor accepts at the pace handshakes complete (see `engine::gate`), and a job's
/// all-to-all connects thousands at once. The kernel caps it at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: i32 = 4096;

pub mod fair;
pub mod frames;
pub mod memory;
pub mod netlink;
pub mod offers;
pub mod tcp;
pub mod verbs;

use std::fmt::Debug;
use std::io;
use std::net::{IpAddr, SocketAddr};

use frames::{FrameReader, FrameWriter, Inbound, ReadError};

/// One NIC as a fabric reports it. Its place in [`Fabric::nics`] is the NIC index every
/// other call takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricNic {
    pub name: String,
    /// The address peers reach the NIC at (RoCE and RDMA-CM address ports by IP too).
    pub ip: IpAddr,
}

/// Bytes a lane has carried, as the fabric counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneProgress {
    /// Bytes the fabric accepted from the lane's writer (written to the kernel, posted).
    pub sent: u64,
    /// Of those, bytes the peer has acknowledged (TCP ACKs, successful RC completions).
    /// `sent - acked` is what the path still holds: a brown-out shows as `acked` growing
    /// slowly while bytes wait.
    pub acked: u64,
    /// Of `sent`, payload bytes written straight into the peer's receive buffer rather
    /// than through the lane's stream (verbs: RDMA WRITE into a buffer the receiver
    /// offered). 0 on a fabric that cannot place.
    pub placed: u64,
}

/// What a fabric provides to the reactor.
///
/// The reactor owns every lane and listener handle and calls these methods from its
/// own thread only. Handles are the fabric's own types: for TCP a socket, for verbs a QP
/// with its completion channel.
///
/// # Readiness
///
/// Lanes and listeners are [`mio::event::Source`]s: the reactor registers them in its
/// `Poll` (lanes readable and writable, listeners readable) and treats each event as a
/// hint, as mio does. On any event of a lane it calls [`Fabric::read`] until it returns
/// `Ok(None)` and then [`Fabric::write`]. So a fabric whose only fd is a completion
/// channel (verbs) reports send completions as readability: `read` then reaps them and
/// `write` posts more. The fabric re-arms its notification before its final poll, so
/// that no completion is missed between the two.
///
/// # Lane lifetime
///
/// A lane comes from [`Fabric::connect`] (outgoing; completion shows as readiness or an
/// error from `read`/`write`) or [`Fabric::accept`]. It is dropped after `deregister`;
/// dropping closes it gracefully (what was sent is still delivered) unless
/// [`Fabric::fence`] was called first.
///
/// # Errors
///
/// `io::Error`s carry the fabric's cause. The reactor classifies `ConnectionReset`,
/// `BrokenPipe` and `UnexpectedEof` as "the peer went away" and any other error as a
/// path failure, so a fabric maps its own errors to those kinds (a verbs fabric: remote
/// access errors to `ConnectionReset`, retry-exceeded to `TimedOut`).
pub trait Fabric: Debug + Send + 'static {
    /// A listening endpoint.
    type Listener: mio::event::Source + Debug + Send;
    /// One lane: a path from a local NIC to a remote one carrying frames both ways.
    type Lane: mio::event::Source + Debug + Send;

    /// The NICs this fabric drives, in index order. Fixed for the fabric's lifetime.
    fn nics(&self) -> &[FabricNic];

    /// The NIC whose carrier the kernel reports under interface name `ifname` (netlink
    /// link events). By default the NIC of that name; a fabric whose NICs are not netdevs
    /// (verbs devices) maps the netdev behind them.
    fn nic_of_link(&self, ifname: &str) -> Option<usize> {
        self.nics().iter().position(|n| n.name == ifname)
    }

    /// Descriptors that turn readable when the fabric has carrier news of its own, which
    /// netlink may not carry (verbs: each device's async events, `PORT_ERR`/`PORT_ACTIVE`).
    /// Called once; the reactor then calls [`Fabric::carrier_events`] on readiness.
    fn carrier_fds(&mut self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// Carrier changes the fabric saw itself since the last call: `(nic, up)`.
    fn carrier_events(&mut self) -> Vec<(usize, bool)> {
        Vec::new()
    }

    /// Listens on NIC `nic`. Returns the endpoint and the address peers connect to.
    fn listen(&mut self, nic: usize) -> io::Result<(Self::Listener, SocketAddr)>;

    /// Takes one incoming lane, `Ok(None)` when none is waiting. Also returns the local
    /// NIC the lane arrived on, when it is one of [`Fabric::nics`].
    ///
    /// An error other than `Ok(None)` leaves the rest of the backlog for a later call
    /// (out of descriptors: `EMFILE`/`ENFILE` as raw OS errors).
    fn accept(
        &mut self,
        listener: &mut Self::Listener,
    ) -> io::Result<Option<(Self::Lane, Option<usize>)>>;

    /// Starts a lane from local NIC `nic` to `to` without blocking.
    fn connect(&mut self, nic: usize, to: SocketAddr) -> io::Result<Self::Lane>;

    /// The next inbound item of `lane`, parsed by `reader`; `Ok(None)` when the lane has
    /// nothing more for now or `reader`'s per-call budget is spent
    /// ([`FrameReader::wants_more`]). Payloads land where the reader was told to place
    /// them.
    fn read(
        &mut self,
        lane: &mut Self::Lane,
        reader: &mut FrameReader,
    ) -> Result<Option<Inbound>, ReadError>;

    /// Sends what `writer` holds, until the lane would block or the writer's per-call
    /// budget is spent ([`FrameWriter::wants_more`]). What was not accepted stays in
    /// `writer`, in order. Never raises a signal for a peer that went away.
    ///
    /// A fabric whose NICs can write a payload straight into the peer's receive buffer
    /// flushes with [`FrameWriter::flush_placing`] and a [`frames::Placer`] lane: it then
    /// offers receives (`Place` frames, consumed by its own `read` at the other end) and
    /// writes first transmissions in place. Others flush plainly and never see either.
    fn write(&mut self, lane: &mut Self::Lane, writer: &mut FrameWriter) -> io::Result<()>;

    /// Whether `lane` can carry frames: any setup of its own that must come first is
    /// done. An accepted lane's pre-authentication deadline starts then. A socket is
    /// ready as soon as it is accepted, and so is a verbs lane, whose handshake crosses
    /// its bootstrap socket: the default says yes.
    fn ready(&self, _lane: &Self::Lane) -> bool {
        true
    }

    /// The peer of accepted lane `lane` proved who it is (its handshake's Proof checked
    /// out). A fabric whose lanes hold costly resources (verbs: QPs and registered rings)
    /// sets them up only now, so that a stranger's connection costs a socket and small
    /// buffers. The default does nothing.
    fn authenticated(&mut self, lane: &mut Self::Lane) {
        let _ = lane;
    }

    /// Whether `lane` holds inbound bytes (or its end) that no readiness event will
    /// announce: a fabric that reaps completions inside `write`, or in the last step of a
    /// `read`, can take in bytes whose event it has already consumed. The reactor asks
    /// after every `write` and every `read` that returned `Ok(None)`, and reads such a
    /// lane on its next turn without waiting. A socket fabric leaves bytes in the kernel,
    /// which signals them: the default says no.
    fn unread(&self, _lane: &Self::Lane) -> bool {
        false
    }

    /// The lane's delivery progress; cheap enough to call every tick for every lane.
    fn progress(&self, lane: &Self::Lane) -> LaneProgress;

    /// The address of the peer's NIC at the other end of `lane`, when the fabric knows
    /// it: with the local NIC it names the path the lane takes, whose other lanes tell a
    /// silent lane on a working path from a dead path.
    fn peer(&self, lane: &Self::Lane) -> Option<std::net::IpAddr> {
        let _ = lane;
        None
    }

    /// Caps the rate the lane sends at, in bytes/s (`None` lifts the cap). Optional: a
    /// fabric that cannot pace returns `ErrorKind::Unsupported`, and lanes then share a
    /// NIC as the hardware decides.
    fn set_pacing(&mut self, lane: &mut Self::Lane, rate: Option<u64>) -> io::Result<()> {
        let _ = (lane, rate);
        Err(io::ErrorKind::Unsupported.into())
    }

    /// Fences the lane before it is dropped: nothing the fabric still holds for it may
    /// reach the peer later (it is replayed on another lane), and the close is a reset
    /// rather than a drain. TCP: `SO_LINGER` 0. Verbs: the QP goes to the error state.
    fn fence(&mut self, lane: &mut Self::Lane);

    /// Seals a receive lane given up: nothing its peer still has on the way may be written
    /// in place into the receive buffers any more (it may land after a replay completed
    /// the receive, into a buffer NCCL reuses), while what the lane sends still goes out.
    /// Verbs: the QPs refuse RDMA WRITEs. Fabrics that write nothing in place: nothing.
    fn seal(&mut self, lane: &mut Self::Lane) {
        let _ = lane;
    }

    /// Closes a lane the reactor has deregistered. Gracefully unless it was fenced.
    fn close(&mut self, lane: Self::Lane) {
        drop(lane);
    }
}
