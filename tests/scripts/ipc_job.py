"""A 2-GPU job on the ipc backend, for checking an installed anyccl (not a checkout): all_reduce
through the low-latency, one-shot and two-shot kernels, and an all_gather, checked against the
exact sums; prints where anyccl and its kernels' sources came from."""

import torch

import anyccl
from anyccl.backends.ipc.compiler import SOURCES

comm = anyccl.init("ipc")
device = f"cuda:{comm.device}"
ok = True
for count in (1000, 300_001, 4_194_307):
    x = torch.full((count,), float(comm.rank + 1), device=device)
    comm.all_reduce(x)
    ok &= bool((x == comm.size * (comm.size + 1) / 2).all())
out = torch.empty(comm.size * 1000, device=device)
comm.all_gather(out, torch.full((1000,), float(comm.rank), device=device))
ok &= bool((out.view(comm.size, 1000)[:, 0] == torch.arange(comm.size, device=device)).all())
print(f"rank {comm.rank}: {comm.backend} from {anyccl.__file__}; kernels from "
      f"{SOURCES[0].parent} ({all(p.is_file() for p in SOURCES)}): {'OK' if ok else 'WRONG'}",
      flush=True)
comm.close()
