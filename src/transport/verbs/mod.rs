//! The RDMA verbs fabric, on rdma-mummy-sys (libibverbs opened at run time).
//!
//! What is here: the raw calls and their owned wrappers ([`sys`]), device discovery with
//! GID and speed selection ([`device`]), each opened device shared by its lanes
//! ([`domain`]: context, protection domain, async-event faults, flush QP), and
//! [`VerbsFabric`]: lanes that are RC QPs moving the lane's byte stream through
//! registered rings ([`lane`]), set up over a bootstrap TCP connection to the address the
//! trait passes. [`flush`] is a device's loopback QP whose RDMA READ makes the NIC's
//! earlier writes into a buffer visible (NCCL's `iflush`), and [`gpu`] says whether the
//! NICs take GPU memory (`ptrSupport`); [`register`] registers NCCL's memory with a
//! device, from `regMr` or from a lane. Tested on Soft-RoCE in QEMU
//! (`scripts/verbs-tier.sh`); `RAILOVER_TRANSPORT=verbs` selects it, and so does `auto`
//! when a usable port exists.

pub mod bootstrap;
pub mod device;
pub mod domain;
pub mod flush;
pub mod gpu;
pub mod lane;
pub mod register;
pub mod sys;

pub use device::{discover, Discovery, VerbsNic};
pub use domain::Domain;
pub use flush::Flusher;
pub use gpu::GpuMemory;
pub use lane::VerbsLane;
pub use register::Registrar;

/// The default QP timing (`RAILOVER_IB_TIMEOUT`, `RAILOVER_IB_RETRY_CNT`): 4.096 us * 2^16
/// = 268 ms per attempt, 7 attempts, so the NIC gives up after about 1.9 s. railover's own
/// completion timeout (1 s by default) decides before that; NCCL's defaults
/// (`NCCL_IB_TIMEOUT=20`, `RETRY_CNT=7`) keep a dead path for about 34 s. Not 7 retries:
/// Soft-RoCE (rxe) takes a retry count of 7 as "retry forever" (seen in the Soft-RoCE
/// tier: a write to a fenced peer never completed).
pub const QP_TIMING: sys::QpTiming = sys::QpTiming {
    timeout: 16,
    retry_cnt: 6,
};

/// The QP timing `settings` ask for.
pub fn qp_timing(settings: &VerbsSettings) -> sys::QpTiming {
    sys::QpTiming {
        timeout: settings.timeout,
        retry_cnt: settings.retry_cnt,
    }
}

use std::io;
use std::net::{IpAddr, SocketAddr};

use mio::event::Source;
use mio::{Interest, Registry, Token};
use socket2::{Protocol, SockAddr, Socket, Type};

use super::frames::{FrameReader, FrameWriter, Inbound, ReadError};
use super::{Fabric, FabricNic, LaneProgress};
use crate::config::VerbsSettings;
use crate::conn::wire::{Kind, WireError};
use std::sync::Arc;
use sys::{wc, Completion};

/// The verbs fabric over the ports discovery found. A NIC's address is the IP of its RoCE
/// GID: lanes bootstrap over TCP between those addresses.
#[derive(Debug)]
pub struct VerbsFabric {
    nics: Vec<FabricNic>,
    verbs: Vec<VerbsNic>,
    /// Each device opened once, for all its lanes and for its async events.
    domains: Vec<Arc<Domain>>,
    settings: VerbsSettings,
    /// What each NIC can do with GPU memory, once [`VerbsFabric::gpu_memory`] judged it:
    /// its lanes refuse GPU memory it cannot take.
    gpu: Vec<GpuMemory>,
    /// Where closed lanes go to be torn down (see [`Fabric::close`]).
    reaper: Option<std::sync::mpsc::Sender<VerbsLane>>,
}

impl VerbsFabric {
    /// The fabric over `nics`; every one must have an IP address (RoCE ports do; IB ports
    /// need IPoIB, which discovery does not look for yet), with the default QP settings.
    pub fn new(nics: Vec<VerbsNic>) -> io::Result<VerbsFabric> {
        VerbsFabric::with_settings(nics, VerbsSettings::default())
    }

