//! The plugin's side of the control socket (`control::Handler`): an operator's request
//! becomes a reactor command, and the control thread waits a bounded time for the answer
//! (`docs/design.md` §5.8). The reactor runs it between turns, as it runs NCCL's calls,
//! so a drain needs no lock on the engine.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use crate::control::{Handler, Request, Source};
use crate::handoff::{Command, CommandQueue, DrainSource};

/// How long the control thread waits for the reactor. A reactor that is alive answers
/// within a turn; one that does not is stuck or gone.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Asks the reactor of this process.
pub struct Operator {
    queue: Arc<CommandQueue>,
    /// `LOCAL_RANK` and its twins, for `railover status`.
    local_rank: Option<u16>,
}

impl Operator {
    pub fn new(queue: Arc<CommandQueue>, local_rank: Option<u16>) -> Operator {
        Operator { queue, local_rank }
    }

    fn ask<T>(&self, make: impl FnOnce(mpsc::SyncSender<T>) -> Command) -> Result<T, String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.queue.push(make(tx));
        rx.recv_timeout(ANSWER_WITHIN).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => format!(
                "the reactor did not answer within {} s",
                ANSWER_WITHIN.as_secs()
            ),
            mpsc::RecvTimeoutError::Disconnected => {
                "the reactor is stopped (finalised, or failed)".to_owned()
            }
        })
    }
}

impl Handler for Operator {
    fn handle(&self, request: Request, source: Source) -> Result<serde_json::Value, String> {
        let source = match source {
            Source::Socket => DrainSource::Socket,
            Source::File => DrainSource::File,
        };
        let drain = |nic, on| {
            let said = self.ask(|reply| Command::Drain {
                nic,
                on,
                source,
                reply,
            })??;
            Ok(serde_json::Value::String(said))
        };
        match request {
            Request::Status => {
                let status = self.ask(|reply| Command::Status { reply })?;
                let mut v = serde_json::to_value(status).map_err(|e| e.to_string())?;
                if let Some(o) = v.as_object_mut() {
                    o.insert("pid".into(), std::process::id().into());
                    o.insert("local_rank".into(), self.local_rank.into());
                }
                Ok(v)
            }
            Request::Drain { nic } => drain(nic, true),
            Request::Undrain { nic } => drain(nic, false),
        }
    }
}
