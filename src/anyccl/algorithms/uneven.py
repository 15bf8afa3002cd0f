"""The uneven ("v") collectives, built from even ones so that they run on every backend alike,
host and GPU: all_to_all with a different number of elements for every pair of ranks (torch's
all_to_all_single with split sizes, MPI's Alltoallv), and all_gather, gather and scatter with a
different size per rank (MPI's Allgatherv, Gatherv, Scatterv).

Two steps. First the ranks agree, on the host, whatever the arrays, in one all_reduce(MAX) of
what each rank claims: for all_to_all, its row of the matrix of send counts (`in_splits`) and of
the matrix of counts expected (`out_splits`); for the other three, its own size and the sizes its
list gives every rank. Every rank then sees every claim, checks them all alike and learns the
largest piece, so that every rank raises together, before any data moves, rather than some
hanging in the exchange. (all_to_all among more than 64 ranks exchanges its counts with an
all_to_all instead, which does not grow with the square of the ranks.)

Then the data moves (`Moves`). Where the GPU backend exchanges pieces of any size (NCCL's grouped
sends and receives: the nccl and ipc backends), each piece goes as it is. Elsewhere it moves as one
even collective on buffers padded to that largest piece: copies fill the padded send buffer, the
even collective runs, and each rank copies the leading elements of every piece it received into
place. On host arrays that runs at once through the communicator; on GPU arrays it is one
operation queued on a stream (scratch from the stream-ordered allocator, device copies, the GPU
backend's collective, the scratch freed in stream order), so it takes the GPU's stream
semantics, async Works and deadlines like any collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import gpu
from ..buffers import Array, GpuArray, Pieces
from ..errors import InvalidArgumentError
from ..ops import ReduceOp

NewBuffer = Callable[[int], Array]   # a padded buffer of that many elements, like the user's
# (None instead: no padding; the GPU backend's `exchange` moves pieces of any size as they are)


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


_NONE = -(1 << 62)          # "this rank says nothing here" in an all_reduce(MAX) of claims
_MATRIX_RANKS = 64          # up to this many ranks all_to_all agrees in one all_reduce of n*n


def agree_all_to_all(comm: Any, out_splits: list[int], in_splits: list[int]) -> int:
    """The largest piece any rank sends, once every rank's `in_splits` matched what its peers
    expect (their `out_splits`); every rank raises InvalidArgumentError together otherwise.
    Splits already checked by `check_splits`; runs host collectives on `comm`: up to
    _MATRIX_RANKS ranks one all_reduce(MAX) of every rank's row of both matrices (what it sends
    each rank, what it expects from each), beyond that an all_to_all of the counts and an
    all_reduce."""
    n, me = comm.size, comm.rank
    if n > _MATRIX_RANKS:
        incoming = np.zeros(n, np.int64)
        comm.all_to_all(incoming, np.asarray(in_splits, np.int64))
        wrong = [j for j in range(n) if incoming[j] != out_splits[j]]
        agreed = np.array([max(max(in_splits, default=0), max(out_splits, default=0)),
                           1 if wrong else 0], np.int64)
        comm.all_reduce(agreed, ReduceOp.MAX)
        piece, mismatch = int(agreed[0]), bool(agreed[1])
    else:
        rows = np.full((2, n, n), _NONE, np.int64)   # [sends, expects][rank][peer]
        rows[0, me], rows[1, me] = in_splits, out_splits
        comm.all_reduce(rows, ReduceOp.MAX)
        incoming = rows[0, :, me]
        wrong = [j for j in range(n) if incoming[j] != out_splits[j]]
        piece, mismatch = int(rows.max()), bool((rows[0] != rows[1].T).any())
    if mismatch:
        detail = (", ".join(f"rank {j} sends {int(incoming[j])} where out_splits[{j}]="
                            f"{out_splits[j]}" for j in wrong) if wrong else
                  "another rank's out_splits disagree with what this rank sends")
        raise InvalidArgumentError(f"rank {me}: all_to_all: the split sizes of the ranks do not "
                                   f"match: {detail}; nothing was sent")
    return piece


def agree_sizes(comm: Any, mine: int, expected: list[int] | None, op: str) -> tuple[list[int],
                                                                                   int]:
    """Every rank's true size (each rank gives its own), checked against the sizes this rank
    expects (None: it expects none); every rank raises together if any rank's expectation is
    wrong. Returns the sizes and the largest. One all_reduce(MAX) on `comm` of each rank's
    claims: its own size, and the highest and (negated) lowest size any rank's list gives each
    rank."""
    n = comm.size
    claims = np.full((3, n), _NONE, np.int64)   # [true sizes, highest listed, -lowest listed]
    claims[0, comm.rank] = mine
    if expected is not None:
        claims[1], claims[2] = expected, [-e for e in expected]
    comm.all_reduce(claims, ReduceOp.MAX)
    true, highest, lowest = claims[0], claims[1], -claims[2]
    if ((highest != true) | (lowest != true)).any():
        wrong = [] if expected is None else [j for j in range(n) if true[j] != expected[j]]
        detail = (", ".join(f"rank {j} has {int(true[j])} elements where this rank's list holds "
                            f"{expected[j]}" for j in wrong)  # type: ignore[index]
                  if wrong else "another rank's list disagrees with the sizes the ranks have")
        raise InvalidArgumentError(f"rank {comm.rank}: {op}: the sizes do not match: {detail}; "
                                   f"nothing was sent")
    return [int(s) for s in true], int(true.max())


# ---- the data: pieces as they are, or one even collective on padded buffers ------------------
Copies = list[tuple[Array, Array]]   # (destination, source) pairs of equal size


class Moves:
    """How one uneven collective's data moves: the `before` copies fill the padded buffers
    (`scratch`), `exchange(target)` runs the collective (target: the communicator for host
    arrays; the GPU backend for GPU arrays, whose call returns the function that queues it),
    and the `after` copies take each piece's leading elements out. Without padding (`exchanged`)
    there are no copies and no scratch."""

    __slots__ = ("before", "exchange", "after", "scratch")

    def __init__(self, before: Copies, exchange: Callable[[Any], Any], after: Copies,
                 scratch: list[Array]) -> None:
        self.before, self.exchange, self.after, self.scratch = before, exchange, after, scratch

    def run_on_host(self, comm: Any) -> None:
        """Move the data now, through `comm`'s even collective (host arrays)."""
        for dst, src in self.before:
            dst[...] = src
        self.exchange(comm)
        for dst, src in self.after:
            dst[...] = src

    def queue_on_gpu(self, backend: Any) -> Callable[[int], None]:
        """The function that queues the whole operation on a stream: the copies in, `backend`'s
        even collective, the copies out, then the scratch freed in stream order. The backend's
        collective is built now, so that what it refuses is refused before any byte moves (the
        caller then gives the scratch back)."""
        exchange = self.exchange(backend)
        before = [(d.ptr, s.ptr, s.nbytes) for d, s in self.before if s.nbytes]
        after = [(d.ptr, s.ptr, s.nbytes) for d, s in self.after if s.nbytes]

        def enqueue(stream: int) -> None:
            for dst, src, nbytes in before:
                gpu.copy_async(dst, src, nbytes, stream)
            exchange(stream)
            for dst, src, nbytes in after:
                gpu.copy_async(dst, src, nbytes, stream)
            self.free(stream)
        return enqueue

    @staticmethod
    def nothing() -> Moves:
        """An operation with nothing to move (every piece is empty)."""
        return Moves([], lambda target: _queue_nothing, [], [])

    @staticmethod
    def exchanged(sends: list[Any], recvs: list[Any]) -> Moves:
        """No padding: sends[r] goes to and recvs[r] comes from rank r through the GPU
        backend's `exchange`, each piece of its own size."""
        return Moves([], lambda backend: backend.exchange(sends, recvs), [], [])

    def free(self, stream: int) -> None:
        """Give the GPU scratch back, in `stream`'s order."""
        for buffer in self.scratch:
            gpu.free_async(buffer.ptr, stream)  # type: ignore[union-attr]
        self.scratch = []


