"""The GPU engine: how a communicator's GPU arrays reach its GPU backend. Which calls go to the
GPU (and that their arrays are on this rank's device), the backend's creation on this device
through the registry, the stream policy of every queued operation (a blocking call runs right
on the caller's stream; an async one on the backend's stream after the caller's, its Work
waiting on the GPU; a torch process group's on the group's own stream after the caller's,
torch_streams.py), the plans that replay a repeated call, and batches of messages."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Callable

from . import gpu
from .arguments import Arguments
from .backends import registry
from .backends.base import Backend
from .backends.gpu_base import GpuBackend
from .backends.gpu_queue import Enqueue
from .buffers import Array, GpuArray, Pieces, current_stream
from .errors import AnycclError, UnsupportedError
from .plans import Plans
from .store import Store
from .trace import ArgsText, Entry, FlightRecorder, OpRecord
from .work import GpuWork

FULL_PATH = object()   # replay's answer when a call must take the full path


class GpuDispatch:
    """The GPU side of one communicator (rank `rank` of `size`)."""

    def __init__(self, check: Arguments, host: Backend, store: Store, *, rank: int, size: int,
                 local_rank: int, name: str, timeout_s: float, meet: Callable[[], Any],
                 post_mortem: Callable[[BaseException], None], number: Callable[[], int],
                 recorder: FlightRecorder, device: int | None, backend: GpuBackend | None,
                 kind: str | None) -> None:
        self._check, self._host, self._store = check, host, store
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self._name, self.timeout_s = name, timeout_s
        self._meet, self._post_mortem = meet, post_mortem
        self._number, self._recorder = number, recorder   # the communicator's numbering
        self.device = device    # this rank's GPU; chosen on first use when None
        self.gpu = backend      # the GPU backend; created by the first GPU collective
        self.kind = kind        # its registered name; None: the host backend's default
        self.plans: Plans | None = None     # blocking calls' plans, once a GPU call ran
        # (tag, tensor) -> whether a blocking one-tensor replay ran whole in compiled code
        # (Plans.compiled), once plans exist and that code can run
        self.compiled_replay: Callable[[tuple, Any], bool] | None = None
        self.batched: list[tuple] | None = None   # GPU messages of an open comm.batch()
        self._batch = _Batch(self)

    def device_if_any(self) -> int | None:
        """This rank's device, or None where no GPU is visible."""
        if self.device is None and gpu.device_count() > 0:
            self.device_for("device")
        return self.device

    def on_gpu(self, op: str, arrays: Sequence[tuple[str, Array]], stream: Any) -> bool:
        """Whether this call's arrays are GPU arrays (all on this rank's device) rather than host
        arrays; refuses a mix, and stream= with host arrays."""
        for _, a in arrays:  # the common host case first, in one pass
            if isinstance(a, GpuArray):
                break
        else:
            if stream is not None:
                raise self._check.fail(op, "stream= applies to GPU arrays only; these are host "
                                           "arrays")
            return False
        on_gpu = [isinstance(a, GpuArray) for _, a in arrays]
        if not all(on_gpu):
            g = next(n for (n, _), g in zip(arrays, on_gpu) if g)
            h = next(n for (n, _), g in zip(arrays, on_gpu) if not g)
            raise self._check.fail(op, f"{g} is a GPU array but {h} is in host memory; pass "
                                       f"arrays of one kind")
        device = self.device_for(op)
        for name, a in arrays:
            if a.device != device:
                raise self._check.fail(op, f"{name} is on GPU {a.device}, but this rank's "
                                           f"communicator uses GPU {device} (choose with "
                                           f"anyccl.init(device_id=...))")
        return True

    def device_for(self, op: str) -> int:
        if self.device is None:
            count = gpu.device_count()
            if count == 0:
                what = ("a GPU backend was asked for" if op == "init" else
                        "GPU arrays were passed")
                raise self._check.fail(op, f"{what}, but no CUDA device is visible "
                                           f"(CUDA_VISIBLE_DEVICES={gpu.visible_devices()})",
                                 UnsupportedError)
            self.device = self.local_rank % count
        return self.device

    def backend(self, op: str, *, collective: bool) -> GpuBackend:
        """The GPU backend, created on the first GPU collective (every rank calls it)."""
        if self.gpu is None:
            if not collective:
                raise self._check.fail(op, "GPU point-to-point needs the GPU backend, which the "
                                           "first GPU collective creates; create it up front with "
                                           "anyccl.init(backend='nccl') or init(device_id=...)")
            self.connect(op)
        assert self.gpu is not None
        return self.gpu

    def prepare(self, op: str, operands: tuple,
                call: Callable[[GpuBackend], Enqueue] | None = None) -> Enqueue:
        """The function that queues collective `op` on a stream: from the GPU backend's method
        `op` with `operands`, or `call(gpu_backend)` (the backend refuses what it cannot do
        here, before any byte moves)."""
        gpu_backend = self.backend(op, collective=True)
        try:
            return getattr(gpu_backend, op)(*operands) if call is None else call(gpu_backend)
        except AnycclError as exc:
            raise type(exc)(f"rank {self.rank}: {op}: {exc}") from None

    def split(self, color: int | None, key: int, label: str, store: Store,
              group: str) -> GpuBackend | None:
        """Collective over this communicator's ranks: its GPU backend, if it exists, split as
        the communicator is (`GpuBackend.split`); None where it does not exist."""
        if self.gpu is None:
            return None
        return self.gpu.split(color, key, label, store=store, group=group)

    @property
    def failure(self) -> BaseException | None:
        """The error that aborted the GPU backend's queue (a lost peer, a deadline, an abort),
        else None."""
        return None if self.gpu is None else self.gpu.failure

    def abort(self, error: BaseException) -> None:
        """Cut the GPU backend's queued work short, if it exists: its kernels return and its
        NCCL communicator is aborted (not waited for); every later GPU call raises `error`."""
        queue = getattr(self.gpu, "queue", None)
        if queue is not None:
            queue.abort(error)

    def close(self) -> None:
        """Release the GPU backend, if one was created."""
        self.plans = self.compiled_replay = None
        if self.gpu is not None:
            self.gpu.close()

    def connect(self, op: str) -> None:
        """Collective: create this communicator's GPU backend now, on this rank's device (the
        one named at init, else local_rank modulo the visible GPUs), instead of at the first
        collective on GPU arrays. Does nothing if it exists."""
        if self.gpu is not None:
            return
        device = self.device_for(op)
        count = gpu.device_count()
        if not 0 <= device < count:
            raise self._check.fail(op, f"device_id={device} but this process sees {count} CUDA "
                                       f"device{'s' if count != 1 else ''} (CUDA_VISIBLE_DEVICES="
                                       f"{gpu.visible_devices()})", UnsupportedError)
        kind = self.kind or registry.host_entry(self._host.name).gpu_arrays
        context = registry.GpuContext(
            store=self._store, key=f"{self._name}/gpu", rank=self.rank, size=self.size,
            device=device, label=f"rank {self.rank} ({self._name})", timeout_s=self.timeout_s,
            host=self._host, meet=self._meet)
        self.gpu = registry.gpu_entry(kind).create(context)

    # ---- operations ------------------------------------------------------------------------
    def collective(self, record: OpRecord, args: ArgsText, enqueue: Enqueue, operands: tuple,
                   arrays: list[GpuArray], async_op: bool, stream: Any,
                   plan: bool) -> GpuWork | None:
        """Queue GPU collective `record` (see `queue`); with `plan`, keep its plan so that the
        next such call on the same arrays replays it (`replay`): the backend's function for
        its `operands` without their owners, which a plan must not keep alive."""
        work = self.queue(record, [record], enqueue, arrays, async_op, stream)
        if plan:
            if self.plans is None:
                self.plans = Plans()
            self.plans.keep(record.name, args, record.nbytes, lambda: getattr(
                self.gpu, record.name)(*[_bare(o) for o in operands]), arrays, self.gpu)
            if self.compiled_replay is None:
                self.compiled_replay = self.plans.compiled(self._number, self._recorder.add,
                                                           self)
        return work

    def replay(self, tag: tuple, tensors: tuple, async_op: bool, stream: Any) -> Any:
        """A GPU call on arrays an earlier call checked, replayed from its cached plan
        (plans.py) with its own record, flight-recorder entry and deadline: a blocking one
        queued right on the caller's current stream (returns None), an async one on the
        backend's stream after it (returns its GpuWork; the queued operation holds `tensors`
        until done). FULL_PATH: the call must take the full path. Called only once a GPU call
        made a plan (`plans` set)."""
        if stream is not None:
            return FULL_PATH
        plan = self.plans.find(tag, tensors)
        if plan is None:
            return FULL_PATH
        record = OpRecord(plan.name, self._number(), plan.args, plan.nbytes)
        record.replayed = True
        self._recorder.add(record)
        stream = plan.current_stream(plan.device)
        deadline = record.issued_at + self.timeout_s
        try:
            if not async_op:
                if plan.queue is not None:   # one compiled call: the shorter way
                    plan.queue.replay_one(record, plan.enqueue, plan.one_call, stream, deadline)
                else:
                    plan.run(record, (stream,), deadline, plan.enqueue, None, [record], stream)
                return None
            event = plan.run(record, (stream,), deadline, plan.enqueue, tensors, [record])
        except BaseException as exc:
            FlightRecorder.ended(record, exc)
            self._post_mortem(exc)
            raise
        work = GpuWork(record, self.rank, plan.backend,
                       functools.partial(plan.current_stream, plan.device))
        work.bind(event, deadline)
        return work

    def message(self, op: str, record: OpRecord, x: GpuArray, peer: int, tag: int,
                async_op: bool, stream: Any) -> GpuWork | None:
        """GPU point-to-point: messages between two ranks match in the order they were issued
        (NCCL has no tags; the ipc backend checks them). Inside a batch, collected for it."""
        backend = self.backend(op, collective=False)
        enqueue = (backend.send if record.name == "send" else backend.recv)(x, peer, tag)
        self._recorder.queued(record)
        if self.batched is not None:
            if not async_op:
                raise self._check.fail(op, f"use i{record.name} inside `with comm.batch():`")
            waits_on = current_stream(x) if stream is None else (
                lambda s=gpu.stream_pointer(stream): s)
            work = GpuWork(record, self.rank, backend, waits_on)
            self.batched.append((record, enqueue, x, stream, work))
            return work
        return self.queue(record, [record], enqueue, [x], async_op, stream)

    def uneven_moves(self, op: str, layout: Callable[[Any], Any], x: GpuArray,
                     stream: Any) -> tuple[Any, int | None]:
        """An uneven collective's moves on GPU arrays and the stream they run after: through
        the backend's `exchange` where it moves pieces of any size (`layout(None)`), else on
        padded scratch allocated in that stream's order (`algorithms/uneven.py`)."""
        from .algorithms import uneven

        after = gpu.stream_pointer(stream) if stream is not None else x.stream
        if self.backend(op, collective=True).exchanges_any_sizes:
            return layout(None), after   # each piece as it is: no scratch
        if after is None:   # no stream to order after (JAX): scratch made ready on the host
            moves = layout(uneven.gpu_scratch(x, 0))
            gpu.synchronize_stream(0)
            return moves, after
        return layout(uneven.gpu_scratch(x, after)), after

    def batch(self) -> _Batch:
        """`comm.batch()`: the GPU messages issued inside the block, issued at its end as one
        group (one NCCL group)."""
        if self.batched is not None:
            raise self._check.fail("batch", "comm.batch() blocks do not nest")
        return self._batch   # blocks do not nest: one object serves them all

    def _issue_batch(self, pending: list[tuple]) -> None:
        streams = {s for *_, s, _ in pending if s is not None}
        if len(streams) > 1:
            raise self._check.fail("batch", "the messages of one batch name different stream= "
                                   "values")
        record = OpRecord("batch", pending[0][0].seq,
                          ", ".join(f"{r.name} {r.args}" for r, *_ in pending),
                          sum(r.nbytes for r, *_ in pending))
        enqueue = self.gpu.group([e for _, e, *_ in pending])
        arrays = [x for _, _, x, _, _ in pending]
        works = [w for *_, w in pending]
        self.queue(record, [r for r, *_ in pending], enqueue, arrays, True,
                   next(iter(streams), None), works[0])
        for w in works[1:]:
            w.bind(*works[0].bound_to())

    def queue(self, record: OpRecord, entries: list[Entry], enqueue: Enqueue,
              arrays: list[GpuArray], async_op: bool, stream: Any,
              work: GpuWork | None = None, keep: Any = None) -> GpuWork | None:
        """Queue GPU work after what the callers' streams (or `stream`) hold; a blocking call
        makes that stream wait for it, an async one returns a GpuWork. The queued operation
        holds `arrays` (so their owners, the user's arrays), and `keep`, until it is done: its
        keep-alive, the only one (a plan's function holds bare arrays)."""
        backend = self.gpu
        if stream is not None:
            after = [gpu.stream_pointer(stream)]
            host_synced = False
        elif arrays[0].stream is not None and all(a.stream == arrays[0].stream
                                                  for a in arrays):  # the common case, quickly
            after, host_synced = [arrays[0].stream], False
        else:
            after = list(dict.fromkeys(a.stream for a in arrays if a.stream is not None))
            for a in arrays:
                a.synchronize_producer()  # arrays without a stream (JAX): on the host
            host_synced = any(a.stream is None for a in arrays)
        deadline = time.monotonic() + self.timeout_s
        # a blocking call on one stream runs right on it; the rest on the backend's stream
        on = after[0] if (not async_op and work is None and not host_synced
                          and len(after) == 1) else None
        try:
            event = backend.run(record, after, deadline, enqueue,
                                arrays if keep is None else (arrays, keep), entries, on)
        except BaseException as exc:
            for entry in entries:
                FlightRecorder.ended(entry, exc)
            self._post_mortem(exc)
            raise
        if async_op or work is not None:
            if work is None:
                waits_on = (lambda: None) if host_synced else (
                    current_stream(arrays[0]) if stream is None else (lambda: after[0]))
                work = GpuWork(record, self.rank, backend, waits_on)
            work.bind(event, deadline)
            return work
        if host_synced:
            backend.host_wait(event, record, deadline)
        elif on is None:
            for s in after:
                gpu.stream_wait(s, event)
        return None


class _Batch:
    """The block of `GpuDispatch.batch` (a class, not a generator: host messages use it on
    every call of a training loop, where a generator's context manager cost a microsecond)."""

    __slots__ = ("_dispatch",)

    def __init__(self, dispatch: GpuDispatch) -> None:
        self._dispatch = dispatch

    def __enter__(self) -> None:
        self._dispatch.batched = []

    def __exit__(self, kind: type | None, *_: object) -> None:
        dispatch = self._dispatch
        pending, dispatch.batched = dispatch.batched, None
        if kind is None and pending:
            dispatch._issue_batch(pending)


def _bare(operand: Any) -> Any:
    """A GPU backend's operand without the user's arrays: GpuArrays (alone or in a list) bare,
    anything else as it is."""
    if isinstance(operand, GpuArray):
        return operand.bare()
    if isinstance(operand, Pieces):   # still the pieces of one array, for backends that ask
        return Pieces(operand.whole.bare(), operand[0].size, len(operand)) \
            if isinstance(operand.whole, GpuArray) else operand
    if isinstance(operand, list):
        return [_bare(o) for o in operand]
    return operand
