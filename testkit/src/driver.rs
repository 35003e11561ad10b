//! A safe Rust client of the exported `ncclNetPlugin_v12` table, driving it the way
//! NCCL's proxy does. The `railover` command (demo, bench) and the Rust tests use it, so
//! they exercise exactly the ABI NCCL sees.
//!
//! Buffers are owned by [`Buffer`]; while a request uses one, its bytes cannot be read
//! and dropping it leaks the memory rather than freeing it under the reactor.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use railover::ffi::exports::{ncclNetPlugin_v12, Table};
use railover::ffi::types::{CommConfig, NetV12, PropertiesV12, NCCL_PTR_HOST, NCCL_SUCCESS};

/// An `ncclResult_t` other than success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code(pub c_int);

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ncclResult_t {}", self.0)
    }
}

impl std::error::Error for Code {}

fn check(r: c_int) -> Result<(), Code> {
    if r == NCCL_SUCCESS {
        Ok(())
    } else {
        Err(Code(r))
    }
}

/// The table every call goes through: the plugin linked into this program, unless
/// [`use_plugin`] loaded another build's `.so` first.
fn table() -> &'static NetV12 {
    LOADED.get().map_or(&ncclNetPlugin_v12.0, |t| &t.0)
}

static LOADED: std::sync::OnceLock<&'static Table<NetV12>> = std::sync::OnceLock::new();

/// The environment variable naming a plugin `.so` the driver calls instead of the linked
/// plugin, in this process and in the peers it starts (they inherit it): how `railover
/// bench --baseline-plugin` runs another build through the same bench.
pub const PLUGIN_ENV: &str = "RAILOVER_DRIVER_PLUGIN";

/// Loads the `.so` named by [`PLUGIN_ENV`], if set, for every later call; call it before
/// any other function here. The library stays loaded for the life of the process.
pub fn use_plugin_from_env() -> Result<Option<std::path::PathBuf>, String> {
    match std::env::var_os(PLUGIN_ENV) {
        Some(p) if !p.is_empty() => {
            let p = std::path::PathBuf::from(p);
            use_plugin(&p).map(|()| Some(p))
        }
        _ => Ok(None),
    }
}

/// Calls the `ncclNetPlugin_v12` table of the plugin at `path` from now on, instead of
/// the linked one. Fails if a table was loaded already, or `path` has none.
pub fn use_plugin(path: &std::path::Path) -> Result<(), String> {
    let what = |e: &dyn std::fmt::Display| format!("plugin {}: {e}", path.display());
    // SAFETY: loading runs the library's initialisers; a railover build (or another NCCL
    // net plugin) has none that need more than the C runtime.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| what(&e))?;
    // SAFETY: `ncclNetPlugin_v12` is, in every NCCL net plugin, a `ncclNet_v12_t`: the
    // layout of `NetV12` (which tests/abi asserts field by field), and `Table` is a
    // transparent wrapper of it.
    let sym =
        unsafe { lib.get::<*const Table<NetV12>>(b"ncclNetPlugin_v12\0") }.map_err(|e| what(&e))?;
    let t: *const Table<NetV12> = *sym;
    // The library is never unloaded, so its table lives as long as the process.
    std::mem::forget(lib);
    // SAFETY: a non-null pointer to a static table of a library that stays loaded.
    let t = unsafe { t.as_ref() }.ok_or_else(|| what(&"ncclNetPlugin_v12 is NULL"))?;
    LOADED
        .set(t)
        .map_err(|_| what(&"another plugin was loaded first"))
}

/// The plugin's name as NCCL reads it.
pub fn name() -> String {
    // SAFETY: the table's name is a static NUL-terminated string.
    unsafe { CStr::from_ptr(table().name) }
        .to_string_lossy()
        .into_owned()
}

/// `len` bytes that differ for every `seed` (xorshift): a payload whose misplacement,
/// truncation or duplication shows in a byte comparison.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One `init` … `finalize` context.
#[derive(Debug)]
pub struct Ctx {
    raw: *mut c_void,
}

