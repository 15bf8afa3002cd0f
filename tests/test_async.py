"""async_op=True: Work handles, issue order, and overlap with the caller."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

import anyccl


def check_async_collectives_complete_in_issue_order(comm):
    arrays = [np.full(200_000, float(i + comm.rank), np.float32) for i in range(16)]
    works = [comm.all_reduce(a, async_op=True) for a in arrays]
    assert all(isinstance(w, anyccl.Work) for w in works)
    finished_order: list[int] = []
    while len(finished_order) < len(works):
        # asked newest first: a work seen complete means every earlier one was complete then
        done = [w.is_completed() for w in reversed(works)][::-1]
        assert done == sorted(done, reverse=True), f"completed out of issue order: {done}"
        finished_order += [i for i in range(len(finished_order), len(works)) if done[i]]
    assert finished_order == list(range(len(works)))
    for w in works:
        w.wait()
    base = sum(range(comm.size))
    return all((a == comm.size * i + base).all() for i, a in enumerate(arrays))


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_sixteen_async_collectives_complete_in_issue_order(world_size):
    assert all(run_ranks(check_async_collectives_complete_in_issue_order, world_size))


def check_every_collective_accepts_async_op(comm):
    n, r = comm.size, comm.rank
    x = np.full(5, r, np.int64)
    works = [
        comm.all_reduce(x, async_op=True),
        comm.broadcast(np.zeros(3), 0, async_op=True),
        comm.reduce(np.ones(3), 0, async_op=True),
        comm.all_gather(np.empty(2 * n), np.ones(2), async_op=True),
        comm.gather(np.ones(2), [np.empty(2) for _ in range(n)] if r == 0 else None, 0,
                    async_op=True),
        comm.scatter(np.empty(2), [np.ones(2) for _ in range(n)] if r == 0 else None, 0,
                     async_op=True),
        comm.reduce_scatter(np.empty(2), np.ones(2 * n), async_op=True),
        comm.all_to_all(np.empty(2 * n), np.ones(2 * n), async_op=True),
        comm.barrier(async_op=True),
    ]
    for w in works:
        w.wait()
    # blocking calls issued after async ones wait for them and keep the order
    y = np.ones(4)
    comm.all_reduce(y)
    return bool((x == sum(range(n))).all() and (y == n).all())


def test_every_collective_returns_a_work_with_async_op():
    assert all(run_ranks(check_every_collective_accepts_async_op, 3))


def check_wait_timeout_and_exception(comm):
    if comm.rank == 0:
        got = np.empty(4)
        w = comm.irecv(got, 1, tag=9)
        assert not w.is_completed() and w.exception() is None
        try:
            w.wait(timeout=0.2)
        except anyccl.TimeoutError as exc:
            message = str(exc)
        else:
            return "no timeout"
        comm.barrier()  # now rank 1 sends
        w.wait(timeout=30)
        assert (got == 7).all()
        return message
    comm.barrier()
    comm.send(np.full(4, 7.0), 0, tag=9)
    return "sent"


def test_work_wait_with_a_timeout_raises_and_the_op_goes_on():
    message, _ = run_ranks(check_wait_timeout_and_exception, 2)
    assert "is not complete after wait(timeout=0.2)" in message, message
