//! The version-independent plugin: what every `ncclNetPlugin_vN` entry point calls after
//! `ffi` has checked its pointers. Safe Rust throughout; buffers arrive as [`UserBuf`].
//!
//! NCCL's threads only do three things here: validate, queue a command for the reactor,
//! and read request state. They never touch a socket.

pub mod net_handle;
pub mod nics;
pub mod operator;

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::{Config, TransportChoice};
use crate::control::{Control, ControlConfig, NicIdent};
use crate::handoff::comm::{Isend, MAX_RECVS, NCCL_PTR_HOST};
pub use crate::handoff::{
    CommShared, Error, ListenShared, MemoryRegion, PendingConnect, PendingListen, Request, Rescue,
    Side, Status,
};
use crate::handoff::{Command, Done};
use crate::reactor::{LocalNic, ReactorHandle, ReactorStats, Setup};
use crate::telemetry::exporter::ExporterConfig;
use crate::telemetry::metrics::Telemetry;
use crate::topology::{Fabric, Topology};
pub use crate::transport::memory::UserBuf;
use crate::transport::memory::{Memory, Region};
use crate::transport::tcp::{self, TcpFabric, TcpNic};
use crate::transport::verbs::{self, VerbsFabric, VerbsNic};
pub use net_handle::NetHandle;
use operator::Operator;

/// The plugin's name in NCCL (`NCCL_NET=railover`).
pub const NAME: &CStr = c"railover";

/// One NIC as `getProperties` reports it.
#[derive(Debug, Clone)]
pub struct NicInfo {
    pub tcp: TcpNic,
    /// Interned: NCCL keeps these pointers for the library's lifetime.
    pub name: &'static CStr,
    pub pci_path: Option<&'static CStr>,
    pub guid: u64,
    /// The NIC's rail, when known (reported as `railId` to NCCL v12).
    pub rail: Option<u32>,
    /// The memory NCCL may register with it (`NCCL_PTR_HOST`, `_CUDA`, `_DMABUF`).
    pub ptr_support: i32,
    /// Where `regMr` registers memory with its device now (verbs only).
    pub registrar: Option<verbs::Registrar>,
}

/// Everything alive between the first `init` and the last `finalize`.
#[derive(Debug)]
pub struct Runtime {
    pub config: Config,
    pub nics: Vec<NicInfo>,
    pub reactor: ReactorHandle,
    pub telemetry: Arc<Telemetry>,
    /// The control socket and drain-file watch (`railover drain`, `railover status`).
    pub control: Mutex<Control>,
}

