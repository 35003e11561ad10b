//! The TCP fabric's own socket options that std, nix and socket2 do not wrap: progress
//! (`TIOCOUTQ`) and pacing (`SO_MAX_PACING_RATE`). Every `unsafe` block of the TCP
//! fabric is here.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;

/// Bytes the kernel still holds in a TCP socket's send queue: written by us and not yet
/// acknowledged by the peer's TCP (`TIOCOUTQ`/`SIOCOUTQ`). What was written minus this is
/// what the path has actually delivered, even when a large socket buffer hides the
/// backlog from userspace.
pub fn tcp_send_queue(sock: &impl AsRawFd) -> io::Result<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one `int` through the pointer, which points to a live local;
    // the fd belongs to `sock`, which the caller keeps open for the call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as u64)
}

/// Caps the rate at which the kernel paces a TCP socket (`SO_MAX_PACING_RATE`, bytes/s;
/// `None` lifts the cap). TCP paces internally once a cap is set, whatever the qdisc.
pub fn set_max_pacing_rate(sock: &impl AsRawFd, rate: Option<u64>) -> io::Result<()> {
    let v: libc::c_ulong = rate.map_or(libc::c_ulong::MAX, |r| r as libc::c_ulong);
    // SAFETY: the option value points to a live local of the size passed; the fd belongs
    // to `sock`, which the caller keeps open for the call.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MAX_PACING_RATE,
            (&v as *const libc::c_ulong).cast(),
            std::mem::size_of::<libc::c_ulong>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn send_queue_counts_unacknowledged_bytes() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_b, _) = l.accept().unwrap();
        assert_eq!(tcp_send_queue(&a).unwrap(), 0);
        a.write_all(&[1u8; 1000]).unwrap();
        // Loopback acknowledges at once; the queue drains to zero, never above what we wrote.
        assert!(tcp_send_queue(&a).unwrap() <= 1000);
        let err = tcp_send_queue(&std::fs::File::open("/dev/null").unwrap());
        assert!(err.is_err(), "not a socket");
    }

    #[test]
    fn pacing_caps_are_set_and_lifted() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let read = |s: &std::net::TcpStream| -> libc::c_ulong {
            let mut v: libc::c_ulong = 0;
            let mut n = std::mem::size_of::<libc::c_ulong>() as libc::socklen_t;
            // SAFETY: value and length point to live locals of the sizes given.
            let r = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_MAX_PACING_RATE,
                    (&mut v as *mut libc::c_ulong).cast(),
                    &mut n,
                )
            };
            assert_eq!(r, 0);
            v
        };
        set_max_pacing_rate(&a, Some(12_345_678)).unwrap();
        assert_eq!(read(&a), 12_345_678);
        set_max_pacing_rate(&a, None).unwrap();
        assert_eq!(read(&a), libc::c_ulong::MAX);
        assert!(set_max_pacing_rate(&std::fs::File::open("/dev/null").unwrap(), None).is_err());
    }
}