// SAFETY: a context pointer is an opaque key into a thread-safe registry.
unsafe impl Send for Ctx {}
// SAFETY: as above; every call through it is thread-safe.
unsafe impl Sync for Ctx {}

/// Properties of one device, copied out of the C struct.
#[derive(Debug, Clone)]
pub struct Props {
    pub name: String,
    pub pci_path: Option<String>,
    pub guid: u64,
    pub speed_mbps: i32,
    pub max_recvs: i32,
    pub max_p2p_bytes: usize,
    /// `ptrSupport`: `NCCL_PTR_*` bits.
    pub ptr_support: i32,
}

impl Ctx {
    pub fn init() -> Result<Ctx, Code> {
        let mut raw = std::ptr::null_mut();
        let mut cfg = CommConfig { traffic_class: -1 };
        // SAFETY: valid out-pointer and config; NULL logger/profiler are allowed.
        check(unsafe { (table().init)(&mut raw, 0, &mut cfg, None, None) })?;
        Ok(Ctx { raw })
    }

    pub fn devices(&self) -> Result<i32, Code> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { (table().devices)(&mut n) })?;
        Ok(n)
    }

    pub fn properties(&self, dev: i32) -> Result<Props, Code> {
        let mut p = std::mem::MaybeUninit::<PropertiesV12>::uninit();
        // SAFETY: the plugin writes the whole struct on success.
        check(unsafe { (table().get_properties)(dev, p.as_mut_ptr()) })?;
        // SAFETY: initialised by the successful call above.
        let p = unsafe { p.assume_init() };
        let s = |c: *const std::ffi::c_char| {
            (!c.is_null()).then(|| {
                // SAFETY: the plugin's strings are static and NUL-terminated.
                unsafe { CStr::from_ptr(c) }.to_string_lossy().into_owned()
            })
        };
        Ok(Props {
            name: s(p.name).unwrap_or_default(),
            pci_path: s(p.pci_path),
            guid: p.guid,
            speed_mbps: p.speed,
            max_recvs: p.max_recvs,
            max_p2p_bytes: p.max_p2p_bytes,
            ptr_support: p.ptr_support,
        })
    }

    /// Listens on `dev`; returns the handle to ship to the connector.
    pub fn listen(&self, dev: i32) -> Result<([u8; 128], Listener), Code> {
        let mut handle = [0u8; 128];
        let mut raw = std::ptr::null_mut();
        // SAFETY: 128-byte handle buffer and a valid out-pointer.
        check(unsafe { (table().listen)(self.raw, dev, handle.as_mut_ptr().cast(), &mut raw) })?;
        Ok((handle, Listener { raw }))
    }

    /// One non-blocking connect attempt: `None` means "call again with the same handle".
    pub fn connect(&self, dev: i32, handle: &mut [u8; 128]) -> Result<Option<SendComm>, Code> {
        let mut raw = std::ptr::null_mut();
        let mut dev_comm = std::ptr::null_mut();
        // SAFETY: 128-byte handle buffer and valid out-pointers.
        check(unsafe {
            (table().connect)(
                self.raw,
                dev,
                handle.as_mut_ptr().cast(),
                &mut raw,
                &mut dev_comm,
            )
        })?;
        Ok((!raw.is_null()).then_some(SendComm(Comm { raw })))
    }

    /// The raw context pointer, for tests of bad input.
    /// The context's address, for bad-input tests.
    pub fn raw(&self) -> usize {
        self.raw as usize
    }

    pub fn finalize(self) -> Result<(), Code> {
        let raw = self.raw;
        std::mem::forget(self);
        // SAFETY: the context came from `init` and is finalised once.
        check(unsafe { (table().finalize)(raw) })
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context came from `init` and is finalised once.
        let _ = unsafe { (table().finalize)(self.raw) };
    }
}