impl Runtime {
    fn start() -> Result<Runtime, Error> {
        // Before the configuration, so that a bad value reaches NCCL's log as a WARN.
        crate::telemetry::log::install();
        let config = Config::from_env()?;
        crate::telemetry::log::set_stderr_level(config.log);
        let metrics_cfg = ExporterConfig::from_env()?;
        let control_cfg = ControlConfig::from_env()?;
        let verbs_nics = choose_fabric(&config)?;
        let tcp_nics = match &verbs_nics {
            // The NICs as the rest of the runtime sees them: name, address, PCI, speed.
            Some(v) => v
                .iter()
                .map(|n| TcpNic {
                    name: n.device.clone(),
                    ip: n
                        .ip()
                        .expect("the verbs fabric only takes NICs with an address"),
                    pci_path: n.pci_path.clone(),
                    speed_mbps: i32::try_from(n.speed_mbps).unwrap_or(i32::MAX),
                    loopback: false,
                })
                .collect(),
            None if config.loopback_nics > 0 => tcp::nic::loopback_nics(config.loopback_nics),
            None => discover_nics(&config)?,
        };
        let kind = if verbs_nics.is_some() {
            Fabric::Rdma
        } else {
            Fabric::Tcp
        };
        let mut verbs_fabric = verbs_nics
            .map(|v| VerbsFabric::with_settings(v, config.verbs))
            .transpose()?;
        let gpu = match verbs_fabric.as_mut() {
            Some(f) => f.gpu_memory(&config.sysfs_root, &config.gdr_hca),
            None => Vec::new(),
        };
        let mut registrars = match verbs_fabric.as_mut() {
            Some(f) => f.registrars(),
            None => Vec::new(),
        };
        let topo = match Topology::discover_fabric(&config.sysfs_root, kind) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::info!("railover: no PCI topology ({e}); distance limits are not applied");
                None
            }
        };
        let rails = nics::rails(&tcp_nics, &config, topo.as_ref())?;
        let distance = nics::distances(&tcp_nics, topo.as_ref());
        let nics: Vec<NicInfo> = tcp_nics
            .into_iter()
            .zip(rails)
            .enumerate()
            .map(|(i, (tcp, rail))| NicInfo {
                name: intern(&tcp.name),
                pci_path: tcp.pci_path.as_deref().map(intern),
                // Unique per device within the process; NCCL treats equal guids as one port.
                guid: 0x7261_696c_0000_0000 | i as u64,
                rail,
                ptr_support: gpu.get(i).map_or(NCCL_PTR_HOST, ptr_support),
                registrar: registrars.get_mut(i).and_then(Option::take),
                tcp,
            })
            .collect();
        for (n, g) in nics.iter().zip(&gpu) {
            tracing::info!("railover: {}: {} ({})", n.tcp.name, g.summary(), g.why);
        }
        let setup = Setup {
            nics: nics
                .iter()
                .map(|n| LocalNic {
                    name: n.tcp.name.clone(),
                    ip: n.tcp.ip,
                    rail: n.rail,
                    speed_mbps: u64::try_from(n.tcp.speed_mbps).ok().filter(|&s| s > 0),
                })
                .collect(),
            distance,
            spin: config.spin,
            completion_timeout: config.completion_timeout,
            probe_timeout: config.probe_timeout,
            probe_bytes: config.probe_bytes,
            fair_share: config.fair_share,
            stripes: config.stripes,
            router: config.router,
            telemetry: Arc::new(Telemetry::start_with_nics(
                &metrics_cfg,
                None,
                &nics
                    .iter()
                    .map(|n| (n.tcp.name.as_str(), n.rail))
                    .collect::<Vec<_>>(),
            )),
            unmatched_warn: config.unmatched_warn,
            entropy_seed: None,
        };
        let telemetry = setup.telemetry.clone();
        let spawned = match verbs_fabric {
            Some(f) => ReactorHandle::spawn(setup, f, config.progress),
            None => ReactorHandle::spawn(
                setup,
                TcpFabric::new(&nics.iter().map(|n| n.tcp.clone()).collect::<Vec<_>>()),
                config.progress,
            ),
        };
        let reactor = match spawned {
            Ok(r) => r,
            Err(e) => {
                telemetry.shutdown();
                return Err(e.into());
            }
        };
        tracing::info!(
            "railover: {} NIC(s): {} ({config})",
            nics.len(),
            nics.iter()
                .map(|n| format!(
                    "{}={} rail {}",
                    n.tcp.name,
                    n.tcp.ip,
                    n.rail.map_or("-".into(), |r| r.to_string())
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let idents = nics
            .iter()
            .map(|n| NicIdent {
                name: n.tcp.name.clone(),
                pci: n.tcp.pci_path.clone(),
                rail: n.rail,
            })
            .collect();
        let local_rank = metrics_cfg.local_rank;
        let operator = Arc::new(Operator::new(reactor.queue.clone(), local_rank));
        let control = Mutex::new(Control::start(&control_cfg, idents, operator));
        Ok(Runtime {
            config,
            nics,
            reactor,
            telemetry,
            control,
        })
    }

    fn nic(&self, dev: i32) -> Result<&NicInfo, Error> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.nics.get(d))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device {dev} does not exist ({} NICs)",
                    self.nics.len()
                ))
            })
    }

    /// Counters of the reactor (rejected connections, protocol errors, bytes).
    pub fn stats(&self) -> &ReactorStats {
        &self.reactor.stats
    }
}

/// `ptrSupport` for a verbs NIC that can do `g` with GPU memory.
fn ptr_support(g: &verbs::GpuMemory) -> i32 {
    use crate::handoff::comm::{NCCL_PTR_CUDA, NCCL_PTR_DMABUF};
    let mut p = NCCL_PTR_HOST;
    if g.cuda {
        p |= NCCL_PTR_CUDA;
    }
    if g.dmabuf {
        p |= NCCL_PTR_DMABUF;
    }
    p
}

/// Applies `RAILOVER_TRANSPORT`: the verbs NICs to run on, or `None` for TCP, and says
/// at INFO which and why. No libibverbs or no kernel RDMA support is zero devices,
/// silently.
fn choose_fabric(config: &Config) -> Result<Option<Vec<VerbsNic>>, Error> {
    // `tcp` never opens libibverbs.
    let found = match config.transport {
        TransportChoice::Tcp => verbs::Discovery::default(),
        _ => verbs::discover(&config.hca, &config.verbs.gid, &config.sysfs_root),
    };
    let (nics, line) = decide_fabric(config.transport, found)?;
    match nics {
        Some(_) => tracing::info!("railover: {line}; {}", config.verbs),
        None => tracing::info!("railover: {line}"),
    }
    // Once, beside the line whose NICs and settings they shaped; `tcp` uses none of them.
    if config.transport != TransportChoice::Tcp {
        if let Some(noted) = config.nccl_ib.summary() {
            tracing::info!("railover: {noted}");
        }
    }
    Ok(nics)
}

