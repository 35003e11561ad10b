//! Every call into libibverbs, through rdma-mummy-sys, and the owned wrappers around what
//! it hands out. Every `unsafe` block of the verbs fabric is here.
//!
//! rdma-mummy-sys `dlopen`s `libibverbs.so.1` at load time and forwards to it; without
//! the library every call fails with `EOPNOTSUPP`, so nothing here links rdma-core.
//! Only functions the bundled stubs implement are used: bindgen also declares some that
//! they do not (`ibv_query_port_speed`, `ibv_rate_to_mbps`, ...), and a plugin calling one
//! fails to `dlopen` in NCCL (`tests/abi_symbols.rs` checks the `.so`).
//!
//! Ownership makes the destruction order right: a [`Qp`] holds its [`Pd`] and its [`Cq`]
//! (or [`PolledCq`]), a [`Cq`] its [`CompChannel`], an [`Mr`] its [`Pd`], and all of them
//! the [`Context`], so a QP is destroyed before its CQ, a CQ before its channel, an MR and
//! a QP before their PD, and the device is closed last. The inline verbs (`poll_cq`, `post_send`, `post_recv`,
//! `req_notify_cq`, `query_port`) go through the context's provider table, so they are
//! reachable only through objects that a real device produced.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::Arc;

use rdma_mummy_sys as ffi;

/// `IBV_LINK_LAYER_*`: an anonymous C enum bindgen does not export.
pub const LINK_LAYER_INFINIBAND: u8 = 1;
pub const LINK_LAYER_ETHERNET: u8 = 2;
/// `IBV_QPF_GRH_REQUIRED` in `ibv_port_attr.flags`.
pub const QPF_GRH_REQUIRED: u8 = 1;
/// `IBV_PORT_ACTIVE`.
pub const PORT_ACTIVE: u32 = ffi::ibv_port_state::IBV_PORT_ACTIVE;

/// Async event numbers (`enum ibv_event_type`), read as raw numbers: a provider may report
/// one newer than the crate's Rust enum, which must not be materialised as that enum.
pub mod event {
    pub const CQ_ERR: u32 = 0;
    pub const QP_FATAL: u32 = 1;
    pub const QP_REQ_ERR: u32 = 2;
    pub const QP_ACCESS_ERR: u32 = 3;
    pub const DEVICE_FATAL: u32 = 8;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
}

/// Work-completion status numbers used by callers.
pub mod wc {
    pub const SUCCESS: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_SUCCESS;
    pub const LOC_LEN_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_LOC_LEN_ERR;
    pub const LOC_QP_OP_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_LOC_QP_OP_ERR;
    pub const LOC_PROT_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_LOC_PROT_ERR;
    pub const WR_FLUSH_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
    pub const REM_ACCESS_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
    pub const REM_INV_REQ_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_REM_INV_REQ_ERR;
    pub const REM_OP_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_REM_OP_ERR;
    pub const RETRY_EXC_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
    pub const RNR_RETRY_EXC_ERR: u32 = rdma_mummy_sys::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR;
    pub const RECV_RDMA_WITH_IMM: u32 = rdma_mummy_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;
}

/// Mirror of `struct ibv_async_event` whose event type is a plain number.
#[repr(C)]
struct RawAsyncEvent {
    element: ffi::ibv_async_event_element_t,
    event_type: u32,
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The error of a call that returns an errno value itself (0 = success).
fn rc(r: c_int, what: &str) -> io::Result<()> {
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::from_raw_os_error(if r < 0 { errno() } else { r });
    Err(io::Error::new(e.kind(), format!("{what}: {e}")))
}

fn null_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd number has no memory effects; a bad fd is an error return.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One device as the device list names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedDevice {
    pub name: String,
    /// Node GUID, host byte order.
    pub guid: u64,
}

/// The devices libibverbs knows. `Err(errno)` when there is no list at all:
/// `EOPNOTSUPP` without libibverbs, `ENOSYS` without kernel RDMA support.
pub fn device_list() -> Result<Vec<ListedDevice>, i32> {
    with_device_list(|devs| {
        devs.iter()
            .map(|&d| ListedDevice {
                name: device_name(d),
                // SAFETY: `d` comes from the live list.
                guid: u64::from_be(unsafe { ffi::ibv_get_device_guid(d) }),
            })
            .collect()
    })
}

fn device_name(d: *mut ffi::ibv_device) -> String {
    // SAFETY: `d` comes from a live device list; the name lives as long as the list.
    let p = unsafe { ffi::ibv_get_device_name(d) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a non-NULL name is a NUL-terminated string owned by the device.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// What `ibv_fork_init` made of registered memory across `fork()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForkSafety {
    /// The kernel keeps pinned pages with the parent on fork (copy-on-fork, 5.13 and
    /// later): nothing to do.
    Unneeded,
    /// libibverbs marks registered memory `MADV_DONTFORK`, so a child's copy-on-write
    /// cannot move a page the NIC still writes to.
    Enabled,
    /// Neither: `ibv_fork_init` returned this error (`EOPNOTSUPP` without libibverbs).
    Disabled(i32),
}

impl std::fmt::Display for ForkSafety {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ForkSafety::Unneeded => f.write_str("unneeded (the kernel copies pinned pages on fork)"),
            ForkSafety::Enabled => {
                f.write_str("enabled (registered memory is MADV_DONTFORK, as ibv_fork_init makes it)")
            }
            ForkSafety::Disabled(e) => write!(
                f,
                "off: ibv_fork_init failed ({}); a fork() after registration (DataLoader workers) can corrupt pinned buffers on kernels before 5.13",
                io::Error::from_raw_os_error(*e)
            ),
        }
    }
}

