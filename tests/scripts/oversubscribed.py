"""Many small collectives of every kind, as a job with more ranks than cores runs them: prints
the seconds they took on rank 0. Usage: oversubscribed.py ROUNDS"""

import sys
import time

import numpy as np

import anyccl

rounds = int(sys.argv[1])
comm = anyccl.init()
n, rank = comm.size, comm.rank
x = np.ones(256, np.float32)
outs = np.empty(256 * n, np.float32)
comm.barrier()
start = time.perf_counter()
for step in range(rounds):
    comm.all_reduce(x)
    comm.broadcast(x, step % n)
    comm.all_gather(outs, x)
    comm.reduce_scatter(x, outs)
    comm.all_to_all(outs, outs.copy())
    comm.sendrecv(x, (rank + 1) % n, x.copy(), (rank - 1) % n)
comm.barrier()
if rank == 0:
    print(f"{time.perf_counter() - start:.3f}", flush=True)
comm.close()
