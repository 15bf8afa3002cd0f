"""Time per call of a blocking sendrecv between 2 ranks on the `mpi` backend beside mpi4py's own
Sendrecv, the two alternating in rounds in one job, and how many of anyccl's went through the
compiled exchange (backends/mpi.py: exchange_context):

    mpiexec -n 2 python benchmarks/lab/mpi_sendrecv_pace.py [--calls 200] [--rounds 3]

Set ANYCCL_TUNING=mpi.exchange_max=1M to send sizes past the default through the compiled
exchange, =0 to send every one the Python way. Rank 0 prints a row per size and round."""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import anyccl

SIZES = (4096, 8192, 32768, 262144)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    comm, world = anyccl.init("mpi"), MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run it on 2 ranks (mpiexec -n 2)")
    peer = 1 - comm.rank
    step = comm._hot[2] if comm._hot is not None else None
    for size in SIZES:
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        for _ in range(args.rounds):
            compiled = step.exchanges if step is not None else 0
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                comm.sendrecv(x, peer, y, peer)
            ours = (time.perf_counter() - start) / args.calls * 1e6
            compiled = (step.exchanges if step is not None else 0) - compiled
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                world.Sendrecv(x, peer, 0, y, peer, 0)
            theirs = (time.perf_counter() - start) / args.calls * 1e6
            if comm.rank == 0:
                print(f"{size:>8} B  anyccl {ours:7.1f} us  mpi4py {theirs:7.1f} us  "
                      f"compiled {compiled}/{args.calls}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