    /// The fabric over `nics`, its lanes' QPs set up as `settings` say.
    pub fn with_settings(nics: Vec<VerbsNic>, settings: VerbsSettings) -> io::Result<VerbsFabric> {
        let fabric = nics
            .iter()
            .map(|n| {
                let ip = n.ip().ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::Unsupported,
                        format!("{} has no IP address to bootstrap lanes from (InfiniBand without IPoIB is not supported yet)", n.label()),
                    )
                })?;
                Ok(FabricNic {
                    name: n.device.clone(),
                    ip,
                })
            })
            .collect::<io::Result<_>>()?;
        Ok(VerbsFabric {
            nics: fabric,
            verbs: nics,
            domains: Vec::new(),
            gpu: Vec::new(),
            reaper: reaper(),
            settings,
        })
    }

    /// What each NIC can do with GPU memory (`ptrSupport`), as `RAILOVER_GDR`,
    /// `gdr_hca` (`RAILOVER_GDR_HCA`) and the checks under `sysfs_root` decide: a dma-buf
    /// probe on each device, opened for it (and kept open, as the fabric's). Lanes made
    /// afterwards refuse the GPU memory their NIC cannot take.
    pub fn gpu_memory(
        &mut self,
        sysfs_root: &std::path::Path,
        gdr_hca: &crate::config::HcaFilter,
    ) -> Vec<GpuMemory> {
        let peer = gpu::peermem(sysfs_root);
        let gdr = self.settings.gdr;
        self.gpu = (0..self.verbs.len())
            .map(|nic| {
                let n = &self.verbs[nic];
                let selected = gdr_hca.selects(&n.device, n.port);
                gpu::of_device(gdr, selected, peer, || self.domain(nic))
            })
            .collect();
        self.gpu.clone()
    }

    /// What `regMr` registers with on each NIC (after [`VerbsFabric::gpu_memory`], whose
    /// verdicts they apply): every NIC's device opened now, as its first lane would, so
    /// the reactor reads its async events from the start. `None` for a NIC whose device
    /// cannot be opened; its lanes will say why.
    pub fn registrars(&mut self) -> Vec<Option<Registrar>> {
        (0..self.verbs.len())
            .map(|nic| {
                let dom = self.domain(nic).ok()?;
                Some(Registrar::new(
                    dom,
                    self.verbs[nic].clone(),
                    self.settings,
                    self.gpu.get(nic).cloned(),
                ))
            })
            .collect()
    }

    /// The device of NIC `nic`, opened the first time.
    fn domain(&mut self, nic: usize) -> io::Result<Arc<Domain>> {
        let device = &self.nic(nic)?.device;
        if let Some(d) = self.domains.iter().find(|d| d.name() == device) {
            return Ok(d.clone());
        }
        let d = Domain::open(device)?;
        self.domains.push(d.clone());
        Ok(d)
    }

    fn nic(&self, nic: usize) -> io::Result<&VerbsNic> {
        self.verbs.get(nic).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no NIC {nic} (the verbs fabric has {})", self.verbs.len()),
            )
        })
    }
}

/// A listener of the verbs fabric: the bootstrap TCP listener on the NIC's address.
#[derive(Debug)]
pub struct VerbsListen(mio::net::TcpListener);

impl Fabric for VerbsFabric {
    type Listener = VerbsListen;
    type Lane = VerbsLane;

    fn nics(&self) -> &[FabricNic] {
        &self.nics
    }

    /// The port whose RoCE netdev is `ifname` (the port goes down with its netdev's
    /// carrier), else the device's own name.
    fn nic_of_link(&self, ifname: &str) -> Option<usize> {
        self.verbs
            .iter()
            .position(|n| n.netdev.as_deref() == Some(ifname))
            .or_else(|| self.nics.iter().position(|n| n.name == ifname))
    }

    /// Each device's async-event fd. The fabric reads the events: port changes go to the
    /// reactor, and faults of a lane's QP or port are filed in the device for the lane.
    fn carrier_fds(&mut self) -> Vec<std::os::fd::RawFd> {
        let mut fds = Vec::new();
        for nic in 0..self.verbs.len() {
            let d = self.verbs[nic].device.clone();
            if self.verbs[..nic].iter().any(|n| n.device == d) {
                continue;
            }
            match self.domain(nic).and_then(|dom| dom.ctx.async_fd()) {
                Ok(fd) => fds.push(fd),
                Err(e) => tracing::warn!(
                    "railover: cannot watch {d}'s async events ({e}); its ports' state comes from netlink and lane timeouts"
                ),
            }
        }
        fds
    }

