"""Host arrays that are not contiguous (a column of a matrix, a transposed matrix, a channels_last
tensor, a reversed strided view) work on every collective and message, as gloo's do: each
call's result lands in place, element for element in the array's logical order, and the memory
between the array's elements is never touched. Only an output whose elements share memory is
refused, on every rank, with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from arraykinds import DLPackOnly, _torch
from harness import run_ranks
from reference import assert_matches, make_input, reduce_reference

import anyccl
from anyccl.buffers import BFLOAT16
from anyccl.ops import ReduceOp

SENTINEL = 3   # what lies between a view's elements, checked untouched afterwards
DTYPES = (np.dtype(np.float64), np.dtype(np.int32), BFLOAT16)
COUNTS = (12, 48_000)   # 48_000 float64 cross the 256 KiB staging halves
SMALL_STAGING = {"ANYCCL_SHM_STAGING_BYTES": str(256 << 10)}


def _permuted(b, order):
    return b.permute(*order) if hasattr(b, "permute") else b.transpose(*order)


# layout -> (shape of the backing memory for `count` elements, the view of it an operation gets)
LAYOUTS = {
    "column": (lambda n: (n, 3), lambda b: b[:, 1]),
    "transposed": (lambda n: (2, n // 2), lambda b: b.T),
    "channels_last": (lambda n: (2, 2, n // 12, 3), lambda b: _permuted(b, (0, 3, 1, 2))),
    "reversed_every_other": (lambda n: (2 * n,), lambda b: b[::-2]),   # NumPy alone
}
KIND_LAYOUTS = [(kind, layout) for kind in ("numpy", "torch", "dlpack") for layout in LAYOUTS
                if kind == "numpy" or layout != "reversed_every_other"]


class Strided:
    """`count` elements of `dtype` in `layout` over a larger backing array filled with
    SENTINEL: `view` is the NumPy view (for expectations), `arg` the same memory as `kind`."""

    def __init__(self, kind: str, layout: str, count: int, dtype: np.dtype,
                 values: np.ndarray | None = None) -> None:
        shape, self._view_of = LAYOUTS[layout]
        self.backing = np.full(shape(count), SENTINEL, dtype)
        self.view = self._view_of(self.backing)
        assert self.view.size == count and not self.view.flags.c_contiguous
        if values is not None:
            self.view[...] = values.reshape(self.view.shape)
        self.arg = self.view if kind == "numpy" else _as_kind(kind, self.backing, self._view_of)

    def values(self) -> np.ndarray:
        """The elements in logical (C) order."""
        return self.view.reshape(-1)

    def check(self, expected: np.ndarray, what: str) -> None:
        """The elements hold `expected`, and the memory between them still SENTINEL."""
        assert_matches(self.values(), expected, what)
        between = np.ones(self.backing.shape, bool)
        self._view_of(between)[...] = False
        assert (self.backing[between] == SENTINEL).all(), \
            f"{what}: memory between the elements was written"


def _as_kind(kind: str, backing: np.ndarray, view_of) -> object:
    tensor_backing = _torch(backing)
    if kind == "torch":
        return view_of(tensor_backing)
    # DLPack: NumPy exports strided views itself; bfloat16 travels from torch
    return DLPackOnly(view_of(tensor_backing) if backing.dtype == BFLOAT16 else
                      view_of(backing))


def check_every_operation(comm, kind: str, layout: str) -> int:
    n, r = comm.size, comm.rank
    left, right = (r - 1) % n, (r + 1) % n
    checked = 0
    for dtype in DTYPES:
        for count in COUNTS:
            def strided(values=None, elements=count, dtype=dtype):
                return Strided(kind, layout, elements, dtype, values)

            def given(rank, salt=0, elements=count, dtype=dtype):
                return make_input(rank, elements, dtype, salt)

            what = f"{kind} {layout} {dtype} x {count}"
            everyone = [given(j) for j in range(n)]
            root = count % n

            x = strided(given(r))
            comm.all_reduce(x.arg)
            x.check(reduce_reference(everyone, ReduceOp.SUM), f"all_reduce {what}")
            x = strided(given(r))
            comm.all_reduce(x.arg, op="max", async_op=True).wait()
            x.check(reduce_reference(everyone, ReduceOp.MAX), f"async all_reduce {what}")

            x = strided(given(r))
            comm.broadcast(x.arg, src=root)
            x.check(everyone[root], f"broadcast {what}")
            x = strided(given(r))
            comm.reduce(x.arg, dst=root)
            x.check(reduce_reference(everyone, ReduceOp.SUM) if r == root else given(r),
                    f"reduce {what}")

            x, outs = strided(given(r)), [strided() for _ in range(n)]
            comm.all_gather([o.arg for o in outs], x.arg)
            for j, o in enumerate(outs):
                o.check(everyone[j], f"all_gather from {j} {what}")
            x.check(given(r), f"all_gather's input {what}")
            whole = strided(elements=n * count)
            work = comm.all_gather(whole.arg, strided(given(r)).arg, async_op=True)
            work.wait()
            whole.check(np.concatenate(everyone), f"async all_gather into one array {what}")
            sizes = [count + 12 * j for j in range(n)]
            outs = [strided(elements=sizes[j]) for j in range(n)]
            comm.all_gather([o.arg for o in outs], strided(given(r, 0, sizes[r]), sizes[r]).arg)
            for j, o in enumerate(outs):
                o.check(given(j, 0, sizes[j]), f"uneven all_gather from {j} {what}")

            outs = [strided() for _ in range(n)] if r == root else None
            comm.gather(strided(given(r)).arg, outs and [o.arg for o in outs], dst=root)
            for j, o in enumerate(outs or []):
                o.check(everyone[j], f"gather from {j} {what}")
            chunks = [strided(given(j, 1)) for j in range(n)] if r == root else None
            out = strided()
            comm.scatter(out.arg, chunks and [c.arg for c in chunks], src=root)
            out.check(given(r, 1), f"scatter {what}")

            out = strided()
            comm.reduce_scatter(out.arg, [strided(given(r, j)).arg for j in range(n)])
            out.check(reduce_reference([given(j, r) for j in range(n)], ReduceOp.SUM),
                      f"reduce_scatter {what}")

            outs = [strided() for _ in range(n)]
            comm.all_to_all([o.arg for o in outs], [strided(given(r, j)).arg for j in range(n)])
            for j, o in enumerate(outs):
                o.check(given(j, r), f"all_to_all from {j} {what}")
            both = strided(np.concatenate([given(r, j) for j in range(n)]), n * count)
            comm.all_to_all(both.arg, both.arg)
            both.check(np.concatenate([given(j, r) for j in range(n)]),
                       f"all_to_all in place {what}")
            splits = [12 * (1 + (r + j) % 2) for j in range(n)]
            inp = strided(np.concatenate([given(r, j, splits[j]) for j in range(n)]),
                          sum(splits))
            out = strided(elements=sum(splits))
            comm.all_to_all(out.arg, inp.arg, out_splits=splits, in_splits=splits)
            out.check(np.concatenate([given(j, r, splits[j]) for j in range(n)]),
                      f"uneven all_to_all {what}")

            got = strided()
            comm.sendrecv(strided(given(r)).arg, right, got.arg, left)
            got.check(everyone[left], f"sendrecv {what}")
            got = strided()
            sent = comm.isend(strided(given(r, 2)).arg, right, tag=5)
            comm.recv(got.arg, left, tag=5)
            sent.wait()
            got.check(given(left, 2), f"recv {what}")
            got = strided()
            received = comm.irecv(got.arg, left, tag=6)
            comm.send(strided(given(r, 3)).arg, right, tag=6)
            received.wait()
            got.check(given(left, 3), f"irecv {what}")
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("kind,layout", KIND_LAYOUTS)
def test_every_operation_writes_non_contiguous_arrays_in_place(kind, layout, world_size):
    if kind != "numpy":
        pytest.importorskip("torch")
    assert run_ranks(check_every_operation, world_size, kind, layout, env=SMALL_STAGING,
                     deadline_s=300) == [len(DTYPES) * len(COUNTS)] * world_size


def check_overlapping_output(comm) -> str:
    """Rank 0's output has elements that share memory; the other ranks' arrays are fine."""
    x = np.zeros((4, 6), np.float32)
    if comm.rank == 0:
        x = np.lib.stride_tricks.as_strided(np.zeros(6, np.float32), (4, 6), (0, 4))
    try:
        comm.all_reduce(x)
    except anyccl.AnycclError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_an_output_whose_elements_share_memory_is_refused_on_every_rank():
    said = run_ranks(check_overlapping_output, 3)
    assert said[0].startswith("InvalidArgumentError: rank 0: all_reduce: tensor (a NumPy array) "
                              "has elements that share memory (shape (4, 6), strides (0, 4))"), \
        said[0]
    for other in said[1:]:
        assert "rank 0" in other and "share memory" in other, other


def check_failed_call_leaves_array(comm) -> bool:
    """Calls that fail after their checks write nothing back into strided arrays."""
    if comm.rank == 1:
        return True   # never joins: rank 0's calls time out
    comm.timeout_s = 0.5
    received, reduced = np.full((6, 3), 7.0)[:, 1], np.full((6, 3), 8.0)[:, 1]
    work = comm.irecv(received, 1)
    with pytest.raises(anyccl.TimeoutError):
        work.wait()
    assert work.is_completed() and work.exception() is not None
    with pytest.raises(anyccl.AnycclError):   # the communicator broke on the timeout
        comm.all_reduce(reduced)
    return bool((received == 7.0).all() and (reduced == 8.0).all())


def test_a_strided_array_keeps_its_values_when_its_call_fails():
    assert run_ranks(check_failed_call_leaves_array, 2) == [True, True]
