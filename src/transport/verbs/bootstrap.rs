//! A verbs lane's bootstrap connection, apart from its socket and its QPs: what the lane
//! sends and expects on it, and when it may spend on QPs and registered rings. No I/O.
//!
//! Until its peer is authenticated a lane costs its socket and small buffers only: the
//! start of its stream (the handshake frames of `conn::auth`) crosses the socket, in
//! chunks. Then each end sets up its QPs and rings and sends their addresses (a `Hello`
//! chunk); once it knows both hellos an end connects its QPs, posts its receives and
//! sends `Ready`, the last chunk it sends: the rest of its stream goes through the
//! peer's ring, which it writes only after the peer's `Ready`.
//!
//! Who sets up first: the listener, once the engine says the connector proved its secret
//! ([`Bootstrap::authenticated`]); the connector when the listener's `Hello` arrives,
//! which the listener sends only then. A connector's `Hello` that comes first is refused:
//! a stranger cannot make a listener register memory.
//!
//! At most [`SOCKET_STREAM`] bytes of each end's stream cross the socket: room for the
//! handshake frames. More waits for the rings, so that a probe's payload, sent right
//! after its Proof, measures the RDMA path and not the socket.
//!
//! A chunk is a tag byte, a little-endian u32 length and that many bytes.

use std::io::IoSlice;

/// Bytes of its stream an end may send over the bootstrap socket: two handshake frames
/// (header and [`crate::conn::wire::MAX_BODY`] each) with room to spare.
pub const SOCKET_STREAM: usize = 16 << 10;
/// Bytes of a chunk's header.
pub const CHUNK_HEADER: usize = 5;

const STREAM: u8 = b'S';
const HELLO: u8 = b'H';
const READY: u8 = b'R';

/// What the socket's next bytes are, as far as the reader is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// This many more bytes of a chunk header (or of a `Hello`): read them into a
    /// buffer and pass them to [`Bootstrap::took`].
    Control(usize),
    /// Up to this many bytes of the peer's stream: read them where the stream goes and
    /// report them with [`Bootstrap::streamed`].
    Stream(usize),
    /// Nothing more: the peer's stream goes on in the ring.
    Ring,
}

#[derive(Debug)]
enum Rx {
    Header { buf: [u8; CHUNK_HEADER], got: usize },
    Stream { left: usize },
    Hello { buf: Vec<u8>, len: usize },
    Ring,
}

/// One end of a verbs lane's bootstrap connection.
#[derive(Debug)]
pub struct Bootstrap {
    listener: bool,
    /// Listener: the engine said the connector proved its secret.
    authenticated: bool,
    /// Our QPs and rings exist and our `Hello` is queued.
    set_up: bool,
    peer_hello: Option<Vec<u8>>,
    /// Our QPs are connected, our receives posted and our `Ready` queued.
    connected: bool,
    peer_ready: bool,
    /// The largest `Hello` the peer may send.
    max_hello: usize,
    /// Bytes for the socket, in order.
    out: Vec<u8>,
    streamed_out: usize,
    streamed_in: usize,
    rx: Rx,
}

impl Bootstrap {
    /// An accepted lane (`listener`) or one we connect; a peer's `Hello` is at most
    /// `max_hello` bytes.
    pub fn new(listener: bool, max_hello: usize) -> Bootstrap {
        Bootstrap {
            listener,
            authenticated: false,
            set_up: false,
            peer_hello: None,
            connected: false,
            peer_ready: false,
            max_hello,
            out: Vec::new(),
            streamed_out: 0,
            streamed_in: 0,
            rx: Rx::Header {
                buf: [0; CHUNK_HEADER],
                got: 0,
            },
        }
    }

    /// Listener: the connector proved who it is. (A connector learns that its listener
    /// took it from the listener's `Hello`.)
    pub fn authenticated(&mut self) {
        self.authenticated = true;
    }

    /// Whether the lane should now set up its QPs and rings and call
    /// [`Bootstrap::set_up`].
    pub fn setup_due(&self) -> bool {
        !self.set_up
            && match self.listener {
                true => self.authenticated,
                false => self.peer_hello.is_some(),
            }
    }