def _queue_nothing(stream: int) -> None:
    """Queues nothing."""


def gpu_scratch(like: GpuArray, stream: int) -> NewBuffer:
    """Moves buffers for GPU arrays like `like`: stream-ordered device memory allocated on
    `stream` (the stream the operation is ordered after), as GpuArrays working on it."""
    def new(count: int) -> GpuArray:
        ptr = gpu.malloc_async(count * like.dtype.itemsize, stream)
        return GpuArray(ptr, count, like.dtype, like.device, stream, like.kind, None)
    return new


def host_scratch(like: np.ndarray) -> NewBuffer:
    """Moves buffers for host arrays like `like` (zeroed: the padding sent is defined)."""
    return lambda count: np.zeros(count, like.dtype)


def _runs(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) of consecutive runs of `counts` elements."""
    runs, start = [], 0
    for count in counts:
        runs.append((start, count))
        start += count
    return runs


def all_to_all_v(n: int, out: Array, inp: Array, out_splits: list[int], in_splits: list[int],
                 piece: int, new: NewBuffer | None) -> Moves:
    """Rank i's `out`, cut by `out_splits`, receives piece i of every rank's `inp` (cut by its
    `in_splits`), through an even all_to_all of pieces of `piece` elements."""
    if piece == 0:
        return Moves.nothing()
    if new is None:
        return Moves.exchanged([inp[s:s + c] for s, c in _runs(in_splits)],
                                [out[s:s + c] for s, c in _runs(out_splits)])
    send, recv = new(n * piece), new(n * piece)
    before = [(send[j * piece:j * piece + c], inp[s:s + c])
              for j, (s, c) in enumerate(_runs(in_splits))]
    after = [(out[s:s + c], recv[j * piece:j * piece + c])
             for j, (s, c) in enumerate(_runs(out_splits))]
    sends, receives = Pieces(send, piece, n), Pieces(recv, piece, n)
    return Moves(before, lambda t: t.all_to_all(receives, sends), after, [send, recv])


def all_gather_v(n: int, outs: list[Array], x: Array, sizes: list[int], piece: int,
                 new: NewBuffer | None) -> Moves:
    """outs[j] receives rank j's `x` (`sizes[j]` elements)."""
    if piece == 0:
        return Moves.nothing()
    if new is None:
        return Moves.exchanged([x] * n, list(outs))
    padded, whole = new(piece), new(n * piece)
    after = [(o, whole[j * piece:j * piece + sizes[j]]) for j, o in enumerate(outs)]
    pieces = Pieces(whole, piece, n)
    return Moves([(padded[:x.size], x)], lambda t: t.all_gather(pieces, padded), after,
                  [padded, whole])


