"""all_to_all with a different number of elements for every pair of ranks (torch's
all_to_all_single with split sizes, MPI's Alltoallv), built from a communicator's even
collectives, so it runs on every host backend alike.

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
