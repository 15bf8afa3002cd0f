"""The mpi backend's agreement in an envelope (backends/mpi.py: Envelope): every host collective
first all-reduces an envelope -- its signature, and for an all_reduce small enough to fit, its
data -- with anyccl's compiled MPI op, so that a small all_reduce is one MPI call. It must give
the numbers NumPy gives for every dtype and op the core reduces, at sizes on both sides of the
envelope's room, and still refuse every mismatch on every rank, also between an all_reduce
that rides in the envelope and one that does not. Runs in the mpi suite (ANYCCL_TEST_BACKEND=mpi,
under mpiexec)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks, suite_backend

import anyccl

pytestmark = pytest.mark.skipif(suite_backend() != "mpi",
                                reason="the mpi backend's agreement (ANYCCL_TEST_BACKEND=mpi)")

DTYPES = ("float32", "float64", "int8", "int32", "int64", "uint8", "uint64", "float16")
OPS = ("sum", "avg", "prod", "min", "max", "band", "bxor")


class _Counting:
    """The backend's MPI communicator, counting the all-reduces started on it, the envelope's
    (a persistent request, started by the backend's `_start_envelope`) among them."""

    def __init__(self, backend) -> None:
        self._comm, self.calls = backend._comm, 0
        start = backend._start_envelope

        def start_envelope():
            self.calls += 1
            return start()
        backend._comm, backend._start_envelope = self, start_envelope

    def Iallreduce(self, *args):   # noqa: N802 - mpi4py's name
        self.calls += 1
        return self._comm.Iallreduce(*args)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _expected(values: list[np.ndarray], op: str, dtype: np.dtype) -> np.ndarray:
    stack = np.stack(values)
    if op == "avg":
        return (stack.astype(np.float64).sum(0) / len(values)).astype(dtype)
    fold = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
            "band": np.bitwise_and, "bxor": np.bitwise_xor}[op]
    return fold.reduce(stack, axis=0, dtype=dtype)


def check_every_dtype_and_op_around_the_room(comm) -> tuple[int, list[tuple[str, str, int, int]]]:
    backend = comm._engine.backend
    env = backend._envelope
    assert env is not None, "no envelope: the compiled core or the MPI library was not found"
    counting = _Counting(backend)
    rows = []
    for name in DTYPES:
        dtype = np.dtype(name)
        room = env.room // dtype.itemsize
        for op in OPS:
            for count in (0, 1, 7, room, room + 1, 3 * room):
                values = [((np.arange(count) * 7 + 3 * q) % 11 + 1).astype(dtype)
                          for q in range(comm.size)]
                x = values[comm.rank].copy()
                counting.calls = 0
                try:
                    comm.all_reduce(x, op=op)
                except anyccl.UnsupportedError:
                    assert dtype.kind in "iuf" and (op in ("band", "bxor") or
                                                    op == "avg" and dtype.kind in "iu")
                    continue
                want = _expected(values, op, dtype)
                if dtype.kind == "f":
                    np.testing.assert_allclose(x, want, rtol=2e-3,
                                               err_msg=f"{name} {op} x {count}")
                else:
                    assert np.array_equal(x, want), f"{name} {op} x {count}"
                rows.append((name, op, count, counting.calls))
    return env.room, rows


def test_every_dtype_and_op_gives_numpys_result_and_small_ones_take_one_mpi_call():
    for room, rows in run_ranks(check_every_dtype_and_op_around_the_room, 2):
        for name, op, count, calls in rows:
            carried = name != "float16" and count * np.dtype(name).itemsize <= room
            assert calls == (1 if carried else 2), (name, op, count, calls)


def check_mismatch_across_the_room(comm, case: str) -> tuple[str | None, bool, bool]:
    room = comm._engine.backend._envelope.room // 4
    x = np.ones(room + 1, np.float32)
    before = x.copy()
    try:
        if case == "count":        # rides in the envelope on rank 0 only
            comm.all_reduce(x[:room] if comm.rank == 0 else x)
        elif case == "carried vs broadcast":
            if comm.rank == 0:
                comm.all_reduce(x[:room])
            else:
                comm.broadcast(x[:room], 0)
        else:                      # the same bytes, another dtype
            comm.all_reduce(x[:room] if comm.rank == 0 else x[:room].view(np.int32))
    except anyccl.CollectiveMismatchError as exc:
        error = str(exc)
    else:
        error = None
    y = np.full(3, comm.rank + 1.0)
    comm.all_reduce(y)
    return error, bool((x == before).all()), bool((y == comm.size * (comm.size + 1) / 2).all())


@pytest.mark.parametrize("case", ["count", "carried vs broadcast", "dtype"])
def test_a_mismatch_across_the_envelopes_room_is_refused_on_every_rank(case):
    for rank, (error, untouched, usable) in enumerate(
            run_ranks(check_mismatch_across_the_room, 3, case)):
        assert error is not None and error.startswith(f"rank {rank}: "), (rank, error)
        assert "disagree" in error, error
        assert untouched and usable, (rank, untouched, usable)


def check_one_rank_without_the_envelope(comm) -> tuple[bool, str | None, bool]:
    from anyccl.backends import mpi

    if comm.rank == 1:      # as if this rank's compiled core or MPI library were missing
        mpi._envelope[:] = [None]
    sub = comm.split(0)
    try:
        plain = sub._engine.backend._envelope is None
        x = np.full(3, comm.rank + 1.0)
        sub.all_reduce(x)
        try:
            sub.all_reduce(np.ones(3 + comm.rank, np.float32))
        except anyccl.CollectiveMismatchError as exc:
            error = str(exc)
        else:
            error = None
        return plain, error, bool((x == comm.size * (comm.size + 1) / 2).all())
    finally:
        sub.close()
        mpi._envelope.clear()   # made again for the next test


def test_where_one_rank_cannot_make_the_envelope_every_rank_agrees_without_it():
    for rank, (plain, error, right) in enumerate(
            run_ranks(check_one_rank_without_the_envelope, 2)):
        assert plain, f"rank {rank} kept the envelope that rank 1 could not make"
        assert error is not None and "disagree" in error, (rank, error)
        assert right, rank
