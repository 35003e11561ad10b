//! Telemetry: log lines into NCCL's logger (or stderr), and counters.

pub mod log;
