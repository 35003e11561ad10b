//! The C types NCCL exchanges with a net plugin, laid out byte for byte as in NCCL's
//! `net_v8.h` … `net_v12.h` (x86_64 / LP64). `tests/abi_layout.rs` pins every size and
//! offset against a C compiler.
//!
//! Values that come *from* NCCL (result codes, pointer types, device types) are plain
//! `c_int`s: a Rust enum would be undefined behaviour for a value we do not know.

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
pub const NCCL_INVALID_USAGE: NcclResult = 5;
pub const NCCL_REMOTE_ERROR: NcclResult = 6;

/// `regMr` pointer types.
pub use crate::handoff::comm::{NCCL_PTR_CUDA, NCCL_PTR_DMABUF, NCCL_PTR_HOST};

pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;
pub use crate::handoff::comm::NCCL_NET_MAX_REQUESTS;
pub const NCCL_NET_DEVICE_HOST: c_int = 0;
pub const NCCL_NET_ID_UNDEF: i16 = -1;
/// Value NCCL may pre-store in `*request` before `irecv`.
pub const NCCL_NET_OPTIONAL_RECV_COMPLETION: usize = 0x1;

/// `ncclDebugLogLevel` values.
pub const NCCL_LOG_WARN: c_int = 2;
pub const NCCL_LOG_INFO: c_int = 3;
pub const NCCL_LOG_TRACE: c_int = 5;
/// `ncclDebugLogSubSys` flags.
pub const NCCL_INIT: c_ulong = 0x1;
pub const NCCL_NET: c_ulong = 0x10;
pub const NCCL_ALL: c_ulong = !0;

/// `ncclDebugLogger_t`: printf-style and variadic; we always pass `"%s"`.
pub type NcclDebugLogger = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;

/// `ncclProfilerCallback_t` (accepted, not used).
pub type NcclProfilerCallback = Option<
    unsafe extern "C" fn(
        e_handle: *mut *mut c_void,
        kind: c_int,
        p_handle: *mut c_void,
        plugin_id: i64,
        ext_data: *mut c_void,
    ) -> NcclResult,
>;

/// `ncclNetDeviceHandle_v7_t` (v8 … v12 are typedefs of it). 32 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetDeviceHandle {
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub handle: *mut c_void,
    pub size: usize,
    pub needs_proxy_progress: c_int,
}

/// `ncclNetVDeviceProps_v9/v10/v11_t`: 20 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct VDevicePropsV11 {
    pub ndevs: c_int,
    pub devs: [c_int; 4],
}

/// `ncclNetVDeviceProps_v12_t`: 36 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct VDevicePropsV12 {
    pub ndevs: c_int,
    pub devs: [c_int; 8],
}

/// `ncclNetCommConfig_v10/v11/v12_t`: 4 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    pub traffic_class: c_int,
}

/// `ncclNetCommAttr_v11/v12_t`: 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CommAttr {
    pub max_concurrent_peers: i32,
    pub min_concurrent_peers: i32,
    pub max_flows_per_peer: i32,
    pub min_flows_per_peer: i32,
}

/// `ncclNetAttr_v11/v12_t`: 44 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NetAttr {
    pub send_comm_attr: CommAttr,
    pub recv_comm_attr: CommAttr,
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

/// `ncclNetProperties_v8_t`: 64 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV8 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

/// `ncclNetProperties_v9_t` and `_v10_t` (identical): 104 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV9 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub v_props: VDevicePropsV11,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11_t`: 112 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV11 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub v_props: VDevicePropsV11,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
}

/// `ncclNetProperties_v12_t`: 128 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV12 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub v_props: VDevicePropsV12,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
    pub rail_id: i16,
    pub plane_id: i16,
}

// Each older layout keeps a prefix of the next newer one's fields: it is built from
// that one, so the values are chosen once, for v12.

impl From<PropertiesV12> for PropertiesV11 {
    fn from(p: PropertiesV12) -> Self {
        let mut devs = [0; 4];
        devs.copy_from_slice(&p.v_props.devs[..4]);
        PropertiesV11 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            force_flush: p.force_flush,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            v_props: VDevicePropsV11 {
                ndevs: p.v_props.ndevs.min(4),
                devs,
            },
            max_p2p_bytes: p.max_p2p_bytes,
            max_coll_bytes: p.max_coll_bytes,
            max_multi_request_size: p.max_multi_request_size,
        }
    }
}

