//! Telemetry: log lines into NCCL's logger (or stderr), and counters.
//!
//! It sits above `routing`, `config` and `topology` and below everything else: metrics
//! read `routing`'s snapshot types, and `routing` never imports telemetry (the reactor
//! hands routing's counters over). NCCL's logger is reached through a function `ffi`
//! installs ([`log::set_nccl_sink`]), not by importing `ffi`.

pub mod exporter;
pub mod log;
pub mod metrics;
pub mod sampler;
