"""anyccl's own Python time for one GPU collective call, measured on any machine: the CUDA and
NCCL calls are stubbed out (each costs nothing here), so what remains is the argument checks,
the array adapter, the routing, the op record and the queueing -- the part of an eager call's
host time that is anyccl's code. `benchmarks/lab/gpu_overhead.py` measures the whole on a GPU.

    python benchmarks/host_path.py [--op all_reduce|all_gather|reduce_scatter|broadcast]
                                   [--backend nccl|ipc] [--calls 20000] [--profile]
"""

import argparse
import collections
import cProfile
import pstats
import time

import numpy as np

import anyccl
from anyccl import gpu
from anyccl.backends import nccl as nccl_module

parser = argparse.ArgumentParser()
parser.add_argument("--op", default="all_reduce",
                    choices=("all_reduce", "all_gather", "reduce_scatter", "broadcast"))
parser.add_argument("--backend", default="nccl", choices=("nccl", "ipc"),
                    help="ipc: the kernels' path (launches stubbed) in front of stubbed NCCL")
parser.add_argument("--calls", type=int, default=20000)
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()

for name in ("record", "stream_wait"):
    setattr(gpu, name, lambda *a: None)
gpu.is_capturing = lambda stream: False
gpu.use_device = gpu.set_device = lambda device: None
gpu.device_count = lambda: 1
gpu.device_of_pointer = lambda ptr: 0
gpu.event_done = lambda event: True


class Bindings:
    """nccl4py's bindings, doing nothing."""

    class NCCLError(Exception):
        pass

    def __getattr__(self, name):
        return lambda *args: None


class DeviceArray:
    """A GPU array as the CUDA array interface describes one (never dereferenced here)."""

    def __init__(self, count, address=1 << 32):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "version": 3,
                                         "data": (address, False), "strides": None,
                                         "stream": 7}


backend = nccl_module.NcclBackend.__new__(nccl_module.NcclBackend)
backend.__dict__.update(dict(
    _b=Bindings(), _comm=0, rank=0, size=2, device=0, _label="rank 0", _lost_peer=lambda: None,
    stream=5, _start=1, _events=list(range(10, 10 + nccl_module._EVENT_RING)), _next_event=0,
    _last_stream=None, _last_event=0, _lock=__import__("threading").Lock(),
    _wake=__import__("threading").Event(), _queued=__import__("collections").deque(),
    _watchdog=None, _closing=False, failure=None, _reported=False, timeout_s=60.0,
    _more_health=[], _more_aborts=[]))
backend._watch = lambda item: None  # no thread: this measures the caller's side only

if args.backend == "ipc":  # the kernels' side: real argument block and routing, no launches
    from types import SimpleNamespace

    from anyccl.backends.ipc import backend as ipc_module
    from anyccl.backends.ipc.memory import KernelArgs, Layout

    gpu.launch = lambda *a: None
    ipc = ipc_module.IpcBackend.__new__(ipc_module.IpcBackend)
    ipc.__dict__.update(dict(
        nccl=backend, policy="ipc", rank=0, size=2, device=0, layout=Layout(2),
        memory=SimpleNamespace(error=lambda: (0, 0, 0, 0)), _status=np.zeros(8, np.uint64),
        _kernels=collections.defaultdict(int), _args=KernelArgs(), max_blocks=128,
        ll_bytes=1 << 20, one_shot_bytes=2 << 20, ce_bytes=1 << 62, _side=[], _fork=0))
    ipc._params_address = 0
    backend = ipc

comm = anyccl.init("shm")
comm._device, comm._gpu = 0, backend
comm.size = 2  # the communicator's view: two ranks (pieces, roots), while NCCL is stubbed
x, whole = DeviceArray(2), DeviceArray(4, 1 << 33)
call = {"all_reduce": lambda: comm.all_reduce(x),
        "all_gather": lambda: comm.all_gather(whole, x),
        "reduce_scatter": lambda: comm.reduce_scatter(x, whole),
        "broadcast": lambda: comm.broadcast(x, 0)}[args.op]
call()
started = time.perf_counter()
for _ in range(args.calls):
    call()
took = (time.perf_counter() - started) / args.calls
print(f"anyccl.{args.op} on a GPU array ({args.backend}), CUDA and NCCL stubbed: "
      f"{took * 1e6:.2f} us of Python "
      f"per call ({args.calls} calls, {np.__name__} {np.__version__})")
if args.profile:
    cProfile.run("for _ in range(5000): call()", "/tmp/host_path.prof")
    pstats.Stats("/tmp/host_path.prof").sort_stats("tottime").print_stats(16)
comm._gpu = None
comm.close()
