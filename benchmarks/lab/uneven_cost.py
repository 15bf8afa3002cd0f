"""all_to_all_single with uneven split sizes on CUDA tensors (what mixture-of-experts layers call
every step): torch's NCCL group against anyccl's torch group over its nccl and ipc transports,
one process per GPU, the same tensors, rotating order.

Rank i sends rank j `unit * (1 + (i + j) % size)` rows of 256 float32 elements, so every pair
has its own count. Per group and size: host time per call until it returns, time per call once
the GPU finished, and whether the output equals torch NCCL's bit for bit (#wrong: elements that
differ). anyccl checks on the host that the ranks' split sizes agree before any byte moves
(two small host collectives); torch's NCCL group trusts them.

    python benchmarks/lab/uneven_cost.py [--units 1,256,4096] [--calls 100] [--rounds 3]
                                         [--profile]   (+ rank 0's cProfile of anyccl-nccl)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch_pg_cost import free_port, join, rotating  # (this folder: scripts find each other)

ROW = 256   # float32 elements per row


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace) -> None:
    groups = join(rank, size, port)
    rows = []
    for unit in args.units:
        sends = [unit * (1 + (rank + j) % size) for j in range(size)]
        receives = [unit * (1 + (j + rank) % size) for j in range(size)]
        inp = torch.randn(sum(sends), ROW, device="cuda")
        outs = {name: torch.empty(sum(receives), ROW, device="cuda") for name in groups}
        calls = {name: (lambda g=group, o=outs[name], i=inp, r=receives, s=sends:
                        dist.all_to_all_single(o, i, r, s, group=g))
                 for name, group in groups.items()}
        results = rotating(calls, args.rounds, args.calls, 5)
        torch.cuda.synchronize()
        for name in groups:
            wrong = int((outs[name] != outs["nccl"]).sum().item())
            rows.append((unit, sum(sends) * ROW * 4, name,
                         statistics.median(h for h, _ in results[name]),
                         statistics.median(w for _, w in results[name]), wrong))
    if rank == 0:
        print(f"# torch {torch.__version__}, {size} rank(s), {torch.cuda.get_device_name()}; "
              f"median of {args.rounds} rotating rounds of {args.calls} calls; rows of "
              f"{ROW} float32")
        print("| rows unit | bytes sent by rank 0 | group | host us per call | us per call "
              "(GPU done) | #wrong |")
        print("|---:|---:|---|---:|---:|---:|")
        for unit, nbytes, name, host, whole, wrong in rows:
            print(f"| {unit} | {nbytes} | {name} | {host:.1f} | {whole:.1f} | {wrong} |")
    if args.profile:   # every rank calls; rank 0 reports where its host time goes
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            calls["anyccl-nccl"]()
        profile.disable()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(f"\ncProfile of {args.calls} calls on anyccl-nccl (last size), rank 0:")
            print(text.getvalue())
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", default="1,256,4096",
                   type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    size = torch.cuda.device_count()
    mp.spawn(rank_main, args=(size, free_port(), args), nprocs=size)


if __name__ == "__main__":
    main()
