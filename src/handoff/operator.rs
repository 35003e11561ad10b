//! What an operator asks of a process (drain, undrain, status) and what the reactor
//! answers: the control socket's requests cross the command queue in these types
//! (`docs/design.md` §5.8).

use serde::Serialize;

/// Where a drain was asked for. The control socket and the watched drain file each keep
/// their own say, so a file that no longer names a NIC does not undo an operator's
/// `railover drain`, nor the other way round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainSource {
    Socket,
    File,
}

impl DrainSource {
    pub fn as_str(self) -> &'static str {
        match self {
            DrainSource::Socket => "socket",
            DrainSource::File => "file",
        }
    }
}

/// One local NIC in [`ProcessStatus`].
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NicStatus {
    pub index: usize,
    pub name: String,
    pub rail: Option<u32>,
    pub up: bool,
    pub drained: bool,
    /// `socket` and/or `file`.
    pub drained_by: Vec<&'static str>,
    /// Comms with a lane on it now.
    pub comms: usize,
    /// What it can carry (Mbit/s) as backup selection weighs it: its link speed, or the
    /// lower rate it showed while backed up; `None` while neither is known.
    pub capacity_mbit: Option<u64>,
}

/// Comms of each side.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct CommCounts {
    pub send: usize,
    pub recv: usize,
}

/// A send comm away from its original pair.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Degraded {
    pub comm: usize,
    /// Seconds since it first left its original pair.
    pub since_s: f64,
    /// The pairs it runs over now, `local->remote` each: our NIC's name, the peer NIC's
    /// address.
    pub pairs: String,
}

/// What `railover status` shows of this process (the control socket adds pid and rank).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProcessStatus {
    pub nics: Vec<NicStatus>,
    pub comms: CommCounts,
    /// Stripes moved off a failed pair, moved home, and moved off a drained NIC.
    pub failovers: u64,
    pub failbacks: u64,
    pub drains: u64,
    pub degraded: Vec<Degraded>,
}
