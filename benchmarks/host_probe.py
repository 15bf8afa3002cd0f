"""Eager calls of 16 MiB on 2 GPUs, host loop time against time per call: reduce_scatter and
all_gather by anyccl on the caller's (legacy default) stream, on a side stream given as stream=
(no torch stream context: isolates the stream NCCL is handed), inside torch.cuda.stream(...), and
by torch; all_reduce by both; and 8-byte all_reduces on nccl, ipc and torch (is an eager ipc call
slower on the host or on the GPU?). Alternating rounds, medians.

    anyccl run -n 2 benchmarks/host_probe.py
"""
import statistics
import time

import torch

import anyccl
from anyccl.tools.peers import TorchPeer

comm = anyccl.init(backend="nccl")
kernels = anyccl.init(backend="ipc")
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
peer = TorchPeer(comm, str(dev))
dist = peer.dist
n = comm.size
inp = torch.ones(4 << 20, device=dev)
out = torch.empty((4 << 20) // n, device=dev)
tiny = torch.ones(2, device=dev)
side = torch.cuda.Stream(dev)


def on_side():
    with torch.cuda.stream(side):
        comm.reduce_scatter(out, inp)


runs = {"anyccl reduce_scatter": lambda: comm.reduce_scatter(out, inp),
        "anyccl reduce_scatter stream=": lambda: comm.reduce_scatter(out, inp, stream=side),
        "anyccl reduce_scatter in context": on_side,
        "torch reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp),
        "anyccl all_gather": lambda: comm.all_gather(inp, out),
        "anyccl all_gather stream=": lambda: comm.all_gather(inp, out, stream=side),
        "torch all_gather": lambda: dist.all_gather_into_tensor(inp, out),
        "anyccl all_reduce": lambda: comm.all_reduce(inp),
        "anyccl all_reduce stream=": lambda: comm.all_reduce(inp, stream=side),
        "torch all_reduce": lambda: dist.all_reduce(inp),
        "anyccl all_reduce 8 B": lambda: comm.all_reduce(tiny),
        "anyccl-ipc all_reduce 8 B": lambda: kernels.all_reduce(tiny),
        "torch all_reduce 8 B": lambda: dist.all_reduce(tiny)}
times = {k: [] for k in runs}
for f in runs.values():
    for _ in range(20):
        f()
torch.cuda.synchronize()
for _ in range(5):
    for name, f in runs.items():
        dist.barrier()
        torch.cuda.synchronize()
        side.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            f()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        side.synchronize()
        times[name].append(((time.perf_counter() - t0) / 500, host / 500))
if comm.rank == 0:
    for name, ts in times.items():
        print(f"{name:<34} {statistics.median(t for t, _ in ts) * 1e6:7.1f} us per call "
              f"(host loop {statistics.median(h for _, h in ts) * 1e6:6.1f} us)", flush=True)
dist.destroy_process_group()
kernels.close()
comm.close()
