"""The `nccl` backend: GPU arrays moved and reduced by NCCL, ordered on CUDA streams.

Over NVIDIA's nccl4py (``pip install 'anyccl[gpu]'``): `nccl.core` creates, splits and aborts the
NCCL communicator; the collectives go through its thin `nccl.bindings` layer with raw pointers,
which keeps the cost of a call near that of the C API.

Streams, as torch.distributed's NCCL backend does: every operation runs on this backend's own
stream, after the work already queued on the caller's stream (an event recorded there, waited
on here); an event recorded after the operation is what the caller's stream, a `GpuWork`, or the
watchdog wait for. A call returns once the work is queued.

The watchdog thread follows every queued operation's event. When one is not finished by its
deadline, NCCL reports an asynchronous error, or the host transport sees a peer process die, it
aborts the NCCL communicator (so no kernel stays stuck and a host blocked on the stream wakes up)
and records the error, which the next call on this communicator raises.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import gpu
from ..buffers import BFLOAT16, GpuArray, overlaps
from ..errors import (
    AnycclError,
    CommunicatorClosedError,
    PeerLostError,
    TimeoutError,
    UnsupportedError,
)
from ..ops import ReduceOp, dtype_kind
from ..store import Store
from ..trace import FlightRecorder, OpRecord

_EVENT_RING = 1024          # events recycled in order; reuse only ever waits for a later point
_WATCH_POLL_S = 0.01        # how often the watchdog looks at queued events (never per op:
                            # waking a thread per call would cost the caller the GIL)
_HEALTH_POLL_S = 0.1        # how often it asks NCCL and the host transport about peers


def _nccl() -> tuple[Any, Any]:
    try:
        import nccl.bindings.nccl as bindings
        import nccl.core as core
    except ImportError as exc:
        raise UnsupportedError(
            f"the nccl backend needs nccl4py and an NCCL runtime: pip install 'anyccl[gpu]' "
            f"({exc})") from None
    return core, bindings


# NCCL's ncclDataType_t and ncclRedOp_t values (nccl.h)
_NCCL_TYPES: dict[np.dtype, int] = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
    np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6,
    np.dtype(np.float32): 7, np.dtype(np.float64): 8, BFLOAT16: 9,
}
_UINT8 = 1
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3,
             ReduceOp.AVG: 4}
# bool arrays travel as uint8 0/1: or is max, and is min
_BOOL_OPS = {ReduceOp.SUM: 2, ReduceOp.MAX: 2, ReduceOp.BOR: 2,
             ReduceOp.PROD: 3, ReduceOp.MIN: 3, ReduceOp.BAND: 3}


def data_view(x: GpuArray) -> tuple[int, int]:
    """(count, NCCL dtype) that moves `x`'s bytes unchanged (any dtype: as bytes if need be)."""
    code = _NCCL_TYPES.get(x.dtype)
    return (x.size, code) if code is not None else (x.nbytes, _UINT8)


def reduction_view(x: GpuArray, op: ReduceOp, size: int) -> tuple[int, int, int]:
    """(count, NCCL dtype, NCCL op) that reduces `x` with `op` over `size` ranks;
    UnsupportedError if NCCL can't."""
    kind = dtype_kind(x.dtype)
    if op is ReduceOp.AVG and size == 1:
        # the mean of one value is the value; NCCL 2.28's one-rank reduce_scatter with ncclAvg
        # left the last elements of odd counts unwritten (seen on H200, float32 x 1048579)
        op = ReduceOp.SUM
    if kind == "b" and op in _BOOL_OPS:
        return x.size, _UINT8, _BOOL_OPS[op]
    if kind == "c" and op in (ReduceOp.SUM, ReduceOp.AVG):  # component-wise: as real pairs
        real = np.dtype(np.float32 if x.dtype == np.complex64 else np.float64)
        return 2 * x.size, _NCCL_TYPES[real], _NCCL_OPS[op]
    code = _NCCL_TYPES.get(x.dtype)
    if code is None or op not in _NCCL_OPS:
        raise UnsupportedError(
            f"the nccl backend cannot reduce {x.dtype.name} arrays with ReduceOp.{op.name} (NCCL "
            f"reduces int8/32/64, uint8/32/64, float16/32/64 and bfloat16 with SUM, PROD, MIN, "
            f"MAX, AVG; bool with SUM/MAX/BOR, PROD/MIN/BAND; complex with SUM/AVG); use a wider "
            f"dtype or a host array")
    return x.size, code, _NCCL_OPS[op]


