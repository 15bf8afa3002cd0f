"""A job that loses ranks and goes on: run by tests/test_recovery.py under
`anyccl run --keep-going`. Each rank loops on all_reduce; the victims (VICTIMS, comma-separated
ranks) kill themselves with SIGKILL at iteration KILL_AT (MIXED=1: the loop goes through every
kind of operation, see one_op); rank DURING (if set) joins the shrink and dies right after the
survivors agreed on it, or with DURING_AT=build once it built its side of the new transport
(they must go round again without it). Every survivor catches the error, shrinks, checks the
new communicator's collectives and messages, and prints one line:
`rank R of N -> rank r of n: ok lost=[...] seconds=S first=F detect=D on B` (S: from the error
to the new communicator; F: from the error to the end of the first all_reduce on it; D: from
the first victim's kill to the error, when KILL_FILE names a file the victims append their
kill times to, else -1; B: the shrunk communicator's backend). DEVICE=cuda: the loop's
all_reduce, and the first one on the shrunk communicator, are on this rank's GPU (torch
tensors), on whatever GPU backend ANYCCL_BACKEND names; NBYTES sets the loop's array size
(16 KiB). TORCH_PG=1: the loop's all_reduce goes through anyccl's torch process group, whose
errored(), and shrink() give the shrunk communicator."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import anyccl
from anyccl import recovery

victims = {int(r) for r in os.environ.get("VICTIMS", "").split(",") if r}
kill_at = int(os.environ.get("KILL_AT", "5"))
during = int(os.environ["DURING"]) if os.environ.get("DURING") else None
# KILL_WITHIN_S: a victim dies a random time (up to this many seconds) after iteration
# KILL_AT starts, inside whatever operation it is in; ONLY=k: the loop runs kind k alone (see
# one_op); LOOP_S: the loop runs until an error, at most this long (no victim: something
# outside the job breaks it, e.g. a host's link cut); EXPECT_LOST: the ranks the survivors
# must have lost (default: the victims and DURING); SHRINK_S: shrink's deadline (60);
# READY_DIR: each rank touches a file named after its rank there once its loop runs
kill_within = float(os.environ.get("KILL_WITHIN_S", "0"))
only = int(os.environ["ONLY"]) if os.environ.get("ONLY") else None
loop_s = float(os.environ.get("LOOP_S", "0"))

comm = anyccl.init()
rank, size = comm.rank, comm.size
# every rank past start-up before any dies: the kills are to land in operations (a rank lost
# while the others still make the communicator fails their init, which the launcher reports)
comm.barrier()
on_gpu = os.environ.get("DEVICE") == "cuda"
group = None
if os.environ.get("TORCH_PG") == "1":
    import torch

    from anyccl.torch import ProcessGroup

    group = ProcessGroup(comm)
if on_gpu:
    import torch

    torch.cuda.set_device(comm.device)
    x = torch.ones(int(os.environ.get("NBYTES", 1 << 14)) // 4, device=f"cuda:{comm.device}")
else:
    x = np.ones(int(os.environ.get("NBYTES", 1 << 14)) // 4, np.float32)


def one_op(i: int) -> None:
    """Operation i of the loop: all_reduce, or with MIXED=1 every kind in turn (collectives, a
    ring of sendrecvs, neighbour isend/irecv), so that a kill lands in each of them."""
    kind = only if only is not None else i % 8 if os.environ.get("MIXED") == "1" else 0
    if kind == 0 and group is not None:
        t = torch.ones(64)
        group.allreduce([t]).wait()
        assert bool((t == size).all())
    elif kind == 0:
        x[:] = 1.0
        comm.all_reduce(x)
        if on_gpu:
            torch.cuda.synchronize()
    elif kind == 1:
        comm.broadcast(np.zeros(64), i % size)
    elif kind == 2:
        comm.all_gather(np.zeros(16 * size), np.ones(16))
    elif kind == 3:
        comm.reduce_scatter(np.zeros(16), np.ones(16 * size))
    elif kind == 4:
        comm.all_to_all(np.zeros(8 * size), np.ones(8 * size))
    elif kind == 5:
        comm.sendrecv(np.ones(32), (rank + 1) % size, np.zeros(32), (rank - 1) % size)
    elif kind == 6 and rank ^ 1 < size:
        peer = rank ^ 1
        works = [comm.isend(np.ones(1000), peer, tag=i), comm.irecv(np.zeros(1000), peer, tag=i)]
        for w in works:
            w.wait()
    elif kind == 7:
        comm.barrier()


def die() -> None:
    if os.environ.get("KILL_FILE"):
        with open(os.environ["KILL_FILE"], "a") as f:
            f.write(f"{time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


error = None
until = time.monotonic() + (loop_s or 60.0)
limit = 200 if not (kill_within or loop_s) else 10**7   # the timer or the clock ends these
i = 0
while i < limit and time.monotonic() < until:
    if rank in victims and i == kill_at:
        if kill_within:
            import random
            import threading

            threading.Timer(random.uniform(0, kill_within), die).start()
        else:
            die()
    try:
        one_op(i)
    except anyccl.AnycclError as exc:
        if rank in victims and getattr(exc, "lost_rank", None) in victims - {rank}:
            die()   # another victim died first, within an operation this one had not left yet
                    # (a rank may leave a collective before its peers)
        error = exc
        break
    if i == 0 and os.environ.get("READY_DIR"):   # tell whoever breaks the job that it runs
        Path(os.environ["READY_DIR"], str(rank)).touch()
    i += 1
if error is None:
    sys.exit(f"rank {rank}: no rank was lost after {i} iterations")
caught, caught_wall = time.monotonic(), time.time()
assert comm.failure is not None, "the communicator does not say it broke"   # host or GPU
if rank == during:   # join the shrink, then die: after the agreement (DURING_AT=agree), or
    # after building its side of the new transport, before saying so (DURING_AT=build)
    stage = os.environ.get("DURING_AT", "agree")
    real = getattr(recovery, "_agree" if stage == "agree" else "_all_built")

    def then_die(*args):
        if stage == "agree":
            real(*args)
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(recovery, "_agree" if stage == "agree" else "_all_built", then_die)
if group is not None:
    assert group.errored() is not None
    new_group = group.shrink(timeout=float(os.environ.get("SHRINK_S", "60")))
    new = new_group.comm
    assert (new_group.rank(), new_group.size()) == (new.rank, new.size)
    took = time.monotonic() - caught
else:
    new = comm.shrink(timeout=float(os.environ.get("SHRINK_S", "60")))
    took = time.monotonic() - caught
    comm.close()
n, r = new.size, new.rank
lost = victims | ({during} if during is not None else set())
if os.environ.get("EXPECT_LOST"):
    lost = {int(r) for r in os.environ["EXPECT_LOST"].split(",")}
assert n == size - len(lost), (n, size, lost)
# the old communicator's view of its peers names every rank the shrink left out
assert set(comm.lost_ranks()) >= lost, (comm.lost_ranks(), lost)
assert sorted(new.shrunk_from["lost"]) == sorted(lost), new.shrunk_from
if on_gpu:   # the survivors' GPU communicator, made on this first GPU call
    g = torch.full((1000,), float(r + 1), device=f"cuda:{new.device}")
    new.all_reduce(g)
    torch.cuda.synchronize()
    first = time.monotonic() - caught
    assert bool((g == n * (n + 1) / 2).all()), g[:4]
y = np.full(1000, float(r + 1))
new.all_reduce(y)
if not on_gpu:
    first = time.monotonic() - caught
assert np.all(y == n * (n + 1) / 2)
b = np.full(10, float(r))
new.broadcast(b, n - 1)
assert np.all(b == n - 1)
out = np.zeros(4 * n)
new.all_gather(out, np.full(4, float(r)))
assert np.array_equal(out, np.repeat(np.arange(n, dtype=float), 4))
rs = np.zeros(3)
new.reduce_scatter(rs, np.ones(3 * n))
assert np.all(rs == n)
if n > 1:
    got = np.zeros(5)
    new.sendrecv(np.full(5, float(r)), (r + 1) % n, got, (r - 1) % n)
    assert np.all(got == (r - 1) % n)
assert new.all_gather_object(rank) == sorted(set(range(size)) - lost)
new.barrier()
detect = -1.0
if os.environ.get("KILL_FILE"):
    with open(os.environ["KILL_FILE"]) as f:
        detect = caught_wall - min(float(t) for t in f.read().split())
print(f"rank {rank} of {size} -> rank {r} of {n}: ok lost={sorted(new.shrunk_from['lost'])} "
      f"seconds={took:.3f} first={first:.3f} detect={detect:.3f} on {new.backend}", flush=True)
new.close()
