//! Topology: pure data about NICs, GPUs, PCI paths, NUMA nodes and rails.
//! No sockets, no threads.

use std::fmt;

/// NCCL's ordered scale of PCIe path types (only the PCIe part of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathType {
    /// Both devices behind the same PCIe switch.
    Pix,
    /// Behind cascaded PCIe switches, without crossing a CPU.
    Pxb,
    /// Through the CPU's host bridge (same socket).
    Phb,
    /// Across the inter-socket link.
    Sys,
}

impl PathType {
    pub const ALL: [PathType; 4] = [PathType::Pix, PathType::Pxb, PathType::Phb, PathType::Sys];

    /// NCCL's name for the path type.
    pub fn as_str(self) -> &'static str {
        match self {
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
        }
    }

    /// Parses NCCL's name (case-insensitive).
    pub fn parse(s: &str) -> Option<PathType> {
        PathType::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
