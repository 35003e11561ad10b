//! The exported `ncclNetPlugin_v8` … `_v12` tables and their entry points.
//!
//! Each entry point checks its pointers through [`super::handle`], runs inside
//! [`guard`], and calls the version-independent [`crate::plugin`]. Version differences
//! (argument lists, properties layouts) are absorbed here and nowhere else.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::boundary::{guard, guard_code};
use super::handle::{
    self, handle_mut, read_at, write, write_opt, COMMS, CONTEXTS, LISTENS, MRS, REQUESTS,
};
use super::types::*;
use crate::handoff::comm::MAX_RECVS;
use crate::plugin::{self, Error, NetHints, NicInfo, Status};
use crate::transport::memory::UserBuf;

type Ptr = *mut c_void;

/// Wrapper that lets a table of pointers be a `static` (NCCL only reads it).
#[repr(transparent)]
pub struct Table<T>(pub T);
// SAFETY: the tables hold a static string and function pointers, never mutated.
unsafe impl<T> Sync for Table<T> {}

// ---- init / finalize -------------------------------------------------------------

/// Held by every `init` and `finalize`: the last `finalize` stops the runtime and forgets
/// every handle, and an `init` on another thread must not start a new runtime (and hand
/// out handles) in between, or those handles would be forgotten with the old ones.
static LIFECYCLE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

unsafe extern "C" fn init_v11(
    ctx: *mut Ptr,
    _comm_id: u64,
    config: *mut CommConfig,
    log: NcclDebugLogger,
    _prof: NcclProfilerCallback,
) -> NcclResult {
    super::logger::set(log);
    guard("init", || {
        if ctx.is_null() {
            return Err(Error::InvalidArgument("NULL ctx".into()));
        }
        // NCCL passes a stack variable: copy the value, keep no pointer.
        let tc = if config.is_null() {
            -1
        } else {
            // SAFETY: `config` is NULL or NCCL's array for this call, of one element at least.
            unsafe { read_at(config.cast_const(), 0, "config") }?.traffic_class
        };
        let _lifecycle = LIFECYCLE.lock();
        let c = plugin::init_context(tc)?;
        // After the runtime started its logging: the raise is said once.
        super::limits::raise_open_files();
        // SAFETY: `ctx` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(ctx, CONTEXTS.insert(c), "ctx") }
    })
}

unsafe extern "C" fn init_v10(log: NcclDebugLogger, _prof: NcclProfilerCallback) -> NcclResult {
    // SAFETY: v8's `init` with the logger NCCL passed, which it only stores.
    unsafe { init_v8(log) }
}

unsafe extern "C" fn init_v8(log: NcclDebugLogger) -> NcclResult {
    super::logger::set(log);
    guard("init", || {
        pin_library();
        let _lifecycle = LIFECYCLE.lock();
        let legacy = plugin::init_legacy();
        super::limits::raise_open_files();
        legacy.map(|_| ())
    })
}

/// v8–v10 have no `finalize`, so NCCL may `dlclose` the library while the reactor runs:
/// keep the library mapped for the life of the process.
fn pin_library() {
    let mut info: libc::Dl_info = libc_dl_info_zeroed();
    // SAFETY: dladdr only reads the address of one of our own functions and fills `info`.
    let found = unsafe { libc::dladdr(pin_library as *const c_void, &mut info) };
    if found != 0 && !info.dli_fname.is_null() {
        // SAFETY: dli_fname is a NUL-terminated path owned by the loader; RTLD_NOLOAD only
        // takes another reference to the already-loaded object, RTLD_NODELETE pins it.
        let h = unsafe {
            libc::dlopen(
                info.dli_fname,
                libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
            )
        };
        if h.is_null() {
            tracing::debug!("railover: could not pin the library in memory");
        }
    }
}

fn libc_dl_info_zeroed() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

unsafe extern "C" fn finalize(ctx: Ptr) -> NcclResult {
    guard("finalize", || {
        let _lifecycle = LIFECYCLE.lock();
        let c = CONTEXTS.remove(ctx)?;
        if plugin::finalize(&c)? {
            // Handles NCCL never closed belong to the stopped runtime: forget them, or each
            // init/finalize cycle would keep its comms (and their memory) for good. Using
            // one later is an unknown handle, ncclInvalidArgument.
            handle::forget_all();
        }
        Ok(())
    })
}

