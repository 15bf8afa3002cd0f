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
            assert dist.recv_object_list(received) == 0   # from any rank: names the sender
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


# ---- all_to_all with split sizes ------------------------------------------------------------
def _splits(n: int, r: int) -> list[int]:
    """What rank r sends to each rank: (r + 2 * j) % 4 elements to rank j (zeros included)."""
    return [(r + 2 * j) % 4 for j in range(n)]


def check_uneven_all_to_all(comm, matrix_ranks: int):
    from anyccl.algorithms import uneven

    saved, uneven._MATRIX_RANKS = uneven._MATRIX_RANKS, matrix_ranks
    try:
        return _uneven_all_to_all(comm)
    finally:
        uneven._MATRIX_RANKS = saved


def _uneven_all_to_all(comm):
    n, r = comm.size, comm.rank
    sends = _splits(n, r)
    receives = [_splits(n, j)[r] for j in range(n)]
    inp = np.concatenate([np.full(c, 100.0 * r + j) for j, c in enumerate(sends)]) \
        if sum(sends) else np.zeros(0)
    out = np.full(sum(receives), -1.0)
    comm.all_to_all(out, inp, out_splits=receives, in_splits=sends)
    with _default_group(comm):
        rows = np.full((sum(receives), 2), -1.0)
        dist.all_to_all_single(rows, np.repeat(inp[:, None], 2, axis=1), receives, sends)
    refused = []
    for call in (lambda: comm.all_to_all(out, inp, out_splits=receives[:-1], in_splits=sends),
                 lambda: comm.all_to_all(out, inp, out_splits=[c + 1 for c in receives],
                                         in_splits=sends)):
        try:
            call()
        except anyccl.InvalidArgumentError as exc:
            refused.append(str(exc))
    # every rank passes counts that fit its arrays, but rank 0 expects one element from
    # itself and none from rank 1, which sends it one: all ranks raise together, none hangs
    bad = list(receives)
    if r == 0:
        bad[0], bad[1] = bad[0] + 1, bad[1] - 1     # receives[0] is 0, receives[1] is 1
    try:
        comm.all_to_all(out, inp, out_splits=bad, in_splits=sends)
    except anyccl.InvalidArgumentError as exc:
        refused.append(str(exc))
    return out, rows, refused


@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("matrix_ranks", (64, 1))   # counts agreed in one all_reduce, or not
def test_uneven_all_to_all_moves_every_piece_and_refuses_disagreeing_splits(world_size,
                                                                           matrix_ranks):
    n = world_size
    for r, (out, rows, refused) in enumerate(run_ranks(check_uneven_all_to_all, n,
                                                       matrix_ranks)):
        expected = np.concatenate([np.full(_splits(n, j)[r], 100.0 * j + r) for j in range(n)])
        assert (out == expected).all(), (r, out, expected)
        assert (rows == expected[:, None]).all(), (r, rows)
        assert "out_splits=" in refused[0] and "must hold" in refused[0]
        assert "out_splits add up to" in refused[1]
        assert "split sizes of the ranks do not match" in refused[2], refused[2]
        if r == 0:
            assert "rank 0 sends 0 where out_splits[0]=1" in refused[2], refused[2]


# ---- all_gather, gather and scatter with a size per rank -------------------------------------
def check_v_forms(comm):
    n, r = comm.size, comm.rank
    size = lambda j: 2 * j + 1  # noqa: E731 - rank j's size
    mine = np.arange(size(r), dtype=np.float32) + 100 * r
    gathered = [np.full(size(j), -1, np.float32) for j in range(n)]
    comm.all_gather(gathered, mine)
    at_root = [np.full(size(j), -1, np.float32) for j in range(n)] if r == n - 1 else None
    comm.gather(mine, at_root, n - 1, uneven=True)
    out = np.full(size(r), -1, np.float32)
    chunks = [np.full(size(j), 10.0 * j, np.float32) for j in range(n)] if r == 0 else None
    comm.scatter(out, chunks, 0, uneven=True)
    refused = []
    wrong = [np.zeros(size(j) + (1 if j == 0 and r == 1 else 0), np.float32) for j in range(n)]
    try:   # rank 1 expects one element too many from rank 0: every rank raises
        comm.all_gather(wrong, mine)
    except anyccl.InvalidArgumentError as exc:
        refused.append(str(exc))
    return gathered, at_root, out, refused


@pytest.mark.parametrize("world_size", (2, 3))
def test_all_gather_gather_and_scatter_with_a_size_per_rank(world_size):
    n = world_size
    for r, (gathered, at_root, out, refused) in enumerate(run_ranks(check_v_forms, n)):
        expected = [np.arange(2 * j + 1, dtype=np.float32) + 100 * j for j in range(n)]
        assert all((g == e).all() for g, e in zip(gathered, expected)), (r, gathered)
        if r == n - 1:
            assert all((g == e).all() for g, e in zip(at_root, expected)), at_root
        assert (out == 10.0 * r).all() and out.size == 2 * r + 1
        assert len(refused) == 1 and "the sizes do not match" in refused[0], refused
        if r == 1:
            assert "rank 0 has 1 elements where this rank's list holds 2" in refused[0]


def test_a_call_before_init_process_group_says_so_as_torch_does():
    import anyccl.distributed as dist

    if dist.is_initialized():
        pytest.skip("an earlier test of this process initialized the default group")
    with pytest.raises(anyccl.NotInitializedError, match="call init_process_group\\(\\) first") \
            as raised:
        dist.all_reduce(np.ones(2))
    assert isinstance(raised.value, ValueError)   # what torch.distributed raises there
    with pytest.raises(anyccl.NotInitializedError):
        dist.get_rank()


def test_torch_s_names_of_every_reduce_op_are_understood():
    """torch.distributed.ReduceOp.PRODUCT (torch's name of PROD) and anyccl.distributed's own
    ReduceOp.PRODUCT both mean PROD; an op anyccl lacks (PREMUL_SUM) is refused by name."""
    torch = pytest.importorskip("torch")
    names = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
    for name in names:
        ours = anyccl.ReduceOp.parse(getattr(torch.distributed.ReduceOp, name))
        assert ours is anyccl.ReduceOp.parse(name) is getattr(dist.ReduceOp, name)
    assert dist.ReduceOp.PRODUCT is anyccl.ReduceOp.PROD
    with pytest.raises(anyccl.UnsupportedError, match="PREMUL_SUM"):
        anyccl.ReduceOp.parse(torch.distributed.ReduceOp.PREMUL_SUM)
    comm = anyccl.init("shm")
    x = np.full(3, 5.0)
    comm.all_reduce(x, torch.distributed.ReduceOp.PRODUCT)   # one rank: x as it was
    comm.close()
    assert (x == 5.0).all()
