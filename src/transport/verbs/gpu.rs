//! Whether the verbs NICs take GPU memory, which NCCL reads from `ptrSupport`: with
//! `NCCL_PTR_CUDA` it hands `regMr` GPU buffers and lets the NIC move them
//! (GPUDirect RDMA); with `NCCL_PTR_DMABUF` it registers them through `regMrDmaBuf`.
//!
//! The checks are NCCL's: a peer-memory client (nvidia-peermem, or the older nv_peer_mem)
//! lets `ibv_reg_mr` take a GPU address; a device whose driver registers dma-bufs lets
//! `ibv_reg_dmabuf_mr` take GPU memory exported as one. `RAILOVER_GDR` can force the first
//! (a peer-memory client of another name) or turn both off; `RAILOVER_GDR_HCA` leaves
//! NICs out, such as one whose PCIe path to the GPUs carries no peer-to-peer traffic.
//!
//! A NIC that reports host memory only never registers GPU memory: a comm whose GPU
//! memory would move onto it after a failure is refused there ([`refusal`]), and the
//! router leaves that NIC out for the comm.

use std::io;
use std::path::Path;
use std::sync::Arc;

use super::sys::UserMr;
use super::Domain;
use crate::config::Gdr;
use crate::transport::memory::Memory;

/// Files (under the sysfs root) whose presence says a GPU peer-memory client is loaded.
pub const PEERMEM: [&str; 3] = [
    "kernel/mm/memory_peers/nv_mem/version",
    "kernel/mm/memory_peers/nv_mem_nc/version",
    "module/nvidia_peermem/version",
];

/// What one NIC can do with GPU memory.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct GpuMemory {
    /// `NCCL_PTR_CUDA`: `regMr` takes GPU memory.
    pub cuda: bool,
    /// `NCCL_PTR_DMABUF`: `regMrDmaBuf` takes it.
    pub dmabuf: bool,
    /// Why, for the log and `railover doctor`.
    pub why: String,
}

impl GpuMemory {
    /// The verdict in a few words, as the log and `railover doctor` say it.
    pub fn summary(&self) -> &'static str {
        match (self.cuda, self.dmabuf) {
            (true, true) => "GPU memory (NCCL_PTR_CUDA | NCCL_PTR_DMABUF)",
            (true, false) => "GPU memory (NCCL_PTR_CUDA)",
            (false, true) => "GPU memory as dma-buf only (NCCL_PTR_DMABUF)",
            (false, false) => "host memory only",
        }
    }

    /// Host memory only, because of `why`.
    pub fn none(why: impl Into<String>) -> GpuMemory {
        GpuMemory {
            cuda: false,
            dmabuf: false,
            why: why.into(),
        }
    }
}

/// The first peer-memory file present under `sysfs_root`.
pub fn peermem(sysfs_root: &Path) -> Option<&'static str> {
    PEERMEM.into_iter().find(|f| sysfs_root.join(f).exists())
}

/// What `gdr` and the checks make of one NIC (`selected`: `RAILOVER_GDR_HCA` takes it):
/// `open` gives its device's domain, for the dma-buf probe, and is called only when the
/// verdict depends on it.
pub fn of_device(
    gdr: Gdr,
    selected: bool,
    peermem: Option<&str>,
    open: impl FnOnce() -> io::Result<Arc<Domain>>,
) -> GpuMemory {
    let probe = match gdr {
        Gdr::Off => Err("not probed".to_string()),
        _ if !selected => Err("not probed".to_string()),
        _ => open()
            .and_then(|d| UserMr::dmabuf_supported(&d.pd))
            .map_err(|e| e.to_string()),
    };
    decide(gdr, selected, peermem, probe)
}

/// What `gdr` makes of the checks: whether `RAILOVER_GDR_HCA` selects the NIC, the
/// peer-memory file found, and the device's dma-buf probe (`Err` with why not).
pub fn decide(
    gdr: Gdr,
    selected: bool,
    peermem: Option<&str>,
    dmabuf: Result<(), String>,
) -> GpuMemory {
    if gdr == Gdr::Off {
        return GpuMemory::none("RAILOVER_GDR=off");
    }
    if !selected {
        return GpuMemory::none("left out by RAILOVER_GDR_HCA");
    }
    let dmabuf_ok = dmabuf.is_ok();
    let mut why = Vec::new();
    match peermem {
        Some(f) => why.push(format!("peer memory ({f})")),
        None => why.push("no GPU peer-memory client (nvidia-peermem not loaded)".to_string()),
    }
    match &dmabuf {
        Ok(()) => why.push("dma-buf registration works".into()),
        Err(e) => why.push(format!("no dma-buf registration ({e})")),
    }
    if gdr == Gdr::Force && peermem.is_none() {
        why.push("GPU memory forced by RAILOVER_GDR=force".into());
    }
    // `NCCL_PTR_CUDA` promises that `regMr` takes a plain GPU address, which only a
    // peer-memory client makes true. With dma-buf alone NCCL registers through
    // `regMrDmaBuf` where CUDA can export the buffer, and stages through host memory
    // where it cannot; claiming CUDA there would hand us plain GPU addresses that no NIC
    // can register, and the comm would die at its first send (NCCL's `init.cc` sets the
    // bit from the peer-memory check alone, too).
    GpuMemory {
        cuda: peermem.is_some() || gdr == Gdr::Force,
        dmabuf: dmabuf_ok,
        why: why.join("; "),
    }
}

