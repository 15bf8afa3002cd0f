"""Collectives over symmetric staging memory: every rank owns a staging area that every other
rank can read (shared memory between processes; peer-mapped device memory between GPUs).

Each staging area has two halves. A schedule processes a message in chunks that fit one half;
each chunk writes the next half in turn, then passes a barrier, after which every rank may read
what the others wrote. Because halves alternate and every chunk ends at a barrier, a half is
never rewritten until every rank has passed a barrier after its last read of it, so no extra
synchronisation is needed at the end of an op or between ops.

Element order of reductions is fixed for a given world size: one-shot reduces ranks 0..n-1 in
order; two-shot and reduce_scatter start from the slice owner's own values and then add the
others in rank order. Every rank therefore ends with bit-identical results.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..ops import ReduceOp, accumulate, combine, finish

_SLICE_ALIGN_BYTES = 64  # slice boundaries on cache lines, so no two ranks write one line


class SymmetricStaging(Protocol):
    """What a transport offers these schedules."""

    rank: int
    size: int
    half_bytes: int
    one_shot_max_bytes: int   # all_reduce up to this size in one shot, two shots above

    def next_half(self) -> int:
        """The half the next chunk writes (alternates; every rank calls it in the same order)."""

    def mine(self, half: int) -> np.ndarray:
        """This rank's half as a writable uint8 array."""

    def peer(self, rank: int, half: int) -> np.ndarray:
        """Rank `rank`'s half as a uint8 array (read only by convention)."""

    def typed(self, half: int, dtype: np.dtype, count: int | None = None) -> list[np.ndarray]:
        """Every rank's whole `half` viewed as `dtype` (its first `count` elements if given), in
        rank order (write only this rank's); the same views on every call (cached)."""

    def sync(self) -> None:
        """Return once every rank has reached the same point of the current collective (its
        first sync carries the collective's signature, compared across ranks)."""


