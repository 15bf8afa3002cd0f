"""The uneven ("v") collectives, built from a communicator's even ones so that they run on
every host backend alike: all_to_all with a different number of elements for every pair of ranks
(torch's all_to_all_single with split sizes, MPI's Alltoallv), and all_gather, gather and scatter
with a different size per rank (MPI's Allgatherv, Gatherv, Scatterv). The last three learn every
rank's size with one small all_gather, check it against the lists, and move padded pieces.

Each rank says how many elements it sends to every rank (`in_splits`) and expects from every
rank (`out_splits`). First the ranks exchange their send counts (an even all_to_all of one int64
per pair) and check them against what each expects; then one all_reduce(MAX) agrees on the
largest piece and on whether any rank found a mismatch, so that every rank raises together
rather than some hanging in the exchange. The data then moves as an even all_to_all of pieces
padded to that largest size, and each rank keeps the leading `out_splits[j]` elements of piece j.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..ops import ReduceOp


def split_elements(shape: Sequence[int], split_sizes: Any) -> list[int] | None:
    """torch's split sizes (rows along dim 0 of an array of `shape`) as element counts; None
    (even pieces) when none are given. Entries that are not ints pass through, for
    `check_splits` to refuse by name."""
    if not split_sizes:
        return None
    per_row = 1
    for extent in tuple(shape)[1:]:
        per_row *= int(extent)
    return [int(rows) * per_row if isinstance(rows, (int, np.integer))
            and not isinstance(rows, bool) else rows for rows in split_sizes]


def check_splits(rank: int, size: int, splits: Any, name: str, total: int,
                 array_name: str) -> list[int]:
    """`splits` as `size` non-negative ints summing to `total` (the elements of
    `array_name`); InvalidArgumentError naming the argument otherwise."""
    if isinstance(splits, (str, bytes)) or not isinstance(splits, Sequence):
        raise InvalidArgumentError(f"rank {rank}: all_to_all: {name}={splits!r} must be a list "
                                   f"of {size} element counts")
    counts = list(splits)
    if len(counts) != size or any(isinstance(c, bool) or not isinstance(c, (int, np.integer))
                                  or c < 0 for c in counts):
        raise InvalidArgumentError(f"rank {rank}: all_to_all: {name}={counts} must hold {size} "
                                   f"non-negative ints, one per rank")
    if sum(counts) != total:
        raise InvalidArgumentError(f"rank {rank}: all_to_all: {name} add up to {sum(counts)} "
                                   f"elements but {array_name} has {total}")
    return [int(c) for c in counts]


def all_to_all_v(comm: Any, out: np.ndarray, inp: np.ndarray, out_splits: list[int],
                 in_splits: list[int]) -> None:
    """Rank i's `out`, cut by `out_splits`, receives piece i of every rank's `inp` (cut by its
    `in_splits`). Flat host arrays of one dtype; splits already checked by `check_splits`."""
    n, me = comm.size, comm.rank
    incoming = np.zeros(n, np.int64)
    comm.all_to_all(incoming, np.asarray(in_splits, np.int64))
    wrong = [j for j in range(n) if incoming[j] != out_splits[j]]
    agreed = np.array([max(max(in_splits, default=0), max(out_splits, default=0)),
                       1 if wrong else 0], np.int64)
    comm.all_reduce(agreed, ReduceOp.MAX)
    if agreed[1]:
        detail = (", ".join(f"rank {j} sends {int(incoming[j])} where out_splits[{j}]="
                            f"{out_splits[j]}" for j in wrong) if wrong else
                  "another rank's out_splits disagree with what this rank sends")
        raise InvalidArgumentError(f"rank {me}: all_to_all: the split sizes of the ranks do not "
                                   f"match: {detail}; nothing was sent")
    piece = int(agreed[0])
    if piece == 0:
        return
    packed_in = np.zeros(n * piece, inp.dtype)
    start = 0
    for j, count in enumerate(in_splits):
        packed_in[j * piece:j * piece + count] = inp[start:start + count]
        start += count
    packed_out = np.empty(n * piece, out.dtype)
    comm.all_to_all(packed_out, packed_in)
    start = 0
    for j, count in enumerate(out_splits):
        out[start:start + count] = packed_out[j * piece:j * piece + count]
        start += count


# ---- all_gather, gather and scatter with a different size per rank ("v" forms) ---------------
def _sizes(comm: Any, mine: int, expected: list[int] | None, op: str) -> tuple[list[int], int]:
    """Every rank's true size (each rank gives its own), checked against the sizes this rank
    expects (None: it expects none); every rank raises together if any rank's expectation is
    wrong. Returns the sizes and the largest."""
    n = comm.size
    true = np.zeros(n, np.int64)
    comm.all_gather(true, np.array([mine], np.int64))
    wrong = [] if expected is None else [j for j in range(n) if true[j] != expected[j]]
    agreed = np.array([int(true.max()), 1 if wrong else 0], np.int64)
    comm.all_reduce(agreed, ReduceOp.MAX)
    if agreed[1]:
        detail = (", ".join(f"rank {j} has {int(true[j])} elements where this rank's list holds "
                            f"{expected[j]}" for j in wrong)  # type: ignore[index]
                  if wrong else "another rank's list disagrees with the sizes the ranks have")
        raise InvalidArgumentError(f"rank {comm.rank}: {op}: the sizes do not match: {detail}; "
                                   f"nothing was sent")
    return [int(s) for s in true], int(agreed[0])


def all_gather_v(comm: Any, outs: list[np.ndarray], x: np.ndarray) -> None:
    """outs[j] receives rank j's `x`, whatever its size (outs[j].size on every rank)."""
    n = comm.size
    sizes, piece = _sizes(comm, x.size, [o.size for o in outs], "all_gather")
    if piece == 0:
        return
    padded = np.zeros(piece, x.dtype)
    padded[:x.size] = x
    whole = np.empty(n * piece, x.dtype)
    comm.all_gather(whole, padded)
    for j, o in enumerate(outs):
        o[...] = whole[j * piece:j * piece + sizes[j]]


def gather_v(comm: Any, x: np.ndarray, outs: list[np.ndarray] | None, root: int) -> None:
    """Rank `root`'s outs[j] receives rank j's `x`, whatever its size."""
    n = comm.size
    sizes, piece = _sizes(comm, x.size, [o.size for o in outs] if outs is not None else None,
                          "gather")
    if piece == 0:
        return
    padded = np.zeros(piece, x.dtype)
    padded[:x.size] = x
    whole = np.empty(n * piece, x.dtype) if comm.rank == root else None
    comm.gather(padded, whole, root)
    if whole is not None and outs is not None:
        for j, o in enumerate(outs):
            o[...] = whole[j * piece:j * piece + sizes[j]]


def scatter_v(comm: Any, out: np.ndarray, chunks: list[np.ndarray] | None, root: int) -> None:
    """Rank j's `out` receives rank `root`'s chunks[j], whatever its size."""
    n = comm.size
    sizes, piece = _sizes(comm, out.size, [c.size for c in chunks] if chunks is not None
                          else None, "scatter")
    if piece == 0:
        return
    whole = None
    if chunks is not None:
        whole = np.zeros(n * piece, out.dtype)
        for j, c in enumerate(chunks):
            whole[j * piece:j * piece + sizes[j]] = c
    padded = np.empty(piece, out.dtype)
    comm.scatter(padded, whole, root)
    out[...] = padded[:out.size]