impl From<PropertiesV11> for PropertiesV9 {
    fn from(p: PropertiesV11) -> Self {
        PropertiesV9 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            force_flush: p.force_flush,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            v_props: p.v_props,
            max_p2p_bytes: p.max_p2p_bytes,
            max_coll_bytes: p.max_coll_bytes,
        }
    }
}

impl From<PropertiesV9> for PropertiesV8 {
    fn from(p: PropertiesV9) -> Self {
        PropertiesV8 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
        }
    }
}

type Ptr = *mut c_void;
type PtrPtr = *mut *mut c_void;

/// `ncclNet_v12_t`: 22 slots, 176 bytes.
#[repr(C)]
pub struct NetV12 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        PtrPtr,
        u64,
        *mut CommConfig,
        NcclDebugLogger,
        NcclProfilerCallback,
    ) -> NcclResult,
    pub devices: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV12) -> NcclResult,
    pub listen: unsafe extern "C" fn(Ptr, c_int, Ptr, PtrPtr) -> NcclResult,
    pub connect:
        unsafe extern "C" fn(Ptr, c_int, Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub accept: unsafe extern "C" fn(Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PtrPtr) -> NcclResult,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PtrPtr) -> NcclResult>,
    pub dereg_mr: unsafe extern "C" fn(Ptr, Ptr) -> NcclResult,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PtrPtr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(
        Ptr,
        c_int,
        PtrPtr,
        *mut usize,
        *mut c_int,
        PtrPtr,
        PtrPtr,
        PtrPtr,
    ) -> NcclResult,
    pub iflush: unsafe extern "C" fn(Ptr, c_int, PtrPtr, *mut c_int, PtrPtr, PtrPtr) -> NcclResult,
    pub test: unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult,
    pub close_send: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_recv: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_listen: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PtrPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_v_device: Option<unsafe extern "C" fn(*mut c_int, *mut VDevicePropsV12) -> NcclResult>,
    pub finalize: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub set_net_attr: Option<unsafe extern "C" fn(Ptr, *mut NetAttr) -> NcclResult>,
}

/// `ncclNet_v11_t`: same slots as v12 with the v11 properties and vProps types.
#[repr(C)]
pub struct NetV11 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        PtrPtr,
        u64,
        *mut CommConfig,
        NcclDebugLogger,
        NcclProfilerCallback,
    ) -> NcclResult,
    pub devices: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV11) -> NcclResult,
    pub listen: unsafe extern "C" fn(Ptr, c_int, Ptr, PtrPtr) -> NcclResult,
    pub connect:
        unsafe extern "C" fn(Ptr, c_int, Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub accept: unsafe extern "C" fn(Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PtrPtr) -> NcclResult,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PtrPtr) -> NcclResult>,
    pub dereg_mr: unsafe extern "C" fn(Ptr, Ptr) -> NcclResult,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PtrPtr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(
        Ptr,
        c_int,
        PtrPtr,
        *mut usize,
        *mut c_int,
        PtrPtr,
        PtrPtr,
        PtrPtr,
    ) -> NcclResult,
    pub iflush: unsafe extern "C" fn(Ptr, c_int, PtrPtr, *mut c_int, PtrPtr, PtrPtr) -> NcclResult,
    pub test: unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult,
    pub close_send: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_recv: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_listen: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PtrPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_v_device: Option<unsafe extern "C" fn(*mut c_int, *mut VDevicePropsV11) -> NcclResult>,
    pub finalize: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub set_net_attr: Option<unsafe extern "C" fn(Ptr, *mut NetAttr) -> NcclResult>,
}

/// `ncclNet_v10_t`: 20 slots, 160 bytes. Process-wide `init`; `connect` takes the config.
#[repr(C)]
pub struct NetV10 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(NcclDebugLogger, NcclProfilerCallback) -> NcclResult,
    pub devices: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, PtrPtr) -> NcclResult,
    pub connect: unsafe extern "C" fn(
        c_int,
        *mut CommConfig,
        Ptr,
        PtrPtr,
        *mut *mut NetDeviceHandle,
    ) -> NcclResult,
    pub accept: unsafe extern "C" fn(Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PtrPtr) -> NcclResult,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PtrPtr) -> NcclResult>,
    pub dereg_mr: unsafe extern "C" fn(Ptr, Ptr) -> NcclResult,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PtrPtr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(
        Ptr,
        c_int,
        PtrPtr,
        *mut usize,
        *mut c_int,
        PtrPtr,
        PtrPtr,
        PtrPtr,
    ) -> NcclResult,
    pub iflush: unsafe extern "C" fn(Ptr, c_int, PtrPtr, *mut c_int, PtrPtr, PtrPtr) -> NcclResult,
    pub test: unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult,
    pub close_send: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_recv: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_listen: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PtrPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_v_device: Option<unsafe extern "C" fn(*mut c_int, *mut VDevicePropsV11) -> NcclResult>,
}