    /// Our QPs and rings exist: queues their addresses, `hello`.
    pub fn set_up(&mut self, hello: &[u8]) {
        debug_assert!(!self.set_up);
        self.set_up = true;
        self.push(HELLO, &[hello]);
    }

    /// The peer's `Hello`, once ours is out and our QPs wait to be connected to it.
    pub fn connect_due(&self) -> Option<&[u8]> {
        match (self.set_up, self.connected) {
            (true, false) => self.peer_hello.as_deref(),
            _ => None,
        }
    }

    /// Our QPs are connected and our receives posted: queues `Ready`, the last chunk.
    pub fn connected(&mut self) {
        debug_assert!(self.connect_due().is_some());
        self.connected = true;
        self.push(READY, &[]);
    }

    /// Whether our QPs exist (with their rings).
    pub fn is_set_up(&self) -> bool {
        self.set_up
    }

    /// Whether our QPs are connected to the peer's.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Whether our stream now goes into the peer's ring: it has posted its receives.
    pub fn tx_on_ring(&self) -> bool {
        self.connected && self.peer_ready
    }

    /// Whether the peer's stream now comes through our ring.
    pub fn rx_on_ring(&self) -> bool {
        matches!(self.rx, Rx::Ring)
    }

    /// Stream bytes the socket may take now: none while earlier chunks wait, once
    /// `Ready` is queued, or past [`SOCKET_STREAM`].
    pub fn stream_room(&self) -> usize {
        if self.connected || !self.out.is_empty() {
            return 0;
        }
        SOCKET_STREAM - self.streamed_out
    }

