"""Where a torch process group's operations run, and the torch Work each one returns.

On CUDA, as with NCCL's process group, an operation is queued on the group's own stream for the
tensors' device, after the work already on the caller's current stream, with no host
synchronisation: the caller's later kernels (the rest of backward, under DDP) overlap it. While
anyccl's call runs, that stream is torch's current one, so the call queues there. Every CUDA
tensor the operation uses is marked as used by that stream (the caching allocator then keeps its
memory until the operation is done), and the Work's future records the stream, so whoever waits
on the Work is ordered after the result. On the host the call is done when it returns and the
Work's future is complete.

`GroupStreams` does this through the group's compiled part (torch_core.py: two calls per
operation, futures that hold typed tensors) where it is built, else in Python; both keep the same
promises.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from . import gpu, torch_core
from .buffers import torch_stream_function


class GroupStreams:
    """A torch process group's streams (one per CUDA device, made on first use) and Works."""

    def __init__(self) -> None:
        torch = self._torch = sys.modules["torch"]
        from torch._C._distributed_c10d import _create_work_from_future

        self._core = torch_core.load()
        self._sides: dict[int, Any] = {}
        self._future, self._work = torch._C.Future, _create_work_from_future
        self._set = getattr(torch._C, "_cuda_setStream", None)
        self._get = getattr(torch._C, "_cuda_getCurrentStream", None)

    @property
    def compiled(self) -> bool:
        return self._core is not None

    @property
    def core(self) -> Any:
        """The group's compiled part (torch_core.py), or None where its Python code runs."""
        return self._core

    @property
    def sides(self) -> dict[int, Any]:
        """The group's stream on each CUDA device it has used so far, by device index."""
        return self._sides

    def done(self, result: Any) -> Any:
        """A torch Work whose CPU future is complete with `result` (a tensor, a list of tensors,
        a list of lists of them, or None): a host operation that has finished."""
        if self._core is not None:
            return self._core.completed(result)
        future = self._future([])
        future.set_result(result)
        return self._work(future)

    def run(self, index: int, call: Callable[[], object], used: list[Any], result: Any) -> Any:
        """`call()` (anyccl's calls, queued on the current stream) on CUDA device `index`, on
        the group's stream there after the caller's current stream; then the torch Work whose
        future holds `result` and records that stream. The tensors in `used` are marked as used
        by it. The caller's device and stream are current again afterwards, also when `call`
        raises."""
        side = self._sides.get(index)
        if side is None:
            side = self._sides[index] = self._side(index)
        if self._core is not None:
            previous = side.enter()
            try:
                gpu.ensure_context(index)   # anyccl's driver calls need one on a new thread
                call()
            except BaseException:
                side.restore(previous)
                raise
            return side.leave(previous, used, result)
        return self._run_in_python(side, index, call, used, result)

    def _side(self, index: int) -> Any:
        stream = self._torch.cuda.Stream(index)
        if self._core is not None:
            return self._core.Side(stream.stream_id, stream.device_index, stream.device_type)
        return _PythonSide(self._torch, stream, index)

    def _run_in_python(self, side: _PythonSide, index: int, call: Callable[[], object],
                       used: list[Any], result: Any) -> Any:
        restore = _use_device(self._torch, index)
        gpu.follow(side.handle, side.event, side.caller(index))  # after the caller's work so far
        previous = self._get(index)
        self._set(*side.ids)
        try:
            call()
            stream = side.stream
            for t in used:
                if t.is_cuda:
                    t.record_stream(stream)
            future = self._future(side.devices)   # its events record the current stream
            future.set_result(result)
            return self._work(future)
        finally:
            self._set(*previous)
            if restore is not None:
                gpu.set_device(restore)


class _PythonSide:
    """The Python code's view of a group's stream on one device: the torch stream, torch's (id,
    device index, device type) for it, its raw handle, an event to order it after the caller's
    stream, the device list of torch futures, and torch's lookup of the current raw stream.
    Streams are switched through their raw handles: torch's `wait_stream` and stream context
    cost more host time than the operation itself."""

    __slots__ = ("stream", "ids", "handle", "_event", "event", "devices", "caller")

    def __init__(self, torch: Any, stream: Any, index: int) -> None:
        self.stream = stream
        self.ids = (stream.stream_id, stream.device_index, stream.device_type)
        self.handle = stream.cuda_stream
        self._event = torch.cuda.Event()  # torch owns it; made on this device by a record
        self._event.record(stream)
        self.event = self._event.cuda_event
        self.devices = [torch.device("cuda", index)]
        self.caller = torch_stream_function()


def _use_device(torch: Any, index: int) -> int | None:
    """Make CUDA device `index` current on this thread for one operation, as torch's own groups
    do with a device guard: the device to restore afterwards, or None when it was current (a
    thread new to CUDA also gets the device's context: the driver calls need one)."""
    current = torch._C._cuda_getDevice()
    if current == index:
        gpu.ensure_context(index)
        return None
    gpu.set_device(index)
    return current
