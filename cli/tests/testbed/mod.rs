//! Test-side helpers of the fault tier: the namespace testbed itself is
//! `railover_testkit::testbed` (the demo uses it too); `flow` drives and judges plugin
//! streams between one pair of processes, `mesh` between many senders and receivers.
#![allow(dead_code, unused_imports)]

pub mod flow;
pub mod mesh;

pub use railover_testkit::testbed::*;