    /// Queues as much of `bufs` as [`Bootstrap::stream_room`] allows as one chunk;
    /// returns the bytes taken.
    pub fn push_stream(&mut self, bufs: &[IoSlice<'_>]) -> usize {
        let mut left = self.stream_room();
        let mut parts = Vec::new();
        for b in bufs {
            if left == 0 {
                break;
            }
            let take = b.len().min(left);
            parts.push(&b[..take]);
            left -= take;
        }
        let n: usize = parts.iter().map(|p| p.len()).sum();
        if n > 0 {
            self.push(STREAM, &parts);
            self.streamed_out += n;
        }
        n
    }

    fn push(&mut self, tag: u8, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.out.push(tag);
        self.out
            .extend_from_slice(&u32::try_from(len).expect("chunks are small").to_le_bytes());
        for p in parts {
            self.out.extend_from_slice(p);
        }
    }

    /// Bytes waiting for the socket.
    pub fn outbox(&self) -> &[u8] {
        &self.out
    }

    /// The socket took the first `n` bytes of the outbox.
    pub fn sent(&mut self, n: usize) {
        self.out.drain(..n);
    }

    /// What the reader should take from the socket next.
    pub fn want(&self) -> Want {
        match &self.rx {
            Rx::Header { got, .. } => Want::Control(CHUNK_HEADER - got),
            Rx::Stream { left } => Want::Stream(*left),
            Rx::Hello { buf, len } => Want::Control(len - buf.len()),
            Rx::Ring => Want::Ring,
        }
    }

    /// `n` bytes of the peer's stream were read (at most what [`Want::Stream`] said).
    pub fn streamed(&mut self, n: usize) {
        if let Rx::Stream { left } = &mut self.rx {
            *left -= n.min(*left);
            if *left == 0 {
                self.rx = header();
            }
        }
    }

    /// Control bytes read from the socket (at most what [`Want::Control`] said). `Err`
    /// when the peer broke the protocol.
    pub fn took(&mut self, bytes: &[u8]) -> Result<(), String> {
        match &mut self.rx {
            Rx::Header { buf, got } => {
                let n = bytes.len().min(CHUNK_HEADER - *got);
                buf[*got..*got + n].copy_from_slice(&bytes[..n]);
                *got += n;
                if *got == CHUNK_HEADER {
                    let len = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                    let tag = buf[0];
                    self.rx = self.chunk(tag, len)?;
                }
            }
            Rx::Hello { buf, len } => {
                let n = bytes.len().min(*len - buf.len());
                buf.extend_from_slice(&bytes[..n]);
                if buf.len() == *len {
                    self.peer_hello = Some(std::mem::take(buf));
                    self.rx = header();
                }
            }
            Rx::Stream { .. } | Rx::Ring => {}
        }
        Ok(())
    }

    /// Where a chunk with this header leads.
    fn chunk(&mut self, tag: u8, len: usize) -> Result<Rx, String> {
        match tag {
            STREAM if len == 0 || self.streamed_in + len > SOCKET_STREAM => Err(format!(
                "the peer sent {} stream bytes over the verbs bootstrap socket, more than {SOCKET_STREAM}",
                self.streamed_in + len
            )),
            STREAM => {
                self.streamed_in += len;
                Ok(Rx::Stream { left: len })
            }
            HELLO if self.listener && !self.set_up => {
                Err("the peer sent its verbs hello before it was authenticated".into())
            }
            HELLO if self.peer_hello.is_some() => Err("a second verbs hello".into()),
            HELLO if len == 0 || len > self.max_hello => {
                Err(format!("a verbs hello of {len} bytes"))
            }
            HELLO => Ok(Rx::Hello {
                buf: Vec::with_capacity(len),
                len,
            }),
            READY if !self.set_up || self.peer_hello.is_none() || len != 0 => {
                Err("an unexpected verbs ready".into())
            }
            READY => {
                self.peer_ready = true;
                Ok(Rx::Ring)
            }
            _ => Err(format!(
                "a chunk tagged {tag:#04x} on the verbs bootstrap socket"
            )),
        }
    }
}

fn header() -> Rx {
    Rx::Header {
        buf: [0; CHUNK_HEADER],
        got: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moves `from`'s outbox into `to` as its socket would, in pieces of `step` bytes;
    /// returns the stream bytes `to` read.
    fn cross(from: &mut Bootstrap, to: &mut Bootstrap, step: usize) -> Result<Vec<u8>, String> {
        let wire = from.outbox().to_vec();
        from.sent(wire.len());
        let mut stream = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let rest = &wire[at..(at + step).min(wire.len())];
            let n = match to.want() {
                Want::Control(n) => {
                    let n = n.min(rest.len());
                    to.took(&rest[..n])?;
                    n
                }
                Want::Stream(n) => {
                    let n = n.min(rest.len());
                    stream.extend_from_slice(&rest[..n]);
                    to.streamed(n);
                    n
                }
                Want::Ring => return Err("bytes after Ready".into()),
            };
            at += n;
        }
        Ok(stream)
    }

    /// What a lane does when its machine says so: sets up (counting it) and connects.
    fn act(b: &mut Bootstrap, hello: &[u8], setups: &mut u32) {
        if b.setup_due() {
            *setups += 1;
            b.set_up(hello);
        }
        if b.connect_due().is_some() {
            b.connected();
        }
    }

    #[test]
    fn an_accepted_lane_sets_up_nothing_until_its_peer_is_authenticated() {
        let (mut l, mut c) = (Bootstrap::new(true, 64), Bootstrap::new(false, 64));
        let (mut l_setups, mut c_setups) = (0, 0);
        // The handshake frames cross the socket, both ways, for as long as it takes.
        let hello = vec![1u8; 300];
        assert_eq!(c.push_stream(&[IoSlice::new(&hello)]), 300);
        assert_eq!(cross(&mut c, &mut l, 7).unwrap(), hello);
        act(&mut l, b"L", &mut l_setups);
        let challenge = vec![2u8; 200];
        assert_eq!(l.push_stream(&[IoSlice::new(&challenge)]), 200);
        assert_eq!(cross(&mut l, &mut c, 1000).unwrap(), challenge);
        act(&mut c, b"C", &mut c_setups);
        let proof = vec![3u8; 100];
        c.push_stream(&[IoSlice::new(&proof[..40]), IoSlice::new(&proof[40..])]);
        assert_eq!(cross(&mut c, &mut l, 3).unwrap(), proof);
        act(&mut l, b"L", &mut l_setups);
        assert_eq!(
            (l_setups, c_setups),
            (0, 0),
            "nothing set up before the proof is checked"
        );
        assert!(!l.is_set_up() && !c.is_set_up());

        // The engine checked the proof: the listener sets up, then the connector.
        l.authenticated();
        act(&mut l, b"L-hello", &mut l_setups);
        assert_eq!(l_setups, 1);
        let welcome = vec![4u8; 50];
        assert_eq!(
            l.push_stream(&[IoSlice::new(&welcome)]),
            0,
            "the Hello chunk goes out first"
        );
        assert!(cross(&mut l, &mut c, 5).unwrap().is_empty());
        assert_eq!(c.connect_due(), None, "the connector has not set up yet");
        act(&mut c, b"C-hello", &mut c_setups);
        assert_eq!(c_setups, 1);
        assert!(c.is_connected(), "it knows both hellos");
        assert!(
            !c.tx_on_ring(),
            "it writes into the ring only after the listener's Ready"
        );
        assert_eq!(c.stream_room(), 0, "Ready was its last chunk");
        // The listener's Welcome still crosses the socket, before the listener's Ready.
        assert_eq!(l.push_stream(&[IoSlice::new(&welcome)]), 50);
        assert_eq!(cross(&mut l, &mut c, 100).unwrap(), welcome);
        cross(&mut c, &mut l, 2).unwrap();
        assert_eq!(l.connect_due(), Some(&b"C-hello"[..]));
        act(&mut l, b"L-hello", &mut l_setups);
        assert!(l.tx_on_ring() && l.rx_on_ring());
        cross(&mut l, &mut c, 1).unwrap();
        assert!(c.tx_on_ring() && c.rx_on_ring());
        assert_eq!((l_setups, c_setups), (1, 1));
    }

    #[test]
    fn a_hello_before_authentication_is_refused() {
        let mut l = Bootstrap::new(true, 64);
        let mut stranger = Bootstrap::new(true, 64);
        stranger.authenticated();
        stranger.set_up(b"fake");
        let e = cross(&mut stranger, &mut l, 64).unwrap_err();
        assert!(e.contains("before it was authenticated"), "{e}");
        assert!(!l.setup_due());

        // Nor may a Ready come before the hellos, or a chunk of an unknown kind.
        for (chunk, why) in [
            (&[READY, 0, 0, 0, 0][..], "unexpected verbs ready"),
            (&[b'X', 0, 0, 0, 0][..], "tagged 0x58"),
            (&[STREAM, 0, 0, 0, 0][..], "0 stream bytes"),
        ] {
            let mut c = Bootstrap::new(false, 64);
            assert!(c.took(chunk).unwrap_err().contains(why), "{why}");
        }
        let mut c = Bootstrap::new(false, 8);
        let e = c.took(&[HELLO, 9, 0, 0, 0]).unwrap_err();
        assert!(e.contains("hello of 9 bytes"), "{e}");
    }

    #[test]
    fn no_more_than_the_socket_budget_crosses_before_the_rings() {
        let mut c = Bootstrap::new(false, 64);
        let big = vec![5u8; SOCKET_STREAM + 100];
        let mut taken = 0;
        loop {
            let n = c.push_stream(&[IoSlice::new(&big[taken..])]);
            let out = c.outbox().len();
            c.sent(out);
            if n == 0 {
                break;
            }
            taken += n;
        }
        assert_eq!(taken, SOCKET_STREAM, "the rest waits for the rings");
        // A peer sending past the budget breaks the protocol.
        let mut l = Bootstrap::new(true, 64);
        l.took(&[STREAM, 0, 0x40, 0, 0]).unwrap();
        assert_eq!(l.want(), Want::Stream(SOCKET_STREAM));
        l.streamed(SOCKET_STREAM);
        let e = l.took(&[STREAM, 1, 0, 0, 0]).unwrap_err();
        assert!(e.contains("more than"), "{e}");
    }
}
