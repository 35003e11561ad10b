//! railover's test machinery, kept out of the plugin library NCCL loads. The `railover`
//! command (demo, bench, fault-peer, doctor's tests) and the test tiers use it.
//!
//! * [`driver`] — a safe Rust client of the exported `ncclNetPlugin_v12` table, driving it
//!   as NCCL's proxy does.
//! * [`fault_line`] — the JSON lines `railover fault-peer` prints and reads, as types
//!   both the peer and the tests that judge it use.
//! * [`kept`] — what a collective keeps across a failover, from `fault-peer` ticks: steady
//!   windows, the slowest comm, kept ratios, time series.
//! * [`fixture`] — synthetic sysfs trees, laid out like `/sys`, for topology and doctor
//!   tests. The plugin's own topology unit tests compile the same file in (they cannot
//!   link this crate: it links a second copy of the plugin's exported tables).
//! * [`testbed`] — two network namespaces joined by shaped veth pairs, for the fault
//!   tier and `railover demo`: real links to cut, slow and flap.
#![deny(unsafe_code)]

// Calls through the plugin's C function table, as NCCL does; each block says why.
#[allow(unsafe_code)]
pub mod driver;
pub mod fault_line;
pub mod fixture;
pub mod kept;
pub mod testbed;