@dataclass
class _Queued:
    record: OpRecord
    event: int
    deadline: float
    keep: Any              # the user's arrays, alive until the operation finished
    entries: list[dict]    # the flight recorder's lines for it


class NcclBackend:
    """One NCCL communicator on one GPU, with its stream, events and watchdog."""

    name = "nccl"

    def __init__(self, comm: Any, rank: int, size: int, device: int, label: str,
                 lost_peer: Callable[[], tuple[int, str] | None]) -> None:
        core, self._b = _nccl()
        self._core_comm = comm
        self._comm = comm._comm  # the bindings' handle that nccl.core itself passes to NCCL
        self.rank, self.size, self.device = rank, size, device
        self._label = label
        self._lost_peer = lost_peer
        self.stream = gpu.new_stream(device)
        self._start = gpu.new_event(device)
        self._events = [gpu.new_event(device) for _ in range(_EVENT_RING)]
        self._next_event = 0
        self._last_stream: int | None = None     # where this communicator's last op was queued
        self._last_event = 0
        self._lock = threading.Lock()            # NCCL calls on this communicator vs abort
        self._wake = threading.Event()           # set when work arrives in an empty queue
        self._queued: deque[_Queued] = deque()   # appended here, popped by the watchdog
        self._watchdog: threading.Thread | None = None
        self._closing = False
        self.failure: BaseException | None = None
        self._reported = False
        self.timeout_s = 0.0                       # set by create(); splits inherit it
        # what else the watchdog asks about (every poll) and stops on abort: the ipc kernels
        self._more_health: list[Callable[[OpRecord], BaseException | None]] = []
        self._more_aborts: list[Callable[[], None]] = []

    def watch_also(self, health: Callable[[OpRecord], BaseException | None],
                   abort: Callable[[], None]) -> None:
        """Have the watchdog call `health(record)` at every poll (an error it returns aborts
        the communicator) and `abort()` first when it aborts."""
        self._more_health.append(health)
        self._more_aborts.append(abort)

    # ---- creation ----------------------------------------------------------------------------
    @classmethod
    def create(cls, store: Store, key: str, rank: int, size: int, device: int, label: str,
               timeout_s: float, lost_peer: Callable[[], tuple[int, str] | None]) -> NcclBackend:
        """Collective over the `size` ranks: rank 0 makes NCCL's unique id and shares it through
        `store` under `key`; every rank then joins the NCCL communicator on `device`."""
        core, _ = _nccl()
        gpu.set_device(device)
        if rank == 0:
            store.set(key, bytes(core.get_unique_id()))
        unique_id = core.UniqueId.from_bytes(store.get(key, timeout_s))
        comm = core.Communicator.init(size, rank, unique_id)
        backend = cls(comm, rank, size, device, label, lost_peer)
        backend.timeout_s = timeout_s
        return backend

    def split(self, color: int | None, key: int, label: str, store: Any = None,
              group: str = "") -> NcclBackend | None:
        """Collective over this communicator (ncclCommSplit): None where color is None."""
        self.raise_if_failed()
        gpu.set_device(self.device)
        with self._lock:
            child = self._core_comm.split(color, key)
        if color is None:
            return None
        backend = NcclBackend(child, child.rank, child.nranks, self.device, label,
                              self._lost_peer)
        backend.timeout_s = self.timeout_s
        return backend

    # ---- running operations ------------------------------------------------------------------
    def run(self, record: OpRecord, after: Sequence[int], deadline: float,
            enqueue: Callable[[int], None], keep: Any, entries: list[dict],
            on: int | None = None) -> int:
        """Queue `enqueue(stream)` (NCCL calls) and return the event that marks its end.

        on=None: on this backend's stream, after the work queued so far on each stream of
        `after` (async operations, which may overlap the caller's later work). on=stream: right
        on the caller's stream (blocking calls: already ordered both ways, no extra sync).
        Either way it also follows the previous operation of this communicator, wherever that
        was queued: NCCL needs one communicator's operations to run in issue order."""
        self.raise_if_failed()
        if on is not None and gpu.is_capturing(on):
            return self._captured(on, enqueue, record, entries)
        if on is None and any(gpu.is_capturing(s) for s in after):
            raise UnsupportedError(f"rank {self.rank}: {record}: async_op=True while the stream "
                                   f"is captured into a CUDA graph; capture blocking calls")
        with self._lock:
            stream = self.stream if on is None else on
            if stream in gpu.NULL_STREAMS or any(s in gpu.NULL_STREAMS for s in after):
                gpu.use_device(self.device)  # a null stream is the current device's
            if on is None:
                for user_stream in after:
                    gpu.record(self._start, user_stream)
                    gpu.stream_wait(stream, self._start)
            if self._last_stream is not None and self._last_stream != stream:
                gpu.stream_wait(stream, self._last_event)
            try:
                enqueue(stream)
            except self._b.NCCLError as exc:
                raise self._error(record, exc) from None
            event = self._events[self._next_event]
            self._next_event = (self._next_event + 1) % _EVENT_RING
            gpu.record(event, stream)
            self._last_stream, self._last_event = stream, event
        for entry in entries:
            FlightRecorder.started(entry)
        self._watch(_Queued(record, event, deadline, keep, entries))
        return event

    def _captured(self, stream: int, enqueue: Callable[[int], None], record: OpRecord,
                  entries: list[dict]) -> int:
        """Record the operation into the CUDA graph being captured on `stream`: no event, no
        deadline (it runs each time the graph is launched); ordering is the graph's."""
        with self._lock:
            try:
                enqueue(stream)
            except self._b.NCCLError as exc:
                raise self._error(record, exc) from None
        for entry in entries:
            FlightRecorder.started(entry)
            FlightRecorder.ended(entry)
        return 0

    def group(self, calls: list[Callable[[int], None]]) -> Callable[[int], None]:
        """One enqueue function running `calls` inside an NCCL group (fused, deadlock-free)."""
        def enqueue(stream: int) -> None:
            self._b.group_start()
            try:
                for call in calls:
                    call(stream)
            finally:
                self._b.group_end()
        return enqueue

    def _error(self, record: OpRecord, exc: BaseException) -> AnycclError:
        detail = ""
        try:
            detail = self._b.get_last_error(self._comm)
        except Exception:  # noqa: BLE001 - the detail is a courtesy
            pass
        return AnycclError(f"rank {self.rank}: {record}: NCCL refused the call: {exc}"
                           + (f" ({detail})" if detail else ""))

    # enqueue functions: each takes the stream and issues NCCL calls on it
    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Callable[[int], None]:
        count, dtype, nop = reduction_view(x, op, self.size)
        return lambda s: self._b.all_reduce(x.ptr, x.ptr, count, dtype, nop, self._comm, s)

    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Callable[[int], None]:
        count, dtype, nop = reduction_view(x, op, self.size)
        return lambda s: self._b.reduce(x.ptr, x.ptr, count, dtype, nop, root, self._comm, s)

    def broadcast(self, x: GpuArray, root: int) -> Callable[[int], None]:
        count, dtype = data_view(x)
        return lambda s: self._b.broadcast(x.ptr, x.ptr, count, dtype, root, self._comm, s)

    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Callable[[int], None]:
        if _consecutive(outs):
            count, dtype = data_view(x)
            return lambda s: self._b.all_gather(x.ptr, outs[0].ptr, count, dtype, self._comm, s)
        return self._exchange(sends=[x] * self.size, recvs=outs)

    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray],
                       op: ReduceOp) -> Callable[[int], None]:
        count, dtype, nop = reduction_view(out, op, self.size)
        if _consecutive(inputs):
            return lambda s: self._b.reduce_scatter(inputs[0].ptr, out.ptr, count, dtype, nop,
                                                    self._comm, s)

        def staged(s: int) -> None:  # separate pieces: gather them into one scratch array
            whole = _scratch_copy(inputs, s)
            try:
                self._b.reduce_scatter(whole, out.ptr, count, dtype, nop, self._comm, s)
            finally:
                gpu.free_async(whole, s)
        return staged

    def gather(self, x: GpuArray, outs: list[GpuArray] | None,
               root: int) -> Callable[[int], None]:
        if self.rank != root:
            return self._exchange(sends=[x if r == root else None for r in range(self.size)],
                                  recvs=[None] * self.size)
        assert outs is not None
        return self._exchange(sends=[x if r == root else None for r in range(self.size)],
                              recvs=outs)

    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None,
                root: int) -> Callable[[int], None]:
        recvs: list[GpuArray | None] = [out if r == root else None for r in range(self.size)]
        if self.rank != root:
            return self._exchange(sends=[None] * self.size, recvs=recvs)
        assert chunks is not None
        return self._exchange(sends=chunks, recvs=recvs)

    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Callable[[int], None]:
        if not any(overlaps(o, i) for o in outs for i in inputs):
            return self._exchange(sends=inputs, recvs=outs)

        def staged(s: int) -> None:  # in place: send from a copy of the input
            whole = _scratch_copy(inputs, s)
            try:
                size = inputs[0].nbytes
                copies = [GpuArray(whole + r * size, piece.size, piece.dtype, piece.device, None,
                                   piece.kind, None) for r, piece in enumerate(inputs)]
                self._exchange(sends=copies, recvs=outs)(s)
            finally:
                gpu.free_async(whole, s)
        return staged

    def _exchange(self, sends: list[GpuArray | None],
                  recvs: list[GpuArray | None]) -> Callable[[int], None]:
        """Send sends[r] to and receive recvs[r] from every rank r, as one NCCL group; this
        rank's own piece is a device copy."""
        calls: list[Callable[[int], None]] = []
        for peer in range(self.size):
            out, src = recvs[peer], sends[peer]
            if peer == self.rank:
                if out is not None and src is not None and out.ptr != src.ptr and out.nbytes:
                    calls.append(_device_copy(out, src))
                continue
            if src is not None and src.nbytes:
                count, dtype = data_view(src)
                calls.append(lambda s, p=src.ptr, c=count, d=dtype, r=peer:
                             self._b.send(p, c, d, r, self._comm, s))
            if out is not None and out.nbytes:
                count, dtype = data_view(out)
                calls.append(lambda s, p=out.ptr, c=count, d=dtype, r=peer:
                             self._b.recv(p, c, d, r, self._comm, s))
        return self.group(calls)

    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Callable[[int], None]:
        """(NCCL has no tags: messages between two ranks match in issue order.)"""
        count, dtype = data_view(x)
        return lambda s: self._b.send(x.ptr, count, dtype, dst, self._comm, s)

    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Callable[[int], None]:
        count, dtype = data_view(x)
        return lambda s: self._b.recv(x.ptr, count, dtype, src, self._comm, s)

    # ---- waiting -----------------------------------------------------------------------------
    def host_wait(self, event: int, record: OpRecord, deadline: float) -> None:
        """Block the host until `event` completed; TimeoutError at `deadline`, or the
        watchdog's error if it broke the communicator meanwhile."""
        if not gpu.wait_event(event, deadline, self.raise_if_failed):
            raise TimeoutError(f"rank {self.rank}: {record} is not complete on GPU "
                               f"{self.device} after {time.monotonic() - record.issued_at:.3g} s")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        failure = self.failure
        if failure is None:
            return
        if not self._reported:
            self._reported = True
            raise failure
        raise CommunicatorClosedError(
            f"{self._label}: the NCCL communicator was aborted on an earlier error: {failure}"
        ) from failure

    # ---- the watchdog ------------------------------------------------------------------------
    def _watch(self, item: _Queued) -> None:
        was_empty = not self._queued
        self._queued.append(item)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watchdog_loop, daemon=True,
                                              name=f"anyccl-nccl-watchdog-{self._label}")
            self._watchdog.start()
        if was_empty:
            self._wake.set()

    def _watchdog_loop(self) -> None:
        gpu.set_device(self.device)
        gpu.relax_capture_mode()   # its event queries must not break the caller's graph capture
        last_health = 0.0
        while not self._closing:
            if not self._queued:
                self._wake.wait()
                self._wake.clear()
                continue
            time.sleep(_WATCH_POLL_S)
            # operations finish in issue order: when the newest is done, all are (one query)
            count = len(self._queued)  # items appended from here on are not looked at
            done = count if gpu.event_done(self._queued[count - 1].event) else 0
            while not done and self._queued and gpu.event_done(self._queued[0].event):
                for entry in self._queued.popleft().entries:
                    FlightRecorder.ended(entry)
            for _ in range(done):
                for entry in self._queued.popleft().entries:
                    FlightRecorder.ended(entry)
            problem: BaseException | None = None
            for health in self._more_health:   # (an error may also end an op early)
                problem = problem or health(self._queued[0].record if self._queued else
                                            OpRecord("(last operation)", 0))
            if problem is not None:
                self._abort(problem)
                return
            if not self._queued:
                continue
            head = self._queued[0]
            now = time.monotonic()
            if now >= head.deadline:
                problem = TimeoutError(
                    f"rank {self.rank}: {head.record} did not finish on GPU {self.device} within "
                    f"{head.deadline - head.record.issued_at:.3g} s (the anyccl timeout); the "
                    f"NCCL communicator was aborted")
            elif now - last_health >= _HEALTH_POLL_S:
                last_health = now
                problem = self._health(head.record)
            if problem is not None:
                self._abort(problem)
                return

    def _health(self, record: OpRecord) -> BaseException | None:
        lost = self._lost_peer()
        if lost is not None:
            return PeerLostError(f"rank {self.rank}: {lost[1]} while {record} was queued on GPU "
                                 f"{self.device}; the NCCL communicator was aborted", lost[0])
        status = self._b.comm_get_async_error(self._comm)
        if status not in (self._b.Result.Success, self._b.Result.InProgress):
            return AnycclError(f"rank {self.rank}: NCCL reported {status!r} during {record}: "
                               f"{self._b.get_last_error(self._comm)}; the NCCL communicator was "
                               f"aborted")
        return None

    def _abort(self, problem: BaseException) -> None:
        self.failure = problem
        for stop in self._more_aborts:
            stop()
        got = self._lock.acquire(timeout=1.0)  # a call stuck in NCCL must not keep us waiting
        try:
            self._core_comm.abort()
        finally:
            if got:
                self._lock.release()
        failed = list(self._queued)
        self._queued.clear()
        for item in failed:
            for entry in item.entries:
                FlightRecorder.ended(entry, problem)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait (briefly) for queued work, then free the NCCL communicator, stream and events."""
        deadline = time.monotonic() + 10.0
        while self.failure is None and self._queued and time.monotonic() < deadline:
            time.sleep(0.001)
        self._closing = True
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)
        with self._lock:
            if self.failure is None and not self._queued:
                self._core_comm.destroy()
            elif self.failure is None:
                self._core_comm.abort()
            for event in (self._start, *self._events):
                gpu.destroy_event(event)
            gpu.destroy_stream(self.stream)


def _consecutive(pieces: list[GpuArray]) -> bool:
    if getattr(pieces, "whole", None) is not None:
        return True  # the pieces of one array (the communicator's _Pieces): by construction
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(pieces, pieces[1:]))


def _device_copy(dst: GpuArray, src: GpuArray) -> Callable[[int], None]:
    return lambda stream: gpu.copy_async(dst.ptr, src.ptr, src.nbytes, stream)


def _scratch_copy(pieces: list[GpuArray], stream: int) -> int:
    """Stream-ordered scratch memory holding `pieces` back to back (free with free_async)."""
    whole = gpu.malloc_async(sum(p.nbytes for p in pieces), stream)
    offset = 0
    for piece in pieces:
        if piece.nbytes:
            gpu.copy_async(whole + offset, piece.ptr, piece.nbytes, stream)
        offset += piece.nbytes
    return whole
