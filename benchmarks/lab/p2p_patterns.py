"""8-byte messages between 2 ranks in the four shapes users write them, anyccl against mpi4py in
the same processes (alternating rounds, medians): `sendrecv` (MPI's Sendrecv), a batch of isend
and irecv then wait (nccl-tests' shape), irecv + blocking send + wait (torch's ring idiom), and a
ping-pong of blocking send and recv (one round trip: two messages). Times are per exchange.

    mpiexec -n 2 python benchmarks/lab/p2p_patterns.py [--backend shm] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import anyccl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    comm = anyccl.init(backend=args.backend)
    world = MPI.COMM_WORLD
    assert comm.size == 2 == world.size, "run on 2 ranks"
    peer = 1 - comm.rank
    x, y = np.ones(2, np.float32), np.zeros(2, np.float32)

    def batched() -> None:
        with comm.batch():
            comm.isend(x, peer)
            work = comm.irecv(y, peer)
        work.wait()

    def ring() -> None:
        work = comm.irecv(y, peer)
        comm.send(x, peer)
        work.wait()

    def ping_pong(send: Callable, recv: Callable) -> None:
        if comm.rank == 0:
            send(x, peer)
            recv(y, peer)
        else:
            recv(y, peer)
            send(x, peer)

    def mpi_batched() -> None:
        MPI.Request.Waitall([world.Isend(x, peer), world.Irecv(y, peer)])

    def mpi_ring() -> None:
        request = world.Irecv(y, peer)
        world.Send(x, peer)
        request.Wait()

    shapes: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "sendrecv": (lambda: comm.sendrecv(x, peer, y, peer),
                     lambda: world.Sendrecv(x, peer, 0, y, peer, 0)),
        "isend+irecv batch, wait": (batched, mpi_batched),
        "irecv, send, wait": (ring, mpi_ring),
        "ping-pong send/recv": (lambda: ping_pong(comm.send, comm.recv),
                                lambda: ping_pong(world.Send, world.Recv)),
    }
    if not hasattr(comm, "sendrecv"):  # an anyccl from before it had one
        del shapes["sendrecv"]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, pair in shapes.items():
            for side, call in enumerate(pair):
                for _ in range(200):
                    call()
                world.Barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                elapsed = (time.perf_counter() - start) / args.calls * 1e6
                times.setdefault((name, side), []).append(elapsed)
    if comm.rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# anyccl {anyccl.__version__} ({comm.backend}) vs mpi4py on {library}; 8 bytes, "
              f"2 ranks, median of {args.rounds} rounds of {args.calls}")
        print("| shape | anyccl (us) | MPI (us) | anyccl / MPI |")
        print("|---|---:|---:|---:|")
        for name in shapes:
            ours, theirs = (statistics.median(times[(name, s)]) for s in (0, 1))
            print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.1f}x |")
    comm.close()


if __name__ == "__main__":
    main()
