"""The mpi backend's agreement in an envelope (backends/mpi.py: Envelope): every host collective
first all-reduces an envelope -- its signature, and for an all_reduce small enough to fit, its
data -- with anyccl's compiled MPI op, so that a small all_reduce is one MPI call. It must give
the numbers NumPy gives for every dtype and op the core reduces, at sizes on both sides of the
envelope's room, and still refuse every mismatch on every rank, also between an all_reduce
that rides in the envelope and one that does not. A broadcast or all_gather whose bytes fit rides
in it too (bitwise OR over bytes, every other rank's place zero). The blocking all_reduce that
fits runs whole
in compiled code (`_shmcore.hot` with `MpiStep`): the same numbers, the same refusals, with a
rank on it beside a rank on the Python path, and the same deadline where a peer never comes.
Runs in the mpi suite (ANYCCL_TEST_BACKEND=mpi, under mpiexec)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks, run_ranks_outcomes, suite_backend

import anyccl

pytestmark = pytest.mark.skipif(suite_backend() != "mpi",
                                reason="the mpi backend's agreement (ANYCCL_TEST_BACKEND=mpi)")

DTYPES = ("float32", "float64", "int8", "int32", "int64", "uint8", "uint64", "float16")
OPS = ("sum", "avg", "prod", "min", "max", "band", "bxor")
SMALL_HOT_MAX = {"ANYCCL_TUNING": "mpi.hot_max=64K"}   # the sizes around it stay small


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

    def Ibcast(self, *args):   # noqa: N802 - mpi4py's name
        self.calls += 1
        return self._comm.Ibcast(*args)

    def Iallgather(self, *args):   # noqa: N802 - mpi4py's name
        self.calls += 1
        return self._comm.Iallgather(*args)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _expected(values: list[np.ndarray], op: str, dtype: np.dtype) -> np.ndarray:
    stack = np.stack(values)
    if op == "avg":
        return (stack.astype(np.float64).sum(0) / len(values)).astype(dtype)
    fold = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
            "band": np.bitwise_and, "bxor": np.bitwise_xor}[op]
    return fold.reduce(stack, axis=0, dtype=dtype)


def _assert_reduced(x: np.ndarray, want: np.ndarray, what: str) -> None:
    if x.dtype.kind == "f":
        np.testing.assert_allclose(x, want, rtol=2e-3, err_msg=what)
    else:
        assert np.array_equal(x, want), what


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
                _assert_reduced(x, _expected(values, op, dtype), f"{name} {op} x {count}")
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


def check_the_compiled_call(comm) -> tuple[list[tuple[str, str, int, int, int]], int]:
    """Every dtype and op the envelope carries, by ReduceOp (the compiled call takes those;
    a name such as "sum" takes the Python path), at sizes around the room and around
    `mpi.hot_max`: (name, op, count, envelopes and data calls the compiled step started for
    it) and the step's count at the end."""
    assert comm._hot is not None, "no compiled call: the core or the MPI library's calls"
    step = comm._hot[2]
    room, most = comm._engine.backend._envelope.room, step.data_max
    assert most == 64 << 10, most
    rows = []
    for name in DTYPES:
        dtype = np.dtype(name)
        for op in OPS:
            for count in (0, 1, 7, room // dtype.itemsize, room // dtype.itemsize + 1,
                          1001, most // dtype.itemsize, most // dtype.itemsize + 1):
                values = [((np.arange(count) * 7 + 3 * q) % 11 + 1).astype(dtype)
                          for q in range(comm.size)]
                x = values[comm.rank].copy()
                before, data_before = step.starts, step.data_starts
                try:
                    comm.all_reduce(x, anyccl.ReduceOp[op.upper()])
                except anyccl.UnsupportedError:
                    continue
                _assert_reduced(x, _expected(values, op, dtype), f"{name} {op} x {count}")
                rows.append((name, op, count, step.starts - before,
                             step.data_starts - data_before))
    y, before = np.full(2, comm.rank, np.float32), step.starts
    comm.broadcast(y, 1)                               # broadcast and all_gather: compiled too
    assert y.tolist() == [1.0, 1.0] and step.starts == before + 1, (y, step.starts - before)
    out = np.zeros(2 * comm.size, np.float32)
    comm.all_gather(out, np.full(2, comm.rank + 1.0, np.float32))
    assert out.tolist() == [q + 1.0 for q in range(comm.size) for _ in range(2)], out
    assert step.starts == before + 2, step.starts - before
    return rows, step.starts


def test_the_compiled_call_gives_numpys_result_and_takes_what_fits():
    """Up to the room: one envelope with the data in it. Up to mpi.hot_max: the envelope with
    the signature, then the data call, both from compiled code. float16 (reduced by anyccl's
    Python kernel) and larger arrays: the Python path."""
    for rows, _ in run_ranks(check_the_compiled_call, 2, env=SMALL_HOT_MAX):
        for name, op, count, started, data in rows:
            nbytes = count * np.dtype(name).itemsize
            if name == "float16" or nbytes > 64 << 10:
                want = (0, 0)
            else:
                want = (1, 0) if nbytes <= 64 else (1, 1)
            assert (started, data) == want, (name, op, count, started, data)


def check_large_calls(comm) -> list[tuple[str, int, bool]]:
    """At the default `mpi.hot_max`, MiB-sized calls through the compiled step, each in place
    on x (MPI_IN_PLACE, nothing copied aside): (what, data calls started for it, right)."""
    step, rows = comm._hot[2], []
    n, me = 1 << 18, comm.rank
    values = [(np.arange(n, dtype=np.float32) % 13) + q for q in range(comm.size)]

    def counted(what: str, call, check) -> None:
        before = step.data_starts
        call()
        rows.append((what, step.data_starts - before, bool(check())))
    x = values[me].copy()
    counted("all_reduce sum", lambda: comm.all_reduce(x, anyccl.ReduceOp.SUM),
            lambda: np.array_equal(x, sum(values)))
    y = values[me].copy()
    counted("all_reduce avg", lambda: comm.all_reduce(y, anyccl.ReduceOp.AVG),
            lambda: np.allclose(y, sum(values) / comm.size))
    b = values[me].copy()
    counted("broadcast", lambda: comm.broadcast(b, 1), lambda: np.array_equal(b, values[1]))
    out = np.full(comm.size * n, -1.0, np.float32)
    out[me * n:(me + 1) * n] = values[me]
    counted("all_gather, x its own piece of out",
            lambda: comm.all_gather(out, out[me * n:(me + 1) * n]),
            lambda: np.array_equal(out, np.concatenate(values)))
    z = np.zeros(n + 1, np.float32) + me            # shapes differ: refused before any data
    try:
        comm.all_reduce(z if me == 0 else z[:n], anyccl.ReduceOp.SUM)
        refused = False
    except anyccl.CollectiveMismatchError:
        refused = True
    rows.append(("mismatch refused", 0, refused and bool((z == me).all())))
    return rows


def test_mib_sized_calls_run_in_place_in_the_compiled_step():
    for rank, rows in enumerate(run_ranks(check_large_calls, 2)):
        for what, data_calls, right in rows:
            assert right, (rank, what)
            assert data_calls == (0 if what == "mismatch refused" else 1), (rank, what)


def check_compiled_beside_python(comm, case: str) -> tuple[str | None, list[float], int]:
    """Rank 0 on the compiled call, rank 1 on the Python path (the op by name): the same
    envelope either way. case "agree": the result; "dtype": rank 1 another dtype."""
    step = comm._hot[2]
    x = np.full(4, comm.rank + 1.0, np.float32)
    if case == "dtype" and comm.rank == 1:
        x = x.astype(np.float64)
    try:
        comm.all_reduce(x, anyccl.ReduceOp.SUM if comm.rank == 0 else "sum")
    except anyccl.CollectiveMismatchError as exc:
        error = str(exc)
    else:
        error = None
    y = np.full(2, comm.rank + 1.0)
    comm.all_reduce(y, anyccl.ReduceOp.AVG)
    return error, x.tolist() + y.tolist(), step.starts


@pytest.mark.parametrize("case", ["agree", "dtype"])
def test_a_rank_on_the_compiled_call_and_one_on_the_python_path_agree(case):
    for rank, (error, values, starts) in enumerate(
            run_ranks(check_compiled_beside_python, 2, case)):
        if case == "agree":
            assert error is None and values == [3.0] * 4 + [1.5, 1.5], (rank, error, values)
        else:
            assert error is not None and error.startswith(f"rank {rank}: "), (rank, error)
            assert "disagree" in error and values[4:] == [1.5, 1.5], (rank, error, values)
        assert starts >= (2 if rank == 0 else 1), (rank, starts)


def check_a_peer_that_never_comes(comm) -> str | None:
    import time

    if comm.rank == 1:
        time.sleep(4)
        return None
    try:
        comm.all_reduce(np.ones(2, np.float32), anyccl.ReduceOp.SUM)
    except anyccl.TimeoutError as exc:
        return str(exc)
    return "finished"


def test_the_compiled_call_waits_until_the_deadline_and_names_the_operation():
    outcomes = run_ranks_outcomes(check_a_peer_that_never_comes, 2,
                                  env={"ANYCCL_TIMEOUT": "2"})
    error = outcomes[0]
    assert isinstance(error, str) and error.startswith("rank 0: all_reduce(float32 x 2"), error
    assert "timed out" in error, error


def check_broadcast_and_all_gather_around_the_room(comm) -> list[tuple[str, str, int, int]]:
    backend = comm._engine.backend
    room = backend._envelope.room
    counting = _Counting(backend)
    step = comm._hot[2]        # the compiled call's envelopes count too
    rows = []
    n = comm.size

    def calls(before: int) -> int:   # envelopes and data calls, from Python and compiled code
        return counting.calls + step.starts + step.data_starts - before
    for name in ("float32", "int8", "float16", "uint64", "bool"):
        dtype = np.dtype(name)
        per = room // dtype.itemsize
        for count in (0, 1, per, per + 1):
            values = [((np.arange(count) * 5 + 7 * q) % 13).astype(dtype) for q in range(n)]
            x = values[comm.rank].copy()
            counting.calls, before = 0, step.starts + step.data_starts
            comm.broadcast(x, n - 1)
            assert np.array_equal(x, values[n - 1]), f"broadcast {name} x {count}"
            rows.append(("broadcast", name, count * dtype.itemsize, calls(before)))
        for count in (0, 1, per // n, per // n + 1):
            values = [((np.arange(count) * 5 + 7 * q) % 13).astype(dtype) for q in range(n)]
            outs = [np.full(count, 99, dtype) for _ in range(n)]
            counting.calls, before = 0, step.starts + step.data_starts
            comm.all_gather(outs, values[comm.rank].copy())
            for q in range(n):
                assert np.array_equal(outs[q], values[q]), f"all_gather {name} x {count}: {q}"
            rows.append(("all_gather", name, n * count * dtype.itemsize, calls(before)))
            out = np.full(n * count, 99, dtype)      # into one array (the compiled call)
            counting.calls, before = 0, step.starts + step.data_starts
            comm.all_gather(out, values[comm.rank].copy())
            assert np.array_equal(out, np.concatenate(values)), f"all_gather into one {name}"
            rows.append(("all_gather into one", name, n * count * dtype.itemsize,
                         calls(before)))
            whole = np.zeros((n, count), dtype)      # in place: x is this rank's row
            whole[comm.rank] = values[comm.rank]
            comm.all_gather(list(whole), whole[comm.rank])
            assert np.array_equal(whole, np.stack(values)), f"all_gather in place {name}"
            columns = np.zeros((count, n), dtype)    # outputs that are strided columns
            comm.all_gather([columns[:, q] for q in range(n)], values[comm.rank])
            assert np.array_equal(columns.T, np.stack(values)), f"all_gather columns {name}"
    return rows


@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_and_all_gather_that_fit_ride_in_the_envelope(n):
    for rank_rows in run_ranks(check_broadcast_and_all_gather_around_the_room, n):
        for op, name, span, calls in rank_rows:
            assert calls == (1 if span <= 64 else 2), (op, name, span, calls)


def check_carried_mismatches(comm, case: str) -> str | None:
    x = np.ones(4, np.float32)
    try:
        if case == "root":
            comm.broadcast(x, comm.rank)
        elif case == "broadcast vs all_gather":
            if comm.rank == 0:
                comm.broadcast(x, 0)
            else:
                comm.all_gather([np.zeros(4, np.float32) for _ in range(comm.size)], x)
        else:   # all_gather pieces of different sizes
            comm.all_gather([np.zeros(2 + comm.rank, np.float32) for _ in range(comm.size)],
                            np.ones(2 + comm.rank, np.float32))
    except anyccl.CollectiveMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case", ["root", "broadcast vs all_gather", "piece sizes"])
def test_a_carried_broadcast_or_all_gather_that_disagrees_is_refused_on_every_rank(case):
    for rank, error in enumerate(run_ranks(check_carried_mismatches, 2, case)):
        assert error is not None and error.startswith(f"rank {rank}: "), (rank, error)
        assert "disagree" in error, error


def check_past_the_room_mismatches(comm, case: str) -> tuple[str | None, bool]:
    """Mismatches of collectives too large for the envelope, on the compiled call: only the
    signature rides, and the data call must never start."""
    step = comm._hot[2]
    data_before = step.data_starts
    x = np.ones(100 + (100 * comm.rank if case == "count" else 0), np.float32)
    try:
        if case == "count":
            comm.all_reduce(x, anyccl.ReduceOp.SUM)
        elif case == "broadcast vs all_gather":
            if comm.rank == 0:
                comm.broadcast(x, 0)
            else:
                comm.all_gather(np.zeros(100 * comm.size, np.float32), x)
        else:   # the root
            comm.broadcast(x, comm.rank)
    except anyccl.CollectiveMismatchError as exc:
        error = str(exc)
    else:
        error = None
    y = np.full(300, comm.rank + 1.0)
    comm.all_reduce(y, anyccl.ReduceOp.SUM)
    usable = bool((y == comm.size * (comm.size + 1) / 2).all())
    return error, usable and step.data_starts == data_before + 1


@pytest.mark.parametrize("case", ["count", "broadcast vs all_gather", "root"])
def test_past_the_room_a_mismatch_is_refused_on_every_rank_before_any_data_moves(case):
    for rank, (error, usable) in enumerate(run_ranks(check_past_the_room_mismatches, 2, case)):
        assert error is not None and error.startswith(f"rank {rank}: "), (rank, error)
        assert "disagree" in error, error
        assert usable, rank


def check_late_peers_past_the_room(comm, late: str) -> list[str]:
    """Rank 1 comes late to collectives past the room: "envelope" (it calls 0.3 s late, so
    rank 0's envelope is not back within the spin and Python makes the data call), or "data"
    (it runs the Python path and starts its data call 0.3 s after the envelope, so rank 0's
    compiled data call is not done within the spin and Python completes its request)."""
    import time

    backend = comm._engine.backend
    if comm.rank == 1 and late == "data":
        for name in ("_all_reduce_call", "_broadcast_call", "_all_gather_call"):
            call = getattr(backend, name)

            def later(*args, call=call):
                time.sleep(0.3)
                return call(*args)
            setattr(backend, name, later)
    wrong = []
    op = anyccl.ReduceOp.AVG if comm.rank == 0 or late == "envelope" else "avg"
    for count in (17, 4000):
        if comm.rank == 1 and late == "envelope":
            time.sleep(0.3)
        x = np.arange(count, dtype=np.float64) + comm.rank
        comm.all_reduce(x, op)
        if not np.allclose(x, np.arange(count) + (comm.size - 1) / 2):
            wrong.append(f"all_reduce x {count}")
        if comm.rank == 1 and late == "envelope":
            time.sleep(0.3)
        y = np.arange(count, dtype=np.int32) * (comm.rank + 1)
        comm.broadcast(y, 1)
        if not np.array_equal(y, np.arange(count) * 2):
            wrong.append(f"broadcast x {count}")
        if comm.rank == 1 and late == "envelope":
            time.sleep(0.3)
        out = np.zeros(count * comm.size, np.int16)
        comm.all_gather(out, np.full(count, comm.rank + 5, np.int16))
        if not np.array_equal(out, np.repeat(np.arange(comm.size) + 5, count)):
            wrong.append(f"all_gather x {count}")
    return wrong


@pytest.mark.parametrize("late", ["envelope", "data"])
def test_past_the_room_a_late_peer_is_waited_for_in_python_with_the_same_result(late):
    for rank, wrong in enumerate(run_ranks(check_late_peers_past_the_room, 2, late)):
        assert wrong == [], (rank, wrong)


def check_compiled_beside_python_past_the_room(comm) -> list[str]:
    """Past the room, rank 0 on the compiled call and rank 1 on the Python path (an op by
    name, a strided array, a list of outputs): both send the signature alone, then make the
    same MPI call."""
    step = comm._hot[2]
    compiled, before = comm.rank == 0, step.data_starts
    wrong = []
    x = np.arange(1000, dtype=np.float32) + comm.rank
    comm.all_reduce(x, anyccl.ReduceOp.SUM if compiled else "sum")
    if not np.array_equal(x, 2 * np.arange(1000) + 1):
        wrong.append("all_reduce")
    whole = np.zeros(2000, np.int32)
    y = whole[::2] if not compiled else whole[:1000]
    y[:] = np.arange(1000) * (comm.rank + 1)
    comm.broadcast(y, 1)
    if not np.array_equal(y, np.arange(1000) * 2):
        wrong.append("broadcast")
    piece = np.full(300, comm.rank + 3, np.int16)
    if compiled:
        out = np.zeros(300 * comm.size, np.int16)
        comm.all_gather(out, piece)
        pieces = list(out.reshape(comm.size, -1))
    else:
        pieces = [np.zeros(300, np.int16) for _ in range(comm.size)]
        comm.all_gather(pieces, piece)
    if any(not (p == q + 3).all() for q, p in enumerate(pieces)):
        wrong.append("all_gather")
    if step.data_starts - before != (3 if compiled else 0):
        wrong.append(f"data calls from compiled code: {step.data_starts - before}")
    return wrong


def test_past_the_room_a_rank_on_the_compiled_call_and_one_on_the_python_path_agree():
    for rank, wrong in enumerate(run_ranks(check_compiled_beside_python_past_the_room, 2)):
        assert wrong == [], (rank, wrong)