unsafe extern "C" fn set_net_attr(ctx: Ptr, attr: *mut NetAttr) -> NcclResult {
    guard("setNetAttr", || {
        let c = CONTEXTS.get(ctx)?;
        // SAFETY: `attr` is NULL or NCCL's array for this call, of one element at least.
        let a = unsafe { read_at(attr.cast_const(), 0, "netAttr") }?;
        *c.hints.lock() = Some(NetHints {
            send_max_flows_per_peer: a.send_comm_attr.max_flows_per_peer,
            recv_max_flows_per_peer: a.recv_comm_attr.max_flows_per_peer,
            op: a.op,
            algo: a.algo,
            proto: a.proto,
        });
        Ok(())
    })
}

// ---- devices / properties --------------------------------------------------------

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        let n = plugin::devices()?;
        // SAFETY: `ndev` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(ndev, n as c_int, "ndev") }
    })
}

/// Largest message: NCCL validates 1 … 2^40.
const MAX_P2P_BYTES: usize = 1 << 40;
const MAX_COLL_BYTES: usize = 512 << 20;
const MAX_COMMS: c_int = 65536;

fn props_common(dev: c_int) -> Result<NicInfo, Error> {
    plugin::nic_info(dev)
}

fn pci(n: &NicInfo) -> *const std::ffi::c_char {
    n.pci_path.map_or(std::ptr::null(), |p| p.as_ptr())
}

/// The properties of `dev`, in the newest layout; older versions get a prefix of it.
fn properties(dev: c_int) -> Result<PropertiesV12, Error> {
    let n = props_common(dev)?;
    let mut devs = [0; 8];
    devs[0] = dev;
    Ok(PropertiesV12 {
        name: n.name.as_ptr(),
        pci_path: pci(&n),
        guid: n.guid,
        ptr_support: n.ptr_support,
        reg_is_global: 0,
        force_flush: 0,
        speed: n.tcp.speed_mbps,
        port: 0,
        latency: 0.0,
        max_comms: MAX_COMMS,
        max_recvs: MAX_RECVS as c_int,
        net_device_type: NCCL_NET_DEVICE_HOST,
        net_device_version: 0,
        v_props: VDevicePropsV12 { ndevs: 1, devs },
        max_p2p_bytes: MAX_P2P_BYTES,
        max_coll_bytes: MAX_COLL_BYTES,
        max_multi_request_size: 1,
        rail_id: n
            .rail
            .and_then(|r| i16::try_from(r).ok())
            .unwrap_or(NCCL_NET_ID_UNDEF),
        plane_id: NCCL_NET_ID_UNDEF,
    })
}

unsafe extern "C" fn get_properties_v12(dev: c_int, props: *mut PropertiesV12) -> NcclResult {
    // SAFETY: `props` is NCCL's out-pointer for this call: NULL or writable.
    guard("getProperties", || unsafe {
        write(props, properties(dev)?, "props")
    })
}

unsafe extern "C" fn get_properties_v11(dev: c_int, props: *mut PropertiesV11) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: `props` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(props, PropertiesV11::from(properties(dev)?), "props") }
    })
}

unsafe extern "C" fn get_properties_v9(dev: c_int, props: *mut PropertiesV9) -> NcclResult {
    guard("getProperties", || {
        let p = PropertiesV11::from(properties(dev)?);
        // SAFETY: `props` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(props, PropertiesV9::from(p), "props") }
    })
}

unsafe extern "C" fn get_properties_v8(dev: c_int, props: *mut PropertiesV8) -> NcclResult {
    guard("getProperties", || {
        let p = PropertiesV9::from(PropertiesV11::from(properties(dev)?));
        // SAFETY: `props` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(props, PropertiesV8::from(p), "props") }
    })
}

// ---- listen / connect / accept ---------------------------------------------------

unsafe extern "C" fn listen_v11(
    ctx: Ptr,
    dev: c_int,
    handle: Ptr,
    listen_comm: *mut Ptr,
) -> NcclResult {
    guard("listen", || {
        let c = CONTEXTS.get(ctx)?;
        // SAFETY: the pointers NCCL passed to this entry point, as `do_listen` requires.
        unsafe { do_listen(&c, dev, handle, listen_comm) }
    })
}

