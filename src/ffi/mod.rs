//! ffi
#![allow(unsafe_code)]
pub mod buffer;
pub mod types;
