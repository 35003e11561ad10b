//! NCCL's logger, stored once from `init`, and the one place it is called.

use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::types::{
    NcclDebugLogger, NCCL_ALL, NCCL_LOG_INFO, NCCL_LOG_TRACE, NCCL_LOG_WARN, NCCL_NET,
};

/// How a line should appear in NCCL's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Warn,
    Info,
    Trace,
}

static LOGGER: AtomicUsize = AtomicUsize::new(0);

/// Test seam: while capturing, lines meant for NCCL's logger are kept here instead.
/// Rust tests cannot define the C-variadic function NCCL's logger is.
static CAPTURING: AtomicBool = AtomicBool::new(false);
static CAPTURED: Mutex<Vec<(Severity, String)>> = Mutex::new(Vec::new());

/// Test only: from now on, keep every line meant for NCCL's logger for [`captured`].
#[doc(hidden)]
pub fn capture() {
    CAPTURED.lock().clear();
    CAPTURING.store(true, Ordering::Release);
}

/// Test only: the lines kept since [`capture`], in order.
#[doc(hidden)]
pub fn captured() -> Vec<(Severity, String)> {
    CAPTURED.lock().clone()
}

/// Remembers NCCL's logger (it is the same function for every `init`).
pub fn set(f: NcclDebugLogger) {
    if let Some(f) = f {
        LOGGER.store(f as usize, Ordering::Release);
    }
}

/// Sends one line to NCCL's logger with a fixed `"%s"` format. Returns `false` when NCCL
/// gave no logger.
pub fn emit(sev: Severity, file: &str, line: u32, msg: &str) -> bool {
    if CAPTURING.load(Ordering::Acquire) {
        CAPTURED.lock().push((sev, msg.to_string()));
        return true;
    }
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