unsafe extern "C" fn listen_v8(dev: c_int, handle: Ptr, listen_comm: *mut Ptr) -> NcclResult {
    guard("listen", || {
        // SAFETY: the pointers NCCL passed to this entry point, as `do_listen` requires.
        unsafe { do_listen(&*plugin::legacy_context()?, dev, handle, listen_comm) }
    })
}

/// # Safety
/// `handle` and `listen_comm` as NCCL passes them to `listen`: NULL or valid for the call.
unsafe fn do_listen(
    c: &plugin::Context,
    dev: c_int,
    handle: Ptr,
    listen_comm: *mut Ptr,
) -> Result<(), Error> {
    if listen_comm.is_null() {
        return Err(Error::InvalidArgument("NULL listenComm".into()));
    }
    c.check()?;
    // SAFETY: `handle` is NULL or NCCL's 128-byte handle buffer, its own for this call.
    let h = unsafe { handle_mut(handle) }?;
    let l = plugin::listen(c, dev, h)?;
    // SAFETY: `listen_comm` is NCCL's out-pointer for this call: NULL or writable.
    unsafe { write(listen_comm, LISTENS.insert(l), "listenComm") }
}

unsafe extern "C" fn connect_v11(
    ctx: Ptr,
    dev: c_int,
    handle: Ptr,
    send_comm: *mut Ptr,
    _dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    guard("connect", || {
        let c = CONTEXTS.get(ctx)?;
        // SAFETY: the pointers NCCL passed to this entry point, as `do_connect` requires.
        unsafe { do_connect(&c, dev, handle, send_comm) }
    })
}

unsafe extern "C" fn connect_v10(
    dev: c_int,
    _config: *mut CommConfig,
    handle: Ptr,
    send_comm: *mut Ptr,
    _dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    guard("connect", || {
        // SAFETY: the pointers NCCL passed to this entry point, as `do_connect` requires.
        unsafe { do_connect(&*plugin::legacy_context()?, dev, handle, send_comm) }
    })
}

unsafe extern "C" fn connect_v8(
    dev: c_int,
    handle: Ptr,
    send_comm: *mut Ptr,
    _dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    guard("connect", || {
        // SAFETY: the pointers NCCL passed to this entry point, as `do_connect` requires.
        unsafe { do_connect(&*plugin::legacy_context()?, dev, handle, send_comm) }
    })
}

/// `sendDevComm` may be NULL or point to NULL: a host plugin never writes it.
///
/// # Safety
/// `handle` and `send_comm` as NCCL passes them to `connect`: NULL or valid for the call.
unsafe fn do_connect(
    c: &plugin::Context,
    dev: c_int,
    handle: Ptr,
    send_comm: *mut Ptr,
) -> Result<(), Error> {
    // SAFETY: `send_comm` is NCCL's out-pointer for this call: NULL or writable.
    unsafe { write(send_comm, std::ptr::null_mut(), "sendComm") }?;
    c.check()?;
    // SAFETY: `handle` is NULL or NCCL's 128-byte handle buffer, its own for this call.
    let h = unsafe { handle_mut(handle) }?;
    if let Some(comm) = plugin::connect(c, dev, h)? {
        // SAFETY: `send_comm` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(send_comm, COMMS.insert(comm), "sendComm") }?;
    }
    Ok(())
}

unsafe extern "C" fn accept(
    listen_comm: Ptr,
    recv_comm: *mut Ptr,
    _dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    guard("accept", || {
        // SAFETY: `recv_comm` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(recv_comm, std::ptr::null_mut(), "recvComm") }?;
        let l = LISTENS.get(listen_comm)?;
        if let Some(comm) = plugin::accept(&l)? {
            // SAFETY: `recv_comm` is NCCL's out-pointer for this call: NULL or writable.
            unsafe { write(recv_comm, COMMS.insert(comm), "recvComm") }?;
        }
        Ok(())
    })
}

unsafe extern "C" fn close_listen(listen_comm: Ptr) -> NcclResult {
    guard("closeListen", || {
        let l = LISTENS.remove(listen_comm)?;
        plugin::close_listen(&l);
        Ok(())
    })
}

// ---- memory registration ---------------------------------------------------------

