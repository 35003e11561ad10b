//! The plugin's error type; `ffi::error` is the one place it becomes an `ncclResult_t`.

use crate::config::ConfigError;
use crate::conn::ConnError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// NCCL passed a NULL or unknown handle or pointer.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The caller broke a rule of use (e.g. a call that needs `init` before it, or
    /// registering GPU memory on a NIC that does not report it in `ptrSupport`).
    #[error("{0}")]
    InvalidUsage(String),
    /// A state the plugin should never reach.
    #[error("internal error: {0}")]
    Internal(String),
    /// The local network or OS failed.
    #[error("system error: {0}")]
    System(String),
    /// The peer failed, closed, or broke the protocol.
    #[error("remote error: {0}")]
    Remote(String),
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
}

impl From<ConnError> for Error {
    fn from(e: ConnError) -> Error {
        match e {
            ConnError::Protocol(_) | ConnError::PeerClosed | ConnError::Gone(_) => {
                Error::Remote(e.to_string())
            }
            ConnError::Io(_)
            | ConnError::Stalled(_)
            | ConnError::Memory(_)
            | ConnError::PeerMemory => Error::System(e.to_string()),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::System(e.to_string())
    }
}
