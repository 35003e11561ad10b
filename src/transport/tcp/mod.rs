//! The TCP fabric: interfaces as NICs, one non-blocking stream per lane.
//!
//! [`TcpFabric`] implements [`Fabric`]: progress is what the peer's TCP acknowledged
//! (bytes written less `TIOCOUTQ`), pacing is `SO_MAX_PACING_RATE`, and a fence is
//! `SO_LINGER` 0, so the close resets and drops what the kernel still holds.

pub mod nic;
pub mod sys;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use mio::event::Source;
use mio::{Interest, Registry, Token};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use super::{Fabric, FabricNic, LaneProgress};
pub use nic::TcpNic;

/// The TCP fabric over a fixed list of interfaces.
#[derive(Debug)]
pub struct TcpFabric {
    nics: Vec<FabricNic>,
}

impl TcpFabric {
    pub fn new(nics: &[TcpNic]) -> TcpFabric {
        TcpFabric {
            nics: nics
                .iter()
                .map(|n| FabricNic {
                    name: n.name.clone(),
                    ip: n.ip,
                })
                .collect(),
        }
    }

    fn ip(&self, nic: usize) -> io::Result<IpAddr> {
        self.nics.get(nic).map(|n| n.ip).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no NIC {nic} (the TCP fabric has {})", self.nics.len()),
            )
        })
    }

    fn nic_of(&self, ip: IpAddr) -> Option<usize> {
        self.nics.iter().position(|n| n.ip == ip)
    }
}

/// A lane of the TCP fabric: one stream, and the bytes written to it.
#[derive(Debug)]
pub struct TcpLane {
    stream: mio::net::TcpStream,
    sent: u64,
}

/// A listener of the TCP fabric.
#[derive(Debug)]
pub struct TcpListen(mio::net::TcpListener);

impl Fabric for TcpFabric {
    type Listener = TcpListen;
    type Lane = TcpLane;

    fn nics(&self) -> &[FabricNic] {
        &self.nics
    }

    fn listen(&mut self, nic: usize) -> io::Result<(TcpListen, SocketAddr)> {
        let l = listen(self.ip(nic)?)?;
        let addr = l.local_addr()?;
        Ok((TcpListen(l), addr))
    }

    fn accept(&mut self, l: &mut TcpListen) -> io::Result<Option<(TcpLane, Option<usize>)>> {
        loop {
            return match l.0.accept() {
                Ok((stream, _)) => {
                    if let Err(e) = tune(&socket2::SockRef::from(&stream)) {
                        tracing::debug!("railover: cannot tune an accepted socket: {e}");
                    }
                    let nic = stream.local_addr().ok().and_then(|a| self.nic_of(a.ip()));
                    Ok(Some((TcpLane { stream, sent: 0 }, nic)))
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    fn peer(&self, lane: &TcpLane) -> Option<IpAddr> {
        lane.stream.peer_addr().ok().map(|a| a.ip())
    }

    fn connect(&mut self, nic: usize, to: SocketAddr) -> io::Result<TcpLane> {
        let stream = connect(self.ip(nic)?, to)?;
        Ok(TcpLane { stream, sent: 0 })
    }

    fn read(
        &mut self,
        lane: &mut TcpLane,
        reader: &mut FrameReader,
    ) -> Result<Option<Inbound>, ReadError> {
        reader.next_stream(&mut lane.stream)
    }

    fn write(&mut self, lane: &mut TcpLane, writer: &mut FrameWriter) -> io::Result<()> {
        let before = writer.total_written();
        let res = writer.flush(&mut NoSigPipe(&lane.stream));
        lane.sent += writer.total_written() - before;
        res
    }

    fn progress(&self, lane: &TcpLane) -> LaneProgress {
        // An error (the socket is gone) counts nothing as delivered beyond what was.
        let unacked = sys::tcp_send_queue(&lane.stream).unwrap_or(0);
        LaneProgress {
            sent: lane.sent,
            acked: lane.sent.saturating_sub(unacked),
            placed: 0,
        }
    }

    fn set_pacing(&mut self, lane: &mut TcpLane, rate: Option<u64>) -> io::Result<()> {
        sys::set_max_pacing_rate(&lane.stream, rate)
    }

    fn fence(&mut self, lane: &mut TcpLane) {
        let _ = socket2::SockRef::from(&lane.stream).set_linger(Some(Duration::ZERO));
    }
}

impl Source for TcpLane {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        self.stream.register(r, t, i)
    }

    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        self.stream.reregister(r, t, i)
    }

    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        self.stream.deregister(r)
    }
}

impl Source for TcpListen {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        self.0.register(r, t, i)
    }

    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        self.0.reregister(r, t, i)
    }

    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        self.0.deregister(r)
    }
}

/// Socket buffer size: large enough that a lane keeps a fast link busy between reactor turns.
const SOCK_BUF: usize = 4 << 20;