unsafe extern "C" fn reg_mr(
    comm: Ptr,
    data: Ptr,
    size: usize,
    kind: c_int,
    mhandle: *mut Ptr,
) -> NcclResult {
    guard("regMr", || {
        // SAFETY: `mhandle` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(mhandle, std::ptr::null_mut(), "mhandle") }?;
        let c = COMMS.get(comm)?;
        if data.is_null() && size > 0 {
            return Err(Error::InvalidArgument(
                "NULL data with a non-zero size".into(),
            ));
        }
        let mr = plugin::reg_mr(&c, data as usize, size, kind)?;
        // SAFETY: `mhandle` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(mhandle, MRS.insert(mr), "mhandle") }
    })
}

unsafe extern "C" fn reg_mr_dma_buf(
    comm: Ptr,
    data: Ptr,
    size: usize,
    kind: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut Ptr,
) -> NcclResult {
    guard("regMrDmaBuf", || {
        // SAFETY: `mhandle` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(mhandle, std::ptr::null_mut(), "mhandle") }?;
        let c = COMMS.get(comm)?;
        if data.is_null() || size == 0 {
            return Err(Error::InvalidArgument(format!(
                "regMrDmaBuf of {size} bytes at {data:?}: a dma-buf range needs an address and a size"
            )));
        }
        if fd < 0 {
            return Err(Error::InvalidArgument(format!("regMrDmaBuf with fd {fd}")));
        }
        // NCCL closes `fd` when we return; a backup NIC registers the memory later, from
        // our duplicate (close-on-exec), which the range keeps until `deregMr`.
        // SAFETY: `fd` is NCCL's open dma-buf fd for the length of this call.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let owned = borrowed
            .try_clone_to_owned()
            .map_err(|e| Error::System(format!("cannot duplicate dma-buf fd {fd}: {e}")))?;
        let mr = plugin::reg_mr_dmabuf(&c, data as usize, size, kind, offset, owned)?;
        // SAFETY: `mhandle` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(mhandle, MRS.insert(mr), "mhandle") }
    })
}

unsafe extern "C" fn dereg_mr(comm: Ptr, mhandle: Ptr) -> NcclResult {
    guard("deregMr", || {
        // NCCL may deregister a NULL handle, and may do so after closing the comm.
        if mhandle.is_null() {
            return Ok(());
        }
        let _ = comm;
        MRS.remove(mhandle).map(|_| ())
    })
}

unsafe extern "C" fn get_device_mr(comm: Ptr, mhandle: Ptr, dptr_mhandle: *mut Ptr) -> NcclResult {
    guard("getDeviceMr", || {
        // Host plugin: there is no device-side handle; NULL tells NCCL so.
        COMMS.get(comm)?;
        MRS.get(mhandle)?;
        // SAFETY: `dptr_mhandle` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(dptr_mhandle, std::ptr::null_mut(), "dptr_mhandle") }
    })
}

// ---- data path -------------------------------------------------------------------

/// # Safety
/// `request` as NCCL passes it to `isend` (NULL or valid for a write); `data` NULL or
/// valid for `size` bytes until the request finishes or the comm closes.
unsafe fn do_isend(
    send_comm: Ptr,
    data: Ptr,
    size: usize,
    tag: c_int,
    mhandle: Ptr,
    request: *mut Ptr,
) -> Result<(), Error> {
    // Always write *request first: NCCL may have left a stale value there.
    // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
    unsafe { write(request, std::ptr::null_mut(), "request") }?;
    let comm = COMMS.get(send_comm)?;
    let mr = MRS.get(mhandle)?;
    if data.is_null() && size > 0 {
        return Err(Error::InvalidArgument(
            "NULL data with a non-zero size".into(),
        ));
    }
    // SAFETY: NCCL keeps `data[..size]` valid and untouched until `test` reports the
    // request done or the comm is closed (the isend contract), as `new` requires.
    let buf = unsafe { UserBuf::new(data, size) };
    if let Some(req) = plugin::isend(&comm, buf, tag, &mr)? {
        // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(request, REQUESTS.insert(req), "request") }?;
    }
    Ok(())
}

unsafe extern "C" fn isend_v10(
    send_comm: Ptr,
    data: Ptr,
    size: usize,
    tag: c_int,
    mhandle: Ptr,
    _phandle: Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("isend", || {
        // SAFETY: the pointers NCCL passed to this entry point, as `do_isend` requires.
        unsafe { do_isend(send_comm, data, size, tag, mhandle, request) }
    })
}

