"""Step time of data-parallel training with anyccl.ddp, reductions overlapped with backward
(hook mode) against reduced after backward, on the GPUs of one machine.

    anyccl run -n 2 benchmarks/ddp_overlap.py [--layers 12 --width 4096 --batch 64]

The model is a stack of width x width Linear layers (12 x 4096^2 = 201M parameters by
default, float32). Each mode runs --warmup steps, then --steps timed steps (CUDA-synchronised
wall time per step, slowest rank); rank 0 prints both and their ratio.
"""

import argparse
import time

import numpy as np
import torch

import anyccl
from anyccl.ddp import GradientAverager

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=12)
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--bucket-mb", type=float, default=25)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

comm = anyccl.init(backend="nccl")
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in
                              range(args.layers)]).to(dev)
params = sum(p.numel() for p in model.parameters())
x = torch.randn(args.batch, args.width, device=dev)


def step_times(averager, overlapped):
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        if overlapped:
            loss.backward()                     # buckets start as gradients are accumulated
            averager.wait()
        else:
            with averager.no_sync():
                loss.backward()
            averager.average([p.grad for p in model.parameters()])
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    slowest = np.array([np.mean(times)])
    comm.all_reduce(slowest, "max")
    return float(slowest[0])


averager = GradientAverager.for_module(comm, model, bucket_mb=args.bucket_mb)
after = step_times(averager, overlapped=False)
during = step_times(averager, overlapped=True)
if comm.rank == 0:
    print(f"{params / 1e6:.0f}M parameters, {comm.size} GPUs, bucket {args.bucket_mb} MB: "
          f"step {after * 1e3:.1f} ms reducing after backward, {during * 1e3:.1f} ms overlapped "
          f"with backward ({after / during:.2f}x)", flush=True)
comm.close()
