"""What every rank says of a collective before a byte of it moves, and the error when they differ.

Every collective on host arrays carries a *signature*: two non-negative 64-bit words, the first
packing the collective's name, the dtype, the root and the reduce op, the second the element
count every rank must agree on. Host backends compare the signatures of all ranks before any
rank touches another's memory (shm: in the arrival the ranks make anyway; mpi: one small
all-reduce first) and raise `CollectiveMismatchError` on every rank when they differ. That is the
check gloo ("Received data size doesn't match expected size") and MPICH ("Message truncated")
make, always on; debug mode adds the full cross-check of sequence numbers.

A rank that refuses its own arguments still arrives, with a *refused* signature and its reason,
so that its peers raise too instead of pairing their call with its next one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .buffers import SUPPORTED_DTYPES
from .errors import CollectiveMismatchError
from .ops import COLLECTIVES, ReduceOp

# (word, count) or, from a rank that refused its arguments, (word, count, reason)
Signature = tuple

_NAMES = list(COLLECTIVES)
_OPS = list(ReduceOp)
_ROOT_BITS = 24
REFUSED = 1 << 62
# the first word's fields, OR-ed together: name (bits 0-4), dtype + 1 (5-9), reduce op + 1
# (10-14, on each ReduceOp as `agree_bits`: an enum member's attribute is read faster than
# an enum hashed), root + 1 (15-38); bits 40-55 carry the barrier's epoch on shm
NAME_BITS = {name: i for i, name in enumerate(_NAMES)}
DTYPE_BITS = {d: (i + 1) << 5 for i, d in enumerate(SUPPORTED_DTYPES)}
for _i, _op in enumerate(_OPS):
    _op.agree_bits = (_i + 1) << 10


def word(name: str, dtype: Optional[np.dtype], root: int = -1,
         op: Optional[ReduceOp] = None) -> int:
    """The first word of the signature of collective `name` on elements of `dtype` (None: no
    data), with `root` (-1: none) and reduce `op` (None: none); the second is the count. (The
    communicator computes the same inline, on its hot path.)"""
    return (NAME_BITS[name] | (0 if dtype is None else DTYPE_BITS[dtype])
            | (0 if op is None else op.agree_bits) | (root + 1) << 15)


def refused(name: str, reason: str) -> Signature:
    """The signature of a rank that refused its arguments to collective `name`."""
    return NAME_BITS[name] | REFUSED, 0, reason


def describe(word: int, count: int) -> str:
    """A signature as a person reads it: 'all_reduce float32 x 8, op=SUM'."""
    name = _NAMES[word & 31] if (word & 31) < len(_NAMES) else "?"
    if word & REFUSED:
        return f"{name} (refused its arguments)"
    dtype_code, op_code = (word >> 5) & 31, (word >> 10) & 31
    root = ((word >> 15) & ((1 << _ROOT_BITS) - 1)) - 1
    parts = [name]
    if dtype_code:
        parts.append(f" {SUPPORTED_DTYPES[dtype_code - 1].name} x {count}")
    extra = []
    if root >= 0:
        extra.append(f"root={root}")
    if op_code:
        extra.append(f"op={_OPS[op_code - 1].name}")
    return "".join(parts) + (", " + ", ".join(extra) if extra else "")


def mismatch(rank: int, record: object, words: list[tuple[int, int]],
             reasons: dict[int, str], backend: str) -> CollectiveMismatchError:
    """The error every rank raises when the signatures `words` (one per rank) differ: which
    rank refused its arguments and why, or a table of what each rank called."""
    refusing = {r: reasons.get(r, "") for r, (word, _) in enumerate(words) if word & REFUSED}
    if refusing:
        said = "; ".join(f"rank {r} refused its arguments to {describe(*words[r]).split()[0]}()"
                         + (f": {why}" if why else "") for r, why in refusing.items())
        error = CollectiveMismatchError(
            f"rank {rank}: {record}: {said}; no data moved ({backend} backend)")
        error.refused_by = tuple(refusing)
        return error
    lines = [f"rank {rank}: collectives disagree at {record}; no data moved ({backend} "
             f"backend):", f"  {'rank':>4}  called"]
    lines += [f"  {r:>4}  {describe(*w)}" for r, w in enumerate(words)]
    return CollectiveMismatchError("\n".join(lines))


def out_of_bounds(rank: int, record: object, peer: int, verb: str,
                  nbytes: int) -> CollectiveMismatchError:
    """The error of a copy into or out of `peer`'s memory that would leave the arrays `peer`
    published for the collective (refused before a byte moves)."""
    return CollectiveMismatchError(
        f"rank {rank}: {record}: refused to {verb} {nbytes} B of rank {peer}'s memory outside "
        f"the arrays rank {peer} gave this collective (the ranks' sizes disagree)")
