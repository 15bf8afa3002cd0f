"""The mpi backend's all_reduce ring (backends/mpi.py: _Ring), what a hierarchical all_reduce
runs between hosts on 3 ranks or more (`all_reduce_start`, from `mpi.split_all_reduce_min`):
it must give NumPy's numbers, the same bits on every rank, for every dtype and op, at sizes
that do not divide by the ranks and sizes smaller than the ranks; two rings in flight at once
must not take each other's messages, nor the program's own messages on the same tags; a rank
that never joins makes the others raise at their deadline, naming the rank and the step. Runs
in the mpi suite (ANYCCL_TEST_BACKEND=mpi, under mpiexec)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import run_ranks, run_ranks_outcomes, suite_backend

import anyccl
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
    stack = np.stack([_values(count, q, dtype) for q in range(n)])
    if op == "avg":
        return (stack.astype(np.float64).sum(0) / n).astype(dtype)
    fold = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
            "bxor": np.bitwise_xor}[op]
    return fold.reduce(stack, axis=0, dtype=dtype)


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


@pytest.mark.parametrize("n", [3, 4])
def test_every_dtype_and_op_gives_numpys_result_with_the_same_bits_on_every_rank(n):
    results = run_ranks(check_every_dtype_op_and_size, n,
                        env={"ANYCCL_TUNING": f"mpi.split_all_reduce_min={MIN}"})
    assert results[0], "no size reached the ring"
    for rank_rows in results[1:]:
        assert rank_rows == results[0]


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
