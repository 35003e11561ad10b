//! User memory: what NCCL lends for a request and what a fabric reads and writes.
//!
//! It lives under `transport`, not `ffi`, because the fabrics are its users: the frame
//! reader and writer copy through it, and the verbs fabric registers it with its NICs
//! so that they read and write it in place. `ffi` only makes one, through the `unsafe`
//! `UserBuf::new` whose contract NCCL's `isend`/`irecv` rules fulfil; the raw pointer
//! is touched only in `sys`.

mod sys;

use std::any::Any;
use std::sync::Arc;

use parking_lot::Mutex;

#[cfg(test)]
pub(crate) use sys::SimMem;
pub use sys::{LentBuf, UserBuf};

/// A range NCCL registered (`regMr`), and what fabrics registered of it: one handle per
/// protection domain (a verbs device), made the first time a lane on that domain moves a
/// buffer of the range in place. So a backup NIC registers the memory only when a comm
/// first uses it, and each domain registers it once for all its lanes. The handles go
/// with the last holder: `deregMr`, after NCCL's last request on the range.
#[derive(Debug)]
pub struct Region {
    pub base: usize,
    pub len: usize,
    keys: Mutex<Vec<(u64, Arc<dyn Any + Send + Sync>)>>,
}

impl Region {
    pub fn new(base: usize, len: usize) -> Region {
        Region {
            base,
            len,
            keys: Mutex::new(Vec::new()),
        }
    }

    /// Domain `domain`'s registration of the range: `make`'s, the first time.
    pub fn key<T, E>(&self, domain: u64, make: impl FnOnce() -> Result<T, E>) -> Result<Arc<T>, E>
    where
        T: Any + Send + Sync,
    {
        let mut keys = self.keys.lock();
        if let Some((_, k)) = keys.iter().find(|(d, _)| *d == domain) {
            if let Ok(k) = k.clone().downcast::<T>() {
                return Ok(k);
            }
        }
        let k = Arc::new(make()?);
        keys.retain(|(d, _)| *d != domain);
        keys.push((domain, k.clone()));
        Ok(k)
    }

    /// How many domains registered the range.
    pub fn domains(&self) -> usize {
        self.keys.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_domain_registers_once_and_only_when_asked() {
        let r = Region::new(0x1000, 4096);
        assert_eq!(r.domains(), 0, "nothing registered at regMr");
        let mut made = 0;
        let a = r
            .key(7, || {
                made += 1;
                Ok::<_, ()>(41u32)
            })
            .unwrap();
        let b = r
            .key(7, || {
                made += 1;
                Ok::<_, ()>(99u32)
            })
            .unwrap();
        assert_eq!(
            (*a, *b, made),
            (41, 41, 1),
            "the second use finds the first"
        );
        assert_eq!(r.key(8, || Err::<u32, _>("no")).unwrap_err(), "no");
        assert_eq!(r.domains(), 1, "a failed registration is not kept");
        r.key(8, || Ok::<_, ()>(5u32)).unwrap();
        assert_eq!(r.domains(), 2);
    }
}
