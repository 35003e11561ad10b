//! What the opaque pointers NCCL holds are, and how they are checked.
//!
//! Every object handed to NCCL is an `Arc` registered here under its address. A pointer
//! from NCCL is only ever looked up, never dereferenced, so NULL, unknown, stale or
//! double-closed handles become `ncclInvalidArgument` instead of undefined behaviour.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;

use crate::plugin::{CommShared, Context, Error, ListenShared, MemoryRegion, Request};

/// Live objects of one kind, keyed by the address handed to NCCL.
pub struct Registry<T> {
    what: &'static str,
    map: LazyLock<Mutex<HashMap<usize, Arc<T>>>>,
}

impl<T> Registry<T> {
    const fn new(what: &'static str) -> Registry<T> {
        Registry {
            what,
            map: LazyLock::new(|| Mutex::new(HashMap::new())),
        }
    }

    /// Registers `v` and returns the pointer NCCL will hold.
    pub fn insert(&self, v: Arc<T>) -> *mut c_void {
        let p = Arc::as_ptr(&v) as *mut c_void;
        self.map.lock().insert(p as usize, v);
        p
    }

    pub fn get(&self, p: *mut c_void) -> Result<Arc<T>, Error> {
        if p.is_null() {
            return Err(Error::InvalidArgument(format!("NULL {}", self.what)));
        }
        self.map
            .lock()
            .get(&(p as usize))
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("unknown or closed {} {p:p}", self.what)))
    }

    pub fn remove(&self, p: *mut c_void) -> Result<Arc<T>, Error> {
        if p.is_null() {
            return Err(Error::InvalidArgument(format!("NULL {}", self.what)));
        }
        self.map.lock().remove(&(p as usize)).ok_or_else(|| {
            Error::InvalidArgument(format!("unknown or already closed {} {p:p}", self.what))
        })
    }

    /// Removes every entry that matches (used to forget a closed comm's requests).
    pub fn retain(&self, keep: impl Fn(&T) -> bool) {
        self.map.lock().retain(|_, v| keep(v));
    }

    /// How many objects are registered.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn clear(&self) {
        // Dropped outside the lock: nothing in a drop may call back into the registry.
        let old = std::mem::take(&mut *self.map.lock());
        drop(old);
    }
}

/// Forgets every comm, listener, registration and request (the last `finalize`; contexts
/// are removed one by one by their own `finalize`).
pub(super) fn forget_all() {
    REQUESTS.clear();
    MRS.clear();
    COMMS.clear();
    LISTENS.clear();
}

pub static CONTEXTS: Registry<Context> = Registry::new("context");
pub static LISTENS: Registry<ListenShared> = Registry::new("listen comm");
/// Send and receive comms share one registry: `regMr` takes either.
pub static COMMS: Registry<CommShared> = Registry::new("comm");
pub static MRS: Registry<MemoryRegion> = Registry::new("memory handle");
pub static REQUESTS: Registry<Request> = Registry::new("request");

/// Writes through an out-pointer after a NULL check (NULL: `ncclInvalidArgument`).
///
/// # Safety
/// `p` is NULL or valid for a write of `T`, as NCCL's out-pointers are for the call.
pub(super) unsafe fn write<T>(p: *mut T, v: T, what: &str) -> Result<(), Error> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("NULL {what}")));
    }
    // SAFETY: non-null, so valid and aligned by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// Writes through an out-pointer NCCL may legally pass as NULL.
///
/// # Safety
/// As for [`write()`].
pub(super) unsafe fn write_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: as in `write`.
        unsafe { p.write(v) };
    }
}

/// Reads element `i` of an array NCCL passed, after a NULL check.
///
/// # Safety
/// `p` is NULL or valid for reads of at least `i + 1` elements of `T`.
pub(super) unsafe fn read_at<T: Copy>(p: *const T, i: usize, what: &str) -> Result<T, Error> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("NULL {what}")));
    }
    // SAFETY: non-null, so element `i` is readable by the caller's contract.
    Ok(unsafe { p.add(i).read() })
}

/// The 128-byte handle buffer NCCL passes to `listen`/`connect`.
///
/// # Safety
/// `p` is NULL or points to 128 bytes that nothing else touches for the lifetime `'a`
/// (NCCL_NET_HANDLE_MAXSIZE, byte-aligned, the calling thread's for the call).
pub(super) unsafe fn handle_mut<'a>(p: *mut c_void) -> Result<&'a mut [u8; 128], Error> {
    if p.is_null() {
        return Err(Error::InvalidArgument("NULL handle".into()));
    }
    // SAFETY: non-null, so 128 exclusive bytes for `'a` by the caller's contract.
    Ok(unsafe { &mut *(p as *mut [u8; 128]) })
}
