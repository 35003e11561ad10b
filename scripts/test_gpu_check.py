#!/usr/bin/env python3
"""Tests of gpu_check.py without a GPU or torch: arguments and settings, the preflight's
judgement (ELF exports, NCCL's tables, compute mode), NCCL 2.28's log lines, result
checks, the rank watcher with fake ranks (real processes that die, hang, or hang in
teardown), the three-file output, and a summary that survives the driver being killed.

Run: python3 scripts/test_gpu_check.py  (ends with a cargo-style "test result:" line
that scripts/test.sh counts). The same file is the fake rank:
python3 scripts/test_gpu_check.py --fake-rank SPEC WORKER-ARGS..."""

import faulthandler
import glob
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_check as g  # noqa: E402

# NCCL 2.28's messages (src/plugin/net.cc, src/plugin/net/net_v11.cc,
# src/plugin/plugin_open.cc, src/init.cc, src/transport/net.cc, src/misc/utils.cc) in
# its line format "host:pid:tid [dev] NCCL INFO msg" / "[dev] file:line NCCL WARN msg";
# hosts, pids, paths and file:line are made up, the messages are NCCL's and railover's.
SO = "/opt/railover/librailover.so"
PLUGIN_LOG = f"""\
h200:4242:4242 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to {SO}
h200:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin railover (v11)
h200:4242:4242 [0] NCCL INFO Successfully loaded external network plugin {SO}
h200:4242:4242 [0] NCCL INFO railover: fabric TCP (RAILOVER_TRANSPORT=tcp)
h200:4242:4242 [0] NCCL INFO Initialized NET plugin railover
h200:4242:4242 [0] NCCL INFO Assigned NET plugin railover to comm
h200:4242:4242 [0] NCCL INFO cudaDriverVersion 12090
h200:4242:4242 [0] NCCL INFO NCCL version 2.28.9+cuda12.9
h200:4242:4242 [0] NCCL INFO NCCL_HOSTID set by environment to railover-gpu-check-0
h200:4242:4242 [0] NCCL INFO Using network railover
h200:4242:4250 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/railover/0
h200:4242:4250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/railover/0
h200:4242:4250 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/railover/0
"""

SOCKET_LOG = """\
h200:4300:4300 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to none
h200:4300:4300 [0] NCCL INFO NCCL version 2.28.9+cuda12.9
h200:4300:4300 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
h200:4300:4300 [0] NCCL INFO Initialized NET plugin Socket
h200:4300:4300 [0] NCCL INFO Assigned NET plugin Socket to comm
h200:4300:4300 [0] NCCL INFO Using network Socket
h200:4300:4310 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
h200:4300:4310 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

# No table NCCL knows (ncclNetPluginLoad), then no plugin at all (ncclNetInit).
UNSUPPORTED_LOG = f"""\
h200:4242:4242 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to {SO}
h200:4242:4242 [0] NCCL INFO External network plugin {SO} is unsupported
h200:4242:4242 [0] plugin/net.cc:412 NCCL WARN Failed to initialize any NET plugin
"""

# Loaded, but its init or devices() failed: railover found no NIC.
INIT_FAILED_LOG = f"""\
h200:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin railover (v11)
h200:4242:4242 [0] NCCL INFO Successfully loaded external network plugin {SO}
h200:4242:4242 [0] src/plugin/mod.rs:311 NCCL WARN railover: RAILOVER_IFNAME=eth9 matches no usable interface, so railover offers 0 devices; interfaces with an address: lo (127.0.0.1, loopback: only when named)
h200:4242:4242 [0] NCCL INFO Failed to initialize NET plugin railover
h200:4242:4242 [0] plugin/net.cc:412 NCCL WARN Failed to initialize any NET plugin
"""

NOT_FOUND_LOG = f"""\
h200:4242:4242 [0] NCCL INFO NET/Plugin: Could not find: {SO}
h200:4242:4242 [0] plugin/net.cc:412 NCCL WARN Failed to initialize any NET plugin
"""

DLOPEN_LOG = f"""\
h200:4242:4242 [0] NCCL INFO NET/Plugin: {SO}: {SO}: undefined symbol: ibv_reg_dmabuf_mr
"""

DUPLICATE_LOG = """\
h200:4242:4242 [0] init.cc:904 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000
"""

FELL_BACK_LOG = """\
h200:4242:4242 [0] NCCL INFO NCCL version 2.28.9+cuda12.9
h200:4242:4242 [0] NCCL INFO Using network Socket
h200:4242:4250 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""

SHM_LOG = """\
h200:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin railover (v11)
h200:4242:4242 [0] NCCL INFO Using network railover
h200:4242:4250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] via P2P/CUMEM/read
"""

LOGS = {"ok": None, "unsupported": UNSUPPORTED_LOG, "init_failed": INIT_FAILED_LOG, "none": ""}


def quiet_exit(f, *args):
    """Calls f expecting argparse's SystemExit, without its usage text on stderr."""
    with open(os.devnull, "w") as null:
        stderr, sys.stderr = sys.stderr, null
        try:
            f(*args)
        finally:
            sys.stderr = stderr


def extension_module():
    """A CPython extension module (a real ELF shared object) and its PyInit_ symbol."""
    for path in sorted(glob.glob(os.path.join(sysconfig.get_config_var("DESTSHARED") or "", "*.so"))):
        name = os.path.basename(path).split(".")[0]
        if name.startswith("_test"):
            continue
        return path, f"PyInit_{name}"
    return None, None


# ---- the fake rank -----------------------------------------------------------------
# SPEC is comma-separated key=value: items=N|all (results reported), then=hang|exit:N|segv
# (after them, with the next item begun), cut=1 (stop early as the soft deadline does),
# teardown=ok|hang|exit:N, exit=ok|hang (after teardown), wrong=I (item I is wrong),
# log=ok|unsupported|init_failed|none (NCCL lines written), dump=1 (offer SIGUSR1
# for a stack dump), ignore_term=1, busbw=X.


def _act(what):
    if what == "ok":
        return
    if what == "hang":
        while True:
            signal.pause()
    if what.startswith("exit:"):
        os._exit(int(what[5:]))
    if what == "segv":
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    raise ValueError(f"fake rank: unknown action {what!r}")


