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
import functools
import os
import pickle
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import agreement, gpu
from .algorithms import uneven
from .arguments import Arguments
from .backends.base import Backend
from .backends.gpu_base import GpuBackend
from .buffers import (
    SUPPORTED_DTYPES,
    Array,
    GpuArray,
    Pieces,
    current_stream,
    immutable_copy,
    lives_on_gpu,
    overlaps,
)
from .engine import Engine
from .errors import (
    AnycclError,
    CollectiveMismatchError,
    InvalidArgumentError,
    PeerLostError,
    TimeoutError,
    UnsupportedError,
)
from .gpu_dispatch import GpuDispatch
from .ops import COLLECTIVES, ReduceOp
from .plans import Plans
from .store import Store
from .trace import ArgsText, FlightRecorder, OpRecord, flight_directory, format_bytes
from .work import GpuWork, Work

_OP_CODES = list(COLLECTIVES)
_FULL_PATH = object()   # _replayed's answer when a call must take the full path
_REDOP_CODES = list(ReduceOp)
_DTYPE_CODES = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}

_live: weakref.WeakSet[Communicator] = weakref.WeakSet()
_NAME_BITS, _DTYPE_BITS = agreement.NAME_BITS, agreement.DTYPE_BITS


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
        self.timeout_s = timeout_s
        self.debug = debug
        self.job_id = job_id
        self.flight_recorder = FlightRecorder(rank, name)
        self._check = Arguments(rank, size)
        self._backend = backend
        self._store = store
        self._owns_store = owns_store  # the world communicator; sub-communicators share it
        self._name = name
        self._engine = Engine(backend, f"rank {rank} ({name})")
        self._seq = 0
        self._p2p_seq: dict[tuple[str, int | None, int | None], int] = {}
        self._splits = 0
        self._closed = False
        self._gpu_side = GpuDispatch(self._check, backend, store, rank=rank, size=size,
                                     local_rank=local_rank, name=name, timeout_s=timeout_s,
                                     meet=self.barrier, post_mortem=self._post_mortem,
                                     device=device, backend=gpu_backend, kind=gpu_kind)
        self._batch: list[tuple] | None = None
        self._plans: Plans | None = None  # blocking GPU calls' plans, once a GPU call ran
        self._owner_pid = os.getpid()
        # the host of each rank, and why the host backend is what it is (set by init())
        self.hosts: tuple[str, ...] = ()
        self.backend_reason = "given"
        _live.add(self)

    # ---- identity ----------------------------------------------------------------------------
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

    def _collective(self, name: str, args: ArgsText, nbytes: int, call: Callable[[Any], Any],
                    async_op: bool, *, like: Array | None = None, root: int = -1,
                    op: ReduceOp | None = None, arrays: Sequence[tuple[str, Array]] = (),
                    stream: Any = None, replayable: bool = True) -> Work | None:
        """Run collective `name` in issue order: `call(backend)` runs it on the host backend, or
        returns the function that queues it on the GPU backend. `like` (the array whose dtype
        and size every rank must agree on), `root` and `op` are what debug mode compares.
        replayable=False: a blocking GPU call leaves no plan (its queued function holds
        buffers of its own, used once)."""
        on_gpu = self._gpu_side.on_gpu(name, arrays, stream)
        enqueue = None
        if on_gpu:
            gpu_backend = self._gpu_side.backend(name, collective=True)
            try:
                enqueue = call(gpu_backend)  # refuses what NCCL cannot do, before any byte moves
            except AnycclError as exc:
                raise type(exc)(f"rank {self.rank}: {name}: {exc}") from None
        self._seq += 1
        record = OpRecord(name, self._seq, args, nbytes)
        entry = self.flight_recorder.queued(record)
        signature = None
        if self.debug:
            signature = np.array([_OP_CODES.index(name), record.seq,
                                  _DTYPE_CODES[like.dtype] if like is not None else -1,
                                  like.size if like is not None else -1, root,
                                  _REDOP_CODES.index(op) if op is not None else -1], np.int64)
        if enqueue is not None:  # the GPU path: the host engine only runs debug mode's check
            if signature is not None:
                self._engine.call(self._host_task(record, entry, signature, None),
                                  lambda: Work(record, self.rank))
            gpu_arrays = [a for _, a in arrays]
            plan = replayable and not (self.debug or stream is not None)   # the next such call
            # an async operation holds its tensors itself: a plan releases the arrays' owners
            held = [a.owner[0] for a in gpu_arrays if type(a.owner) is list and a.owner] \
                if plan and async_op else None
            work = self._gpu_side.queue(record, [entry], enqueue, gpu_arrays, async_op, stream,
                                        keep=held)
            if plan:
                if self._plans is None:
                    self._plans = Plans()
                self._plans.keep(name, args, nbytes, enqueue, gpu_arrays, gpu_backend)
            return work
        if like is not None:  # agreement.word(), inline
            record.agree = (_NAME_BITS[name] | _DTYPE_BITS[like.dtype] | (root + 1) << 15
                            | (0 if op is None else op.agree_bits), like.size)
        else:
            record.agree = (_NAME_BITS[name], 0)
        if not async_op and signature is None and self._engine.run_now(self._run_host, record,
                                                                       entry, call):
            return None  # the common blocking case: run right here, nothing outstanding
        task = self._host_task(record, entry, signature, call)
        if async_op:
            return self._engine.submit(task, Work(record, self.rank))
        self._engine.call(task, lambda: Work(record, self.rank))
        return None

    def _run_host(self, record: OpRecord, entry: list, call: Callable[[Any], Any] | None,
                  signature: np.ndarray | None = None) -> None:
        """One operation on the host backend: debug mode's agreement check (if `signature`),
        then `call(backend)` (None: the operation itself is queued on a GPU)."""
        backend = self._backend
        FlightRecorder.started(entry)
        backend.begin(record, time.monotonic() + self.timeout_s)
        try:
            if signature is not None:
                self._check_agreement(record, signature)
            if call is not None:
                call(backend)
        except BaseException as exc:
            FlightRecorder.ended(entry, exc)
            self._post_mortem(exc)
            raise
        if call is not None:
            FlightRecorder.ended(entry)
        backend.end(record)

    def _replayed(self, tag: tuple, tensors: tuple, async_op: bool, stream: Any) -> Any:
        """A GPU call on arrays an earlier call checked, replayed from its cached plan
        (plans.py) with its own record, flight-recorder entry and deadline: a blocking one
        queued right on the caller's current stream (returns None), an async one on the
        backend's stream after it (returns its GpuWork; the queued operation holds `tensors`
        until done). _FULL_PATH: the call must take the full path. Called only once a GPU
        call made a plan (`self._plans` set)."""
        if stream is not None:
            return _FULL_PATH
        plan = self._plans.find(tag, tensors)
        if plan is None:
            return _FULL_PATH
        self._seq += 1
        record = OpRecord(plan.name, self._seq, plan.args, plan.nbytes)
        entry = self.flight_recorder.queued(record)
        stream = plan.current_stream(plan.device)
        deadline = record.issued_at + self.timeout_s
        try:
            if not async_op:
                plan.run(record, (stream,), deadline, plan.enqueue, None, [entry], stream)
                return None
            event = plan.run(record, (stream,), deadline, plan.enqueue, tensors, [entry])
        except BaseException as exc:
            FlightRecorder.ended(entry, exc)
            self._post_mortem(exc)
            raise
        work = GpuWork(record, self.rank, plan.backend,
                       functools.partial(plan.current_stream, plan.device))
        work.bind(event, deadline)
        return work

    def _host_task(self, record: OpRecord, entry: list, signature: np.ndarray | None,
                   call: Callable[[Any], Any] | None) -> Callable[[Work | None], None]:
        """`_run_host` as the task the host engine queues."""
        return lambda _=None: self._run_host(record, entry, call, signature)

    def _check_agreement(self, record: OpRecord, signature: np.ndarray) -> None:
        """Debug mode: every rank learns what every rank called; all raise on a difference."""
        everyone = [np.empty_like(signature) for _ in range(self.size)]
        self._backend.all_gather(everyone, signature)
        if all((s == signature).all() for s in everyone):
            return
        lines = [f"rank {self.rank}: collectives disagree at {record} (debug mode):",
                 f"  {'rank':>4}  {'op':<15}{'seq':>6}  {'dtype':<10}{'count':>10}{'root':>6}  "
                 f"redop"]
        for r, (op, seq, dtype, count, root, redop) in enumerate(everyone):
            lines.append(
                f"  {r:>4}  {_OP_CODES[op]:<15}{seq:>6}  "
                f"{SUPPORTED_DTYPES[dtype].name if dtype >= 0 else '-':<10}"
                f"{count if count >= 0 else '-':>10}{root if root >= 0 else '-':>6}  "
                f"{_REDOP_CODES[redop].name if redop >= 0 else '-'}")
        raise CollectiveMismatchError("\n".join(lines))

    def _refused(self, name: str, exc: AnycclError, args: tuple) -> None:
        """This rank refused its arguments to collective `name`: arrive at it all the same,
        with a refused signature and the reason, so that every other rank raises too (host
        collectives; a call on GPU arrays, or on a closed or one-rank communicator, tells
        nobody)."""
        if self._closed or self.size == 1 or self._engine.failure is not None \
                or lives_on_gpu(args):
            return
        self._seq += 1
        record = OpRecord(name, self._seq, "refused its arguments")
        record.agree = agreement.refused(name, str(exc))
        entry = self.flight_recorder.queued(record)
        try:
            self._engine.call(self._host_task(record, entry, None, lambda b: b.barrier()),
                              lambda: Work(record, self.rank))
        except CollectiveMismatchError:
            pass  # what the peers called: they raise their side of it

    def _post_mortem(self, exc: BaseException) -> None:
        """On a timeout or a lost peer: write the flight record once and point the error at it."""
        if not isinstance(exc, (TimeoutError, PeerLostError)):
            return
        path = self.flight_recorder.dumped_to or self.flight_recorder.dump(
            flight_directory(self.job_id))
        if exc.args and isinstance(exc.args[0], str) and path not in exc.args[0]:
            exc.args = (f"{exc.args[0]}\n  flight record of rank {self.rank}: {path}",
                        *exc.args[1:])

    def _message(self, kind: str, x: Array, peer: int | None, tag: int, async_op: bool,
                 stream: Any = None) -> Work | int | None:
        """Send or receive (peer=None: receive from any rank); a blocking receive returns the
        sender, an async call its Work."""
        record = self._message_record(kind, x, peer, tag)
        if (stream is not None or type(x) is not np.ndarray) and self._gpu_side.on_gpu(
                "i" + kind if async_op else kind, [("tensor", x)], stream):
            op = "i" + kind if async_op else kind
            if peer is None:
                raise self._check.fail(op, "src=None (from any rank) needs host arrays: GPU "
                                           "messages match in issue order between two named "
                                           "ranks (NCCL has no any-source receive); name src")
            return self._gpu_message(op, record, x, peer, tag, async_op, stream)
        if self._batch is not None and not async_op:
            raise self._check.fail(kind, f"use i{kind} inside `with comm.batch():`")
        entry = self.flight_recorder.queued(record)
        if not async_op:
            return self._blocking_messages(record, entry, ((kind, x, peer, tag),))
        work = Work(record, self.rank)
        if peer is not None and self._engine.run_now(self._message_at_once, kind, x, peer, tag,
                                                     entry, work, after_posted=True) \
                and work.is_completed():
            return work
        backend, engine = self._backend, self._engine
        sender: list[int] = []   # a receive from any rank: whose message it took
        if kind == "send":
            post = backend.post_send
        elif peer is None:
            post = functools.partial(backend.post_recv, found=sender.append)
        else:
            post = backend.post_recv

        def task(w: Work) -> None:
            FlightRecorder.started(entry)
            done = engine.completion(w)

            def on_done(error: BaseException | None) -> None:
                self._message_ended(entry, error)
                if kind == "recv":
                    w.source = sender[0] if sender else peer
                done(error)
            post(x, peer, tag, record, time.monotonic() + self.timeout_s, on_done)
        return engine.post(task, work)

    def _message_at_once(self, kind: str, x: Array, peer: int, tag: int, entry: list,
                         work: Work) -> None:
        """An async message that the transport's fast path finishes right now (a send that
        fits, a receive whose message is already there): `work` completes here, with no
        engine bookkeeping; else nothing happens and the caller posts it."""
        backend = self._backend
        if backend.send_now(x, peer, tag) if kind == "send" else \
                backend.receive_now(x, peer, tag, wait=False):
            FlightRecorder.started(entry)
            FlightRecorder.ended(entry)
            work.source = peer if kind == "recv" else None
            work.complete()

    def _message_record(self, kind: str, x: Array, peer: int | None, tag: int,
                        src: int | None = None) -> OpRecord:
        """The record of a message (kind "sendrecv": of an exchange, receiving from `src`),
        numbered per kind and peers."""
        key = (kind, peer, src)
        self._p2p_seq[key] = seq = self._p2p_seq.get(key, 0) + 1
        nbytes = x.nbytes
        return OpRecord(kind, seq, functools.partial(_message_text, kind, peer, tag, nbytes, src),
                        nbytes)

    def _blocking_messages(self, record: OpRecord, entry: list,
                           messages: tuple[_HostMessage, ...]) -> int | None:
        """Send and receive `messages` together as the one operation `record`, on this thread
        when it may drive the host backend (else in turn on the engine); return the sender of
        the receive among them."""
        found: list[int] = []
        if not self._engine.run_now(self._messages_now, record, entry, messages, found,
                                    after_posted=True):
            self._engine.call(lambda: self._messages_now(record, entry, messages, found),
                              lambda: Work(record, self.rank))
        return found[0] if found else messages[-1][2]

    def _messages_now(self, record: OpRecord, entry: list, messages: tuple[_HostMessage, ...],
                      found: list[int]) -> None:
        """Blocking messages, on the thread that drives the host backend: each through the
        transport's fast path where it takes it (send_now, receive_now: done at once), the
        others posted; return once all are done, raising the first error. A receive from any
        rank appends its sender to `found`. Only posted messages tell the backend that this
        rank is in `record` (what peers see while it waits) and get a deadline."""
        FlightRecorder.started(entry)
        backend = self._backend
        posted, deadline = 0, 0.0
        outcomes: list[BaseException | None] = []
        for kind, x, peer, tag in messages:
            if peer is not None and (backend.send_now if kind == "send"
                                     else backend.receive_now)(x, peer, tag):
                continue
            if not posted:
                deadline = time.monotonic() + self.timeout_s
                backend.begin(record, deadline)
            posted += 1
            if kind == "send":
                backend.post_send(x, peer, tag, record, deadline, outcomes.append)
            else:
                backend.post_recv(x, peer, tag, record, deadline, outcomes.append,
                                  found=found.append)
        if not posted:
            FlightRecorder.ended(entry)
            return
        if len(outcomes) < posted:
            try:
                backend.wait_for_messages(lambda: len(outcomes) == posted, record, deadline)
            except BaseException as exc:
                self._message_ended(entry, exc)
                raise
        backend.end(record)
        error = next((e for e in outcomes if e is not None), None)
        self._message_ended(entry, error)
        if error is not None:
            raise error

    def _message_ended(self, entry: list, error: BaseException | None) -> None:
        FlightRecorder.ended(entry, error)
        if error is not None:
            self._post_mortem(error)

    def _gpu_message(self, op: str, record: OpRecord, x: GpuArray, peer: int, tag: int,
                     async_op: bool, stream: Any) -> Work | None:
        """GPU point-to-point: messages between two ranks match in the order they were issued
        (NCCL has no tags; the ipc backend checks them)."""
        backend = self._gpu_side.backend(op, collective=False)
        enqueue = (backend.send if record.name == "send" else backend.recv)(x, peer, tag)
        entry = self.flight_recorder.queued(record)
        if self._batch is not None:
            if not async_op:
                raise self._check.fail(op, f"use i{record.name} inside `with comm.batch():`")
            waits_on = current_stream(x) if stream is None else (
                lambda s=gpu.stream_pointer(stream): s)
            work = GpuWork(record, self.rank, backend, waits_on)
            self._batch.append((record, entry, enqueue, x, stream, work))
            return work
        return self._gpu_side.queue(record, [entry], enqueue, [x], async_op, stream)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
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
        if self._batch is not None:
            raise self._check.fail("batch", "comm.batch() blocks do not nest")
        self._batch = []
        try:
            yield
        except BaseException:
            self._batch = None
            raise
        pending, self._batch = self._batch, None
        if not pending:
            return
        streams = {s for *_, s, _ in pending if s is not None}
        if len(streams) > 1:
            raise self._check.fail("batch", "the messages of one batch name different stream= "
                                   "values")
        record = OpRecord("batch", pending[0][0].seq,
                          ", ".join(f"{r.name} {r.args}" for r, *_ in pending),
                          sum(r.nbytes for r, *_ in pending))
        enqueue = self._gpu_side.gpu.group([e for _, _, e, *_ in pending])
        arrays = [x for _, _, _, x, _, _ in pending]
        works = [w for *_, w in pending]
        self._gpu_side.queue(record, [entry for _, entry, *_ in pending], enqueue, arrays, True,
                           next(iter(streams), None), works[0])
        for w in works[1:]:
            w.bind(*works[0].bound_to())

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
        if self._batch is not None:
            raise self._check.fail("sendrecv", "use isend and irecv inside `with comm.batch():`")
        if stream is None and type(x) is np.ndarray and type(y) is np.ndarray:
            record = self._message_record("sendrecv", x, dst, tag, src)
            return self._blocking_messages(record, self.flight_recorder.queued(record),
                                           (("send", x, dst, tag), ("recv", y, src, tag)))
        with self.batch():
            sent = self.isend(x, dst, tag, stream=stream)
            received = self.irecv(y, src, tag, stream=stream)
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
        if type(tensor) is not np.ndarray or not tensor.flags.writeable:
            staged = immutable_copy(tensor)
            if staged is not None:
                return self._on_copy("broadcast", tensor, staged, async_op,
                                     lambda copy: self.broadcast(copy, src))
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("broadcast", src), (tensor,), async_op, stream)
            if replayed is not _FULL_PATH:
                return tensor if replayed is None else replayed
        self._check_open("broadcast")
        try:
            x = self._check.array("broadcast", tensor, "tensor", writable=True)
            src = self._check.peer("broadcast", src, "src")
        except _REFUSALS as exc:
            self._refused("broadcast", exc, (tensor,))
            raise
        work = self._collective("broadcast", _about(x, ", src={}", src), x.nbytes,
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
        if type(tensor) is not np.ndarray or not tensor.flags.writeable:
            staged = immutable_copy(tensor)
            if staged is not None:
                return self._on_copy("all_reduce", tensor, staged, async_op,
                                     lambda copy: self.all_reduce(copy, op))
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("all_reduce", op), (tensor,), async_op, stream)
            if replayed is not _FULL_PATH:
                return tensor if replayed is None else replayed
        self._check_open("all_reduce")
        try:
            x = self._check.array("all_reduce", tensor, "tensor", writable=True)
            rop = self._check.reduce_op("all_reduce", op, x.dtype)
        except _REFUSALS as exc:
            self._refused("all_reduce", exc, (tensor,))
            raise
        work = self._collective("all_reduce", _about(x, ", op={0.name}", rop), x.nbytes,
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
        if type(tensor) is not np.ndarray or not tensor.flags.writeable:
            staged = immutable_copy(tensor)
            if staged is not None:
                return self._on_copy("reduce", tensor, staged, async_op,
                                     lambda copy: self.reduce(copy, dst, op))
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("reduce", dst, op), (tensor,), async_op, stream)
            if replayed is not _FULL_PATH:
                return tensor if replayed is None else replayed
        self._check_open("reduce")
        try:
            x = self._check.array("reduce", tensor, "tensor", writable=True)
            dst = self._check.peer("reduce", dst, "dst")
            rop = self._check.reduce_op("reduce", op, x.dtype)
        except _REFUSALS as exc:
            self._refused("reduce", exc, (tensor,))
            raise
        work = self._collective("reduce", _about(x, ", dst={}, op={.name}", dst, rop),
                                x.nbytes, lambda b: b.reduce(x, dst, rop), async_op, like=x,
                                root=dst, op=rop, arrays=[("tensor", x)], stream=stream)
        return tensor if work is None else work

    def _on_copy(self, name: str, tensor: Any, staged: tuple[np.ndarray, Callable],
                 async_op: bool, call: Callable[[np.ndarray], Any]) -> Any:
        """Collective `name` on a writable copy of `tensor`, which cannot be written in place;
        the result as an array of `tensor`'s kind. Blocking only: an async call is refused (on
        every rank, as any refused argument is)."""
        copy, back = staged
        if async_op:
            self._check_open(name)
            exc = InvalidArgumentError(
                f"rank {self.rank}: {name}: tensor ({type(tensor).__name__}) cannot be written "
                f"in place, so async_op=True has nowhere to put the result; call it blocking "
                f"and use what it returns: y = comm.{name}(x, ...)")
            self._refused(name, exc, (copy,))
            raise exc
        call(copy)
        return back(copy)

    def all_gather(self, out: Any, tensor: Any, async_op: bool = False, *,
                   stream: Any = None) -> Work | None:
        """`out` receives every rank's `tensor` in rank order: a list of `size` arrays, or one
        array of size * tensor.size elements. The arrays may differ in size from rank to rank
        ("allgatherv"): then `out` is a list whose entry j has rank j's size, on every rank."""
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("all_gather",), (out, tensor), async_op, stream)
            if replayed is not _FULL_PATH:
                return replayed
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
            arrays = [("tensor", x), *_named("out", outs)]
            self._gpu_side.on_gpu("all_gather", arrays, stream)
            sizes, piece = uneven.agree_sizes(self, x.size, [o.size for o in outs], "all_gather")
            return self._uneven("all_gather", arrays, lambda new: uneven.all_gather_v(
                self.size, outs, x, sizes, piece, new), x, async_op, stream)
        return self._collective("all_gather", _about(x), x.nbytes * self.size,
                                lambda b: b.all_gather(outs, x), async_op, like=x,
                                arrays=[("tensor", x), *_named("out", outs)], stream=stream)

    def gather(self, tensor: Any, out_list: Any = None, dst: int = 0,
               async_op: bool = False, *, stream: Any = None,
               uneven: bool = False) -> Work | None:
        """Rank `dst`'s `out_list` receives every rank's `tensor` in rank order; the other ranks
        pass out_list=None. uneven=True (on every rank): each rank's `tensor` may have its own
        size, and out_list[j] has rank j's ("gatherv")."""
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("gather", dst), (tensor, out_list), async_op, stream)
            if replayed is not _FULL_PATH:
                return replayed
        self._check_open("gather")
        x, dst, outs = self._rooted_args("gather", tensor, "tensor", dst, "dst", out_list,
                                         "out_list", uneven)
        if uneven:
            return self._rooted_uneven("gather", x, out_list, "out_list", dst, "dst", True,
                                       async_op, stream)
        return self._collective("gather", _about(x, ", dst={}", dst), x.nbytes * self.size,
                                lambda b: b.gather(x, outs, dst), async_op, like=x, root=dst,
                                arrays=[("tensor", x), *_named("out_list", outs or [])],
                                stream=stream)

    def _rooted_args(self, op: str, array: Any, name: str, root: Any, root_name: str,
                     pieces: Any, pieces_name: str, uneven: bool
                     ) -> tuple[Array, int, list[Array] | None]:
        """gather's (op "gather": the root's pieces receive) or scatter's arguments, checked,
        a refusal told to the other ranks: (array, root, the root's pieces; None elsewhere and
        for the uneven forms, whose pieces `_rooted_uneven` checks)."""
        gathers = op == "gather"
        try:
            x = self._check.array(op, array, name, writable=not gathers)
            root = self._check.peer(op, root, root_name)
            checked = None
            if not uneven:
                checked = self._check.root_pieces(op, pieces, pieces_name, x, root, root_name,
                                                  writable=gathers)
                if not gathers:
                    self._check.others_disjoint(op, checked or [], pieces_name, x, name)
        except _REFUSALS as exc:
            self._refused(op, exc, (array, pieces))
            raise
        return x, root, checked

    def scatter(self, out: Any, chunks: Any = None, src: int = 0,
                async_op: bool = False, *, stream: Any = None,
                uneven: bool = False) -> Work | None:
        """Rank i's `out` receives `chunks[i]` of rank `src`; the other ranks pass
        chunks=None. uneven=True (on every rank): chunk i has rank i's `out` size, which may
        differ from rank to rank ("scatterv")."""
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("scatter", src), (out, chunks), async_op, stream)
            if replayed is not _FULL_PATH:
                return replayed
        self._check_open("scatter")
        x, src, pieces = self._rooted_args("scatter", out, "out", src, "src", chunks, "chunks",
                                           uneven)
        if uneven:
            return self._rooted_uneven("scatter", x, chunks, "chunks", src, "src", False,
                                       async_op, stream)
        return self._collective("scatter", _about(x, ", src={}", src), x.nbytes * self.size,
                                lambda b: b.scatter(x, pieces, src), async_op, like=x, root=src,
                                arrays=[("out", x), *_named("chunks", pieces or [])],
                                stream=stream)

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, *, stream: Any = None) -> Work | None:
        """Rank i's `out` becomes the reduction of every rank's piece i of `inp` (a list of
        `size` arrays like `out`, or one array of size * out.size elements)."""
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("reduce_scatter", op), (out, inp), async_op, stream)
            if replayed is not _FULL_PATH:
                return replayed
        self._check_open("reduce_scatter")
        try:
            x = self._check.array("reduce_scatter", out, "out", writable=True)
            inputs = self._check.pieces("reduce_scatter", inp, "inp", x, writable=False)
            self._check.others_disjoint("reduce_scatter", inputs, "inp", x, "out")
            rop = self._check.reduce_op("reduce_scatter", op, x.dtype)
        except _REFUSALS as exc:
            self._refused("reduce_scatter", exc, (out, inp))
            raise
        return self._collective("reduce_scatter", _about(x, ", op={0.name}", rop),
                                x.nbytes * self.size, lambda b: b.reduce_scatter(x, inputs, rop),
                                async_op, like=x, op=rop,
                                arrays=[("out", x), *_named("inp", inputs)], stream=stream)

    def all_to_all(self, out: Any, inp: Any, async_op: bool = False, *,
                   stream: Any = None, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> Work | None:
        """Rank i's out[j] receives rank j's inp[i]. Both are lists of `size` arrays of one
        size, or single arrays split evenly into `size` pieces. out may be inp (in place).

        Uneven: with `in_splits` (elements this rank sends to each rank) and `out_splits`
        (elements it receives from each), `out` and `inp` are single arrays (host or GPU) cut
        at those counts, which every pair of ranks must agree on (all ranks raise if not)."""
        if out_splits is not None or in_splits is not None:
            return self._all_to_all_uneven(out, inp, out_splits, in_splits, async_op, stream)
        if self._plans is not None:  # a GPU call ran: this one may replay a plan
            replayed = self._replayed(("all_to_all",), (out, inp), async_op, stream)
            if replayed is not _FULL_PATH:
                return replayed
        self._check_open("all_to_all")
        try:
            if isinstance(inp, (list, tuple)):
                if not inp:
                    raise self._check.fail("all_to_all", "inp is an empty list")
                first = self._check.array("all_to_all", inp[0], "inp[0]", writable=False)
            else:
                whole = self._check.array("all_to_all", inp, "inp", writable=False)
                if whole.size % self.size:
                    raise self._check.fail("all_to_all", f"inp has {whole.size} elements, not "
                                           f"divisible into {self.size} equal pieces")
                first = whole[: whole.size // self.size]
            inputs = self._check.pieces("all_to_all", inp, "inp", first, writable=False)
            outs = self._check.pieces("all_to_all", out, "out", first, writable=True)
            for i, o in enumerate(outs):
                for j, piece in enumerate(inputs):
                    if i != j:
                        self._check.disjoint("all_to_all", o, f"out[{i}]", piece, f"inp[{j}]")
        except _REFUSALS as exc:
            self._refused("all_to_all", exc, (out, inp))
            raise
        return self._collective("all_to_all", _about(first), first.nbytes * self.size,
                                lambda b: b.all_to_all(outs, inputs), async_op, like=first,
                                arrays=[*_named("inp", inputs), *_named("out", outs)],
                                stream=stream)

    def _all_to_all_uneven(self, out: Any, inp: Any, out_splits: Any, in_splits: Any,
                           async_op: bool, stream: Any) -> Work | None:
        self._check_open("all_to_all")
        try:
            x = self._check.array("all_to_all", inp, "inp", writable=False)
            y = self._check.array("all_to_all", out, "out", writable=True)
            arrays = [("inp", x), ("out", y)]
            self._gpu_side.on_gpu("all_to_all", arrays, stream)
            if x.dtype != y.dtype:
                raise self._check.fail("all_to_all", f"out has dtype {y.dtype.name} but inp has "
                                       f"{x.dtype.name}")
            if overlaps(x, y):
                raise self._check.fail("all_to_all", "out and inp share memory; with split sizes "
                                       "pass separate arrays")
            n = self.size
            sends = uneven.check_splits(self.rank, n, [x.size // n] * n if in_splits is None else
                                        in_splits, "in_splits", x.size, "inp")
            receives = uneven.check_splits(self.rank, n, [y.size // n] * n if out_splits is None
                                           else out_splits, "out_splits", y.size, "out")
        except _REFUSALS as exc:
            self._refused("all_to_all", exc, (out, inp))
            raise
        piece = uneven.agree_all_to_all(self, receives, sends)
        return self._uneven("all_to_all", arrays, lambda new: uneven.all_to_all_v(
            n, y, x, receives, sends, piece, new), x, async_op, stream)

    # ---- the uneven ("v") forms (algorithms/uneven.py) ----------------------------------------
    def _rooted_uneven(self, op: str, x: Array, pieces: Any, name: str, root: int,
                       root_name: str, writable: bool, async_op: bool,
                       stream: Any) -> Work | None:
        """gather (writable pieces) or scatter with a size per rank: `pieces` (the root's list,
        None elsewhere) checked, the sizes agreed, then the data moved."""
        try:
            checked = self._check.root_pieces(op, pieces, name, x, root, root_name,
                                              writable=writable, sizes_may_differ=True)
        except _REFUSALS as exc:
            self._refused(op, exc, (x, pieces))
            raise
        arrays = [("tensor" if writable else "out", x), *_named(name, checked or [])]
        self._gpu_side.on_gpu(op, arrays, stream)
        sizes, piece = uneven.agree_sizes(self, x.size, [p.size for p in checked]
                                          if checked is not None else None, op)
        layout = uneven.gather_v if writable else uneven.scatter_v
        return self._uneven(op, arrays, lambda new: layout(self.size, self.rank, x, checked,
                                                           root, sizes, piece, new),
                            x, async_op, stream)

    def _uneven(self, op: str, arrays: list[tuple[str, Array]],
                layout: Callable[[uneven.NewBuffer | None], uneven.Moves], x: Array, async_op: bool,
                stream: Any) -> Work | None:
        """Move an uneven collective's data once the ranks agreed on its sizes: `layout(new)`
        lays it out on padded buffers that `new` makes like `x` (`layout(None)`: pieces as they
        are). Host arrays: at once, through this communicator's even collectives (async_op=True
        gets a Work already complete). GPU arrays: one operation queued like any GPU collective
        (stream=, async Works, deadlines), through the GPU backend's `exchange` where it moves
        pieces of any size, else padded, its scratch allocated in the order of the stream it
        runs after."""
        if not isinstance(x, GpuArray):
            layout(uneven.host_scratch(x)).run_on_host(self)
            if not async_op:
                return None
            work = Work(OpRecord(op, self._seq, "uneven sizes", x.nbytes), self.rank)
            work.complete()
            return work
        after = gpu.stream_pointer(stream) if stream is not None else x.stream
        if self._gpu_side.backend(op, collective=True).exchanges_any_sizes:
            moves = layout(None)   # each piece as it is: no scratch
        elif after is None:   # no stream to order after (JAX): scratch made ready on the host
            moves = layout(uneven.gpu_scratch(x, 0))
            gpu.synchronize_stream(0)
        else:
            moves = layout(uneven.gpu_scratch(x, after))
        like = moves.scratch[0] if moves.scratch else None
        try:
            return self._collective(op, _about(x, ", uneven sizes"), x.nbytes,
                                    moves.queue_on_gpu, async_op, like=like, arrays=arrays,
                                    stream=stream, replayable=False)
        except BaseException:
            if moves.scratch:   # refused or failed before it was queued: given back here
                moves.free(after or 0)
            raise

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
        src = self._check.peer("broadcast_object", src, "src")
        payload = np.frombuffer(pickle.dumps(obj), np.uint8) if self.rank == src else None
        length = np.array([payload.size if payload is not None else 0], np.int64)
        self.broadcast(length, src)
        data = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's `obj`, in rank order (pickle: trusted peers only)."""
        self._check_open("all_gather_object")
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = np.empty(self.size, np.int64)
        self.all_gather(lengths, np.array([payload.size], np.int64))
        width = int(lengths.max())
        mine = np.zeros(width, np.uint8)
        mine[:payload.size] = payload
        everything = np.empty(self.size * width, np.uint8)
        self.all_gather(everything, mine)
        return [pickle.loads(everything[i * width:i * width + int(n)].tobytes())
                for i, n in enumerate(lengths)]

    # ---- groups ------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Collective: a new communicator of the ranks that pass the same `color`, ordered by
        (`key`, rank). Ranks passing color=None get None."""
        self._check_open("split")
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise self._check.fail("split", f"color={color!r} must be a non-negative int or None")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise self._check.fail("split", f"key={key!r} must be an int or None")
        choices = self.all_gather_object((color, self.rank if key is None else key))
        self._splits += 1
        name = f"{self._name}.{self._splits}.{color}"
        members = sorted((k, r) for r, (c, k) in enumerate(choices) if c == color)
        ranks = [r for _, r in members]
        # an existing NCCL communicator splits too (collective over all of its ranks)
        parent = self._gpu_side.gpu
        gpu_child = None if parent is None else parent.split(
            color, choices[self.rank][1],
            f"rank {ranks.index(self.rank)} ({name})" if color is not None else "",
            store=self._store, group=name)
        if color is None:
            return None
        backend = self._backend.subgroup(ranks, name, self.timeout_s)
        child = Communicator(backend, self._store, rank=ranks.index(self.rank), size=len(ranks),
                             local_rank=self.local_rank, timeout_s=self.timeout_s, name=name,
                             job_id=self.job_id, debug=self.debug, device=self._gpu_side.device,
                             gpu_backend=gpu_child, gpu_kind=self._gpu_side.kind)
        if self.hosts:
            child.hosts = tuple(self.hosts[r] for r in ranks)
        child.backend_reason = f"split from {self._name} ({self.backend_reason})"
        return child

    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """Collective over all ranks: a communicator of `ranks` (in ascending order, as
        torch.distributed does). Ranks not listed get None."""
        self._check_open("new_group")
        members = list(ranks)
        for r in members:
            self._check.peer("new_group", r, "ranks[...]")
        if not members or len(set(members)) != len(members):
            raise self._check.fail("new_group", f"ranks={members} must be a non-empty list of "
                                   f"distinct ranks")
        ordered = sorted(members)
        inside = self.rank in ordered
        return self.split(0 if inside else None, ordered.index(self.rank) if inside else None)

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
        self._plans = None
        _live.discard(self)

    def close(self) -> None:
        """Finish queued work (briefly), then release shared memory, threads and connections.
        Idempotent; also called at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._plans = None
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


_DTYPE_NAMES = {d: d.name for d in SUPPORTED_DTYPES}


def _about(x: Array, more: str = "", *values: Any) -> Callable[[], str]:
    """An op record's argument text, made when read: `x` as "float32 x 4", then `more` formatted
    with `values` (str.format). Records are kept (flight recorder, plans), so the text captures
    `x`'s dtype and size, never `x`: a record keeps no array alive."""
    dtype, size = x.dtype, x.size
    return lambda: f"{_DTYPE_NAMES.get(dtype) or dtype.name} x {size}{more.format(*values)}"


# a blocking host message: kind ("send" or "recv"), array, peer (None: any rank), tag
_HostMessage = tuple[str, Array, Optional[int], int]


def _message_text(kind: str, peer: int | None, tag: int, nbytes: int, src: int | None) -> str:
    """A message's argument text ("dst=1, tag=0, 8 B"), made when first read."""
    if kind == "sendrecv":
        return (f"dst={peer}, src={'any' if src is None else src}, tag={tag}, "
                f"{format_bytes(nbytes)}")
    arrow = "dst" if kind == "send" else "src"
    return f"{arrow}={'any' if peer is None else peer}, tag={tag}, {format_bytes(nbytes)}"


def _named(name: str, pieces: Sequence[Array]) -> list[tuple[str, Array]]:
    """The arrays a call reads or writes, named for messages: one array split into pieces is
    itself (its pieces share its device and stream), else each piece."""
    if isinstance(pieces, Pieces):
        return [(name, pieces.whole)]
    return [(f"{name}[{i}]", p) for i, p in enumerate(pieces)]


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