/// Makes registered memory safe across `fork()` before anything is registered, as NCCL
/// does before it lists devices: a training job's DataLoader forks workers after
/// communicators are up, and on kernels before 5.13 the parent's next write to a pinned
/// page would move it away from the NIC's DMA. Called once, before the first device list
/// (libibverbs wants it before any other call); later calls say what the first did.
pub fn fork_safety() -> ForkSafety {
    static DONE: std::sync::OnceLock<ForkSafety> = std::sync::OnceLock::new();
    *DONE.get_or_init(|| {
        // SAFETY: no arguments; called before any other verbs call of this process
        // (the first device list waits for it).
        let rc = unsafe { ffi::ibv_fork_init() };
        // SAFETY: no arguments; a query of libibverbs' state.
        let status = unsafe { ffi::ibv_is_fork_initialized() };
        let safety = match status {
            ffi::IBV_FORK_UNNEEDED => ForkSafety::Unneeded,
            ffi::IBV_FORK_ENABLED => ForkSafety::Enabled,
            _ => ForkSafety::Disabled(if rc != 0 { rc } else { libc::EINVAL }),
        };
        match safety {
            ForkSafety::Disabled(e) if e == libc::EOPNOTSUPP => {} // no libibverbs: no verbs
            ForkSafety::Disabled(_) => tracing::warn!("railover: fork safety {safety}"),
            _ => tracing::debug!("railover: fork safety {safety}"),
        }
        safety
    })
}

/// Runs `f` over the device list and frees it.
fn with_device_list<T>(f: impl FnOnce(&[*mut ffi::ibv_device]) -> T) -> Result<T, i32> {
    fork_safety();
    // Preset: without libibverbs the stub does not write it.
    let mut n: c_int = 0;
    // SAFETY: `n` is a live local the call writes at most once.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(errno());
    }
    let n = usize::try_from(n).unwrap_or(0);
    // SAFETY: a non-NULL list holds `n` device pointers (then a NULL).
    let devs = unsafe { std::slice::from_raw_parts(list, n) };
    let out = f(devs);
    // SAFETY: the list came from ibv_get_device_list and is freed once; `devs` is not
    // used after this.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(out)
}

/// An open device (`ibv_context`).
#[derive(Debug)]
pub struct Context {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs objects may be used from any thread (the library locks internally);
// each wrapper is used by one owner at a time.
unsafe impl Send for Context {}
// SAFETY: the `&self` methods are thread-safe verbs (queries, event reads).
unsafe impl Sync for Context {}

/// The attributes of a device that the fabric uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    pub phys_port_cnt: u8,
    pub max_qp_wr: i32,
    pub max_cqe: i32,
    pub vendor_part_id: u32,
    /// RDMA READs a QP may have outstanding as their target, and as their initiator.
    pub max_qp_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
}

/// The attributes of a port that the fabric uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortAttr {
    /// `IBV_PORT_*`: 4 is ACTIVE.
    pub state: u32,
    /// `IBV_MTU_*`: 1 = 256 ... 5 = 4096.
    pub active_mtu: u32,
    pub gid_tbl_len: i32,
    pub lid: u16,
    pub active_width: u8,
    pub active_speed: u8,
    pub active_speed_ex: u32,
    pub link_layer: u8,
    pub flags: u8,
}

