"""The mpi backend's rings between hosts (backends/mpi.py: _Ring, and the same ring in compiled
code on the backend's ring thread, `_RingThread`): the all_reduce a hierarchical all_reduce runs
between hosts (`all_reduce_start`, from `mpi.split_all_reduce_min`), and on a backend of one
rank per host (`between_hosts`) the reduce_scatter's ring and the broadcast's chain. They must
give NumPy's numbers, the same bits on every rank, for every dtype and op, at sizes that do not
divide by the ranks or the segments and sizes smaller than the ranks; two rings in flight at
once must not take each other's messages, nor the program's own messages on the same tags; a
ring on the thread moves while the rank that started it does something else; a rank that never
joins makes the others raise at their deadline, naming the rank and the step. Runs in the mpi
suite (ANYCCL_TEST_BACKEND=mpi, under mpiexec)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import run_ranks, run_ranks_outcomes, suite_backend

import anyccl
from anyccl.backends.shm import CORE_REDUCTIONS
from anyccl.ops import ReduceOp
from anyccl.trace import OpRecord

pytestmark = pytest.mark.skipif(suite_backend() != "mpi",
                                reason="the mpi backend's ring (ANYCCL_TEST_BACKEND=mpi)")

CASES = [("float32", "sum"), ("float64", "avg"), ("int64", "max"), ("int32", "prod"),
         ("uint8", "bxor"), ("bool", "sum"), ("float16", "min")]
MIN = 1024   # mpi.split_all_reduce_min for these tests: small arrays take the ring too


def _values(count: int, q: int, dtype: np.dtype) -> np.ndarray:
    return ((np.arange(count) * 7 + 3 * q) % 5 + 1).astype(dtype)


def _expected(count: int, n: int, op: str, dtype: np.dtype) -> np.ndarray:
    return _expected_of(np.stack([_values(count, q, dtype) for q in range(n)]), op, dtype)


def _backend(comm, seconds: float = 60.0):
    backend = comm._engine.backend
    record = OpRecord("all_reduce", 0)
    record.deadline = time.monotonic() + seconds
    backend.enter(record)
    return backend


def check_every_dtype_op_and_size(comm) -> list[tuple[str, str, int, bytes]]:
    backend = _backend(comm)
    assert backend._split_min == MIN, backend._split_min
    rows = []
    for name, op in CASES:
        dtype = np.dtype(name)
        for count in (1, comm.size - 1, 1000, 4099, 65537):
            x = _values(count, comm.rank, dtype)
            if x.nbytes < MIN:      # below the split: MPI's own all_reduce, not the ring
                continue
            backend.all_reduce_start(x, ReduceOp[op.upper()])()
            want = _expected(count, comm.size, op, dtype)
            if dtype.kind == "f":
                np.testing.assert_allclose(x.astype(np.float64), want.astype(np.float64),
                                           rtol=2e-3, err_msg=f"{name} {op} x {count}")
            else:
                assert np.array_equal(x, want), f"{name} {op} x {count}"
            rows.append((name, op, count, x.tobytes()))
    return rows


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_dtype_and_op_gives_numpys_result_with_the_same_bits_on_every_rank(n):
    results = run_ranks(check_every_dtype_op_and_size, n,
                        env={"ANYCCL_TUNING": f"mpi.split_all_reduce_min={MIN},"
                                              f"mpi.pair_ring_min={MIN}"})
    assert results[0], "no size reached the ring"
    for rank_rows in results[1:]:
        assert rank_rows == results[0]


SEGMENT = 1000   # mpi.chain_segment for these tests: arrays of several uneven segments


def check_reduce_scatter_and_broadcast_between_hosts(comm) -> list[tuple[str, int, bytes]]:
    backend = _backend(comm)
    backend.between_hosts = True
    n, r = comm.size, comm.rank
    rows = []
    for name, op in CASES:
        dtype = np.dtype(name)
        for count in (1, 257, 4099):
            inputs = [_values(count, r + 7 * i, dtype) for i in range(n)]
            out = np.empty(count, dtype)
            rings = backend._rings
            backend.reduce_scatter(out, inputs, ReduceOp[op.upper()], OpRecord("rs", 0))
            ring = count * n * dtype.itemsize >= MIN \
                and (dtype, ReduceOp[op.upper() if op != "avg" else "SUM"]) in CORE_REDUCTIONS
            assert backend._rings == rings + ring, \
                f"{name} x {count}: the ring ran {backend._rings - rings} times"
            stack = np.stack([_values(count, q + 7 * r, dtype) for q in range(n)])
            want = _expected_of(stack, op, dtype)
            if dtype.kind == "f":
                np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64),
                                           rtol=2e-3, err_msg=f"{name} {op} x {count}")
            else:
                assert np.array_equal(out, want), f"{name} {op} x {count}"
            rows.append((f"reduce_scatter {name} {op} to {r}", count, out.tobytes()))
    for root in range(n):
        for nbytes in (1, SEGMENT, 5 * SEGMENT + 3, 100_003):
            x = np.full(nbytes, 0, np.uint8) if r != root \
                else ((np.arange(nbytes) * 31 + root) % 251).astype(np.uint8)
            # a 2-D view of the same bytes where it divides, as a broadcast of any shape
            arg = x.reshape(-1, 3) if nbytes % 3 == 0 else x
            rings = backend._rings
            backend.broadcast(arg, root, OpRecord("broadcast", 0))
            assert backend._rings == rings + (nbytes >= MIN), (root, nbytes)
            want = ((np.arange(nbytes) * 31 + root) % 251).astype(np.uint8)
            assert np.array_equal(x, want), (root, nbytes)
            rows.append((f"broadcast from {root}", nbytes, x.tobytes()))
    return rows


def _expected_of(stack: np.ndarray, op: str, dtype: np.dtype) -> np.ndarray:
    if op == "avg":
        return (stack.astype(np.float64).sum(0) / len(stack)).astype(dtype)
    fold = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
            "bxor": np.bitwise_xor}[op]
    return fold.reduce(stack, axis=0, dtype=dtype)


@pytest.mark.parametrize("n", [3, 4])
def test_between_hosts_reduce_scatter_and_broadcast_run_as_rings_with_numpys_result(n):
    results = run_ranks(check_reduce_scatter_and_broadcast_between_hosts, n,
                        env={"ANYCCL_TUNING": f"mpi.split_all_reduce_min={MIN},"
                                              f"mpi.chain_broadcast_min={MIN},"
                                              f"mpi.chain_segment={SEGMENT}"})
    broadcasts = [[row for row in rows if row[0].startswith("broadcast")] for rows in results]
    assert broadcasts[0] and all(b == broadcasts[0] for b in broadcasts[1:])


def check_rings_in_flight_beside_messages(comm) -> tuple[bool, bool, list[float]]:
    backend = _backend(comm)
    a = np.full(50_000, comm.rank + 1.0, np.float32)
    b = np.full(30_001, 10.0 * (comm.rank + 1), np.float64)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    # the program's own messages, on tag 0 (the first ring's tag too), around the rings
    sent = comm.isend(np.full(4, comm.rank, np.int64), right, tag=0)
    got = np.zeros(4, np.int64)
    first = backend.all_reduce_start(a, ReduceOp.SUM)
    second = backend.all_reduce_start(b, ReduceOp.SUM)   # both in flight
    second()
    first()
    comm.recv(got, left, tag=0)
    sent.wait()
    total = comm.size * (comm.size + 1) / 2
    return bool((a == total).all()), bool((b == 10 * total).all()), got.tolist()


def test_two_rings_in_flight_and_the_programs_messages_do_not_mix():
    n = 3
    for rank, (a_ok, b_ok, got) in enumerate(
            run_ranks(check_rings_in_flight_beside_messages, n,
                      env={"ANYCCL_TUNING": f"mpi.split_all_reduce_min={MIN}"})):
        assert a_ok and b_ok, rank
        assert got == [(rank - 1) % n] * 4, (rank, got)


def check_a_ring_moves_while_its_rank_is_busy(comm) -> tuple[float, bool, bool]:
    """Rank 0 starts the ring, then is busy for 2.5 s before it waits for it; the others wait
    at once. (seconds the others waited, on the thread, right)."""
    backend = _backend(comm)
    x = np.full(1 << 18, comm.rank + 1.0, np.float32)
    finish = backend.all_reduce_start(x, ReduceOp.SUM)
    threaded = type(backend._ring_thread).__name__ == "_RingThread"
    if comm.rank == 0:
        time.sleep(2.5)            # the ring's messages must still move
    started = time.monotonic()
    finish()
    waited = time.monotonic() - started
    comm.barrier()
    return waited, threaded, bool((x == comm.size * (comm.size + 1) / 2).all())


@pytest.mark.parametrize("n", [2, 3])
def test_a_ring_on_the_thread_moves_while_the_rank_that_started_it_is_busy(n):
    for rank, (waited, threaded, right) in enumerate(
            run_ranks(check_a_ring_moves_while_its_rank_is_busy, n)):
        assert threaded and right, rank
        if rank:
            assert waited < 1.5, f"rank {rank} waited {waited:.2f} s for a ring rank 0 started"


def check_a_rank_that_never_joins(comm) -> str | None:
    backend = _backend(comm, seconds=3.0)
    try:
        if comm.rank == 2:
            time.sleep(5)
            return None
        try:
            backend.all_reduce_start(np.ones(100_000, np.float32), ReduceOp.SUM)()
        except anyccl.TimeoutError as exc:
            return str(exc)
        return "finished"
    finally:   # the ring's messages are left unmatched: this job ends here
        comm.abort()


def test_a_rank_that_never_joins_is_named_at_the_deadline():
    outcomes = run_ranks_outcomes(check_a_rank_that_never_joins, 3,
                                  env={"ANYCCL_TUNING": f"mpi.split_all_reduce_min={MIN}",
                                       "ANYCCL_TIMEOUT": "31"})
    for rank in (0, 1):
        error = outcomes[rank]
        assert isinstance(error, str) and error.startswith(f"rank {rank}: "), (rank, error)
        assert "all_reduce ring" in error, error
