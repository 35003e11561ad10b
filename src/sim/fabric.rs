//! The [`Fabric`] over the simulated network: one per node, lanes are connection ends.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use mio::event::Source;
use mio::{Interest, Registry, Token};
use parking_lot::Mutex;

use super::net::{ip_of, Net};
use crate::transport::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use crate::transport::{Fabric, FabricNic, LaneProgress};

pub(crate) type SharedNet = Arc<Mutex<Net>>;

/// Node `node`'s view of the network.
#[derive(Debug)]
pub(crate) struct SimFabric {
    net: SharedNet,
    node: usize,
    nics: Vec<FabricNic>,
}

impl SimFabric {
    pub(crate) fn new(net: SharedNet, node: usize, nics: usize) -> SimFabric {
        SimFabric {
            net,
            node,
            nics: (0..nics)
                .map(|i| FabricNic {
                    name: format!("n{node}e{i}"),
                    ip: ip_of(node, i),
                })
                .collect(),
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

// Readiness is a hint and `Driven::step` services every lane: nothing to register.
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
        Ok(got.map(|(conn, nic)| {
            (
                SimLane {
                    net: self.net.clone(),
                    conn,
                    end: 1,
                    fenced: false,
                },
                Some(nic),
            )
        }))
    }

    fn connect(&mut self, nic: usize, to: SocketAddr) -> io::Result<SimLane> {
        let conn = self.net.lock().connect(self.node, nic, to)?;
        Ok(SimLane {
            net: self.net.clone(),
            conn,
            end: 0,
            fenced: false,
        })
    }

    fn read(
        &mut self,
        lane: &mut SimLane,
        reader: &mut FrameReader,
    ) -> Result<Option<Inbound>, ReadError> {
        let mut net = self.net.lock();
        reader.next(&mut Io {
            net: &mut net,
            conn: lane.conn,
            end: lane.end,
        })
    }

    fn write(&mut self, lane: &mut SimLane, writer: &mut FrameWriter) -> io::Result<()> {
        let mut net = self.net.lock();
        writer.flush(&mut Io {
            net: &mut net,
            conn: lane.conn,
            end: lane.end,
        })
    }

    fn progress(&self, lane: &SimLane) -> LaneProgress {
        let (sent, acked) = self.net.lock().progress(lane.conn, lane.end);
        LaneProgress { sent, acked }
    }

    fn fence(&mut self, lane: &mut SimLane) {
        lane.fenced = true;
    }
}
