"""How the all_reduce between hosts fares on MPI at 3 hosts or more: MPICH's Iallreduce, its
Ireduce_scatter_block + Iallgather (what anyccl's mpi backend ran between hosts before), and a
ring over point-to-point messages (what it runs now, backends/mpi.py: _Ring), on simulated
hosts with shaped links, one rank per host:

    sudo python benchmarks/lab/mpi_column_ring.py --hosts 3 --rate 500mbit --sizes 1M,4M,16M

Rank 0 prints busbw (2(n-1)/n S / t, GB/s; the median of 3 rounds of 3 calls each) per size
and way, beside what one TCP stream carries over the shaped links."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def job(sizes: list[int]) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size

    def split(x: np.ndarray) -> None:
        mine = np.empty(x.size // n, x.dtype)
        comm.Ireduce_scatter_block(x, mine, MPI.SUM).Wait()
        comm.Iallgather(mine, x).Wait()

    def ring(x: np.ndarray) -> None:
        pieces, arrived = x.reshape(n, -1), np.empty(x.size // n, x.dtype)
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            requests = [comm.Irecv(arrived, left, 1), comm.Isend(pieces[(r - s) % n], right, 1)]
            MPI.Request.Waitall(requests)
            pieces[(r - s - 1) % n] += arrived
        for s in range(n - 1):
            MPI.Request.Waitall([comm.Irecv(pieces[(r - s) % n], left, 2),
                                 comm.Isend(pieces[(r + 1 - s) % n], right, 2)])

    def plain(x: np.ndarray) -> None:
        comm.Iallreduce(MPI.IN_PLACE, x, MPI.SUM).Wait()

    ways = {"Iallreduce": plain, "Ireduce_scatter_block + Iallgather": split, "ring": ring}
    for size in sizes:
        x = np.ones(size // 4 // n * n, np.float32)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(3):
            for name, way in ways.items():
                x[:] = 1
                way(x)
                assert x[0] == n and x[-1] == n, name
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(3):
                    way(x)
                comm.Barrier()
                times[name].append((time.perf_counter() - start) / 3)
        if r == 0:
            print(f"| {size >> 20} MiB | " + " | ".join(
                f"{2 * (n - 1) / n * x.nbytes / sorted(t)[1] / 1e9:.3f}" for t in times.values())
                + " |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate", default="500mbit")
    p.add_argument("--sizes", default="1M,4M,16M")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    sys.path.insert(0, str(HERE.parent.parent / "src"))
    from anyccl._units import parse_size
    sizes = [parse_size(s) for s in ns.sizes.split(",")]
    if ns.job:
        job(sizes)
        return 0
    sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "tests")]
    from many_hosts import _mpiexec, one_stream_mb_s
    from simhosts import Cluster
    with Cluster(ns.hosts) as cluster:
        cluster.shape(ns.rate)
        stream = one_stream_mb_s(cluster, 64 << 20)
        print(f"{ns.hosts} hosts x 1 rank, links at {ns.rate}; one TCP stream: {stream:.1f} MB/s")
        print("| size | Iallreduce | Ireduce_scatter_block + Iallgather | ring (p2p) |")
        print("|---:|---:|---:|---:|")
        print(_mpiexec(cluster, 1, [sys.executable, __file__, "--job", "--sizes", ns.sizes],
                       dict(os.environ)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
