//! Memory NCCL lends the plugin for the life of a request.
//!
//! [`UserBuf`] is the request's one handle on that memory: move-only, made only by the
//! `unsafe` [`UserBuf::new`] (called from `ffi`), and kept with the request by the
//! reactor. The frame reader and writer copy into and out of it through [`LentBuf`]
//! views of it. Neither type is `Clone`.
//!
//! Reading and writing through a [`LentBuf`] is safe code that relies on the contract of
//! [`UserBuf::new`]; the reactor keeps its side of it (see there). Every `unsafe` block
//! on user memory is here.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;

use super::Region;

/// A buffer NCCL passed to `isend`/`irecv`, with the registration NCCL passed for it.
#[derive(Debug)]
pub struct UserBuf {
    ptr: *mut u8,
    len: usize,
    region: Option<Arc<Region>>,
}

// SAFETY: the buffer is owned by NCCL for the request's lifetime and accessed by exactly
// one plugin thread (the reactor) at a time; the pointer is just an address to move.
unsafe impl Send for UserBuf {}

impl UserBuf {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes (or `len` must be 0), and
    /// nothing but the plugin may access them, from this call until the plugin reports the
    /// request finished (`test`) or confirms its comm closed (`closeSend`/`closeRecv`),
    /// which is NCCL's `isend`/`irecv` contract.
    ///
    /// The plugin's side, which makes [`LentBuf::slice`] and [`LentBuf::slice_mut`] sound:
    /// the buffer and its views are used on the reactor thread only, never after that
    /// point, and a slice of a view lives for one copy or one system call.
    pub(crate) unsafe fn new(ptr: *mut c_void, len: usize) -> UserBuf {
        UserBuf {
            ptr: ptr.cast(),
            len,
            region: None,
        }
    }