/// What `choice` makes of what discovery `found`: the verbs NICs to run on (`None`:
/// TCP) and the line that says so. `auto` takes verbs whenever a usable NIC exists.
fn decide_fabric(
    choice: TransportChoice,
    mut found: verbs::Discovery,
) -> Result<(Option<Vec<VerbsNic>>, String), Error> {
    let var = match choice {
        TransportChoice::Auto => "RAILOVER_TRANSPORT=auto",
        TransportChoice::Verbs => "RAILOVER_TRANSPORT=verbs",
        TransportChoice::Tcp => return Ok((None, "fabric TCP (RAILOVER_TRANSPORT=tcp)".into())),
    };
    // Lanes bootstrap over TCP between the NICs' addresses.
    let (usable, no_ip): (Vec<VerbsNic>, Vec<VerbsNic>) =
        found.nics.drain(..).partition(|n| n.ip().is_some());
    found.skipped.extend(no_ip.iter().map(|n| {
        format!(
            "{}: no IP address to bootstrap lanes from (InfiniBand without IPoIB is not supported yet)",
            n.label()
        )
    }));
    if usable.is_empty() {
        let why = found
            .absent
            .clone()
            .unwrap_or_else(|| match found.skipped.is_empty() {
                true => "libibverbs lists no device".into(),
                false => found.skipped.join("; "),
            });
        return match choice {
            TransportChoice::Verbs => Err(Error::InvalidUsage(format!(
                "{var}, but there is no usable verbs NIC: {why}"
            ))),
            _ => Ok((
                None,
                format!("fabric TCP ({var}: no usable verbs NIC: {why})"),
            )),
        };
    }
    let names: Vec<String> = usable.iter().map(|n| n.label()).collect();
    Ok((
        Some(usable),
        format!("fabric verbs ({var}): {}", names.join(", ")),
    ))
}

/// The interfaces `RAILOVER_IFNAME` selects; a WARN naming the filter and every interface
/// there is when it selects none (NCCL then sees 0 devices).
fn discover_nics(config: &Config) -> Result<Vec<TcpNic>, Error> {
    let all = tcp::nic::interfaces()?;
    let chosen = tcp::nic::select(&all, &config.ifname);
    if chosen.is_empty() {
        let filter = if config.ifname.given {
            format!(
                "RAILOVER_IFNAME={}{}{}",
                if config.ifname.exclude { "^" } else { "" },
                if config.ifname.exact { "=" } else { "" },
                config.ifname.names.join(",")
            )
        } else {
            "the default selection (every up interface with an address)".to_string()
        };
        let there: Vec<String> = all
            .iter()
            .map(|i| {
                format!(
                    "{} ({}{}{})",
                    i.name,
                    i.ip,
                    if i.up { "" } else { ", down" },
                    if i.loopback {
                        ", loopback: only when named"
                    } else {
                        ""
                    }
                )
            })
            .collect();
        tracing::warn!(
            "railover: {filter} matches no usable interface, so railover offers 0 devices; interfaces with an address: {}",
            if there.is_empty() { "none".to_string() } else { there.join(", ") }
        );
    }
    Ok(chosen
        .iter()
        .map(|i| tcp::nic::describe(i, &config.sysfs_root))
        .collect())
}

fn intern(s: &str) -> &'static CStr {
    static NAMES: Mutex<Vec<&'static CStr>> = Mutex::new(Vec::new());
    let mut names = NAMES.lock();
    if let Some(n) = names.iter().find(|n| n.to_bytes() == s.as_bytes()) {
        return n;
    }
    let c = CString::new(s.replace('\0', "")).expect("NUL bytes removed");
    let leaked: &'static CStr = Box::leak(c.into_boxed_c_str());
    names.push(leaked);
    leaked
}

/// Per-communicator state (v11+), or the process-wide one of older versions.
#[derive(Debug)]
pub struct Context {
    pub runtime: Arc<Runtime>,
    pub traffic_class: i32,
    pub hints: Mutex<Option<NetHints>>,
    legacy: bool,
}

impl Context {
    /// `Err` (`ncclInternalError`) once the reactor thread has panicked: `listen` and
    /// `connect` on the context fail from then on, until it is finalised.
    pub fn check(&self) -> Result<(), Error> {
        self.runtime.reactor.queue.check()
    }
}

/// `setNetAttr`'s advisory traffic shape, kept for later use by lane planning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetHints {
    pub send_max_flows_per_peer: i32,
    pub recv_max_flows_per_peer: i32,
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

struct Global {
    runtime: Option<Arc<Runtime>>,
    contexts: usize,
    legacy: Option<Arc<Context>>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    runtime: None,
    contexts: 0,
    legacy: None,
});

/// The process that started the runtime (`std::process::id()`), 0 while none runs. An
/// atomic, not a field behind [`GLOBAL`]: a forked child must be able to tell without
/// taking a lock, since one that another thread of the parent held at the fork stays held
/// in the child for good.
static RUNTIME_PID: AtomicU32 = AtomicU32::new(0);

