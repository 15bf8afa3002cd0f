"""GPU arrays on the `mpi` backend: staged through pinned host memory, pipelined.

For an MPI that cannot read device memory. all_reduce and broadcast split the array into chunks
that flow through a ring of pinned host buffers: the device-to-host copy of chunk i+1 (on one
CUDA stream), MPI on chunk i (on the host) and the host-to-device copy of chunk i-1 (on another
stream) overlap. The other collectives copy their arrays to the host, run the host algorithm and
copy back. Staging uses its own duplicate of the MPI communicator, so it never interleaves with
host-array operations of the same anyccl communicator.

It implements the GPU backend interface (`gpu_base.GpuBackend`: each op returns the function
that does it on a given stream); the work is host-driven, so a call returns once the result is
on its way back to the device, with the caller's stream ordered after it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from .. import gpu, settings
from ..buffers import GpuArray
from ..errors import TimeoutError, UnsupportedError
from ..ops import ReduceOp
from ..trace import Entry, FlightRecorder, OpRecord
from .gpu_base import GpuBackend
from .mpi import MpiBackend
from .registry import GpuContext

_SLOTS = 3  # pinned chunk buffers in flight: copying in, reducing, copying out


class StagedGpuBackend(GpuBackend):
    """GPU arrays over a host MPI communicator, through pinned memory on `device`."""

    name = "mpi-staged"

    def __init__(self, host: MpiBackend, device: int, label: str) -> None:
        self._host = host.duplicate()  # its own traffic, apart from the host arrays'
        self.rank, self.size, self.device = host.rank, host.size, device
        self._label = label
        self.chunk_bytes = settings.MPI_STAGING_CHUNK.get()
        self.stream = gpu.new_stream(device)      # device-to-host copies
        self._back = gpu.new_stream(device)       # host-to-device copies
        self._start = gpu.new_event(device)
        self._done = gpu.new_event(device)
        self._copied_in = [gpu.new_event(device) for _ in range(_SLOTS)]
        self._copied_out = [gpu.new_event(device) for _ in range(_SLOTS)]
        self._pinned: list[tuple[int, np.ndarray]] = []
        self._record: OpRecord | None = None
        self._deadline = float("inf")
        self.failure: BaseException | None = None

    # ---- queuing: on the host, between the copies ------------------------------------------------
    def run(self, record: OpRecord, after: Sequence[int], deadline: float,
            enqueue: Callable[[int], None], keep: Any, entries: list[Entry],
            on: int | None = None) -> int:
        self.raise_if_failed()
        waits = list(after) if on is None else [on]
        if any(s in gpu.NULL_STREAMS for s in waits):
            gpu.use_device(self.device)  # a null stream is the current device's
        for user_stream in waits:
            gpu.record(self._start, user_stream)
            gpu.stream_wait(self.stream, self._start)
        for entry in entries:
            FlightRecorder.started(entry)
        record.deadline = deadline   # the host steps' options (see `_record`)
        self._record, self._deadline = record, deadline
        try:
            enqueue(self.stream)
        except BaseException as exc:
            for entry in entries:
                FlightRecorder.ended(entry, exc)
            raise
        gpu.record(self._start, self._back)
        gpu.stream_wait(self.stream, self._start)
        gpu.record(self._done, self.stream)
        if on is not None:
            gpu.stream_wait(on, self._done)
        for entry in entries:
            FlightRecorder.ended(entry)
        return self._done

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def host_wait(self, event: int, record: OpRecord, deadline: float) -> None:
        if not gpu.wait_event(event, deadline):
            raise TimeoutError(f"rank {self.rank}: {record} is not complete on GPU "
                               f"{self.device}")

    def _no_messages(self) -> UnsupportedError:
        return UnsupportedError("GPU point-to-point on the mpi backend is not built yet; use "
                                "backend='nccl' for GPU messages")

    def group(self, calls: list[Callable[[int], None]]) -> Callable[[int], None]:
        raise self._no_messages()

    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Callable[[int], None]:
        raise self._no_messages()

    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Callable[[int], None]:
        raise self._no_messages()

    def split(self, color: int | None, key: int, label: str, store: Any = None,
              group: str = "") -> None:
        return None  # the child communicator stages through its own host backend

    def close(self) -> None:
        for ptr, _ in self._pinned:
            gpu.pinned_free(ptr)
        self._pinned = []
        for event in (self._start, self._done, *self._copied_in, *self._copied_out):
            gpu.destroy_event(event)
        gpu.destroy_stream(self.stream)
        gpu.destroy_stream(self._back)
        self._host.close()

    # ---- pinned memory ------------------------------------------------------------------------
    def _slot(self, k: int, nbytes: int) -> np.ndarray:
        """Pinned host buffer `k` of at least `nbytes` (kept and reused)."""
        while len(self._pinned) <= k:
            self._pinned.append((0, np.empty(0, np.uint8)))
        ptr, view = self._pinned[k]
        if view.nbytes < nbytes:
            if ptr:
                gpu.pinned_free(ptr)
            ptr = gpu.pinned_alloc(nbytes)
            view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
            self._pinned[k] = (ptr, view)
        return view

    def _to_host(self, x: GpuArray, host: np.ndarray, stream: int) -> None:
        if x.nbytes:  # pinned memory is in the unified address space: the copy finds its way
            gpu.copy_async(host.ctypes.data, x.ptr, x.nbytes, stream)

    def _to_device(self, x: GpuArray, host: np.ndarray, stream: int) -> None:
        if x.nbytes:
            gpu.copy_async(x.ptr, host.ctypes.data, x.nbytes, stream)

    def _wait(self, event: int) -> None:
        """The host waits for `event`, within the operation's deadline."""
        if not gpu.wait_event(event, self._deadline, max_pause=2e-6):  # on the pipeline's path
            raise TimeoutError(f"rank {self.rank}: {self._record} timed out copying "
                               f"between GPU {self.device} and the host")

    # ---- pipelined: all_reduce, broadcast -----------------------------------------------------
    def _pipelined(self, x: GpuArray, host_op: Callable[[np.ndarray], None]) -> Callable:
        """Chunks of `x` through the pinned ring: copy in, `host_op` in place, copy out."""
        itemsize = x.dtype.itemsize
        per_chunk = max(1, self.chunk_bytes // itemsize)
        chunks = [x[i:i + per_chunk] for i in range(0, x.size, per_chunk)] or [x]

        def staged(stream: int) -> None:
            views: dict[int, np.ndarray] = {}

            def copy_in(i: int) -> None:
                slot = i % _SLOTS
                if i >= _SLOTS:  # the slot's previous chunk must be back on the device
                    self._wait(self._copied_out[slot])
                view = self._slot(slot, chunks[i].nbytes)[:chunks[i].nbytes].view(x.dtype)
                views[i] = view
                self._to_host(chunks[i], view, stream)
                gpu.record(self._copied_in[slot], stream)

            for i in range(min(_SLOTS - 1, len(chunks))):
                copy_in(i)
            for i, chunk in enumerate(chunks):
                if i + _SLOTS - 1 < len(chunks):
                    copy_in(i + _SLOTS - 1)       # the next chunks come in meanwhile
                self._wait(self._copied_in[i % _SLOTS])
                host_op(views.pop(i))             # MPI on the host
                self._to_device(chunk, self._slot(i % _SLOTS, chunk.nbytes), self._back)
                gpu.record(self._copied_out[i % _SLOTS], self._back)
        return staged

    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Callable[[int], None]:
        return self._pipelined(x, lambda h: self._host.all_reduce(h, op, self._record))

    def broadcast(self, x: GpuArray, root: int) -> Callable[[int], None]:
        return self._pipelined(x, lambda h: self._host.broadcast(h, root, self._record))

    # ---- whole arrays: the other collectives --------------------------------------------------
    def _whole(self, arrays: list[GpuArray | None], results: list[GpuArray | None],
               host_op: Callable[..., None]) -> Callable[[int], None]:
        """Copy `arrays` to host memory, run host_op on the host copies, copy the host copies
        of `results` (a subset of `arrays`, by identity) back."""
        def staged(stream: int) -> None:
            copies: list[np.ndarray | None] = []
            for a in arrays:
                if a is None:
                    copies.append(None)
                    continue
                h = np.empty(a.size, a.dtype)
                self._to_host(a, h.view(np.uint8), stream)
                copies.append(h)
            gpu.record(self._copied_in[0], stream)
            self._wait(self._copied_in[0])
            host_op(*copies)
            for a, h in zip(arrays, copies):
                if a is not None and any(a is r for r in results):
                    self._to_device(a, h.view(np.uint8), self._back)
            gpu.record(self._copied_out[0], self._back)
            self._wait(self._copied_out[0])  # the host copies are freed on return
        return staged

    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Callable[[int], None]:
        return self._whole([x], [x] if self.rank == root else [],
                           lambda h: self._host.reduce(h, root, op, self._record))

    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Callable[[int], None]:
        n = len(outs)
        return self._whole([x, *outs], outs,
                           lambda h, *o: self._host.all_gather(list(o[:n]), h, self._record))

    def gather(self, x: GpuArray, outs: list[GpuArray] | None,
               root: int) -> Callable[[int], None]:
        outs = outs or []
        return self._whole([x, *outs], outs, lambda h, *o: self._host.gather(
            h, list(o) if self.rank == root else None, root, self._record))

    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None,
                root: int) -> Callable[[int], None]:
        chunks = chunks or []
        return self._whole([out, *chunks], [out], lambda h, *c: self._host.scatter(
            h, list(c) if self.rank == root else None, root, self._record))

    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray],
                       op: ReduceOp) -> Callable[[int], None]:
        return self._whole([out, *inputs], [out],
                           lambda h, *i: self._host.reduce_scatter(h, list(i), op, self._record))

    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Callable[[int], None]:
        n = len(outs)
        return self._whole([*outs, *inputs], outs,
                           lambda *a: self._host.all_to_all(list(a[:n]), list(a[n:]),
                                                             self._record))


def create(ctx: GpuContext) -> StagedGpuBackend:
    """GPU arrays on the mpi host backend, staged through pinned memory."""
    gpu.set_device(ctx.device)
    assert isinstance(ctx.host, MpiBackend)
    return StagedGpuBackend(ctx.host, ctx.device, ctx.label)


def status() -> str:
    return "available with the mpi backend (GPU arrays staged through pinned host memory)"
