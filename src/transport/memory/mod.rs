//! User memory: what NCCL lends for a request and what a fabric reads and writes.
//!
//! It lives under `transport`, not `ffi`, because the fabrics are its users: the frame
//! reader and writer copy through it today, and a verbs fabric will register it. `ffi`
//! only makes one, through the `unsafe` `UserBuf::new` whose contract NCCL's
//! `isend`/`irecv` rules fulfil; the raw pointer is touched only in `sys`.

mod sys;

#[cfg(test)]
pub(crate) use sys::SimMem;
pub use sys::{LentBuf, UserBuf};