/// Set in a child forked while a runtime ran (by the `pthread_atfork` child handler the
/// C boundary registers): only then does [`check_process`] ask for the process id.
static FORKED: AtomicBool = AtomicBool::new(false);

/// The child side of a `fork`: a child of a process whose runtime runs is marked. Only
/// atomics, as a handler running right after `fork` must.
pub fn forked() {
    if RUNTIME_PID.load(Ordering::Acquire) != 0 {
        FORKED.store(true, Ordering::Release);
    }
}

/// The last process that reported [`check_process`]'s error, for one WARN per process.
static FORK_REPORTED: AtomicU32 = AtomicU32::new(0);

/// `Err` (`ncclSystemError`) in a child forked from a process whose runtime is running.
/// The child has a copy of the runtime's memory but not its threads: no reactor would ever
/// answer, so every call fails at once instead, `init` included (a new runtime could not
/// be started safely on top of the copied one: its locks, sockets and handles are the
/// parent's). A child forked before the first `init` or after the last `finalize` starts
/// its own runtime as any process does. The parent is not affected.
pub fn check_process() -> Result<(), Error> {
    // The common case costs one load: no fork happened under a running runtime.
    if !FORKED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let owner = RUNTIME_PID.load(Ordering::Acquire);
    let me = std::process::id();
    if owner == 0 || owner == me {
        return Ok(());
    }
    Err(Error::System(format!(
        "railover was initialised in process {owner}; this is a child {me} forked from it, \
         where railover's threads do not exist, so every call fails: use the network from \
         a new process (exec, e.g. the spawn start method of Python's multiprocessing), or \
         fork before NCCL initialises railover"
    )))
}

/// Whether this is the first time this process reports [`check_process`]'s error: NCCL
/// hears it once at WARN, and every later call fails with the same code quietly.
pub fn first_fork_report() -> bool {
    let me = std::process::id();
    FORK_REPORTED.swap(me, Ordering::AcqRel) != me
}

/// `init` of v11+: a new context for one communicator. The first one starts the runtime.
pub fn init_context(traffic_class: i32) -> Result<Arc<Context>, Error> {
    let mut g = GLOBAL.lock();
    let runtime = match &g.runtime {
        Some(rt) => rt.clone(),
        None => {
            let rt = Arc::new(Runtime::start()?);
            g.runtime = Some(rt.clone());
            RUNTIME_PID.store(std::process::id(), Ordering::Release);
            rt
        }
    };
    g.contexts += 1;
    Ok(Arc::new(Context {
        runtime,
        traffic_class,
        hints: Mutex::new(None),
        legacy: false,
    }))
}

/// `init` of v8–v10: one context for the whole process, never finalised (those versions
/// have no `finalize`). Repeated calls return the same context.
pub fn init_legacy() -> Result<Arc<Context>, Error> {
    if let Some(ctx) = GLOBAL.lock().legacy.clone() {
        return Ok(ctx);
    }
    let ctx = init_context(-1)?;
    let ctx = Arc::new(Context {
        runtime: ctx.runtime.clone(),
        traffic_class: -1,
        hints: Mutex::new(None),
        legacy: true,
    });
    GLOBAL.lock().legacy = Some(ctx.clone());
    Ok(ctx)
}

/// The legacy context, for v8–v10 calls that carry no context.
pub fn legacy_context() -> Result<Arc<Context>, Error> {
    GLOBAL
        .lock()
        .legacy
        .clone()
        .ok_or_else(|| Error::InvalidUsage("init was not called".into()))
}

/// `finalize`: the last context stops the reactor and joins its thread, because NCCL may
/// unload the library right after. `Ok(true)` when this was the last one: every comm,
/// listener, registration and request of the runtime is dead then.
pub fn finalize(ctx: &Context) -> Result<bool, Error> {
    if ctx.legacy {
        return Err(Error::InvalidArgument(
            "the process-wide context of v8–v10 is not finalised".into(),
        ));
    }
    let stop = {
        let mut g = GLOBAL.lock();
        g.contexts = g.contexts.saturating_sub(1);
        if g.contexts == 0 {
            RUNTIME_PID.store(0, Ordering::Release);
            g.runtime.take()
        } else {
            None
        }
    };
    if let Some(rt) = stop {
        // Attempts NCCL started and never collected would otherwise outlive the plugin.
        *PENDING.lock() = None;
        // First: an operator's request must find the reactor still there to answer it.
        rt.control.lock().shutdown();
        rt.reactor.shutdown();
        rt.telemetry.shutdown();
        tracing::info!("railover: finalised, reactor stopped");
        return Ok(true);
    }
    Ok(false)
}

/// The runtime in use (for `devices`/`getProperties`, which carry no context).
pub fn runtime() -> Result<Arc<Runtime>, Error> {
    GLOBAL
        .lock()
        .runtime
        .clone()
        .ok_or_else(|| Error::InvalidUsage("init was not called".into()))
}

