"""The functions of torch.distributed that anyccl.distributed adds for scripts that use them:
object gather/scatter and point-to-point, batched isend/irecv (P2POp), monitored_barrier, and
torch 2.13's all_gather_single/reduce_scatter_single names, against NumPy references."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from harness import run_ranks

import anyccl
import anyccl.distributed as dist


@contextlib.contextmanager
def _default_group(comm):
    saved, dist.GroupMember.WORLD = dist.GroupMember.WORLD, comm
    try:
        yield
    finally:
        dist.GroupMember.WORLD = saved


def check_object_functions(comm):
    n, r = comm.size, comm.rank
    with _default_group(comm):
        gathered = [None] * n if r == 0 else None
        dist.gather_object({"rank": r, "square": r * r}, gathered, dst=0)
        out = [None]
        dist.scatter_object_list(out, [f"for {q}" for q in range(n)] if r == n - 1 else None,
                                 src=n - 1)
        received = [None, None]
        if r == 0:
            dist.send_object_list([("hello", 1), {"x": [1, 2]}], dst=n - 1)
        if r == n - 1:
            dist.recv_object_list(received, src=0)
        refused = []
        try:
            dist.gather_object(1, [None], dst=r)   # a list of the wrong length on dst
        except ValueError as exc:
            refused.append(str(exc))
    return gathered, out[0], received, refused


@pytest.mark.parametrize("world_size", (2, 3))
def test_object_gather_scatter_and_messages(world_size):
    for r, (gathered, got, received, refused) in enumerate(
            run_ranks(check_object_functions, world_size)):
        if r == 0:
            assert gathered == [{"rank": q, "square": q * q} for q in range(world_size)]
        assert got == f"for {r}"
        if r == world_size - 1:
            assert received == [("hello", 1), {"x": [1, 2]}]
        assert "object_gather_list must be a list of" in refused[0]


def check_batched_ring(comm):
    n, r = comm.size, comm.rank
    with _default_group(comm):
        send = np.full(5, float(r))
        got = np.zeros(5)
        ops = [dist.P2POp(dist.isend, send, (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        whole = np.zeros(3 * n)
        dist.all_gather_single(whole, np.full(3, float(r)))
        part = np.zeros(2)
        dist.reduce_scatter_single(part, np.arange(2.0 * n) + r)
        dist.monitored_barrier(timeout=30)
    return got, whole, part


@pytest.mark.parametrize("world_size", (2, 3))
def test_batched_messages_single_names_and_monitored_barrier(world_size):
    n = world_size
    for r, (got, whole, part) in enumerate(run_ranks(check_batched_ring, n)):
        assert (got == (r - 1) % n).all()
        assert (whole == np.repeat(np.arange(float(n)), 3)).all()
        assert (part == n * np.arange(2 * r, 2 * r + 2) + sum(range(n))).all()


def check_monitored_barrier_timeout(comm):
    with _default_group(comm):
        if comm.rank == 1:
            return "stayed away"
        try:
            dist.monitored_barrier(timeout=0.5)
        except anyccl.TimeoutError as exc:
            return str(exc)
    return "no error"


def test_a_monitored_barrier_raises_when_a_rank_does_not_come():
    message, _ = run_ranks(check_monitored_barrier_timeout, 2, env={"ANYCCL_TIMEOUT": "3"})
    assert "barrier" in message and "not complete after wait(timeout=0.5)" in message
