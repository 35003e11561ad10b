//! State shared by NCCL's threads and the reactor: requests, comms and listeners, pending
//! connects and listens, and the command queue between them.
//!
//! Both sides use it and neither owns it: `plugin` (NCCL's threads) creates these
//! objects and queues commands; the reactor takes the commands and writes outcomes back.
//! It sits below `reactor`, so the reactor never reaches up into `plugin` or `ffi`.

pub mod comm;
pub mod error;
pub mod operator;
pub mod queue;
pub mod request;

use std::any::Any;

pub use comm::{
    CommShared, ListenShared, MemoryRegion, PendingConnect, PendingListen, Rescue, Side,
};
pub use error::Error;
pub use operator::{DrainSource, ProcessStatus};
pub(crate) use queue::{Call, Drive};
pub use queue::{Command, CommandQueue, Done, Signal};
pub use request::{Request, Status};

/// The text of a panic payload (`panic!` makes a `&str` or a `String`).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