pub fn devices() -> Result<usize, Error> {
    Ok(runtime()?.nics.len())
}

pub fn nic_info(dev: i32) -> Result<NicInfo, Error> {
    runtime()?.nic(dev).cloned()
}

/// How long `listen` waits for the reactor to open the listener: a bind takes
/// microseconds; this only bounds a reactor that stopped answering.
const LISTEN_REPLY: Duration = Duration::from_secs(30);

/// Opens a listener on device `dev` and describes it in `handle`. The reactor opens it;
/// this waits for its address, since NCCL sends the handle on as soon as we return.
pub fn listen(ctx: &Context, dev: i32, handle: &mut [u8; 128]) -> Result<Arc<ListenShared>, Error> {
    let rt = &ctx.runtime;
    rt.nic(dev)?;
    let mut token = [0u8; 16];
    getrandom::getrandom(&mut token)
        .map_err(|e| Error::System(format!("no randomness for the comm token: {e}")))?;
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let shared = Arc::new(ListenShared {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        token,
        nic: dev as usize,
        ready: Mutex::new(Default::default()),
        queue: rt.reactor.queue.clone(),
    });
    let reply = Arc::new(PendingListen::default());
    rt.reactor.queue.push(Command::Listen {
        nic: dev as usize,
        shared: shared.clone(),
        reply: reply.clone(),
    });
    let addr = (rt
        .reactor
        .queue
        .drive_until(LISTEN_REPLY, |t| reply.wait(t)))
    .unwrap_or_else(|| {
        Err(Error::Internal(
            "the reactor did not open the listener in time".into(),
        ))
    });
    let addr = match addr {
        Ok(a) => a,
        Err(e) => {
            // Opened too late for us: the reactor closes it when it sees this.
            close_listen(&shared);
            return Err(e);
        }
    };
    *handle = NetHandle {
        addr,
        token,
        connect_id: 0,
        listen_id: shared.id,
        nics: rt.reactor.wire_nics.clone(),
    }
    .encode();
    Ok(shared)
}

/// Pending connects, keyed by the id `connect` writes into NCCL's copy of the handle. A
/// map: at communicator init an all-to-all job has thousands pending, each polled by
/// NCCL until it completes, so a lookup must not cost a scan of them all.
static PENDING: Mutex<Option<HashMap<u64, Arc<PendingConnect>>>> = Mutex::new(None);

/// Connection attempts started and not yet collected by a final `connect` call.
pub fn pending_connects() -> usize {
    PENDING.lock().as_ref().map_or(0, HashMap::len)
}

/// Non-blocking connect: `Ok(None)` means "call again". NCCL passes the same handle
/// buffer to every retry, so the first call records its progress id there.
pub fn connect(
    ctx: &Context,
    dev: i32,
    handle: &mut [u8; 128],
) -> Result<Option<Arc<CommShared>>, Error> {
    let mut h = NetHandle::decode(handle)?;
    if h.connect_id != 0 {
        // NCCL polls here until the connect completes: run the handshake meanwhile.
        ctx.runtime.reactor.queue.drive();
        let mut pending = PENDING.lock();
        let map = pending.get_or_insert_with(HashMap::new);
        let Some(p) = map.get(&h.connect_id) else {
            return Err(Error::InvalidArgument(
                "handle refers to an unknown connection attempt".into(),
            ));
        };
        let outcome = p.result.lock().take();
        return match outcome {
            None => Ok(None),
            Some(r) => {
                map.remove(&h.connect_id);
                r.map(Some)
            }
        };
    }
    let rt = &ctx.runtime;
    rt.nic(dev)?;
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    h.connect_id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    *handle = h.encode();
    let pending = Arc::new(PendingConnect::default());
    PENDING
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(h.connect_id, pending.clone());
    rt.reactor.queue.push(Command::Connect {
        nic: dev as usize,
        to: h.addr,
        token: h.token,
        rescue: Rescue {
            listen_id: h.listen_id,
            nics: h.nics,
        },
        pending,
    });
    rt.reactor.queue.drive();
    Ok(None)
}

/// Non-blocking accept: `Ok(None)` means "call again".
pub fn accept(listen: &ListenShared) -> Result<Option<Arc<CommShared>>, Error> {
    listen.queue.check()?;
    listen.queue.drive();
    Ok(listen.ready.lock().pop_front())
}

pub fn close_listen(listen: &Arc<ListenShared>) {
    listen.queue.push(Command::CloseListen {
        shared: listen.clone(),
    });
}

