"""Smallest GPU check: `anyccl run -n N benchmarks/gpu_smoke.py` all-reduces a torch tensor on
every rank's GPU through the nccl backend and prints what each rank got."""

import torch

import anyccl

comm = anyccl.init(backend="nccl")
x = torch.full((1 << 20,), comm.rank + 1.0, device=f"cuda:{comm.device}")
comm.all_reduce(x)
torch.cuda.synchronize()
expected = comm.size * (comm.size + 1) / 2
print(f"rank {comm.rank}: GPU {comm.device}, backend {comm.backend}, all_reduce -> "
      f"{x[0].item()} (expected {expected})", flush=True)
assert torch.all(x == expected)
comm.close()