unsafe extern "C" fn isend_v9(
    send_comm: Ptr,
    data: Ptr,
    size: usize,
    tag: c_int,
    mhandle: Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("isend", || {
        // SAFETY: the pointers NCCL passed to this entry point, as `do_isend` requires.
        unsafe { do_isend(send_comm, data, size, tag, mhandle, request) }
    })
}

unsafe extern "C" fn isend_v8(
    send_comm: Ptr,
    data: Ptr,
    size: c_int,
    tag: c_int,
    mhandle: Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("isend", || {
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("negative size {size}")))?;
        // SAFETY: the pointers NCCL passed to this entry point, as `do_isend` requires.
        unsafe { do_isend(send_comm, data, size, tag, mhandle, request) }
    })
}

/// # Safety
/// The arrays and `request` as NCCL passes them to `irecv`: NULL or valid for the call,
/// of `n` elements (`tags` is not read when `n` is 1); `data[i]` NULL or valid for the
/// size `size_at(i)` returns until the request finishes or the comm closes.
unsafe fn do_irecv(
    recv_comm: Ptr,
    n: c_int,
    data: *mut Ptr,
    size_at: impl Fn(usize) -> Result<usize, Error>,
    tags: *mut c_int,
    mhandles: *mut Ptr,
    request: *mut Ptr,
) -> Result<(), Error> {
    // Overwrites NCCL's pre-stored NCCL_NET_OPTIONAL_RECV_COMPLETION (0x1) or stale value.
    // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
    unsafe { write(request, std::ptr::null_mut(), "request") }?;
    let comm = COMMS.get(recv_comm)?;
    let count = usize::try_from(n)
        .ok()
        .filter(|c| (1..=MAX_RECVS).contains(c))
        .ok_or_else(|| {
            Error::Internal(format!(
                "irecv with n={n}: railover takes 1 to maxRecvs={MAX_RECVS}"
            ))
        })?;
    let (mut bufs, mut mrs) = (Vec::with_capacity(count), Vec::with_capacity(count));
    for i in 0..count {
        // SAFETY: `data` is NULL or NCCL's array for this call, of `n` elements.
        let buf = unsafe { read_at(data.cast_const(), i, "data") }?;
        let size = size_at(i)?;
        // Every buffer's tag picks its send, a single receive's too (as `ncclIbIsend`).
        // SAFETY: `tags` is NULL or NCCL's array for this call, of `n` elements.
        let tag = unsafe { read_at(tags.cast_const(), i, "tags") }?;
        // SAFETY: `mhandles` is NULL or NCCL's array for this call, of `n` elements.
        let mr = MRS.get(unsafe { read_at(mhandles.cast_const(), i, "mhandles") }?)?;
        if buf.is_null() && size > 0 {
            return Err(Error::InvalidArgument(format!(
                "NULL data[{i}] with a non-zero size"
            )));
        }
        // SAFETY: NCCL keeps `buf[..size]` valid and leaves it alone until `test` reports
        // the request done or the comm is closed (the irecv contract), as `new` requires.
        let ub = unsafe { UserBuf::new(buf, size) };
        bufs.push((ub, tag));
        mrs.push(mr);
    }
    let subs = (bufs.into_iter().zip(&mrs))
        .map(|((b, t), mr)| (b, t, &**mr))
        .collect();
    if let Some(req) = plugin::irecv(&comm, subs)? {
        // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(request, REQUESTS.insert(req), "request") }?;
    }
    Ok(())
}

unsafe extern "C" fn irecv_v10(
    recv_comm: Ptr,
    n: c_int,
    data: *mut Ptr,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut Ptr,
    _phandles: *mut Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("irecv", || {
        // SAFETY: `sizes` is NULL or NCCL's array for this call, of `n` elements.
        let size_at = |i| unsafe { read_at(sizes.cast_const(), i, "sizes") };
        // SAFETY: the pointers NCCL passed to this entry point, as `do_irecv` requires.
        unsafe { do_irecv(recv_comm, n, data, size_at, tags, mhandles, request) }
    })
}

unsafe extern "C" fn irecv_v9(
    recv_comm: Ptr,
    n: c_int,
    data: *mut Ptr,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("irecv", || {
        // SAFETY: `sizes` is NULL or NCCL's array for this call, of `n` elements.
        let size_at = |i| unsafe { read_at(sizes.cast_const(), i, "sizes") };
        // SAFETY: the pointers NCCL passed to this entry point, as `do_irecv` requires.
        unsafe { do_irecv(recv_comm, n, data, size_at, tags, mhandles, request) }
    })
}

