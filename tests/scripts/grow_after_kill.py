"""A job that loses a rank, shrinks, then grows back: run by tests/test_grow.py under
`anyccl run --keep-going`. Each rank loops on all_reduce; rank VICTIM (none if unset) kills
itself with SIGKILL at iteration 3; the survivors' grow of the failed communicator is refused,
and they shrink. Then the job's lowest rank starts
NEWCOMERS processes (this script with NEWCOMER=1, the same environment otherwise), which call
`anyccl.join()`; the survivors call `comm.grow(NEWCOMERS)` (GROW_COUNT=none, with one
newcomer: `comm.grow()`, which admits whoever waits, until it admitted it). Every member of
the grown communicator checks its collectives and messages and prints
`grown: rank r of n: ok was=W joined=[...]` (W: its rank before, -1 for a newcomer).
REPLACED=1: no rank starts newcomers; `anyccl run --replace` starts one in place of the victim
(its anyccl.init() joins), and the survivors grow by one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import anyccl


def check(comm: anyccl.Communicator, was: int) -> None:
    """Every kind of operation on `comm`, with results that depend on every rank."""
    n, r = comm.size, comm.rank
    y = np.full(1000, float(r + 1))
    comm.all_reduce(y)
    assert np.all(y == n * (n + 1) / 2), y[:3]
    b = np.full(10, float(r))
    comm.broadcast(b, n - 1)
    assert np.all(b == n - 1)
    out = np.zeros(4 * n)
    comm.all_gather(out, np.full(4, float(r)))
    assert np.array_equal(out, np.repeat(np.arange(n, dtype=float), 4))
    rs = np.zeros(3)
    comm.reduce_scatter(rs, np.ones(3 * n))
    assert np.all(rs == n)
    got = np.zeros(5)
    comm.sendrecv(np.full(5, float(r)), (r + 1) % n, got, (r - 1) % n)
    assert np.all(got == (r - 1) % n)
    big = np.full(3 << 20, float(r), np.float32)   # larger than a message ring
    comm.sendrecv(big.copy(), (r + 1) % n, big, (r - 1) % n)
    assert np.all(big == (r - 1) % n)
    comm.barrier()
    print(f"grown: rank {r} of {n}: ok was={was} joined={comm.grown_from['joined']}",
          flush=True)


count = int(os.environ.get("NEWCOMERS", "1"))
if os.environ.get("NEWCOMER") == "1":
    comm = anyccl.join(timeout=60)
    check(comm, -1)
    comm.close()
    sys.exit(0)

comm = anyccl.init()
if comm.grown_from is not None:   # started by `anyccl run --replace`: init() joined
    check(comm, -1)
    comm.close()
    sys.exit(0)
victim = int(os.environ["VICTIM"]) if os.environ.get("VICTIM") else None
x = np.ones(256, np.float32)
if victim is not None:
    for i in range(200):
        if comm.rank == victim and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x)
        except anyccl.AnycclError:
            break
    else:
        sys.exit(f"rank {comm.rank}: no rank was lost")
    try:   # a failed communicator refuses to grow: its survivors shrink it first
        comm.grow(1, timeout=1)
        sys.exit(f"rank {comm.rank}: a failed communicator grew")
    except anyccl.CommunicatorClosedError as exc:
        assert "shrink it first" in str(exc), exc
    shrunk = comm.shrink(timeout=60)
    comm.close()
    comm = shrunk
was = comm.rank
newcomers = []
if comm.rank == 0 and os.environ.get("REPLACED") != "1":
    env = dict(os.environ, NEWCOMER="1")
    newcomers = [subprocess.Popen([sys.executable, __file__], env=env) for _ in range(count)]
if os.environ.get("GROW_COUNT") == "none":   # admit whoever waits, until the one came
    grown, tries = comm, 0
    while grown is comm and tries < 300:
        time.sleep(0.1)
        grown, tries = comm.grow(timeout=30), tries + 1
else:
    grown = comm.grow(count, timeout=60)
assert grown.size == comm.size + count, (grown.size, comm.size, count)
assert grown.rank == was
check(grown, was)
grown.close()
comm.close()
for p in newcomers:
    assert p.wait(timeout=60) == 0, p.returncode
