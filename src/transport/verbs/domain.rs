//! One opened device, shared by every lane on it: its context, one protection domain
//! (so user memory is registered once per device, for all its lanes), the faults its
//! async events reported, and its flush QP ([`Flusher`], made on first use). The fabric
//! opens it once, reads its async-event fd (an fd can be in the reactor's poll once
//! only), and files what concerns a lane here, where the lane looks at each turn.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::device::VerbsNic;
use super::flush::{Flusher, SharedFlusher};
use super::sys::{event, AsyncEvent, Context, Pd};
use crate::config::VerbsSettings;

/// Process-wide numbering of domains: the key a registration is filed under in a
/// [`Region`](crate::transport::memory::Region).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Faulted QPs remembered at most (QP numbers of lanes long gone are dropped first).
const MAX_FAULTED_QPS: usize = 1024;

#[derive(Debug)]
pub struct Domain {
    pub ctx: Arc<Context>,
    pub pd: Arc<Pd>,
    pub id: u64,
    faults: Mutex<Faults>,
    /// The device's flush QP, once something flushed (see [`Domain::flusher`]).
    flusher: Mutex<Option<SharedFlusher>>,
}

#[derive(Debug, Default)]
struct Faults {
    /// QPs an event declared broken (`QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR`).
    qps: Vec<(u32, u32)>,
    /// Ports down since their `PORT_ERR`, until `PORT_ACTIVE`.
    ports_down: Vec<u8>,
    /// CQs an event declared overrun (`CQ_ERR`): their lanes fail, no other.
    cqs: Vec<usize>,
    /// `DEVICE_FATAL`: every lane of the device fails.
    fatal: Option<u32>,
}

impl Domain {
    pub fn open(device: &str) -> io::Result<Arc<Domain>> {
        let ctx = Context::open(device)?;
        // Non-blocking before anything reads it: only the fabric does, on readiness.
        ctx.async_fd()?;
        let pd = Pd::new(&ctx)?;
        Ok(Arc::new(Domain {
            ctx,
            pd,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            faults: Mutex::new(Faults::default()),
            flusher: Mutex::new(None),
        }))
    }

    pub fn name(&self) -> &str {
        self.ctx.name()
    }

    /// Files async event `ev` for the lanes.
    pub fn note(&self, ev: &AsyncEvent) {
        note(&mut self.faults.lock(), ev);
    }

    /// Why the CQ `cq` ([`Cq::id`](super::sys::Cq::id)) lost completions, if an event
    /// said so: what waits on it must not wait any longer.
    pub fn cq_fault(&self, cq: usize) -> Option<String> {
        let f = self.faults.lock();
        f.cqs.contains(&cq).then(|| {
            format!(
                "verbs async event CQ_ERR on {}: a completion queue overran",
                self.name()
            )
        })
    }

    /// CQ `cq` is being destroyed: its fault goes with it (the address may be reused).
    pub fn forget_cq(&self, cq: usize) {
        self.faults.lock().cqs.retain(|&c| c != cq);
    }

    /// QPs `qps` are being destroyed: their faults go with them, since the device may
    /// hand their numbers to new QPs, whose lanes an old fault would fail.
    pub fn forget_qps(&self, qps: &[u32]) {
        if !qps.is_empty() {
            forget(&mut self.faults.lock(), qps);
        }
    }

    /// Why a lane on `port` with QPs `qps` must fail, if an event said so.
    pub fn fault(&self, port: u8, qps: &[u32]) -> Option<String> {
        fault(&self.faults.lock(), self.name(), port, qps)
    }

    /// The device's flush QP, shared by every caller (the reactor and NCCL's threads
    /// lock it to post and to test). Made on the first call, on `nic`'s port (a port of
    /// this device) with `settings`' QP timing; later calls get the same one whatever
    /// they pass, until a READ on it fails: then the next call makes a fresh one (who
    /// still holds the broken one keeps getting its error). A failure to make one is
    /// returned and nothing is kept, so the next call tries again.
    ///
    /// Not to be called while holding the flusher's own lock: this locks it to see
    /// whether it is broken.
    pub fn flusher(&self, nic: &VerbsNic, settings: &VerbsSettings) -> io::Result<SharedFlusher> {
        let mut slot = self.flusher.lock();
        if let Some(f) = slot.as_ref().filter(|f| !f.lock().is_broken()) {
            return Ok(f.clone());
        }
        if let Some(old) = slot.take() {
            let (q, cq) = {
                let o = old.lock();
                (o.qp_num(), o.cq_id())
            };
            self.forget_qps(&[q]);
            self.forget_cq(cq);
        }
        let f = Arc::new(Mutex::new(Flusher::new(&self.pd, nic, settings)?));
        *slot = Some(f.clone());
        Ok(f)
    }
}

