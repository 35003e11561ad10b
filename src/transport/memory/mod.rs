//! User memory: what NCCL lends for a request and what a fabric reads and writes.
//!
//! It lives under `transport`, not `ffi`, because the fabrics are its users: the frame
//! reader and writer copy through it, and the verbs fabric registers it with its NICs
//! so that they read and write it in place. `ffi` only makes one, through the `unsafe`
//! `UserBuf::new` whose contract NCCL's `isend`/`irecv` rules fulfil; the raw pointer
//! is touched only in `sys`.

mod sys;

use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

pub use crate::conn::MemoryUnreachable;
#[cfg(any(test, feature = "fuzz-harness"))]
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
    pub memory: Memory,
    keys: Mutex<Vec<(u64, Arc<dyn Any + Send + Sync>)>>,
}

/// What kind of memory a registered range is, which decides who may touch it: the CPU
/// copies host memory through the lanes' rings; GPU memory only a NIC can move, in place.
#[derive(Debug)]
pub enum Memory {
    /// `NCCL_PTR_HOST`.
    Host,
    /// `NCCL_PTR_CUDA` through `regMr`: a GPU virtual address a NIC registers through a
    /// peer-memory client (nvidia-peermem).
    Gpu,
    /// `regMrDmaBuf`: GPU memory exported as a dma-buf. The fd is our duplicate (NCCL
    /// closes its own when the call returns), kept so that a backup NIC can register the
    /// memory later; `offset` is where the range starts in the dma-buf.
    DmaBuf { fd: OwnedFd, offset: u64 },
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Memory::Host => "host memory",
            Memory::Gpu => "GPU memory",
            Memory::DmaBuf { .. } => "GPU memory (dma-buf)",
        })
    }
}

impl Region {
    /// Host memory at `[base, base + len)`.
    pub fn new(base: usize, len: usize) -> Region {
        Region::of(base, len, Memory::Host)
    }

    pub fn of(base: usize, len: usize, memory: Memory) -> Region {
        Region {
            base,
            len,
            memory,
            keys: Mutex::new(Vec::new()),
        }
    }

    /// Whether the CPU may read and write the range (host memory). GPU memory is moved by
    /// NICs only: every payload in or out of it is written in place.
    pub fn cpu_reachable(&self) -> bool {
        matches!(self.memory, Memory::Host)
    }

    /// The dma-buf the range lies in, and the range's offset there.
    pub fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        match &self.memory {
            Memory::DmaBuf { fd, offset } => Some((fd.as_fd(), *offset)),
            _ => None,
        }
    }

    /// The registrations made so far, for whoever must reach each domain's (a flush).
    pub fn keys(&self) -> Vec<(u64, Arc<dyn Any + Send + Sync>)> {
        self.keys.lock().clone()
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
        assert!(r.cpu_reachable() && r.dmabuf().is_none());
    }

    #[test]
    fn gpu_memory_is_not_the_cpus_and_keeps_its_dmabuf() {
        assert!(!Region::of(0, 8, Memory::Gpu).cpu_reachable());
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let r = Region::of(0, 8, Memory::DmaBuf { fd, offset: 4096 });
        assert!(!r.cpu_reachable());
        let (fd, off) = r.dmabuf().unwrap();
        assert_eq!(off, 4096);
        assert!(
            fd.try_clone_to_owned().is_ok(),
            "the fd stays open with the region"
        );
    }
}
