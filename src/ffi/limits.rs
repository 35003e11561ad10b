//! The open-file limit. A job opens thousands of comms per process (all-to-all), each
//! with a lane descriptor or more, beside NCCL's listeners: far past the usual soft limit
//! of 1,024. The first `init` raises the soft limit toward the hard one, as far as
//! [`WANTED`], and says so; code in the same process that uses `select()` cannot watch
//! descriptors above 1,023 whatever the limit (FD_SETSIZE), so the log says that too.

use std::sync::Once;

/// Enough for 4,096 comms with several lanes each, listeners and NCCL's own files.
pub const WANTED: u64 = 1 << 16;

static RAISE: Once = Once::new();

/// Raises the soft `RLIMIT_NOFILE`, once per process.
pub fn raise_open_files() {
    RAISE.call_once(|| match raise(WANTED) {
        Ok(Some((from, to))) => tracing::info!(
            "railover: raised the open-file limit from {from} to {to} (hard limit {}), for thousands of comms; select()-based code in this process still cannot use descriptors above 1023",
            hard().map_or_else(|| "unknown".into(), |h| h.to_string())
        ),
        Ok(None) => {}
        Err(e) => tracing::warn!(
            "railover: cannot raise the open-file limit ({e}); a job with thousands of comms may run out of descriptors"
        ),
    });
}

fn get() -> std::io::Result<libc::rlimit> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// `rlim_t` is 64 bits wide on the 64-bit targets railover builds for, 32 elsewhere.
#[allow(clippy::unnecessary_cast)]
fn wide(x: libc::rlim_t) -> u64 {
    x as u64
}

fn hard() -> Option<u64> {
    get().ok().map(|r| wide(r.rlim_max))
}

/// The soft limit raised to `min(wanted, hard)` when it is lower: `(from, to)`, or `None`
/// when it already sufficed or the hard limit allows nothing more.
pub fn raise(wanted: u64) -> std::io::Result<Option<(u64, u64)>> {
    let mut r = get()?;
    let (soft, hard) = (r.rlim_cur as u64, wide(r.rlim_max));
    let to = wanted.min(hard);
    if soft >= to {
        return Ok(None);
    }
    r.rlim_cur = to as libc::rlim_t;
    // SAFETY: `r` is a valid rlimit with the soft limit at or below the hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some((soft, to)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_wanted_value_within_the_hard_one() {
        let before = get().unwrap();
        let (soft, hard) = (wide(before.rlim_cur), wide(before.rlim_max));
        // Asking for no more than the soft limit changes nothing.
        assert_eq!(raise(soft).unwrap(), None);
        if soft < hard {
            let to = (soft + 1).min(hard);
            assert_eq!(raise(to).unwrap(), Some((soft, to)));
            assert_eq!(wide(get().unwrap().rlim_cur), to);
        } else {
            eprintln!("soft limit already at the hard one ({hard}): only the no-op is checked");
        }
        // Never above the hard limit.
        let _ = raise(u64::MAX).unwrap();
        assert!(wide(get().unwrap().rlim_cur) <= hard);
    }
}
