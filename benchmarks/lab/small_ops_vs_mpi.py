"""8-byte all_reduce, broadcast, all_gather and sendrecv between 2 ranks, anyccl on the backend
named (shm by default, or mpi) against mpi4py's own calls in the same processes: each round
times 5000 calls of each op in turn (anyccl's, then mpi4py's), after 500 to warm up and a
barrier; rank 0 prints the medians of 3 rounds in us per call and their ratio. What
`anyccl bench --compare mpi` measures in one job, in a few seconds, for comparing two source
trees run alternately (PYTHONPATH=TREE/src).

    mpiexec -n 2 python benchmarks/lab/small_ops_vs_mpi.py [shm|mpi]
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import anyccl

CALLS, WARM, ROUNDS = 5000, 500, 3


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "shm"
    comm = anyccl.init(backend=backend)
    world = MPI.COMM_WORLD
    assert comm.size == 2 == world.size, "run on 2 ranks"
    x, y, peer = np.ones(2, np.float32), np.zeros(2, np.float32), 1 - comm.rank
    gathered = np.zeros(4, np.float32)

    def timed(call: Callable[[], object]) -> float:
        for _ in range(WARM):
            call()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        return (time.perf_counter() - start) / CALLS * 1e6

    shapes: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "all_reduce": (lambda: comm.all_reduce(x), lambda: world.Allreduce(MPI.IN_PLACE, x)),
        "broadcast": (lambda: comm.broadcast(x, 0), lambda: world.Bcast(x, 0)),
        "all_gather": (lambda: comm.all_gather(gathered, x),
                       lambda: world.Allgather(x, gathered)),
        "sendrecv": (lambda: comm.sendrecv(x, peer, y, peer),
                     lambda: world.Sendrecv(x, peer, recvbuf=y, source=peer)),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in shapes}
    for _ in range(ROUNDS):
        for name, (ours, theirs) in shapes.items():
            times[name].append((timed(ours), timed(theirs)))
    if comm.rank == 0:
        print(f"# anyccl {anyccl.__version__} ({backend}) vs mpi4py on "
              f"{MPI.Get_library_version().splitlines()[0].strip()}; 8 bytes, 2 ranks, "
              f"median of {ROUNDS} rounds of {CALLS}")
        print("| op | anyccl (us) | MPI (us) | anyccl / MPI |")
        print("|---|---:|---:|---:|")
        for name, pairs in times.items():
            ours = statistics.median(p[0] for p in pairs)
            theirs = statistics.median(p[1] for p in pairs)
            print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    comm.close()


if __name__ == "__main__":
    main()
