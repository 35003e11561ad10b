//! ffi
#![allow(unsafe_code)]
pub mod types;
