//! Test-side helpers of the fault tier: the namespace testbed itself is
//! `railover_testkit::testbed` (the demo uses it too); `flow` drives and judges plugin streams.
#![allow(dead_code, unused_imports)]

pub mod flow;

pub use railover_testkit::testbed::*;
