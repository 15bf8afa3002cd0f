"""Time per call of small host collectives on the `mpi` backend beside mpi4py's own calls, and of
the agreement's all-reduce at several envelope sizes (backends/mpi.py: Envelope), in one job:

    mpiexec -n 2 python benchmarks/lab/mpi_small_calls.py [--calls 20000]

Rows (rank 0 prints them): mpi4py's Allreduce and anyccl's all_reduce of 8 and 256 bytes, its
Bcast and anyccl's broadcast of 8 bytes, then an Iallreduce polled by Test of a 32-byte MAX (the
agreement without an envelope) and of envelopes of 32-512 bytes carrying a signature alone, and
the backend's own envelope size as a persistent request (Allreduce_init, Start, Test)."""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import anyccl
from anyccl.backends import mpi as anyccl_mpi


def per_call_us(world, calls: int, fn: Callable[[], object], warm: int | None = None) -> float:
    """us per call of `fn` on this rank: `calls` calls after `warm` (a tenth of them) and a
    barrier."""
    for _ in range(calls // 10 if warm is None else warm):
        fn()
    world.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def polled(world, *args) -> Callable[[], None]:
    def call() -> None:
        request = world.Iallreduce(*args)
        while not request.Test():
            pass
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    calls = parser.parse_args().calls
    comm = anyccl.init(backend="mpi")
    world = MPI.COMM_WORLD
    rows = []
    for n in (2, 64):
        x = np.ones(n, np.float32)
        rows.append((f"mpi4py Allreduce {4 * n} B",
                     per_call_us(world, calls, lambda x=x: world.Allreduce(MPI.IN_PLACE, x,
                                                                           MPI.SUM))))
        rows.append((f"anyccl all_reduce {4 * n} B",
                     per_call_us(world, calls, lambda x=x: comm.all_reduce(x))))
    y = np.ones(2, np.float32)
    rows.append(("mpi4py Bcast 8 B", per_call_us(world, calls, lambda: world.Bcast(y, 0))))
    rows.append(("anyccl broadcast 8 B", per_call_us(world, calls, lambda: comm.broadcast(y, 0))))
    a, b = np.zeros(4, np.int64), np.zeros(4, np.int64)
    rows.append(("Iallreduce MAX 32 B", per_call_us(world, calls, polled(world, a, b, MPI.MAX))))
    # (a tree from before the envelope has none: its rows are left out)
    env = anyccl_mpi.envelope(MPI) if hasattr(anyccl_mpi, "envelope") else None
    for nbytes in (32, 96, 128, 256, 512) if env is not None else ():
        datatype = MPI.BYTE.Create_contiguous(nbytes).Commit()
        out, got = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        out[:32].view(np.int64)[:] = (5, 2, -1, 0)   # a signature alone
        rows.append((f"Iallreduce envelope {nbytes} B", per_call_us(
            world, calls, polled(world, [out, 1, datatype], [got, 1, datatype], env.op))))
        if nbytes == env.nbytes and hasattr(world, "Allreduce_init"):   # as the backend does
            request = world.Allreduce_init([out, 1, datatype], [got, 1, datatype], env.op)

            def started(request=request) -> None:
                request.Start()
                while not request.Test():
                    pass
            rows.append((f"persistent envelope {nbytes} B", per_call_us(world, calls, started)))
            request.Free()
        datatype.Free()
    if world.rank == 0:
        for name, us in rows:
            print(f"{name:<28} {us:7.2f} us")


if __name__ == "__main__":
    main()