/// `ncclNet_v9_t`: 20 slots, 160 bytes. No profiler handles, no config.
#[repr(C)]
pub struct NetV9 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(NcclDebugLogger) -> NcclResult,
    pub devices: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, PtrPtr) -> NcclResult,
    pub connect: unsafe extern "C" fn(c_int, Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub accept: unsafe extern "C" fn(Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PtrPtr) -> NcclResult,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PtrPtr) -> NcclResult>,
    pub dereg_mr: unsafe extern "C" fn(Ptr, Ptr) -> NcclResult,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, PtrPtr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(
        Ptr,
        c_int,
        PtrPtr,
        *mut usize,
        *mut c_int,
        PtrPtr,
        PtrPtr,
    ) -> NcclResult,
    pub iflush: unsafe extern "C" fn(Ptr, c_int, PtrPtr, *mut c_int, PtrPtr, PtrPtr) -> NcclResult,
    pub test: unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult,
    pub close_send: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_recv: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_listen: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PtrPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_v_device: Option<unsafe extern "C" fn(*mut c_int, *mut VDevicePropsV11) -> NcclResult>,
}

/// `ncclNet_v8_t`: 19 slots, 152 bytes. `int` sizes for isend/irecv.
#[repr(C)]
pub struct NetV8 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(NcclDebugLogger) -> NcclResult,
    pub devices: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV8) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, PtrPtr) -> NcclResult,
    pub connect: unsafe extern "C" fn(c_int, Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub accept: unsafe extern "C" fn(Ptr, PtrPtr, *mut *mut NetDeviceHandle) -> NcclResult,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PtrPtr) -> NcclResult,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PtrPtr) -> NcclResult>,
    pub dereg_mr: unsafe extern "C" fn(Ptr, Ptr) -> NcclResult,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, c_int, c_int, Ptr, PtrPtr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(
        Ptr,
        c_int,
        PtrPtr,
        *mut c_int,
        *mut c_int,
        PtrPtr,
        PtrPtr,
    ) -> NcclResult,
    pub iflush: unsafe extern "C" fn(Ptr, c_int, PtrPtr, *mut c_int, PtrPtr, PtrPtr) -> NcclResult,
    pub test: unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult,
    pub close_send: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_recv: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub close_listen: unsafe extern "C" fn(Ptr) -> NcclResult,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PtrPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_property_layouts_carry_the_newest_values() {
        let name = c"nic7";
        let v12 = PropertiesV12 {
            name: name.as_ptr(),
            pci_path: std::ptr::null(),
            guid: 0x1234,
            ptr_support: 1,
            reg_is_global: 0,
            force_flush: 0,
            speed: 25_000,
            port: 2,
            latency: 1.5,
            max_comms: 99,
            max_recvs: 1,
            net_device_type: 0,
            net_device_version: 3,
            v_props: VDevicePropsV12 {
                ndevs: 2,
                devs: [7, 8, 0, 0, 0, 0, 0, 0],
            },
            max_p2p_bytes: 1 << 40,
            max_coll_bytes: 512 << 20,
            max_multi_request_size: 1,
            rail_id: 3,
            plane_id: -1,
        };
        let v11 = PropertiesV11::from(v12);
        assert_eq!((v11.v_props.ndevs, v11.v_props.devs), (2, [7, 8, 0, 0]));
        assert_eq!(v11.max_multi_request_size, 1);
        let v9 = PropertiesV9::from(v11);
        assert_eq!(v9.max_coll_bytes, 512 << 20);
        let v8 = PropertiesV8::from(v9);
        assert_eq!(v8.name, name.as_ptr());
        assert_eq!(
            (
                v8.guid,
                v8.speed,
                v8.port,
                v8.latency,
                v8.max_comms,
                v8.net_device_version
            ),
            (0x1234, 25_000, 2, 1.5, 99, 3)
        );
    }
}
