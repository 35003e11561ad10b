//! The RDMA verbs fabric, on rdma-mummy-sys (libibverbs opened at run time).
//!
//! What is here: the raw calls and their owned wrappers ([`sys`]), and device discovery
//! with GID and speed selection ([`device`]). The lane (RC QPs behind [`super::Fabric`])
//! is not written yet: `RAILOVER_TRANSPORT=auto` uses TCP, and the verbs devices found are
//! only reported (`railover doctor`) and exercised by `railover verbs-check` in the
//! Soft-RoCE tier (`scripts/verbs-tier.sh`).

pub mod device;
pub mod sys;

pub use device::{discover, Discovery, VerbsNic};

/// QP timing: 4.096 us * 2^16 = 268 ms per attempt, 7 attempts, so the NIC gives up after
/// about 1.9 s. railover's own completion timeout (1 s by default) decides before that;
/// NCCL's defaults (`NCCL_IB_TIMEOUT=20`, `RETRY_CNT=7`) keep a dead path for about 34 s.
/// Not 7 retries: Soft-RoCE (rxe) takes a retry count of 7 as "retry forever" (seen in the
/// Soft-RoCE tier: a write to a fenced peer never completed).
pub const QP_TIMING: sys::QpTiming = sys::QpTiming {
    timeout: 16,
    retry_cnt: 6,
};

use std::io;

use sys::{wc, Completion};

/// The `io::Error` a failed completion means, in the kinds [`super::Fabric`] documents:
/// the peer refusing our access (its QP or memory is gone) is `ConnectionReset`, "the
/// peer went away"; retries exhausted is `TimedOut`; a flushed request (the QP was
/// already in error, e.g. fenced) is `ConnectionAborted`; anything else is a path failure
/// with the status text.
pub fn completion_error(c: &Completion) -> io::Error {
    let kind = match c.status {
        wc::REM_ACCESS_ERR | wc::REM_INV_REQ_ERR | wc::REM_OP_ERR => io::ErrorKind::ConnectionReset,
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
mod tests {
    use super::*;

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
            (wc::REM_ACCESS_ERR, io::ErrorKind::ConnectionReset),
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
