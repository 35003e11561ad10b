//! The panic barrier around every exported function: a panic becomes
//! `ncclInternalError` and one WARN line, never an unwind into NCCL. It also refuses
//! every call in a child forked from an initialised process
//! ([`crate::plugin::check_process`]), before anything that could wait.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::error;
use super::types::{NcclResult, NCCL_INTERNAL_ERROR, NCCL_SUCCESS};
use crate::handoff::{panic_message, Error};
use crate::plugin;

/// Runs `body` for the entry point `name`, mapping its outcome to `ncclResult_t`.
pub fn guard(name: &'static str, body: impl FnOnce() -> Result<(), Error>) -> NcclResult {
    guard_code(name, || body().map(|()| NCCL_SUCCESS))
}

/// As [`guard`], for a body that may return an error code itself, without a WARN (one
/// already logged for the same failure).
pub fn guard_code(
    name: &'static str,
    body: impl FnOnce() -> Result<NcclResult, Error>,
) -> NcclResult {
    // Before the body, which may take locks or wait for the reactor: neither is safe in
    // a forked child. One WARN per process; later calls fail with the same code quietly.
    super::fork::watch();
    if let Err(e) = plugin::check_process() {
        return match plugin::first_fork_report() {
            true => error::report(name, &e),
            false => error::code(&e),
        };
    }
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => error::report(name, &e),
        Err(panic) => {
            let what = panic_message(&*panic);
            tracing::warn!("railover {name}: internal panic caught at the NCCL boundary: {what}");
            NCCL_INTERNAL_ERROR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_internal_error() {
        assert_eq!(guard("test", || panic!("on purpose")), NCCL_INTERNAL_ERROR);
        assert_eq!(guard("test", || Ok(())), NCCL_SUCCESS);
        assert_eq!(guard("test", || Err(Error::InvalidUsage("x".into()))), 5);
    }
}
