//! Link (carrier) changes from the kernel's rtnetlink multicast group, so a cable pull or
//! `ip link set down` is seen at once, without polling sysfs. The socket is `netlink-sys`'s;
//! `netlink-packet-core` and `-route` give bounds-checked views of the messages, their
//! link header and their attributes. Ours are the carrier rule and which attribute to read.

use std::os::fd::{AsRawFd, RawFd};

use netlink_packet_core::{NetlinkBuffer, NlasIterator};
use netlink_packet_route::link::{LinkFlags, LinkHeader};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

const RTMGRP_LINK: u32 = 1;

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
    sock: Socket,
    buf: Vec<u8>,
}

impl LinkWatcher {
    pub fn open() -> std::io::Result<LinkWatcher> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.set_non_blocking(true)?;
        sock.bind(&SocketAddr::new(0, RTMGRP_LINK))?;
        Ok(LinkWatcher {
            sock,
            buf: Vec::with_capacity(64 << 10),
        })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Every link event queued on the socket (drains it until it would block).
    pub fn drain(&mut self) -> Vec<LinkEvent> {
        let mut out = Vec::new();
        loop {
            self.buf.clear();
            match self.sock.recv(&mut self.buf, 0) {
                Ok(0) => break,
                Ok(_) => out.extend(parse(&self.buf)),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // EAGAIN: drained. ENOBUFS: the kernel dropped events; the lane timeouts
                // still catch whatever was missed.
                Err(_) => break,
            }
        }
        out
    }
}

/// Bytes of a link message's fixed header (`ifinfomsg`) before its attributes.
const IFINFO_LEN: usize = 16;

/// Parses a datagram of netlink messages. A link message without a readable name is
/// skipped; a header whose length does not fit the datagram ends the parse.
pub fn parse(mut b: &[u8]) -> Vec<LinkEvent> {
    let mut out = Vec::new();
    while let Ok(msg) = NetlinkBuffer::new_checked(b) {
        let len = msg.length() as usize;
        match msg.message_type() {
            libc::RTM_NEWLINK => out.extend(link_event(msg.payload(), true)),
            libc::RTM_DELLINK => out.extend(link_event(msg.payload(), false)),
            _ => {}
        }
        // Messages are 4-byte aligned within a datagram.
        b = b.get((len + 3) & !3..).unwrap_or(&[]);
    }
    out
}

/// The header through the crate, then only the name among the attributes: decoding them
/// all (`LinkMessage::parse`, every link kind's info) would add about 0.3 MB to the
/// plugin for nothing, and would drop the event when an attribute we never read is odd.
fn link_event(payload: &[u8], new: bool) -> Option<LinkEvent> {
    let header = LinkHeader::parse(payload).ok()?;
    let name = NlasIterator::new(payload.get(IFINFO_LEN..)?)
        .map_while(Result::ok)
        .find(|nla| nla.kind() == libc::IFLA_IFNAME)?;
    // The kernel ends the name with one NUL; cut at the first.
    let name = name.value().split(|&c| c == 0).next().unwrap_or(&[]);
    let running = LinkFlags::Up | LinkFlags::Running;
    Some(LinkEvent {
        ifname: String::from_utf8_lossy(name).into_owned(),
        up: new && header.flags.contains(running),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RTM_NEWLINK: u16 = libc::RTM_NEWLINK;
    const RTM_DELLINK: u16 = libc::RTM_DELLINK;
    const IFLA_IFNAME: u16 = libc::IFLA_IFNAME;
    const IFF_UP: u32 = libc::IFF_UP as u32;
    const IFF_RUNNING: u32 = libc::IFF_RUNNING as u32;
    const NLMSG_HDR: usize = 16;
    const IFINFO: usize = 16;

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

    /// A namespace of the test's own, removed on drop.
    struct Netns(String);

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }

    fn ip(args: &[&str]) -> bool {
        std::process::Command::new("ip")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn a_real_socket_reports_a_link_going_up_and_down() {
        let name = format!("rvnl{}", std::process::id());
        if !ip(&["netns", "add", &name]) {
            eprintln!("SKIP: needs root and iproute2 to make a network namespace");
            return;
        }
        let ns = Netns(name);
        // A socket's namespace is the one its thread was in when it was made.
        let f = std::fs::File::open(format!("/run/netns/{}", ns.0)).unwrap();
        let mut w = std::thread::spawn(move || {
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            LinkWatcher::open().unwrap()
        })
        .join()
        .unwrap();
        // Non-blocking: nothing queued, nothing to wait for.
        assert_eq!(w.drain(), vec![]);
        let ev = |up| LinkEvent {
            ifname: "rvnl0".into(),
            up,
        };
        // Carrier changes come from the kernel's link-watch work, a moment after the
        // command that caused them: drain until the event shows up, bounded.
        let mut wait_for = |want: LinkEvent| {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !w.drain().contains(&want) {
                assert!(std::time::Instant::now() < end, "no {want:?}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        };
        let n = ns.0.as_str();
        assert!(ip(&[
            "-n", n, "link", "add", "rvnl0", "type", "veth", "peer", "rvnl1"
        ]));
        wait_for(ev(false));
        assert!(ip(&["-n", n, "link", "set", "rvnl1", "up"]));
        assert!(ip(&["-n", n, "link", "set", "rvnl0", "up"]));
        wait_for(ev(true));
        // The far end goes down: rvnl0 stays administratively up but loses its carrier.
        assert!(ip(&["-n", n, "link", "set", "rvnl1", "down"]));
        wait_for(ev(false));
        assert!(ip(&["-n", n, "link", "del", "rvnl0"]));
        wait_for(ev(false));
    }
}
