"""The Communicator: the public operations, their ordering, sub-groups and objects.

Each operation's arguments are checked first (`arguments.py`), once, before any byte moves; a
refused call raises and leaves the communicator usable, and a refused host collective is told
to the other ranks (`_refused`), which raise too. Host arrays go, as flat NumPy views, to the
host backend, run in issue order by the `Engine`, each host collective with its signature
(agreement.py) for the backend to compare across ranks; GPU arrays go, as `GpuArray`s, to the
GPU backend through `gpu_dispatch.py`, which queues them on CUDA streams. Every operation gets a
sequence number, a flight-recorder line and, in debug mode, the full agreement check across
ranks. Backends trust what they receive.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from . import groups
from .algorithms import objects
from .arguments import Arguments, named
from .backends.base import Backend
from .backends.gpu_base import GpuBackend
from .buffers import (
    Array,
    immutable_copy,
    lives_on_gpu,
)
from .engine import HostEngine
from .errors import (
    AnycclError,
    InvalidArgumentError,
    UnsupportedError,
)
from .gpu_dispatch import FULL_PATH, GpuDispatch
from .ops import ReduceOp
from .store import Store
from .trace import ArgsText, FlightRecorder, OpRecord, about, message_text
from .uneven_calls import UnevenCalls
from .work import Work

_live: weakref.WeakSet[Communicator] = weakref.WeakSet()


# a collective's refusal of its own arguments: told to the other ranks (see `_refused`)
_REFUSALS = (InvalidArgumentError, UnsupportedError)


class Communicator:
    """A group of ranks that exchange arrays. Create one with `anyccl.init()`.

    Collectives must be called by every rank of the communicator, in the same order. Blocking
    calls return once this rank's part is done and its arrays hold the result; with
    ``async_op=True`` they return a `Work` instead, and collectives complete in issue order.
    Messages between one pair of ranks with one tag are received in the order they were sent.

    `hosts` names the host of every rank; `backend` names the backend serving host arrays (and
    the GPU backend once it exists), and `backend_reason` says why it was chosen (e.g. "ranks
    on 2 hosts: shared memory inside each host, torch's gloo between hosts").

    Example:
        On 2 ranks:

        ```python
        comm = anyccl.init()
        x = np.full(4, comm.rank + 1.0)
        comm.all_reduce(x)            # both ranks: [3. 3. 3. 3.]
        ```
    """

    def __init__(self, backend: Backend, store: Store, *, rank: int, size: int, local_rank: int,
                 timeout_s: float, name: str = "world", job_id: str = "local",
                 debug: bool = False, owns_store: bool = False,
                 device: int | None = None, gpu_backend: GpuBackend | None = None,
                 gpu_kind: str | None = None) -> None:
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.debug = debug
        self.job_id = job_id
        self.flight_recorder = FlightRecorder(rank, name)
        self._check = Arguments(rank, size)
        self._backend = backend
        self._store = store
        self._owns_store = owns_store  # the world communicator; sub-communicators share it
        self._name = name
        self._engine = HostEngine(backend, f"rank {rank} ({name})", rank=rank, size=size,
                                  timeout_s=timeout_s, recorder=self.flight_recorder,
                                  job_id=job_id)
        self._seq = 0
        self._p2p_seq: dict[tuple[str, int | None, int | None], int] = {}
        self._splits = 0
        self._closed = False
        self._gpu_side = GpuDispatch(self._check, backend, store, rank=rank, size=size,
                                     local_rank=local_rank, name=name, timeout_s=timeout_s,
                                     meet=self.barrier, post_mortem=self._engine.post_mortem,
                                     number=self._number, recorder=self.flight_recorder,
                                     device=device, backend=gpu_backend, kind=gpu_kind)
        self._uneven = UnevenCalls(self, self._check, self._gpu_side, self._refused,
                                   self._collective, lambda: self._seq)
        self._owner_pid = os.getpid()
        # the host of each rank, and why the host backend is what it is (set by init())
        self.hosts: tuple[str, ...] = ()
        self.backend_reason = "given"
        _live.add(self)

    # ---- identity ----------------------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """Seconds any one operation may wait before it fails with anyccl.TimeoutError (may be
        changed; applies to operations issued afterwards)."""
        return self._engine.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self._engine.timeout_s = self._gpu_side.timeout_s = seconds

    @property
    def backend(self) -> str:
        """The host backend's name ("shm", ...), then the GPU backend's once it exists:
        "shm" or "cpu:shm,cuda:nccl"."""
        gpu_backend = self._gpu_side.gpu
        if gpu_backend is None:
            return self._backend.name
        return f"cpu:{self._backend.name},cuda:{gpu_backend.name}"

    @property
    def gpu_backend(self) -> GpuBackend | None:
        """The backend serving this communicator's GPU arrays, once created (see
        `connect_gpu`); None before."""
        return self._gpu_side.gpu

    @property
    def device(self) -> int | None:
        """The CUDA device this rank's GPU arrays must be on: device_id given to init(), else
        local_rank modulo the visible GPUs; None where no GPU is visible."""
        return self._gpu_side.device_if_any()

    def __repr__(self) -> str:
        return (f"<anyccl.Communicator {self._name} rank {self.rank}/{self.size} "
                f"backend={self.backend}{' closed' if self._closed else ''}>")

    # ---- running -----------------------------------------------------------------------------
    def connect_gpu(self) -> None:
        """Collective: create this communicator's GPU backend now, on this rank's device (the
        one named at init, else local_rank modulo the visible GPUs), instead of at the first
        collective on GPU arrays. Does nothing if it exists."""
        self._gpu_side.connect("init")

    def _number(self) -> int:
        """The next collective's sequence number (every rank numbers them alike)."""
        self._seq += 1
        return self._seq

    def _collective(self, name: str, args: ArgsText, nbytes: int, call: Callable[[Any], Any],
                    async_op: bool, *, like: Array | None = None, root: int = -1,
                    op: ReduceOp | None = None, arrays: Sequence[tuple[str, Array]] = (),
                    stream: Any = None, replayable: bool = True) -> Work | None:
        """Number and record collective `name`, then route it: host arrays to the host engine,
        where `call(backend)` runs it; GPU arrays to the GPU engine, `call(gpu_backend)`
        returning the function that queues it. `like` (the array whose dtype and size every
        rank must agree on), `root` and `op` are its signature. replayable=False: a blocking
        GPU call leaves no plan (its queued function holds buffers of its own, used once)."""
        enqueue = None
        # one host array and no stream (the common case) cannot be on a GPU: no need to ask
        if (stream is not None or len(arrays) != 1 or type(like) is not np.ndarray) \
                and self._gpu_side.on_gpu(name, arrays, stream):
            gpu_backend = self._gpu_side.backend(name, collective=True)
            try:
                enqueue = call(gpu_backend)  # refuses what NCCL cannot do, before any byte moves
            except AnycclError as exc:
                raise type(exc)(f"rank {self.rank}: {name}: {exc}") from None
        self._seq += 1
        record = self.flight_recorder.queued(OpRecord(name, self._seq, args, nbytes))
        if enqueue is None:
            return self._engine.collective(record, call, async_op, like, root, op, self.debug)
        if self.debug:
            self._engine.check_agreement(record, like, root, op)
        return self._gpu_side.collective(record, args, enqueue, [a for _, a in arrays],
                                         async_op, stream, replayable and not (
                                             self.debug or stream is not None))

    def _refused(self, name: str, exc: AnycclError, args: tuple) -> None:
        """This rank refused its arguments to collective `name`: the other ranks are told, and
        raise too (host collectives; a call on GPU arrays, or on a closed or one-rank
        communicator, tells nobody)."""
        if self._closed or self.size == 1 or self._engine.failure is not None \
                or lives_on_gpu(args):
            return
        record = OpRecord(name, self._number(), "refused its arguments")
        self._engine.refuse(self.flight_recorder.queued(record), str(exc))

    def _message(self, kind: str, x: Array, peer: int | None, tag: int, async_op: bool,
                 stream: Any = None) -> Work | int | None:
        """Send or receive (peer=None: receive from any rank); a blocking receive returns the
        sender, an async call its Work."""
        record = self._message_record(kind, x, peer, tag)
        op = "i" + kind if async_op else kind
        if (stream is not None or type(x) is not np.ndarray) and self._gpu_side.on_gpu(
                op, [("tensor", x)], stream):
            if peer is None:
                raise self._check.fail(op, "src=None (from any rank) needs host arrays: GPU "
                                           "messages match in issue order between two named "
                                           "ranks (NCCL has no any-source receive); name src")
            return self._gpu_side.message(op, record, x, peer, tag, async_op, stream)
        if self._gpu_side.batched is not None and not async_op:
            raise self._check.fail(kind, f"use i{kind} inside `with comm.batch():`")
        return self._engine.message(kind, x, peer, tag, self.flight_recorder.queued(record),
                                    async_op)

    def _message_record(self, kind: str, x: Array, peer: int | None, tag: int,
                        src: int | None = None) -> OpRecord:
        """The record of a message (kind "sendrecv": of an exchange, receiving from `src`),
        numbered per kind and peers."""
        key = (kind, peer, src)
        self._p2p_seq[key] = seq = self._p2p_seq.get(key, 0) + 1
        nbytes = x.nbytes
        return OpRecord(kind, seq, (message_text, kind, peer, tag, nbytes, src),
                        nbytes)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Issue the isend/irecv calls made inside the block together: for GPU arrays, as one
        NCCL group when the block ends (so rings of sends and receives cannot deadlock); wait
        on their Works after the block. Host messages progress together anyway.

        Example:
            ```python
            with comm.batch():
                comm.isend(x, (rank + 1) % size)
                work = comm.irecv(y, (rank - 1) % size)
            work.wait()
            ```
        """
        self._check_open("batch")
        return self._gpu_side.batch()

    # ---- point to point ----------------------------------------------------------------------
    def _p2p_args(self, op: str, tensor: Any, peer: Any, peer_name: str, tag: Any,
                  writable: bool) -> tuple[Array, int | None, int]:
        self._check_open(op)
        return self._check.message(op, tensor, peer, peer_name, tag, writable)

    def send(self, tensor: Any, dst: int, tag: int = 0, *, stream: Any = None) -> None:
        """Send `tensor` to rank `dst`. Host arrays: returns once the data is out of `tensor`
        (it may be buffered in shared memory before `dst` receives it). GPU arrays: queued on
        the stream like a collective; messages between two ranks match in issue order."""
        self._message("send", *self._p2p_args("send", tensor, dst, "dst", tag, False), False,
                      stream)

    def recv(self, tensor: Any, src: int | None, tag: int = 0, *, stream: Any = None) -> int:
        """Receive the next message from `src` with `tag` into `tensor` (same dtype and size as
        sent) and return the sender. src=None (host arrays): the first message with `tag` from
        any rank; messages from each rank still arrive in the order it sent them."""
        sender = self._message("recv", *self._p2p_args("recv", tensor, src, "src", tag, True),
                               False, stream)
        return src if src is not None else sender  # type: ignore[return-value]

    def isend(self, tensor: Any, dst: int, tag: int = 0, *, stream: Any = None) -> Work:
        """Start sending `tensor` to `dst`; do not modify it until the Work completes."""
        return self._message("send", *self._p2p_args("isend", tensor, dst, "dst", tag, False),
                             True, stream)  # type: ignore[return-value]

    def irecv(self, tensor: Any, src: int | None, tag: int = 0, *, stream: Any = None) -> Work:
        """Start receiving into `tensor`; read it only after the Work completes. src=None: from
        any rank (host arrays); the Work's `source` then names the sender."""
        return self._message("recv", *self._p2p_args("irecv", tensor, src, "src", tag, True),
                             True, stream)

    def sendrecv(self, send_tensor: Any, dst: int, recv_tensor: Any, src: int | None,
                 tag: int = 0, *, stream: Any = None) -> int:
        """Send `send_tensor` to `dst` and receive the next message from `src` with `tag` into
        `recv_tensor`, both at once (MPI's Sendrecv): neither waits for the other, so a ring of
        exchanges cannot deadlock. Returns the sender (src=None, host arrays: from any rank).
        Host arrays: returns when the message arrived; GPU arrays: queued on the stream."""
        self._check_open("sendrecv")
        x, dst, tag = self._check.message("sendrecv", send_tensor, dst, "dst", tag, False)
        y, src, _ = self._check.message("sendrecv", recv_tensor, src, "src", tag, True)
        self._check.disjoint("sendrecv", x, "send_tensor", y, "recv_tensor")
        if self._gpu_side.batched is not None:
            raise self._check.fail("sendrecv", "use isend and irecv inside `with comm.batch():`")
        if stream is None and type(x) is np.ndarray and type(y) is np.ndarray:
            record = self._message_record("sendrecv", x, dst, tag, src)
            return self._engine.exchange(self.flight_recorder.queued(record),
                                         (("send", x, dst, tag), ("recv", y, src, tag)))
        with self.batch():   # GPU arrays: one group; isend and irecv take the caller's arrays
            sent = self.isend(send_tensor, dst, tag, stream=stream)
            received = self.irecv(recv_tensor, src, tag, stream=stream)
        sent.wait()
        received.wait()
        return src if src is not None else received.source

    # ---- collectives -------------------------------------------------------------------------
    # GPU arrays: each call is queued after the work on the caller's current stream (torch's or
    # CuPy's, or `stream=`) and returns once queued; that stream waits for the result.
    def broadcast(self, tensor: Any, src: int, async_op: bool = False, *,
                  stream: Any = None) -> Any:
        """Every rank's `tensor` becomes a copy of rank `src`'s `tensor`.

        Returns:
            Blocking: the array that holds the result (see `all_reduce`). Else a `Work`.
        """
        if type(tensor) is not np.ndarray or not tensor.flags.writeable \
                or self._gpu_side.plans is not None:
            early = self._in_place_early(("broadcast", src), tensor, async_op, stream,
                                         lambda copy: self.broadcast(copy, src))
            if early is not FULL_PATH:
                return early
        self._check_open("broadcast")
        try:
            x = self._check.array("broadcast", tensor, "tensor", writable=True)
            src = self._check.peer("broadcast", src, "src")
        except _REFUSALS as exc:
            self._refused("broadcast", exc, (tensor,))
            raise
        work = self._collective("broadcast", about(x, ", src={}", src), x.nbytes,
                                lambda b: b.broadcast(x, src), async_op, like=x, root=src,
                                arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM,
                   async_op: bool = False, *, stream: Any = None) -> Any:
        """Every rank's `tensor` becomes the element-wise reduction of all ranks' `tensor`.

        Returns:
            Blocking: the array that holds the result. That is `tensor` itself, written in
            place, except for an input that cannot be written (a JAX array on the host, a
            read-only NumPy array): that one is left as it was and a new array of its kind
            holds the result, so `y = comm.all_reduce(x)` works for every array. With
            `async_op=True`: a `Work` (in place only).
        """
        if type(tensor) is not np.ndarray or not tensor.flags.writeable \
                or self._gpu_side.plans is not None:
            early = self._in_place_early(("all_reduce", op), tensor, async_op, stream,
                                         lambda copy: self.all_reduce(copy, op))
            if early is not FULL_PATH:
                return early
        self._check_open("all_reduce")
        try:
            x, rop = self._check.reduced("all_reduce", tensor, op)
        except _REFUSALS as exc:
            self._refused("all_reduce", exc, (tensor,))
            raise
        work = self._collective("all_reduce", about(x, ", op={0.name}", rop), x.nbytes,
                                lambda b: b.all_reduce(x, rop), async_op, like=x, op=rop,
                                arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def reduce(self, tensor: Any, dst: int, op: ReduceOp | str = ReduceOp.SUM,
               async_op: bool = False, *, stream: Any = None) -> Any:
        """Rank `dst`'s `tensor` becomes the reduction of all ranks' `tensor`; the other ranks'
        arrays are left as they were.

        Returns:
            Blocking: the array that holds the result (see `all_reduce`). Else a `Work`.
        """
        if type(tensor) is not np.ndarray or not tensor.flags.writeable \
                or self._gpu_side.plans is not None:
            early = self._in_place_early(("reduce", dst, op), tensor, async_op, stream,
                                         lambda copy: self.reduce(copy, dst, op))
            if early is not FULL_PATH:
                return early
        self._check_open("reduce")
        try:
            x, rop = self._check.reduced("reduce", tensor, op)
            dst = self._check.peer("reduce", dst, "dst")
        except _REFUSALS as exc:
            self._refused("reduce", exc, (tensor,))
            raise
        work = self._collective("reduce", about(x, ", dst={}, op={.name}", dst, rop),
                                x.nbytes, lambda b: b.reduce(x, dst, rop), async_op, like=x,
                                root=dst, op=rop, arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def _in_place_early(self, tag: tuple, tensor: Any, async_op: bool, stream: Any,
                        again: Callable[[np.ndarray], Any]) -> Any:
        """What all_reduce, broadcast or reduce (`tag`: its name and arguments) answers before
        its full path: for an input that cannot be written in place, `again(copy)` on a
        writable copy, and the result as a new array of the input's kind (blocking only: an
        async call is refused, on every rank, as any refused argument is); a replayed plan's
        outcome (GPU); else FULL_PATH."""
        staged = immutable_copy(tensor)
        if staged is not None:
            copy, back = staged
            name = tag[0]
            if async_op:
                self._check_open(name)
                exc = InvalidArgumentError(
                    f"rank {self.rank}: {name}: tensor ({type(tensor).__name__}) cannot be "
                    f"written in place, so async_op=True has nowhere to put the result; call it "
                    f"blocking and use what it returns: y = comm.{name}(x, ...)")
                self._refused(name, exc, (copy,))
                raise exc
            again(copy)
            return back(copy)
        if self._gpu_side.plans is not None:
            replayed = self._gpu_side.replay(tag, (tensor,), async_op, stream)
            if replayed is not FULL_PATH:
                return tensor if replayed is None else replayed
        return FULL_PATH

    def all_gather(self, out: Any, tensor: Any, async_op: bool = False, *,
                   stream: Any = None) -> Work | None:
        """`out` receives every rank's `tensor` in rank order: a list of `size` arrays, or one
        array of size * tensor.size elements. The arrays may differ in size from rank to rank
        ("allgatherv"): then `out` is a list whose entry j has rank j's size, on every rank."""
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("all_gather",), (out, tensor), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("all_gather")
        try:
            x = self._check.array("all_gather", tensor, "tensor", writable=False)
            outs = self._check.pieces("all_gather", out, "out", x, writable=True,
                                      sizes_may_differ=self.size > 1)
            even = all(o.size == x.size for o in outs)
            if even:
                self._check.others_disjoint("all_gather", outs, "out", x, "tensor")
        except _REFUSALS as exc:
            self._refused("all_gather", exc, (out, tensor))
            raise
        if not even:
            return self._uneven.all_gather(x, outs, async_op, stream)
        return self._collective("all_gather", about(x), x.nbytes * self.size,
                                lambda b: b.all_gather(outs, x), async_op, like=x,
                                arrays=[("tensor", x), *named("out", outs)], stream=stream)

    def gather(self, tensor: Any, out_list: Any = None, dst: int = 0,
               async_op: bool = False, *, stream: Any = None,
               uneven: bool = False) -> Work | None:
        """Rank `dst`'s `out_list` receives every rank's `tensor` in rank order; the other ranks
        pass out_list=None. uneven=True (on every rank): each rank's `tensor` may have its own
        size, and out_list[j] has rank j's ("gatherv")."""
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("gather", dst), (tensor, out_list), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("gather")
        x, dst, outs = self._rooted_args("gather", tensor, "tensor", dst, "dst", out_list,
                                         "out_list", uneven)
        if uneven:
            return self._uneven.rooted("gather", x, out_list, "out_list", dst, "dst", True,
                                       async_op, stream)
        return self._collective("gather", about(x, ", dst={}", dst), x.nbytes * self.size,
                                lambda b: b.gather(x, outs, dst), async_op, like=x, root=dst,
                                arrays=[("tensor", x), *named("out_list", outs or [])],
                                stream=stream)

    def _rooted_args(self, op: str, array: Any, name: str, root: Any, root_name: str,
                     pieces: Any, pieces_name: str, uneven: bool
                     ) -> tuple[Array, int, list[Array] | None]:
        """gather's or scatter's arguments checked (`Arguments.rooted`), a refusal told."""
        try:
            return self._check.rooted(op, array, name, root, root_name, pieces, pieces_name,
                                      uneven)
        except _REFUSALS as exc:
            self._refused(op, exc, (array, pieces))
            raise

    def scatter(self, out: Any, chunks: Any = None, src: int = 0,
                async_op: bool = False, *, stream: Any = None,
                uneven: bool = False) -> Work | None:
        """Rank i's `out` receives `chunks[i]` of rank `src`; the other ranks pass
        chunks=None. uneven=True (on every rank): chunk i has rank i's `out` size, which may
        differ from rank to rank ("scatterv")."""
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("scatter", src), (out, chunks), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("scatter")
        x, src, pieces = self._rooted_args("scatter", out, "out", src, "src", chunks, "chunks",
                                           uneven)
        if uneven:
            return self._uneven.rooted("scatter", x, chunks, "chunks", src, "src", False,
                                       async_op, stream)
        return self._collective("scatter", about(x, ", src={}", src), x.nbytes * self.size,
                                lambda b: b.scatter(x, pieces, src), async_op, like=x, root=src,
                                arrays=[("out", x), *named("chunks", pieces or [])],
                                stream=stream)

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, *, stream: Any = None) -> Work | None:
        """Rank i's `out` becomes the reduction of every rank's piece i of `inp` (a list of
        `size` arrays like `out`, or one array of size * out.size elements)."""
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("reduce_scatter", op), (out, inp), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("reduce_scatter")
        try:
            x = self._check.array("reduce_scatter", out, "out", writable=True)
            inputs = self._check.pieces("reduce_scatter", inp, "inp", x, writable=False)
            self._check.others_disjoint("reduce_scatter", inputs, "inp", x, "out")
            rop = self._check.reduce_op("reduce_scatter", op, x.dtype)
        except _REFUSALS as exc:
            self._refused("reduce_scatter", exc, (out, inp))
            raise
        return self._collective("reduce_scatter", about(x, ", op={0.name}", rop),
                                x.nbytes * self.size, lambda b: b.reduce_scatter(x, inputs, rop),
                                async_op, like=x, op=rop,
                                arrays=[("out", x), *named("inp", inputs)], stream=stream)

    def all_to_all(self, out: Any, inp: Any, async_op: bool = False, *,
                   stream: Any = None, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> Work | None:
        """Rank i's out[j] receives rank j's inp[i]. Both are lists of `size` arrays of one
        size, or single arrays split evenly into `size` pieces. out may be inp (in place).

        Uneven: with `in_splits` (elements this rank sends to each rank) and `out_splits`
        (elements it receives from each), `out` and `inp` are single arrays (host or GPU) cut
        at those counts, which every pair of ranks must agree on (all ranks raise if not)."""
        if out_splits is not None or in_splits is not None:
            return self._uneven.all_to_all(out, inp, out_splits, in_splits, async_op, stream)
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("all_to_all",), (out, inp), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("all_to_all")
        try:
            outs, inputs, first = self._check.all_to_all(out, inp)
        except _REFUSALS as exc:
            self._refused("all_to_all", exc, (out, inp))
            raise
        return self._collective("all_to_all", about(first), first.nbytes * self.size,
                                lambda b: b.all_to_all(outs, inputs), async_op, like=first,
                                arrays=[*named("inp", inputs), *named("out", outs)],
                                stream=stream)

    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every rank of the communicator has called barrier (host arrays' work
        included; GPU work queued on streams is not waited for)."""
        self._check_open("barrier")
        return self._collective("barrier", "", 0, lambda b: b.barrier(), async_op)

    # ---- objects (pickle: trusted peers only) ------------------------------------------------
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Return rank `src`'s `obj` on every rank (other ranks' `obj` is ignored).

        Objects travel as pickles: unpickling runs code, so use this only among trusted peers.
        """
        self._check_open("broadcast_object")
        return objects.broadcast_object(self, obj, self._check.peer("broadcast_object", src,
                                                                     "src"))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's `obj`, in rank order (pickle: trusted peers only)."""
        self._check_open("all_gather_object")
        return objects.all_gather_object(self, obj)

    # ---- groups (groups.py) ------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Collective: a new communicator of the ranks that pass the same `color`, ordered by
        (`key`, rank). Ranks passing color=None get None."""
        self._check_open("split")
        return groups.split(self, color, key)

    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """Collective over all ranks: a communicator of `ranks` (in ascending order, as
        torch.distributed does). Ranks not listed get None."""
        self._check_open("new_group")
        return groups.new_group(self, ranks)

    # ---- lifetime ----------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self._closed:
            from .errors import CommunicatorClosedError

            if self._owner_pid != os.getpid():
                raise CommunicatorClosedError(
                    f"rank {self.rank}: {op}: this communicator belongs to process "
                    f"{self._owner_pid}, and this process ({os.getpid()}) was forked from it "
                    f"after init(): a child cannot use its parent's communicator (it would "
                    f"take its parent's place as rank {self.rank}). Call anyccl.init() in the "
                    f"child as a rank of its own, or fork before init()")
            raise CommunicatorClosedError(f"rank {self.rank}: {op}: the communicator is closed")

    def _disown(self) -> None:
        """In a child forked from this communicator's process: refuse every call, and leave
        the parent's shared memory, threads and connections to the parent (closing them
        here would tell the parent's peers that it left)."""
        self._closed = True
        self._gpu_side.plans = None
        _live.discard(self)

    def close(self) -> None:
        """Finish queued work (briefly), then release shared memory, threads and connections.
        Idempotent; also called at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._gpu_side.plans = None
        _live.discard(self)
        try:
            if self._gpu_side.gpu is not None:
                self._gpu_side.gpu.close()
        finally:
            try:
                self._engine.close()
            finally:
                if self._owns_store:
                    self._store.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _after_fork_in_child() -> None:
    for comm in list(_live):
        comm._disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_all() -> None:
    """Close every communicator still open (registered with atexit)."""
    for comm in list(_live):
        try:
            comm.close()
        except AnycclError:
            pass
