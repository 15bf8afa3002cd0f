"""anyccl's own host time per call, for every operation on every backend, on any machine.

What is stubbed, per column, so that only anyccl's code is timed:

    shm    two ranks of the real shm backend in this one process; the peer never calls, its
           barrier counter is set far ahead, so every barrier passes at once, and the
           signatures rank 0 compares its own with are its own (the data moved is real:
           staging copies, reductions; the agreement check runs in full). send+recv: one
           rank sends, the other receives, both timed (a whole message's host work).
    host   the communicator's layer over a transport that does nothing (argument checks, op
           records, flight recorder, engine): what every host backend (shm, mpi) pays on top of
           its transport.
    nccl   CUDA and NCCL calls stubbed (each costs nothing here): argument checks, the array
           adapter, routing, op record, stream ordering and queueing.
    ipc    as nccl, plus the kernels' argument block and routing; launches stubbed.
    nccl-again, ipc-again
           the same calls on arrays that are seen as torch CUDA tensors: from the second call on
           the same arrays, a blocking call replays its cached plan (`anyccl/plans.py`) -- what
           a training loop's calls cost.

`benchmarks/lab/gpu_overhead.py` measures the whole on a GPU; `anyccl bench` measures the wire.

    python benchmarks/host_time.py [--backend shm,host,nccl,ipc] [--op all_reduce,...]
                                   [--calls 20000] [--profile] [--json FILE]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import cProfile
import ctypes
import itertools
import json
import platform
import pstats
import shutil
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

import anyccl
from anyccl import gpu
from anyccl.backends.base import Backend
from anyccl.backends.doorbell import PollingBell

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
       "all_to_all", "barrier", "send+recv")
BACKENDS = ("shm", "host", "nccl", "ipc", "nccl-again", "ipc-again")


# ---- the host columns --------------------------------------------------------------------------
def two_ranks() -> tuple[Any, Any]:
    """Ranks 0 and 1 of a 2-rank job on shm, both in this process."""
    from anyccl.backends.shm import SharedMemoryBackend
    from anyccl.communicator import Communicator
    from anyccl.store import FileStore

    where = tempfile.mkdtemp(prefix="anyccl-host-time-")
    atexit.register(shutil.rmtree, where, True)   # the store's files go with the process
    store = FileStore(where)
    backends: list[Any] = [None, None]

    def join(rank: int) -> None:
        backends[rank] = SharedMemoryBackend(store, rank, 2, job_id=f"host-time-{rank}",
                                             comm_name="w", timeout_s=60.0)
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tuple(Communicator(b, store, rank=r, size=2, local_rank=r, timeout_s=60.0)
                 for r, b in enumerate(backends))


class NoTransport(Backend):
    """A host transport that moves nothing: every operation returns at once."""

    name = "none"

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def _nothing(self, *args: Any) -> None:
        return None

    all_reduce = reduce = broadcast = all_gather = gather = scatter = _nothing
    reduce_scatter = all_to_all = barrier = progress = abort = close = _nothing
    doorbell = PollingBell()

    def post_send(self, x, dst, tag, record, on_done) -> None:
        on_done(None)

    def post_recv(self, x, src, tag, record, on_done, found=None) -> None:
        on_done(None)

    def subgroup(self, ranks, name, timeout_s):
        return NoTransport(ranks.index(self.rank), len(ranks))


def host_calls(backend: str) -> dict[str, Callable[[], None]]:
    """The timed calls on host arrays: rank 0's, with rank 1 stubbed (see the module doc)."""
    comm, peer = two_ranks()
    if backend == "host":
        comm._engine.backend = comm._backend = NoTransport(0, 2)
    else:  # shm: the peer has passed every barrier already, having called what rank 0 calls
        from anyccl.backends import shm

        peer._backend._own.words[shm._W_ARRIVE] = 1 << 62
        if hasattr(shm, "_W_AGREE"):  # its signatures: rank 0 compares with its own words
            own = comm._backend
            own._peer_ctl = [own._own.words]
            own._peer_agree_at = [(at,) for at in own._agree_at]
    x, y = np.zeros(2, np.float32), np.zeros(2, np.float32)
    whole, other = np.zeros(4, np.float32), np.zeros(4, np.float32)

    def send_recv() -> None:
        comm.send(x, 1)
        (peer if backend == "shm" else comm).recv(y, 0 if backend == "shm" else 1)

    return {**collective_calls(comm, x, whole, other), "barrier": lambda: comm.barrier(),
            "send+recv": send_recv}