/// Why NIC `nic`, which can do `gpu`, must not register `memory`: `None` when it may try
/// (host memory always; GPU memory of the kind the NIC reports).
pub fn refusal(gpu: &GpuMemory, nic: &str, memory: &Memory) -> Option<String> {
    match memory {
        Memory::Host => None,
        Memory::Gpu if !gpu.cuda => Some(format!(
            "{nic} takes {} ({})",
            if gpu.dmabuf {
                "GPU memory as dma-buf only, not a plain GPU address"
            } else {
                "host memory only"
            },
            gpu.why
        )),
        Memory::DmaBuf { .. } if !gpu.dmabuf => {
            Some(format!("{nic} registers no dma-buf ({})", gpu.why))
        }
        Memory::Gpu | Memory::DmaBuf { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_memory_is_found_by_its_sysfs_file() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(peermem(root.path()), None);
        let f = root.path().join("module/nvidia_peermem");
        std::fs::create_dir_all(&f).unwrap();
        std::fs::write(f.join("version"), "1.0\n").unwrap();
        assert_eq!(peermem(root.path()), Some("module/nvidia_peermem/version"));
    }

    #[test]
    fn what_each_setting_reports() {
        let no = || Err("Operation not supported".to_string());
        let peer = Some(PEERMEM[2]);
        let g = decide(Gdr::Auto, true, None, no());
        assert!(!g.cuda && !g.dmabuf, "{g:?}");
        assert!(g.why.contains("nvidia-peermem not loaded"), "{}", g.why);
        let g = decide(Gdr::Auto, true, peer, no());
        assert!(g.cuda && !g.dmabuf, "{g:?}");
        let g = decide(Gdr::Auto, true, None, Ok(()));
        assert!(
            !g.cuda && g.dmabuf,
            "dma-buf alone carries GPU memory through regMrDmaBuf only: {g:?}"
        );
        assert_eq!(g.summary(), "GPU memory as dma-buf only (NCCL_PTR_DMABUF)");
        let g = decide(Gdr::Auto, true, peer, Ok(()));
        assert!(g.cuda && g.dmabuf, "{g:?}");
        let g = decide(Gdr::Force, true, None, no());
        assert!(
            g.cuda && !g.dmabuf && g.why.contains("RAILOVER_GDR=force"),
            "{g:?}"
        );
        let g = decide(Gdr::Off, true, peer, Ok(()));
        assert!(!g.cuda && !g.dmabuf && g.why == "RAILOVER_GDR=off", "{g:?}");
        for gdr in [Gdr::Auto, Gdr::Force] {
            let g = decide(gdr, false, peer, Ok(()));
            assert!(
                !g.cuda && !g.dmabuf && g.why.contains("RAILOVER_GDR_HCA"),
                "{g:?}"
            );
        }
    }

    #[test]
    fn a_nic_left_out_is_not_even_probed() {
        let opened = std::cell::Cell::new(false);
        let open = || {
            opened.set(true);
            Err(io::Error::other("no device"))
        };
        let g = of_device(Gdr::Auto, false, None, open);
        assert!(!g.cuda && !opened.get(), "{g:?}");
        let g = of_device(Gdr::Auto, true, None, open);
        assert!(opened.get() && g.why.contains("no device"), "{g:?}");
    }

    #[test]
    fn what_a_nic_refuses_to_register() {
        let dmabuf = || {
            let fd = std::fs::File::open("/dev/null").unwrap();
            Memory::DmaBuf {
                fd: fd.into(),
                offset: 0,
            }
        };
        let host_only = GpuMemory::none("left out by RAILOVER_GDR_HCA");
        assert_eq!(refusal(&host_only, "rxe1:1", &Memory::Host), None);
        let why = refusal(&host_only, "rxe1:1", &Memory::Gpu).unwrap();
        assert!(
            why.contains("rxe1:1") && why.contains("RAILOVER_GDR_HCA"),
            "{why}"
        );
        assert!(refusal(&host_only, "rxe1:1", &dmabuf()).is_some());
        let peer = decide(Gdr::Auto, true, Some(PEERMEM[2]), Err("no".into()));
        assert_eq!(refusal(&peer, "mlx5_0:1", &Memory::Gpu), None);
        let why = refusal(&peer, "mlx5_0:1", &dmabuf()).unwrap();
        assert!(why.contains("no dma-buf"), "{why}");
        let dmabuf_only = decide(Gdr::Auto, true, None, Ok(()));
        assert_eq!(refusal(&dmabuf_only, "mlx5_0:1", &dmabuf()), None);
        // A plain GPU address needs a peer-memory client, which a dma-buf NIC lacks.
        let why = refusal(&dmabuf_only, "mlx5_0:1", &Memory::Gpu).unwrap();
        assert!(
            why.contains("dma-buf only") && why.contains("nvidia-peermem not loaded"),
            "{why}"
        );
    }
}
