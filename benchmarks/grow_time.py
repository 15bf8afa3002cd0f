"""How long `comm.grow()` takes to admit newcomers that already wait, and until the first
all_reduce on the grown communicator has finished; the slowest rank's times.

    anyccl run -n 8 benchmarks/grow_time.py [--newcomers 1] [--rounds 3]

Rank 0 starts the newcomers (this script again, which calls `anyccl.join()`), every rank waits
until all of them have taken their tickets in the job's store, then the ranks grow. Each round
grows the job's communicator anew; rank 0 prints one line per round."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

import anyccl
from anyccl.store import PrefixStore, connection_of

parser = argparse.ArgumentParser()
parser.add_argument("--newcomers", type=int, default=1)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()


def first_steps(comm: anyccl.Communicator, took: float) -> np.ndarray:
    """The first all_reduce on the grown communicator, then the slowest rank's times."""
    x = np.ones(1000)
    comm.all_reduce(x)
    assert x[0] == comm.size, x[0]
    times = np.array([took, time.monotonic() - started if took else 0.0])
    comm.all_reduce(times, op="max")
    return times


started = 0.0
if os.environ.get("GROW_NEWCOMER") == "1":
    grown = anyccl.join(timeout=120)
    first_steps(grown, 0.0)
    grown.close()
    sys.exit(0)

comm = anyccl.init()
room = PrefixStore("grow", connection_of(comm._store))
for round_ in range(args.rounds):
    procs = [subprocess.Popen([sys.executable, __file__],
                              env=dict(os.environ, GROW_NEWCOMER="1"))
             for _ in range(args.newcomers)] if comm.rank == 0 else []
    want = room.add("claimed", 0) + args.newcomers
    for _ in range(1200):   # at most 60 s for the newcomers to start and take their tickets
        if room.add("arrived", 0) >= want:
            break
        time.sleep(0.05)
    comm.barrier()
    started = time.monotonic()
    grown = comm.grow(args.newcomers, timeout=120)
    times = first_steps(grown, time.monotonic() - started)
    if comm.rank == 0:
        print(f"round {round_}: {comm.size} ranks + {args.newcomers} -> {grown.size}: grow "
              f"{times[0] * 1e3:.1f} ms, first all_reduce done {times[1] * 1e3:.1f} ms after "
              f"the grow began (slowest rank)", flush=True)
    grown.close()
    for p in procs:
        assert p.wait(timeout=60) == 0, p.returncode
comm.close()
