"""The uneven ("v") forms of all_gather, gather, scatter and all_to_all, as a Communicator serves
them: the arguments checked (a refusal told to the other ranks, as for every collective), the
sizes agreed by every rank (algorithms/uneven.py), then the data moved. Host arrays move at once
through the communicator's own even collectives; GPU arrays move as one operation queued like
any GPU collective (stream=, async Works, deadlines), laid out by the GPU engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .algorithms import uneven
from .arguments import Arguments, named
from .buffers import Array, GpuArray
from .errors import InvalidArgumentError, UnsupportedError
from .gpu_dispatch import GpuDispatch
from .layouts import Staged, check_stream, copy_back, settle
from .trace import OpRecord, about
from .work import Work

if TYPE_CHECKING:
    from .communicator import Communicator

_REFUSALS = (InvalidArgumentError, UnsupportedError)


class UnevenCalls:
    """The uneven forms of one communicator. `refused(op, exc, arrays)` tells the other ranks
    of a refusal; `collective(...)` is the communicator's numbering, recording and routing of
    one collective (Communicator._collective); `seq()` its last collective's number."""

    def __init__(self, comm: Communicator, check: Arguments, gpu_side: GpuDispatch,
                 refused: Callable[[str, Exception, tuple], None],
                 collective: Callable[..., Work | None], seq: Callable[[], int]) -> None:
        self._comm, self._check, self._gpu_side = comm, check, gpu_side
        self._refused, self._collective, self._seq = refused, collective, seq

    def all_gather(self, x: Array, outs: list[Array], async_op: bool,
                   stream: Any) -> Work | None:
        """all_gather into `outs`, whose entry j has rank j's size (checked already)."""
        staged = self._check.take_staged()
        arrays = [("tensor", x), *named("out", outs)]
        self._gpu_side.on_gpu("all_gather", arrays, stream)
        comm = self._comm
        sizes, piece = uneven.agree_sizes(comm, x.size, [o.size for o in outs], "all_gather")
        return self._move("all_gather", arrays, lambda new: uneven.all_gather_v(
            comm.size, outs, x, sizes, piece, new), x, async_op, stream, staged)

    def all_to_all(self, out: Any, inp: Any, out_splits: Any, in_splits: Any,
                   async_op: bool, stream: Any) -> Work | None:
        """all_to_all with `in_splits` elements sent to each rank and `out_splits` received."""
        try:
            x, y, sends, receives = self._check.all_to_all_uneven(out, inp, out_splits,
                                                                  in_splits)
            arrays = [("inp", x), ("out", y)]
            self._gpu_side.on_gpu("all_to_all", arrays, stream)
        except _REFUSALS as exc:
            self._refused("all_to_all", exc, (out, inp))
            raise
        staged = self._check.take_staged()
        comm = self._comm
        piece = uneven.agree_all_to_all(comm, receives, sends)
        return self._move("all_to_all", arrays, lambda new: uneven.all_to_all_v(
            comm.size, y, x, receives, sends, piece, new), x, async_op, stream, staged)

    def rooted(self, op: str, x: Array, pieces: Any, name: str, root: int, root_name: str,
               writable: bool, async_op: bool, stream: Any) -> Work | None:
        """gather (writable pieces) or scatter with a size per rank: `pieces` (the root's list,
        None elsewhere) checked, the sizes agreed, then the data moved."""
        try:
            checked = self._check.root_pieces(op, pieces, name, x, root, root_name,
                                              writable=writable, sizes_may_differ=True)
        except _REFUSALS as exc:
            self._refused(op, exc, (x, pieces))
            raise
        staged = self._check.take_staged()
        arrays = [("tensor" if writable else "out", x), *named(name, checked or [])]
        self._gpu_side.on_gpu(op, arrays, stream)
        comm = self._comm
        sizes, piece = uneven.agree_sizes(comm, x.size, [p.size for p in checked]
                                          if checked is not None else None, op)
        layout = uneven.gather_v if writable else uneven.scatter_v
        return self._move(op, arrays, lambda new: layout(comm.size, comm.rank, x, checked,
                                                         root, sizes, piece, new),
                          x, async_op, stream, staged)

    def _move(self, op: str, arrays: list[tuple[str, Array]],
              layout: Callable[[uneven.NewBuffer | None], uneven.Moves], x: Array,
              async_op: bool, stream: Any, staged: Staged) -> Work | None:
        """Move an uneven collective's data once the ranks agreed on its sizes: `layout(new)`
        lays it out on padded buffers that `new` makes like `x` (`layout(None)`: pieces as they
        are). Host arrays: at once, through the communicator's even collectives (async_op=True
        gets a Work already complete); `staged` (host arrays the checks copied, layouts.py)
        are copied back once moved. GPU arrays: one operation queued like any GPU collective,
        laid out by the GPU engine (`uneven_moves`); staged GPU arrays are copied back after it
        on the current stream (at once, or at the Work's wait)."""
        comm = self._comm
        if not isinstance(x, GpuArray):
            layout(uneven.host_scratch(x)).run_on_host(comm)
            copy_back(staged)
            if not async_op:
                return None
            work = Work(OpRecord(op, self._seq(), "uneven sizes", x.nbytes), comm.rank)
            work.complete()
            return work
        check_stream(staged, stream, lambda text: self._check.fail(op, text))
        moves, after = self._gpu_side.uneven_moves(op, layout, x, stream)
        like = moves.scratch[0] if moves.scratch else None
        try:
            return settle(self._collective(op, about(x, ", uneven sizes"), x.nbytes, (),
                                           async_op, like=like, arrays=arrays, stream=stream,
                                           replayable=False, gpu_call=moves.queue_on_gpu),
                          staged)
        except BaseException:
            if moves.scratch:   # refused or failed before it was queued: given back here
                moves.free(after or 0)
            raise
