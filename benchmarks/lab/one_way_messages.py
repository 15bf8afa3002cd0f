"""One-way messages between two ranks: rank 0 sends an array of each size, rank 1 receives it
and answers with 8 bytes; the median of 20 timed exchanges (after 5 untimed ones) on rank 0, in
microseconds. anyccl (its default backend) or, with `mpi4py`, MPI's Send/Recv in the same
pattern, so the two can be run alternately on one machine.

    anyccl run -n 2 benchmarks/lab/one_way_messages.py
    mpiexec -n 2 python benchmarks/lab/one_way_messages.py mpi4py
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

SIZES = (1 << 20, 4 << 20, 16 << 20)
WARM, TIMED = 5, 20


def main() -> None:
    if sys.argv[1:] == ["mpi4py"]:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, barrier = world.Get_rank(), world.Barrier
        send, recv = (lambda x, peer: world.Send(x, peer)), (lambda x, peer: world.Recv(x, peer))
        name, close = "MPI (mpi4py)", (lambda: None)
    else:
        import anyccl

        comm = anyccl.init()
        rank, barrier, send, recv = comm.rank, comm.barrier, comm.send, comm.recv
        name, close = f"anyccl ({comm.backend})", comm.close
    ack = np.zeros(1)
    line = []
    for size in SIZES:
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        times = []
        for _ in range(WARM + TIMED):
            barrier()
            start = time.perf_counter()
            if rank == 0:
                send(x, 1)
                recv(ack, 1)
            else:
                recv(y, 0)
                send(ack, 0)
            times.append(time.perf_counter() - start)
        line.append(f"{size >> 20} MiB {statistics.median(times[WARM:]) * 1e6:.0f} us")
    if rank == 0:
        print(f"{name}: " + ", ".join(line), flush=True)
    close()


if __name__ == "__main__":
    main()
