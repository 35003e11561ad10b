//! Link (carrier) changes from the kernel's rtnetlink multicast group, so a cable pull or
//! `ip link set down` is seen at once, without polling sysfs.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    bind, recv, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

const RTMGRP_LINK: u32 = 1;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const IFLA_IFNAME: u16 = 3;
const IFF_UP: u32 = 0x1;
const IFF_RUNNING: u32 = 0x40;
const NLMSG_HDR: usize = 16;
const IFINFO: usize = 16;

/// A link's state as a message reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEvent {
    pub ifname: String,
    /// Administratively up and operationally running (carrier present).
    pub up: bool,
}

/// A non-blocking rtnetlink socket subscribed to link events.
#[derive(Debug)]
pub struct LinkWatcher {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl LinkWatcher {
    pub fn open() -> std::io::Result<LinkWatcher> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkRoute,
        )?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, RTMGRP_LINK))?;
        Ok(LinkWatcher {
            fd,
            buf: vec![0; 64 << 10],
        })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Every link event queued on the socket (drains it until it would block).
    pub fn drain(&mut self) -> Vec<LinkEvent> {
        let mut out = Vec::new();
        loop {
            match recv(self.fd.as_raw_fd(), &mut self.buf, MsgFlags::empty()) {
                Ok(0) => break,
                Ok(n) => out.extend(parse(&self.buf[..n])),
                Err(nix::errno::Errno::EINTR) => continue,
                // EAGAIN: drained. ENOBUFS: the kernel dropped events; the lane timeouts
                // still catch whatever was missed.
                Err(_) => break,
            }
        }
        out
    }
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(i..i + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

/// Parses a datagram of netlink messages; anything malformed ends the parse.
pub fn parse(mut b: &[u8]) -> Vec<LinkEvent> {
    let mut out = Vec::new();
    while b.len() >= NLMSG_HDR {
        let Some(len) = u32_at(b, 0).map(|l| l as usize) else {
            break;
        };
        let Some(kind) = u16_at(b, 4) else { break };
        if len < NLMSG_HDR || len > b.len() {
            break;
        }
        let msg = &b[NLMSG_HDR..len];
        if (kind == RTM_NEWLINK || kind == RTM_DELLINK) && msg.len() >= IFINFO {
            let flags = u32_at(msg, 8).unwrap_or(0);
            let mut attrs = &msg[IFINFO..];
            while attrs.len() >= 4 {
                let alen = u16_at(attrs, 0).unwrap_or(0) as usize;
                let akind = u16_at(attrs, 2).unwrap_or(0);
                if alen < 4 || alen > attrs.len() {
                    break;
                }
                if akind == IFLA_IFNAME {
                    let name = &attrs[4..alen];
                    let name = name.split(|&c| c == 0).next().unwrap_or(&[]);
                    out.push(LinkEvent {
                        ifname: String::from_utf8_lossy(name).into_owned(),
                        up: kind == RTM_NEWLINK && flags & IFF_UP != 0 && flags & IFF_RUNNING != 0,
                    });
                }
                attrs = attrs.get((alen + 3) & !3..).unwrap_or(&[]);
            }
        }
        let next = (len + 3) & !3;
        b = b.get(next..).unwrap_or(&[]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link_msg(kind: u16, flags: u32, name: &str) -> Vec<u8> {
        let mut attr = Vec::new();
        let alen = 4 + name.len() + 1;
        attr.extend_from_slice(&(alen as u16).to_ne_bytes());
        attr.extend_from_slice(&IFLA_IFNAME.to_ne_bytes());
        attr.extend_from_slice(name.as_bytes());
        attr.push(0);
        while attr.len() % 4 != 0 {
            attr.push(0);
        }
        let mut ifi = vec![0u8; IFINFO];
        ifi[8..12].copy_from_slice(&flags.to_ne_bytes());
        let len = NLMSG_HDR + ifi.len() + attr.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend(ifi);
        m.extend(attr);
        m
    }

    #[test]
    fn parses_up_down_and_deleted_links() {
        let mut dgram = link_msg(RTM_NEWLINK, IFF_UP | IFF_RUNNING, "rv0");
        dgram.extend(link_msg(RTM_NEWLINK, IFF_UP, "rv1"));
        dgram.extend(link_msg(RTM_DELLINK, IFF_UP | IFF_RUNNING, "rv2"));
        let ev = parse(&dgram);
        assert_eq!(
            ev,
            vec![
                LinkEvent {
                    ifname: "rv0".into(),
                    up: true
                },
                LinkEvent {
                    ifname: "rv1".into(),
                    up: false
                },
                LinkEvent {
                    ifname: "rv2".into(),
                    up: false
                },
            ]
        );
    }

    #[test]
    fn malformed_datagrams_never_panic() {
        let good = link_msg(RTM_NEWLINK, IFF_UP | IFF_RUNNING, "eth0");
        for cut in 0..good.len() {
            let _ = parse(&good[..cut]);
        }
        let mut bad = good.clone();
        bad[0] = 0xff;
        let _ = parse(&bad);
        // An attribute whose padded length runs past the end of the message.
        let mut odd = link_msg(RTM_NEWLINK, IFF_UP, "abcd");
        let attr_len_at = NLMSG_HDR + IFINFO;
        odd[attr_len_at] = (odd.len() - attr_len_at - 1) as u8;
        let _ = parse(&odd);
        let mut x = 1u32;
        for _ in 0..2000 {
            let v: Vec<u8> = (0..64)
                .map(|_| {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (x >> 16) as u8
                })
                .collect();
            let _ = parse(&v);
        }
    }
}
