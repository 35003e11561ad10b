//! Fabric-specific code. Each fabric supplies NIC discovery and the lane I/O the reactor
//! drives; no fabric decides policy.
//!
//! Today there is one fabric, [`tcp`]: a NIC is a network interface, a lane is one TCP
//! stream between a local and a remote interface, carrying the frames of
//! [`crate::conn::wire`]. A verbs fabric (RC QPs) plugs in beside it.

pub mod tcp;
