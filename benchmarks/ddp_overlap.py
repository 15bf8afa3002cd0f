"""Step time of data-parallel training with anyccl.ddp, reductions overlapped with backward
(hook mode) against reduced after backward, and against compute alone (no reduction), on the
GPUs of one machine.

    anyccl run -n 2 benchmarks/ddp_overlap.py [--layers 12 --width 4096 --batch 64]
                                              [--backend nccl|ipc|auto]

The model is a stack of width x width Linear layers (12 x 4096^2 = 201M parameters by
default, float32). Each mode runs --warmup steps, then --steps timed steps (CUDA-synchronised
wall time per step, slowest rank); rank 0 prints the three.
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
parser.add_argument("--backend", default="nccl", help="nccl, ipc or auto")
args = parser.parse_args()

comm = anyccl.init(backend=args.backend)
dev = torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in
                              range(args.layers)]).to(dev)
params = sum(p.numel() for p in model.parameters())
x = torch.randn(args.batch, args.width, device=dev)


def step_times(averager, mode):
    """Mean step time (slowest rank) with gradients reduced 'after' backward, 'during' it
    (bucket hooks), or 'never' (compute alone: the floor both approach)."""
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        if mode == "during":
            loss.backward()                     # buckets start as gradients are accumulated
            averager.wait()
        else:
            with averager.no_sync():
                loss.backward()
            if mode == "after":
                averager.average([p.grad for p in model.parameters()])
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    slowest = np.array([np.mean(times)])
    comm.all_reduce(slowest, "max")
    return float(slowest[0])


averager = GradientAverager.for_module(comm, model, bucket_mb=args.bucket_mb)
after = step_times(averager, "after")
during = step_times(averager, "during")
alone = step_times(averager, "never")
if comm.rank == 0:
    print(f"{params / 1e6:.0f}M parameters, {comm.size} GPUs on {comm.backend}, bucket "
          f"{args.bucket_mb} MB: step {after * 1e3:.1f} ms reducing after backward, "
          f"{during * 1e3:.1f} ms overlapped with backward ({after / during:.2f}x); compute "
          f"alone {alone * 1e3:.1f} ms", flush=True)
comm.close()
