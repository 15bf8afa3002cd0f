"""8-byte all_reduce, broadcast and sendrecv between 2 ranks, anyccl (shm) against mpi4py in the
same processes: each round times 20000 calls of each in turn, after 2000 to warm up and a
barrier; the medians of 3 rounds, in us per call. What `anyccl bench --compare mpi` measures in
two separate jobs, here side by side, so that a busy machine slows both alike.

    mpiexec -n 2 python benchmarks/lab/latency_vs_mpi.py [label]
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import anyccl

CALLS, WARM, ROUNDS = 20000, 2000, 3


def main() -> None:
    comm = anyccl.init(backend="shm")
    world = MPI.COMM_WORLD
    assert comm.size == 2 == world.size, "run on 2 ranks"
    x, y, peer = np.ones(2, np.float32), np.zeros(2, np.float32), 1 - comm.rank

    def timed(call: Callable[[], object]) -> float:
        for _ in range(WARM):
            call()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        return (time.perf_counter() - start) / CALLS * 1e6

    shapes: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "all_reduce": (lambda: comm.all_reduce(x),
                       lambda: world.Allreduce(MPI.IN_PLACE, x)),
        "broadcast": (lambda: comm.broadcast(x, 0), lambda: world.Bcast(x, 0)),
        "sendrecv": (lambda: comm.sendrecv(x, peer, y, peer),
                     lambda: world.Sendrecv(x, peer, recvbuf=y, source=peer)),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in shapes}
    for _ in range(ROUNDS):
        for name, (ours, theirs) in shapes.items():
            times[name].append((timed(ours), timed(theirs)))
    if comm.rank == 0:
        label = " ".join(sys.argv[1:])
        print(f"# anyccl {anyccl.__version__} (shm) vs mpi4py on "
              f"{MPI.Get_library_version().splitlines()[0].strip()}; 8 bytes, 2 ranks, "
              f"median of {ROUNDS} rounds of {CALLS} {label}")
        print("| op | anyccl (us) | MPI (us) | anyccl / MPI |")
        print("|---|---:|---:|---:|")
        for name, pairs in times.items():
            ours = statistics.median(p[0] for p in pairs)
            theirs = statistics.median(p[1] for p in pairs)
            print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    comm.close()


if __name__ == "__main__":
    main()
