"""Eager calls of 16 MiB on 2 GPUs, host loop time against time per call: reduce_scatter and
all_gather by anyccl on the caller's (legacy default) stream, on a side stream given as stream=
(no torch stream context: isolates the stream NCCL is handed), inside torch.cuda.stream(...), and
by torch; all_reduce by both; and 8-byte all_reduces on nccl, ipc, torch and torch's
symmetric-memory two-shot kernel (is an eager ipc call slower on the host or on the GPU?).
"raw" rows call the backend's enqueue function straight on the stream, without the communicator
(no checks, no op record, no watchdog): the floor that anyccl's Python sits on. Alternating
rounds, medians.

    anyccl run -n 2 benchmarks/lab/host_probe.py
"""
import statistics
import time

import torch

import anyccl
from anyccl.buffers import gpu_array
from anyccl.ops import ReduceOp
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
import torch.distributed._symmetric_memory as symm_mem  # noqa: E402

group_name = dist.group.WORLD.group_name
symm_tiny = symm_mem.empty(2, device=dev)
symm_mem.rendezvous(symm_tiny, group_name)
two_shot = torch.ops.symm_mem.two_shot_all_reduce_
comm.all_reduce(tiny)
kernels.all_reduce(tiny)   # both backends made
stream = torch.cuda.current_stream(dev).cuda_stream
g_inp, g_out, g_tiny = (gpu_array(t, "x") for t in (inp, out, tiny))
raw_rs = comm.gpu_backend.reduce_scatter(g_out, [g_inp[i * g_out.size:(i + 1) * g_out.size]
                                          for i in range(n)], ReduceOp.SUM)
raw_nccl_tiny = comm.gpu_backend.all_reduce(g_tiny, ReduceOp.SUM)
raw_ipc_tiny = kernels.gpu_backend.all_reduce(g_tiny, ReduceOp.SUM)


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
        "torch all_reduce 8 B": lambda: dist.all_reduce(tiny),
        "torch symm two-shot 8 B": lambda: two_shot(symm_tiny, "sum", group_name),
        "raw nccl reduce_scatter": lambda: raw_rs(stream),
        "raw nccl all_reduce 8 B": lambda: raw_nccl_tiny(stream),
        "raw ipc all_reduce 8 B": lambda: raw_ipc_tiny(stream)}
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
import numpy as np  # noqa: E402

mine = np.array([statistics.median(h for _, h in ts) for ts in times.values()])
hosts = np.zeros(n * len(mine))
comm.all_gather(hosts, mine)   # every rank's host loop: the slowest one paces a collective
hosts = hosts.reshape(n, -1)
if comm.rank == 0:
    for j, (name, ts) in enumerate(times.items()):
        loops = ", ".join(f"{h * 1e6:5.1f}" for h in hosts[:, j])
        print(f"{name:<34} {statistics.median(t for t, _ in ts) * 1e6:7.1f} us per call "
              f"(host loop by rank: {loops} us)", flush=True)
dist.destroy_process_group()
kernels.close()
comm.close()
