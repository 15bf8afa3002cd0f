"""Single-copy collectives for transports where a rank can read a peer's own arrays (the shm
backend with cross-memory attach). Each rank publishes the addresses of its arrays, passes a
barrier, reads what it needs straight into its own arrays, and passes a final barrier so that no
array is changed while a peer still reads it. Large messages move once instead of twice."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..ops import ReduceOp, accumulate, finish
from .symmetric import split_bounds

_SLICE_ALIGN_BYTES = 4096


class DirectAccess(Protocol):
    """What a transport offers these schedules; `chunk_bytes` and `block_bytes` are all_reduce's
    (the tuning table's shm.direct_chunk and shm.direct_block)."""

    rank: int
    size: int
    chunk_bytes: int
    block_bytes: int

    def publish(self, arrays: list[np.ndarray]) -> None:
        """Make this rank's arrays (address and length) visible to peers for the current op;
        a peer's read or write outside them is refused."""

    def addresses(self, rank: int) -> list[int]:
        """The addresses `rank` published for the current op (valid after the next barrier)."""

    def read(self, rank: int, address: int, dst: np.ndarray) -> None:
        """Copy dst.nbytes bytes at `address` in `rank`'s memory into `dst`."""

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        """Copy `src` to `address` in `rank`'s memory."""

    def scratch(self, nbytes: int) -> np.ndarray:
        """A private uint8 buffer of at least `nbytes`, reused across ops."""

    def sync(self) -> None: ...


def all_gather(d: DirectAccess, outs: list[np.ndarray], x: np.ndarray) -> None:
    """outs[j] = rank j's `x` on every rank: each rank pulls every peer's array."""
    d.publish([x])
    d.sync()   # first: a refused collective (sizes disagree) leaves every array as it was
    outs[d.rank][:] = x
    for j in range(d.size):
        if j != d.rank:
            d.read(j, d.addresses(j)[0], outs[j])
    d.sync()


def gather(d: DirectAccess, outs: list[np.ndarray] | None, x: np.ndarray, root: int) -> None:
    """The root's outs[j] = rank j's `x`: every other rank pushes its array into the root's list,
    so all ranks copy at once instead of the root alone."""
    d.publish(list(outs) if d.rank == root else [])
    d.sync()
    if d.rank == root:
        outs[root][:] = x
    else:
        d.write(root, d.addresses(root)[d.rank], x)
    d.sync()


def broadcast(d: DirectAccess, x: np.ndarray, root: int) -> None:
    """Every receiver pulls the last (n-1)/n of the root's array while the root pushes the first
    1/n into every receiver: the copying is spread over all n ranks, not n-1."""
    n = d.size
    d.publish([x])
    d.sync()
    raw = x.reshape(-1).view(np.uint8)
    split = min(raw.size, -(-raw.size // n // _SLICE_ALIGN_BYTES) * _SLICE_ALIGN_BYTES)
    if d.rank == root:
        for j in range(n):
            if j != root and split:
                d.write(j, d.addresses(j)[0], raw[:split])
    elif split < raw.size:
        d.read(root, d.addresses(root)[0] + split, raw[split:])
    d.sync()


def scatter(d: DirectAccess, out: np.ndarray, chunks: list[np.ndarray] | None,
            root: int) -> None:
    d.publish(list(chunks) if d.rank == root else [])
    d.sync()
    if d.rank == root:
        out[:] = chunks[root]
    else:
        d.read(root, d.addresses(root)[d.rank], out)
    d.sync()


def all_reduce(d: DirectAccess, x: np.ndarray, op: ReduceOp) -> None:
    """Each rank owns a slice of every chunk: it reads the peers' inputs for it block by block
    (the scratch stays in L2), reduces into its own array, and pushes the result block straight
    into every peer's array. Only a slice's owner reads or writes that slice in a peer's
    array, and it writes only after its own read, so two barriers suffice: one before (every
    rank has entered and published) and one after (every push has landed)."""
    n, me, dtype = d.size, d.rank, x.dtype
    item = dtype.itemsize
    d.publish([x])
    align = max(1, _SLICE_ALIGN_BYTES // item)
    step = max(align * n, d.chunk_bytes // item)   # every rank works at once on each chunk
    block = max(align, d.block_bytes // item)      # peers' data read and reduced in L2
    tmp = d.scratch(block * item)
    d.sync()
    base = [d.addresses(j)[0] if j != me else 0 for j in range(n)]
    for start in range(0, x.size, step):
        lo, hi = split_bounds(min(step, x.size - start), n, align)[me]
        for sub_lo in range(start + lo, start + hi, block):
            acc = x[sub_lo:min(sub_lo + block, start + hi)]
            piece = tmp[:acc.nbytes].view(dtype)
            for j in range(n):
                if j != me:
                    d.read(j, base[j] + sub_lo * item, piece)
                    accumulate(acc, piece, op)
            finish(acc, op, n)
            for j in range(n):
                if j != me:
                    d.write(j, base[j] + sub_lo * item, acc)
    d.sync()
