"""A stand-in for the few parts of PyTorch that gpu_check.py's worker and probe use, in
plain Python: tensors are lists on the CPU and the two ranks exchange them over a TCP
connection, with the same results torch.distributed gives. It lets
scripts/test_gpu_check.py run the real worker, end to end under the real driver, on a
machine with no GPU and no torch. It also writes the lines NCCL 2.28 would log about
its network into NCCL_DEBUG_FILE, following NCCL_NET, and FAKE_TORCH_CORRUPT=NAME makes
collective NAME (all_reduce, all_gather, reduce_scatter, sendrecv) deliver one wrong
element, so a test can see the worker catch it. It is not torch: only what the worker
calls is here.
"""

import os
import pickle
import socket
import struct
import sys
import time
import types

__version__ = "0.0+fake"
version = types.SimpleNamespace(cuda="12.9")
float32, int64, bool_ = "float32", "int64", "bool"


class device:
    def __init__(self, kind, index=0):
        self.type, self.index = kind, index


def _values(x, n):
    return x.v if isinstance(x, Tensor) else [x] * n


class Tensor:
    def __init__(self, values, dtype):
        self.v, self.dtype = list(values), dtype

    def _op(self, other, f, dtype=None):
        o = _values(other, len(self.v))
        kind = dtype or (float32 if float32 in (self.dtype, getattr(other, "dtype", None)) or isinstance(other, float) else self.dtype)
        return Tensor([f(a, b) for a, b in zip(self.v, o)], kind)

    def __add__(self, o):
        return self._op(o, lambda a, b: a + b)

    __radd__ = __add__

    def __mul__(self, o):
        return self._op(o, lambda a, b: a * b)

    __rmul__ = __mul__

    def __mod__(self, o):
        return self._op(o, lambda a, b: a % b)

    def __floordiv__(self, o):
        return self._op(o, lambda a, b: a // b)

    def __ne__(self, o):
        return self._op(o, lambda a, b: a != b, bool_)

    def __eq__(self, o):
        return self._op(o, lambda a, b: a == b, bool_)

    def __getitem__(self, idx):
        return Tensor([self.v[i] for i in idx.v], self.dtype)

    def to(self, dtype):
        return Tensor([float(x) if dtype == float32 else int(x) for x in self.v], dtype)

    def float(self):
        return self.to(float32)

    def sum(self):
        return Tensor([sum(self.v)], int64)

    def item(self):
        return self.v[0]

    def tolist(self):
        return list(self.v)

    def copy_(self, src):
        self.v = list(src.v)
        return self

    def fill_(self, x):
        self.v = [x] * len(self.v)
        return self


def arange(start, end=None, device=None, dtype=int64):
    if end is None:
        start, end = 0, start
    return Tensor(range(start, end), dtype)


def zeros(n, device=None, dtype=float32):
    return Tensor([0.0] * n, dtype)


def empty(n, device=None, dtype=float32):
    return Tensor([float("nan")] * n, dtype)  # never read before written, or it shows


def tensor(values, device=None):
    values = list(values)
    return Tensor(values, int64 if all(isinstance(x, int) for x in values) else float32)


# ---- torch.cuda ------------------------------------------------------------------------

cuda = types.ModuleType("torch.cuda")
cuda.is_available = lambda: True
cuda.device_count = lambda: 1
cuda.set_device = lambda i: None
cuda.synchronize = lambda: None
cuda.get_device_name = lambda i=0: "fake GPU"
cuda.nccl = types.SimpleNamespace(version=lambda: (2, 28, 9))

# ---- torch.distributed: two ranks over one TCP connection -----------------------------

distributed = types.ModuleType("torch.distributed")
_pg = {}

_NCCL_LINES = {
    "railover": [
        "NCCL INFO NCCL_NET_PLUGIN set by environment to {plugin}",
        "NCCL INFO NET/Plugin: Loaded net plugin railover (v11)",
        "NCCL INFO Successfully loaded external network plugin {plugin}",
        "NCCL INFO railover: fabric TCP (RAILOVER_TRANSPORT=tcp)",
        "NCCL INFO NCCL version 2.28.9+cuda12.9",
        "NCCL INFO Using network railover",
        "NCCL INFO Channel 00/0 : {peer}[0] -> {rank}[0] [receive] via NET/railover/0",
        "NCCL INFO Channel 00/0 : {rank}[0] -> {peer}[0] [send] via NET/railover/0",
    ],
    "Socket": [
        "NCCL INFO NCCL version 2.28.9+cuda12.9",
        "NCCL INFO Using network Socket",
        "NCCL INFO Channel 00/0 : {peer}[0] -> {rank}[0] [receive] via NET/Socket/0",
        "NCCL INFO Channel 00/0 : {rank}[0] -> {peer}[0] [send] via NET/Socket/0",
    ],
}


def _nccl_log(rank, world):
    path, net = os.environ.get("NCCL_DEBUG_FILE"), os.environ.get("NCCL_NET")
    if not path or net not in _NCCL_LINES:
        return
    with open(path, "a") as f:
        for line in _NCCL_LINES[net]:
            msg = line.format(plugin=os.environ.get("NCCL_NET_PLUGIN"), rank=rank, peer=(rank + 1) % world)
            f.write(f"{socket.gethostname()}:{os.getpid()}:{os.getpid()} [0] {msg}\n")


def _init(backend, init_method, rank, world_size, device_id=None, timeout=None):
    if world_size != 2:
        raise RuntimeError("the fake torch.distributed joins two ranks only")
    port = int(init_method.rsplit(":", 1)[1])
    limit = time.monotonic() + (timeout.total_seconds() if timeout else 60)
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        srv.settimeout(max(1.0, limit - time.monotonic()))
        conn, _ = srv.accept()
        srv.close()
    else:
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                if time.monotonic() > limit:
                    raise
                time.sleep(0.02)
    conn.settimeout(None)
    _pg.update(conn=conn, rank=rank, world=world_size)
    _nccl_log(rank, world_size)


def _exchange(values):
    conn = _pg["conn"]
    data = pickle.dumps(values)
    conn.sendall(struct.pack("!Q", len(data)) + data)

    def recv(n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise RuntimeError("the peer rank went away")
            buf += chunk
        return buf

    return pickle.loads(recv(struct.unpack("!Q", recv(8))[0]))


def _corrupt(name, values):
    if os.environ.get("FAKE_TORCH_CORRUPT") == name and values:
        values[len(values) // 2] += 1
    return values


class ReduceOp:
    SUM, MAX = "sum", "max"


def _all_reduce(t, op=ReduceOp.SUM):
    other = _exchange(t.v)
    t.v = [max(a, b) if op == ReduceOp.MAX else a + b for a, b in zip(t.v, other)]
    if op == ReduceOp.SUM:
        _corrupt("all_reduce", t.v)


def _all_gather_into_tensor(out, inp):
    other = _exchange(inp.v)
    out.v = _corrupt("all_gather", inp.v + other if _pg["rank"] == 0 else other + inp.v)


def _reduce_scatter_tensor(out, inp):
    other = _exchange(inp.v)
    n, r = len(out.v), _pg["rank"]
    out.v = _corrupt("reduce_scatter", [a + b for a, b in zip(inp.v, other)][r * n : (r + 1) * n])


def isend():
    raise RuntimeError("only through batch_isend_irecv in this fake")


def irecv():
    raise RuntimeError("only through batch_isend_irecv in this fake")


class P2POp:
    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.peer = op, tensor, peer


class _Work:
    def wait(self):
        return True


def _batch_isend_irecv(ops):
    send = [o for o in ops if o.op is isend]
    recv = [o for o in ops if o.op is irecv]
    other = _exchange([o.tensor.v for o in send])
    for o, v in zip(recv, other):
        o.tensor.v = _corrupt("sendrecv", list(v))
    return [_Work() for _ in ops]


def _destroy():
    _pg.pop("conn").close()


distributed.is_available = lambda: True
distributed.is_nccl_available = lambda: True
distributed.init_process_group = _init
distributed.destroy_process_group = _destroy
distributed.all_reduce = _all_reduce
distributed.all_gather_into_tensor = _all_gather_into_tensor
distributed.reduce_scatter_tensor = _reduce_scatter_tensor
distributed.batch_isend_irecv = _batch_isend_irecv
distributed.ReduceOp = ReduceOp
distributed.P2POp = P2POp
distributed.isend = isend
distributed.irecv = irecv

sys.modules["torch.cuda"] = cuda
sys.modules["torch.distributed"] = distributed
