"""8-byte all_reduce, broadcast, all_gather and sendrecv between 2 ranks, anyccl against
mpi4py in the same processes: each round times CALLS calls of each op in turn (anyccl's, then
mpi4py's), after WARM to warm up and a barrier; rank 0 prints the medians of 3 rounds, in us
per call. What `anyccl bench --compare mpi` measures in two separate jobs, here side by side,
so that a busy machine slows both alike; with PYTHONPATH=TREE/src, two source trees run
alternately compare on one machine.

    mpiexec -n 2 python benchmarks/lab/latency_vs_mpi.py [--backend shm|mpi] [--calls 20000]
        [--warm 2000] [label]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import anyccl

ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shm", choices=("shm", "mpi"))
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--warm", type=int, default=2000)
    parser.add_argument("label", nargs="*")
    args = parser.parse_args()
    comm = anyccl.init(backend=args.backend)
    world = MPI.COMM_WORLD
    assert comm.size == 2 == world.size, "run on 2 ranks"
    x, y, peer = np.ones(2, np.float32), np.zeros(2, np.float32), 1 - comm.rank
    gathered = np.zeros(4, np.float32)

    def timed(call: Callable[[], object]) -> float:
        for _ in range(args.warm):
            call()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        return (time.perf_counter() - start) / args.calls * 1e6

    shapes: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "all_reduce": (lambda: comm.all_reduce(x),
                       lambda: world.Allreduce(MPI.IN_PLACE, x)),
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
        print(f"# anyccl {anyccl.__version__} ({args.backend}) vs mpi4py on "
              f"{MPI.Get_library_version().splitlines()[0].strip()}; 8 bytes, 2 ranks, "
              f"median of {ROUNDS} rounds of {args.calls} {' '.join(args.label)}")
        print("| op | anyccl (us) | MPI (us) | anyccl / MPI |")
        print("|---|---:|---:|---:|")
        for name, pairs in times.items():
            ours = statistics.median(p[0] for p in pairs)
            theirs = statistics.median(p[1] for p in pairs)
            print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    comm.close()


if __name__ == "__main__":
    main()