/// A listening endpoint; closed on drop.
#[derive(Debug)]
pub struct Listener {
    raw: *mut c_void,
}

// SAFETY: opaque registry key; calls through it are thread-safe.
unsafe impl Send for Listener {}

impl Listener {
    /// One non-blocking accept attempt.
    pub fn accept(&self) -> Result<Option<RecvComm>, Code> {
        let mut raw = std::ptr::null_mut();
        let mut dev_comm = std::ptr::null_mut();
        // SAFETY: valid out-pointers.
        check(unsafe { (table().accept)(self.raw, &mut raw, &mut dev_comm) })?;
        Ok((!raw.is_null()).then_some(RecvComm(Comm { raw })))
    }
}

/// Why [`connect_pair`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairError {
    Connect(Code),
    Accept(Code),
    /// Neither call failed, but the pair was not complete within this limit.
    TimedOut(Duration),
}

impl std::fmt::Display for PairError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PairError::Connect(c) => write!(f, "connect: {c}"),
            PairError::Accept(c) => write!(f, "accept: {c}"),
            PairError::TimedOut(d) => write!(f, "connect/accept did not finish within {d:?}"),
        }
    }
}

impl std::error::Error for PairError {}

/// Connects to `listener` (whose handle is `handle`) from this same process: connect and
/// accept called in turn, as NCCL's proxy does, until both have given a comm, for at most
/// `limit`. The first error of either call ends it.
pub fn connect_pair(
    ctx: &Ctx,
    dev: i32,
    handle: &mut [u8; 128],
    listener: &Listener,
    limit: Duration,
) -> Result<(SendComm, RecvComm), PairError> {
    let end = Instant::now() + limit;
    let (mut s, mut r) = (None, None);
    loop {
        if s.is_none() {
            s = ctx.connect(dev, handle).map_err(PairError::Connect)?;
        }
        if r.is_none() {
            r = listener.accept().map_err(PairError::Accept)?;
        }
        match (s, r) {
            (Some(s), Some(r)) => return Ok((s, r)),
            pending => (s, r) = pending,
        }
        if Instant::now() > end {
            return Err(PairError::TimedOut(limit));
        }
        // Two cores may be shared with both reactors: let them run.
        std::thread::yield_now();
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: closes the listener this value owns, once.
        let _ = unsafe { (table().close_listen)(self.raw) };
    }
}

#[derive(Debug)]
struct Comm {
    raw: *mut c_void,
}

// SAFETY: opaque registry key; calls through it are thread-safe.
unsafe impl Send for Comm {}

/// Host memory registered with one comm.
#[derive(Debug)]
pub struct Buffer {
    data: Box<[u8]>,
    mr: *mut c_void,
    busy: Arc<AtomicBool>,
}

// SAFETY: the buffer owns its memory; the MR pointer is an opaque registry key.
unsafe impl Send for Buffer {}

impl Buffer {
    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The bytes; `None` while a request is using the buffer.
    pub fn bytes(&self) -> Option<&[u8]> {
        (!self.busy.load(Ordering::Acquire)).then_some(&self.data[..])
    }

    /// The bytes, writable; `None` while a request is using the buffer.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        (!self.busy.load(Ordering::Acquire)).then_some(&mut self.data[..])
    }

    fn claim(&self) -> bool {
        self.busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: deregisters this buffer's own handle once (NCCL allows it after close).
        let _ = unsafe { (table().dereg_mr)(std::ptr::null_mut(), self.mr) };
        if self.busy.load(Ordering::Acquire) {
            // The plugin may still write into it: leak rather than free.
            std::mem::forget(std::mem::take(&mut self.data));
        }
    }
}