def collective_calls(comm: Any, x: Any, whole: Any, other: Any) -> dict[str, Callable[[], None]]:
    """Rank 0's call of every collective: `x` 2 elements, `whole` and `other` 4."""
    return {"all_reduce": lambda: comm.all_reduce(x),
            "broadcast": lambda: comm.broadcast(x, 0),
            "reduce": lambda: comm.reduce(x, 0),
            "all_gather": lambda: comm.all_gather(whole, x),
            "gather": lambda: comm.gather(x, whole, 0),
            "scatter": lambda: comm.scatter(x, whole, 0),
            "reduce_scatter": lambda: comm.reduce_scatter(x, whole),
            "all_to_all": lambda: comm.all_to_all(other, whole)}


# ---- the GPU columns ---------------------------------------------------------------------------
class Bindings:
    """nccl4py's bindings, doing nothing."""

    class NCCLError(Exception):
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: None


class DeviceArray:
    """A GPU array as the CUDA array interface describes one (never dereferenced here)."""

    def __init__(self, count: int, address: int = 1 << 32) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "version": 3,
                                         "data": (address, False), "strides": None,
                                         "stream": 7}


def stub_cuda() -> None:
    handles = itertools.count(10)
    for name in ("record", "stream_wait", "launch", "copy_async"):
        setattr(gpu, name, lambda *a: None)
    gpu.new_stream = gpu.new_event = lambda device: next(handles)
    gpu.is_capturing = lambda stream: False
    gpu.queue_kernel = lambda *a: True
    gpu.use_device = gpu.set_device = gpu.ensure_context = lambda device: None
    gpu.device_count = lambda: 1
    gpu.device_of_pointer = lambda ptr: 0
    gpu.event_done = lambda event: True


def gpu_backend(kind: str) -> Any:
    """The nccl backend over stubbed bindings, or the ipc backend in front of it."""
    from anyccl.backends import nccl as nccl_module
    from anyccl.backends.gpu_queue import GpuQueue

    queue = GpuQueue(0, "rank 0", lambda: None, rank=0, what="NCCL communicator")
    # no watchdog thread: the caller's side only (what it queues for the watchdog is dropped)
    queue._queued, queue._wake_watchdog = collections.deque(maxlen=0), lambda: None
    nccl = nccl_module.NcclBackend.__new__(nccl_module.NcclBackend)
    nccl.__dict__.update(dict(_b=Bindings(), _comm=0, rank=0, size=2, device=0, _label="rank 0",
                              _lost_peer=lambda: None, timeout_s=60.0, queue=queue))
    if kind == "nccl":
        return nccl
    from anyccl.backends.ipc import backend as ipc_module
    from anyccl.backends.ipc.memory import KernelArgs, Layout
    from anyccl.backends.ipc.routes import Routes

    ipc = ipc_module.IpcBackend.__new__(ipc_module.IpcBackend)
    ipc.__dict__.update(dict(
        nccl=nccl, queue=queue, policy="ipc", rank=0, size=2, device=0, layout=Layout(2),
        memory=SimpleNamespace(error=lambda: (0, 0, 0, 0)),
        _kernels=collections.defaultdict(int), _args=KernelArgs(), max_blocks=128, takers=0,
        tile_min=4 << 10, ll_bytes=1 << 20, one_shot_bytes=2 << 20, ce_bytes=1 << 62,
        _side=[], _fork=0,
        routes=Routes.kernels(1 << 20, 2 << 20, 1 << 62, "policy ipc")))
    ipc._params_address = 0
    queue.watch(alarm=((ctypes.c_uint64 * 8)(), 1))   # the kernels' status words, all clear
    return ipc