def split_bounds(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split range(count) into `parts` contiguous pieces, as even as `align` allows."""
    units = -(-count // align)
    base, extra = divmod(units, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = min(count, lo + (base + (i < extra)) * align)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _typed(raw: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    return raw[: count * dtype.itemsize].view(dtype)


def _chunks(count: int, chunk: int):
    for start in range(0, count, chunk):
        yield start, min(chunk, count - start)


def all_reduce(stg: SymmetricStaging, x: np.ndarray, op: ReduceOp, root: int | None = None) -> None:
    """Reduce flat `x` over all ranks in place; with `root`, only that rank receives the result
    (the reduce collective) and the others' `x` stays as it was."""
    if stg.size == 1:
        finish(x, op, 1)
        return
    if x.nbytes <= stg.one_shot_max_bytes:   # tuning: shm.one_shot_max
        _one_shot(stg, x, op, root)
    else:
        _two_shot(stg, x, op, root)


def _one_shot(stg: SymmetricStaging, x: np.ndarray, op: ReduceOp, root: int | None) -> None:
    n, count, dtype = stg.size, x.size, x.dtype
    chunk = max(1, stg.half_bytes // dtype.itemsize)
    for start in range(0, count, chunk):
        c = min(chunk, count - start)
        out = x if c == count else x[start:start + c]
        staged = stg.typed(stg.next_half(), dtype, c)
        staged[stg.rank][...] = out
        stg.sync()
        if root is not None and stg.rank != root:
            continue
        combine(out, staged[0], staged[1], op)
        for j in range(2, n):
            accumulate(out, staged[j], op)
        finish(out, op, n)


def _two_shot(stg: SymmetricStaging, x: np.ndarray, op: ReduceOp, root: int | None) -> None:
    """Per chunk: stage the slices peers reduce; reduce this rank's slice from its own array and
    the peers' staging, publish it; then (overlapped with the next chunk's staging) copy the
    peers' reduced slices. Per rank this reads and writes about 4.5x the chunk for 2 ranks,
    against 5.5x for staging everything."""
    n, me, count, dtype = stg.size, stg.rank, x.size, x.dtype
    align = max(1, _SLICE_ALIGN_BYTES // dtype.itemsize)
    receives = root is None or me == root
    pending: tuple[int, list[tuple[int, int]], int] | None = None  # result still to copy out

    def copy_out(start: int, bounds: list[tuple[int, int]], half: int) -> None:
        for j, (lo, hi) in enumerate(bounds):
            if j != me:
                x[start + lo:start + hi] = stg.typed(half, dtype)[j][lo:hi]

    for start, c in _chunks(count, max(1, stg.half_bytes // dtype.itemsize)):
        half = stg.next_half()
        bounds = split_bounds(c, n, align)
        mine = stg.typed(half, dtype)[me][:c]
        for j, (lo, hi) in enumerate(bounds):
            if j != me:
                mine[lo:hi] = x[start + lo:start + hi]
        if pending and receives:
            copy_out(*pending)
        stg.sync()
        lo, hi = bounds[me]
        if receives:  # reduce straight into the caller's array, then publish the slice
            acc = x[start + lo:start + hi]
        else:  # a non-root rank of reduce keeps its array as it was
            acc = mine[lo:hi]
            acc[:] = x[start + lo:start + hi]
        for j in range(n):
            if j != me:
                accumulate(acc, stg.typed(half, dtype)[j][lo:hi], op)
        finish(acc, op, n)
        if receives:
            mine[lo:hi] = acc
        stg.sync()
        pending = (start, bounds, half)
    if pending and receives:
        copy_out(*pending)


def broadcast(stg: SymmetricStaging, x: np.ndarray, root: int) -> None:
    """Copy the root's flat `x` into every rank's `x`."""
    if stg.size == 1:
        return
    raw = x.view(np.uint8)
    for start, c in _chunks(raw.size, stg.half_bytes):
        half = stg.next_half()
        if stg.rank == root:
            stg.mine(half)[:c] = raw[start:start + c]
        stg.sync()
        if stg.rank != root:
            raw[start:start + c] = stg.peer(root, half)[:c]


def all_gather(stg: SymmetricStaging, outs: list[np.ndarray] | None, x: np.ndarray,
               root: int | None = None) -> None:
    """outs[j] = rank j's flat `x`, on every rank (or, with `root`, on the root only: gather)."""
    raw = x.view(np.uint8)
    receives = root is None or stg.rank == root
    for start, c in _chunks(raw.size, stg.half_bytes) if stg.size > 1 else ():
        half = stg.next_half()
        stg.mine(half)[:c] = raw[start:start + c]
        stg.sync()
        if receives:
            for j in range(stg.size):
                if j != stg.rank:
                    outs[j].view(np.uint8)[start:start + c] = stg.peer(j, half)[:c]
    if receives:  # last: a collective refused at its first barrier leaves `outs` as they were
        outs[stg.rank].view(np.uint8)[:] = raw


def _pieces_per_half(stg: SymmetricStaging, itemsize: int) -> int:
    """Elements of each of `size` pieces that fit side by side in one half, cache-line aligned."""
    per_piece = stg.half_bytes // stg.size // _SLICE_ALIGN_BYTES * _SLICE_ALIGN_BYTES
    return max(1, per_piece // itemsize)


def scatter(stg: SymmetricStaging, out: np.ndarray, chunks: list[np.ndarray] | None,
            root: int) -> None:
    """`out` = piece `rank` of the root's `chunks` (all flat, equal sizes)."""
    me, dtype = stg.rank, out.dtype
    if stg.size == 1:
        out[:] = chunks[me]
        return
    step = _pieces_per_half(stg, dtype.itemsize)
    slot_bytes = step * dtype.itemsize
    for start, c in _chunks(out.size, step):
        half = stg.next_half()
        if me == root:
            staged = stg.mine(half)
            for j in range(stg.size):
                if j != me:
                    _typed(staged[j * slot_bytes:], dtype, c)[:] = chunks[j][start:start + c]
        stg.sync()
        if me != root:
            out[start:start + c] = _typed(stg.peer(root, half)[me * slot_bytes:], dtype, c)
    if me == root:  # after the first barrier, as everywhere: a refused call changes nothing
        out[:] = chunks[me]


def _exchange(stg: SymmetricStaging, inputs: list[np.ndarray], on_chunk) -> None:
    """Stage piece j of `inputs` for rank j, chunk by chunk; after each barrier call
    on_chunk(start, c, pieces) where pieces[j] is what rank j staged for this rank."""
    me, n, dtype = stg.rank, stg.size, inputs[0].dtype
    step = _pieces_per_half(stg, dtype.itemsize)
    slot_bytes = step * dtype.itemsize
    for start, c in _chunks(inputs[0].size, step):
        half = stg.next_half()
        staged = stg.mine(half)
        for j in range(n):
            if j != me:
                _typed(staged[j * slot_bytes:], dtype, c)[:] = inputs[j][start:start + c]
        stg.sync()
        pieces = [None if j == me else _typed(stg.peer(j, half)[me * slot_bytes:], dtype, c)
                  for j in range(n)]
        on_chunk(start, c, pieces)


def reduce_scatter(stg: SymmetricStaging, out: np.ndarray, inputs: list[np.ndarray],
                   op: ReduceOp) -> None:
    """`out` = reduction over ranks of their piece `rank` of `inputs` (all flat, equal sizes)."""
    me, n = stg.rank, stg.size
    if n == 1:
        out[:] = inputs[me]
    else:
        def reduce_chunk(start: int, c: int, pieces: list) -> None:
            acc = out[start:start + c]
            acc[:] = inputs[me][start:start + c]   # after the barrier (see all_gather)
            for j in range(n):
                if j != me:
                    accumulate(acc, pieces[j], op)

        _exchange(stg, inputs, reduce_chunk)
    finish(out, op, n)


def all_to_all(stg: SymmetricStaging, outs: list[np.ndarray], inputs: list[np.ndarray]) -> None:
    """outs[j] = rank j's inputs[rank] (all flat, equal sizes)."""
    me = stg.rank
    if stg.size > 1:
        def place(start: int, c: int, pieces: list) -> None:
            for j, piece in enumerate(pieces):
                if piece is not None:
                    outs[j][start:start + c] = piece

        _exchange(stg, inputs, place)
    outs[me][:] = inputs[me]   # last (see all_gather)
