"""The copy-engine all_reduce between processes (src/anyccl/backends/ipc/ce.py), timed
for each way of waiting for its flags (kernels, the backend's way, or memop-wait) and each
number of chunks per segment, beside the SM two-shot kernels of the same backend and torch, in
rounds that rotate the order. Two timings of the same back-to-back calls: eager (the host queues
them as the GPU runs) and held (queued while the GPU sleeps, then timed from the sleep's end:
GPU time only). Each configuration is first checked for the exact sum.

    anyccl run -n 2 benchmarks/lab/ce_modes.py [--mib 64 256 1024] [--chunks 2 4 8]
                                           [--sync kernels memop-wait] [--rounds 3]

Prints busbw (GB/s; 2 (n-1)/n x bytes / time), the median round of the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import anyccl
from anyccl.backends.ipc.routes import Routes
from anyccl.ops import ReduceOp
from anyccl.tools.peers import TorchPeer

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, nargs="+", default=[64, 256, 1024])
parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
parser.add_argument("--sync", nargs="+", default=["kernels", "memop-wait"],
                    choices=["kernels", "memop-wait"])
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--iters", type=int, default=6)
args = parser.parse_args()

comm = anyccl.init(backend="ipc")
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
peer = TorchPeer(comm, str(dev))
dist = peer.dist
n = comm.size
x = torch.empty((max(args.mib) << 20) // 4, device=dev)
comm.all_reduce(x[:1024])
backend = comm.gpu_backend  # the ipc backend: its copy-engine threshold and chunks are set below
SM_ONLY = 1 << 62


def configure(name: str) -> None:
    """'sm': the SM kernels; 'ce SYNC CHUNKS': the copy engines from 1 MiB up. Plans cached
    by earlier calls are dropped, so that the next call is queued under this configuration."""
    ce_min = SM_ONLY
    if name.startswith("ce"):
        _, sync, chunks = name.split()
        backend.ce_memop_wait = sync == "memop-wait"     # the experiment's own switch
        ce_min, backend.ce_chunks = 1 << 20, int(chunks)
    backend.ce_bytes = ce_min
    backend.routes = Routes.kernels(backend.ll_bytes, backend.one_shot_bytes, ce_min, name,
                                    ll_two_shot_max=backend.ll2_bytes)
    if comm._gpu_side.plans is not None:
        comm._gpu_side.plans.forget()


def call(name: str, t: torch.Tensor) -> None:
    if name == "torch":
        dist.all_reduce(t)
    else:
        comm.all_reduce(t)


def timed(name: str, t: torch.Tensor, held: bool) -> float:
    """Seconds per call of args.iters back-to-back calls, slowest rank."""
    torch.cuda.synchronize()
    comm.barrier()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if held:
        torch.cuda._sleep(60_000_000)     # ~30 ms at H200 clocks: the host queues meanwhile
    begin.record()
    for _ in range(args.iters):
        call(name, t)
    end.record()
    end.synchronize()
    mine = np.array([begin.elapsed_time(end) / 1e3 / args.iters])
    comm.all_reduce(mine, op=ReduceOp.MAX)
    return float(mine[0])


def checked(name: str, t: torch.Tensor) -> bool:
    t.fill_(comm.rank + 1.0)
    call(name, t)
    ok = np.array([float(bool((t == n * (n + 1) / 2).all()))])
    comm.all_reduce(ok, op=ReduceOp.MIN)
    return bool(ok[0])


names = ["torch", "sm"] + [f"ce {s} {c}" for s in args.sync for c in args.chunks]
results: dict[tuple[int, str, bool], list[float]] = {}
wrong: set[tuple[int, str]] = set()
for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for mib in args.mib:
        t = x[:(mib << 20) // 4]
        for name in order:
            configure(name)
            if not checked(name, t):
                wrong.add((mib, name))
            call(name, t)                  # warm up
            for held in (False, True):
                results.setdefault((mib, name, held), []).append(timed(name, t, held))
configure("sm")
if comm.rank == 0:
    print(f"all_reduce float32 on {n} GPUs, busbw GB/s (median of {args.rounds} rounds, "
          f"{args.iters} calls each; eager | held = GPU time)")
    print(f"  {'MiB':>5}  {'library':<24} {'eager':>7} {'held':>7}")
    for mib in args.mib:
        moved = 2 * (n - 1) / n * (mib << 20)
        for name in names:
            eager, held = (moved / statistics.median(results[mib, name, h]) / 1e9
                           for h in (False, True))
            flag = "  WRONG" if (mib, name) in wrong else ""
            print(f"  {mib:5d}  {name:<24} {eager:7.1f} {held:7.1f}{flag}", flush=True)
comm.barrier()
peer.close()
comm.close()