    fn carrier_events(&mut self) -> Vec<(usize, bool)> {
        let mut out = Vec::new();
        for dom in &self.domains {
            while let Some(ev) = dom.ctx.next_async_event() {
                dom.note(&ev);
                out.extend(carrier_of(&self.verbs, dom.name(), &ev));
            }
        }
        out
    }

    fn listen(&mut self, nic: usize) -> io::Result<(VerbsListen, SocketAddr)> {
        self.nic(nic)?;
        let ip = self.nics[nic].ip;
        let sock = Socket::new(
            socket2::Domain::for_address(SocketAddr::new(ip, 0)),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        sock.set_reuse_address(true)?;
        sock.set_nonblocking(true)?;
        sock.bind(&SockAddr::from(SocketAddr::new(ip, 0)))?;
        sock.listen(crate::transport::LISTEN_BACKLOG)?;
        let l = mio::net::TcpListener::from_std(sock.into());
        let addr = l.local_addr()?;
        Ok((VerbsListen(l), addr))
    }

    fn accept(&mut self, l: &mut VerbsListen) -> io::Result<Option<(VerbsLane, Option<usize>)>> {
        loop {
            return match l.0.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let ip = stream.local_addr()?.ip();
                    let Some(nic) = self.nics.iter().position(|n| n.ip == ip) else {
                        // Not one of ours (a wildcard listener would be): drop it.
                        continue;
                    };
                    let dom = self.domain(nic)?;
                    let lane =
                        VerbsLane::new(&dom, &self.verbs[nic], stream, &self.settings, true)?
                            .taking(self.gpu.get(nic).cloned());
                    Ok(Some((lane, Some(nic))))
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    fn connect(&mut self, nic: usize, to: SocketAddr) -> io::Result<VerbsLane> {
        let from: IpAddr =
            self.nics.get(nic).map(|n| n.ip).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no NIC {nic}"))
            })?;
        let sock = Socket::new(
            socket2::Domain::for_address(to),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        sock.set_nonblocking(true)?;
        sock.set_nodelay(true)?;
        if from.is_ipv4() == to.is_ipv4() {
            sock.bind(&SockAddr::from(SocketAddr::new(from, 0)))?;
        }
        match sock.connect(&SockAddr::from(to)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(e),
        }
        Ok(VerbsLane::new(
            &self.domain(nic)?,
            &self.verbs[nic],
            mio::net::TcpStream::from_std(sock.into()),
            &self.settings,
            false,
        )?
        .taking(self.gpu.get(nic).cloned()))
    }

    fn read(
        &mut self,
        lane: &mut VerbsLane,
        reader: &mut FrameReader,
    ) -> Result<Option<Inbound>, ReadError> {
        // What the peer wrote before the lane failed is read first (its last words, such
        // as a `Stalled` before it sealed its end, say why); then the error.
        if let Err(e) = lane.pump() {
            if !lane.has_unread() {
                return Err(e.into());
            }
        }
        let got = loop {
            match reader.next(lane) {
                // The peer offers a receive to be written in place: the lane's business.
                Ok(Some(Inbound::Frame(h, body))) if h.kind == Kind::Place => {
                    let offer = lane::Offer::of_frame(&h, &body)
                        .ok_or(WireError::Malformed("Place body"))?;
                    lane.offer(h.seq, offer);
                }
                got => break got,
            }
        };
        // Credit for what this read consumed (a failed lane's error waits for its bytes).
        match lane.pump() {
            Err(e) if !matches!(got, Ok(Some(_))) => Err(e.into()),
            _ => got,
        }
    }

    fn write(&mut self, lane: &mut VerbsLane, writer: &mut FrameWriter) -> io::Result<()> {
        lane.pump()?;
        writer.flush_placing(lane)
    }

    fn unread(&self, lane: &VerbsLane) -> bool {
        lane.has_unread()
    }

    fn peer(&self, lane: &VerbsLane) -> Option<std::net::IpAddr> {
        lane.peer()
    }

    fn progress(&self, lane: &VerbsLane) -> LaneProgress {
        let (sent, acked) = lane.progress();
        LaneProgress {
            sent,
            acked,
            placed: lane.placed(),
        }
    }

    /// The QPs and rings of an accepted lane are set up now, and not before.
    fn authenticated(&mut self, lane: &mut VerbsLane) {
        lane.authenticated();
    }

    fn fence(&mut self, lane: &mut VerbsLane) {
        lane.fence();
    }

    fn seal(&mut self, lane: &mut VerbsLane) {
        lane.seal();
    }

    /// The lane's last acknowledgements and its teardown happen on the reaper thread:
    /// tearing a lane down can block (on Soft-RoCE the reactor was once held, and every
    /// comm with it, for as long as the lane's port was down; its QP destroy waits for
    /// the QP's kernel tasks to go idle), and lingering takes up to 200 ms.
    fn close(&mut self, lane: VerbsLane) {
        let lane = match &self.reaper {
            Some(tx) => match tx.send(lane) {
                Ok(()) => return,
                Err(back) => back.0,
            },
            None => lane,
        };
        bury(lane);
    }
}

/// A lane's end: what its peer was sent is acknowledged (briefly waited for unless it was
/// fenced), then its QPs, rings and CQ go.
fn bury(mut lane: VerbsLane) {
    lane.linger();
    drop(lane);
}

/// The thread that tears closed lanes down, off the reactor; it ends with the fabric.
fn reaper() -> Option<std::sync::mpsc::Sender<VerbsLane>> {
    let (tx, rx) = std::sync::mpsc::channel::<VerbsLane>();
    let spawned = std::thread::Builder::new()
        .name("railover-verbs-reaper".into())
        .spawn(move || rx.into_iter().for_each(bury));
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(
                "railover: no thread to close verbs lanes on ({e}); the reactor closes them itself"
            );
            None
        }
    }
}