/// A non-blocking listener on `ip`, on a port the kernel picks.
fn listen(ip: IpAddr) -> io::Result<mio::net::TcpListener> {
    let sock = Socket::new(
        Domain::for_address(SocketAddr::new(ip, 0)),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&SockAddr::from(SocketAddr::new(ip, 0)))?;
    sock.listen(crate::transport::LISTEN_BACKLOG)?;
    Ok(mio::net::TcpListener::from_std(sock.into()))
}

/// Starts a non-blocking connection from local address `from` (so the traffic leaves
/// through that NIC) to `to`. Completion shows as writability or an error.
fn connect(from: IpAddr, to: SocketAddr) -> io::Result<mio::net::TcpStream> {
    let sock = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_nonblocking(true)?;
    if from.is_ipv4() == to.is_ipv4() {
        sock.bind(&SockAddr::from(SocketAddr::new(from, 0)))?;
    }
    tune(&sock)?;
    match sock.connect(&SockAddr::from(to)) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(mio::net::TcpStream::from_std(sock.into()))
}

/// Options every lane socket gets: no Nagle delay (control frames are latency-critical)
/// and large buffers.
fn tune(sock: &Socket) -> io::Result<()> {
    sock.set_nodelay(true)?;
    // Best effort: the kernel clamps to its limits.
    let _ = sock.set_send_buffer_size(SOCK_BUF);
    let _ = sock.set_recv_buffer_size(SOCK_BUF);
    Ok(())
}

/// Writes to a lane with `MSG_NOSIGNAL`: a peer that went away must produce `EPIPE`,
/// never a `SIGPIPE` that would kill NCCL's process.
struct NoSigPipe<'a>(&'a mio::net::TcpStream);

impl io::Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        socket2::SockRef::from(self.0).send_with_flags(buf, libc::MSG_NOSIGNAL)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        socket2::SockRef::from(self.0).send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::wire::{Header, Kind};
    use std::net::Ipv4Addr;

    fn fabric() -> TcpFabric {
        TcpFabric::new(&nic::loopback_nics(1))
    }

    /// Accepts from `l`, polling without sleeping: loopback completes at once.
    fn accept(f: &mut TcpFabric, l: &mut TcpListen) -> (TcpLane, Option<usize>) {
        for _ in 0..1_000_000 {
            if let Some(got) = f.accept(l).unwrap() {
                return got;
            }
            std::thread::yield_now();
        }
        panic!("no connection arrived");
    }

    fn read_one(f: &mut TcpFabric, lane: &mut TcpLane, r: &mut FrameReader) -> Inbound {
        for _ in 0..1_000_000 {
            if let Some(item) = f.read(lane, r).unwrap() {
                return item;
            }
            std::thread::yield_now();
        }
        panic!("nothing arrived");
    }

    #[test]
    fn lanes_carry_frames_and_count_progress() {
        let mut f = fabric();
        let ip = f.nics()[0].ip;
        let (mut l, addr) = f.listen(0).unwrap();
        assert_eq!(addr.ip(), ip);
        let mut a = f.connect(0, addr).unwrap();
        let (mut b, nic) = accept(&mut f, &mut l);
        assert_eq!(nic, Some(0), "the lane arrived on our NIC 0");

        let mut w = FrameWriter::default();
        w.push_ctrl(&Header::new(Kind::Keepalive, 7, 0).encode());
        for _ in 0..1_000_000 {
            f.write(&mut a, &mut w).unwrap();
            if w.is_empty() {
                break;
            }
            std::thread::yield_now();
        }
        assert!(w.is_empty(), "the frame was sent");
        let p = f.progress(&a);
        assert_eq!(p.sent, w.total_written());
        assert!(p.acked <= p.sent);

        let mut r = FrameReader::default();
        match read_one(&mut f, &mut b, &mut r) {
            Inbound::Frame(h, _) => assert_eq!((h.kind, h.seq), (Kind::Keepalive, 7)),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(f.progress(&b), LaneProgress::default(), "b sent nothing");
        f.set_pacing(&mut a, Some(1 << 20)).unwrap();
        f.set_pacing(&mut a, None).unwrap();
    }

    #[test]
    fn a_fenced_lane_closes_with_a_reset() {
        let mut f = fabric();
        let (mut l, addr) = f.listen(0).unwrap();
        let mut a = f.connect(0, addr).unwrap();
        let (mut b, _) = accept(&mut f, &mut l);
        f.fence(&mut a);
        f.close(a);
        let mut r = FrameReader::default();
        let mut got = None;
        for _ in 0..1_000_000 {
            match f.read(&mut b, &mut r) {
                Ok(None) => std::thread::yield_now(),
                other => {
                    got = Some(other);
                    break;
                }
            }
        }
        match got {
            Some(Err(ReadError::Io(e))) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
            other => panic!("expected a reset, got {other:?}"),
        }
    }

    #[test]
    fn unknown_nics_are_refused_with_the_count() {
        let mut f = fabric();
        let e = f.listen(3).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("no NIC 3"), "{e}");
        let to = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9);
        assert!(f.connect(1, to).is_err());
    }
}