/// One GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid: [u8; 16],
    /// 0 IB, 1 RoCE v1, 2 RoCE v2.
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// An async event, read and acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// `event::*`.
    pub kind: u32,
    /// The port, for port events.
    pub port: Option<u8>,
    /// The QP number, for QP events.
    pub qp_num: Option<u32>,
    /// The CQ's identity ([`Cq::id`], [`PolledCq::id`]), for `CQ_ERR`.
    pub cq: Option<usize>,
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> io::Result<Arc<Context>> {
        let opened = with_device_list(|devs| {
            let d = devs.iter().copied().find(|&d| device_name(d) == name)?;
            // SAFETY: `d` is in the live list; an open context stays valid after the list
            // is freed.
            Some(unsafe { ffi::ibv_open_device(d) })
        })
        .map_err(io::Error::from_raw_os_error)?;
        let Some(p) = opened else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no verbs device {name}"),
            ));
        };
        let ctx = NonNull::new(p).ok_or_else(|| null_err(&format!("ibv_open_device({name})")))?;
        Ok(Arc::new(Context {
            ctx,
            name: name.to_string(),
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_device(&self) -> io::Result<DeviceAttr> {
        let mut a = MaybeUninit::<ffi::ibv_device_attr>::zeroed();
        // SAFETY: the context is open; `a` is a live zeroed struct of the right type.
        let r = unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), a.as_mut_ptr()) };
        rc(r, "ibv_query_device")?;
        // SAFETY: zeroed is a valid value for this plain C struct, and the call filled it.
        let a = unsafe { a.assume_init() };
        Ok(DeviceAttr {
            phys_port_cnt: a.phys_port_cnt,
            max_qp_wr: a.max_qp_wr,
            max_cqe: a.max_cqe,
            vendor_part_id: a.vendor_part_id,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom,
        })
    }

    pub fn query_port(&self, port: u8) -> io::Result<PortAttr> {
        let mut a = MaybeUninit::<ffi::ibv_port_attr>::zeroed();
        // SAFETY: the context is a real open device (the inline call goes through its
        // provider table); `a` is a live zeroed struct.
        let r = unsafe { ffi::ibv_query_port(self.ctx.as_ptr(), port, a.as_mut_ptr()) };
        rc(r, "ibv_query_port")?;
        // SAFETY: plain C struct, zeroed then filled.
        let a = unsafe { a.assume_init() };
        Ok(PortAttr {
            state: a.state,
            active_mtu: a.active_mtu,
            gid_tbl_len: a.gid_tbl_len,
            lid: a.lid,
            active_width: a.active_width,
            active_speed: a.active_speed,
            active_speed_ex: a.active_speed_ex,
            link_layer: a.link_layer,
            flags: a.flags,
        })
    }

    /// GID `index` of `port`; `None` for an empty or unreadable slot.
    pub fn query_gid(&self, port: u8, index: u32) -> Option<GidEntry> {
        let mut e = MaybeUninit::<ffi::ibv_gid_entry>::zeroed();
        // SAFETY: open context, live zeroed entry; the size passed is the entry's.
        let r = unsafe {
            ffi::ibv_query_gid_ex(self.ctx.as_ptr(), port.into(), index, e.as_mut_ptr(), 0)
        };
        if r != 0 {
            return None;
        }
        // SAFETY: plain C struct, zeroed then filled.
        let e = unsafe { e.assume_init() };
        // SAFETY: every bit pattern of the union is a valid byte array.
        let gid = unsafe { e.gid.raw };
        Some(GidEntry {
            index,
            gid,
            gid_type: e.gid_type,
            ndev_ifindex: e.ndev_ifindex,
        })
    }

    /// The async-event fd, made non-blocking (for the reactor's `Poll`).
    pub fn async_fd(&self) -> io::Result<RawFd> {
        // SAFETY: the context is open; the field is a plain int.
        let fd = unsafe { (*self.ctx.as_ptr()).async_fd };
        set_nonblocking(fd)?;
        Ok(fd)
    }

    /// The next async event, acknowledged; `None` when none is waiting (the fd must be
    /// non-blocking: see [`Context::async_fd`]).
    pub fn next_async_event(&self) -> Option<AsyncEvent> {
        let mut ev = MaybeUninit::<RawAsyncEvent>::zeroed();
        // SAFETY: `RawAsyncEvent` has the layout of `ibv_async_event` with a u32 in place
        // of the C enum; the call fills it.
        let r = unsafe {
            ffi::ibv_get_async_event(
                self.ctx.as_ptr(),
                ev.as_mut_ptr().cast::<ffi::ibv_async_event>(),
            )
        };
        if r != 0 {
            return None;
        }
        // SAFETY: filled by the call above.
        let e = unsafe { ev.assume_init_ref() };
        let kind = e.event_type;
        let port = matches!(kind, event::PORT_ACTIVE | event::PORT_ERR)
            // SAFETY: for port events the element is the port number.
            .then(|| unsafe { e.element.port_num } as u8);
        let qp_num = if matches!(
            kind,
            event::QP_FATAL | event::QP_REQ_ERR | event::QP_ACCESS_ERR
        ) {
            // SAFETY: for QP events the element is the QP, alive until the event is acked.
            let qp = unsafe { e.element.qp };
            // SAFETY: non-NULL QP pointer from the event, read before the ack.
            (!qp.is_null()).then(|| unsafe { (*qp).qp_num })
        } else {
            None
        };
        let cq = if kind == event::CQ_ERR {
            // SAFETY: for CQ events the element is the CQ; only its address is kept, as
            // the identity `Cq::id` gives.
            Some(unsafe { e.element.cq } as usize)
        } else {
            None
        };
        // SAFETY: acknowledges exactly the event just read (destroying its object waits
        // for this).
        unsafe { ffi::ibv_ack_async_event(ev.as_mut_ptr().cast::<ffi::ibv_async_event>()) };
        Some(AsyncEvent {
            kind,
            port,
            qp_num,
            cq,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object of the context holds an `Arc` of it, so none is left.
        unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd {
    pd: NonNull<ffi::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for Pd {}
// SAFETY: a PD has no `&self` operation of its own.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<Pd>> {
        // SAFETY: the context is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx.as_ptr()) };
        Ok(Arc::new(Pd {
            pd: NonNull::new(pd).ok_or_else(|| null_err("ibv_alloc_pd"))?,
            ctx: ctx.clone(),
        }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: QPs and MRs of this PD hold an `Arc` of it, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// Page-aligned memory registered with a PD, owned by the region. The NIC reads and
/// writes it behind Rust's back, so it is never lent out as a slice: bytes are copied in
/// and out.
#[derive(Debug)]
pub struct Mr {
    mr: NonNull<ffi::ibv_mr>,
    buf: NonNull<u8>,
    len: usize,
    _pd: Arc<Pd>,
}

// SAFETY: see `Context`; the buffer is owned by the region.
unsafe impl Send for Mr {}
// SAFETY: `&self` methods copy with raw pointer reads/writes bounded by `len`.
unsafe impl Sync for Mr {}

const MR_ALIGN: usize = 4096;

impl Mr {
    /// Allocates `len` zeroed bytes and registers them for local write and remote write
    /// and read.
    pub fn new(pd: &Arc<Pd>, len: usize) -> io::Result<Mr> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), MR_ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let buf = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "no memory for an MR"))?;
        let access = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as c_int;
        // SAFETY: `buf` is a live allocation of `len` bytes that the region owns and
        // frees only after deregistering.
        let mr =
            unsafe { ffi::ibv_reg_mr(pd.pd.as_ptr(), buf.as_ptr().cast::<c_void>(), len, access) };
        let Some(mr) = NonNull::new(mr) else {
            let e = null_err("ibv_reg_mr");
            // SAFETY: allocated above with this layout, not registered.
            unsafe { std::alloc::dealloc(buf.as_ptr(), layout) };
            return Err(e);
        };
        Ok(Mr {
            mr,
            buf,
            len,
            _pd: pd.clone(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    fn check(&self, off: usize, n: usize) -> io::Result<()> {
        if off.checked_add(n).map_or(true, |end| end > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("[{off}, +{n}) is outside the {}-byte region", self.len),
            ));
        }
        Ok(())
    }

    /// Copies `src` into the region at `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> io::Result<()> {
        self.check(off, src.len())?;
        // SAFETY: in bounds (checked); `src` cannot overlap the region, which is never
        // lent out.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.buf.as_ptr().add(off), src.len())
        };
        Ok(())
    }

    /// Copies bytes of the region at `off` into `dst`.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> io::Result<()> {
        self.check(off, dst.len())?;
        // SAFETY: in bounds (checked); `dst` cannot overlap the region.
        unsafe {
            std::ptr::copy_nonoverlapping(self.buf.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once; then the memory is ours alone.
        unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        let layout = std::alloc::Layout::from_size_align(self.len.max(1), MR_ALIGN)
            .expect("the layout was valid at allocation");
        // SAFETY: allocated in `new` with this layout; the NIC can no longer reach it.
        unsafe { std::alloc::dealloc(self.buf.as_ptr(), layout) };
    }
}

/// Memory the plugin does not own (a range NCCL registered with `regMr`) registered with
/// a PD, for local and remote writes. Registering reads and writes nothing; the NIC
/// touches the range only when a work request names it (a send from it) or a peer writes
/// at an address this end advertised for an open receive, both inside NCCL's lending of
/// the buffer (see `transport::memory`). NCCL keeps the range allocated until `deregMr`,
/// and this registration goes with the last holder of that range.
#[derive(Debug)]
pub struct UserMr {
    mr: NonNull<ffi::ibv_mr>,
    addr: u64,
    len: usize,
    _pd: Arc<Pd>,
}

// SAFETY: see `Context`; the wrapper only holds the registration's keys.
unsafe impl Send for UserMr {}
// SAFETY: the `&self` methods read the registration's keys.
unsafe impl Sync for UserMr {}

/// What peers and flushes may do with user memory: be written (payloads), be read (a
/// flush reads back through the NIC that wrote).
const USER_ACCESS: ffi::ibv_access_flags = ffi::ibv_access_flags(
    ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
);

/// PCIe relaxed ordering on user registrations, as NCCL asks for it
/// (`NCCL_IB_PCI_RELAXED_ORDERING`'s default): the NIC's writes into GPU memory may then
/// pass each other on the way, which is where a GPU behind a PCIe switch gets its full
/// rate. It is an optional access flag: a driver or a platform without it ignores it.
/// libibverbs older than 1.8 (rdma-core 27) has no `ibv_reg_mr_iova2` to carry it; the
/// first registration that finds so turns it off for the process.
const RELAXED: u32 = ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
static NO_RELAXED_ORDERING: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether user registrations ask for relaxed ordering (until one found libibverbs
/// without it).
pub fn relaxed_ordering() -> bool {
    !NO_RELAXED_ORDERING.load(std::sync::atomic::Ordering::Relaxed)
}

impl UserMr {
    /// Registers `[addr, addr + len)` with `pd`, with relaxed ordering where libibverbs
    /// carries it (see [`relaxed_ordering`]).
    pub fn register(pd: &Arc<Pd>, addr: usize, len: usize) -> io::Result<UserMr> {
        let mut mr = null_mut();
        if relaxed_ordering() {
            // SAFETY: as below; the iova is the address, as for `ibv_reg_mr`.
            mr = unsafe {
                ffi::ibv_reg_mr_iova2(
                    pd.pd.as_ptr(),
                    addr as *mut c_void,
                    len,
                    addr as u64,
                    USER_ACCESS.0 | RELAXED,
                )
            };
            if mr.is_null() && errno() == libc::EOPNOTSUPP {
                NO_RELAXED_ORDERING.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(
                    "railover: libibverbs has no ibv_reg_mr_iova2: registrations without relaxed ordering"
                );
            } else if mr.is_null() {
                return Err(null_err("ibv_reg_mr_iova2"));
            }
        }
        if mr.is_null() {
            let access = USER_ACCESS.0 as c_int;
            // SAFETY: the kernel pins and checks the range (EFAULT if it is not mapped);
            // the call itself reads nothing through the pointer.
            mr = unsafe { ffi::ibv_reg_mr(pd.pd.as_ptr(), addr as *mut c_void, len, access) };
        }
        let mr = NonNull::new(mr).ok_or_else(|| null_err("ibv_reg_mr"))?;
        Ok(UserMr {
            mr,
            addr: addr as u64,
            len,
            _pd: pd.clone(),
        })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// Registers `len` bytes of the dma-buf `fd` from `offset`, addressed from `iova` (the
    /// range's virtual address, so work requests name it as for any other registration).
    /// The kernel takes its own reference on the dma-buf: `fd` may close after the call.
    pub fn register_dmabuf(
        pd: &Arc<Pd>,
        fd: BorrowedFd<'_>,
        offset: u64,
        iova: usize,
        len: usize,
    ) -> io::Result<UserMr> {
        // SAFETY: the kernel checks the fd, offset and length; nothing is read through a
        // pointer, and `fd` is open for the call (borrowed).
        let mr = unsafe {
            ffi::ibv_reg_dmabuf_mr(
                pd.pd.as_ptr(),
                offset,
                len,
                iova as u64,
                fd.as_raw_fd(),
                (USER_ACCESS.0 | RELAXED) as c_int,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| null_err("ibv_reg_dmabuf_mr"))?;
        Ok(UserMr {
            mr,
            addr: iova as u64,
            len,
            _pd: pd.clone(),
        })
    }

    /// Whether the device's driver registers dma-buf memory, as NCCL tells: a registration
    /// of no fd fails with `EBADF` where dma-bufs are supported, and with `EOPNOTSUPP` or
    /// `EPROTONOSUPPORT` where the kernel, the driver or libibverbs is without them.
    pub fn dmabuf_supported(pd: &Arc<Pd>) -> Result<(), io::Error> {
        // SAFETY: an fd of -1 and a length of 0: the call only validates its arguments.
        let mr = unsafe { ffi::ibv_reg_dmabuf_mr(pd.pd.as_ptr(), 0, 0, 0, -1, 0) };
        let e = io::Error::last_os_error();
        if let Some(mr) = NonNull::new(mr) {
            // SAFETY: registered just now, deregistered once.
            unsafe { ffi::ibv_dereg_mr(mr.as_ptr()) };
            return Ok(());
        }
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT) => Err(e),
            _ => Ok(()),
        }
    }

    /// Whether `[addr, addr + len)` lies inside the registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len as u64)
    }
}

impl Drop for UserMr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once. QPs that used it completed
        // or were flushed: the last holder drops it after NCCL's last request on the range.
        unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// One RDMA WRITE of registered bytes to a peer's registered memory.
#[derive(Debug, Clone, Copy)]
pub struct RawWrite {
    /// Local bytes: address, length and the key of a registration covering them.
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: Option<u32>,
    pub signaled: bool,
    pub wr_id: u64,
}

/// A completion channel: one fd that becomes readable when an armed CQ has a completion.
#[derive(Debug)]
pub struct CompChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for CompChannel {}
// SAFETY: reading events is thread-safe in libibverbs.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// A channel with a non-blocking fd.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<CompChannel>> {
        // SAFETY: the context is open.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.ctx.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| null_err("ibv_create_comp_channel"))?;
        let out = Arc::new(CompChannel {
            ch,
            _ctx: ctx.clone(),
        });
        set_nonblocking(out.fd())?;
        Ok(out)
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel lives until drop; the field is a plain int.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    /// Waits up to `timeout` for the fd to become readable (for tools without a
    /// reactor); `Ok(false)` on timeout.
    pub fn wait(&self, timeout: std::time::Duration) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as c_int;
        // SAFETY: one live pollfd, count 1.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        match r {
            r if r < 0 => Err(io::Error::last_os_error()),
            0 => Ok(false),
            _ => Ok(true),
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ on the channel holds an `Arc` of it, so none is left.
        unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
    }
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// `wc::*`; 0 is success.
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub vendor_err: u32,
}

/// A completion queue bound to a channel. It is the channel's only CQ, so every event on
/// the channel is this CQ's.
#[derive(Debug)]
pub struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    channel: Arc<CompChannel>,
}

