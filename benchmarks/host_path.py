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
import itertools
import pstats
import time
from types import SimpleNamespace

import numpy as np

import anyccl
from anyccl import gpu
from anyccl.backends import nccl as nccl_module
from anyccl.backends.gpu_queue import GpuQueue

parser = argparse.ArgumentParser()
parser.add_argument("--op", default="all_reduce",
                    choices=("all_reduce", "all_gather", "reduce_scatter", "broadcast"))
parser.add_argument("--backend", default="nccl", choices=("nccl", "ipc"),
                    help="ipc: the kernels' path (launches stubbed) in front of stubbed NCCL")
parser.add_argument("--calls", type=int, default=20000)
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()



handles = itertools.count(10)
for name in ("record", "stream_wait"):
    setattr(gpu, name, lambda *a: None)
gpu.new_stream = gpu.new_event = lambda device: next(handles)
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


queue = GpuQueue(0, "rank 0", lambda: None, rank=0, what="NCCL communicator")
queue._watch = lambda item: None  # no watchdog thread: this measures the caller's side only
backend = nccl_module.NcclBackend.__new__(nccl_module.NcclBackend)
backend.__dict__.update(dict(_b=Bindings(), _comm=0, rank=0, size=2, device=0, _label="rank 0",
                             _lost_peer=lambda: None, timeout_s=60.0, queue=queue))

if args.backend == "ipc":  # the kernels' side: real argument block and routing, no launches
    from anyccl.backends.ipc import backend as ipc_module
    from anyccl.backends.ipc.memory import KernelArgs, Layout

    gpu.launch = lambda *a: None
    ipc = ipc_module.IpcBackend.__new__(ipc_module.IpcBackend)
    ipc.__dict__.update(dict(
        nccl=backend, queue=queue, policy="ipc", rank=0, size=2, device=0, layout=Layout(2),
        memory=SimpleNamespace(error=lambda: (0, 0, 0, 0)), _status=np.zeros(8, np.uint64),
        _kernels=collections.defaultdict(int), _args=KernelArgs(), max_blocks=128,
        ll_bytes=1 << 20, one_shot_bytes=2 << 20, ce_bytes=1 << 62, _side=[], _fork=0))
    ipc._params_address = 0
    backend = ipc

comm = anyccl.init("shm")
gpu_side = comm._gpu_side  # this tool measures anyccl's internals: it installs the stubs there
gpu_side.device, gpu_side.gpu = 0, backend
# the communicator's view: two ranks (pieces, roots), while NCCL is stubbed
comm.size = comm._check.size = gpu_side.size = 2
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
gpu_side.gpu = None
comm.close()