/// Registers `[addr, addr + len)` for use with `comm`: host memory, or GPU memory
/// (`NCCL_PTR_CUDA`) where the comm's NIC reported it can take it. A verbs NIC registers
/// it with the comm's own device now; any other device registers it the first time one
/// of its lanes moves a buffer of it, so a backup NIC only when a comm moves there.
pub fn reg_mr(
    comm: &Arc<CommShared>,
    addr: usize,
    len: usize,
    ptr_type: i32,
) -> Result<Arc<MemoryRegion>, Error> {
    use crate::handoff::comm::NCCL_PTR_CUDA;
    let memory = match ptr_type {
        NCCL_PTR_HOST => Memory::Host,
        NCCL_PTR_CUDA => {
            gpu_allowed(comm, NCCL_PTR_CUDA, "GPU memory (NCCL_PTR_CUDA)")?;
            Memory::Gpu
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown memory type {other}"
            )))
        }
    };
    register(comm, addr, len, ptr_type, memory)
}

/// Registers `[addr, addr + len)`, GPU memory exported as the dma-buf `fd` from `offset`:
/// `fd` is our duplicate of NCCL's (which closes its own on return), kept with the range
/// so that a backup NIC can register it when a comm moves there.
pub fn reg_mr_dmabuf(
    comm: &Arc<CommShared>,
    addr: usize,
    len: usize,
    ptr_type: i32,
    offset: u64,
    fd: std::os::fd::OwnedFd,
) -> Result<Arc<MemoryRegion>, Error> {
    use crate::handoff::comm::{NCCL_PTR_CUDA, NCCL_PTR_DMABUF};
    if ptr_type != NCCL_PTR_CUDA && ptr_type != NCCL_PTR_DMABUF {
        return Err(Error::InvalidArgument(format!(
            "regMrDmaBuf of memory type {ptr_type}: railover takes NCCL_PTR_CUDA or NCCL_PTR_DMABUF"
        )));
    }
    gpu_allowed(comm, NCCL_PTR_DMABUF, "DMA-BUF memory (NCCL_PTR_DMABUF)")?;
    register(comm, addr, len, ptr_type, Memory::DmaBuf { fd, offset })
}

/// `Ok` when `comm`'s NIC reported `ptr` in `ptrSupport`.
fn gpu_allowed(comm: &Arc<CommShared>, ptr: i32, what: &str) -> Result<(), Error> {
    let rt = runtime()?;
    let nic = rt.nic(comm.nic() as i32)?;
    if nic.ptr_support & ptr != 0 {
        return Ok(());
    }
    Err(Error::InvalidUsage(format!(
        "{what} cannot be registered on {}: it reports ptrSupport {:#x} (GPU memory needs the verbs fabric with nvidia-peermem or dma-buf registration, or RAILOVER_GDR=force)",
        nic.tcp.name, nic.ptr_support
    )))
}

fn register(
    comm: &Arc<CommShared>,
    addr: usize,
    len: usize,
    ptr_type: i32,
    memory: Memory,
) -> Result<Arc<MemoryRegion>, Error> {
    // Registration is local: a comm whose peer already failed may still register; one
    // whose reactor is gone may not.
    comm.queue.check()?;
    if comm.is_closed() {
        return Err(Error::InvalidArgument("comm is closed".into()));
    }
    let r = Arc::new(MemoryRegion::new(comm.clone(), addr, len, ptr_type, memory));
    // On the comm's own NIC now, as NCCL's IB transport registers: the registration
    // stays off the reactor, and a failure reaches NCCL here instead of failing the comm
    // at its first message. Backups register when a failover moves the comm there.
    let rt = runtime()?;
    if let Some(reg) = rt.nics.get(comm.nic()).and_then(|n| n.registrar.as_ref()) {
        reg.register(&r.region)
            .map_err(|e| Error::System(format!("regMr of {addr:#x}+{len}: {e}")))?;
    }
    comm.remember_region(&r);
    Ok(r)
}

/// Posts a send with `tag`, as NCCL's IB transport does (`ncclIbIsend`): the send takes
/// the first free buffer with its tag in the peer's oldest posted receive that is not
/// fully matched, and is cut to that buffer's size. `Ok(None)` ("call again") when there
/// is none yet, or all request slots are busy; the comm goes on either way.
pub fn isend(
    comm: &Arc<CommShared>,
    mut buf: UserBuf,
    tag: i32,
    mr: &MemoryRegion,
) -> Result<Option<Arc<Request>>, Error> {
    if comm.side != Side::Send {
        return Err(Error::InvalidArgument("isend on a receive comm".into()));
    }
    mr.check(comm, buf.addr(), buf.len())?;
    buf.attach(mr.region.clone());
    let posted = comm.isend(buf, tag, Instant::now())?;
    // Send it with this thread's next turn (the test that follows in NCCL's sweep); or,
    // with nothing matched yet, read the CTS that NCCL's next call will match against:
    // NCCL comes back with `isend` alone then, so it counts as a look at the comm.
    Ok(match posted {
        Isend::NotNow => {
            comm.drive_tested();
            None
        }
        Isend::Failed(req) | Isend::Posted(req, _) => {
            comm.drive_posted();
            Some(req)
        }
    })
}

