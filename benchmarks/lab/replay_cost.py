"""Where the host time of a repeated eager GPU call goes (one rank per GPU): each step of a
plan's replay timed alone on a loop (the tensor key, the plan lookup, torch's stream lookup, the
op record and flight-recorder entry, the capture query, an event record, the queue's run with an
empty operation, the plan's one compiled call), then whole calls, then a profile of the whole
calls. Also the same operation queued as one launch of a CUDA graph that captured it
(cuGraphLaunch through ctypes).

    anyccl run -n 2 benchmarks/lab/replay_cost.py [ipc|nccl]
"""

import collections
import cProfile
import ctypes
import io
import pstats
import sys
import time

import torch

import anyccl
from anyccl import gpu
from anyccl.buffers import cuda_tensor_key, gpu_array, torch_stream
from anyccl.ops import ReduceOp
from anyccl.trace import OpRecord

backend = sys.argv[1] if len(sys.argv) > 1 else "ipc"
comm = anyccl.init(backend=backend)
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
tiny = torch.ones(2, device=dev)
for _ in range(3):
    comm.all_reduce(tiny)
torch.cuda.synchronize()
b = comm.gpu_backend
queue = b.queue
stream = torch_stream(comm.device)
event = gpu.new_event(comm.device)
raw = b.all_reduce(gpu_array(tiny, "x"), ReduceOp.SUM)
plans = comm._gpu_side.plans
tag = ("all_reduce", ReduceOp.SUM)
one_call = gpu.ONE_CALL.get(type(raw))


def per_call(fn, n=20000) -> float:
    for _ in range(200):
        fn()
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
    return sorted(best)[1]


def nothing(s: int) -> None:
    pass


local = {
    "cuda_tensor_key": lambda: cuda_tensor_key(tiny),
    "plans.find (hit)": lambda: plans.find(tag, (tiny,)),
    "torch_stream": lambda: torch_stream(comm.device),
    "OpRecord + flight entry": lambda: comm.flight_recorder.queued(OpRecord("x", 1, "", 8)),
    "gpu.is_capturing": lambda: gpu.is_capturing(stream),
    "gpu.current_device": gpu.current_device,
    "gpu.record": lambda: gpu.record(event, stream),
    "queue.run (empty op)": lambda: queue.run(OpRecord("x", 1, "", 8), (stream,),
                                              time.monotonic() + 60, nothing, None, [], stream),
}
lines = [f"{name:<28} {per_call(fn):7.2f} us" for name, fn in local.items()]
torch.cuda.synchronize()
comm.barrier()
joint = {"raw enqueue (kernel launch)": lambda: raw(stream),
         "comm.all_reduce (replay)": lambda: comm.all_reduce(tiny)}
drv = gpu._drv()
side = torch.cuda.Stream(dev)
capture_stream = side.cuda_stream
torch.cuda.synchronize()
gpu._check_driver(drv.cuStreamBeginCapture(
    capture_stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)[0], "capture")
raw(capture_stream)
status, graph = drv.cuStreamEndCapture(capture_stream)
gpu._check_driver(status, "cuStreamEndCapture")
status, graph_exec = drv.cuGraphInstantiate(graph, 0)
gpu._check_driver(status, "cuGraphInstantiate")
libcuda = ctypes.CDLL("libcuda.so.1")
graph_launch = libcuda.cuGraphLaunch
graph_launch.argtypes, graph_launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
exec_handle = int(graph_exec)
joint["CUDA graph launch (ctypes)"] = lambda: graph_launch(exec_handle, stream or None)
if one_call is not None:
    joint["one compiled call"] = lambda: one_call(raw, stream, event, 0, comm.device)
joint["queue.run (kernel)"] = lambda: queue.run(OpRecord("x", 1, "", 8), (stream,),
                                                 time.monotonic() + 60, raw, None, [], stream)


def unwatched() -> None:
    queued, wake = queue._queued, queue._wake_watchdog
    queue._queued, queue._wake_watchdog = collections.deque(maxlen=0), lambda: None
    try:
        comm.all_reduce(tiny)
    finally:
        queue._queued, queue._wake_watchdog = queued, wake


joint["comm.all_reduce, no watchdog"] = unwatched


def on_side_stream() -> None:
    with torch.cuda.stream(side):
        for _ in range(100):
            comm.all_reduce(tiny)


joint["x100 on a side stream"] = on_side_stream
for name, fn in joint.items():
    comm.barrier()
    torch.cuda.synchronize()
    lines.append(f"{name:<28} {per_call(fn, 50 if 'x100' in name else 5000):7.2f} us")
    torch.cuda.synchronize()
comm.barrier()
profile = cProfile.Profile()
profile.runcall(lambda: [comm.all_reduce(tiny) for _ in range(3000)])
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
everything = comm.all_gather_object("\n".join(lines) + "\n" + text.getvalue())
if comm.rank == 0:
    for r, part in enumerate(everything):
        print(f"## rank {r}, backend {backend}\n{part}", flush=True)
comm.close()