// SAFETY: see `Context`.
unsafe impl Send for Cq {}
// SAFETY: polling and event reads are thread-safe in libibverbs; one poller at a time is
// the caller's contract (the reactor owns the CQ).
unsafe impl Sync for Cq {}

impl Cq {
    /// The CQ's identity, as a `CQ_ERR` event names it.
    pub fn id(&self) -> usize {
        self.cq.as_ptr() as usize
    }

    /// A CQ of at least `cqe` entries on `channel`, armed.
    pub fn new(ctx: &Arc<Context>, channel: &Arc<CompChannel>, cqe: i32) -> io::Result<Arc<Cq>> {
        // SAFETY: context and channel are open; no cq_context is used.
        let cq = unsafe {
            ffi::ibv_create_cq(ctx.ctx.as_ptr(), cqe, null_mut(), channel.ch.as_ptr(), 0)
        };
        let cq = Arc::new(Cq {
            cq: NonNull::new(cq).ok_or_else(|| null_err("ibv_create_cq"))?,
            channel: channel.clone(),
        });
        cq.arm()?;
        Ok(cq)
    }

    pub fn channel(&self) -> &Arc<CompChannel> {
        &self.channel
    }

    fn arm(&self) -> io::Result<()> {
        // SAFETY: a CQ of a real device (inline call through its provider table).
        rc(
            unsafe { ffi::ibv_req_notify_cq(self.cq.as_ptr(), 0) },
            "ibv_req_notify_cq",
        )
    }

