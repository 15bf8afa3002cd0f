"""The ipc kernels' large-size configurations side by side with torch's NCCL, in one job: for
all_reduce, all_gather and reduce_scatter at each size, each configuration of the ipc backend
(its thread blocks per kernel, its tile, all_reduce's copy-engine path on or off) and torch's
NCCL, rotating the order round by round. Each configuration is first checked (exact sums of
small integers, the gathered pieces) on every rank.

    anyccl run -n 4 benchmarks/lab/ipc_sweep.py [--mib 16 64 256 1024] [--blocks 64 128]
        [--tiles 256 512] [--takers 0 16] [--algorithms two_shot one_shot low_latency_two_shot]
        [--tile-mins 4 64] [--ops all_reduce,all_gather,reduce_scatter] [--dtype float32]
        [--no-ce]

(--mib takes fractions: 0.25 is 256 KiB. --takers: blocks of each kernel that take what
arrived while the others push; --algorithms: all_reduce's kernels, each in every
configuration, instead of the tuning table's choice by size; --tile-mins: the smallest tile in
KiB, as `ipc.tile_min`; --no-ce leaves the copy-engine column out.)

Prints busbw (GB/s, nccl-tests' factors) of the median round, slowest rank, and each
configuration's speed over NCCL's. Eager back-to-back calls timed with CUDA events.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import anyccl
from anyccl.backends.ipc.routes import NO_END, Routes
from anyccl.ops import ReduceOp
from anyccl.tools.peers import TorchPeer

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=float, nargs="+", default=[16, 64, 256, 1024])
parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
parser.add_argument("--tiles", type=int, nargs="+", default=[256, 512],
                    help="KiB a block moves between two flags")
parser.add_argument("--takers", type=int, nargs="+", default=[None])
parser.add_argument("--algorithms", nargs="+", default=[None])
parser.add_argument("--tile-mins", type=int, nargs="+", default=[None],
                    help="KiB: the smallest tile (ipc.tile_min)")
parser.add_argument("--no-ce", action="store_true", help="no copy-engine column")
parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--iters", type=int, default=5)
args = parser.parse_args()

comm = anyccl.init(backend="ipc")
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
peer = TorchPeer(comm, str(dev))
dist = peer.dist
n = comm.size
dtype = getattr(torch, args.dtype)
top = int(max(args.mib) * (1 << 20)) // dtype.itemsize
big = torch.empty(top, dtype=dtype, device=dev)
gathered = torch.empty(top, dtype=dtype, device=dev)
backend = comm.gpu_backend
default = (backend.max_blocks, backend.layout.tile_bytes, backend.ce_bytes, backend.takers,
           backend.routes, backend.tile_min)
NEVER = 1 << 62
SHORT = {"two_shot": "2s", "one_shot": "1s", "low_latency": "ll", "low_latency_two_shot": "ll2"}


def configure(name: str) -> None:
    """'nccl'; 'sm B T [K [A]] [mM]': the SM kernels, B blocks, tiles of T KiB (down to M
    KiB), K of the blocks taking, all_reduce by algorithm A; 'ce': the copy engines. Plans
    cached by earlier calls are dropped, so that the next call is queued under this
    configuration."""
    (backend.max_blocks, backend.layout.tile_bytes, backend.ce_bytes, backend.takers,
     backend.routes, backend.tile_min) = default
    if name.startswith("sm"):
        _, blocks, tile, *rest = name.split()
        if rest and rest[-1].startswith("m"):
            backend.tile_min = int(rest.pop()[1:]) << 10
        backend.max_blocks, backend.layout.tile_bytes = int(blocks), int(tile) << 10
        backend.ce_bytes = NEVER
        if rest:
            backend.takers = int(rest[0])
        if len(rest) > 1:
            algorithm = {v: k for k, v in SHORT.items()}[rest[1]]
            routes = Routes(dict(default[4].spans), f"all_reduce by {algorithm}")
            routes.spans["all_reduce"] = [(0, NO_END, algorithm)]
            backend.routes = routes
        else:   # the tuning table's algorithms by size, the copy engines never
            backend.routes = Routes.kernels(backend.ll_bytes, backend.one_shot_bytes, NEVER,
                                            "the SM kernels", ll_two_shot_max=backend.ll2_bytes)
    elif name == "ce":
        backend.ce_bytes = 1 << 20
        backend.routes = Routes.kernels(backend.ll_bytes, backend.one_shot_bytes, 1 << 20,
                                        "the copy engines", ll_two_shot_max=backend.ll2_bytes)
    if comm._gpu_side.plans is not None:
        comm._gpu_side.plans.forget()


def operands(op: str, mib: float) -> tuple[torch.Tensor, torch.Tensor]:
    count = int(mib * (1 << 20)) // dtype.itemsize
    if op == "all_reduce":
        return big[:count], big[:count]
    piece = count // n
    return big[:piece] if op == "all_gather" else big[:count], \
        gathered[:count] if op == "all_gather" else gathered[:piece]


def call(name: str, op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    if name == "nccl":
        if op == "all_reduce":
            dist.all_reduce(inp)
        elif op == "all_gather":
            dist.all_gather_into_tensor(out, inp)
        else:
            dist.reduce_scatter_tensor(out, inp)
    elif op == "all_reduce":
        comm.all_reduce(inp)
    elif op == "all_gather":
        comm.all_gather(out, inp)
    else:
        comm.reduce_scatter(out, inp)


def checked(name: str, op: str, inp: torch.Tensor, out: torch.Tensor) -> bool:
    inp.fill_(comm.rank + 1.0)
    call(name, op, inp, out)
    if op == "all_reduce":
        good = bool((inp == n * (n + 1) / 2).all())
    elif op == "reduce_scatter":
        good = bool((out == n * (n + 1) / 2).all())
    else:
        want = torch.arange(1, n + 1, dtype=dtype, device=dev).repeat_interleave(inp.numel())
        good = bool((out == want).all())
    ok = np.array([float(good)])
    comm.all_reduce(ok, op=ReduceOp.MIN)
    return bool(ok[0])


def timed(name: str, op: str, inp: torch.Tensor, out: torch.Tensor) -> float:
    """Seconds per call of args.iters back-to-back calls, slowest rank."""
    torch.cuda.synchronize()
    comm.barrier()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.iters):
        call(name, op, inp, out)
    end.record()
    end.synchronize()
    mine = np.array([begin.elapsed_time(end) / 1e3 / args.iters])
    comm.all_reduce(mine, op=ReduceOp.MAX)
    return float(mine[0])


ops = args.ops.split(",")
sm = [" ".join(f"sm {b} {t}{'' if k is None else f' {k}'}"
              f"{'' if al is None else f' {SHORT[al]}'}{'' if m is None else f' m{m}'}".split())
      for b in args.blocks for t in args.tiles for k in args.takers for al in args.algorithms
      for m in args.tile_mins]
ce = [] if args.no_ce or n == 1 else ["ce"]
names = ["nccl"] + sm
results: dict[tuple[str, int, str], list[float]] = {}
wrong: set[tuple[str, int, str]] = set()
for r in range(args.rounds):
    for op in ops:
        for mib in args.mib:
            inp, out = operands(op, mib)
            cands = names + (ce if op == "all_reduce" else [])
            cands = cands[r % len(cands):] + cands[:r % len(cands)]
            for name in cands:
                configure(name)
                if r == 0 and not checked(name, op, inp, out):
                    wrong.add((op, mib, name))
                call(name, op, inp, out)
                results.setdefault((op, mib, name), []).append(timed(name, op, inp, out))
configure("default")
if comm.rank == 0:
    print(f"{n} GPUs ({torch.cuda.get_device_name(dev)}), {args.dtype}; busbw GB/s, median of "
          f"{args.rounds} rounds x {args.iters} eager calls; (x NCCL)")
    for op in ops:
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        cands = names + (ce if op == "all_reduce" else [])
        print(f"  {op:<15}" + "".join(f"{c:>16}" for c in cands))
        for mib in args.mib:
            bw = {c: factor * mib * (1 << 20) / statistics.median(results[op, mib, c]) / 1e9
                  for c in cands}
            cells = "".join(f"{bw[c]:7.1f} ({bw[c] / bw['nccl']:4.2f})"
                            + ("!" if (op, mib, c) in wrong else " ") for c in cands)
            print(f"  {mib:>10g} MiB  {cells}", flush=True)
comm.barrier()
peer.close()
comm.close()