fn note(f: &mut Faults, ev: &AsyncEvent) {
    match (ev.kind, ev.port, ev.qp_num) {
        (event::PORT_ERR, Some(p), _) if !f.ports_down.contains(&p) => f.ports_down.push(p),
        (event::PORT_ACTIVE, Some(p), _) => f.ports_down.retain(|&d| d != p),
        (event::CQ_ERR, _, _) => match ev.cq {
            Some(cq) => {
                if f.cqs.len() == MAX_FAULTED_QPS {
                    f.cqs.remove(0);
                }
                f.cqs.push(cq);
            }
            // Which CQ is not known: every lane's may be the one.
            None => {
                f.fatal.get_or_insert(ev.kind);
            }
        },
        (event::DEVICE_FATAL, _, _) => {
            f.fatal.get_or_insert(ev.kind);
        }
        (event::QP_FATAL | event::QP_REQ_ERR | event::QP_ACCESS_ERR, _, Some(q)) => {
            if f.qps.len() == MAX_FAULTED_QPS {
                f.qps.remove(0);
            }
            f.qps.push((q, ev.kind));
        }
        _ => {}
    }
}

fn forget(f: &mut Faults, qps: &[u32]) {
    f.qps.retain(|(q, _)| !qps.contains(q));
}

fn fault(f: &Faults, device: &str, port: u8, qps: &[u32]) -> Option<String> {
    if let Some(kind) = f.fatal {
        return Some(format!(
            "verbs async event {kind} on {device}: every lane of the device fails"
        ));
    }
    if f.ports_down.contains(&port) {
        return Some(format!(
            "verbs async event PORT_ERR on {device} port {port}"
        ));
    }
    let (q, kind) = f.qps.iter().find(|(q, _)| qps.contains(q))?;
    Some(format!("verbs async event {kind} on {device} QP {q}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: u32, port: Option<u8>, qp_num: Option<u32>) -> AsyncEvent {
        AsyncEvent {
            kind,
            port,
            qp_num,
            cq: None,
        }
    }

    #[test]
    fn events_reach_the_lanes_they_concern_and_no_other() {
        let mut f = Faults::default();
        note(&mut f, &ev(event::QP_FATAL, None, Some(7)));
        assert!(fault(&f, "rxe0", 1, &[7, 8]).is_some_and(|m| m.contains("QP 7")));
        assert_eq!(fault(&f, "rxe0", 1, &[9]), None, "another lane's QP");
        note(&mut f, &ev(event::PORT_ERR, Some(2), None));
        assert!(fault(&f, "rxe0", 2, &[9]).is_some());
        assert_eq!(fault(&f, "rxe0", 1, &[9]), None, "another port");
        note(&mut f, &ev(event::PORT_ACTIVE, Some(2), None));
        assert_eq!(fault(&f, "rxe0", 2, &[9]), None, "the port came back");
        note(&mut f, &ev(event::DEVICE_FATAL, None, None));
        assert!(
            fault(&f, "rxe0", 1, &[]).is_some(),
            "every lane of the device"
        );
    }

    #[test]
    fn an_overrun_cq_fails_its_own_lanes_not_the_device() {
        let mut f = Faults::default();
        note(
            &mut f,
            &AsyncEvent {
                cq: Some(0x1000),
                ..ev(event::CQ_ERR, None, None)
            },
        );
        assert_eq!(f.fatal, None, "one CQ, not the device");
        assert_eq!(f.cqs, [0x1000]);
        assert_eq!(
            fault(&f, "rxe0", 1, &[7]),
            None,
            "lanes are asked by their CQ"
        );
        // An overrun whose CQ is not known may be anyone's.
        note(&mut f, &ev(event::CQ_ERR, None, None));
        assert!(fault(&f, "rxe0", 1, &[7]).is_some());
    }

    #[test]
    fn a_destroyed_qps_fault_does_not_follow_its_number() {
        let mut f = Faults::default();
        note(&mut f, &ev(event::QP_FATAL, None, Some(7)));
        note(&mut f, &ev(event::QP_REQ_ERR, None, Some(8)));
        forget(&mut f, &[7]);
        assert_eq!(
            fault(&f, "rxe0", 1, &[7]),
            None,
            "a new QP given number 7 starts clean"
        );
        assert!(fault(&f, "rxe0", 1, &[8]).is_some(), "QP 8 still lives");
    }

    #[test]
    fn faulted_qps_are_bounded() {
        let mut f = Faults::default();
        for q in 0..(MAX_FAULTED_QPS as u32 + 10) {
            note(&mut f, &ev(event::QP_FATAL, None, Some(q)));
        }
        assert_eq!(f.qps.len(), MAX_FAULTED_QPS);
        assert_eq!(fault(&f, "d", 1, &[0]), None, "the oldest went first");
        assert!(fault(&f, "d", 1, &[MAX_FAULTED_QPS as u32 + 9]).is_some());
    }
}
