//! The line protocol of `railover fault-peer` (docs/fault-tier.md): one JSON object per
//! line, each way. The peer writes [`Event`]s on stdout and reads [`Command`]s on stdin;
//! the fault tier and the demo read and write the same types, so neither side can drift.
//!
//! Times `t` are Unix-epoch milliseconds, the clock the tests also read. They are `u64`:
//! serde's internally tagged enums cannot carry `u128`.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Bytes in an NCCL connection handle.
pub const HANDLE_LEN: usize = 128;

/// One listener's handle: the receiver prints it, the test passes it to the sender.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handle {
    pub comm: usize,
    pub dev: i32,
    /// The handle's bytes in lowercase hex.
    pub hex: String,
}

impl Handle {
    pub fn new(comm: usize, dev: i32, bytes: &[u8; HANDLE_LEN]) -> Handle {
        Handle {
            comm,
            dev,
            hex: bytes.iter().map(|x| format!("{x:02x}")).collect(),
        }
    }

    /// The handle's bytes; `None` unless `hex` is exactly 256 hex digits.
    pub fn bytes(&self) -> Option<[u8; HANDLE_LEN]> {
        let h = self.hex.as_bytes();
        if h.len() != 2 * HANDLE_LEN {
            return None;
        }
        let mut out = [0u8; HANDLE_LEN];
        for (o, pair) in out.iter_mut().zip(h.chunks(2)) {
            *o = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        Some(out)
    }
}

/// The call that returned an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    Isend,
    Irecv,
    Test,
    Iflush,
    /// tcp-recv's socket read.
    Read,
    /// tcp-send's socket write.
    Write,
}

/// A link fault the sender injects inside its own plugin (the loopback demo).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Link {
    Down,
    Up,
}

/// What an endpoint had done when it stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    /// `recv`, `send`, `tcp-recv` or `tcp-send`.
    pub role: String,
    pub comms: u64,
    /// Messages verified (receiver) or completed (sender).
    pub msgs: u64,
    pub bytes: u64,
    pub ended: u64,
    pub failed: u64,
    /// Comms that still had a request pending when the endpoint gave up.
    pub stalled: u64,
    /// Damaged messages (every one, not only those printed as [`Event::Bad`]).
    pub bad: u64,
    pub req_errors: u64,
    /// (ncclResult_t, how many requests returned it), ascending by code.
    pub codes: Vec<(i32, u64)>,
    pub first_error: Option<u64>,
    pub last_error: Option<u64>,
    /// The router's failed probes, from the route snapshot the plugin publishes.
    pub probes_failed: u64,
    /// Connections this process's listeners turned away before they authenticated
    /// (refused, past their deadline, or dropped to keep the handshake caps).
    pub rejected_connections: u64,
    /// Of those: handshakes that failed to authenticate.
    pub refused_handshakes: u64,
    /// Of those: connections the admission gate dropped to make room.
    pub evicted_handshakes: u64,
    /// The most connections this process's listeners held in their handshake at once.
    pub handshakes_peak: u64,
    /// Payload bytes this process's verbs lanes wrote in place (zero copy).
    pub placed_bytes: u64,
    /// Ranges of NCCL memory this process registered with an RDMA device.
    pub registrations: u64,
    /// Payload bytes the CPU copied through lanes' streams: into receive buffers
    /// (receiver), from send buffers (sender). Zero when every payload was written in
    /// place.
    pub streamed_in: u64,
    pub streamed_out: u64,
    /// Receiver: `iflush` requests of receives into GPU memory that completed.
    #[serde(default)]
    pub flushes: u64,
    /// Flush READs this process posted (one per device that registered the buffer).
    #[serde(default)]
    pub flush_reads: u64,
    /// Device flushes counted done because the device was down (its lanes fenced).
    #[serde(default)]
    pub flushes_excused: u64,
    /// Device flushes that waited for a free slot on the device's flush QP.
    #[serde(default)]
    pub flushes_queued: u64,
    /// Device flushes posted again on a fresh flush QP after a READ broke the old one.
    #[serde(default)]
    pub flushes_reposted: u64,
}

/// One line the peer prints on stdout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// The plugin's devices, in order.
    Devices {
        n: i32,
        names: Vec<String>,
    },
    Handle(Handle),
    /// The receiver printed every handle and now accepts.
    Listening {
        comms: usize,
    },
    /// tcp-recv listens on `addr`.
    TcpListening {
        addr: SocketAddr,
    },
    Connected {
        comms: usize,
        t: u64,
        /// Ranges registered with an RDMA device so far: by `regMr` on each comm's own
        /// NIC, before any lane moved a byte.
        #[serde(default)]
        registrations: u64,
    },
    /// Bytes per comm since the previous tick (receiver: verified deliveries; sender:
    /// completed sends); `el` is milliseconds since the endpoint started ticking.
    /// `devs`: bytes each local device's interface moved since the previous tick
    /// (receiver: received, sender: sent; headers and probes included), in device order;
    /// empty when the endpoint does not count them (plain TCP).
    Tick {
        t: u64,
        el: u64,
        bytes: Vec<u64>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        devs: Vec<u64>,
        /// Per comm, the longest wait in milliseconds between two of its completions
        /// (receiver: deliveries) that ended since the previous tick; 0 when it completed
        /// fewer than two. Empty when the endpoint does not track them.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gaps: Vec<u32>,
    },
    /// Sender, after each tick: running lanes per local NIC.
    Lanes {
        t: u64,
        counts: Vec<u32>,
    },
    /// Sender, after each tick: bytes each local NIC has sent so far.
    NicBytes {
        t: u64,
        tx: Vec<u64>,
    },
    /// A post or test returned ncclResult_t `code` (-1 for a socket error, in `detail`).
    Error {
        t: u64,
        comm: usize,
        op: Op,
        seq: Option<u64>,
        code: i32,
        detail: Option<String>,
    },
    /// Damaged data: `kind` is dup, gap, misrouted, size or corrupt (first 20 only).
    Bad {
        t: u64,
        comm: usize,
        kind: String,
        detail: String,
    },
    /// Receiver: comm's END arrived after `msgs` messages.
    End {
        t: u64,
        comm: usize,
        msgs: u64,
    },
    Injected {
        link: Link,
        dev: usize,
        t: u64,
    },
    InjectFailed {
        link: Link,
        dev: usize,
        error: String,
    },
    SetupFailed {
        error: String,
    },
    Summary(Summary),
}

