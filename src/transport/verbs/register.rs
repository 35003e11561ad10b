//! Registering NCCL's memory with a device, once per range and device: by `regMr` on the
//! comm's own NIC (on NCCL's thread, where a failure reaches NCCL as `regMr`'s), and by
//! a lane the first time its device needs a range it has not registered yet (a backup
//! NIC a failover moved the comm to: memory is registered there only when needed).
//! Either way the registration is filed in the range ([`Region::key`]) under the device,
//! so the other finds it.

use std::convert::Infallible;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::device::VerbsNic;
use super::domain::Domain;
use super::flush::{DeviceFlush, PendingFlush};
use super::gpu::{self, GpuMemory};
use super::sys::UserMr;
use crate::config::VerbsSettings;
use crate::transport::memory::{MemoryUnreachable, Region};

/// Ranges of NCCL's memory registered with an RDMA device, process-wide.
pub static USER_REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

/// `dom`'s registration of `region` (NIC `nic` of that device, which can do `gpu` with
/// GPU memory where the fabric judged it): made now unless it exists (`when` says why
/// now, for the log). `Ok(None)` when registering host memory failed (said once per
/// range and device; its payloads then go through the lanes' rings); an error when GPU
/// memory cannot be registered here ([`MemoryUnreachable`]), which no ring can carry.
pub fn register(
    dom: &Arc<Domain>,
    nic: &VerbsNic,
    settings: &VerbsSettings,
    gpu: Option<&GpuMemory>,
    region: &Region,
    when: &str,
) -> io::Result<Option<Arc<Registration>>> {
    if let Some(why) = gpu.and_then(|g| gpu::refusal(g, &nic.label(), &region.memory)) {
        return Err(io::Error::other(MemoryUnreachable(format!(
            "{} at {:#x}+{} is refused: {why}",
            region.memory, region.base, region.len
        ))));
    }
    let mr = region
        .key(dom.id, || {
            let made = match region.dmabuf() {
                Some((fd, offset)) => {
                    UserMr::register_dmabuf(&dom.pd, fd, offset, region.base, region.len)
                }
                None => UserMr::register(&dom.pd, region.base, region.len),
            };
            let flush = (!region.cpu_reachable()).then(|| FlushVia {
                dom: dom.clone(),
                nic: nic.clone(),
                settings: *settings,
            });
            Ok::<_, Infallible>(match made {
                Ok(mr) => {
                    USER_REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        "railover: registered {:#x}+{} ({}) on {} ({when})",
                        region.base,
                        region.len,
                        region.memory,
                        dom.name()
                    );
                    Registration {
                        mr: Some(mr),
                        flush,
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        "railover: cannot register {:#x}+{} ({}) on {}: {e}{}",
                        region.base,
                        region.len,
                        region.memory,
                        dom.name(),
                        if region.cpu_reachable() {
                            "; messages in it are copied through the lanes' rings there"
                        } else {
                            "; comms whose messages are in it leave this device"
                        }
                    );
                    Registration { mr: None, flush }
                }
            })
        })
        .unwrap_or_else(|e| match e {});
    if mr.mr.is_some() {
        return Ok(Some(mr));
    }
    if region.cpu_reachable() {
        return Ok(None);
    }
    Err(io::Error::other(MemoryUnreachable(format!(
        "{} at {:#x}+{} cannot be registered on {}",
        region.memory,
        region.base,
        region.len,
        dom.name()
    ))))
}

/// What `regMr` registers with on one NIC: its device, as its lanes see it.
#[derive(Debug, Clone)]
pub struct Registrar {
    dom: Arc<Domain>,
    nic: VerbsNic,
    settings: VerbsSettings,
    gpu: Option<GpuMemory>,
}

impl Registrar {
    pub(super) fn new(
        dom: Arc<Domain>,
        nic: VerbsNic,
        settings: VerbsSettings,
        gpu: Option<GpuMemory>,
    ) -> Registrar {
        Registrar {
            dom,
            nic,
            settings,
            gpu,
        }
    }

    /// Registers `region` on this NIC's device now (see [`register`]).
    pub fn register(&self, region: &Region) -> io::Result<Option<Arc<Registration>>> {
        register(
            &self.dom,
            &self.nic,
            &self.settings,
            self.gpu.as_ref(),
            region,
            "regMr on the comm's NIC",
        )
    }
}

/// A device's registration of a range NCCL registered, as the range keeps it (one per
/// device: see [`Region::key`](crate::transport::memory::Region::key)).
#[derive(Debug)]
pub struct Registration {
    /// `None` when registering failed (said once; host memory then goes through rings).
    pub mr: Option<UserMr>,
    /// GPU memory: the device whose writes into it a flush must make visible.
    flush: Option<FlushVia>,
}

/// The device a registration's flush READs go through.
#[derive(Debug)]
pub(super) struct FlushVia {
    pub(super) dom: Arc<Domain>,
    pub(super) nic: VerbsNic,
    pub(super) settings: VerbsSettings,
}

impl Registration {
    /// The flush of what the device wrote into the range, READ at `addr` (inside it): see
    /// [`Flush`](super::flush::Flush). `None` for host memory, which needs none, and where
    /// nothing was registered (the device wrote none).
    pub fn flush(this: &Arc<Registration>, addr: u64) -> Option<PendingFlush> {
        this.flush.as_ref()?;
        this.mr.as_ref()?;
        Some(PendingFlush::new(DeviceFlush::new(this.clone()), addr))
    }

    /// The device a flush READs through (GPU memory only).
    pub(super) fn flush_via(&self) -> Option<&FlushVia> {
        self.flush.as_ref()
    }

    /// The key a flush READs the range under.
    pub(super) fn rkey(&self) -> Option<u32> {
        self.mr.as_ref().map(|m| m.rkey())
    }
}
