"""The shm transport's compiled core (backends/_shmcore.c) does exactly what the Python path it
replaces does: the same bytes for every reduction it covers (NaN, infinities, signed zeros,
integer wrap-around included), the same messages in the same order. Each check runs once with
the core and once on the Python path (what runs where the core could not be built: the test
setup `without_core` takes it away before init()), and the two runs must agree bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

from anyccl import ReduceOp

pytestmark = pytest.mark.shm_only

PYTHON_PATH = {"ANYCCL_TEST_SETUP": "test_shm_core:without_core"}
CORE_DTYPES = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
               "uint32", "uint64")
# 1 element, an odd count, and the largest one-shot message of float32 (128 KiB)
COUNTS = (1, 7, 1000, 32768)


def without_core() -> None:
    """In every rank, before init(): the shm transport as where its core could not be built."""
    from anyccl.backends import doorbell, shm

    shm._shmcore = None
    doorbell._post = None


def core_status(comm) -> str:
    from anyccl.backends import shm

    return shm.status()


def test_the_python_path_runs_where_the_core_is_taken_away():
    assert all("compiled core built" in s for s in run_ranks(core_status, 2))
    assert all("compiled core not built: Python path" in s
               for s in run_ranks(core_status, 2, env=PYTHON_PATH))


def hostile_values(rank: int, count: int, dtype: np.dtype, salt: int) -> np.ndarray:
    """Values that expose any difference in order or rounding: random floats over many scales
    with NaN, +-inf and -0.0 sprinkled in; integers over their whole range (sums wrap)."""
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype.kind == "f":
        x = (rng.standard_normal(count) * 10.0 ** rng.integers(-8, 9, count)).astype(dtype)
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype)
        x[rng.random(count) < 0.05] = specials[rng.integers(0, 5)]
        return x
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


def reductions(comm) -> bytes:
    """Every covered dtype x op x count, as all_reduce and as reduce to each root in turn:
    the concatenated result bytes of this rank."""
    out = []
    salt = 0
    for name in CORE_DTYPES:
        dtype = np.dtype(name)
        ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
        ops += [ReduceOp.AVG] if dtype.kind == "f" else [ReduceOp.BAND, ReduceOp.BOR,
                                                         ReduceOp.BXOR]
        for op in ops:
            for count in COUNTS:
                salt += 1
                x = hostile_values(comm.rank, count, dtype, salt)
                with np.errstate(all="ignore"):
                    comm.all_reduce(x, op=op)
                    out.append(x.tobytes())
                    y = hostile_values(comm.rank, count, dtype, salt)
                    comm.reduce(y, dst=salt % comm.size, op=op)
                out.append(y.tobytes())
    return b"".join(out)


@pytest.mark.parametrize("world_size", [2, 3])
def test_core_reductions_match_the_python_path_bit_for_bit(world_size):
    with_core = run_ranks(reductions, world_size)
    without = run_ranks(reductions, world_size, env=PYTHON_PATH)
    for rank in range(world_size):
        assert with_core[rank] == without[rank], f"rank {rank} differs"


def broadcasts(comm) -> bytes:
    """Broadcasts from every root of every dtype the shm backend moves, at sizes up to and past
    one staging half (the core runs one half whole; more is Python's chunked path)."""
    out = []
    for salt, count in enumerate((0, 1, 7, 1000, 70_000)):
        for dtype in ("float32", "float64", "int8", "uint64", "complex64", "bool"):
            for root in range(comm.size):
                x = hostile_values(comm.rank, count, np.dtype("uint8"), salt).view(np.uint8)
                x = np.resize(x, count * np.dtype(dtype).itemsize).view(dtype)
                comm.broadcast(x, root)
                out.append(x.tobytes())
    return b"".join(out)


@pytest.mark.parametrize("world_size", [2, 3])
def test_core_broadcasts_match_the_python_path_bit_for_bit(world_size):
    env = {"ANYCCL_SHM_STAGING_BYTES": str(64 << 10)}   # 70_000 elements span several halves
    with_core = run_ranks(broadcasts, world_size, env=env)
    assert with_core == run_ranks(broadcasts, world_size, env={**env, **PYTHON_PATH})
    assert len(set(with_core)) == 1   # every rank holds the same bytes


def messages(comm) -> list[bytes]:
    """Messages of every kind the core takes whole and those it leaves to Python: small and
    larger than the ring, tags out of order, receives posted first, from any rank, async."""
    me, n = comm.rank, comm.size
    right, left = (me + 1) % n, (me - 1) % n
    got = []
    for count in (0, 1, 7, 5000, 300_000):
        x = np.arange(count, dtype=np.float64) + 1000 * me
        y = np.empty(count, np.float64)
        w = comm.irecv(y, left, tag=count % 7)
        comm.send(x, right, tag=count % 7)
        w.wait()
        got.append(y.tobytes())
    # two tags sent in one order, received in the other
    a, b = np.full(3, me, np.int32), np.full(5, -me, np.int32)
    ra, rb = np.empty(3, np.int32), np.empty(5, np.int32)
    with comm.batch():
        comm.isend(a, right, tag=1)
        comm.isend(b, right, tag=2)
    rb_work = comm.irecv(rb, left, tag=2)
    comm.recv(ra, left, tag=1)
    rb_work.wait()
    got += [ra.tobytes(), rb.tobytes()]
    # from any rank: rank 0 hears everyone once
    if me == 0:
        heard = []
        for _ in range(n - 1):
            z = np.empty(2, np.int64)
            sender = comm.recv(z, None, tag=9)
            assert z[0] == sender
            heard.append(sender)
        got.append(np.array(sorted(heard)).tobytes())
    else:
        comm.send(np.full(2, me, np.int64), 0, tag=9)
    comm.barrier()
    return got


def test_core_messages_match_the_python_path():
    with_core = run_ranks(messages, 3)
    assert with_core == run_ranks(messages, 3, env=PYTHON_PATH)
    expected_left = np.arange(7, dtype=np.float64) + 1000 * 2
    assert with_core[0][2] == expected_left.tobytes()  # rank 0's left neighbour is rank 2
    assert with_core[0][-1] == np.array([1, 2]).tobytes()


def test_the_compiled_core_is_built_by_the_install():
    """README's `pip install -e .` builds it; every figure in benchmarks/results assumes it."""
    from anyccl.backends import _shmcore

    assert {"ring", "send", "take", "reduce", "Staging"} <= set(dir(_shmcore))
    assert {"sync", "one_shot", "close", "epoch", "half"} <= set(dir(_shmcore.Staging))


def test_the_core_refuses_an_array_larger_than_a_staging_half_and_any_step_after_close():
    """The core's one-shot step writes the caller's array into this rank's staging half: one
    that does not fit is refused before any byte is written, and after close (the segments
    are unmapped) every step raises instead of touching their addresses."""
    from anyccl.backends import _shmcore

    halves = [[np.zeros(64, np.uint8) for _ in range(2)] for _ in range(2)]   # [half][rank]
    words = np.zeros(16, np.uint64)
    at = words.ctypes.data
    lanes = tuple((tuple(a.ctypes.data for a in halves[h]), 0, at, (at + 64,), at + 16 * p,
                   (at + 8,), (at + 32 + 16 * p,), 0) for h in (0, 1) for p in (0, 1))
    staging = _shmcore.Staging(lanes, at + 120, 64)
    with pytest.raises(ValueError, match="larger than a staging half"):
        staging.one_shot(np.ones(17, np.float32), 1, None, 0, 0, True, -1)
    assert not any(a.any() for pair in halves for a in pair) and not words.any()
    assert (staging.epoch, staging.half) == (0, 1)   # no step was taken
    staging.close()
    with pytest.raises(ValueError, match="closed"):
        staging.one_shot(np.ones(2, np.float32), 1, None, 0, 0, True, -1)
    with pytest.raises(ValueError, match="closed"):
        staging.sync(None)


def _envelopes(*heads_and_data):
    """Envelopes (backends/mpi.py: Envelope) of (word, count, code, status, data bytes)."""
    from anyccl.backends import _shmcore

    out = []
    for word, count, code, status, data in heads_and_data:
        e = np.zeros(_shmcore.ENVELOPE_BYTES, np.uint8)
        e[:32].view(np.int64)[:] = (word, count, code, status)
        e[32:32 + len(data)] = np.frombuffer(data, np.uint8)
        out.append(e)
    return out


def _envelope_op(a, b, count=1):
    import ctypes

    from anyccl.backends import _shmcore

    op = ctypes.CDLL(_shmcore.__file__).anyccl_envelope_op
    n = ctypes.c_int(count)
    op(ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(b.ctypes.data), ctypes.byref(n), None)


def test_the_mpi_envelope_op_reduces_only_where_every_signature_agrees():
    pytest.importorskip("anyccl.backends._shmcore")
    from anyccl.backends import _shmcore
    from anyccl.backends.shm import CORE_REDUCTIONS

    f32 = np.dtype(np.float32)
    dt, op = CORE_REDUCTIONS[(f32, ReduceOp.SUM)]
    code = dt * _shmcore.N_OPS + op
    x, y = np.arange(5, dtype=np.float32), np.full(5, 10, np.float32)
    a, b = _envelopes((7, 5, code, 0, x.tobytes()), (7, 5, code, 0, y.tobytes()))
    _envelope_op(a, b)
    assert b[24:32].view(np.int64)[0] == 0 and np.array_equal(b[32:52].view(np.float32), x + y)
    dt, op = CORE_REDUCTIONS[(f32, ReduceOp.MAX)]
    a, b = _envelopes((7, 5, dt * _shmcore.N_OPS + op, 0, x.tobytes()),
                      (7, 5, dt * _shmcore.N_OPS + op, 0, (y - 8).tobytes()))
    _envelope_op(a, b)
    assert np.array_equal(b[32:52].view(np.float32), np.maximum(x, y - 8))
    room = (_shmcore.ENVELOPE_BYTES - 32) // 4
    for first, second in [((7, 5, code, 0), (8, 5, code, 0)),        # another word
                          ((7, 5, code, 0), (7, 6, code, 0)),        # another count
                          ((7, 5, code, 0), (7, 5, -1, 0)),          # data on one rank only
                          ((7, 5, code, 1), (7, 5, code, 0)),        # already a mismatch
                          ((7, room + 1, code, 0), (7, room + 1, code, 0)),   # over the room
                          ((7, 5, 10 * _shmcore.N_OPS, 0),) * 2]:    # no such dtype
        a, b = _envelopes((*first, y.tobytes()), (*second, y.tobytes()))
        _envelope_op(a, b)
        assert b[24:32].view(np.int64)[0] == 1, (first, second)
        assert np.array_equal(b[32:52].view(np.float32), y), "data reduced though they differ"
    a, b = _envelopes((7, 5, -1, 0, b""), (7, 5, -1, 0, b""))        # a signature alone
    _envelope_op(a, b)
    assert b[24:32].view(np.int64)[0] == 0