    /// Names the registration (`regMr`) the buffer lies in, so that a fabric that moves
    /// bytes with its NIC can register it there. The caller checked that it does.
    pub fn attach(&mut self, region: Arc<Region>) {
        self.region = Some(region);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps only the first `len` bytes (a send cut to its receive's size); a larger
    /// `len` changes nothing.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The address, for range checks against memory registrations.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// A view for the frame reader (to fill) or writer (to send from), under the contract
    /// of [`UserBuf::new`].
    pub fn lend(&self) -> LentBuf {
        LentBuf {
            ptr: self.ptr,
            len: self.len,
            region: self.region.clone(),
        }
    }
}

/// A view of a [`UserBuf`] held by a lane's frame reader or writer.
#[derive(Debug)]
pub struct LentBuf {
    ptr: *mut u8,
    len: usize,
    region: Option<Arc<Region>>,
}

// SAFETY: as for `UserBuf`: the reactor is the one thread that uses the views.
unsafe impl Send for LentBuf {}

impl LentBuf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address, for a NIC to read or write it in place.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The registration the buffer lies in, when NCCL named one.
    pub fn region(&self) -> Option<&Arc<Region>> {
        self.region.as_ref()
    }

    /// Whether the CPU may copy the buffer: not GPU memory (see [`Region::cpu_reachable`]).
    pub fn cpu_reachable(&self) -> bool {
        self.region.as_ref().map_or(true, |r| r.cpu_reachable())
    }

    /// Bytes `off..off + n` of the buffer (clamped to its length; empty for GPU memory,
    /// which the CPU must not touch: callers check [`LentBuf::cpu_reachable`] first).
    pub fn slice(&self, off: usize, n: usize) -> &[u8] {
        let (off, n) = self.clamp(off, n);
        if n == 0 {
            return &[];
        }
        // SAFETY: in bounds by `clamp`; valid and not written meanwhile by the contract
        // of `UserBuf::new`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    /// Writable bytes `off..off + n` of the buffer (clamped to its length; empty for GPU
    /// memory).
    pub fn slice_mut(&mut self, off: usize, n: usize) -> &mut [u8] {
        let (off, n) = self.clamp(off, n);
        if n == 0 {
            return &mut [];
        }
        // SAFETY: in bounds by `clamp`; valid and not accessed otherwise meanwhile by the
        // contract of `UserBuf::new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }

    fn clamp(&self, off: usize, n: usize) -> (usize, usize) {
        if self.ptr.is_null() || !self.cpu_reachable() {
            return (0, 0);
        }
        let off = off.min(self.len);
        (off, n.min(self.len - off))
    }
}

#[cfg(test)]
impl UserBuf {
    /// Test helper: a buffer over memory that lives for good and is the caller's no more.
    pub(crate) fn of_slice(s: &'static mut [u8]) -> UserBuf {
        UserBuf {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            region: None,
        }
    }
}

/// Test only (and the fuzz harness): memory the deterministic simulation lends the reactor, freed when the last
/// holder lets go. The simulation keeps one holder until its reactors are gone, so the
/// memory outlives every [`UserBuf`] and view made from it.
#[cfg(any(test, feature = "fuzz-harness"))]
#[derive(Debug)]
pub(crate) struct SimMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the simulation drives its reactors on its own thread; the pointer only moves.
#[cfg(any(test, feature = "fuzz-harness"))]
unsafe impl Send for SimMem {}
// SAFETY: as above; `bytes` is called between reactor steps, never during one.
#[cfg(any(test, feature = "fuzz-harness"))]
unsafe impl Sync for SimMem {}

#[cfg(any(test, feature = "fuzz-harness"))]
impl SimMem {
    pub(crate) fn new(data: Vec<u8>) -> SimMem {
        let len = data.len();
        let ptr = Box::into_raw(data.into_boxed_slice()).cast::<u8>();
        SimMem { ptr, len }
    }

    /// A buffer over all of it, for one request.
    pub(crate) fn user_buf(&self) -> UserBuf {
        UserBuf {
            ptr: self.ptr,
            len: self.len,
            region: None,
        }
    }

    /// Where the memory starts.
    #[cfg(test)]
    pub(crate) fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// A NIC's write of `bytes` at `addr`, between reactor steps; `false` (nothing
    /// written) when they do not lie inside the memory.
    #[cfg(test)]
    pub(crate) fn land(&self, addr: usize, bytes: &[u8]) -> bool {
        let Some(off) = addr.checked_sub(self.ptr as usize) else {
            return false;
        };
        if off
            .checked_add(bytes.len())
            .map_or(true, |end| end > self.len)
        {
            return false;
        }
        // SAFETY: `off..off + bytes.len()` lies inside the `len` bytes `self` owns; the
        // simulation lands writes between reactor steps, when no view of the memory is
        // being read or written.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(off), bytes.len()) };
        true
    }

    /// A copy of the bytes, read between reactor steps (once the request is finished).
    pub(crate) fn bytes(&self) -> Vec<u8> {
        if self.len == 0 {
            return Vec::new();
        }
        // SAFETY: `ptr` holds `len` initialised bytes owned by `self`; the simulation reads
        // them on the reactor's thread between steps, so nothing writes meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

#[cfg(any(test, feature = "fuzz-harness"))]
impl Drop for SimMem {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of that length,
        // and this is its one owner.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

#[cfg(any(test, feature = "fuzz-harness"))]
mod tests {
    use super::*;

    /// Does not compile if `UserBuf` or `LentBuf` become `Clone` (or `Copy`): the call to
    /// `check` would then match two impls.
    trait NotClone<A> {
        fn check() {}
    }
    impl<T> NotClone<()> for T {}
    struct IsClone;
    impl<T: Clone> NotClone<IsClone> for T {}
    const _: fn() = || {
        <UserBuf as NotClone<_>>::check();
        <LentBuf as NotClone<_>>::check();
    };

    #[test]
    fn views_see_the_buffer_and_stay_in_bounds() {
        let buf = UserBuf::of_slice(Vec::leak((0..10u8).collect()));
        let mut w = buf.lend();
        w.slice_mut(8, 5).copy_from_slice(&[7, 7]);
        let r = buf.lend();
        assert_eq!(r.slice(6, 100), &[6, 7, 7, 7]);
        assert_eq!(r.slice(20, 1), &[] as &[u8], "past the end");
        assert_eq!(r.len(), 10);
        // SAFETY: a NULL buffer of length 0 is what NCCL passes for an empty message.
        let empty = unsafe { UserBuf::new(std::ptr::null_mut(), 0) };
        assert!(empty.lend().slice(0, 1).is_empty());
    }
}