    /// The channel's readiness handler, before polling: reads every pending event,
    /// acknowledges them and re-arms, so that a completion arriving from now on raises
    /// the fd again. Then poll until empty. Returns the number of events read.
    pub fn drain_and_rearm(&self) -> io::Result<u32> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut ffi::ibv_cq = null_mut();
            let mut ctx: *mut c_void = null_mut();
            // SAFETY: live channel; the outputs are live locals. Non-blocking fd: fails
            // with EAGAIN when empty.
            if unsafe { ffi::ibv_get_cq_event(self.channel.ch.as_ptr(), &mut cq, &mut ctx) } != 0 {
                break;
            }
            debug_assert_eq!(cq, self.cq.as_ptr(), "one CQ per channel");
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the events read above, all of this CQ.
            unsafe { ffi::ibv_ack_cq_events(self.cq.as_ptr(), n) };
        }
        self.arm()?;
        Ok(n)
    }

    /// Copies up to `max` completions out; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<usize> {
        poll_cq(self.cq, out, max)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs on this CQ hold an `Arc` of it, so none is left; every event read
        // was acknowledged in `drain_and_rearm`.
        unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// A completion queue without a channel, for a user that polls it (the flush QP's):
/// nothing arms it, nothing reads events for it.
#[derive(Debug)]
pub struct PolledCq {
    cq: NonNull<ffi::ibv_cq>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for PolledCq {}
// SAFETY: polling is thread-safe in libibverbs; one poller at a time is the caller's
// contract (its owner polls it under a lock).
unsafe impl Sync for PolledCq {}

impl PolledCq {
    /// The CQ's identity, as a `CQ_ERR` event names it.
    pub fn id(&self) -> usize {
        self.cq.as_ptr() as usize
    }

