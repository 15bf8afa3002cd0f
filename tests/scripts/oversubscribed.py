"""Many small collectives of every kind and a pair of messages a round, as a job with more ranks
than cores runs them: prints the seconds they took on rank 0. Usage: oversubscribed.py ROUNDS
[bind]; with `bind`, each rank then runs on one core of those it may use (rank r on the
(r mod n)-th), as launchers that bind ranks to cores place them."""

import os
import sys
import time

import numpy as np

import anyccl

rounds = int(sys.argv[1])
comm = anyccl.init()
n, rank = comm.size, comm.rank
if sys.argv[2:] == ["bind"]:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
x = np.ones(256, np.float32)
outs = np.empty(256 * n, np.float32)
y = np.empty(256, np.float32)
comm.barrier()
start = time.perf_counter()
for step in range(rounds):
    comm.all_reduce(x)
    comm.broadcast(x, step % n)
    comm.all_gather(outs, x)
    comm.reduce_scatter(x, outs)
    comm.all_to_all(outs, outs.copy())
    comm.sendrecv(x, (rank + 1) % n, x.copy(), (rank - 1) % n)
    works = [comm.irecv(y, (rank - 1) % n, tag=step), comm.isend(x, (rank + 1) % n, tag=step)]
    for w in works:
        w.wait()
comm.barrier()
if rank == 0:
    print(f"{time.perf_counter() - start:.3f}", flush=True)
comm.close()
