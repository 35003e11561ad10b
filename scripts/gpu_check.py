#!/usr/bin/env python3
"""GPU validation of a railover build with PyTorch's NCCL backend.

Two ranks share one GPU; each gets its own NCCL_HOSTID, so NCCL takes them for two
hosts and must move every byte between them through the network (P2P and SHM are ruled
out between different host hashes: NCCL's p2p.cc and shm.cc canConnect). The sweep runs
all_reduce, all_gather, reduce_scatter and send/recv over a range of sizes, checks every
result, then runs again with NCCL's built-in Socket transport for comparison. NCCL's own
log must show that railover was loaded through the table this NCCL asks for and carried
every channel.

    gpu_check.py --plugin /path/librailover.so --out DIR [--full] [options]

It is built to lose nothing it measured:

* OUT gets at most three files: summary.json, log-tail.txt and gpu-check.tar.gz (every
  log and event file of the run). Everything else is written in a work folder.
* Each rank appends one JSON line per event (item begun, item measured, teardown begun
  ...) and flushes it; the driver reads those lines as they come and rewrites
  summary.json atomically whenever a result arrives. A timeout or crash keeps what came
  before, and the summary names every item that did not run, and why.
* Ranks run unbuffered (PYTHONUNBUFFERED, stdbuf -oL -eL where present, and NCCL's log
  in NCCL_DEBUG_FILE, which NCCL line-buffers), so a killed rank keeps its last lines.
* When one rank ends, the other gets --grace seconds, then is stopped and reported so.
  Teardown (destroy_process_group and process exit) has its own limit; a hang there is
  reported as a teardown hang and the results measured before it stand.
* A preflight (CUDA visible, the GPU's compute mode, NCCL's version from torch, the
  plugin's ncclNetPlugin_vN tables against those that NCCL loads) fails fast, with the
  reason, before any rank starts.

Exit status: 0 passed; 1 railover failed (a wrong result, a rank that failed, or NCCL's
log not showing railover); 3 railover passed but the Socket baseline did not; 4 the
preflight failed and nothing ran; 5 railover's results passed but a rank hung or failed
in teardown; 6 railover passed what ran but some items did not run (time limit); 124
stopped by SIGTERM (e.g. the wrapper's time limit).

The functions above `worker` need no torch and are tested by scripts/test_gpu_check.py.
"""

import argparse
import ctypes
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time

PLUGIN_NAME = "railover"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
MODES = ("plugin", "socket")
WORLD = 2
# Values stay small integers, exact in float32 after summing two ranks.
PERIOD = 251
RANK_STEP = 1000
ELEM = 4  # float32

SUMMARY = "summary.json"
LOG_TAIL = "log-tail.txt"
ARCHIVE = "gpu-check.tar.gz"
OUT_FILES = (SUMMARY, LOG_TAIL, ARCHIVE)

PASSED, RAILOVER_FAILED, USAGE, SOCKET_FAILED, PREFLIGHT_FAILED, TEARDOWN, INCOMPLETE = 0, 1, 2, 3, 4, 5, 6
INTERRUPTED = 124
STATUS_TEXT = {
    PASSED: "passed",
    RAILOVER_FAILED: "railover failed",
    SOCKET_FAILED: "railover passed; the Socket baseline failed or is incomplete",
    PREFLIGHT_FAILED: "preflight failed; nothing ran",
    TEARDOWN: "railover's results passed, but a rank hung or failed in teardown",
    INCOMPLETE: "railover passed what ran, but some items did not run",
    INTERRUPTED: "stopped by SIGTERM",
}

# The defaults keep a run (preflight, both transports) within 4 minutes with the
# wrapper's margin; --full takes the whole sweep and up to 9 minutes.
PROFILES = {
    "default": {"max_bytes": 32 << 20, "step": 4, "budget": 210.0, "mode_limit": 90.0},
    "full": {"max_bytes": 256 << 20, "step": 2, "budget": 540.0, "mode_limit": 240.0},
}


# ---- arguments ---------------------------------------------------------------------


def parse_size(s):
    """'8', '4K', '256M', '1G' -> bytes (binary multiples)."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", str(s).strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"size {s!r} is not valid: expected a number with an optional K, M or G suffix")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def parse_args(argv):
    codes = sorted({**STATUS_TEXT, USAGE: "usage error"}.items())
    epilog = "Exit status: " + " | ".join(f"{k}: {v}" for k, v in codes)
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0], epilog=epilog)
    p.add_argument("--plugin", help="railover .so built beforehand (cargo build --release)")
    p.add_argument("--out", help="folder for summary.json, log-tail.txt and gpu-check.tar.gz")
    p.add_argument("--full", action="store_true", help="the whole sweep: 8 B to 256 MiB in doublings, 9 min budget")
    p.add_argument("--min-bytes", default="8", help="smallest size (8)")
    p.add_argument("--max-bytes", help="largest size (default 32M, 256M with --full)")
    p.add_argument("--step", type=int, help="size factor between items (default 4, 2 with --full)")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 210, 540 with --full)")
    p.add_argument("--mode-limit", type=float, help="seconds per transport (default 90, 240 with --full)")
    p.add_argument("--grace", type=float, default=25.0, help="seconds a rank gets after its peer ended (25)")
    p.add_argument("--teardown-limit", type=float, default=20.0, help="seconds for destroy_process_group and exit (20)")
    p.add_argument("--preflight-limit", type=float, default=60.0, help="seconds for the preflight probe (60)")
    p.add_argument("--work", help="folder for the logs and event files (default: a new temporary folder)")
    # Tuning for tests; hidden.
    p.add_argument("--poll", type=float, default=0.2, help=argparse.SUPPRESS)
    p.add_argument("--stop-wait", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--min-mode-seconds", type=float, default=45.0, help=argparse.SUPPRESS)
    p.add_argument("--op-timeout", type=float, default=45.0, help=argparse.SUPPRESS)
    p.add_argument("--soft-deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    prof = PROFILES["full" if a.full else "default"]
    try:
        a.min_bytes = parse_size(a.min_bytes)
        a.max_bytes = parse_size(a.max_bytes) if a.max_bytes is not None else prof["max_bytes"]
    except ValueError as e:
        p.error(str(e))
    a.step = a.step if a.step is not None else prof["step"]
    a.budget = a.budget if a.budget is not None else prof["budget"]
    a.mode_limit = a.mode_limit if a.mode_limit is not None else prof["mode_limit"]
    if a.step < 2:
        p.error(f"--step {a.step} is too small: expected 2 or more")
    if a.min_bytes < WORLD * ELEM:
        p.error(f"--min-bytes {a.min_bytes} is too small: expected at least {WORLD * ELEM} (one float per rank)")
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes {a.min_bytes} is above --max-bytes {a.max_bytes}")
    for name in ("budget", "mode_limit", "grace", "teardown_limit", "preflight_limit", "poll"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be above 0 seconds")
    if a.worker or a.probe:
        return a
    if not a.plugin or not a.out:
        p.error("--plugin PATH and --out DIR are required")
    a.plugin = os.path.abspath(a.plugin)
    if not os.path.isfile(a.plugin):
        p.error(f"--plugin {a.plugin!r} is not a file: expected the built librailover.so")
    return a


def sizes(lo, hi, factor=2):
    """Sizes from lo to hi, each `factor` times the last, hi included, each a whole
    number of floats per rank."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    out.append(hi)
    step = WORLD * ELEM
    return sorted({max(step, x - x % step) for x in out})