    /// A CQ of at least `cqe` entries with no completion channel.
    pub fn new(ctx: &Arc<Context>, cqe: i32) -> io::Result<Arc<PolledCq>> {
        // SAFETY: the context is open; no cq_context, no channel.
        let cq = unsafe { ffi::ibv_create_cq(ctx.ctx.as_ptr(), cqe, null_mut(), null_mut(), 0) };
        Ok(Arc::new(PolledCq {
            cq: NonNull::new(cq).ok_or_else(|| null_err("ibv_create_cq"))?,
            _ctx: ctx.clone(),
        }))
    }

    /// Copies up to `max` completions out; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<usize> {
        poll_cq(self.cq, out, max)
    }
}

impl Drop for PolledCq {
    fn drop(&mut self) {
        // SAFETY: QPs on this CQ hold an `Arc` of it, so none is left; it has no channel,
        // so no event is left unacknowledged.
        unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// Copies up to `max` completions of `cq` out; returns how many. One poller at a time.
fn poll_cq(cq: NonNull<ffi::ibv_cq>, out: &mut Vec<Completion>, max: usize) -> io::Result<usize> {
    const BATCH: usize = 16;
    let mut wcs = [MaybeUninit::<ffi::ibv_wc>::zeroed(); BATCH];
    let mut total = 0;
    while total < max {
        let want = (max - total).min(BATCH) as i32;
        // SAFETY: a CQ of a real device; `wcs` has room for `want` entries.
        let n = unsafe { ffi::ibv_poll_cq(cq.as_ptr(), want, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq failed ({n})")));
        }
        for w in &wcs[..n as usize] {
            // SAFETY: the first `n` entries were filled by the poll.
            let w = unsafe { w.assume_init_ref() };
            let with_imm = w.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            out.push(Completion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                byte_len: w.byte_len,
                imm: with_imm.then(|| {
                    // SAFETY: the union holds the immediate when the flag says so.
                    u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })
                }),
                qp_num: w.qp_num,
                vendor_err: w.vendor_err,
            });
        }
        total += n as usize;
        if (n as usize) < want as usize {
            break;
        }
    }
    Ok(total)
}

/// Where a QP's peer is, as exchanged at connection time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    /// The peer's GID; used (with a GRH) when `global`.
    pub gid: [u8; 16],
    pub global: bool,
    /// `IBV_MTU_*` to use on the path (the smaller of both ends).
    pub mtu: u32,
}

/// Local addressing of a QP's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalPort {
    pub port: u8,
    pub sgid_index: u8,
    pub traffic_class: u8,
    pub service_level: u8,
}

/// Send-side timing of an RC QP: the local ACK timeout is 4.096 us * 2^`timeout`, tried
/// `retry_cnt` + 1 times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTiming {
    pub timeout: u8,
    pub retry_cnt: u8,
}

/// An RC queue pair.
#[derive(Debug)]
pub struct Qp {
    qp: NonNull<ffi::ibv_qp>,
    _cq: QpCq,
    _pd: Arc<Pd>,
}

/// The CQ a QP completes on, held (never read) so that it outlives the QP.
#[derive(Debug)]
enum QpCq {
    Armed { _cq: Arc<Cq> },
    Polled { _cq: Arc<PolledCq> },
}

