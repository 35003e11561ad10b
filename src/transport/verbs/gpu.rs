//! Whether the verbs NICs take GPU memory, which NCCL reads from `ptrSupport`: with
//! `NCCL_PTR_CUDA` it hands `regMr` GPU buffers and lets the NIC move them
//! (GPUDirect RDMA); with `NCCL_PTR_DMABUF` it registers them through `regMrDmaBuf`.
//!
//! The checks are NCCL's: a peer-memory client (nvidia-peermem, or the older nv_peer_mem)
//! lets `ibv_reg_mr` take a GPU address; a device whose driver registers dma-bufs lets
//! `ibv_reg_dmabuf_mr` take GPU memory exported as one. `RAILOVER_GDR` can force the first
//! (a peer-memory client of another name) or turn both off.

use std::io;
use std::path::Path;
use std::sync::Arc;

use super::sys::UserMr;
use super::Domain;
use crate::config::Gdr;

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
            (false, _) => "host memory only",
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

/// What `gdr` and the checks make of one device: `open` gives its domain, for the dma-buf
/// probe, and is not called under `RAILOVER_GDR=off`.
pub fn of_device(
    gdr: Gdr,
    peermem: Option<&str>,
    open: impl FnOnce() -> io::Result<Arc<Domain>>,
) -> GpuMemory {
    let probe = match gdr {
        Gdr::Off => Err("not probed".to_string()),
        _ => open()
            .and_then(|d| UserMr::dmabuf_supported(&d.pd))
            .map_err(|e| e.to_string()),
    };
    decide(gdr, peermem, probe)
}

/// What `gdr` makes of the checks: the peer-memory file found, and the device's dma-buf
/// probe (`Err` with why not).
pub fn decide(gdr: Gdr, peermem: Option<&str>, dmabuf: Result<(), String>) -> GpuMemory {
    if gdr == Gdr::Off {
        return GpuMemory::none("RAILOVER_GDR=off");
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
    GpuMemory {
        cuda: peermem.is_some() || dmabuf_ok || gdr == Gdr::Force,
        dmabuf: dmabuf_ok,
        why: why.join("; "),
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
        let g = decide(Gdr::Auto, None, no());
        assert!(!g.cuda && !g.dmabuf, "{g:?}");
        assert!(g.why.contains("nvidia-peermem not loaded"), "{}", g.why);
        let g = decide(Gdr::Auto, peer, no());
        assert!(g.cuda && !g.dmabuf, "{g:?}");
        let g = decide(Gdr::Auto, None, Ok(()));
        assert!(
            g.cuda && g.dmabuf,
            "dma-buf alone carries GPU memory: {g:?}"
        );
        let g = decide(Gdr::Force, None, no());
        assert!(
            g.cuda && !g.dmabuf && g.why.contains("RAILOVER_GDR=force"),
            "{g:?}"
        );
        let g = decide(Gdr::Off, peer, Ok(()));
        assert!(!g.cuda && !g.dmabuf && g.why == "RAILOVER_GDR=off", "{g:?}");
    }
}
