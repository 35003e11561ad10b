//! railover: an NCCL network plugin that carries NCCL's inter-node traffic over TCP or
//! RDMA verbs and moves it to healthy NIC pairs when a link fails. The design (promises
//! P1–P9, threads, the lane protocol, the failure model, the test tiers) is
//! `docs/design.md`; code comments cite its sections as `docs/design.md §N`.
//!
//! The layers, top-down (`docs/design.md` §2). A module imports only the modules after it
//! in this list; `tests/layers.rs` checks it.
//! * [`ffi`] — the exported `ncclNetPlugin_v8` … `_v12` tables, the exact `repr(C)` types,
//!   the panic barrier and the one place errors become `ncclResult_t`.
//! * [`plugin`] — the version-independent facade: contexts, devices, listen/connect/accept,
//!   memory handles and requests; it picks the fabric.
//! * [`control`] — the operator's control plane: a Unix socket per process and a watched
//!   drain file, served on one joinable thread (`railover drain|undrain|status`); what a
//!   request does is the plugin's, through [`control::Handler`].
//! * `sim` — the deterministic simulation (test builds only): two reactors driven by hand
//!   over an in-memory network in virtual time. Nothing imports it.
//! * [`reactor`] — the one owner of I/O per process: it owns every socket, QP, `epoll` and
//!   the timers' clock, and feeds readiness and commands to the engine. NCCL's threads
//!   queue commands to it and run its turns themselves while it is free; its own thread
//!   covers what no caller drives.
//! * [`engine`] — sans-IO: comms, lane machines, handshakes, failover orchestration,
//!   pacing and metric sampling; it reaches sockets only through the reactor's `Io`.
//! * [`handoff`] — what `plugin` and `reactor` share: requests whose atomic state `test`
//!   reads, comms, pending connects and listens, the command queue.
//! * [`transport`] — the `Fabric` seam the reactor drives lanes through (listen, connect,
//!   move frames, progress, pacing, fence, seal), implemented for TCP (`transport::tcp`)
//!   and RDMA verbs RC QPs (`transport::verbs`), and the user memory fabrics read and write.
//! * [`conn`] — sans-IO per-comm send/receive machines, lanes' and paths' life across
//!   failures, the handshake and the wire format.
//! * [`telemetry`] — logging into NCCL's logger, Prometheus metrics.
//! * [`routing`] — sans-IO failover policy; the reactor publishes route snapshots
//!   lock-free.
//! * [`config`] — `RAILOVER_*` environment variables parsed into typed values.
//! * [`topology`] — pure data about NICs, GPUs, PCI paths and rails.
//!
//! The `railover` command lives in `cli/`, and the test machinery (namespace testbed,
//! fixture sysfs trees, a Rust driver of the C ABI) in `testkit/`, so neither is part of
//! the library NCCL loads.
#![deny(unsafe_code, unsafe_op_in_unsafe_fn)]

pub mod config;
pub mod conn;
pub mod control;
pub mod engine;
pub mod ffi;
pub mod handoff;
pub mod plugin;
pub mod reactor;
pub mod routing;
#[cfg(test)]
mod sim;
pub mod telemetry;
pub mod topology;
pub mod transport;