unsafe extern "C" fn irecv_v8(
    recv_comm: Ptr,
    n: c_int,
    data: *mut Ptr,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhandles: *mut Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("irecv", || {
        let size_at = |i| {
            // SAFETY: `sizes` is NULL or NCCL's array for this call, of `n` elements.
            let s = unsafe { read_at(sizes.cast_const(), i, "sizes") }?;
            usize::try_from(s).map_err(|_| Error::InvalidArgument(format!("negative size {s}")))
        };
        // SAFETY: the pointers NCCL passed to this entry point, as `do_irecv` requires.
        unsafe { do_irecv(recv_comm, n, data, size_at, tags, mhandles, request) }
    })
}

unsafe extern "C" fn iflush(
    recv_comm: Ptr,
    n: c_int,
    data: *mut Ptr,
    sizes: *mut c_int,
    mhandles: *mut Ptr,
    request: *mut Ptr,
) -> NcclResult {
    guard("iflush", || {
        // NULL means "nothing to wait for": host memory, or nothing received.
        // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
        unsafe { write(request, std::ptr::null_mut(), "request") }?;
        let comm = COMMS.get(recv_comm)?;
        let count = usize::try_from(n)
            .ok()
            .filter(|c| *c <= MAX_RECVS)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("iflush with n={n}: 0 to maxRecvs={MAX_RECVS}"))
            })?;
        // As NCCL's IB transport: one READ, at the last buffer that received bytes; it
        // orders every earlier write of the NIC before it.
        let mut last = None;
        for i in 0..count {
            // SAFETY: `sizes` is NULL or NCCL's array for this call, of `n` elements.
            let size = unsafe { read_at(sizes.cast_const(), i, "sizes") }?;
            if size > 0 {
                last = Some(i);
            }
        }
        let Some(i) = last else {
            return Ok(());
        };
        // SAFETY: `data` and `mhandles` are NULL or NCCL's arrays for this call, of `n`
        // elements.
        let (buf, mh) = unsafe {
            (
                read_at(data.cast_const(), i, "data")?,
                read_at(mhandles.cast_const(), i, "mhandles")?,
            )
        };
        let mr = MRS.get(mh)?;
        mr.check(&comm, buf as usize, 1)?;
        if let Some(req) = plugin::iflush(&comm, buf as usize, &mr.region)? {
            // SAFETY: `request` is NCCL's out-pointer for this call: NULL or writable.
            unsafe { write(request, REQUESTS.insert(req), "request") }?;
        }
        Ok(())
    })
}

unsafe extern "C" fn test(request: Ptr, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard_code("test", || {
        let req = REQUESTS.get(request)?;
        if done.is_null() {
            return Err(Error::InvalidArgument("NULL done".into()));
        }
        match plugin::test(&req) {
            // SAFETY: `done` is NCCL's out-pointer for this call: NULL or writable.
            Ok(Status::Pending) => unsafe { write(done, 0, "done") }.map(|()| NCCL_SUCCESS),
            Ok(Status::Done(_)) => {
                REQUESTS.remove(request)?;
                if !sizes.is_null() {
                    for (i, n) in req.sizes().enumerate() {
                        // SAFETY: `sizes` is NCCL's out-array for this call, non-NULL here,
                        // of one element per buffer of the request.
                        unsafe { sizes.add(i).write(n.min(c_int::MAX as u64) as c_int) };
                    }
                }
                // SAFETY: `done` is NCCL's out-pointer for this call: NULL or writable.
                unsafe { write(done, 1, "done") }.map(|()| NCCL_SUCCESS)
            }
            Err(e) => {
                REQUESTS.remove(request)?;
                // SAFETY: `done` is NCCL's out-pointer for this call: NULL or writable.
                unsafe { write(done, 1, "done") }?;
                // One WARN per failed comm: its later requests fail with the same code,
                // quietly.
                if plugin::first_report(&req, &e) {
                    Err(e)
                } else {
                    Ok(super::error::code(&e))
                }
            }
        }
    })
}

unsafe extern "C" fn irecv_consumed(recv_comm: Ptr, _n: c_int, _request: Ptr) -> NcclResult {
    // Host plugin: buffers are NCCL's own, nothing to recycle.
    guard("irecvConsumed", || COMMS.get(recv_comm).map(|_| ()))
}

