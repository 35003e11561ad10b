//! Telling a forked child apart without a system call per NCCL call: a `pthread_atfork`
//! child handler, registered once before the first entry point runs, marks the child of
//! a process whose runtime is running ([`crate::plugin::forked`]). The check on every
//! call is then one relaxed load instead of `getpid`, which NCCL's proxy thread, calling
//! `test` in a tight loop, paid on each call. glibc keys the handler to this shared object
//! and drops it when the object is unloaded. A raw `fork` system call that skips the
//! handlers is not seen; `posix_spawn` and `vfork` + `exec` need not be.

use std::sync::Once;

use crate::plugin;

static WATCH: Once = Once::new();

/// Registers the child handler, once per process.
pub fn watch() {
    WATCH.call_once(|| {
        // SAFETY: the handler is a plain `extern "C" fn` with no arguments that lives as
        // long as this object (glibc unregisters it when the object is unloaded); null
        // prepare and parent handlers are allowed.
        let r = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if r != 0 {
            tracing::warn!(
                "railover: cannot watch for fork (pthread_atfork: {}); a forked child is not told apart",
                std::io::Error::from_raw_os_error(r)
            );
        }
    });
}

/// Runs in the child right after `fork`, on its only thread: only async-signal-safe work
/// (an atomic load and store).
extern "C" fn in_child() {
    plugin::forked();
}
