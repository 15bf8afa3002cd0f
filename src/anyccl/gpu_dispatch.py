"""How a communicator's GPU arrays reach its GPU backend: which calls go to the GPU (and that
their arrays are on this rank's device), the backend's creation on this device through the
registry, and the stream policy of every queued operation (a blocking call runs right on the
caller's stream; an async one on the backend's stream after the caller's, its Work waiting on
the GPU)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable

from . import gpu
from .arguments import Arguments
from .backends import registry
from .backends.base import Backend
from .backends.gpu_base import GpuBackend
from .backends.gpu_queue import Enqueue
from .buffers import Array, GpuArray, current_stream
from .errors import UnsupportedError
from .store import Store
from .trace import FlightRecorder, OpRecord
from .work import GpuWork


class GpuDispatch:
    """The GPU side of one communicator (rank `rank` of `size`)."""

    def __init__(self, check: Arguments, host: Backend, store: Store, *, rank: int, size: int,
                 local_rank: int, name: str, timeout_s: float, meet: Callable[[], Any],
                 post_mortem: Callable[[BaseException], None], device: int | None,
                 backend: GpuBackend | None, kind: str | None) -> None:
        self._check, self._host, self._store = check, host, store
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self._name, self.timeout_s = name, timeout_s
        self._meet, self._post_mortem = meet, post_mortem
        self.device = device    # this rank's GPU; chosen on first use when None
        self.gpu = backend      # the GPU backend; created by the first GPU collective
        self.kind = kind        # its registered name; None: the host backend's default

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

    def queue(self, record: OpRecord, entries: list[dict], enqueue: Enqueue,
              arrays: list[GpuArray], async_op: bool, stream: Any,
              work: GpuWork | None = None, keep: Any = None) -> GpuWork | None:
        """Queue GPU work after what the callers' streams (or `stream`) hold; a blocking call
        makes that stream wait for it, an async one returns a GpuWork. The queued operation
        holds `arrays` (and `keep`) until it is done."""
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

