"""The hot path: a blocking small all_reduce, broadcast or all_gather on a NumPy array runs
whole in one compiled call (the shm backend's `hot_context`, `_shmcore.hot`), and so does a
blocking sendrecv of NumPy arrays (`exchange_context`, `_shmcore.exchange`), keeping every
promise of the full path (checks, numbering, records, signatures, failures), and leaves every
other call to the full path."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks, suite_backend

pytestmark = pytest.mark.skipif(suite_backend() != "shm", reason="the shm backend's hot path")


def check_which_calls_take_the_hot_path(comm) -> dict:
    """Runs calls that the hot path takes and calls it must leave to the full path, counting
    the engine's collective calls (the full path's): each result checked against NumPy."""
    from anyccl import ReduceOp

    n, r = comm.size, comm.rank
    if comm._hot is None:
        return {"hot": None}
    engine, counted = comm._engine, [0]
    full = engine.collective

    def counting(*args, **kwargs):
        counted[0] += 1
        return full(*args, **kwargs)

    engine.collective = counting
    taken: dict[str, int] = {}

    def took(name: str, call) -> None:
        before = counted[0]
        call()
        taken[name] = counted[0] - before    # 0: the hot path ran it

    first = comm._seq + 1
    x = np.arange(5, dtype=np.float32) + r
    took("all_reduce", lambda: comm.all_reduce(x))
    assert (x == sum(np.arange(5, dtype=np.float32) + q for q in range(n))).all()
    y = np.full((2, 3), r, np.int64)
    took("broadcast 2-D from the last rank", lambda: comm.broadcast(y, n - 1))
    assert (y == n - 1).all()
    z = np.full(3, r + 1.0)
    took("all_reduce MAX", lambda: comm.all_reduce(z, ReduceOp.MAX))
    assert (z == n).all()
    g = np.zeros(2 * n, np.int32)
    took("all_gather into one array", lambda: comm.all_gather(g, np.full(2, r, np.int32)))
    assert (g == np.repeat(np.arange(n, dtype=np.int32), 2)).all()
    h = np.full(3 * n, -1.0)
    h[3 * r:3 * r + 3] = r
    took("all_gather in place", lambda: comm.all_gather(h, h[3 * r:3 * r + 3]))
    assert (h == np.repeat(np.arange(n, dtype=np.float64), 3)).all()
    # the full path's own cases: each still right
    a = np.full(4, 1.0, np.float32)
    took("async", lambda: comm.all_reduce(a, async_op=True).wait())
    assert (a == n).all()
    b = np.full(4, 1.0, np.float32)
    took("op by name", lambda: comm.all_reduce(b, "sum"))
    assert (b == n).all()
    c = np.full(4, r, np.float32)
    took("numpy integer rank", lambda: comm.broadcast(c, np.int64(0)))
    assert (c == 0).all()
    d = np.full(8, 1.0, np.float32)
    took("not contiguous", lambda: comm.all_reduce(d[::2]))
    assert (d[::2] == n).all() and (d[1::2] == 1).all()
    e = np.full(4, 1.0, np.float32)
    e.flags.writeable = False
    result = comm.all_reduce(e)      # a new array holds it (its copy may run hot)
    assert (e == 1).all() and (result == n).all()
    big = np.ones((1 << 20) // 4, np.float32)
    took("beyond a staging half", lambda: comm.all_reduce(big))
    assert (big == n).all()

    pieces = [np.zeros(2, np.int32) for _ in range(n)]
    took("all_gather into a list", lambda: comm.all_gather(pieces, np.full(2, r, np.int32)))
    assert [p.tolist() for p in pieces] == [[q, q] for q in range(n)]
    try:                                          # another dtype than the piece: refused
        comm.all_gather(np.zeros(2 * n, np.float32), np.full(2, r, np.int32))
    except Exception as exc:   # noqa: BLE001 - the full path's error, on every rank
        taken["dtype refused"] = type(exc).__name__
    m = np.zeros(2 * n, np.int64)
    try:                                          # overlapping another rank's piece: refused
        took("all_gather overlapping", lambda: comm.all_gather(m, m[1:3]))
    except Exception as exc:   # noqa: BLE001 - the full path's error, on every rank
        taken["overlap refused"] = type(exc).__name__

    class Sub(np.ndarray):
        pass

    f = np.full(4, 1.0, np.float32).view(Sub)
    took("a subclass", lambda: comm.all_reduce(f))
    assert (np.asarray(f) == n).all()
    engine.collective = full
    records = [e for e in comm.flight_recorder.entries() if e["seq"] >= first and
               e["op"] not in ("send", "recv", "sendrecv")]
    return {"hot": True, "taken": taken,
            "seqs": [e["seq"] for e in records], "states": [e["state"] for e in records],
            "said": [f"{e['op']}({e['args']})" for e in records[:3]]}


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_blocking_all_reduce_or_broadcast_on_a_numpy_array_runs_whole_compiled(world):
    for got in run_ranks(check_which_calls_take_the_hot_path, world):
        if got["hot"] is None:
            pytest.skip("the shm core is not built here")
        taken = got["taken"]
        for name in ("all_reduce", "broadcast 2-D from the last rank", "all_reduce MAX",
                     "all_gather into one array", "all_gather in place"):
            assert taken[name] == 0, f"{name}: not on the hot path"
        for name in ("async", "op by name", "numpy integer rank", "not contiguous",
                     "beyond a staging half", "a subclass", "all_gather into a list"):
            assert taken[name] >= 1, f"{name}: the hot path took it"
        assert taken["overlap refused"] == taken["dtype refused"] == "InvalidArgumentError"
        # numbered like every other collective, every one recorded and done
        assert got["seqs"] == list(range(got["seqs"][0], got["seqs"][0] + len(got["seqs"])))
        assert set(got["states"]) == {"done"}
        assert got["said"] == ["all_reduce(float32 x 5, op=SUM)",
                               f"broadcast(int64 x 6, src={world - 1})",
                               "all_reduce(float64 x 3, op=MAX)"]


def check_a_mismatch_on_the_hot_path(comm) -> str:
    from anyccl.errors import CollectiveMismatchError

    x = np.ones(4 + comm.rank, np.float32)    # every rank another size
    try:
        comm.all_reduce(x)
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_a_mismatch_on_the_hot_path_stops_every_rank_naming_what_each_called():
    said = run_ranks(check_a_mismatch_on_the_hot_path, 2)
    for text in said:
        assert "float32 x 4" in text and "float32 x 5" in text, text


def check_which_exchanges_run_whole_compiled(comm) -> dict:
    """sendrecv around the ring (to the next rank, from the one before): calls the compiled
    exchange takes and calls it leaves to the full path, counting the host engine's sendrecv
    (the full path's); each result checked."""
    messages = comm._messages
    if messages._exchange_context is None:
        return {"hot": None}
    n, r = comm.size, comm.rank
    dst, src = (r + 1) % n, (r - 1) % n
    engine, counted = messages._engine, [0]
    full = engine.sendrecv

    def counting(*args, **kwargs):
        counted[0] += 1
        return full(*args, **kwargs)

    engine.sendrecv = counting
    taken: dict[str, int] = {}

    def took(name: str, call) -> None:
        before = counted[0]
        assert call() == src
        taken[name] = counted[0] - before    # 0: the compiled exchange ran it

    y = np.zeros(5, np.float32)
    took("float32", lambda: comm.sendrecv(np.arange(5, dtype=np.float32) + r, dst, y, src))
    assert (y == np.arange(5) + src).all()
    y2 = np.zeros((2, 3), np.int64)
    took("2-D int64, a tag", lambda: comm.sendrecv(np.full((2, 3), r), dst, y2, src, tag=7))
    assert (y2 == src).all()
    big = np.zeros((2 << 20) // 8)
    took("beyond the ring", lambda: comm.sendrecv(np.full(big.size, float(r)), dst, big, src))
    assert (big == src).all()
    # the full path's own cases: each still right
    s = np.arange(10, dtype=np.float32) + r
    y3 = np.zeros(5, np.float32)
    took("not contiguous", lambda: comm.sendrecv(s[::2], dst, y3, src))
    assert (y3 == (np.arange(10) + src)[::2]).all()
    y4 = np.zeros(3, np.int32)
    took("numpy integer ranks", lambda: comm.sendrecv(np.full(3, r, np.int32), np.int64(dst),
                                                       y4, np.int64(src)))
    assert (y4 == src).all()
    engine.sendrecv = full
    try:                                  # a receive of another size: the full path's error
        comm.sendrecv(np.zeros(4, np.float32), dst, np.zeros(3, np.float32), src)
    except Exception as exc:   # noqa: BLE001 - the same error as the full path's
        taken["size refused"] = type(exc).__name__
    records = [e for e in comm.flight_recorder.entries() if e["op"] == "sendrecv"][-6:]
    return {"hot": True, "taken": taken, "seqs": [e["seq"] for e in records],
            "states": [e["state"] for e in records[:-1]],
            "said": [e["args"] for e in records[:2]]}


@pytest.mark.parametrize("world", [2, 3])
def test_a_blocking_sendrecv_of_numpy_arrays_runs_whole_compiled(world):
    for r, got in enumerate(run_ranks(check_which_exchanges_run_whole_compiled, world)):
        if got["hot"] is None:
            pytest.skip("the shm core is not built here")
        taken = got["taken"]
        for name in ("float32", "2-D int64, a tag", "beyond the ring"):
            assert taken[name] == 0, f"{name}: not compiled"
        for name in ("not contiguous", "numpy integer ranks"):
            assert taken[name] >= 1, f"{name}: the compiled exchange took it"
        assert taken["size refused"] == "InvalidArgumentError"
        # numbered like every other sendrecv between the same ranks, recorded and done
        assert got["seqs"] == list(range(got["seqs"][0], got["seqs"][0] + len(got["seqs"])))
        assert set(got["states"]) == {"done"}
        dst, src = (r + 1) % world, (r - 1) % world
        assert got["said"] == [f"dst={dst}, src={src}, tag=0, 20 B",
                               f"dst={dst}, src={src}, tag=7, 48 B"]