impl Comm {
    fn register(&self, len: usize, ptr_type: c_int) -> Result<Buffer, Code> {
        let mut data = vec![0u8; len].into_boxed_slice();
        let mut mr = std::ptr::null_mut();
        // SAFETY: `data` is a live allocation of `len` bytes owned by the returned Buffer.
        check(unsafe {
            (table().reg_mr)(self.raw, data.as_mut_ptr().cast(), len, ptr_type, &mut mr)
        })?;
        Ok(Buffer {
            data,
            mr,
            busy: Arc::new(AtomicBool::new(false)),
        })
    }

    fn close(&mut self, f: unsafe extern "C" fn(*mut c_void) -> c_int) -> Result<(), Code> {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        // SAFETY: closes the comm this value owns, once.
        check(unsafe { f(raw) })
    }
}

/// The sending half; closed on drop.
#[derive(Debug)]
pub struct SendComm(Comm);

/// The receiving half; closed on drop.
#[derive(Debug)]
pub struct RecvComm(Comm);

/// An outstanding request. Test it until it reports done.
#[derive(Debug)]
pub struct Request {
    raw: *mut c_void,
    /// The claims of its buffers: one, or a grouped receive's.
    busy: Vec<Arc<AtomicBool>>,
    finished: bool,
}

// SAFETY: opaque registry key; `test` is thread-safe.
unsafe impl Send for Request {}

impl Request {
    /// `Ok(Some(size))` once done; `Ok(None)` while pending.
    pub fn test(&mut self) -> Result<Option<usize>, Code> {
        Ok(self.test_all()?.map(|sizes| sizes[0]))
    }

    /// As [`Request::test`], with the size of each buffer (a grouped receive's).
    pub fn test_all(&mut self) -> Result<Option<Vec<usize>>, Code> {
        if self.finished {
            return Err(Code(railover::ffi::types::NCCL_INVALID_ARGUMENT));
        }
        let mut done = 0;
        let mut sizes: Vec<c_int> = vec![-1; self.busy.len()];
        // SAFETY: the request came from isend/irecv and is tested until done; `sizes`
        // has one element per buffer.
        let r = unsafe { (table().test)(self.raw, &mut done, sizes.as_mut_ptr()) };
        if r != NCCL_SUCCESS || done != 0 {
            self.finished = true;
            for b in &self.busy {
                b.store(false, Ordering::Release);
            }
        }
        check(r)?;
        Ok((done != 0).then(|| sizes.iter().map(|&s| s as usize).collect()))
    }
}

/// The outcome of an `isend`/`irecv` on `bufs`: a request, none yet ("call again"), or
/// the error; the buffers' claims are released unless a request now holds them.
/// How long [`SendComm::isend_patiently`] keeps asking: far longer than a receive's
/// clear-to-send takes to arrive on a loaded machine.
pub const PATIENCE: Duration = Duration::from_secs(30);

fn posted_all(r: c_int, req: *mut c_void, bufs: &[&Buffer]) -> Result<Option<Request>, Code> {
    if r != NCCL_SUCCESS || req.is_null() {
        for b in bufs {
            b.busy.store(false, Ordering::Release);
        }
    }
    check(r)?;
    Ok((!req.is_null()).then(|| Request {
        raw: req,
        busy: bufs.iter().map(|b| b.busy.clone()).collect(),
        finished: false,
    }))
}

fn posted(r: c_int, req: *mut c_void, buf: &Buffer) -> Result<Option<Request>, Code> {
    posted_all(r, req, &[buf])
}

impl SendComm {
    pub fn register(&self, len: usize) -> Result<Buffer, Code> {
        self.0.register(len, NCCL_PTR_HOST)
    }

    /// A buffer registered as `ptr_type` (`NCCL_PTR_CUDA`: host memory the plugin must
    /// treat as GPU memory, never touching it with the CPU).
    pub fn register_as(&self, len: usize, ptr_type: c_int) -> Result<Buffer, Code> {
        self.0.register(len, ptr_type)
    }

    /// Sends the first `len` bytes of `buf` with tag 0; `Ok(None)` means "not now, call
    /// again": the receive it fills is not posted (or not yet heard of), or no slot is
    /// free. Panics if `buf` is still used by another request or `len` exceeds it.
    pub fn isend(&self, buf: &Buffer, len: usize) -> Result<Option<Request>, Code> {
        self.isend_tagged(buf, len, 0)
    }

