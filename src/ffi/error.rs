//! The one mapping from [`Error`] to `ncclResult_t`, and the WARN that goes with it.

use super::types::{
    NcclResult, NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR,
    NCCL_SYSTEM_ERROR,
};
use crate::plugin::Error;

/// The code NCCL receives for `e`.
pub fn code(e: &Error) -> NcclResult {
    match e {
        Error::InvalidArgument(_) | Error::Config(_) => NCCL_INVALID_ARGUMENT,
        Error::InvalidUsage(_) => NCCL_INVALID_USAGE,
        Error::Internal(_) => NCCL_INTERNAL_ERROR,
        Error::System(_) => NCCL_SYSTEM_ERROR,
        Error::Remote(_) => NCCL_REMOTE_ERROR,
    }
}

/// Logs one WARN naming the entry point (NCCL keeps it as its last error) and returns
/// the code.
pub fn report(entry: &str, e: &Error) -> NcclResult {
    tracing::warn!("railover {entry}: {e}");
    code(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigError;

    #[test]
    fn every_error_has_its_code() {
        let s = || "x".to_string();
        assert_eq!(code(&Error::InvalidArgument(s())), 4);
        assert_eq!(code(&Error::InvalidUsage(s())), 5);
        assert_eq!(code(&Error::Internal(s())), 3);
        assert_eq!(code(&Error::System(s())), 2);
        assert_eq!(code(&Error::Remote(s())), 6);
        let c = ConfigError {
            var: "RAILOVER_LOG",
            value: s(),
            accepted: "warn",
        };
        assert_eq!(code(&Error::Config(c)), 4);
    }
}