def seen_as_torch_tensors() -> None:
    """Make plans take DeviceArrays for torch CUDA tensors (on a current stream of 7)."""
    from anyccl import plans

    plans.cuda_tensor_key = lambda x: ((x.__cuda_array_interface__["data"][0],
                                        x.__cuda_array_interface__["shape"][0], "float32")
                                       if isinstance(x, DeviceArray) else None)
    plans.torch_stream_function = lambda: (lambda device: 7)


def gpu_calls(kind: str) -> dict[str, Callable[[], None]]:
    stub_cuda()
    if kind.endswith("-again"):
        seen_as_torch_tensors()
        kind = kind[:-len("-again")]
    comm = anyccl.init("shm", rank=0, world_size=1)
    gpu_side = comm._gpu_side  # this tool measures anyccl's internals: the stubs go there
    gpu_side.device, gpu_side.gpu = 0, gpu_backend(kind)
    # the communicator's view: two ranks (pieces, roots), while the wire is stubbed
    comm.size = comm._check.size = gpu_side.size = 2
    x, whole = DeviceArray(2), DeviceArray(4, 1 << 33)
    other = DeviceArray(4, 1 << 34)
    return {**collective_calls(comm, x, whole, other),
            "send+recv": lambda: (comm.send(x, 1), comm.recv(x, 1))}


def per_call_us(call: Callable[[], None], calls: int) -> float:
    """Median over 5 rounds of the mean time of `calls`/5 calls, in microseconds."""
    for _ in range(min(calls, 500)):
        call()
    n = max(1, calls // 5)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            call()
        rounds.append((time.perf_counter() - started) / n * 1e6)
    return sorted(rounds)[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=",".join(BACKENDS))
    parser.add_argument("--op", default=",".join(OPS))
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true",
                        help="print the top functions of each measured call")
    parser.add_argument("--json", help="write the table to this JSON file")
    args = parser.parse_args()
    backends, ops = args.backend.split(","), args.op.split(",")
    for name in (*backends, *ops):
        if name not in (*BACKENDS, *OPS):
            parser.error(f"unknown backend or op {name!r}")
    table: dict[str, dict[str, float]] = {}
    # the GPU stubs replace module functions for good: host columns first, then GPU ones, and
    # the columns of arrays seen as torch tensors last
    for backend in sorted(backends, key=lambda b: (b not in ("shm", "host"), "again" in b)):
        calls = host_calls(backend) if backend in ("shm", "host") else gpu_calls(backend)
        for op in ops:
            if op not in calls:
                continue
            table.setdefault(op, {})[backend] = per_call_us(calls[op], args.calls)
            if args.profile:
                profile = cProfile.Profile()
                call = calls[op]
                profile.runcall(lambda: [call() for _ in range(2000)])  # noqa: B023
                print(f"## {op} on {backend}")
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    for comm in list(anyccl.lifetime.live):  # the stubbed GPU sides have nothing to close
        comm._gpu_side.gpu = None
    print(f"# anyccl {anyccl.__version__}, numpy {np.__version__}, Python "
          f"{platform.python_version()}, {platform.machine()}; us of host time per call "
          f"(median of 5 rounds, {args.calls} calls), float32 x 2 per rank, 2 ranks")
    print(f"| op | {' | '.join(backends)} |")
    print(f"|---|{'---:|' * len(backends)}")
    for op in ops:
        cells = [f"{table[op][b]:.2f}" if b in table.get(op, {}) else "-" for b in backends]
        print(f"| {op} | {' | '.join(cells)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"anyccl": anyccl.__version__, "numpy": np.__version__,
                       "python": platform.python_version(), "calls": args.calls,
                       "us_per_call": table}, f, indent=1)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
