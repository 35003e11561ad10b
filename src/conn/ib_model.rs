//! NCCL's IB transport's matching of sends to posted receives, transcribed as the
//! reference the plugin is checked against (tests only).
//!
//! Source: NCCL 2.30 (NVIDIA/nccl master at 5067397c), `src/transport/net_ib/p2p.cc`
//! and `common.h`; line numbers below are of that file. Only what decides where a send
//! goes and what size it reports is kept: the receiver writes one FIFO slot per `irecv`
//! into the sender's memory, and `isend` reads the slot at the sender's own head.

/// `NET_IB_MAX_REQUESTS` (common.h:304): `NCCL_NET_MAX_REQUESTS * NCCL_NET_IB_MAX_RECVS`.
const MAX_REQUESTS: usize = 32 * MAX_RECVS;
/// `NCCL_NET_IB_MAX_RECVS` (common.h:161).
const MAX_RECVS: usize = 8;

/// One element of `ctsFifo[slot][r]` (`struct ncclIbSendFifo`): what the receiver wrote.
#[derive(Debug, Clone, Copy, Default)]
struct FifoElem {
    /// `fifoHead + 1` of the receive that wrote it (p2p.cc:512).
    idx: u64,
    nreqs: usize,
    tag: i32,
    size: u64,
}

/// Where `isend` put a send: buffer `index` of the receive posted as `recv` (the
/// receiver's `fifoHead` at its `irecv`), and the size the send reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub recv: u64,
    pub index: usize,
    pub size: u64,
}

/// Both ends of one comm, as far as matching goes.
#[derive(Debug)]
pub struct IbModel {
    /// The sender's `ctsFifo`, which the receiver writes (`ncclIbPostFifo`, p2p.cc:376).
    fifo: Vec<[FifoElem; MAX_RECVS]>,
    /// The receiver's `fifoHead` (p2p.cc:443, 518).
    recv_head: u64,
    /// The sender's `fifoHead` (p2p.cc:278, 355).
    send_head: u64,
    /// `sendReqs[slot][r] != NULL`: taken buffers of each slot (p2p.cc:346).
    taken: Vec<[bool; MAX_RECVS]>,
    /// `sendReqsCnt[slot]` (p2p.cc:348).
    count: Vec<usize>,
}

impl Default for IbModel {
    fn default() -> Self {
        IbModel {
            fifo: vec![[FifoElem::default(); MAX_RECVS]; MAX_REQUESTS],
            recv_head: 0,
            send_head: 0,
            taken: vec![[false; MAX_RECVS]; MAX_REQUESTS],
            count: vec![0; MAX_REQUESTS],
        }
    }
}

impl IbModel {
    /// `ncclIbIrecv` (p2p.cc:430) of `(tag, size)` buffers: returns the receive's id.
    pub fn irecv(&mut self, bufs: &[(i32, u64)]) -> u64 {
        assert!((1..=MAX_RECVS).contains(&bufs.len()), "p2p.cc:438");
        // A slot is used again only after its sends completed (p2p.cc:657-663), which
        // this model leaves out: it covers a comm's first `MAX_REQUESTS` receives.
        assert!(self.recv_head < MAX_REQUESTS as u64, "a slot used twice");
        let id = self.recv_head; // p2p.cc:444: req->id = fifoHead
        let slot = (self.recv_head % MAX_REQUESTS as u64) as usize; // p2p.cc:443
        for (i, &(tag, size)) in bufs.iter().enumerate() {
            // p2p.cc:501-512: every element carries n, its size, its tag, fifoHead + 1.
            self.fifo[slot][i] = FifoElem {
                idx: self.recv_head + 1,
                nreqs: bufs.len(),
                tag,
                size,
            };
        }
        self.recv_head += 1; // p2p.cc:518
        id
    }

    /// `ncclIbIsend` (p2p.cc:262) of `size` bytes with `tag`: where it went, or `None`
    /// for `*request = NULL` (p2p.cc:283, 360).
    pub fn isend(&mut self, tag: i32, size: u64) -> Option<Placed> {
        let slot = (self.send_head % MAX_REQUESTS as u64) as usize; // p2p.cc:278
        let idx = self.send_head + 1; // p2p.cc:281
        if self.fifo[slot][0].idx != idx {
            return None; // p2p.cc:282-284: the receive is not posted yet
        }
        let nreqs = self.fifo[slot][0].nreqs; // p2p.cc:286
                                              // p2p.cc:288-290 spins until every element has arrived; here they all have.
        for r in 0..nreqs {
            let e = self.fifo[slot][r];
            if self.taken[slot][r] || e.tag != tag {
                continue; // p2p.cc:293: taken, or another tag
            }
            let size = size.min(e.size); // p2p.cc:295
            let recv = self.send_head; // p2p.cc:308: req->id = fifoHead
            self.taken[slot][r] = true; // p2p.cc:346
            self.count[slot] += 1; // p2p.cc:348
            if self.count[slot] == nreqs {
                self.send_head += 1; // p2p.cc:350-355: all matched, the head moves
            }
            return Some(Placed {
                recv,
                index: r,
                size,
            });
        }
        None // p2p.cc:360: no free buffer with this tag
    }
}