// SAFETY: see `Context`.
unsafe impl Send for Qp {}
// SAFETY: posting is thread-safe in libibverbs providers.
unsafe impl Sync for Qp {}

/// One WRITE of a local region's bytes to a remote address.
#[derive(Debug, Clone, Copy)]
pub struct Write<'a> {
    pub local: &'a Mr,
    pub offset: usize,
    pub len: usize,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Immediate data: a WRITE_WITH_IMM, consuming a posted receive at the peer.
    pub imm: Option<u32>,
    pub signaled: bool,
    pub wr_id: u64,
}

/// One RDMA READ of remote bytes into a local region, always signaled.
#[derive(Debug, Clone, Copy)]
pub struct Read<'a> {
    pub local: &'a Mr,
    pub offset: usize,
    pub len: usize,
    pub remote_addr: u64,
    pub rkey: u32,
    pub wr_id: u64,
}

impl Qp {
    /// An RC QP on `pd` using `cq` for sends and receives.
    pub fn new_rc(pd: &Arc<Pd>, cq: &Arc<Cq>, max_send: u32, max_recv: u32) -> io::Result<Qp> {
        Qp::create_rc(
            pd,
            cq.cq,
            QpCq::Armed { _cq: cq.clone() },
            max_send,
            max_recv,
        )
    }

    /// An RC QP on `pd` completing on the polled `cq`.
    pub fn new_rc_polled(
        pd: &Arc<Pd>,
        cq: &Arc<PolledCq>,
        max_send: u32,
        max_recv: u32,
    ) -> io::Result<Qp> {
        Qp::create_rc(
            pd,
            cq.cq,
            QpCq::Polled { _cq: cq.clone() },
            max_send,
            max_recv,
        )
    }

