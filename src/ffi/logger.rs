//! NCCL's logger, stored once from `init`, and the one place it is called.
//! `telemetry::log` decides what to log and reaches it through [`emit`].

use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::types::{
    NcclDebugLogger, NCCL_ALL, NCCL_LOG_INFO, NCCL_LOG_TRACE, NCCL_LOG_WARN, NCCL_NET,
};
use crate::telemetry::log::{set_nccl_sink, Severity};

static LOGGER: AtomicUsize = AtomicUsize::new(0);

/// Remembers NCCL's logger (it is the same function for every `init`).
pub fn set(f: NcclDebugLogger) {
    set_nccl_sink(emit);
    if let Some(f) = f {
        LOGGER.store(f as usize, Ordering::Release);
    }
}

/// Sends one line to NCCL's logger with a fixed `"%s"` format. Returns `false` when NCCL
/// gave no logger.
pub fn emit(sev: Severity, file: &str, line: u32, msg: &str) -> bool {
    let raw = LOGGER.load(Ordering::Acquire);
    if raw == 0 {
        return false;
    }
    // SAFETY: `raw` was stored from a non-null `ncclDebugLogger_t` in `set`; function
    // pointers round-trip through usize on every platform Rust supports.
    let f: unsafe extern "C" fn(
        c_int,
        std::ffi::c_ulong,
        *const std::ffi::c_char,
        c_int,
        *const std::ffi::c_char,
        ...
    ) = unsafe { std::mem::transmute::<usize, _>(raw) };
    let (level, flags) = match sev {
        Severity::Warn => (NCCL_LOG_WARN, NCCL_ALL),
        Severity::Info => (NCCL_LOG_INFO, NCCL_NET),
        Severity::Trace => (NCCL_LOG_TRACE, NCCL_NET),
    };
    let text = CString::new(msg.replace('\0', " ")).expect("NUL bytes removed");
    let file = CString::new(file.replace('\0', " ")).expect("NUL bytes removed");
    // SAFETY: NCCL's logger takes a printf format; we pass the constant "%s" and one
    // NUL-terminated string argument, both alive for the call.
    unsafe {
        f(
            level,
            flags,
            file.as_ptr(),
            line as c_int,
            c"%s".as_ptr(),
            text.as_ptr(),
        )
    };
    true
}
