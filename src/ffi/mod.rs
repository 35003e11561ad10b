//! The C boundary with NCCL.
//!
//! Rules every entry point follows (NCCL's, which differ from usual C conventions):
//! * `*request` is always written: a request, or NULL meaning "call again later"; a
//!   value NCCL pre-stored there (`0x1`, a stale pointer) is overwritten.
//! * `connect` and `accept` return success with a NULL comm until the comm is ready.
//! * `deregMr(comm, NULL)` succeeds; `iflush` returns a NULL request for host memory, and
//!   for GPU memory one that `test` completes when the flush READs have.
//! * NULL or unknown handles return `ncclInvalidArgument`; a panic returns
//!   `ncclInternalError` ([`boundary`]); no unwind ever crosses into NCCL. After a panic
//!   of the reactor thread, `listen`, `connect`, `accept`, `regMr`, `isend`, `irecv` and
//!   `test` of a pending request return `ncclInternalError`; closes still succeed.
//! * Legal NULLs (`sizes` in `test`, `sendDevComm`, profiler handles) are not errors.
//! * In a child forked from a process whose plugin is initialised, every entry point,
//!   `init` included, returns `ncclSystemError` at once, with one WARN per process
//!   ([`crate::plugin::check_process`]): the reactor thread is not in the child.
//!
//! `unsafe` is allowed in this module and in each fabric's own `transport/*/sys` only;
//! each block says why it is sound.
#![allow(unsafe_code)]

pub mod boundary;
pub mod error;
pub mod exports;
pub mod fork;
pub mod handle;
pub mod limits;
pub mod logger;
pub mod types;