/// Queues a receive of 1 to [`MAX_RECVS`] buffers, each with its tag and registration: a
/// grouped receive when several, which the next sends fill by tag. `Ok(None)` when all
/// slots are busy.
pub fn irecv(
    comm: &Arc<CommShared>,
    subs: Vec<(UserBuf, i32, &MemoryRegion)>,
) -> Result<Option<Arc<Request>>, Error> {
    if comm.side != Side::Recv {
        return Err(Error::InvalidArgument("irecv on a send comm".into()));
    }
    if !(1..=MAX_RECVS).contains(&subs.len()) {
        return Err(Error::InvalidArgument(format!(
            "irecv of {} buffers: railover takes 1 to maxRecvs={MAX_RECVS}",
            subs.len()
        )));
    }
    for (buf, _, mr) in &subs {
        mr.check(comm, buf.addr(), buf.len())?;
    }
    if !comm.take_slot()? {
        comm.drive_tested();
        return Ok(None);
    }
    let req = comm.new_request(subs.len());
    if req.is_finished() {
        return Ok(Some(req));
    }
    comm.queue.push(Command::Recv {
        comm: comm.clone(),
        req: req.clone(),
        bufs: (subs.into_iter())
            .map(|(mut b, tag, mr)| {
                b.attach(mr.region.clone());
                (b, tag)
            })
            .collect(),
    });
    // The CTS leaves with this thread's next turn (the test that follows in the sweep).
    comm.drive_posted();
    Ok(Some(req))
}

/// `test`: the request's outcome without blocking. A finished request frees its slot;
/// the caller forgets the request. A request still pending when the reactor panicked
/// never finishes: it fails here.
pub fn test(req: &Request) -> Result<Status, Error> {
    req.progress();
    let mut st = req.status();
    if matches!(st, Ok(Status::Pending)) {
        // NCCL spins here: this is where the reactor turns, on NCCL's thread.
        req.comm.drive_tested();
        st = req.status();
    }
    if matches!(st, Ok(Status::Pending)) {
        // The queue is poisoned only after the reactor's state is dropped: no buffer of
        // this request is referenced any more, so NCCL may reuse it.
        if let Some(e) = req.comm.queue.panicked() {
            req.fail(e.clone());
            st = Err(e);
        }
    }
    if !matches!(st, Ok(Status::Pending)) && req.slot {
        req.comm.release_slot();
    }
    st
}

/// Whether `test`'s failure `e` of `req` is the first NCCL hears of it: a request failed by
/// its comm's failure (or its reactor's) is reported once per comm, the rest quietly.
pub fn first_report(req: &Request, e: &Error) -> bool {
    req.comm.failure().as_ref() != Some(e) || req.comm.first_report()
}

/// `iflush` of a receive at `addr` in `region`: a request that is done once every live
/// NIC of the comm that registered the range has read back through it (GPU memory), or
/// `None` when there is nothing to wait for (host memory, or no NIC registered it). A NIC
/// that went down counts as flushed (its lanes are fenced, see
/// [`FlushPath::down`](verbs::flush::FlushPath::down)), and a full flush QP only delays
/// the request: a failover never turns a flush into a failed comm.
pub fn iflush(
    comm: &Arc<CommShared>,
    addr: usize,
    region: &Arc<Region>,
) -> Result<Option<Arc<Request>>, Error> {
    if comm.side != Side::Recv {
        return Err(Error::InvalidArgument("iflush on a send comm".into()));
    }
    comm.queue.check()?;
    let mut flushes = verbs::flush::flush_region(region, addr as u64);
    if flushes.is_empty() {
        return Ok(None);
    }
    let mut poll = move || {
        let now = Instant::now();
        let mut err = None;
        flushes.retain_mut(|f| match f.done(now) {
            Ok(done) => !done,
            Err(e) => {
                err.get_or_insert(e);
                true
            }
        });
        match err {
            Some(e) => Err(Error::System(format!(
                "flush of GPU memory at {addr:#x}: {e}"
            ))),
            None => Ok(flushes.is_empty()),
        }
    };
    // Post the READs now; `test` sees them complete.
    poll()?;
    Ok(Some(Arc::new(Request::polled(
        comm.clone(),
        crate::handoff::request::Poller(Box::new(poll)),
    ))))
}

