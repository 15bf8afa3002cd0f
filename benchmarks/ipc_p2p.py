"""One-way send/recv bandwidth between two GPUs: rank 0 sends, rank 1 receives, for anyccl on
ipc, anyccl on nccl and torch.distributed (NCCL), same processes, same buffers, same run.

    anyccl run -n 2 benchmarks/ipc_p2p.py [--min 1M --max 1G]

Time: `iters` messages back to back, both ranks synchronised before and after, slowest rank;
GB/s = bytes per message x iters / time. The last message of each size is checked.
"""

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

import anyccl
from anyccl._units import parse_size

parser = argparse.ArgumentParser()
parser.add_argument("--min", default="1M")
parser.add_argument("--max", default="1G")
parser.add_argument("--seconds", type=float, default=0.3, help="time per size and library")
args = parser.parse_args()

ipc = anyccl.init("ipc")
nccl = anyccl.init("nccl")
r, dev = ipc.rank, torch.device(f"cuda:{ipc.device}")
torch.cuda.set_device(dev)
address = ipc.broadcast_object(f"tcp://127.0.0.1:{29500 + (int(time.time()) % 1000)}", 0)
dist.init_process_group("nccl", init_method=address, rank=r, world_size=2, device_id=dev)


def one_way(send, recv, x, iters):
    torch.cuda.synchronize()
    ipc.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        send(x) if r == 0 else recv(x)
    torch.cuda.synchronize()
    took = np.array([time.perf_counter() - t0])
    ipc.all_reduce(took, "max")
    return float(took[0])


libraries = {
    "anyccl-ipc": (lambda x: ipc.send(x, 1), lambda x: ipc.recv(x, 0)),
    "anyccl-nccl": (lambda x: nccl.send(x, 1), lambda x: nccl.recv(x, 0)),
    "torch": (lambda x: dist.send(x, 1), lambda x: dist.recv(x, 0)),
}
size, top = parse_size(args.min), parse_size(args.max)
rows = []
while size <= top:
    x = torch.empty(size // 4, device=dev)
    row = [size]
    for send, recv in libraries.values():
        x.fill_(1.0 if r == 0 else 0.0)
        one_way(send, recv, x, 3)                               # warm up
        probe = one_way(send, recv, x, 2) / 2
        iters = int(min(500, max(3, args.seconds / max(probe, 1e-6))))
        iters = int(ipc.broadcast_object(iters, 0))
        x.fill_(float(r == 0) * 7.0)
        took = one_way(send, recv, x, iters)
        ok = bool(torch.all(x == 7.0)) if r == 1 else True
        ok = all(ipc.all_gather_object(ok))
        row.append((size * iters / took / 1e9, took / iters * 1e6, ok))
    rows.append(row)
    size *= 4
if r == 0:
    names = list(libraries)
    print("# one-way send/recv, rank 0 -> rank 1 (GB/s, us per message, data checked)")
    print(f"# {'size':>12}" + "".join(f" {n + ' GB/s':>17} {'us':>9} ok" for n in names)
          + "   ipc/torch ipc/nccl")
    for size, *cols in rows:
        print(f"  {size:>12}" + "".join(f" {bw:17.1f} {us:9.1f} {'y' if ok else 'N'}"
                                         for bw, us, ok in cols)
              + f"   {cols[0][0] / cols[2][0]:9.2f} {cols[0][0] / cols[1][0]:8.2f}", flush=True)
dist.destroy_process_group()
nccl.close()
ipc.close()