impl Source for VerbsListen {
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

/// What async event `ev` of device `device` says about the carrier of `nics`' ports:
/// `PORT_ERR` is that port down, `PORT_ACTIVE` up, `DEVICE_FATAL` every port down.
pub fn carrier_of(nics: &[VerbsNic], device: &str, ev: &sys::AsyncEvent) -> Vec<(usize, bool)> {
    use sys::event::{DEVICE_FATAL, PORT_ACTIVE, PORT_ERR};
    let (up, port) = match (ev.kind, ev.port) {
        (PORT_ACTIVE, Some(p)) => (true, Some(p)),
        (PORT_ERR, Some(p)) => (false, Some(p)),
        (DEVICE_FATAL, _) => (false, None),
        _ => return Vec::new(),
    };
    (nics.iter().enumerate())
        .filter(|(_, n)| n.device == device && port.map_or(true, |p| p == n.port))
        .map(|(i, _)| (i, up))
        .collect()
}

/// The `io::Error` a failed completion means, in the kinds [`super::Fabric`] documents:
/// the peer refusing a write or read (it sealed the lane it gave up, or the key is stale)
/// is `PermissionDenied`, a path failure the comm fails over from, not "the peer went
/// away" (a gone peer's QP answers nothing: retries run out); a remote operation error
/// is `ConnectionReset`; retries exhausted is `TimedOut`; a flushed request (the QP was
/// already in error, e.g. fenced) is `ConnectionAborted`; anything else is a path failure
/// with the status text.
pub fn completion_error(c: &Completion) -> io::Error {
    let kind = match c.status {
        wc::REM_ACCESS_ERR | wc::REM_INV_REQ_ERR => io::ErrorKind::PermissionDenied,
        wc::REM_OP_ERR => io::ErrorKind::ConnectionReset,
        wc::RETRY_EXC_ERR | wc::RNR_RETRY_EXC_ERR => io::ErrorKind::TimedOut,
        wc::WR_FLUSH_ERR => io::ErrorKind::ConnectionAborted,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(
        kind,
        format!(
            "verbs completion of wr {} on QP {}: {} (status {}, vendor error {:#x})",
            c.wr_id,
            c.qp_num,
            sys::wc_status_str(c.status),
            c.status,
            c.vendor_err
        ),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sys::{GidEntry, PortAttr};

    pub(crate) fn roce_nic(device: &str, netdev: &str, ip: [u8; 4]) -> VerbsNic {
        let gids = vec![GidEntry {
            index: 3,
            gid: std::net::Ipv4Addr::from(ip).to_ipv6_mapped().octets(),
            gid_type: 2,
            ndev_ifindex: 2,
        }];
        VerbsNic {
            device: device.into(),
            port: 1,
            guid: 1,
            attr: PortAttr {
                state: sys::PORT_ACTIVE,
                link_layer: sys::LINK_LAYER_ETHERNET,
                ..Default::default()
            },
            speed_mbps: 10_000,
            gid_index: device::pick_gid(&gids, sys::LINK_LAYER_ETHERNET),
            gids,
            netdev: Some(netdev.into()),
            pci_path: None,
        }
    }

    #[test]
    fn port_events_are_the_carrier_of_that_port() {
        let mut two_port = roce_nic("mlx5_0", "ens1f0", [192, 0, 2, 1]);
        two_port.port = 2;
        let nics = [
            roce_nic("mlx5_0", "ens1f0", [192, 0, 2, 1]),
            two_port,
            roce_nic("rxe1", "eth1", [198, 51, 100, 1]),
        ];
        let ev = |kind, port| sys::AsyncEvent {
            kind,
            port,
            qp_num: None,
            cq: None,
        };
        use sys::event::*;
        assert_eq!(
            carrier_of(&nics, "mlx5_0", &ev(PORT_ERR, Some(2))),
            [(1, false)]
        );
        assert_eq!(
            carrier_of(&nics, "mlx5_0", &ev(PORT_ACTIVE, Some(1))),
            [(0, true)]
        );
        assert_eq!(
            carrier_of(&nics, "rxe1", &ev(PORT_ERR, Some(1))),
            [(2, false)]
        );
        assert_eq!(
            carrier_of(&nics, "mlx5_0", &ev(DEVICE_FATAL, None)),
            [(0, false), (1, false)]
        );
        assert!(carrier_of(&nics, "rxe1", &ev(PORT_ERR, Some(2))).is_empty());
        assert!(carrier_of(&nics, "rxe7", &ev(PORT_ERR, Some(1))).is_empty());
        assert!(carrier_of(&nics, "rxe1", &ev(PORT_ERR, None)).is_empty());
        assert!(carrier_of(&nics, "rxe1", &ev(QP_FATAL, None)).is_empty());
    }

    #[test]
    fn link_events_name_the_netdev_behind_a_verbs_nic() {
        let f = VerbsFabric::new(vec![
            roce_nic("rxe0", "eth0", [192, 0, 2, 1]),
            roce_nic("rxe1", "eth1", [198, 51, 100, 1]),
            roce_nic("rxe2", "eth2", [203, 0, 113, 1]),
        ])
        .unwrap();
        assert_eq!(f.nics()[1].name, "rxe1");
        assert_eq!(f.nic_of_link("eth1"), Some(1));
        assert_eq!(f.nic_of_link("eth2"), Some(2));
        assert_eq!(f.nic_of_link("rxe0"), Some(0));
        assert_eq!(f.nic_of_link("eth3"), None);
        assert_eq!(f.nic_of_link("lo"), None);
    }

    #[test]
    fn the_default_timing_is_the_settings_default() {
        assert_eq!(qp_timing(&VerbsSettings::default()), QP_TIMING);
        let s = VerbsSettings {
            timeout: 20,
            retry_cnt: 7,
            ..Default::default()
        };
        assert_eq!(
            qp_timing(&s),
            sys::QpTiming {
                timeout: 20,
                retry_cnt: 7
            }
        );
    }

    #[test]
    fn completion_errors_map_to_the_trait_kinds() {
        let c = |status| Completion {
            wr_id: 7,
            status,
            opcode: 0,
            byte_len: 0,
            imm: None,
            qp_num: 42,
            vendor_err: 0,
        };
        for (status, kind) in [
            (wc::REM_ACCESS_ERR, io::ErrorKind::PermissionDenied),
            (wc::REM_INV_REQ_ERR, io::ErrorKind::PermissionDenied),
            (wc::REM_OP_ERR, io::ErrorKind::ConnectionReset),
            (wc::RETRY_EXC_ERR, io::ErrorKind::TimedOut),
            (wc::WR_FLUSH_ERR, io::ErrorKind::ConnectionAborted),
            (wc::LOC_QP_OP_ERR, io::ErrorKind::Other),
        ] {
            let e = completion_error(&c(status));
            assert_eq!(e.kind(), kind, "status {status}");
            assert!(e.to_string().contains("QP 42"), "{e}");
        }
    }
}