/// `closeSend`/`closeRecv`: never blocks; the reactor flushes what it can and lets go.
pub fn close_comm(comm: &Arc<CommShared>) -> Result<(), Error> {
    if !comm.mark_closed() {
        return Err(Error::InvalidArgument("comm closed twice".into()));
    }
    if comm.queue.is_stopped() {
        return Ok(());
    }
    // Wait for our own reactor (never for the peer): once this returns, nothing in the
    // plugin touches the comm's buffers, and NCCL may free them.
    let done = Arc::new(Done::default());
    comm.queue.push(Command::CloseComm {
        comm: comm.clone(),
        done: done.signaller(),
    });
    let limit = std::time::Duration::from_secs(10);
    if (comm
        .queue
        .drive_until(limit, |t| done.wait(t).then_some(())))
    .is_none()
    {
        return Err(Error::Internal(
            "the reactor did not confirm the close within 10 s".into(),
        ));
    }
    Ok(())
}

/// In-process fault injection: local NIC `dev` behaves as if its cable were pulled
/// (`up = false`) or plugged back. Its lanes go silent without closing, so the peer must
/// notice by itself, as with a real cut; this process sees a carrier event. For the
/// demo's loopback variant and tests, where no interface can be taken down.
pub fn inject_link(dev: usize, up: bool) -> Result<(), Error> {
    let rt = runtime()?;
    if dev >= rt.nics.len() {
        return Err(Error::InvalidArgument(format!(
            "device {dev} does not exist ({} NICs)",
            rt.nics.len()
        )));
    }
    rt.reactor.queue.push(Command::InjectLink { nic: dev, up });
    Ok(())
}

/// Test only: makes the reactor thread panic with `message`, to check that a reactor
/// panic fails every caller instead of hanging. A Rust function, not in any exported
/// table, so NCCL cannot reach it; an environment switch would be reachable from any job.
#[doc(hidden)]
pub fn inject_reactor_panic(message: &str) -> Result<(), Error> {
    runtime()?
        .reactor
        .queue
        .push(Command::Panic(message.into()));
    Ok(())
}

#[cfg(test)]
mod fabric_tests {
    use super::*;

    #[test]
    fn transport_choice_picks_the_fabric() {
        let with = |t| Config {
            transport: t,
            ..Config::default()
        };
        assert!(matches!(
            choose_fabric(&with(TransportChoice::Tcp)),
            Ok(None)
        ));
        match choose_fabric(&with(TransportChoice::Verbs)) {
            // This machine has no RDMA: refused, naming the variable and the reason.
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("RAILOVER_TRANSPORT=verbs") && m.contains("no usable verbs NIC"),
                    "{m}"
                );
            }
            Ok(Some(nics)) => assert!(nics.iter().all(|n| n.ip().is_some())),
            Ok(None) => panic!("verbs chosen but no verbs NICs returned"),
        }
    }

    /// A RoCE port at `ip`, or, without one, a port with no address to bootstrap from.
    fn roce(device: &str, ip: Option<[u8; 4]>) -> VerbsNic {
        let mut n = crate::transport::verbs::tests::roce_nic(device, "eth0", ip.unwrap_or([0; 4]));
        if ip.is_none() {
            n.gid_index = None;
        }
        n
    }

    #[test]
    fn auto_takes_verbs_when_a_usable_nic_exists_and_tcp_otherwise() {
        let found = |nics| verbs::Discovery {
            nics,
            ..Default::default()
        };
        let two = vec![roce("mlx5_0", Some([192, 0, 2, 1])), roce("mlx5_1", None)];
        let (nics, line) = decide_fabric(TransportChoice::Auto, found(two.clone())).unwrap();
        let nics = nics.expect("auto runs on verbs NICs when there are some");
        assert_eq!(nics.len(), 1, "a port without an IP cannot bootstrap lanes");
        assert_eq!(nics[0].device, "mlx5_0");
        assert_eq!(line, "fabric verbs (RAILOVER_TRANSPORT=auto): mlx5_0:1");

        let (nics, line) =
            decide_fabric(TransportChoice::Auto, found(vec![roce("mlx5_1", None)])).unwrap();
        assert!(nics.is_none(), "nothing usable: TCP");
        assert!(
            line.starts_with(
                "fabric TCP (RAILOVER_TRANSPORT=auto: no usable verbs NIC: mlx5_1:1: no IP address"
            ),
            "{line}"
        );
        let absent = verbs::Discovery {
            absent: Some("libibverbs.so.1 is not installed".into()),
            ..Default::default()
        };
        let (nics, line) = decide_fabric(TransportChoice::Auto, absent.clone()).unwrap();
        assert!(nics.is_none());
        assert!(
            line.ends_with("libibverbs.so.1 is not installed)"),
            "{line}"
        );
        let e = decide_fabric(TransportChoice::Verbs, absent).unwrap_err();
        assert!(e.to_string().contains("RAILOVER_TRANSPORT=verbs, but there is no usable verbs NIC: libibverbs.so.1 is not installed"), "{e}");
        let (nics, _) = decide_fabric(TransportChoice::Verbs, found(two)).unwrap();
        assert_eq!(nics.map(|n| n.len()), Some(1));
    }
}
