//! The [`Fabric`] over the simulated network: one per node, lanes are connection ends.
//!
//! A verbs-like fabric (`reaping`) also writes payloads in place as verbs lanes do with
//! the default settings: receivers offer every receive (`Place` frames), senders write
//! a first transmission of 4 KiB or more into an offered buffer, and a message sent again
//! only with an offer made after the receiver fenced the lanes it could have been lost
//! with ([`Offers`]). The network lands the writes ([`Net::place`](super::net::Net)).
//! A closed verbs-like lane's end still takes writes in place for a while, as a verbs
//! lane's QP stays up while its teardown waits for the peer's last acknowledgements,
//! unless it was fenced or sealed.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use mio::event::Source;
use mio::{Interest, Registry, Token};
use parking_lot::Mutex;

use super::net::{ip_of, Net};
use crate::config::ZeroCopy;
use crate::conn::wire::{Kind, WireError};
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, Placer, Placing, ReadError};
use crate::transport::memory::LentBuf;
use crate::transport::offers::{self, Offer, Offers, Pick};
use crate::transport::{Fabric, FabricNic, LaneProgress};

pub(crate) type SharedNet = Arc<Mutex<Net>>;

/// Node `node`'s view of the network.
#[derive(Debug)]
pub(crate) struct SimFabric {
    net: SharedNet,
    node: usize,
    nics: Vec<FabricNic>,
    /// Lanes behave as verbs lanes do: every `read` and `write` first reaps what
    /// arrived into the lane's own buffer (a verbs lane's ring), consuming the event
    /// that announced it, so only [`Fabric::unread`] tells the reactor it is there.
    reaping: bool,
}

/// How long a closed, unfenced verbs-like lane still takes writes in place (a verbs
/// lane lingers up to 200 ms for acknowledgements, on the reaper thread, QP up).
const LINGER: std::time::Duration = std::time::Duration::from_millis(200);

impl SimFabric {
    pub(crate) fn new(net: SharedNet, node: usize, nics: usize, reaping: bool) -> SimFabric {
        SimFabric {
            net,
            node,
            nics: (0..nics)
                .map(|i| FabricNic {
                    name: format!("n{node}e{i}"),
                    ip: ip_of(node, i),
                })
                .collect(),
            reaping,
        }
    }

    fn lane(&self, conn: usize, end: usize) -> SimLane {
        SimLane {
            net: self.net.clone(),
            conn,
            end,
            fenced: false,
            reaped: Reaped::default(),
            offers: Offers::default(),
        }
    }
}

/// One end of a simulated connection. Dropping it closes it, as a process's exit would.
#[derive(Debug)]
pub(crate) struct SimLane {
    net: SharedNet,
    conn: usize,
    end: usize,
    fenced: bool,
    reaped: Reaped,
    /// What the peer offered to have written in place (a verbs-like fabric's lanes).
    offers: Offers,
}

impl SimLane {
    /// Whether something happened on this end since the last call (an edge-triggered
    /// poll's event for it).
    pub(crate) fn take_news(&self) -> bool {
        self.net.lock().take_news(self.conn, self.end)
    }

    /// Whether a poll would report this end now.
    pub(crate) fn has_news(&self) -> bool {
        self.net.lock().has_news(self.conn, self.end)
    }
}

/// What a reaping lane took from the network and has not handed to a reader yet.
#[derive(Debug, Default)]
struct Reaped {
    bytes: std::collections::VecDeque<u8>,
    eof: bool,
    err: Option<io::ErrorKind>,
}

impl Reaped {
    /// Everything the network holds for the lane, and its event with it.
    fn reap(&mut self, net: &mut Net, conn: usize, end: usize) {
        let mut buf = [0u8; 16 << 10];
        while !self.eof && self.err.is_none() {
            match net.read(conn, end, &mut buf) {
                Ok(0) => self.eof = true,
                Ok(n) => self.bytes.extend(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => self.err = Some(e.kind()),
            }
        }
        net.take_news(conn, end);
    }

    fn pending(&self) -> bool {
        !self.bytes.is_empty() || self.eof || self.err.is_some()
    }
}

impl io::Read for Reaped {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.bytes.is_empty() {
            let n = buf.len().min(self.bytes.len());
            for (o, b) in buf.iter_mut().zip(self.bytes.drain(..n)) {
                *o = b;
            }
            return Ok(n);
        }
        match (self.err, self.eof) {
            (Some(kind), _) => Err(kind.into()),
            (None, true) => Ok(0),
            (None, false) => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl Drop for SimLane {
    fn drop(&mut self) {
        self.net.lock().close(self.conn, self.end, self.fenced);
    }
}

#[derive(Debug)]
pub(crate) struct SimListener {
    net: SharedNet,
    addr: SocketAddr,
}

impl Drop for SimListener {
    fn drop(&mut self) {
        self.net.lock().close_listener(self.addr);
    }
}

// `Driven::step` decides which lanes are ready: nothing to register.
macro_rules! no_registration {
    ($t:ty) => {
        impl Source for $t {
            fn register(&mut self, _: &Registry, _: Token, _: Interest) -> io::Result<()> {
                Ok(())
            }
            fn reregister(&mut self, _: &Registry, _: Token, _: Interest) -> io::Result<()> {
                Ok(())
            }
            fn deregister(&mut self, _: &Registry) -> io::Result<()> {
                Ok(())
            }
        }
    };
}
no_registration!(SimLane);
no_registration!(SimListener);

/// `Read` and `Write` of one end, with the network locked for one call.
struct Io<'a> {
    net: &'a mut Net,
    conn: usize,
    end: usize,
}

impl io::Read for Io<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.net.read(self.conn, self.end, buf)
    }
}