def plan(a):
    """The items of one transport's sweep, in the order the ranks run them."""
    return [(kind, size) for size in sizes(a.min_bytes, a.max_bytes, a.step) for kind in COLLECTIVES]


def item_key(kind, size):
    return f"{kind}/{size}"


def item_name(kind, size):
    return f"{kind} {human(size)}"


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# ---- one rank's process -------------------------------------------------------------


def rank_env(base, rank, mode, plugin, nccl_log):
    """The environment of one rank: the caller's, without NCCL_NET*/RAILOVER_* and the
    NCCL settings this check makes itself."""
    ours = ("NCCL_HOSTID", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_SOCKET_IFNAME")
    env = {
        k: v
        for k, v in base.items()
        if not (k.startswith("NCCL_NET") or k.startswith("RAILOVER_") or k in ours)
    }
    env.update(
        {
            "NCCL_HOSTID": f"railover-gpu-check-{rank}",  # two "hosts" on one machine
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
            # NCCL line-buffers its debug file (setlinebuf), so a killed rank loses no line.
            "NCCL_DEBUG_FILE": nccl_log,
            "NCCL_SOCKET_IFNAME": "lo",  # bootstrap on loopback only
            "NCCL_MNNVL_ENABLE": "0",
            # Two ranks time-share one GPU: few CTAs each.
            "NCCL_MIN_CTAS": "1",
            "NCCL_MAX_CTAS": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if mode == "plugin":
        env.update(
            {
                "NCCL_NET": PLUGIN_NAME,
                "NCCL_NET_PLUGIN": plugin,
                "RAILOVER_TRANSPORT": "tcp",
                "RAILOVER_IFNAME": "lo",
                # Both ranks have local rank 0, so they would take the same metrics port.
                "RAILOVER_METRICS_PORT": "off",
            }
        )
    else:
        env.update({"NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none"})
    return env


def rank_files(work, mode, rank):
    stem = os.path.join(work, f"{mode}-rank{rank}")
    return {"out": stem + ".out", "events": stem + ".jsonl", "nccl": stem + ".nccl.log"}


def worker_args(a, mode, rank, port, files, soft_deadline):
    """The arguments every rank takes (the real worker and, in tests, a fake one)."""
    return [
        "--mode", mode, "--rank", str(rank), "--port", str(port), "--events", files["events"],
        "--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes), "--step", str(a.step),
        "--soft-deadline", f"{soft_deadline:.3f}", "--op-timeout", str(a.op_timeout),
    ]  # fmt: skip


def line_buffered(argv, which=shutil.which):
    """argv run under `stdbuf -oL -eL` when coreutils' stdbuf is there: C stdio (NCCL's
    fallbacks, CUDA, the plugin) then flushes every line."""
    sb = which("stdbuf")
    return ([sb, "-oL", "-eL"] + argv) if sb else list(argv)


def worker_launcher(a, mode, rank, port, files, soft_deadline):
    """argv and environment of a real rank."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    argv += worker_args(a, mode, rank, port, files, soft_deadline)
    return line_buffered(argv), rank_env(os.environ, rank, mode, a.plugin, files["nccl"])


# ---- the events file ---------------------------------------------------------------


class EventWriter:
    """A rank's JSON lines, each flushed as it is written (a killed rank keeps them)."""

    def __init__(self, path):
        self.f = open(path, "a", buffering=1)

    def emit(self, ev, **fields):
        self.f.write(json.dumps({"ev": ev, "t": round(time.time(), 3), **fields}) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


class EventReader:
    """Reads the lines a rank has written so far; a line still being written waits."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read_new(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"ev": "garbled", "text": line.decode(errors="replace")[:200]})
        return out


# ---- NCCL's log --------------------------------------------------------------------
# Messages as NCCL 2.28 words them (src/init.cc, src/plugin/net.cc, src/plugin/net/
# net_v*.cc, src/plugin/plugin_open.cc, src/transport/net.cc), and railover's own.

_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)(\S*)")
_LOADED = re.compile(r"NET/Plugin: Loaded net plugin (\S+) \(v(\d+)\)")
_SUCCESS = re.compile(r"Successfully loaded external network plugin (\S+)")
_INITIALIZED = re.compile(r"Initialized NET plugin (\S+)")
_ASSIGNED = re.compile(r"Assigned NET plugin (\S+) to comm")
_USING = re.compile(r"Using network (\S+)")
_VIA = re.compile(r"\[(?:send|receive)\] via NET/([^/\s]+)/")
_BYPASS = re.compile(r"Channel \d+(?:/\d+)? : .* via (P2P|SHM|CUMEM|NVLS|COLLNET)\S*")
_FABRIC = re.compile(r"railover: fabric (\S+)")
# (pattern, what it means)
_FAILURES = (
    (re.compile(r"External network plugin (\S+) is unsupported"), "NCCL found no ncclNetPlugin_vN table it knows in {0}"),
    (re.compile(r"Failed to initialize NET plugin (\S+)"), "NCCL could not initialise the NET plugin {0}"),
    (re.compile(r"Failed to initialize any NET plugin"), "NCCL initialised no NET plugin"),
    (re.compile(r"NET/Plugin: Could not find: ?(.*)"), "NCCL could not find the plugin library: {0}"),
    (re.compile(r"NET/Plugin: (/\S+|\S+\.so\S*): (.+)"), "NCCL could not open {0}: {1}"),
    (re.compile(r"Duplicate GPU detected : (.*)"), "NCCL saw both ranks as one host: {0}"),
    (re.compile(r"railover: (RAILOVER_IFNAME=\S+|the default selection.*?) matches no usable interface"), "railover found no NIC: {0}"),
)


def parse_nccl_log(text):
    """What NCCL said about its network: version, plugin loaded (and through which
    table), network used, channels, failures."""
    info = {
        "nccl_version": None,
        "loaded": [],
        "loaded_from": [],
        "initialized": [],
        "assigned": [],
        "using": [],
        "channels": {},
        "bypass": [],
        "fabric": [],
        "warnings": [],
        "failures": [],
    }
    for line in text.splitlines():
        if (m := _VERSION.search(line)) and not info["nccl_version"]:
            info["nccl_version"] = m.group(1) + m.group(2)
        if m := _LOADED.search(line):
            info["loaded"].append({"name": m.group(1), "table": int(m.group(2))})
        if m := _SUCCESS.search(line):
            info["loaded_from"].append(m.group(1))
        if m := _INITIALIZED.search(line):
            info["initialized"].append(m.group(1))
        if m := _ASSIGNED.search(line):
            info["assigned"].append(m.group(1))
        if m := _USING.search(line):
            info["using"].append(m.group(1))
        if m := _VIA.search(line):
            info["channels"][m.group(1)] = info["channels"].get(m.group(1), 0) + 1
        if m := _BYPASS.search(line):
            info["bypass"].append(m.group(1))
        if m := _FABRIC.search(line):
            info["fabric"].append(m.group(1))
        if " NCCL WARN " in line:
            info["warnings"].append(line.strip())
        for rx, meaning in _FAILURES:
            if m := rx.search(line):
                f = meaning.format(*[g.strip() for g in m.groups()])
                if f not in info["failures"]:
                    info["failures"].append(f)
                break
    return info


def version_tuple(v):
    """'2.28.9+cuda12.9', (2, 28, 9), 22809 -> (2, 28, 9); None when unreadable."""
    if v is None:
        return None
    if isinstance(v, int):
        # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 before.
        return (v // 10000, v // 100 % 100, v % 100) if v >= 20900 else (v // 1000, v // 100 % 10, v % 100)
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v[:3]) if len(v) >= 2 else None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(v))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def check_log(info, mode, expected_table=None):
    """Problems with what the log shows (empty: the expected network carried the traffic
    and, for railover, was loaded through `expected_table`)."""
    want = PLUGIN_NAME if mode == "plugin" else "Socket"
    problems = []
    if mode == "plugin":
        ours = [x for x in info["loaded"] if x["name"].lower() == PLUGIN_NAME]
        if not ours:
            problems.append("NCCL never logged 'NET/Plugin: Loaded net plugin railover (vN)'")
        for x in ours:
            if expected_table is not None and x["table"] != expected_table:
                problems.append(
                    f"NCCL loaded railover through ncclNetPlugin_v{x['table']}, expected v{expected_table} for this NCCL"
                )
                break
        for f in info["fabric"]:
            if f.lower() != "tcp":
                problems.append(f"railover chose fabric {f}, expected TCP (RAILOVER_TRANSPORT=tcp)")
                break
    if not info["using"]:
        problems.append("NCCL never logged 'Using network ...'")
    elif any(u.lower() != want.lower() for u in info["using"]):
        problems.append(f"NCCL used {sorted(set(info['using']))}, expected {want}")
    if not info["channels"]:
        problems.append("no channel went 'via NET/...': the ranks did not talk over the network")
    elif set(k.lower() for k in info["channels"]) != {want.lower()}:
        problems.append(f"channels went via {sorted(info['channels'])}, expected only NET/{want}")
    if info["bypass"]:
        problems.append(f"channels bypassed the network via {sorted(set(info['bypass']))}")
    # With NCCL_NET=railover no other external or internal plugin is initialised, so in
    # plugin mode every NET plugin failure is railover's; in Socket mode only Socket's and
    # the general ones count.
    for f in info["failures"]:
        general = "initialised no NET plugin" in f or "as one host" in f
        if mode == "plugin" or general or "plugin Socket" in f:
            problems.append(f"NCCL: {f}")
    return problems


# ---- the preflight -----------------------------------------------------------------

# The ncclNetPlugin_vN tables NCCL looks for, newest first, from the release that last
# changed the list (src/plugin/net.cc, before 2.26 src/net.cc, of each release).
NCCL_NET_TABLES = (
    ((2, 30), (12, 11, 10, 9, 8, 7, 6)),
    ((2, 28), (11, 10, 9, 8, 7, 6)),
    ((2, 26), (10, 9, 8, 7, 6)),
    ((2, 24), (9, 8, 7, 6, 5)),
    ((2, 20), (8, 7, 6, 5)),
    ((2, 19), (7, 6, 5)),
    ((2, 18), (6, 5, 4)),
)


def nccl_tables(version):
    """(tables NCCL `version` looks for, newest first; False when `version` is newer
    than the releases listed here and the newest list is assumed)."""
    v = version_tuple(version)
    if v is None:
        return (), False
    for since, tables in NCCL_NET_TABLES:
        if v[:2] >= since:
            return tables, v[:2] <= NCCL_NET_TABLES[0][0]
    return (), True


def expected_table(version, exported):
    """The table NCCL `version` takes from a plugin that exports `exported` (the first
    of NCCL's list that the plugin has), or None."""
    tables, _ = nccl_tables(version)
    for t in tables:
        if t in exported:
            return t
    return None


def elf_exports(path):
    """Names of the defined global and weak symbols in an ELF64 shared object's dynamic
    symbol table (what dlsym can find). Raises ValueError with the reason."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    if data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    e = "<" if data[5] == 1 else ">"
    try:
        shoff = struct.unpack_from(e + "Q", data, 0x28)[0]
        shentsize, shnum = struct.unpack_from(e + "HH", data, 0x3A)
        sections = [struct.unpack_from(e + "IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    except struct.error:
        raise ValueError(f"{path}: its section headers are cut short") from None
    dynsym = [s for s in sections if s[1] == 11]  # SHT_DYNSYM
    if not dynsym:
        raise ValueError(f"{path} has no dynamic symbol table")
    _, _, _, _, off, size, link, _, _, entsize = dynsym[0]
    stroff = sections[link][4]
    names = set()
    for i in range(size // (entsize or 24)):
        st_name, st_info, _, st_shndx, _, _ = struct.unpack_from(e + "IBBHQQ", data, off + i * (entsize or 24))
        if st_shndx == 0 or (st_info >> 4) not in (1, 2):  # undefined, or not GLOBAL/WEAK
            continue
        end = data.index(b"\0", stroff + st_name)
        names.add(data[stroff + st_name : end].decode(errors="replace"))
    return names


def net_tables(names):
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ncclNetPlugin_v(\d+)", n)))


def dlopen_check(path, names=()):
    """dlopen `path` as NCCL does (RTLD_NOW | RTLD_LOCAL) and look up `names`:
    {"ok": True, "found": [...]} or {"ok": False, "error": dlerror}."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "found": [n for n in names if hasattr(lib, n)]}


COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def compute_mode_from_smi(text, visible=None):
    """The compute mode of the first visible GPU from `nvidia-smi --query-gpu=
    index,uuid,compute_mode --format=csv,noheader` (CUDA_VISIBLE_DEVICES picks it)."""
    rows = [[c.strip() for c in line.split(",")] for line in text.strip().splitlines() if line.count(",") >= 2]
    if not rows:
        return None
    first = (visible or "").split(",")[0].strip()
    pick = rows[0]
    for r in rows:
        if first and (r[0] == first or r[1].startswith(first)):
            pick = r
            break
    names = {v.lower().replace(" ", "_"): k for k, v in COMPUTE_MODES.items()}
    return names.get(pick[2].lower().replace(" ", "_"))


def read_compute_mode():
    """{"value": n, "name": ..., "source": ...} of the first visible GPU, or {"error": ...}.
    Reads the driver's attribute (no CUDA context is made), else asks nvidia-smi."""
    errors = []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        r = cuda.cuInit(0)
        if r != 0:
            raise OSError(f"cuInit returned CUDA error {r}")
        dev, val = ctypes.c_int(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            raise OSError("cuDeviceGet(0) failed: no visible GPU")
        if cuda.cuDeviceGetAttribute(ctypes.byref(val), 20, dev) != 0:  # CU_DEVICE_ATTRIBUTE_COMPUTE_MODE
            raise OSError("cuDeviceGetAttribute(COMPUTE_MODE) failed")
        return {"value": val.value, "name": COMPUTE_MODES.get(val.value, "unknown"), "source": "libcuda"}
    except (OSError, AttributeError) as e:
        errors.append(f"libcuda: {e}")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run(
                [smi, "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            v = compute_mode_from_smi(r.stdout, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if v is not None:
                return {"value": v, "name": COMPUTE_MODES[v], "source": "nvidia-smi"}
            errors.append(f"nvidia-smi: no compute mode in {r.stdout.strip()[:100]!r} {r.stderr.strip()[:100]}")
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"nvidia-smi: {e}")
    else:
        errors.append("nvidia-smi: not found")
    return {"error": "; ".join(errors)}


def judge_preflight(probe, exports):
    """The preflight's verdict from the probe's findings and the plugin's exported
    tables: {"ok", "reasons" (each enough to fail), "notes", "expected_table"}."""
    reasons, notes = [], []
    if exports.get("error"):
        reasons.append(f"the plugin's symbols could not be read: {exports['error']}")
    if probe.get("error"):
        reasons.append(probe["error"])
    dl = probe.get("dlopen")
    if dl and not dl.get("ok"):
        reasons.append(f"dlopen of the plugin failed ({dl.get('error')}): NCCL would not load it either")
    if probe.get("torch_error"):
        reasons.append(f"cannot import torch ({probe['torch_error']}): install a CUDA build of PyTorch")
    elif "torch" in probe:
        if not probe.get("cuda_available") or not probe.get("device_count"):
            reasons.append(
                f"torch {probe.get('torch')} (CUDA {probe.get('torch_cuda')}) sees no GPU "
                f"(CUDA_VISIBLE_DEVICES={probe.get('cuda_visible_devices')!r})"
            )
        if not probe.get("nccl_available"):
            reasons.append(f"torch {probe.get('torch')} has no NCCL backend (torch.distributed.is_nccl_available() is False)")
    cm = probe.get("compute_mode") or {}
    if "value" in cm:
        name = cm.get("name") or COMPUTE_MODES.get(cm["value"], str(cm["value"]))
        if cm["value"] in (1, 3):
            reasons.append(
                f"the GPU's compute mode is {name}: only one process may use it, so rank 1 would fail "
                "and rank 0 hang; set it to Default (nvidia-smi -c DEFAULT, as root)"
            )
        elif cm["value"] == 2:
            reasons.append(f"the GPU's compute mode is {name}: no process may use it")
    elif cm.get("error"):
        notes.append(f"the GPU's compute mode could not be read ({cm['error']}); Exclusive modes make the ranks hang")
    exp = None
    nv = probe.get("nccl_version")
    if "torch" in probe and not probe.get("torch_error") and nv is None:
        reasons.append(f"torch.cuda.nccl.version() gave no version ({probe.get('nccl_error', 'no NCCL')})")
    tables = exports.get("tables", [])
    if not exports.get("error") and not tables:
        reasons.append(
            "the plugin exports no ncclNetPlugin_vN table: NCCL would log 'External network plugin ... is unsupported'"
        )
    if nv is not None and tables:
        tried, known = nccl_tables(nv)
        ver = ".".join(map(str, version_tuple(nv)))
        if not tried:
            reasons.append(f"NCCL {ver} is older than any release this check knows (2.18); railover needs ncclNetPlugin_v8 (NCCL 2.20 or later)")
        else:
            exp = expected_table(nv, tables)
            if exp is None:
                reasons.append(
                    f"NCCL {ver} looks for ncclNetPlugin_v{'/v'.join(map(str, tried))} and the plugin exports "
                    f"v{'/v'.join(map(str, tables))}: NCCL would log 'External network plugin ... is unsupported'"
                )
            elif not known:
                notes.append(f"NCCL {ver} is newer than the releases this check knows; v{exp} is assumed")
    return {"ok": not reasons, "reasons": reasons, "notes": notes, "expected_table": exp}


def run_bounded(argv, limit, env=None, stop=lambda: None, poll=0.2):
    """Runs argv for at most `limit` seconds (and no longer than `stop()` stays None):
    (returncode or None, stdout, stderr, why it was cut or None)."""
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        p = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env)
        end = time.monotonic() + limit
        cut = None
        while p.poll() is None:
            if time.monotonic() >= end:
                cut = f"did not finish in {limit:.0f} s"
            elif stop():
                cut = f"stopped ({stop()})"
            if cut:
                p.kill()
                p.wait()
                break
            try:
                p.wait(timeout=max(0.001, min(poll, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        o.seek(0)
        e.seek(0)
        return (None if cut else p.returncode), o.read().decode(errors="replace"), e.read().decode(errors="replace"), cut


def run_preflight(a, stop=lambda: None):
    """The real preflight: the plugin's ELF exports here, then a probe process (torch,
    CUDA, compute mode, NCCL's version, a dlopen of the plugin) bounded in time."""
    exports = {}
    try:
        names = elf_exports(a.plugin)
        exports = {"tables": net_tables(names)}
    except (OSError, ValueError) as e:
        exports = {"error": str(e), "tables": []}
    argv = [sys.executable, os.path.abspath(__file__), "--probe", "--plugin", a.plugin]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rc, out, err, cut = run_bounded(argv, a.preflight_limit, env=env, stop=stop)
    probe = {}
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if lines:
        try:
            probe = json.loads(lines[-1])
        except ValueError:
            pass
    if cut:
        probe["error"] = f"the probe (import torch, CUDA, NCCL version) {cut}: CUDA or the driver may be stuck"
    elif not probe:
        probe["error"] = f"the probe exited with status {rc} and no findings: {tail(err, 5) or '(no output)'}"
    verdict = judge_preflight(probe, exports)
    return {**verdict, "exports": exports, "probe": probe, "probe_stderr": tail(err, 20)}


def probe(a):
    """The preflight's findings about this machine, as one JSON line on stdout."""
    out = {"python": sys.version.split()[0], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if a.plugin:
        out["dlopen"] = dlopen_check(a.plugin, [f"ncclNetPlugin_v{n}" for n in range(4, 17)])
    out["compute_mode"] = read_compute_mode()
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        out["torch_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        return 0
    out.update({"torch": torch.__version__, "torch_cuda": torch.version.cuda})
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = torch.cuda.device_count()
        if out["device_count"]:
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"torch could not query CUDA: {type(e).__name__}: {e}"
    out["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    try:
        v = version_tuple(torch.cuda.nccl.version())
        out["nccl_version"] = list(v) if v else None
    except Exception as e:  # noqa: BLE001
        out["nccl_version"] = None
        out["nccl_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    return 0


# ---- expected values ---------------------------------------------------------------


def pattern(rank, i):
    return (i % PERIOD) + RANK_STEP * (rank + 1)


def expected(kind, rank, world, n, i):
    """Element i of `kind`'s output on `rank`; every rank contributed `pattern` of its
    rank (n elements per rank for all_gather/sendrecv, world*n for reduce_scatter)."""
    ranks_sum = RANK_STEP * world * (world + 1) // 2
    if kind == "all_reduce":
        return world * (i % PERIOD) + ranks_sum
    if kind == "all_gather":
        return pattern(i // n, i % n)
    if kind == "reduce_scatter":
        return world * ((rank * n + i) % PERIOD) + ranks_sum
    if kind == "sendrecv":
        return pattern((rank + 1) % world, i)
    raise ValueError(kind)


def output_len(kind, world, n):
    return world * n if kind == "all_gather" else n


def sample_indices(length, k=16):
    """First, last and evenly spread indices: cheap to copy back, catches misplacement."""
    idx = set(range(min(k, length))) | set(range(max(0, length - k), length))
    idx |= {j * length // k for j in range(k)}
    return sorted(idx)


def check_samples(kind, rank, world, n, samples):
    """(index, value) pairs that differ from what `kind` must produce: a list of strings."""
    bad = []
    for i, v in samples:
        e = expected(kind, rank, world, n, i)
        if v != e:
            bad.append(f"{kind} rank {rank} n {n}: element {i} is {v}, expected {e}")
    return bad


# ---- figures -----------------------------------------------------------------------


def bus_factor(kind, world):
    """nccl-tests' busbw factors."""
    if kind == "all_reduce":
        return 2 * (world - 1) / world
    if kind in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


def bandwidths(kind, size, seconds, world):
    """(algbw, busbw) in GB/s for one op of `size` bytes (nccl-tests' size convention:
    the larger of input and output)."""
    alg = size / seconds / 1e9
    return alg, alg * bus_factor(kind, world)


def summarize(plugin, socket_):
    """Rows pairing the two transports' results by (collective, size): railover's items
    in order, then any item only the Socket run measured."""
    pk = {(r["collective"], r["size"]): r for r in plugin}
    sk = {(r["collective"], r["size"]): r for r in socket_}
    rows = []
    for key in list(pk) + [k for k in sk if k not in pk]:
        p, s = pk.get(key), sk.get(key)
        rows.append(
            {
                "collective": key[0],
                "size": key[1],
                "railover_busbw": p["busbw"] if p else None,
                "socket_busbw": s["busbw"] if s else None,
                "ratio": (p["busbw"] / s["busbw"]) if p and s and s["busbw"] else None,
                "railover_ok": p["ok"] if p else None,
                "socket_ok": s["ok"] if s else None,
            }
        )
    return rows


def table(rows):
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def ok(x):
        return "-" if x is None else ("ok" if x else "WRONG")

    out = [f"{'collective':<15} {'size':>9} {'railover GB/s':>14} {'Socket GB/s':>12} {'ratio':>6}  railover  Socket"]
    for r in rows:
        out.append(
            f"{r['collective']:<15} {human(r['size']):>9} {num(r['railover_busbw'], '.3f'):>14} "
            f"{num(r['socket_busbw'], '.3f'):>12} {num(r['ratio'], '.2f'):>6}  {ok(r['railover_ok']):<8}  {ok(r['socket_ok'])}"
        )
    return "\n".join(out)


def verdict(modes):
    """Exit status from the modes' records (see the module's docstring)."""
    p = modes.get("plugin", {})
    if p.get("problems") or not all(r["ok"] for r in p.get("results", [])):
        return RAILOVER_FAILED
    if p.get("teardown"):
        return TEARDOWN
    if p.get("not_run") or not p.get("results"):
        return INCOMPLETE
    s = modes.get("socket", {})
    if s.get("problems") or not all(r["ok"] for r in s.get("results", [])) or s.get("not_run") or not s.get("results"):
        return SOCKET_FAILED
    return PASSED


def tail(text, n=60):
    return "\n".join(text.splitlines()[-n:])


# ---- watching the ranks ------------------------------------------------------------

PHASES = {
    "start": "starting Python",
    "import": "importing torch",
    "init": "init_process_group (NCCL bootstrap and comm init)",
    "sweep": "the sweep",
    "teardown": "teardown (destroy_process_group)",
    "exit": "process exit after teardown",
}


def describe_exit(rc):
    if rc is None:
        return "no exit"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


class RankState:
    """What the driver knows of one rank: its events so far and how it ended."""

    def __init__(self, rank, proc, reader):
        self.rank, self.proc, self.reader = rank, proc, reader
        self.seen = set()
        self.results = {}  # item key -> result
        self.begun = None  # (kind, size) in progress
        self.error = None
        self.cut = None
        self.meta = {}
        self.traceback_signal = None
        self.teardown_seen_at = None
        self.rc = None
        self.exited_at = None
        self.stopped_by = None  # "grace", "teardown", "deadline" or "interrupted"
        self.stop_note = None
        self.waited = None

    def take(self, ev, now):
        """One event; True when it is a new result."""
        kind = ev.get("ev")
        self.seen.add(kind)
        if kind == "start":
            self.traceback_signal = ev.get("traceback_signal")
        elif kind == "init":
            self.meta.update({k: ev[k] for k in ("torch", "nccl", "gpu") if k in ev})
        elif kind == "begin":
            self.begun = (ev["collective"], ev["size"])
        elif kind == "result":
            self.results[item_key(ev["collective"], ev["size"])] = {k: v for k, v in ev.items() if k not in ("ev", "t")}
            self.begun = None
            return True
        elif kind == "error":
            self.error = ev.get("error")
        elif kind == "cut":
            self.cut = ev.get("reason")
        elif kind == "teardown_start" and self.teardown_seen_at is None:
            self.teardown_seen_at = now
        return False

    @property
    def sweep_done(self):
        return "sweep_done" in self.seen

    @property
    def phase(self):
        for ev, phase in (("teardown_done", "exit"), ("teardown_start", "teardown"), ("sweep_done", "teardown"),
                          ("init", "sweep"), ("init_begin", "init"), ("start", "import")):  # fmt: skip
            if ev in self.seen:
                return phase
        return "start"

    def where(self):
        if self.begun and self.phase == "sweep":
            return f"{item_name(*self.begun)} (in progress)"
        return PHASES[self.phase]


def classify(st, grace, teardown_limit, deadline_s):
    """How one rank ended: {"rank", "exit", "phase", "outcome", "detail", ...}.

    outcome: ok; teardown_hang (stopped in teardown or exit: its results stand);
    teardown_failed (ended badly in teardown: its results stand); stopped (by the
    driver before its sweep ended: grace, time limit or interruption); failed (ended by
    itself before its sweep ended)."""
    r = st.rank
    rec = {"rank": r, "exit": describe_exit(st.rc), "phase": st.phase, "stopped_by": st.stopped_by,
           "results": len(st.results), **st.meta}  # fmt: skip
    if st.stopped_by == "teardown":
        why = f"past the teardown limit of {teardown_limit:g} s"
    elif st.stopped_by == "grace":
        why = f"{st.waited:.1f} s after rank {st.stop_note} ended (grace {grace:g} s)"
    elif st.stopped_by == "deadline":
        why = f"at the transport's time limit of {deadline_s:g} s"
    elif st.stopped_by == "interrupted":
        why = f"because the run was interrupted ({st.stop_note})"
    if st.stopped_by and st.sweep_done:
        rec["outcome"] = "teardown_hang"
        rec["detail"] = f"rank {r} hung in {PHASES[st.phase]} and was stopped {why}; its results stand"
    elif st.sweep_done:
        if st.rc == 0 and "teardown_done" in st.seen:
            rec["outcome"], rec["detail"] = "ok", f"rank {r} finished"
        else:
            rec["outcome"] = "teardown_failed"
            rec["detail"] = f"rank {r} ended with {describe_exit(st.rc)} in {PHASES[st.phase]}"
            rec["detail"] += (f": {st.error}" if st.error else "") + "; its results stand"
    elif st.stopped_by:
        rec["outcome"] = "stopped"
        rec["detail"] = f"rank {r} was stopped {why}, while in {st.where()}"
    else:
        rec["outcome"] = "failed"
        rec["detail"] = f"rank {r} ended with {describe_exit(st.rc)} during {st.where()}"
        if st.rc == 0:
            rec["detail"] += " without finishing its sweep"
        if st.error:
            rec["detail"] += f": {st.error}"
    if st.cut:
        rec["cut"] = st.cut
    return rec


_PDEATHSIG = None


def _die_with_parent():
    """In a rank, before exec: die when the driver dies (Linux PR_SET_PDEATHSIG)."""
    if _PDEATHSIG is not None:
        _PDEATHSIG(1, signal.SIGKILL)


def _prepare_pdeathsig():
    global _PDEATHSIG
    if _PDEATHSIG is None and sys.platform.startswith("linux"):
        try:
            _PDEATHSIG = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass


class ModeRun:
    """Both ranks of one transport: started, watched, stopped, recorded."""

    def __init__(self, a, mode, work, launcher, limit, on_result=lambda: None, stop=lambda: None, log=print):
        self.a, self.mode, self.work, self.limit = a, mode, work, limit
        self.on_result, self.stop, self.log = on_result, stop, log
        self.state = "running"
        self.ranks = []
        self.outfiles = []
        _prepare_pdeathsig()
        port = free_port()
        # The ranks stop starting items in time to tear down within the limit.
        soft = time.time() + max(1.0, limit - a.teardown_limit - 5.0)
        for rank in range(WORLD):
            files = rank_files(work, mode, rank)
            for f in files.values():
                if os.path.exists(f):
                    os.remove(f)
            argv, env = launcher(a, mode, rank, port, files, soft)
            out = open(files["out"], "w")
            self.outfiles.append(out)
            # Their own session: only the driver stops them, dumping their stacks first; and
            # they die with it.
            p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
            self.ranks.append(RankState(rank, p, EventReader(files["events"])))
        self.started = time.monotonic()
        self.ended = None
        self.deadline = self.started + limit

    def read_events(self):
        now = time.monotonic()
        new = False
        for st in self.ranks:
            for ev in st.reader.read_new():
                new = st.take(ev, now) or new
        if new:
            self.on_result()

    def stop_rank(self, st, why, note=None):
        """Stops a rank: its Python stack dumped first when it offers that, then SIGTERM,
        then SIGKILL."""
        st.stopped_by, st.stop_note = why, note
        p = st.proc
        steps = [(signal.SIGTERM, self.a.stop_wait), (signal.SIGKILL, 30.0)]
        if st.traceback_signal:
            steps.insert(0, (st.traceback_signal, min(1.0, self.a.stop_wait)))
        for sig, wait in steps:
            if p.poll() is not None:
                break
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        st.rc = p.wait()
        st.exited_at = time.monotonic()

    def watch(self):
        """Until both ranks have ended (by themselves or stopped)."""
        a = self.a
        while True:
            self.read_events()
            now = time.monotonic()
            for st in self.ranks:
                if st.rc is None and st.proc.poll() is not None:
                    st.rc, st.exited_at = st.proc.returncode, now
            alive = [st for st in self.ranks if st.rc is None]
            if not alive:
                break
            ended = [st for st in self.ranks if st.rc is not None]
            if self.stop():
                for st in alive:
                    self.stop_rank(st, "interrupted", self.stop())
                continue
            if now >= self.deadline:
                for st in alive:
                    self.stop_rank(st, "deadline")
                continue
            for st in alive:
                if st.teardown_seen_at is not None and now - st.teardown_seen_at > a.teardown_limit:
                    st.waited = now - st.teardown_seen_at
                    self.stop_rank(st, "teardown")
            if ended:
                first = min(ended, key=lambda s: s.exited_at)
                if now - first.exited_at > a.grace:
                    for st in alive:
                        if st.rc is None:
                            st.waited = now - first.exited_at
                            self.log(f"gpu-check: {self.mode}: rank {first.rank} ended ({describe_exit(first.rc)}); "
                                     f"stopping rank {st.rank} after {st.waited:.1f} s")  # fmt: skip
                            self.stop_rank(st, "grace", str(first.rank))
                    continue
            try:
                alive[0].proc.wait(timeout=a.poll)
            except subprocess.TimeoutExpired:
                pass
        self.read_events()
        for f in self.outfiles:
            f.close()
        self.state = "done"
        self.ended = time.monotonic()

    def log_text(self):
        text = ""
        for rank in range(WORLD):
            files = rank_files(self.work, self.mode, rank)
            for key in ("nccl", "out"):
                try:
                    with open(files[key], errors="replace") as g:
                        text += g.read()
                except FileNotFoundError:
                    pass
        return text


def merge_results(items, ranks):
    """One result per item any rank measured: rank 0's timing, every rank's check."""
    out = []
    for kind, size in items:
        key = item_key(kind, size)
        got = {st.rank: st.results[key] for st in ranks if key in st.results}
        if not got:
            continue
        first = got[min(got)]
        r = dict(first)
        r["checked_by"] = sorted(got)
        r["wrong_elements"] = sum(x.get("wrong_elements", 0) for x in got.values())
        r["sample_errors"] = [e for x in got.values() for e in x.get("sample_errors", [])][:5]
        # False: wrong somewhere; None: right where checked, but not checked on every rank.
        r["ok"] = False if not all(x.get("ok") for x in got.values()) else (True if len(got) == WORLD else None)
        out.append(r)
    return out


def mode_record(run, items, expected_tab=None, final=False):
    """The summary's record of one transport, while it runs or after."""
    results = merge_results(items, run.ranks)
    rec = {"state": run.state, "limit_s": run.limit, "items": len(items), "measured": len(results),
           "results": results, "problems": [], "teardown": [], "not_run": []}  # fmt: skip
    rec["elapsed_s"] = round((run.ended if final else time.monotonic()) - run.started, 1)
    done = {item_key(r["collective"], r["size"]) for r in results}
    for r in results:
        if r["ok"] is False:
            errs = f" {r['sample_errors'][:2]}" if r["sample_errors"] else ""
            rec["problems"].append(f"{item_name(r['collective'], r['size'])}: {r['wrong_elements']} element(s) wrong{errs}")
        elif r["ok"] is None and final:
            missing = [k for k in range(WORLD) if k not in r["checked_by"]]
            rec["problems"].append(f"{item_name(r['collective'], r['size'])}: not checked on rank {missing}")
    if final:
        outcomes = [classify(st, run.a.grace, run.a.teardown_limit, run.limit) for st in run.ranks]
        rec["ranks"] = outcomes
        for o in outcomes:
            if o["outcome"] in ("failed", "stopped"):
                rec["problems"].append(o["detail"])
            elif o["outcome"].startswith("teardown"):
                rec["teardown"].append(o["detail"])
        info = parse_nccl_log(run.log_text())
        rec["log"] = info
        rec["problems"] += check_log(info, run.mode, expected_tab)
        cut = next((st.cut for st in run.ranks if st.cut), None)
        # The cause first: ranks that failed, then those stopped after them.
        bad = [o["detail"] for k in ("failed", "stopped") for o in outcomes if o["outcome"] == k]
        reason = (f"the sweep was cut to stay within the transport's time limit ({cut})" if cut else
                  "; ".join(bad) if bad else "the ranks ended without running it")  # fmt: skip
        in_progress = next((st.begun for st in run.ranks if st.begun), None)
    else:
        rec["ranks"] = [{"rank": st.rank, "phase": st.phase, "results": len(st.results)} for st in run.ranks]
        reason = "pending: the run was still going when this summary was written"
        in_progress = None
    for kind, size in items:
        if item_key(kind, size) not in done:
            why = f"in progress when it ended: {reason}" if final and in_progress == (kind, size) else reason
            rec["not_run"].append({"collective": kind, "size": size, "reason": why})
    return rec


def skipped_record(items, reason, state="not_started"):
    return {"state": state, "reason": reason, "items": len(items), "measured": 0, "results": [], "problems": [],
            "teardown": [], "not_run": [{"collective": k, "size": s, "reason": reason} for k, s in items]}  # fmt: skip


# ---- outputs -----------------------------------------------------------------------


def atomic_write(path, data, scratch):
    """Writes `data` to `path` through a temporary file in `scratch` when it is on the
    same filesystem (so nothing else ever appears in path's folder), else beside it."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        same = os.stat(scratch).st_dev == os.stat(d).st_dev
    except OSError:
        same = False
    fd, tmp = tempfile.mkstemp(dir=scratch if same else d, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def archive_bytes(work, exclude=(".scratch",)):
    """A tar.gz of the work folder (every log and event file), as bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name in sorted(os.listdir(work)):
            if name in exclude:
                continue
            t.add(os.path.join(work, name), arcname=f"gpu-check/{name}")
    return buf.getvalue()


def log_tail_text(driver_lines, runs, n=40):
    """The driver's lines, NCCL's lines about the network, and each rank's last lines."""
    out = ["==== driver", *driver_lines[-200:]]
    for mode, run in runs.items():
        for rank in range(WORLD):
            files = rank_files(run.work, mode, rank)
            for key, label in (("nccl", "NCCL log"), ("out", "stdout+stderr")):
                try:
                    with open(files[key], errors="replace") as g:
                        text = g.read()
                except FileNotFoundError:
                    continue
                net = [x for x in text.splitlines() if re.search(r"NET/Plugin|NET plugin|Using network|network plugin|NCCL WARN|railover:", x)]
                out.append(f"==== {mode} rank {rank} {label}: lines about the network (first 30)")
                out += net[:30]
                out.append(f"==== {mode} rank {rank} {label}: last {n} lines")
                out.append(tail(text, n))
    return "\n".join(out)[-200_000:] + "\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """The whole run: preflight, both transports, and the three output files, kept up
    to date as results arrive."""

    def __init__(self, a, launcher, preflight, stop=lambda: None, echo=print):
        self.a, self.launcher, self.preflight_fn, self.stop, self.echo = a, launcher, preflight, stop, echo
        self.items = plan(a)
        self.work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="gpu-check-"))
        self.scratch = os.path.join(self.work, ".scratch")
        os.makedirs(self.scratch, exist_ok=True)
        os.makedirs(a.out, exist_ok=True)
        for name in OUT_FILES:
            if os.path.exists(os.path.join(a.out, name)):
                os.remove(os.path.join(a.out, name))
        self.lines = []
        self.state = "running"
        self.preflight = None
        self.runs = {}
        self.records = {}
        self.expected_table = None
        self.status = None
        self.error = None
        self.began = time.monotonic()
        self.deadline = self.began + a.budget
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def log(self, line):
        self.lines.append(line)
        self.echo(line, flush=True)
        with open(os.path.join(self.work, "driver.log"), "a") as f:
            f.write(line + "\n")

    def summary(self):
        modes = {}
        for mode in MODES:
            if mode in self.records:
                modes[mode] = self.records[mode]
            elif mode in self.runs:
                modes[mode] = mode_record(self.runs[mode], self.items, self.expected_table)
            else:
                why = "pending: the run was still going when this summary was written"
                modes[mode] = skipped_record(self.items, why, "pending")
        rows = summarize(modes["plugin"]["results"], modes["socket"]["results"])
        not_run = [{"mode": m, **x} for m in MODES for x in modes[m]["not_run"]]
        return {
            "state": self.state,
            "error": self.error,
            "status": self.status,
            "status_text": STATUS_TEXT.get(self.status),
            "passed": None if self.status is None else self.status == PASSED,
            "started": self.started_at,
            "elapsed_s": round(time.monotonic() - self.began, 1),
            "plugin": self.a.plugin,
            "settings": {"min_bytes": self.a.min_bytes, "max_bytes": self.a.max_bytes, "step": self.a.step,
                         "full": self.a.full, "budget_s": self.a.budget, "mode_limit_s": self.a.mode_limit,
                         "grace_s": self.a.grace, "teardown_limit_s": self.a.teardown_limit},  # fmt: skip
            "preflight": self.preflight,
            "expected_table": self.expected_table,
            "rows": rows,
            "not_run": not_run,
            "not_run_count": len(not_run),
            "modes": {m: {k: v for k, v in d.items() if k != "not_run"} for m, d in modes.items()},
            "work": self.work,
            "files": list(OUT_FILES),
        }

    def write_summary(self):
        atomic_write(os.path.join(self.a.out, SUMMARY), json.dumps(self.summary(), indent=1), self.scratch)

    def write_all(self):
        self.write_summary()
        shutil.copy(os.path.join(self.a.out, SUMMARY), os.path.join(self.work, SUMMARY))
        atomic_write(os.path.join(self.a.out, LOG_TAIL), log_tail_text(self.lines, self.runs), self.scratch)
        atomic_write(os.path.join(self.a.out, ARCHIVE), archive_bytes(self.work), self.scratch)

    def finish(self, status):
        self.status = status
        if self.state == "running":
            self.state = "done"
        self.write_all()
        return status

    def run(self):
        a = self.a
        self.log(f"gpu-check: work folder {self.work}; outputs in {a.out}")
        self.log(f"gpu-check: preflight (at most {a.preflight_limit:g} s)")
        self.write_summary()
        pf = self.preflight_fn(a, self.stop)
        self.preflight = pf
        with open(os.path.join(self.work, "preflight.json"), "w") as f:
            json.dump(pf, f, indent=1)
        for n in pf.get("notes", []):
            self.log(f"gpu-check: preflight note: {n}")
        if self.stop():
            return self.interrupted()
        if not pf.get("ok"):
            for r in pf.get("reasons", []):
                self.log(f"gpu-check: preflight failed: {r}")
            why = "preflight failed: " + "; ".join(pf.get("reasons") or ["no reason given"])
            for mode in MODES:
                self.records[mode] = skipped_record(self.items, why)
            self.state = "preflight_failed"
            return self.finish(PREFLIGHT_FAILED)
        self.expected_table = pf.get("expected_table")
        p = pf.get("probe", {})
        self.log(f"gpu-check: preflight ok: torch {p.get('torch')}, NCCL {'.'.join(map(str, p.get('nccl_version') or []))}, "
                 f"{p.get('gpu')}; NCCL takes railover's ncclNetPlugin_v{self.expected_table}")  # fmt: skip
        for mode in MODES:
            left = self.deadline - time.monotonic()
            limit = min(a.mode_limit, left - 8.0)
            if limit < a.min_mode_seconds:
                why = f"not started: {max(0.0, left):.0f} s of the {a.budget:g} s budget left, below the {a.min_mode_seconds:g} s a transport needs"
                self.log(f"gpu-check: {mode}: {why}")
                self.records[mode] = skipped_record(self.items, why)
                continue
            self.log(f"gpu-check: {mode}: two ranks on one GPU, {human(a.min_bytes)} .. {human(a.max_bytes)} "
                     f"(x{a.step}), {len(self.items)} items, at most {limit:.0f} s")  # fmt: skip
            run = ModeRun(a, mode, self.work, self.launcher, limit, on_result=self.write_summary, stop=self.stop, log=self.log)
            self.runs[mode] = run
            run.watch()
            rec = mode_record(run, self.items, self.expected_table if mode == "plugin" else None, final=True)
            self.records[mode] = rec
            for line in rec["problems"] + rec["teardown"]:
                self.log(f"gpu-check: {mode}: {line}")
            self.log(f"gpu-check: {mode}: {rec['measured']} of {rec['items']} items measured")
            self.write_all()
            if self.stop():
                return self.interrupted()
        status = verdict(self.records)
        for line in table(self.summary()["rows"]).splitlines():
            self.log(line)
        self.log(f"gpu-check: {'PASSED' if status == PASSED else 'FAILED'} ({STATUS_TEXT[status]}); "
                 f"summary in {os.path.join(a.out, SUMMARY)}")  # fmt: skip
        return self.finish(status)

    def interrupted(self):
        why = f"not run: the run was interrupted ({self.stop()})"
        for mode in MODES:
            if mode not in self.records:
                self.records[mode] = skipped_record(self.items, why)
        self.state = "interrupted"
        self.log(f"gpu-check: interrupted ({self.stop()}); what was measured is in the summary")
        return self.finish(INTERRUPTED)


# ---- the ranks (torch from here on) -----------------------------------------------


def worker(a):
    ev = EventWriter(a.events)
    import faulthandler

    faulthandler.enable()
    # The driver sends SIGUSR1 before stopping a stuck rank: the Python stack goes to the log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ev.emit("start", pid=os.getpid(), mode=a.mode, rank=a.rank, traceback_signal=int(signal.SIGUSR1))
    try:
        return _worker(a, ev)
    except BaseException as e:
        ev.emit("error", error=f"{type(e).__name__}: {str(e)[:500]}")
        raise


def _worker(a, ev):
    import datetime

    import torch
    import torch.distributed as dist

    ev.emit("init_begin", torch=torch.__version__)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{a.port}",
        rank=a.rank,
        world_size=WORLD,
        device_id=dev,
        timeout=datetime.timedelta(seconds=a.op_timeout),
    )
    rank, world = a.rank, WORLD
    peer = (rank + 1) % world
    flag = torch.zeros(1, device=dev)
    dist.all_reduce(flag)  # the communicator exists from here on
    torch.cuda.synchronize()
    ev.emit(
        "init",
        torch=torch.__version__,
        nccl=".".join(map(str, version_tuple(torch.cuda.nccl.version()) or ())),
        gpu=torch.cuda.get_device_name(0),
    )

    def pat(r, length, offset=0):
        i = torch.arange(offset, offset + length, device=dev, dtype=torch.int64)
        return ((i % PERIOD) + RANK_STEP * (r + 1)).to(torch.float32)

    for kind, size in plan(a):
        # Both ranks agree whether to go on, so they stop at the same item.
        flag.fill_(1.0 if a.soft_deadline and time.time() > a.soft_deadline else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            ev.emit("cut", reason=f"stopped before {item_name(kind, size)}")
            break
        ev.emit("begin", collective=kind, size=size)
        # size = the larger buffer, as nccl-tests counts it.
        n = size // ELEM // (world if kind in ("all_gather", "reduce_scatter") else 1)
        if kind == "reduce_scatter":
            inp, out = pat(rank, world * n), torch.empty(n, device=dev)
            op = lambda: dist.reduce_scatter_tensor(out, inp)  # noqa: E731
        elif kind == "all_gather":
            inp, out = pat(rank, n), torch.empty(world * n, device=dev)
            op = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
        elif kind == "all_reduce":
            src, out = pat(rank, n), torch.empty(n, device=dev)

            def op():
                out.copy_(src)
                dist.all_reduce(out)
        else:
            inp, out = pat(rank, n), torch.empty(n, device=dev)

            def op():
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, peer), dist.P2POp(dist.irecv, out, peer)])
                for q in reqs:
                    q.wait()

        iters = max(2, min(20, int(2e8 // size)))
        op()  # warm-up; also the result checked below
        torch.cuda.synchronize()
        # The whole output against `expected`, computed on the GPU.
        length = output_len(kind, world, n)
        idx = torch.arange(length, device=dev, dtype=torch.int64)
        if kind == "all_reduce":
            want = (world * (idx % PERIOD) + RANK_STEP * world * (world + 1) // 2).float()
        elif kind == "all_gather":
            want = ((idx % n) % PERIOD + RANK_STEP * (idx // n + 1)).float()
        elif kind == "reduce_scatter":
            want = (world * ((rank * n + idx) % PERIOD) + RANK_STEP * world * (world + 1) // 2).float()
        else:
            want = pat(peer, n)
        wrong = int((out != want).sum().item())
        picks = sample_indices(length)
        vals = out[torch.tensor(picks, device=dev)].tolist()
        sample_bad = check_samples(kind, rank, world, n, list(zip(picks, vals)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        torch.cuda.synchronize()
        secs = (time.perf_counter() - t0) / iters
        alg, bus = bandwidths(kind, size, secs, world)
        ev.emit(
            "result",
            collective=kind,
            size=size,
            elements=n,
            iters=iters,
            time_us=secs * 1e6,
            algbw=alg,
            busbw=bus,
            wrong_elements=wrong,
            sample_errors=sample_bad[:5],
            ok=wrong == 0 and not sample_bad,
        )
        del want, idx
    ev.emit("sweep_done")
    ev.emit("teardown_start")
    dist.destroy_process_group()
    ev.emit("teardown_done")
    sys.stdout.flush()
    return 0


# ---- the driver --------------------------------------------------------------------

_STOP = {"why": None}


def _on_sigterm(signum, frame):
    _STOP["why"] = f"signal {signal.Signals(signum).name}"


def main(argv, launcher=None, preflight=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.probe:
        return probe(a)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    d = Driver(a, launcher or worker_launcher, preflight or run_preflight, stop=lambda: _STOP["why"])
    try:
        return d.run()
    except Exception as e:
        # Keep what was measured, and say what broke.
        d.error = f"{type(e).__name__}: {e}"
        d.log(f"gpu-check: internal error: {d.error}")
        d.state = "error"
        d.finish(None)
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
