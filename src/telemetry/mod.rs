//! Telemetry: log lines into NCCL's logger (or stderr), and counters.

pub mod exporter;
pub mod log;
pub mod metrics;
pub mod sampler;
