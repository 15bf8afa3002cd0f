"""What sets the pace of an eager loop of small all_reduces, on every GPU of the machine: for
anyccl's ipc backend, torch's symmetric-memory `two_shot_all_reduce_` and torch's NCCL, in the
same processes, each timed three ways on the same symmetric buffer:

- host: microseconds per call spent issuing 200 calls, the GPU drained before (nothing waits);
- eager: microseconds per call of 2000 calls back to back, then a synchronize (what
  `anyccl bench` reports);
- gpu: microseconds per call of a CUDA graph of 20 calls replayed (symm_mem: not capturable,
  left out).

If eager ~ host, the host sets the pace; if eager ~ gpu, the kernels do; if eager ~ host + gpu,
something serializes them. Then rank 0's profile of anyccl's eager loop (the Python functions
by own time) and its kernels' durations as torch.profiler sees them. Slowest rank, median of 3
rounds, libraries alternating.

    anyccl run -n 4 benchmarks/lab/eager_pace.py [bytes ...]
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory as symm_mem  # noqa: E402

import anyccl  # noqa: E402
from anyccl.tools.peers import _torch_group  # noqa: E402

comm = anyccl.init(backend="ipc")
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
_torch_group(comm, f"cuda:{comm.device}")
group = dist.group.WORLD.group_name
sizes = [int(a) for a in sys.argv[1:]] or [8, 4096, 65536]


def slowest(seconds: float) -> float:
    return float(comm.all_reduce(np.array([seconds]), "max")[0])


def per_call_us(call: Callable[[], object], n: int, with_gpu: bool) -> float:
    """Slowest rank's us per call of `n` calls after a drained GPU: until the last is issued
    (with_gpu=False: the host's time) or until the GPU has run them all."""
    torch.cuda.synchronize()
    comm.barrier()
    t = time.perf_counter()
    for _ in range(n):
        call()
    if with_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return slowest(elapsed / n * 1e6)


def host_us(call: Callable[[], object]) -> float:
    return per_call_us(call, 200, with_gpu=False)


def eager_us(call: Callable[[], object], n: int = 2000) -> float:
    return per_call_us(call, n, with_gpu=True)


def graph_us(call: Callable[[], object], calls: int = 20, replays: int = 100) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    torch.cuda.synchronize()
    return eager_us(graph.replay, replays) / calls


for nbytes in sizes:
    t = symm_mem.empty(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    t.zero_()
    symm_mem.rendezvous(t, group)
    libraries: dict[str, Callable[[], object]] = {
        "anyccl ipc": lambda t=t: comm.all_reduce(t),
        "torch symm two_shot": lambda t=t, f=torch.ops.symm_mem.two_shot_all_reduce_: f(
            t, "sum", group),
        "torch nccl": lambda t=t: dist.all_reduce(t),
    }
    for call in libraries.values():
        for _ in range(50):
            call()
    times: dict[str, dict[str, list[float]]] = {k: {"host": [], "eager": [], "gpu": []}
                                                for k in libraries}
    for k in range(3):
        names = list(libraries)
        for name in names[k % 3:] + names[:k % 3]:
            times[name]["host"].append(host_us(libraries[name]))
            times[name]["eager"].append(eager_us(libraries[name]))
            if "symm" not in name:
                times[name]["gpu"].append(graph_us(libraries[name]))
    if comm.rank == 0:
        print(f"## {nbytes} B float32 all_reduce, {comm.size} ranks: us per call (slowest rank, "
              f"median of 3)")
        print("| library | host | eager | gpu (graph) |")
        print("|---|---:|---:|---:|")
        for name, parts in times.items():
            cells = [f"{statistics.median(v):.2f}" if v else "-" for v in parts.values()]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)

t = symm_mem.empty(2, dtype=torch.float32, device=dev)
t.zero_()
torch.cuda.synchronize()
comm.barrier()
profile = cProfile.Profile()
profile.runcall(lambda: [comm.all_reduce(t) for _ in range(3000)])
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
comm.barrier()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(200):
        comm.all_reduce(t)
    for _ in range(200):
        torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group)
    torch.cuda.synchronize()
kernels = prof.key_averages().table(sort_by="self_device_time_total", row_limit=8)
if comm.rank == 0:
    print(f"## rank 0: profile of 3000 eager anyccl calls of 8 bytes\n{text.getvalue()}")
    print(f"## rank 0: kernels of 200 anyccl calls, then 200 symm_mem calls\n{kernels}",
          flush=True)
comm.barrier()
dist.destroy_process_group()
comm.close()