impl io::Write for Io<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.net
            .write(self.conn, self.end, &[io::IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.net.write(self.conn, self.end, bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One end as a verbs lane writes: the stream, and payloads in place.
struct PlacingEnd<'a> {
    io: Io<'a>,
    offers: &'a mut Offers,
}

impl io::Write for PlacingEnd<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.io.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Placer for PlacingEnd<'_> {
    /// Every receive is offered, as verbs lanes do unless `RAILOVER_GDR=off`.
    fn advertise(
        &mut self,
        seq: u64,
        buf: &LentBuf,
        capacity: u64,
        gen: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        let capacity = capacity.min(buf.len() as u64);
        if capacity == 0 {
            return Ok(None);
        }
        let offer = Offer {
            addr: buf.addr() as u64,
            rkey: 0,
            capacity,
            gen,
        };
        Ok(Some(offer.frame(seq)))
    }

    /// As a verbs lane with `RAILOVER_ZERO_COPY=auto` ([`offers::policy`], [`Offers::pick`]).
    fn direct(&mut self, seq: u64, buf: &LentBuf, len: u64, place: Placing) -> io::Result<bool> {
        let must = place.must || !buf.cpu_reachable();
        let policy = offers::policy(ZeroCopy::Auto, must).expect("auto writes in place");
        let offer = match self.offers.pick(seq, len, place.min_gen, policy) {
            Pick::Place(offer) => offer,
            Pick::Stream => return Ok(false),
            Pick::Wait => return Err(io::ErrorKind::WouldBlock.into()),
        };
        self.offers.remove(seq);
        let bytes = buf.slice(0, len as usize).to_vec();
        (self.io.net).place(self.io.conn, self.io.end, offer.addr as usize, bytes)?;
        Ok(true)
    }
}

impl Fabric for SimFabric {
    type Listener = SimListener;
    type Lane = SimLane;

    fn nics(&self) -> &[FabricNic] {
        &self.nics
    }

    fn listen(&mut self, nic: usize) -> io::Result<(SimListener, SocketAddr)> {
        let addr = self.net.lock().listen(self.node, nic)?;
        Ok((
            SimListener {
                net: self.net.clone(),
                addr,
            },
            addr,
        ))
    }

    fn accept(&mut self, l: &mut SimListener) -> io::Result<Option<(SimLane, Option<usize>)>> {
        let got = self.net.lock().accept(l.addr);
        Ok(got.map(|(conn, nic)| (self.lane(conn, 1), Some(nic))))
    }

    fn peer(&self, lane: &SimLane) -> Option<std::net::IpAddr> {
        self.net.lock().peer_of(lane.conn, lane.end)
    }

    fn connect(&mut self, nic: usize, to: SocketAddr) -> io::Result<SimLane> {
        let conn = self.net.lock().connect(self.node, nic, to)?;
        Ok(self.lane(conn, 0))
    }

    fn read(
        &mut self,
        lane: &mut SimLane,
        reader: &mut FrameReader,
    ) -> Result<Option<Inbound>, ReadError> {
        let mut net = self.net.lock();
        if !self.reaping {
            return reader.next(&mut Io {
                net: &mut net,
                conn: lane.conn,
                end: lane.end,
            });
        }
        lane.reaped.reap(&mut net, lane.conn, lane.end);
        loop {
            match reader.next(&mut lane.reaped) {
                // An offer is the lane's business, as on verbs.
                Ok(Some(Inbound::Frame(h, body))) if h.kind == Kind::Place => {
                    let offer =
                        Offer::of_frame(&h, &body).ok_or(WireError::Malformed("Place body"))?;
                    lane.offers.insert(h.seq, offer);
                }
                got => return got,
            }
        }
    }

    fn write(&mut self, lane: &mut SimLane, writer: &mut FrameWriter) -> io::Result<()> {
        let mut net = self.net.lock();
        let io = Io {
            net: &mut net,
            conn: lane.conn,
            end: lane.end,
        };
        if !self.reaping {
            let mut io = io;
            return writer.flush(&mut io);
        }
        lane.reaped.reap(io.net, lane.conn, lane.end);
        writer.flush_placing(&mut PlacingEnd {
            io,
            offers: &mut lane.offers,
        })
    }

    fn unread(&self, lane: &SimLane) -> bool {
        self.reaping && lane.reaped.pending()
    }

    fn progress(&self, lane: &SimLane) -> LaneProgress {
        let net = self.net.lock();
        let (sent, acked) = net.progress(lane.conn, lane.end);
        LaneProgress {
            sent,
            acked,
            placed: net.placed(lane.conn, lane.end),
        }
    }

    fn fence(&mut self, lane: &mut SimLane) {
        lane.fenced = true;
        self.net.lock().fence(lane.conn, lane.end);
    }

    fn seal(&mut self, lane: &mut SimLane) {
        self.net.lock().fence(lane.conn, lane.end);
    }

    fn close(&mut self, lane: SimLane) {
        if self.reaping && !lane.fenced {
            self.net.lock().linger(lane.conn, lane.end, LINGER);
        }
        drop(lane);
    }
}