    /// As [`SendComm::isend_tagged`], calling again while the plugin answers "not now",
    /// as NCCL does, for up to [`PATIENCE`]; `Ok(None)` if it never took the send.
    pub fn isend_patiently(
        &self,
        buf: &Buffer,
        len: usize,
        tag: i32,
    ) -> Result<Option<Request>, Code> {
        let end = Instant::now() + PATIENCE;
        loop {
            if let Some(r) = self.isend_tagged(buf, len, tag)? {
                return Ok(Some(r));
            }
            if Instant::now() > end {
                return Ok(None);
            }
            std::thread::yield_now();
        }
    }

    /// As [`SendComm::isend`], with `tag` (which picks the buffer of a grouped receive).
    pub fn isend_tagged(
        &self,
        buf: &Buffer,
        len: usize,
        tag: i32,
    ) -> Result<Option<Request>, Code> {
        assert!(len <= buf.len(), "send longer than its buffer");
        assert!(buf.claim(), "buffer already in use by a request");
        let mut req = std::ptr::null_mut();
        // SAFETY: the buffer stays alive (leaked if dropped) and unread until `test`
        // reports done, which releases the claim.
        let r = unsafe {
            (table().isend)(
                self.0.raw,
                buf.data.as_ptr() as *mut c_void,
                len,
                tag,
                buf.mr,
                std::ptr::null_mut(),
                &mut req,
            )
        };
        posted(r, req, buf)
    }

    pub fn close(mut self) -> Result<(), Code> {
        self.0.close(table().close_send)
    }

    /// The comm's address, for bad-input tests.
    pub fn raw(&self) -> usize {
        self.0.raw as usize
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        let _ = self.0.close(table().close_send);
    }
}

impl RecvComm {
    pub fn register(&self, len: usize) -> Result<Buffer, Code> {
        self.0.register(len, NCCL_PTR_HOST)
    }

    /// A buffer registered as `ptr_type` (`NCCL_PTR_CUDA`: host memory the plugin must
    /// treat as GPU memory, never touching it with the CPU).
    pub fn register_as(&self, len: usize, ptr_type: c_int) -> Result<Buffer, Code> {
        self.0.register(len, ptr_type)
    }

    /// Receives up to `capacity` bytes into `buf`; `Ok(None)` means "call again".
    pub fn irecv(&self, buf: &mut Buffer, capacity: usize) -> Result<Option<Request>, Code> {
        assert!(capacity <= buf.len(), "receive larger than its buffer");
        assert!(buf.claim(), "buffer already in use by a request");
        let mut data = buf.data.as_mut_ptr() as *mut c_void;
        let mut size = capacity;
        let mut tag: c_int = 0;
        let mut mr = buf.mr;
        let mut phandle = std::ptr::null_mut();
        // NCCL may pre-store the optional-completion hint; the plugin must overwrite it.
        let mut req = railover::ffi::types::NCCL_NET_OPTIONAL_RECV_COMPLETION as *mut c_void;
        // SAFETY: one-element arrays for n=1; the buffer stays alive and untouched until
        // `test` reports done.
        let r = unsafe {
            (table().irecv)(
                self.0.raw,
                1,
                &mut data,
                &mut size,
                &mut tag,
                &mut mr,
                &mut phandle,
                &mut req,
            )
        };
        posted(r, req, buf)
    }