fn do_close(comm: Ptr) -> Result<(), Error> {
    let c = COMMS.remove(comm)?;
    // Requests NCCL will never test again (closing after an abort) go with the comm.
    REQUESTS.retain(|r| !Arc::ptr_eq(&r.comm, &c));
    plugin::close_comm(&c)
}

unsafe extern "C" fn close_send(send_comm: Ptr) -> NcclResult {
    guard("closeSend", || do_close(send_comm))
}

unsafe extern "C" fn close_recv(recv_comm: Ptr) -> NcclResult {
    guard("closeRecv", || do_close(recv_comm))
}

/// NIC fusion is refused: railover moves traffic between NICs itself, at failure time,
/// so NCCL's own choice of one NIC per connection stays in place (P8).
///
/// # Safety
/// `d` is NULL or valid for a write, as NCCL passes it to `makeVDevice`.
unsafe fn refuse_vdevice(d: *mut c_int) -> Result<(), Error> {
    // SAFETY: `d` is NCCL's out-pointer for this call: NULL or writable.
    unsafe { write_opt(d, -1) };
    tracing::info!(
        "railover: NIC fusion (makeVDevice) declined: railover fails over between NICs by itself"
    );
    Err(Error::InvalidUsage("railover does not fuse NICs".into()))
}

unsafe extern "C" fn make_v_device_v12(d: *mut c_int, _props: *mut VDevicePropsV12) -> NcclResult {
    // SAFETY: `d` is NCCL's out-pointer for this call: NULL or writable.
    guard("makeVDevice", || unsafe { refuse_vdevice(d) })
}

unsafe extern "C" fn make_v_device_v11(d: *mut c_int, _props: *mut VDevicePropsV11) -> NcclResult {
    // SAFETY: `d` is NCCL's out-pointer for this call: NULL or writable.
    guard("makeVDevice", || unsafe { refuse_vdevice(d) })
}

// ---- the tables ------------------------------------------------------------------

const NAME: *const std::ffi::c_char = plugin::NAME.as_ptr();

#[no_mangle]
pub static ncclNetPlugin_v12: Table<NetV12> = Table(NetV12 {
    name: NAME,
    init: init_v11,
    devices,
    get_properties: get_properties_v12,
    listen: listen_v11,
    connect: connect_v11,
    accept,
    reg_mr,
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr,
    isend: isend_v10,
    irecv: irecv_v10,
    iflush,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
    make_v_device: Some(make_v_device_v12),
    finalize,
    set_net_attr: Some(set_net_attr),
});

#[no_mangle]
pub static ncclNetPlugin_v11: Table<NetV11> = Table(NetV11 {
    name: NAME,
    init: init_v11,
    devices,
    get_properties: get_properties_v11,
    listen: listen_v11,
    connect: connect_v11,
    accept,
    reg_mr,
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr,
    isend: isend_v10,
    irecv: irecv_v10,
    iflush,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
    make_v_device: Some(make_v_device_v11),
    finalize,
    set_net_attr: Some(set_net_attr),
});

#[no_mangle]
pub static ncclNetPlugin_v10: Table<NetV10> = Table(NetV10 {
    name: NAME,
    init: init_v10,
    devices,
    get_properties: get_properties_v9,
    listen: listen_v8,
    connect: connect_v10,
    accept,
    reg_mr,
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr,
    isend: isend_v10,
    irecv: irecv_v10,
    iflush,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
    make_v_device: Some(make_v_device_v11),
});

#[no_mangle]
pub static ncclNetPlugin_v9: Table<NetV9> = Table(NetV9 {
    name: NAME,
    init: init_v8,
    devices,
    get_properties: get_properties_v9,
    listen: listen_v8,
    connect: connect_v8,
    accept,
    reg_mr,
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr,
    isend: isend_v9,
    irecv: irecv_v9,
    iflush,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
    make_v_device: Some(make_v_device_v11),
});

#[no_mangle]
pub static ncclNetPlugin_v8: Table<NetV8> = Table(NetV8 {
    name: NAME,
    init: init_v8,
    devices,
    get_properties: get_properties_v8,
    listen: listen_v8,
    connect: connect_v8,
    accept,
    reg_mr,
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr,
    isend: isend_v8,
    irecv: irecv_v8,
    iflush,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
});

/// Keeps the handle module's registries reachable from one place for tests.
pub use handle::Registry;