def gather_v(n: int, rank: int, x: Array, outs: list[Array] | None, root: int,
             sizes: list[int], piece: int, new: NewBuffer | None) -> Moves:
    """Rank `root`'s outs[j] receives rank j's `x` (`sizes[j]` elements)."""
    if piece == 0:
        return Moves.nothing()
    if new is None:
        return Moves.exchanged([x if r == root else None for r in range(n)],
                                list(outs) if rank == root and outs is not None else [None] * n)
    padded = new(piece)
    if rank != root or outs is None:
        return Moves([(padded[:x.size], x)], lambda t: t.gather(padded, None, root), [],
                      [padded])
    whole = new(n * piece)
    after = [(o, whole[j * piece:j * piece + sizes[j]]) for j, o in enumerate(outs)]
    pieces = Pieces(whole, piece, n)
    return Moves([(padded[:x.size], x)], lambda t: t.gather(padded, pieces, root), after,
                  [padded, whole])


def scatter_v(n: int, rank: int, out: Array, chunks: list[Array] | None, root: int,
              sizes: list[int], piece: int, new: NewBuffer | None) -> Moves:
    """Rank j's `out` receives rank `root`'s chunks[j] (`sizes[j]` elements)."""
    if piece == 0:
        return Moves.nothing()
    if new is None:
        return Moves.exchanged(list(chunks) if rank == root and chunks is not None
                                else [None] * n, [out if r == root else None for r in range(n)])
    padded = new(piece)
    after = [(out, padded[:out.size])]
    if rank != root or chunks is None:
        return Moves([], lambda t: t.scatter(padded, None, root), after, [padded])
    whole = new(n * piece)
    before = [(whole[j * piece:j * piece + sizes[j]], c) for j, c in enumerate(chunks)]
    pieces = Pieces(whole, piece, n)
    return Moves(before, lambda t: t.scatter(padded, pieces, root), after, [padded, whole])