    /// `iflush` of the first `len` bytes `buf` received, as NCCL's proxy calls it after a
    /// receive into GPU memory completes: a request to test until done, or `None` when
    /// there is nothing to wait for (host memory). The buffer stays claimed until then:
    /// the GPU may not read it before.
    pub fn iflush(&self, buf: &mut Buffer, len: usize) -> Result<Option<Request>, Code> {
        assert!(len <= buf.len(), "flush longer than its buffer");
        assert!(buf.claim(), "buffer already in use by a request");
        let mut data = buf.data.as_mut_ptr() as *mut c_void;
        let mut size = c_int::try_from(len).unwrap_or(c_int::MAX);
        let mut mr = buf.mr;
        let mut req = std::ptr::null_mut();
        // SAFETY: one-element arrays for n=1; the buffer stays alive and untouched until
        // `test` reports the flush done.
        let r = unsafe { (table().iflush)(self.0.raw, 1, &mut data, &mut size, &mut mr, &mut req) };
        posted(r, req, buf)
    }

    /// A grouped receive: one `irecv` of every `(buffer, capacity, tag)`, which the next
    /// sends fill by tag; `Ok(None)` means "call again".
    pub fn irecv_group(
        &self,
        bufs: &mut [(&mut Buffer, usize, i32)],
    ) -> Result<Option<Request>, Code> {
        for (buf, capacity, _) in bufs.iter() {
            assert!(*capacity <= buf.len(), "receive larger than its buffer");
            assert!(buf.claim(), "buffer already in use by a request");
        }
        let mut data: Vec<*mut c_void> = (bufs.iter_mut())
            .map(|(b, _, _)| b.data.as_mut_ptr() as *mut c_void)
            .collect();
        let mut sizes: Vec<usize> = bufs.iter().map(|(_, c, _)| *c).collect();
        let mut tags: Vec<c_int> = bufs.iter().map(|(_, _, t)| *t).collect();
        let mut mrs: Vec<*mut c_void> = bufs.iter().map(|(b, _, _)| b.mr).collect();
        let mut phandles = vec![std::ptr::null_mut(); bufs.len()];
        let mut req = std::ptr::null_mut();
        // SAFETY: arrays of `bufs.len()` elements; the buffers stay alive and untouched
        // until `test` reports done.
        let r = unsafe {
            (table().irecv)(
                self.0.raw,
                bufs.len() as c_int,
                data.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                mrs.as_mut_ptr(),
                phandles.as_mut_ptr(),
                &mut req,
            )
        };
        let held: Vec<&Buffer> = bufs.iter().map(|(b, _, _)| &**b).collect();
        posted_all(r, req, &held)
    }

    pub fn close(mut self) -> Result<(), Code> {
        self.0.close(table().close_recv)
    }

    /// The comm's address, for bad-input tests.
    pub fn raw(&self) -> usize {
        self.0.raw as usize
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        let _ = self.0.close(table().close_recv);
    }
}

/// Calls `test` with an arbitrary address as the request: for bad-input tests.
pub fn test_raw(request: usize) -> c_int {
    let mut done = 0;
    // SAFETY: the plugin only looks the address up in its registry, never dereferences it.
    unsafe { (table().test)(request as *mut c_void, &mut done, std::ptr::null_mut()) }
}

/// Calls `closeSend` with an arbitrary address: for bad-input tests.
pub fn close_send_raw(comm: usize) -> c_int {
    // SAFETY: as for `test_raw`.
    unsafe { (table().close_send)(comm as *mut c_void) }
}

/// Calls `closeRecv` with an arbitrary address: for bad-input tests.
pub fn close_recv_raw(comm: usize) -> c_int {
    // SAFETY: as for `test_raw`.
    unsafe { (table().close_recv)(comm as *mut c_void) }
}

/// Calls `isend` on an arbitrary comm address with no buffer: for bad-input tests.
/// Returns the result and the address the plugin wrote into `*request`.
pub fn isend_raw(comm: usize) -> (c_int, usize) {
    let mut req = 0x1 as *mut c_void;
    // SAFETY: as for `test_raw`; zero bytes from a NULL buffer.
    let r = unsafe {
        (table().isend)(
            comm as *mut c_void,
            std::ptr::null_mut(),
            0,
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut req,
        )
    };
    (r, req as usize)
}
