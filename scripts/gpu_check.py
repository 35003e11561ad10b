#!/usr/bin/env python3
"""GPU validation of a railover build with PyTorch's NCCL backend.

Two ranks share one GPU; each gets its own NCCL_HOSTID, so NCCL takes them for two
hosts and must move every byte between them through the network plugin (P2P and SHM are
ruled out between different host hashes, so NCCL_P2P_DISABLE/NCCL_SHM_DISABLE are not
needed; see shared/reference/nccl-net-abi.md section 6). The sweep runs all_reduce,
all_gather, reduce_scatter and send/recv at 8 B ... 256 MiB, checks every result, then
runs again with NCCL's built-in Socket transport and prints both bus bandwidths side by
side. NCCL's own log must show that railover was loaded and carried the channels.

    gpu_check.py --plugin /path/librailover.so --out DIR [--min-bytes 8] [--max-bytes 256M]

The functions above `main` need no torch and are tested by scripts/test_gpu_check.py.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

PLUGIN_NAME = "railover"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
WORLD = 2
# Values stay small integers, exact in float32 after summing two ranks.
PERIOD = 251
RANK_STEP = 1000
ELEM = 4  # float32


# ---- arguments ---------------------------------------------------------------------


def parse_size(s):
    """'8', '4K', '256M', '1G' -> bytes (binary multiples)."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", s.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"size {s!r} is not valid: expected a number with an optional K, M or G suffix")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--plugin", help="railover .so built beforehand (cargo build --release)")
    p.add_argument("--out", help="folder for the JSON summary and logs")
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--mode-timeout", type=float, default=200.0, help="seconds per transport")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("plugin", "socket"), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        a.min_bytes = parse_size(a.min_bytes)
        a.max_bytes = parse_size(a.max_bytes)
    except ValueError as e:
        p.error(str(e))
    if a.min_bytes < WORLD * ELEM:
        p.error(f"--min-bytes {a.min_bytes} is too small: expected at least {WORLD * ELEM} (one float per rank)")
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes {a.min_bytes} is above --max-bytes {a.max_bytes}")
    if a.worker:
        return a
    if not a.plugin or not a.out:
        p.error("--plugin PATH and --out DIR are required")
    a.plugin = os.path.abspath(a.plugin)
    if not os.path.isfile(a.plugin):
        p.error(f"--plugin {a.plugin!r} is not a file: expected the built librailover.so")
    return a


def sizes(lo, hi):
    """Doubling sizes from lo to hi, each a whole number of floats per rank."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= 2
    out.append(hi)
    step = WORLD * ELEM
    return sorted({max(step, x - x % step) for x in out})


def rank_env(base, rank, mode, plugin):
    """The environment of one rank: the caller's, without NCCL_NET*/RAILOVER_*."""
    env = {k: v for k, v in base.items() if not (k.startswith("NCCL_NET") or k.startswith("RAILOVER_"))}
    env.update(
        {
            "NCCL_HOSTID": f"railover-gpu-check-{rank}",  # two "hosts" on one machine
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
            "NCCL_SOCKET_IFNAME": "lo",  # bootstrap on loopback only
            "NCCL_MNNVL_ENABLE": "0",
            # Two ranks time-share one GPU: few CTAs each, as NCCL advises for that.
            "NCCL_MIN_CTAS": "1",
            "NCCL_MAX_CTAS": "2",
        }
    )
    if mode == "plugin":
        env.update(
            {
                "NCCL_NET": PLUGIN_NAME,
                "NCCL_NET_PLUGIN": plugin,
                "RAILOVER_IFNAME": "lo",
                "RAILOVER_METRICS_PORT": "off",
            }
        )
    else:
        env.update({"NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none"})
    return env


# ---- NCCL's log --------------------------------------------------------------------

_VERSION = re.compile(r"NCCL version (\S+)")
_LOADED = re.compile(r"NET/Plugin: Loaded net plugin (\S+) \(v(\d+)\)")
_USING = re.compile(r"Using network (\S+)")
_VIA = re.compile(r"\[(?:send|receive)\] via NET/([^/\s]+)/")
_FAILED = re.compile(r"Failed to initialize NET plugin (\S+)|Could not find: .*|NET/Plugin: .*unsupported.*")


