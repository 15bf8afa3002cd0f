"""The Communicator: the public operations. It checks, numbers, records and routes; it calls
no transport.

Each operation's arguments are checked first (`arguments.py`), once, before any byte moves; a
refused call raises and leaves the communicator usable, and a refused host collective is told
to the other ranks (`_refused`), which raise too. Host arrays go, as flat NumPy views, to the
host engine (engine.py), which runs them on the host backend in issue order, each collective
with its signature (agreement.py) for the backend to compare across ranks; GPU arrays go, as
`GpuArray`s, to the GPU engine (gpu_dispatch.py), which queues them on CUDA streams. Messages
take the same two ways (messages.py); the uneven forms, sub-groups, inputs that cannot be
written in place and lifetime have modules of their own (uneven_calls.py, groups.py,
in_place.py, lifetime.py). Every operation gets a sequence number, a flight-recorder line and,
in debug mode, the full agreement check across ranks. Backends trust what they receive.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from . import groups, in_place, layouts, lifetime, recovery
from .algorithms import objects
from .arguments import Arguments, named, seconds
from .backends.base import Backend
from .backends.gpu_base import GpuBackend
from .buffers import Array, lives_on_gpu
from .engine import HostEngine
from .errors import AnycclError, CommunicatorClosedError, InvalidArgumentError, UnsupportedError
from .gpu_dispatch import FULL_PATH, GpuDispatch
from .messages import MessageCalls
from .ops import ReduceOp
from .store import Store
from .trace import ArgsText, FlightRecorder, OpRecord, about
from .uneven_calls import UnevenCalls
from .work import Work

# a collective's refusal of its own arguments: told to the other ranks (see `_refused`)
_REFUSALS = (InvalidArgumentError, UnsupportedError)


# the hot path's kinds (Backend.HOT_KINDS)
_HOT_ALL_REDUCE, _HOT_BROADCAST, _HOT_ALL_GATHER = (
    Backend.HOT_KINDS.index(name) for name in ("all_reduce", "broadcast", "all_gather"))


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
        self.debug, self.job_id = debug, job_id
        self.flight_recorder = FlightRecorder(rank, name)
        self._log = self.flight_recorder.add   # the record of each operation issued
        self._check = Arguments(rank, size)
        self._backend, self._store = backend, store   # the host backend: for its name only
        self._owns_store = owns_store  # the world communicator; sub-communicators share it
        self._name = name
        self._engine = HostEngine(backend, f"rank {rank} ({name})", rank=rank, size=size,
                                  timeout_s=timeout_s, recorder=self.flight_recorder,
                                  job_id=job_id)
        self._seq = 0
        self._splits = 0
        self._closed = False
        self._gpu_side = GpuDispatch(self._check, backend, store, rank=rank, size=size,
                                     local_rank=local_rank, name=name, timeout_s=timeout_s,
                                     meet=self.barrier, post_mortem=self._engine.post_mortem,
                                     number=self._number, recorder=self.flight_recorder,
                                     device=device, backend=gpu_backend, kind=gpu_kind)
        # a blocking small all_reduce, broadcast or all_gather on NumPy arrays in one
        # compiled call (the engine's: HostEngine.hot)
        self._hot_call, self._hot = self._engine.hot_call, self._engine.hot
        self._messages = MessageCalls(self, self._check, self._engine, self._gpu_side)
        self._message = self._messages.message   # send, recv, isend, irecv: one call each
        self._uneven = UnevenCalls(self, self._check, self._gpu_side, self._refused,
                                   self._collective, lambda: self._seq)
        self._owner_pid = os.getpid()
        # the host of each rank, and why the host backend is what it is (set by init())
        self.hosts: tuple[str, ...] = ()
        self.backend_reason = "given"
        # after `shrink`: {"ranks": the parent's ranks that are members, "lost": rank -> why}
        self.shrunk_from: dict[str, Any] | None = None
        self._shrinks = 0   # shrink rounds begun from this communicator
        # after `grow` (or `anyccl.join`): {"ranks": the size before, "joined": new ranks}
        self.grown_from: dict[str, Any] | None = None
        self._grows = 0     # grow rounds begun from this communicator
        lifetime.live.add(self)

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
        return self._backend.name if gpu_backend is None else \
            f"cpu:{self._backend.name},cuda:{gpu_backend.name}"

    @property
    def host_backend(self) -> Backend:
        """The backend serving this communicator's host arrays (`backends/base.py`); shm's
        says whether its ranks read each other's arrays directly (`direct`)."""
        return self._backend

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

    @property
    def failure(self) -> BaseException | None:
        """The error that broke this communicator (a timeout, a lost peer, an error halfway
        through an operation, an abort), on host or GPU arrays: every later call raises naming
        it. None while none has."""
        return self._engine.failure or self._gpu_side.failure

    def lost_ranks(self) -> dict[int, str]:
        """The ranks this rank knows to be gone, and what happened to each (a process that
        ended, a host that fell silent, a rank that closed its communicator), in the order
        they were found: the communicator's one view of its peers (liveness.py), which every
        transport reports to. This rank's view, not agreed by the others: `shrink` agrees,
        and from then on every rank it left out is in it. Empty while every peer seems
        alive."""
        return self._engine.backend.departed()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (or this process was forked from the one that made it)."""
        return self._closed

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

    def _collective(self, name: str, args: ArgsText, nbytes: int, operands: tuple,
                    async_op: bool, *, like: Array | None = None, root: int = -1,
                    op: ReduceOp | None = None, arrays: Sequence[tuple[str, Array]] = (),
                    stream: Any = None, replayable: bool = True,
                    gpu_call: Callable[[Any], Any] | None = None) -> Work | None:
        """Number and record collective `name`, then route it: host arrays to the host engine,
        which runs the host backend's method `name` on `operands`; GPU arrays to the GPU
        engine, which gets the function that queues it from the GPU backend's `name` (or from
        `gpu_call(gpu_backend)`). `like` (the array whose dtype and size every rank must agree
        on), `root` and `op` are its signature. replayable=False: a blocking GPU call leaves no
        plan (its queued function holds buffers of its own, used once). Host arrays staged
        through contiguous copies (layouts.py) are settled here: written back once it is done."""
        if self._check.staged:
            staged = self._check.take_staged()   # (dropped if the call fails)
            layouts.check_stream(staged, stream, lambda text: self._check.fail(name, text))
            return layouts.settle(self._collective(name, args, nbytes, operands, async_op,
                                                   like=like, root=root, op=op, arrays=arrays,
                                                   stream=stream, replayable=replayable,
                                                   gpu_call=gpu_call), staged)
        enqueue = None
        # one host array and no stream (the common case) cannot be on a GPU: no need to ask
        if (stream is not None or len(arrays) != 1 or type(like) is not np.ndarray) \
                and self._gpu_side.on_gpu(name, arrays, stream):
            enqueue = self._gpu_side.prepare(name, operands, gpu_call)
        self._seq += 1
        record = OpRecord(name, self._seq, args, nbytes)
        self._log(record)
        if enqueue is None:
            return self._engine.collective(record, operands, async_op, like, root, op,
                                           self.debug)
        if self.debug:
            self._engine.check_agreement(record, like, root, op)
        return self._gpu_side.collective(record, args, enqueue, operands, [a for _, a in arrays],
                                         async_op, stream, replayable and not (
                                             self.debug or stream is not None))

    def _refused(self, name: str, exc: AnycclError, args: tuple) -> None:
        """This rank refused its arguments to collective `name`: the other ranks are told and
        raise too (host collectives only; a closed or one-rank communicator tells nobody)."""
        self._check.take_staged()   # what its checks staged before refusing is dropped
        if self._closed or self.size == 1 or self._engine.failure is not None \
                or lives_on_gpu(args):
            return
        record = OpRecord(name, self._number(), "refused its arguments")
        self._engine.refuse(self.flight_recorder.queued(record), str(exc))

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
        if self._closed:
            self._check_open("batch")
        return self._gpu_side.batch()

    # ---- point to point ----------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0, *, stream: Any = None) -> None:
        """Send `tensor` to rank `dst`. Host arrays: returns once the data is out of `tensor`
        (it may be buffered in shared memory before `dst` receives it). GPU arrays: queued on
        the stream like a collective; messages between two ranks match in issue order."""
        self._message("send", tensor, dst, tag, False, stream)

    def recv(self, tensor: Any, src: int | None, tag: int = 0, *, stream: Any = None) -> int:
        """Receive the next message from `src` with `tag` into `tensor` (same dtype and size as
        sent) and return the sender. src=None (host arrays): the first message with `tag` from
        any rank; messages from each rank still arrive in the order it sent them."""
        sender = self._message("recv", tensor, src, tag, False, stream)
        return src if src is not None else sender  # type: ignore[return-value]

    def isend(self, tensor: Any, dst: int, tag: int = 0, *, stream: Any = None) -> Work:
        """Start sending `tensor` to `dst`; do not modify it until the Work completes."""
        return self._message("send", tensor, dst, tag, True, stream)  # type: ignore[return-value]

    def irecv(self, tensor: Any, src: int | None, tag: int = 0, *, stream: Any = None) -> Work:
        """Start receiving into `tensor`; read it only after the Work completes. src=None: from
        any rank (host arrays); the Work's `source` then names the sender."""
        return self._message("recv", tensor, src, tag, True, stream)  # type: ignore[return-value]

    def sendrecv(self, send_tensor: Any, dst: int, recv_tensor: Any, src: int | None,
                 tag: int = 0, *, stream: Any = None) -> int:
        """Send `send_tensor` to `dst` and receive the next message from `src` with `tag` into
        `recv_tensor`, both at once (MPI's Sendrecv): neither waits for the other, so a ring of
        exchanges cannot deadlock. Returns the sender (src=None, host arrays: from any rank).
        Host arrays: returns when the message arrived; GPU arrays: queued on the stream."""
        if self._closed:
            self._check_open("sendrecv")
        return self._messages.sendrecv(  # type: ignore[return-value]
            send_tensor, dst, recv_tensor, src, tag, stream)

    # ---- collectives -------------------------------------------------------------------------
    # GPU arrays: each call is queued after the work on the caller's current stream (torch's or
    # CuPy's, or `stream=`) and returns once queued; that stream waits for the result.
    def broadcast(self, tensor: Any, src: int, async_op: bool = False, *,
                  stream: Any = None) -> Any:
        """Every rank's `tensor` becomes a copy of rank `src`'s `tensor`.

        Returns:
            Blocking: the array that holds the result (see `all_reduce`). Else a `Work`.
        """
        if (hot := self._hot) is not None and not async_op and stream is None \
                and self._hot_call(hot, self, _HOT_BROADCAST, tensor, src) is not None:
            return tensor   # the whole call compiled (host arrays: `hot_context`)
        if (replay := self._gpu_side.compiled_replay) is not None and not async_op \
                and stream is None and replay(("broadcast", src), tensor):
            return tensor   # a cached plan replayed whole in compiled code
        if (type(tensor) is not np.ndarray or not tensor.flags.writeable
                or self._gpu_side.plans is not None) and (early := in_place.early(
                    self, ("broadcast", src), tensor, async_op, stream,
                    lambda copy: self.broadcast(copy, src))) is not FULL_PATH:
            return early
        if self._closed:
            self._check_open("broadcast")
        try:
            x = self._check.array("broadcast", tensor, "tensor", writable=True)
            src = self._check.peer("broadcast", src, "src")
        except _REFUSALS as exc:
            self._refused("broadcast", exc, (tensor,))
            raise
        work = self._collective("broadcast", about(x, ", src={}", src), x.nbytes,
                                (x, src), async_op, like=x, root=src,
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
        if (hot := self._hot) is not None and not async_op and stream is None \
                and self._hot_call(hot, self, _HOT_ALL_REDUCE, tensor, op) is not None:
            return tensor   # the whole call compiled (host arrays: `hot_context`)
        if (replay := self._gpu_side.compiled_replay) is not None and not async_op \
                and stream is None and replay(("all_reduce", op), tensor):
            return tensor   # a cached plan replayed whole in compiled code
        if (type(tensor) is not np.ndarray or not tensor.flags.writeable
                or self._gpu_side.plans is not None) and (early := in_place.early(
                    self, ("all_reduce", op), tensor, async_op, stream,
                    lambda copy: self.all_reduce(copy, op))) is not FULL_PATH:
            return early
        if self._closed:
            self._check_open("all_reduce")
        try:
            x, rop = self._check.reduced("all_reduce", tensor, op)
        except _REFUSALS as exc:
            self._refused("all_reduce", exc, (tensor,))
            raise
        work = self._collective("all_reduce", about(x, ", op={0.name}", rop), x.nbytes,
                                (x, rop), async_op, like=x, op=rop,
                                arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def reduce(self, tensor: Any, dst: int, op: ReduceOp | str = ReduceOp.SUM,
               async_op: bool = False, *, stream: Any = None) -> Any:
        """Rank `dst`'s `tensor` becomes the reduction of all ranks' `tensor`; the other ranks'
        arrays are left as they were.

        Returns:
            Blocking: the array that holds the result (see `all_reduce`). Else a `Work`.
        """
        if (replay := self._gpu_side.compiled_replay) is not None and not async_op \
                and stream is None and replay(("reduce", dst, op), tensor):
            return tensor   # a cached plan replayed whole in compiled code
        if (type(tensor) is not np.ndarray or not tensor.flags.writeable
                or self._gpu_side.plans is not None) and (early := in_place.early(
                    self, ("reduce", dst, op), tensor, async_op, stream,
                    lambda copy: self.reduce(copy, dst, op))) is not FULL_PATH:
            return early
        if self._closed:
            self._check_open("reduce")
        try:
            x, rop = self._check.reduced("reduce", tensor, op)
            dst = self._check.peer("reduce", dst, "dst")
        except _REFUSALS as exc:
            self._refused("reduce", exc, (tensor,))
            raise
        work = self._collective("reduce", about(x, ", dst={}, op={.name}", dst, rop),
                                x.nbytes, (x, dst, rop), async_op, like=x,
                                root=dst, op=rop, arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def all_gather(self, out: Any, tensor: Any, async_op: bool = False, *,
                   stream: Any = None) -> Work | None:
        """`out` receives every rank's `tensor` in rank order: a list of `size` arrays, or one
        array of size * tensor.size elements. The arrays may differ in size from rank to rank
        ("allgatherv"): then `out` is a list whose entry j has rank j's size, on every rank."""
        if (hot := self._hot) is not None and not async_op and stream is None \
                and self._hot_call(hot, self, _HOT_ALL_GATHER, tensor, out) is not None:
            return None   # the whole call compiled (host arrays: `hot_context`)
        if self._gpu_side.plans is not None and (replayed := self._gpu_side.replay(
                ("all_gather",), (out, tensor), async_op, stream)) is not FULL_PATH:
            return replayed   # a GPU call ran: this one replayed its plan
        self._check_open("all_gather")
        try:
            x, outs, even = self._check.all_gather(out, tensor)
        except _REFUSALS as exc:
            self._refused("all_gather", exc, (out, tensor))
            raise
        if not even:
            return self._uneven.all_gather(x, outs, async_op, stream)
        return self._collective("all_gather", about(x), x.nbytes * self.size,
                                (outs, x), async_op, like=x,
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
        try:
            x, dst, outs = self._check.rooted("gather", tensor, "tensor", dst, "dst", out_list,
                                              "out_list", uneven)
        except _REFUSALS as exc:
            self._refused("gather", exc, (tensor, out_list))
            raise
        if uneven:
            return self._uneven.rooted("gather", x, out_list, "out_list", dst, "dst", True,
                                       async_op, stream)
        return self._collective("gather", about(x, ", dst={}", dst), x.nbytes * self.size,
                                (x, outs, dst), async_op, like=x, root=dst,
                                arrays=[("tensor", x), *named("out_list", outs or [])],
                                stream=stream)

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
        try:
            x, src, pieces = self._check.rooted("scatter", out, "out", src, "src", chunks,
                                                "chunks", uneven)
        except _REFUSALS as exc:
            self._refused("scatter", exc, (out, chunks))
            raise
        if uneven:
            return self._uneven.rooted("scatter", x, chunks, "chunks", src, "src", False,
                                       async_op, stream)
        return self._collective("scatter", about(x, ", src={}", src), x.nbytes * self.size,
                                (x, pieces, src), async_op, like=x, root=src,
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
            x, inputs, rop = self._check.reduce_scatter(out, inp, op)
        except _REFUSALS as exc:
            self._refused("reduce_scatter", exc, (out, inp))
            raise
        return self._collective("reduce_scatter", about(x, ", op={0.name}", rop),
                                x.nbytes * self.size, (x, inputs, rop),
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
                                (outs, inputs), async_op, like=first,
                                arrays=[*named("inp", inputs), *named("out", outs)],
                                stream=stream)

    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every rank of the communicator has called barrier (host arrays' work
        included; GPU work queued on streams is not waited for)."""
        self._check_open("barrier")
        return self._collective("barrier", "", 0, (), async_op)

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

    def shrink(self, timeout: float | timedelta | None = None) -> Communicator:
        """After a peer was lost: every surviving rank calls this and gets a new communicator of
        the survivors, ranks renumbered in their old order, on the same kinds of transport
        (recovery.py). The survivors agree on who is gone, also when they noticed different
        ranks, and when another rank dies meanwhile. `timeout` (default: the communicator's)
        bounds the whole; past it, TimeoutError names the ranks that never answered. The new
        communicator's `shrunk_from` says which ranks it kept and what happened to the others;
        this one stays broken (close it)."""
        return recovery.shrink(self, seconds(timeout, self.timeout_s))

    def grow(self, count: int | None = None,
             timeout: float | timedelta | None = None) -> Communicator:
        """Collective over all ranks: admit processes started later that called
        `anyccl.join()` (replacements for lost ranks, or more workers; grow.py), and return
        the communicator of this one's ranks, keeping their numbers, and the newcomers after
        them in the order they came. `count`: wait for that many newcomers (every rank passes
        the same); None: admit those waiting now, and return this communicator itself when
        none is. `timeout` (default: the communicator's) bounds the whole; past it,
        TimeoutError says how many came, and this communicator goes on as it was. The new
        communicator's `grown_from` says which ranks joined; this one stays usable (close it
        when done with it)."""
        from . import grow as growing  # it makes communicators as init() does (bootstrap)

        return growing.grow(self, count, seconds(timeout, self.timeout_s))

    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """Collective over all ranks: a communicator of `ranks` (in ascending order, as
        torch.distributed does). Ranks not listed get None."""
        self._check_open("new_group")
        return groups.new_group(self, ranks)

    # ---- lifetime ----------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        """Raise CommunicatorClosedError for `op` if this communicator is closed (or belongs to
        the process this one was forked from); the hot calls look at `_closed` first."""
        if self._closed:
            raise lifetime.closed_error(self.rank, op, self._owner_pid)

    def abort(self) -> None:
        """End this communicator on this rank now, from any thread, waiting for nothing: work
        in progress fails (a thread waiting in an operation gets CommunicatorClosedError within
        a peer check, a fraction of a second), queued GPU work is cut short (the ipc kernels
        return, the NCCL communicator is aborted, not destroyed), peers waiting on this rank
        fail as on a lost peer, and everything is released as by `close()`. For a survivor
        that gives up on an operation before its deadline, or a watchdog of the caller's own.
        Idempotent."""
        if self._closed:
            return
        error = CommunicatorClosedError(f"rank {self.rank}: the communicator was aborted on "
                                        f"this rank")
        self._engine.abort(error)
        self._gpu_side.abort(error)
        self.close()

    def close(self) -> None:
        """Finish queued work (briefly), then release shared memory, threads and connections.
        Idempotent; also called at interpreter exit."""
        lifetime.close(self, self._gpu_side, self._engine, self._store if self._owns_store
                       else None)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