def fake_rank(argv):
    spec = dict(kv.split("=", 1) for kv in argv[0].split(",") if kv)
    a = g.parse_args(["--worker"] + argv[1:])
    if spec.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ev = g.EventWriter(a.events)
    start = {"pid": os.getpid(), "mode": a.mode, "rank": a.rank}
    if spec.get("dump"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        start["traceback_signal"] = int(signal.SIGUSR1)
    ev.emit("start", **start)
    ev.emit("init_begin")
    log = LOGS[spec.get("log", "ok")]
    if log is None:
        log = PLUGIN_LOG if a.mode == "plugin" else SOCKET_LOG
    with open(os.environ["NCCL_DEBUG_FILE"], "w") as f:
        f.write(log)
    if spec.get("log", "ok") != "ok":
        print(f"fake rank {a.rank}: NCCL failed to initialise", flush=True)
        os._exit(1)
    ev.emit("init", torch="fake", nccl="2.28.9", gpu="none")
    items = g.plan(a)
    n = len(items) if spec.get("items", "all") == "all" else int(spec["items"])
    busbw = float(spec.get("busbw", 1.0 if a.mode == "plugin" else 2.0))
    for i, (kind, size) in enumerate(items[:n]):
        ev.emit("begin", collective=kind, size=size)
        ok = str(i) != spec.get("wrong")
        ev.emit("result", collective=kind, size=size, busbw=busbw, algbw=busbw, time_us=1.0, iters=2,
                elements=size // 4, wrong_elements=0 if ok else 3, sample_errors=[] if ok else ["x"], ok=ok)  # fmt: skip
    if n < len(items):
        if spec.get("cut"):
            ev.emit("cut", reason=f"stopped before {g.item_name(*items[n])}")
        else:
            ev.emit("begin", collective=items[n][0], size=items[n][1])
            _act(spec.get("then", "hang"))
    ev.emit("sweep_done")
    ev.emit("teardown_start")
    _act(spec.get("teardown", "ok"))
    ev.emit("teardown_done")
    _act(spec.get("exit", "ok"))
    return 0


def fake_launcher(specs):
    """A launcher starting fake ranks: specs[mode][rank] (default: finish well)."""

    def launch(a, mode, rank, port, files, soft_deadline):
        spec = specs.get(mode, {}).get(rank, "")
        argv = [sys.executable, os.path.abspath(__file__), "--fake-rank", spec]
        argv += g.worker_args(a, mode, rank, port, files, soft_deadline)
        return argv, g.rank_env(os.environ, rank, mode, a.plugin, files["nccl"])

    return launch


def ok_preflight(a, stop):
    return {"ok": True, "reasons": [], "notes": [], "expected_table": 11,
            "probe": {"torch": "fake", "nccl_version": [2, 28, 9], "gpu": "none"}}  # fmt: skip


def failed_preflight(a, stop):
    return {"ok": False, "reasons": ["the GPU's compute mode is Exclusive_Process: only one process may use it"],
            "notes": [], "expected_table": None, "probe": {}}  # fmt: skip


def never_launch(*args):
    raise AssertionError("no rank may start")


class Tmp(unittest.TestCase):
    """A temporary plugin file, output folder and work folder per test."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="gpu-check-test-")
        self.tmp = self._tmp.name
        self.out = os.path.join(self.tmp, "out")
        self.work = os.path.join(self.tmp, "work")
        os.makedirs(self.work)
        self.so = os.path.join(self.tmp, "librailover.so")
        with open(self.so, "wb") as f:
            f.write(b"\x7fELF-not-really")

    def tearDown(self):
        self._tmp.cleanup()

    def args(self, *extra):
        base = ["--plugin", self.so, "--out", self.out, "--work", self.work, "--max-bytes", "64",
                "--poll", "0.02", "--stop-wait", "0.5", "--min-mode-seconds", "1"]  # fmt: skip
        return base + list(extra)

    def opts(self, *extra):
        return g.parse_args(self.args(*extra))


# ---- arguments and settings ----------------------------------------------------------


class Args(unittest.TestCase):
    def test_sizes_parse_with_binary_suffixes(self):
        self.assertEqual(g.parse_size("8"), 8)
        self.assertEqual(g.parse_size("4K"), 4096)
        self.assertEqual(g.parse_size("256M"), 256 << 20)
        self.assertEqual(g.parse_size("1g"), 1 << 30)
        with self.assertRaises(ValueError):
            g.parse_size("lots")

    def test_sweep_covers_8_bytes_to_256_mib_in_whole_floats_per_rank(self):
        s = g.sizes(8, 256 << 20)
        self.assertEqual((s[0], s[-1], len(s)), (8, 256 << 20, 26))
        self.assertTrue(all(x % (g.WORLD * g.ELEM) == 0 for x in s))
        self.assertEqual(g.sizes(8, 100), [8, 16, 32, 64, 96])
        self.assertEqual(g.sizes(8, 512, 4), [8, 32, 128, 512])

    def test_default_is_short_and_full_is_the_whole_sweep(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as so:
            d = g.parse_args(["--plugin", so.name, "--out", "/tmp/x"])
            f = g.parse_args(["--plugin", so.name, "--out", "/tmp/x", "--full"])
        self.assertEqual((d.max_bytes, d.step, len(g.plan(d))), (32 << 20, 4, 12 * 4))
        self.assertEqual((f.max_bytes, f.step, len(g.plan(f))), (256 << 20, 2, 26 * 4))
        self.assertLess(d.budget, f.budget)
        self.assertEqual(g.plan(d)[:4], [(k, 8) for k in g.COLLECTIVES])

    def test_the_wrapper_bounds_the_driver_within_the_device_limits(self):
        # Default ≤ 4 min, --full ≤ 10 min (one device command), each leaving the driver
        # room past its own budget to stop ranks and write its files.
        with open(os.path.join(HERE, "gpu-check.sh")) as f:
            sh = f.read()
        kill_after = int(re.search(r"--kill-after=(\d+)", sh).group(1))
        default = int(re.search(r"^limit=(\d+)$", sh, re.M).group(1))
        full = int(re.search(r"--full \] && limit=(\d+)", sh).group(1))
        self.assertLessEqual(default + kill_after, 240)
        self.assertLessEqual(full + kill_after, 600)
        self.assertGreaterEqual(default, g.PROFILES["default"]["budget"] + 15)
        self.assertGreaterEqual(full, g.PROFILES["full"]["budget"] + 15)
        self.assertEqual(subprocess.run(["bash", "-n", os.path.join(HERE, "gpu-check.sh")]).returncode, 0)

    def test_plugin_and_out_are_required_and_checked(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as so:
            a = g.parse_args(["--plugin", so.name, "--out", "/tmp/x", "--max-bytes", "1M"])
            self.assertEqual((a.min_bytes, a.max_bytes), (8, 1 << 20))
            self.assertTrue(os.path.isabs(a.plugin))
            for bad in (["--grace", "0"], ["--step", "1"], ["--min-bytes", "4"]):
                with self.assertRaises(SystemExit):
                    quiet_exit(g.parse_args, ["--plugin", so.name, "--out", "/tmp/x"] + bad)
        for bad in (["--out", "/tmp/x"], ["--plugin", "/nonexistent/librailover.so", "--out", "/tmp/x"]):
            with self.assertRaises(SystemExit):
                quiet_exit(g.parse_args, bad)

    def test_rank_env_gives_distinct_hosts_unbuffered_logs_and_forces_the_transport(self):
        base = {"PATH": "/bin", "NCCL_NET": "IB", "RAILOVER_LOG": "trace", "NCCL_NET_PLUGIN": "x",
                "NCCL_DEBUG_FILE": "/tmp/elsewhere", "RAILOVER_METRICS_PORT": "9000"}  # fmt: skip
        e0 = g.rank_env(base, 0, "plugin", "/opt/librailover.so", "/w/plugin-rank0.nccl.log")
        e1 = g.rank_env(base, 1, "plugin", "/opt/librailover.so", "/w/plugin-rank1.nccl.log")
        self.assertNotEqual(e0["NCCL_HOSTID"], e1["NCCL_HOSTID"])
        self.assertNotEqual(e0["NCCL_DEBUG_FILE"], e1["NCCL_DEBUG_FILE"])
        self.assertEqual(e0["NCCL_DEBUG_FILE"], "/w/plugin-rank0.nccl.log")
        self.assertEqual((e0["NCCL_NET"], e0["NCCL_NET_PLUGIN"]), ("railover", "/opt/librailover.so"))
        self.assertEqual(e0["NCCL_DEBUG"], "INFO")
        self.assertEqual(e0["PYTHONUNBUFFERED"], "1")
        self.assertEqual(
            (e0["RAILOVER_TRANSPORT"], e0["RAILOVER_METRICS_PORT"], e0["RAILOVER_IFNAME"]), ("tcp", "off", "lo")
        )
        self.assertNotIn("RAILOVER_LOG", e0)
        self.assertEqual(e0["PATH"], "/bin")
        s = g.rank_env(base, 0, "socket", "/opt/librailover.so", "/w/socket-rank0.nccl.log")
        self.assertEqual((s["NCCL_NET"], s["NCCL_NET_PLUGIN"]), ("Socket", "none"))
        self.assertFalse([k for k in s if k.startswith("RAILOVER_")])

    def test_railover_accepts_the_settings_the_ranks_get(self):
        # The names and values rank_env sets are the ones railover's parsers accept.
        src = os.path.join(HERE, "..", "src")
        if not os.path.isdir(src):
            self.skipTest("railover's src/ is not beside scripts/")
        with open(os.path.join(src, "config", "mod.rs")) as f:
            config = f.read()
        with open(os.path.join(src, "telemetry", "exporter.rs")) as f:
            exporter = f.read()
        self.assertIn('get("RAILOVER_TRANSPORT")', config)
        self.assertRegex(config, r'"tcp" => TransportChoice::Tcp')
        self.assertIn('get("RAILOVER_IFNAME")', config)
        self.assertIn('PORT_VAR: &str = "RAILOVER_METRICS_PORT"', exporter)
        self.assertIn('eq_ignore_ascii_case("off")', exporter)

    def test_ranks_run_line_buffered_when_stdbuf_is_there(self):
        self.assertEqual(g.line_buffered(["py", "x"], which=lambda _: "/usr/bin/stdbuf"),
                         ["/usr/bin/stdbuf", "-oL", "-eL", "py", "x"])  # fmt: skip
        self.assertEqual(g.line_buffered(["py", "x"], which=lambda _: None), ["py", "x"])


# ---- NCCL's log ----------------------------------------------------------------------


class Log(unittest.TestCase):
    def test_plugin_log_shows_railover_loaded_chosen_and_carrying_every_channel(self):
        info = g.parse_nccl_log(PLUGIN_LOG)
        self.assertEqual(info["nccl_version"], "2.28.9+cuda12.9")
        self.assertEqual(info["loaded"], [{"name": "railover", "table": 11}])
        self.assertEqual(info["loaded_from"], [SO])
        self.assertEqual((info["initialized"], info["assigned"]), (["railover"], ["railover"]))
        self.assertEqual(info["using"], ["railover"])
        self.assertEqual(info["channels"], {"railover": 3})
        self.assertEqual(info["fabric"], ["TCP"])
        self.assertEqual(info["failures"], [])
        self.assertEqual(g.check_log(info, "plugin", 11), [])

    def test_a_table_other_than_the_one_nccl_should_take_is_caught(self):
        p = g.check_log(g.parse_nccl_log(PLUGIN_LOG), "plugin", 12)
        self.assertEqual(len(p), 1)
        self.assertIn("ncclNetPlugin_v11, expected v12", p[0])

    def test_an_unsupported_plugin_is_caught(self):
        info = g.parse_nccl_log(UNSUPPORTED_LOG)
        p = g.check_log(info, "plugin", 11)
        self.assertIn(f"NCCL: NCCL found no ncclNetPlugin_vN table it knows in {SO}", p)
        self.assertIn("NCCL: NCCL initialised no NET plugin", p)
        self.assertTrue(any("Loaded net plugin railover" in x for x in p), p)
        self.assertEqual(len(info["warnings"]), 1)

    def test_a_plugin_whose_init_failed_is_caught_with_railovers_reason(self):
        p = g.check_log(g.parse_nccl_log(INIT_FAILED_LOG), "plugin", 11)
        self.assertIn("NCCL: NCCL could not initialise the NET plugin railover", p)
        self.assertIn("NCCL: railover found no NIC: RAILOVER_IFNAME=eth9", p)
        self.assertIn("NCCL: NCCL initialised no NET plugin", p)

    def test_a_missing_or_unloadable_library_is_caught(self):
        p = g.check_log(g.parse_nccl_log(NOT_FOUND_LOG), "plugin", 11)
        self.assertIn(f"NCCL: NCCL could not find the plugin library: {SO}", p)
        p = g.check_log(g.parse_nccl_log(DLOPEN_LOG), "plugin", 11)
        self.assertTrue(any("undefined symbol: ibv_reg_dmabuf_mr" in x for x in p), p)

    def test_ranks_seen_as_one_host_are_caught_in_both_modes(self):
        for mode in g.MODES:
            p = g.check_log(g.parse_nccl_log(DUPLICATE_LOG + SOCKET_LOG), mode)
            self.assertTrue(any("Duplicate" not in x and "as one host" in x for x in p), (mode, p))

    def test_a_fallback_to_socket_is_caught(self):
        p = g.check_log(g.parse_nccl_log(FELL_BACK_LOG), "plugin", 11)
        self.assertTrue(any("Loaded net plugin railover" in x for x in p), p)
        self.assertTrue(any("expected railover" in x for x in p), p)

    def test_channels_that_bypass_the_network_are_caught(self):
        p = g.check_log(g.parse_nccl_log(SHM_LOG), "plugin", 11)
        self.assertTrue(any("did not talk over the network" in x for x in p), p)
        self.assertTrue(any("bypassed the network via ['P2P']" in x for x in p), p)

    def test_verbs_instead_of_tcp_is_caught(self):
        log = PLUGIN_LOG.replace("fabric TCP (RAILOVER_TRANSPORT=tcp)", "fabric verbs (RAILOVER_TRANSPORT=auto): mlx5_0:1")
        p = g.check_log(g.parse_nccl_log(log), "plugin", 11)
        self.assertEqual(p, ["railover chose fabric verbs, expected TCP (RAILOVER_TRANSPORT=tcp)"])

    def test_socket_baseline_log(self):
        info = g.parse_nccl_log(SOCKET_LOG)
        self.assertEqual(g.check_log(info, "socket"), [])
        self.assertNotEqual(g.check_log(info, "plugin"), [])
        # Another plugin's failure is not the Socket run's.
        other = g.parse_nccl_log(SOCKET_LOG + "h:1:1 [0] NCCL INFO Failed to initialize NET plugin IB\n")
        self.assertEqual(g.check_log(other, "socket"), [])
        broken = g.parse_nccl_log("h:1:1 [0] NCCL INFO Failed to initialize NET plugin Socket\n")
        self.assertIn("NCCL: NCCL could not initialise the NET plugin Socket", g.check_log(broken, "socket"))

    def test_an_empty_log_is_not_a_pass(self):
        self.assertGreaterEqual(len(g.check_log(g.parse_nccl_log(""), "plugin", 11)), 3)


# ---- the preflight -----------------------------------------------------------------

GOOD_PROBE = {
    "torch": "2.11.0+cu129", "torch_cuda": "12.9", "cuda_available": True, "device_count": 1, "gpu": "NVIDIA H200",
    "nccl_available": True, "nccl_version": [2, 28, 9], "compute_mode": {"value": 0, "name": "Default"},
    "dlopen": {"ok": True, "found": ["ncclNetPlugin_v8", "ncclNetPlugin_v12"]},
}  # fmt: skip
RAILOVER_EXPORTS = {"tables": [8, 9, 10, 11, 12]}


class Preflight(unittest.TestCase):
    def test_nccl_versions_read_in_every_form(self):
        self.assertEqual(g.version_tuple((2, 28, 9)), (2, 28, 9))
        self.assertEqual(g.version_tuple([2, 30, 3]), (2, 30, 3))
        self.assertEqual(g.version_tuple(22809), (2, 28, 9))
        self.assertEqual(g.version_tuple(2708), (2, 7, 8))
        self.assertEqual(g.version_tuple("2.28.9+cuda12.9"), (2, 28, 9))
        self.assertIsNone(g.version_tuple(None))
        self.assertIsNone(g.version_tuple("unknown"))

    def test_the_table_nccl_takes_from_railover(self):
        self.assertEqual(g.expected_table((2, 28, 9), [8, 9, 10, 11, 12]), 11)
        self.assertEqual(g.expected_table((2, 27, 7), [8, 9, 10, 11, 12]), 10)
        self.assertEqual(g.expected_table((2, 30, 4), [8, 9, 10, 11, 12]), 12)
        self.assertEqual(g.expected_table((2, 21, 5), [8, 9, 10, 11, 12]), 8)
        self.assertIsNone(g.expected_table((2, 28, 9), [12]))
        self.assertIsNone(g.expected_table((2, 19, 3), [8, 12]))
        self.assertEqual(g.nccl_tables((2, 28, 9)), ((11, 10, 9, 8, 7, 6), True))
        tables, known = g.nccl_tables((2, 32, 1))
        self.assertEqual((tables[0], known), (12, False))
        self.assertEqual(g.nccl_tables((2, 17, 1))[0], ())

    def test_a_good_machine_passes_and_names_the_table(self):
        v = g.judge_preflight(GOOD_PROBE, RAILOVER_EXPORTS)
        self.assertEqual((v["ok"], v["reasons"], v["expected_table"]), (True, [], 11))

    def test_exclusive_or_prohibited_compute_mode_fails_with_the_reason(self):
        for value, words in ((3, "Exclusive_Process"), (1, "Exclusive_Thread"), (2, "Prohibited")):
            v = g.judge_preflight({**GOOD_PROBE, "compute_mode": {"value": value, "name": g.COMPUTE_MODES[value]}},
                                  RAILOVER_EXPORTS)  # fmt: skip
            self.assertFalse(v["ok"])
            self.assertIn(words, v["reasons"][0])
        v = g.judge_preflight({**GOOD_PROBE, "compute_mode": {"value": 3}}, RAILOVER_EXPORTS)
        self.assertIn("rank 1 would fail and rank 0 hang", v["reasons"][0])

    def test_an_unreadable_compute_mode_is_a_note_not_a_failure(self):
        v = g.judge_preflight({**GOOD_PROBE, "compute_mode": {"error": "libcuda: not found"}}, RAILOVER_EXPORTS)
        self.assertTrue(v["ok"])
        self.assertIn("libcuda: not found", v["notes"][0])

    def test_no_torch_no_gpu_no_nccl_each_fail(self):
        cases = (
            ({"torch_error": "ModuleNotFoundError: No module named 'torch'"}, "cannot import torch"),
            ({**GOOD_PROBE, "cuda_available": False, "device_count": 0}, "sees no GPU"),
            ({**GOOD_PROBE, "nccl_available": False}, "has no NCCL backend"),
            ({**GOOD_PROBE, "nccl_version": None, "nccl_error": "RuntimeError: no NCCL"}, "no NCCL"),
            ({**GOOD_PROBE, "dlopen": {"ok": False, "error": "libfoo.so: cannot open"}}, "libfoo.so: cannot open"),
            ({"error": "the probe did not finish in 60 s"}, "did not finish"),
        )
        for probe, words in cases:
            v = g.judge_preflight(probe, RAILOVER_EXPORTS)
            self.assertFalse(v["ok"], probe)
            self.assertTrue(any(words in r for r in v["reasons"]), (words, v["reasons"]))

    def test_tables_nccl_does_not_know_fail_as_nccl_would_say(self):
        v = g.judge_preflight(GOOD_PROBE, {"tables": [12]})
        self.assertFalse(v["ok"])
        self.assertIn("NCCL 2.28.9 looks for ncclNetPlugin_v11/v10/v9/v8/v7/v6", v["reasons"][0])
        self.assertIn("is unsupported", v["reasons"][0])
        v = g.judge_preflight(GOOD_PROBE, {"tables": []})
        self.assertIn("exports no ncclNetPlugin_vN table", v["reasons"][0])
        v = g.judge_preflight(GOOD_PROBE, {"tables": [], "error": "x is not an ELF file"})
        self.assertEqual(v["reasons"], ["the plugin's symbols could not be read: x is not an ELF file"])
        v = g.judge_preflight({**GOOD_PROBE, "nccl_version": [2, 31, 0]}, RAILOVER_EXPORTS)
        self.assertEqual((v["ok"], v["expected_table"]), (True, 12))
        self.assertIn("newer than the releases this check knows", v["notes"][0])

    def test_elf_exports_of_a_real_shared_object(self):
        path, sym = extension_module()
        if not path:
            self.skipTest("no CPython extension module to read")
        names = g.elf_exports(path)
        self.assertIn(sym, names)
        self.assertNotIn("PyModule_Create2", names)  # used, not defined, by the module
        self.assertEqual(g.net_tables(names), [])
        self.assertEqual(g.net_tables(["ncclNetPlugin_v8", "ncclNetPlugin_v12", "ncclNetPlugin_vX",
                                       "ncclCollNetPlugin_v9"]), [8, 12])  # fmt: skip
        d = g.dlopen_check(path, [sym, "ncclNetPlugin_v11"])
        self.assertEqual(d, {"ok": True, "found": [sym]})

    def test_elf_exports_refuse_what_is_not_a_shared_object(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            f.write(b"#!/bin/sh\n")
            f.flush()
            with self.assertRaisesRegex(ValueError, "not an ELF file"):
                g.elf_exports(f.name)
            d = g.dlopen_check(f.name)
            self.assertFalse(d["ok"])
            self.assertTrue(d["error"])
        with self.assertRaises(OSError):
            g.elf_exports("/nonexistent/librailover.so")

    def test_compute_mode_from_nvidia_smi(self):
        text = "0, GPU-aaaa-1111, Default\n1, GPU-bbbb-2222, Exclusive_Process\n"
        self.assertEqual(g.compute_mode_from_smi(text), 0)
        self.assertEqual(g.compute_mode_from_smi(text, "1"), 3)
        self.assertEqual(g.compute_mode_from_smi(text, "GPU-bbbb"), 3)
        self.assertEqual(g.compute_mode_from_smi("0, GPU-a, Prohibited\n"), 2)
        self.assertIsNone(g.compute_mode_from_smi("No devices were found\n"))

    def test_the_real_preflight_fails_fast_here_with_reasons(self):
        # This machine's probe, for real: a library with no NCCL tables fails whatever
        # torch and CUDA say, and the verdict comes within the limit.
        path, _ = extension_module()
        if not path:
            self.skipTest("no CPython extension module to use as a library")
        a = g.parse_args(["--plugin", path, "--out", "/tmp/unused", "--preflight-limit", "60"])
        t0 = time.monotonic()
        v = g.run_preflight(a)
        self.assertLess(time.monotonic() - t0, 60)
        self.assertFalse(v["ok"])
        self.assertIn("exports no ncclNetPlugin_vN table", " ".join(v["reasons"]))
        self.assertTrue(v["probe"].get("dlopen", {}).get("ok"), v["probe"])
        self.assertIn("compute_mode", v["probe"])

    def test_a_probe_past_its_limit_is_cut_and_said_so(self):
        path, _ = extension_module()
        if not path:
            self.skipTest("no CPython extension module to use as a library")
        a = g.parse_args(["--plugin", path, "--out", "/tmp/unused", "--preflight-limit", "0.001"])
        v = g.run_preflight(a)
        self.assertFalse(v["ok"])
        self.assertTrue(any("did not finish in" in r for r in v["reasons"]), v["reasons"])


# ---- events ------------------------------------------------------------------------


class Events(unittest.TestCase):
    def test_lines_are_read_as_they_are_completed(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.jsonl")
            r = g.EventReader(path)
            self.assertEqual(r.read_new(), [])  # not there yet
            w = g.EventWriter(path)
            w.emit("start", pid=1)
            w.emit("begin", collective="all_reduce", size=8)
            self.assertEqual([e["ev"] for e in r.read_new()], ["start", "begin"])
            with open(path, "a") as f:
                f.write('{"ev": "result", "size"')
                f.flush()
                self.assertEqual(r.read_new(), [])  # half a line waits
                f.write(': 8}\nnot json\n')
            w.close()
            got = r.read_new()
            self.assertEqual((got[0]["ev"], got[0]["size"], got[1]["ev"]), ("result", 8, "garbled"))


# ---- results and figures -------------------------------------------------------------


class Results(unittest.TestCase):
    def fake(self, kind, rank, n, corrupt=None):
        length = g.output_len(kind, g.WORLD, n)
        vals = [g.expected(kind, rank, g.WORLD, n, i) for i in range(length)]
        if corrupt is not None:
            vals[corrupt] += 1
        return [(i, vals[i]) for i in g.sample_indices(length)]

    def test_correct_outputs_pass_for_every_collective_and_rank(self):
        for kind in g.COLLECTIVES:
            for rank in range(g.WORLD):
                self.assertEqual(g.check_samples(kind, rank, g.WORLD, 1000, self.fake(kind, rank, 1000)), [])

    def test_expected_values_follow_the_collective(self):
        # all_reduce: both ranks' patterns summed.
        self.assertEqual(g.expected("all_reduce", 0, 2, 4, 3), g.pattern(0, 3) + g.pattern(1, 3))
        # all_gather: rank 1's block follows rank 0's.
        self.assertEqual(g.expected("all_gather", 0, 2, 4, 5), g.pattern(1, 1))
        # reduce_scatter: rank 1 owns the second half of the summed input.
        self.assertEqual(g.expected("reduce_scatter", 1, 2, 4, 0), g.pattern(0, 4) + g.pattern(1, 4))
        # sendrecv: each rank receives its peer's pattern.
        self.assertEqual(g.expected("sendrecv", 0, 2, 4, 2), g.pattern(1, 2))

    def test_a_wrong_element_or_a_swapped_block_is_reported(self):
        bad = g.check_samples("all_reduce", 0, 2, 1000, self.fake("all_reduce", 0, 1000, corrupt=0))
        self.assertEqual(len(bad), 1)
        self.assertIn("element 0", bad[0])
        n = 64
        swapped = [(i, g.pattern(1 - i // n, i % n)) for i in g.sample_indices(2 * n)]
        self.assertTrue(g.check_samples("all_gather", 0, 2, n, swapped))

    def test_bus_bandwidth_factors_match_nccl_tests(self):
        self.assertEqual(g.bandwidths("all_reduce", 1e9, 1.0, 2), (1.0, 1.0))
        self.assertEqual(g.bandwidths("all_gather", 1e9, 1.0, 2), (1.0, 0.5))
        self.assertEqual(g.bandwidths("sendrecv", 2e9, 1.0, 2), (2.0, 2.0))
        self.assertAlmostEqual(g.bus_factor("all_reduce", 8), 1.75)


class Summary(unittest.TestCase):
    def res(self, kind, size, busbw, ok=True):
        return {"collective": kind, "size": size, "busbw": busbw, "ok": ok}

    def test_rows_pair_the_transports_and_take_the_ratio(self):
        rows = g.summarize(
            [self.res("all_reduce", 8, 0.5), self.res("sendrecv", 1 << 20, 2.0)],
            [self.res("all_reduce", 8, 1.0), self.res("all_gather", 64, 3.0)],
        )
        self.assertEqual([(r["collective"], r["ratio"]) for r in rows],
                         [("all_reduce", 0.5), ("sendrecv", None), ("all_gather", None)])  # fmt: skip
        self.assertIsNone(rows[1]["socket_busbw"])
        self.assertIsNone(rows[2]["railover_busbw"])
        text = g.table(rows)
        self.assertIn("1 MiB", text)
        self.assertIn("0.50", text)

    def test_verdict(self):
        good = {"problems": [], "results": [self.res("all_reduce", 8, 1.0)], "not_run": [], "teardown": []}
        wrong = {**good, "results": [self.res("all_reduce", 8, 1.0, ok=False)]}
        unused = {**good, "problems": ["NCCL used ['Socket'], expected railover"]}
        hung = {**good, "teardown": ["rank 0 hung in teardown"]}
        short = {**good, "not_run": [{"collective": "all_reduce", "size": 16, "reason": "cut"}]}
        self.assertEqual(g.verdict({"plugin": good, "socket": good}), g.PASSED)
        self.assertEqual(g.verdict({"plugin": wrong, "socket": good}), g.RAILOVER_FAILED)
        self.assertEqual(g.verdict({"plugin": unused, "socket": good}), g.RAILOVER_FAILED)
        self.assertEqual(g.verdict({"plugin": hung, "socket": good}), g.TEARDOWN)
        self.assertEqual(g.verdict({"plugin": {**hung, "problems": ["x"]}, "socket": good}), g.RAILOVER_FAILED)
        self.assertEqual(g.verdict({"plugin": short, "socket": good}), g.INCOMPLETE)
        self.assertEqual(g.verdict({"plugin": good, "socket": wrong}), g.SOCKET_FAILED)
        self.assertEqual(g.verdict({"plugin": good, "socket": short}), g.SOCKET_FAILED)
        self.assertEqual(g.verdict({"plugin": good, "socket": hung}), g.PASSED)


# ---- watching fake ranks -------------------------------------------------------------


class Watch(Tmp):
    """One transport with two fake ranks: real processes that finish, die or hang."""

    def mode(self, specs, *extra, mode="plugin", limit=60.0):
        a = self.opts(*extra)
        t0 = time.monotonic()
        run = g.ModeRun(a, mode, self.work, fake_launcher({mode: specs}), limit, log=lambda *a, **k: None)
        run.watch()
        self.elapsed = time.monotonic() - t0
        return g.mode_record(run, g.plan(a), 11 if mode == "plugin" else None, final=True)

    def outcome(self, rec, rank):
        return rec["ranks"][rank]

    def test_two_ranks_that_finish(self):
        rec = self.mode({})
        self.assertEqual([o["outcome"] for o in rec["ranks"]], ["ok", "ok"])
        self.assertEqual([o["stopped_by"] for o in rec["ranks"]], [None, None])
        self.assertEqual((rec["problems"], rec["teardown"], rec["not_run"]), ([], [], []))
        self.assertEqual(rec["measured"], rec["items"])
        self.assertTrue(all(r["ok"] and r["checked_by"] == [0, 1] for r in rec["results"]))

    def test_a_rank_that_dies_gets_its_peer_stopped_after_the_grace(self):
        grace = 0.5
        rec = self.mode({1: "items=2,then=exit:3", 0: "items=2,then=hang"}, "--grace", str(grace))
        dead, stuck = self.outcome(rec, 1), self.outcome(rec, 0)
        self.assertEqual((dead["outcome"], dead["exit"]), ("failed", "status 3"))
        third = g.item_name(*g.plan(self.opts())[2])
        self.assertIn(f"during {third} (in progress)", dead["detail"])
        self.assertEqual((stuck["outcome"], stuck["stopped_by"]), ("stopped", "grace"))
        waited = float(re.search(r"stopped ([\d.]+) s after rank 1 ended", stuck["detail"]).group(1))
        self.assertGreaterEqual(waited, grace)
        self.assertLess(self.elapsed, 30)  # the grace acted, not the 60 s limit
        self.assertEqual(rec["measured"], 2)
        self.assertEqual(len(rec["not_run"]), rec["items"] - 2)
        self.assertTrue(rec["not_run"][0]["reason"].startswith("in progress when it ended: rank 1 ended with status 3"))
        self.assertIn("grace", rec["not_run"][-1]["reason"])
        self.assertEqual(len(rec["problems"]) - len(g.check_log(rec["log"], "plugin", 11)), 2)

    def test_a_rank_killed_by_a_signal_is_named_so(self):
        rec = self.mode({1: "items=1,then=segv", 0: "items=1,then=hang"}, "--grace", "0.2")
        self.assertEqual(self.outcome(rec, 1)["exit"], "signal SIGSEGV")
        self.assertEqual(self.outcome(rec, 0)["outcome"], "stopped")

    def test_a_teardown_hang_is_reported_as_such_and_the_results_stand(self):
        rec = self.mode({0: "teardown=hang,dump=1"}, "--teardown-limit", "0.5", "--grace", "30")
        hung = self.outcome(rec, 0)
        self.assertEqual((hung["outcome"], hung["stopped_by"], hung["phase"]), ("teardown_hang", "teardown", "teardown"))
        self.assertEqual(self.outcome(rec, 1)["outcome"], "ok")
        self.assertEqual(rec["problems"], [])
        self.assertEqual(len(rec["teardown"]), 1)
        self.assertIn("hung in teardown (destroy_process_group)", rec["teardown"][0])
        self.assertEqual((rec["measured"], rec["not_run"]), (rec["items"], []))
        self.assertLess(self.elapsed, 20)
        # Its Python stack was dumped into its log before it was stopped.
        with open(g.rank_files(self.work, "plugin", 0)["out"]) as f:
            self.assertIn("most recent call first", f.read())
        ok = {"problems": [], "results": rec["results"], "not_run": [], "teardown": []}
        self.assertEqual(g.verdict({"plugin": rec, "socket": ok}), g.TEARDOWN)

    def test_a_hang_at_exit_after_teardown_is_a_teardown_hang(self):
        rec = self.mode({1: "exit=hang"}, "--teardown-limit", "0.3", "--grace", "30")
        o = self.outcome(rec, 1)
        self.assertEqual((o["outcome"], o["phase"]), ("teardown_hang", "exit"))
        self.assertEqual(rec["problems"], [])

    def test_a_crash_in_teardown_keeps_the_results(self):
        rec = self.mode({0: "teardown=exit:9"})
        o = self.outcome(rec, 0)
        self.assertEqual((o["outcome"], o["exit"]), ("teardown_failed", "status 9"))
        self.assertEqual((rec["problems"], rec["measured"]), ([], rec["items"]))

    def test_ranks_stuck_in_the_sweep_are_stopped_at_the_time_limit(self):
        rec = self.mode({0: "items=1,then=hang", 1: "items=1,then=hang"}, "--grace", "30", limit=1.0)
        self.assertEqual([o["stopped_by"] for o in rec["ranks"]], ["deadline", "deadline"])
        self.assertTrue(all("time limit of 1 s" in o["detail"] for o in rec["ranks"]))
        self.assertEqual(rec["measured"], 1)
        self.assertLess(self.elapsed, 20)

    def test_a_rank_that_ignores_sigterm_is_killed(self):
        rec = self.mode({0: "items=1,then=hang,ignore_term=1", 1: "items=1,then=exit:1"}, "--grace", "0.2",
                        "--stop-wait", "0.3")  # fmt: skip
        self.assertEqual(self.outcome(rec, 0)["exit"], "signal SIGKILL")

    def test_a_sweep_cut_for_time_lists_what_did_not_run(self):
        rec = self.mode({0: "items=3,cut=1", 1: "items=3,cut=1"})
        self.assertEqual([o["outcome"] for o in rec["ranks"]], ["ok", "ok"])
        self.assertEqual(rec["problems"], [])
        self.assertEqual(len(rec["not_run"]), rec["items"] - 3)
        self.assertTrue(all("cut to stay within" in x["reason"] for x in rec["not_run"]))
        self.assertEqual(g.verdict({"plugin": rec}), g.INCOMPLETE)

    def test_a_wrong_result_on_one_rank_fails_the_item(self):
        rec = self.mode({1: "wrong=0"})
        self.assertFalse(rec["results"][0]["ok"])
        self.assertTrue(rec["results"][1]["ok"])
        self.assertEqual(rec["problems"][0], f"{g.item_name(*g.plan(self.opts())[0])}: 3 element(s) wrong ['x']")

    def test_nccl_failing_at_init_is_explained_from_its_log(self):
        rec = self.mode({0: "log=unsupported", 1: "log=unsupported"}, "--grace", "5")
        self.assertEqual([o["outcome"] for o in rec["ranks"]], ["failed", "failed"])
        self.assertTrue(all("during init_process_group" in o["detail"] for o in rec["ranks"]))
        self.assertIn(f"NCCL: NCCL found no ncclNetPlugin_vN table it knows in {SO}", rec["problems"])
        self.assertEqual(rec["measured"], 0)


# ---- the real worker, on a stand-in for torch ----------------------------------------

FAKE_TORCH = os.path.join(HERE, "fake_torch")


def fake_torch_launcher(**env):
    """The real launcher and worker, with scripts/fake_torch first on the path."""

    def launch(*args):
        argv, e = g.worker_launcher(*args)
        e["PYTHONPATH"] = os.pathsep.join([FAKE_TORCH] + [p for p in [e.get("PYTHONPATH")] if p])
        e.update(env)
        return argv, e

    return launch


def built_plugin():
    for kind in ("release", "debug"):
        path = os.path.join(HERE, "..", "target", kind, "librailover.so")
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


class RealWorker(Tmp):
    def test_the_worker_runs_the_sweep_and_the_driver_passes_it(self):
        a = self.opts("--step", "2", "--grace", "10", "--teardown-limit", "10")
        d = g.Driver(a, fake_torch_launcher(), ok_preflight, echo=lambda *a, **k: None)
        status = d.run()
        s = read_summary(self.out)
        self.assertEqual(status, g.PASSED, json.dumps(s["modes"]["plugin"]["problems"] + s["modes"]["socket"]["problems"]))
        self.assertEqual(len(s["rows"]), len(g.plan(a)))
        for r in s["rows"]:
            self.assertTrue(r["railover_ok"] and r["socket_ok"], r)
            self.assertGreater(r["railover_busbw"], 0)
        ranks = s["modes"]["plugin"]["ranks"]
        self.assertEqual([(o["outcome"], o.get("nccl")) for o in ranks], [("ok", "2.28.9"), ("ok", "2.28.9")])
        self.assertEqual(sorted(os.listdir(self.out)), sorted(g.OUT_FILES))

    def test_the_worker_catches_a_wrong_element_in_each_collective(self):
        for kind in g.COLLECTIVES:
            with self.subTest(kind):
                a = self.opts("--max-bytes", "32", "--step", "4", "--grace", "10")
                run = g.ModeRun(a, "plugin", self.work, fake_torch_launcher(FAKE_TORCH_CORRUPT=kind), 60,
                                log=lambda *a, **k: None)  # fmt: skip
                run.watch()
                rec = g.mode_record(run, g.plan(a), 11, final=True)
                self.assertEqual([o["outcome"] for o in rec["ranks"]], ["ok", "ok"])
                bad = {r["collective"] for r in rec["results"] if r["ok"] is False}
                self.assertEqual(bad, {kind})
                self.assertTrue(all(r["wrong_elements"] >= 1 for r in rec["results"] if r["collective"] == kind))

    def test_the_real_preflight_passes_with_torch_and_the_built_plugin(self):
        so = built_plugin()
        if not so:
            self.skipTest("no target/{release,debug}/librailover.so built")
        a = g.parse_args(["--plugin", so, "--out", self.out])
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([FAKE_TORCH] + ([old] if old else []))
        try:
            v = g.run_preflight(a)
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        self.assertEqual((v["ok"], v["expected_table"]), (True, 11), v["reasons"])
        self.assertIn(11, v["exports"]["tables"])
        self.assertEqual(v["probe"]["nccl_version"], [2, 28, 9])
        self.assertIn("ncclNetPlugin_v11", v["probe"]["dlopen"]["found"])


# ---- the whole run: files, preflight, crash, SIGTERM ---------------------------------


def driver_process(argv, specs):
    """The driver in its own process, with fake ranks, as gpu-check.sh would run it."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_check as g, test_gpu_check as t; "
        "sys.exit(g.main(json.loads(sys.argv[2]), launcher=t.fake_launcher("
        "{m: {int(r): s for r, s in v.items()} for m, v in json.loads(sys.argv[3]).items()}), "
        "preflight=t.ok_preflight))"
    )
    return subprocess.Popen([sys.executable, "-c", code, HERE, json.dumps(argv), json.dumps(specs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def wait_for(cond, limit=30.0):
    """Polls `cond` until it holds; fails after `limit` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"condition not met in {limit} s")


def read_summary(out):
    try:
        with open(os.path.join(out, g.SUMMARY)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def ranks_reported(out):
    """How many results each plugin rank had reported, by the summary in `out`."""
    s = read_summary(out) or {}
    return [r["results"] for r in s.get("modes", {}).get("plugin", {}).get("ranks", [])]


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


class Outputs(Tmp):
    def test_a_whole_run_writes_exactly_three_files(self):
        d = g.Driver(self.opts(), fake_launcher({}), ok_preflight, echo=lambda *a, **k: None)
        self.assertEqual(d.run(), g.PASSED)
        self.assertEqual(sorted(os.listdir(self.out)), sorted(g.OUT_FILES))
        s = read_summary(self.out)
        self.assertEqual((s["state"], s["status"], s["passed"], s["not_run"]), ("done", 0, True, []))
        self.assertEqual(len(s["rows"]), len(g.plan(self.opts())))
        self.assertTrue(all(r["ratio"] == 0.5 for r in s["rows"]))  # fake busbw 1.0 against 2.0
        with tarfile.open(os.path.join(self.out, g.ARCHIVE)) as t:
            names = {os.path.basename(n) for n in t.getnames()}
        for m in g.MODES:
            for r in range(g.WORLD):
                self.assertLessEqual({f"{m}-rank{r}.jsonl", f"{m}-rank{r}.nccl.log", f"{m}-rank{r}.out"}, names)
        self.assertLessEqual({"driver.log", "preflight.json", "summary.json"}, names)
        with open(os.path.join(self.out, g.LOG_TAIL)) as f:
            self.assertIn("NET/Plugin: Loaded net plugin railover (v11)", f.read())
        self.assertEqual(os.listdir(os.path.join(self.work, ".scratch")), [])

    def test_a_failed_preflight_starts_no_rank_and_says_why(self):
        t0 = time.monotonic()
        d = g.Driver(self.opts(), never_launch, failed_preflight, echo=lambda *a, **k: None)
        self.assertEqual(d.run(), g.PREFLIGHT_FAILED)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertEqual(sorted(os.listdir(self.out)), sorted(g.OUT_FILES))
        s = read_summary(self.out)
        self.assertEqual(s["state"], "preflight_failed")
        self.assertEqual(s["not_run_count"], 2 * len(g.plan(self.opts())))
        self.assertTrue(all("Exclusive_Process" in x["reason"] for x in s["not_run"]))

    def test_a_transport_without_time_left_is_not_started_and_said_so(self):
        d = g.Driver(self.opts("--budget", "5", "--min-mode-seconds", "45"), never_launch, ok_preflight,
                     echo=lambda *a, **k: None)  # fmt: skip
        self.assertEqual(d.run(), g.INCOMPLETE)
        s = read_summary(self.out)
        self.assertTrue(all("below the 45 s a transport needs" in x["reason"] for x in s["not_run"]))

    def test_the_summary_survives_the_driver_being_killed_mid_sweep(self):
        specs = {"plugin": {"0": "items=3,then=hang", "1": "items=3,then=hang"}}
        p = driver_process(self.args("--grace", "60", "--mode-limit", "60", "--budget", "120"), specs)
        try:
            wait_for(lambda: ranks_reported(self.out) == [3, 3])
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
        s = read_summary(self.out)
        self.assertEqual(s["state"], "running")
        self.assertEqual(len(s["rows"]), 3)
        self.assertTrue(all(r["railover_ok"] for r in s["rows"]))
        plugin = [x for x in s["not_run"] if x["mode"] == "plugin"]
        self.assertEqual(len(plugin), len(g.plan(self.opts())) - 3)
        self.assertTrue(all(x["reason"].startswith("pending") for x in s["not_run"]))
        self.assertLessEqual(set(os.listdir(self.out)), set(g.OUT_FILES))
        # The ranks die with the driver.
        pids = []
        for r in range(g.WORLD):
            with open(g.rank_files(self.work, "plugin", r)["events"]) as f:
                pids.append(json.loads(f.readline())["pid"])
        wait_for(lambda: all(gone(pid) for pid in pids), 10)

    def test_sigterm_stops_the_ranks_and_writes_all_three_files(self):
        specs = {"plugin": {"0": "items=2,then=hang,dump=1", "1": "items=2,then=hang,dump=1"}}
        p = driver_process(self.args("--grace", "60", "--mode-limit", "60", "--budget", "120"), specs)
        try:
            wait_for(lambda: ranks_reported(self.out) == [2, 2])
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, g.INTERRUPTED, out.decode(errors="replace"))
        self.assertEqual(sorted(os.listdir(self.out)), sorted(g.OUT_FILES))
        s = read_summary(self.out)
        self.assertEqual((s["state"], s["status"]), ("interrupted", g.INTERRUPTED))
        self.assertEqual(len(s["rows"]), 2)
        ranks = s["modes"]["plugin"]["ranks"]
        self.assertEqual([o["stopped_by"] for o in ranks], ["interrupted", "interrupted"])
        by_mode = {m: [x["reason"] for x in s["not_run"] if x["mode"] == m] for m in g.MODES}
        self.assertTrue(all("interrupted (signal SIGTERM)" in r for r in by_mode["plugin"]), by_mode["plugin"][:2])
        self.assertTrue(all(r.startswith("not run: the run was interrupted") for r in by_mode["socket"]))
        with tarfile.open(os.path.join(self.out, g.ARCHIVE)) as t:
            text = t.extractfile("gpu-check/plugin-rank0.out").read().decode()
        self.assertIn("most recent call first", text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--fake-rank":
        sys.exit(fake_rank(sys.argv[2:]))
    r = unittest.main(exit=False, verbosity=2).result
    failed = len(r.failures) + len(r.errors) + len(r.unexpectedSuccesses)
    skipped = len(r.skipped)
    passed = r.testsRun - failed - skipped
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; {skipped} ignored")
    sys.exit(1 if failed else 0)