def parse_nccl_log(text):
    """What NCCL said about its network: version, plugin loaded, network used, channels."""
    info = {"nccl_version": None, "loaded": [], "using": [], "channels": {}, "warnings": [], "failures": []}
    for line in text.splitlines():
        if m := _VERSION.search(line):
            info["nccl_version"] = info["nccl_version"] or m.group(1)
        if m := _LOADED.search(line):
            info["loaded"].append({"name": m.group(1), "table": int(m.group(2))})
        if m := _USING.search(line):
            info["using"].append(m.group(1))
        if m := _VIA.search(line):
            info["channels"][m.group(1)] = info["channels"].get(m.group(1), 0) + 1
        if " NCCL WARN " in line:
            info["warnings"].append(line.strip())
        if m := _FAILED.search(line):
            info["failures"].append(m.group(0))
    return info


def check_log(info, mode):
    """Problems with what the log shows (empty: the expected network carried the traffic)."""
    want = PLUGIN_NAME if mode == "plugin" else "Socket"
    problems = []
    if mode == "plugin":
        names = [x["name"].lower() for x in info["loaded"]]
        if PLUGIN_NAME not in names:
            problems.append("NCCL never logged 'NET/Plugin: Loaded net plugin railover'")
        for x in info["loaded"]:
            if x["name"].lower() == PLUGIN_NAME and x["table"] not in (8, 9, 10, 11, 12):
                problems.append(f"railover loaded through an unexpected table v{x['table']}")
    if not info["using"]:
        problems.append("NCCL never logged 'Using network ...'")
    elif any(u.lower() != want.lower() for u in info["using"]):
        problems.append(f"NCCL used {sorted(set(info['using']))}, expected {want}")
    if not info["channels"]:
        problems.append("no channel went 'via NET/...': the ranks did not talk over the network")
    elif set(k.lower() for k in info["channels"]) != {want.lower()}:
        problems.append(f"channels went via {sorted(info['channels'])}, expected only NET/{want}")
    problems += [f"NCCL: {f}" for f in info["failures"] if mode == "plugin" and PLUGIN_NAME in f.lower()]
    return problems


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
    """Rows pairing the two transports' results by (collective, size)."""
    by = {(r["collective"], r["size"]): r for r in socket_}
    rows = []
    for r in plugin:
        s = by.get((r["collective"], r["size"]))
        rows.append(
            {
                "collective": r["collective"],
                "size": r["size"],
                "railover_busbw": r["busbw"],
                "socket_busbw": s["busbw"] if s else None,
                "ratio": (r["busbw"] / s["busbw"]) if s and s["busbw"] else None,
                "railover_ok": r["ok"],
                "socket_ok": s["ok"] if s else None,
            }
        )
    return rows


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def table(rows):
    out = [f"{'collective':<15} {'size':>9} {'railover GB/s':>14} {'Socket GB/s':>12} {'ratio':>6}  check"]
    for r in rows:
        s = "-" if r["socket_busbw"] is None else f"{r['socket_busbw']:.3f}"
        q = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ok = "ok" if r["railover_ok"] else "WRONG"
        out.append(f"{r['collective']:<15} {human(r['size']):>9} {r['railover_busbw']:>14.3f} {s:>12} {q:>6}  {ok}")
    return "\n".join(out)


def verdict(modes):
    """Exit status: 0 all good, 1 railover failed (log or numbers), 3 only Socket failed."""
    p = modes.get("plugin", {})
    if p.get("problems") or not p.get("results") or not all(r["ok"] for r in p["results"]):
        return 1
    s = modes.get("socket", {})
    if s.get("problems") or not s.get("results") or not all(r["ok"] for r in s["results"]):
        return 3
    return 0


def tail(text, n=60):
    return "\n".join(text.splitlines()[-n:])


# ---- the ranks (torch from here on) -----------------------------------------------


