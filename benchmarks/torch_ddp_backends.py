"""torch DistributedDataParallel on CPU: step time on the "anyccl" process-group backend against
"gloo", same model, same data, same machine, in one run (the two backends alternate in rounds;
medians). Also checks that both train to the same weights.

    python benchmarks/torch_ddp_backends.py [--ranks 2] [--width 1024] [--layers 4]
                                            [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def rank_main(rank: int, backend: str, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=args.ranks)
    net = DDP(model(args.width, args.layers), bucket_cap_mb=25)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=data)
    times = []
    for step in range(args.steps + 3):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        if step >= 3:   # the first steps build buckets
            times.append(time.perf_counter() - start)
    step_s = torch.tensor([statistics.median(times)])
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"step_s": float(step_s), "weights": [p.detach().clone()
                                                         for p in net.parameters()]}, out)
    dist.destroy_process_group()
    # torch's CPU build sometimes aborts in its exit-time destructors after DDP ("terminate called
    # without an active exception", about 1 exit in 10 with gloo alone, no anyccl loaded): the
    # work is done and saved, so leave without them.
    os._exit(0)


def run(backend: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(rank_main, args=(backend, args, _free_port(), out), nprocs=args.ranks)
        return torch.load(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    results: dict[str, list[float]] = {"gloo": [], "anyccl": []}
    weights = {}
    for k in range(args.rounds):
        for backend in (("gloo", "anyccl") if k % 2 == 0 else ("anyccl", "gloo")):
            got = run(backend, args)
            results[backend].append(got["step_s"])
            weights[backend] = got["weights"]
    same = all(torch.equal(a, b) for a, b in zip(weights["gloo"], weights["anyccl"]))
    import anyccl

    print(f"# torch {torch.__version__}, anyccl {anyccl.__version__}, Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.ranks} ranks, "
          f"{args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.2f} M float32 "
          f"parameters ({params * 4 / 2**20:.1f} MiB of gradients per step), batch "
          f"{args.batch}, {args.steps} steps x {args.rounds} alternating rounds")
    print("| backend | step time (ms, median of rounds) | rounds (ms) |")
    print("|---|---:|---|")
    for backend, values in results.items():
        print(f"| {backend} | {statistics.median(values) * 1e3:.2f} | "
              f"{', '.join(f'{v * 1e3:.2f}' for v in values)} |")
    ratio = statistics.median(results["gloo"]) / statistics.median(results["anyccl"])
    print(f"anyccl speed / gloo's: {ratio:.2f}x; weights identical: {same}")
    return 0 if same or args.ranks > 2 else 1


if __name__ == "__main__":
    sys.exit(main())
