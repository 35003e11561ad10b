//! Memory NCCL lends the plugin for the life of a request.

use std::ffi::c_void;

/// A buffer NCCL passed to `isend`/`irecv`. NCCL keeps it valid and leaves it alone until
/// `test` reports the request done; the reactor is the only plugin code that touches it
/// in that window, so handing out slices of it is sound.
#[derive(Debug, Clone, Copy)]
pub struct UserBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned by NCCL for the request's lifetime and accessed by exactly
// one plugin thread (the reactor) at a time; the pointer is just an address to move.
unsafe impl Send for UserBuf {}

impl UserBuf {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the request that
    /// carries this buffer completes, and nothing else may access it meanwhile.
    pub(crate) unsafe fn new(ptr: *mut c_void, len: usize) -> UserBuf {
        UserBuf {
            ptr: ptr.cast(),
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `off..off + n` of the buffer (clamped to its length).
    pub fn slice(&self, off: usize, n: usize) -> &[u8] {
        let (off, n) = self.clamp(off, n);
        if n == 0 {
            return &[];
        }
        // SAFETY: in bounds by `clamp`; validity and exclusivity by the contract of `new`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    /// Writable bytes `off..off + n` of the buffer (clamped to its length).
    pub fn slice_mut(&mut self, off: usize, n: usize) -> &mut [u8] {
        let (off, n) = self.clamp(off, n);
        if n == 0 {
            return &mut [];
        }
        // SAFETY: in bounds by `clamp`; validity and exclusivity by the contract of `new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }

    fn clamp(&self, off: usize, n: usize) -> (usize, usize) {
        if self.ptr.is_null() {
            return (0, 0);
        }
        let off = off.min(self.len);
        (off, n.min(self.len - off))
    }

    /// The address, for range checks against memory registrations.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }
}

#[cfg(test)]
impl UserBuf {
    /// Test helper: a view of `s`. The caller keeps `s` alive and untouched while the
    /// view is in use, which is what NCCL promises for its buffers.
    pub(crate) fn of_slice(s: &mut [u8]) -> UserBuf {
        UserBuf {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }
}