    /// `cq` is the CQ `held` holds.
    fn create_rc(
        pd: &Arc<Pd>,
        cq: NonNull<ffi::ibv_cq>,
        held: QpCq,
        max_send: u32,
        max_recv: u32,
    ) -> io::Result<Qp> {
        // SAFETY: zeroed is a valid value for this plain C struct.
        let mut ia: ffi::ibv_qp_init_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        ia.send_cq = cq.as_ptr();
        ia.recv_cq = cq.as_ptr();
        ia.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        ia.cap.max_send_wr = max_send;
        ia.cap.max_recv_wr = max_recv;
        ia.cap.max_send_sge = 1;
        ia.cap.max_recv_sge = 1;
        // SAFETY: PD and CQ are alive (and kept alive by the QP); `ia` is a live local.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd.as_ptr(), &mut ia) };
        Ok(Qp {
            qp: NonNull::new(qp).ok_or_else(|| null_err("ibv_create_qp"))?,
            _cq: held,
            _pd: pd.clone(),
        })
    }

    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP lives until drop.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    fn modify(
        &self,
        a: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        what: &str,
    ) -> io::Result<()> {
        // SAFETY: live QP; `a` is a live attribute struct filled for `mask`.
        rc(
            unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), a, mask.0 as c_int) },
            what,
        )
    }

    fn zeroed_attr() -> ffi::ibv_qp_attr {
        // SAFETY: zeroed is a valid value for this plain C struct.
        unsafe { MaybeUninit::zeroed().assume_init() }
    }

    /// RESET -> INIT, accepting remote writes and reads.
    pub fn to_init(&self, port: u8) -> io::Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0;
        self.modify(
            &mut a,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "modify_qp(INIT)",
        )
    }

    /// INIT -> RTR towards `remote`, which may have `reads` RDMA READs outstanding
    /// against this QP (1 where it never READs: a lane).
    pub fn to_rtr(&self, local: &LocalPort, remote: &RemoteQp, reads: u8) -> io::Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = remote.mtu;
        a.dest_qp_num = remote.qp_num;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = reads.max(1);
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = local.service_level;
        a.ah_attr.port_num = local.port;
        if remote.global {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = local.sgid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = local.traffic_class;
        }
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "modify_qp(RTR)",
        )
    }

    /// RTR -> RTS, with at most `reads` of its own RDMA READs outstanding.
    pub fn to_rts(&self, psn: u32, timing: QpTiming, reads: u8) -> io::Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = psn;
        a.timeout = timing.timeout;
        a.retry_cnt = timing.retry_cnt;
        a.rnr_retry = 7;
        a.max_rd_atomic = reads.max(1);
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "modify_qp(RTS)",
        )
    }

    /// The QP stays up (RTS to RTS) but takes no more RDMA WRITEs from its peer: they
    /// are refused with a remote access error. What it sends still goes out.
    pub fn refuse_remote_writes(&self) -> io::Result<()> {
        let mut a = Self::zeroed_attr();
        a.qp_access_flags = 0;
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "modify_qp(access flags)",
        )
    }

    /// The fence: the QP goes to ERR; what it still holds is flushed, not sent.
    pub fn to_err(&self) -> io::Result<()> {
        let mut a = Self::zeroed_attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "modify_qp(ERR)",
        )
    }

    /// Posts a receive without buffers: enough to take one WRITE_WITH_IMM.
    pub fn post_recv(&self, wr_id: u64) -> io::Result<()> {
        // SAFETY: zeroed is a valid value for this plain C struct (no SGE, no next).
        let mut r: ffi::ibv_recv_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        r.wr_id = wr_id;
        let mut bad: *mut ffi::ibv_recv_wr = null_mut();
        // SAFETY: a QP of a real device; `r` is a complete WR with no list to read.
        rc(
            unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), &mut r, &mut bad) },
            "ibv_post_recv",
        )
    }

    /// Posts one RDMA WRITE (with immediate when `w.imm` is set). The local region must
    /// outlive the completion: the caller drops QPs before their regions.
    pub fn post_write(&self, w: &Write<'_>) -> io::Result<()> {
        w.local.check(w.offset, w.len)?;
        let len = u32::try_from(w.len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a WRITE is at most 4 GiB"))?;
        self.post_raw(&RawWrite {
            addr: w.local.addr() + w.offset as u64,
            len,
            lkey: w.local.lkey(),
            remote_addr: w.remote_addr,
            rkey: w.rkey,
            imm: w.imm,
            signaled: w.signaled,
            wr_id: w.wr_id,
        })
    }

    /// Posts one RDMA WRITE from memory registered elsewhere: `user` must cover the bytes
    /// and stay registered until the completion (the caller holds it meanwhile).
    pub fn post_user_write(&self, user: &UserMr, w: &RawWrite) -> io::Result<()> {
        if w.lkey != user.lkey() || !user.covers(w.addr, u64::from(w.len)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "[{:#x}, +{}) is not inside the registration its key names",
                    w.addr, w.len
                ),
            ));
        }
        self.post_raw(w)
    }

    /// Posts one signaled RDMA READ of `r.len` bytes at `r.remote_addr` (under `r.rkey`)
    /// into `r.local` at `r.offset`. The local region must outlive the completion: the
    /// caller drops QPs before their regions.
    pub fn post_read(&self, r: &Read<'_>) -> io::Result<()> {
        r.local.check(r.offset, r.len)?;
        let len = u32::try_from(r.len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a READ is at most 4 GiB"))?;
        self.post_wr(
            &RawWrite {
                addr: r.local.addr() + r.offset as u64,
                len,
                lkey: r.local.lkey(),
                remote_addr: r.remote_addr,
                rkey: r.rkey,
                imm: None,
                signaled: true,
                wr_id: r.wr_id,
            },
            true,
        )
    }

    fn post_raw(&self, w: &RawWrite) -> io::Result<()> {
        self.post_wr(w, false)
    }

    /// Posts `w` as a WRITE (with immediate when `w.imm` is set), or as a READ into the
    /// local bytes when `read`.
    fn post_wr(&self, w: &RawWrite, read: bool) -> io::Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: w.addr,
            length: w.len,
            lkey: w.lkey,
        };
        // SAFETY: zeroed is a valid value for this plain C struct.
        let mut wr: ffi::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        wr.wr_id = w.wr_id;
        wr.opcode = match (read, w.imm) {
            (true, _) => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            (false, Some(_)) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            (false, None) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        if let (false, Some(imm)) = (read, w.imm) {
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        if w.signaled {
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if w.len > 0 {
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
        }
        wr.wr.rdma = ffi::rdma_t {
            remote_addr: w.remote_addr,
            rkey: w.rkey,
        };
        let mut bad: *mut ffi::ibv_send_wr = null_mut();
        // SAFETY: a QP of a real device; `wr` and `sge` are complete live locals (the
        // provider copies them before returning); the callers checked that the SGE lies
        // inside a registration that outlives the completion (a READ's SGE is in an `Mr`,
        // registered for local write, which the NIC fills).
        rc(
            unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) },
            "ibv_post_send",
        )
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the CQ and PD it uses are still alive (held above).
        unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

/// The text libibverbs gives a completion status (`ibv_wc_status_str`), or the number.
pub fn wc_status_str(status: u32) -> String {
    // SAFETY: a pure lookup; NULL when libibverbs is missing.
    let p = unsafe { ffi::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {

    #[test]
    fn fork_safety_is_decided_once_and_kept() {
        let first = fork_safety();
        assert_eq!(fork_safety(), first, "later calls say what the first did");
        match first {
            ForkSafety::Disabled(e) if e == libc::EOPNOTSUPP => {
                println!("SKIP: no libibverbs here; ibv_fork_init answered EOPNOTSUPP");
            }
            // libibverbs asks a device whether the kernel copies pinned pages on fork;
            // without one it marks registered memory DONTFORK instead. Either is safe.
            other => assert!(
                matches!(other, ForkSafety::Unneeded | ForkSafety::Enabled),
                "{other}"
            ),
        }
        assert!(ForkSafety::Disabled(libc::EINVAL)
            .to_string()
            .contains("before 5.13"));
    }
    use super::*;

    #[test]
    fn without_kernel_support_there_is_no_device_list() {
        // This machine has no RDMA kernel support (and maybe no libibverbs): the list is
        // absent or empty, never a crash. Where a real device exists, it must be named.
        match device_list() {
            Err(e) => assert!(e != 0, "a missing list carries its errno"),
            Ok(devs) => assert!(devs.iter().all(|d| !d.name.is_empty())),
        }
        assert!(!wc_status_str(wc::RETRY_EXC_ERR).is_empty());
    }

    #[test]
    fn opening_an_unknown_device_is_an_error() {
        assert!(Context::open("no-such-hca_9").is_err());
    }
}
