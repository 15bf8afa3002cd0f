"""Where an 8-byte collective's time goes on the mpi backend, 2 ranks: first MPI's own floors
through mpi4py (a blocking call; a non-blocking one polled with Test, as the backend waits;
two in a row, as the agreement and the data make), then the backend's methods called directly
(with and without the agreement's all-reduce), then the communicator's calls. Each line: 5000
calls after 300 to warm up and a barrier, us per call on rank 0; single runs (a busy machine
moves them: compare lines of one run).

    mpiexec -n 2 python benchmarks/lab/mpi_call_parts.py
"""
from __future__ import annotations

import array
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI
from mpi_small_calls import per_call_us  # (this folder's; scripts run from it)

import anyccl
from anyccl.trace import OpRecord

CALLS, WARM = 5000, 300


def main() -> None:
    comm = anyccl.init(backend="mpi")
    world = MPI.COMM_WORLD
    assert comm.size == 2 == world.size, "run on 2 ranks"
    mine = world.Dup()
    x, gathered = np.ones(2, np.float32), np.zeros(4, np.float32)
    signature, signatures = array.array("q", bytes(32)), array.array("q", bytes(32))

    def per_call(call: Callable[[], object]) -> float:
        return per_call_us(world, CALLS, call, WARM)

    def polled(request: Any) -> None:
        while not request.Test():
            pass

    def record(name: str) -> OpRecord:
        r = OpRecord(name, 1, "", 8)
        r.deadline, r.agree = time.monotonic() + 100, (5, 2)
        return r

    backend = comm._engine.backend
    x_flat, outs, _ = comm._check.all_gather(gathered, x)
    lines: dict[str, Callable[[], object]] = {
        "mpi4py Allreduce": lambda: mine.Allreduce(MPI.IN_PLACE, x),
        "mpi4py Iallreduce + Test": lambda: polled(mine.Iallreduce(MPI.IN_PLACE, x)),
        "mpi4py two Iallreduce + Test": lambda: (
            polled(mine.Iallreduce(signature, signatures, MPI.MAX)),
            polled(mine.Iallreduce(MPI.IN_PLACE, x))),
        "mpi4py Iallgather + Test": lambda: polled(mine.Iallgather(x, gathered)),
        "backend all_reduce": lambda: backend.all_reduce(x, anyccl.ReduceOp.SUM,
                                                         record("all_reduce")),
        "backend all_gather": lambda: backend.all_gather(outs, x_flat, record("all_gather")),
        "backend broadcast": lambda: backend.broadcast(x, 0, record("broadcast")),
    }
    times = {name: per_call(call) for name, call in lines.items()}
    backend._agrees = False   # the same methods without the agreement's all-reduce
    for name in ("backend all_reduce", "backend all_gather", "backend broadcast"):
        times[f"{name}, no agreement"] = per_call(lines[name])
    backend._agrees = True
    times["comm.all_reduce"] = per_call(lambda: comm.all_reduce(x))
    times["comm.all_gather"] = per_call(lambda: comm.all_gather(gathered, x))
    if comm.rank == 0:
        for name, us in times.items():
            print(f"{name:40s} {us:7.2f} us")
    mine.Free()
    comm.close()


if __name__ == "__main__":
    main()
