"""Rounds of sendrecvs of 512 B between two ranks, each round timed alone.

    mpiexec -n 2 python sendrecv_rounds.py [CALLS_PER_ROUND]
"""
import gc
import sys
import time

import numpy as np

import anyccl

comm = anyccl.init()
r, n = comm.rank, comm.size
x = np.ones(128, np.float32)
y = np.empty_like(x)
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 50000
for _ in range(1000):
    comm.sendrecv(x, (r + 1) % n, y, (r - 1) % n)
rows = []
for _ in range(12):
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.sendrecv(x, (r + 1) % n, y, (r - 1) % n)
    rows.append((time.perf_counter() - t0) / iters * 1e6)
print(f"rank {r}: " + " ".join(f"{v:.2f}" for v in rows), flush=True)
print(f"rank {r}: gc stats {gc.get_stats()}", flush=True)