def worker(a):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=WORLD, device_id=dev
    )
    rank, world = a.rank, WORLD
    peer = (rank + 1) % world

    def pat(r, length, offset=0):
        i = torch.arange(offset, offset + length, device=dev, dtype=torch.int64)
        return ((i % PERIOD) + RANK_STEP * (r + 1)).to(torch.float32)

    results = []
    for size in sizes(a.min_bytes, a.max_bytes):
        for kind in COLLECTIVES:
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
                    reqs = dist.batch_isend_irecv(
                        [dist.P2POp(dist.isend, inp, peer), dist.P2POp(dist.irecv, out, peer)]
                    )
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
            results.append(
                {
                    "collective": kind,
                    "size": size,
                    "elements": n,
                    "iters": iters,
                    "time_us": secs * 1e6,
                    "algbw": alg,
                    "busbw": bus,
                    "wrong_elements": wrong,
                    "sample_errors": sample_bad[:5],
                    "ok": wrong == 0 and not sample_bad,
                }
            )
            del want, idx
    doc = {
        "mode": a.mode,
        "rank": rank,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(0),
        "results": results,
    }
    with open(a.result, "w") as f:
        json.dump(doc, f)
    dist.destroy_process_group()
    return 0


# ---- the driver --------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(a, mode):
    """Both ranks of one transport; returns the mode's record for the summary."""
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        log = os.path.join(a.out, f"{mode}-rank{rank}.log")
        res = os.path.join(a.out, f"{mode}-rank{rank}.json")
        if os.path.exists(res):
            os.remove(res)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode]
        cmd += ["--rank", str(rank), "--port", str(port), "--result", res]
        cmd += ["--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes)]
        f = open(log, "w")
        logs.append((log, res, f))
        procs.append(subprocess.Popen(cmd, env=rank_env(os.environ, rank, mode, a.plugin), stdout=f, stderr=subprocess.STDOUT))
    end = time.time() + a.mode_timeout
    problems = []
    for p in procs:
        try:
            p.wait(timeout=max(1, end - time.time()))
        except subprocess.TimeoutExpired:
            problems.append(f"timed out after {a.mode_timeout:.0f} s")
            for q in procs:
                q.kill()
            break
    for p in procs:
        p.wait()
        if p.returncode != 0 and not problems:
            problems.append(f"a rank exited with status {p.returncode}")
    text = ""
    for log, _, f in logs:
        f.close()
        with open(log, errors="replace") as g:
            text += g.read()
    info = parse_nccl_log(text)
    problems += check_log(info, mode)
    results, meta = None, {}
    for _, res, _ in logs[:1]:
        if os.path.exists(res):
            with open(res) as g:
                doc = json.load(g)
            results = doc["results"]
            meta = {k: doc[k] for k in ("torch", "nccl", "gpu")}
    # Both ranks must agree that every result was right.
    for _, res, _ in logs[1:]:
        if os.path.exists(res) and results is not None:
            with open(res) as g:
                other = json.load(g)["results"]
            for r, o in zip(results, other):
                r["ok"] = r["ok"] and o["ok"]
                r["wrong_elements"] += o["wrong_elements"]
    if results is None:
        problems.append("no results were written")
    return {"problems": problems, "log": info, "results": results or [], "log_tail": tail(text), **meta}


def main(argv):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    os.makedirs(a.out, exist_ok=True)
    modes = {}
    for mode in ("plugin", "socket"):
        print(f"gpu-check: {mode}: two ranks on one GPU, {human(a.min_bytes)} .. {human(a.max_bytes)}", flush=True)
        modes[mode] = run_mode(a, mode)
        for p in modes[mode]["problems"]:
            print(f"gpu-check: {mode}: {p}", flush=True)
    rows = summarize(modes["plugin"]["results"], modes["socket"]["results"])
    print(table(rows))
    status = verdict(modes)
    summary = {
        "plugin": a.plugin,
        "status": status,
        "passed": status == 0,
        "rows": rows,
        "modes": {m: {k: v for k, v in d.items() if k != "log_tail"} for m, d in modes.items()},
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.out, "log-tail.txt"), "w") as f:
        for m, d in modes.items():
            f.write(f"==== {m} (last lines of both ranks' logs)\n{d['log_tail']}\n")
    print(f"gpu-check: {'PASSED' if status == 0 else 'FAILED'}; summary in {a.out}/summary.json")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
