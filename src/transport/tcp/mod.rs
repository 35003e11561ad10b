//! The TCP fabric: interfaces as NICs, one non-blocking stream per lane.

pub mod fair;
pub mod netlink;
pub mod nic;
pub mod stream;

use std::io;
use std::net::{IpAddr, SocketAddr};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

pub use nic::TcpNic;

/// Socket buffer size: large enough that a lane keeps a fast link busy between reactor turns.
const SOCK_BUF: usize = 4 << 20;

/// A non-blocking listener on `ip`, on a port the kernel picks.
pub fn listen(ip: IpAddr) -> io::Result<mio::net::TcpListener> {
    let sock = Socket::new(
        Domain::for_address(SocketAddr::new(ip, 0)),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&SockAddr::from(SocketAddr::new(ip, 0)))?;
    sock.listen(1024)?;
    Ok(mio::net::TcpListener::from_std(sock.into()))
}

/// Starts a non-blocking connection from local address `from` (so the traffic leaves
/// through that NIC) to `to`. Completion shows as writability or an error.
pub fn connect(from: IpAddr, to: SocketAddr) -> io::Result<mio::net::TcpStream> {
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
pub fn tune(sock: &Socket) -> io::Result<()> {
    sock.set_nodelay(true)?;
    // Best effort: the kernel clamps to its limits.
    let _ = sock.set_send_buffer_size(SOCK_BUF);
    let _ = sock.set_recv_buffer_size(SOCK_BUF);
    Ok(())
}

/// Applies [`tune`] to an accepted stream.
pub fn tune_stream(stream: &mio::net::TcpStream) -> io::Result<()> {
    tune(&socket2::SockRef::from(stream))
}

/// Writes to a lane with `MSG_NOSIGNAL`: a peer that went away must produce `EPIPE`,
/// never a `SIGPIPE` that would kill NCCL's process.
pub struct NoSigPipe<'a>(pub &'a mio::net::TcpStream);

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