impl Event {
    /// The event on `line`; `None` for anything else (a stray line is not an event).
    pub fn parse(line: &str) -> Option<Event> {
        serde_json::from_str(line).ok()
    }

    /// The last summary among a receiver's `lines`, if it printed one.
    pub fn last_summary(lines: &[String]) -> Option<Summary> {
        lines.iter().rev().find_map(|l| match Event::parse(l)? {
            Event::Summary(s) => Some(s),
            _ => None,
        })
    }

    /// One line, without the newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("plain data always encodes")
    }
}

/// One line the sender reads on stdin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Command {
    /// Connect a comm to this handle (before `Go`).
    Handle(Handle),
    /// Every handle was given: connect.
    Go,
    /// Inject a link fault on a local device (after connecting).
    Link { link: Link, dev: usize },
    /// The receiver is done: close the comms.
    Close,
}

impl Command {
    /// The command on `line`, or why it is not one.
    pub fn parse(line: &str) -> Result<Command, String> {
        serde_json::from_str(line).map_err(|e| format!("bad command line {line:?}: {e}"))
    }

    /// One line, without the newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("plain data always encodes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_line_reads_back_as_written() {
        let h = Handle::new(3, 1, &[0xa5; HANDLE_LEN]);
        let events = [
            Event::Devices {
                n: 2,
                names: vec!["rv0".into(), "rv1".into()],
            },
            Event::Handle(h.clone()),
            Event::TcpListening {
                addr: "10.0.0.2:5201".parse().unwrap(),
            },
            Event::Tick {
                t: 1_700_000_000_123,
                el: 100,
                bytes: vec![1 << 40, 0],
                devs: vec![],
                gaps: vec![],
            },
            Event::Tick {
                t: 1_700_000_000_373,
                el: 350,
                bytes: vec![7, 8, 9],
                devs: vec![3, 0],
                gaps: vec![250, 0, 12],
            },
            Event::Error {
                t: 5,
                comm: 1,
                op: Op::Test,
                seq: Some(9),
                code: 3,
                detail: None,
            },
            Event::Injected {
                link: Link::Down,
                dev: 0,
                t: 7,
            },
            Event::Summary(Summary {
                role: "recv".into(),
                codes: vec![(3, 4), (6, 1)],
                first_error: Some(5),
                ..Summary::default()
            }),
        ];
        for e in events {
            let line = e.to_line();
            assert!(!line.contains('\n'), "{line}");
            assert_eq!(Event::parse(&line), Some(e), "{line}");
        }
        for c in [
            Command::Handle(h),
            Command::Go,
            Command::Link {
                link: Link::Up,
                dev: 2,
            },
            Command::Close,
        ] {
            assert_eq!(Command::parse(&c.to_line()), Ok(c));
        }
    }

    #[test]
    fn handle_bytes_round_trip_and_reject_bad_hex() {
        let mut b = [0u8; HANDLE_LEN];
        for (i, x) in b.iter_mut().enumerate() {
            *x = i as u8 ^ 0x5c;
        }
        let h = Handle::new(0, 0, &b);
        assert_eq!(h.bytes(), Some(b));
        let short = Handle {
            hex: h.hex[2..].into(),
            ..h.clone()
        };
        assert_eq!(short.bytes(), None);
        let mut bad = h.hex.clone();
        bad.replace_range(0..2, "zz");
        assert_eq!(Handle { hex: bad, ..h }.bytes(), None);
    }

    #[test]
    fn stray_lines_are_not_events_and_bad_commands_say_why() {
        assert_eq!(Event::parse("railover INFO 1: hello"), None);
        assert_eq!(Event::parse(r#"{"event":"tick","t":1}"#), None);
        // A tick without per-device bytes (plain TCP) reads with none.
        assert_eq!(
            Event::parse(r#"{"event":"tick","t":1,"el":2,"bytes":[3]}"#),
            Some(Event::Tick {
                t: 1,
                el: 2,
                bytes: vec![3],
                devs: vec![],
                gaps: vec![]
            })
        );
        let e = Command::parse("link-down 0").unwrap_err();
        assert!(e.contains("link-down 0"), "{e}");
    }
}
