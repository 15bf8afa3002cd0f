"""A GPU for machines without one, so that anyccl's GPU paths run in CI (as mpi4py's test suite
runs its GPU-buffer paths on `FakeGPUArray`s).

`install()` replaces the CUDA calls of `anyccl.gpu` with a simulated device whose memory is host
memory and whose streams really are asynchronous: each stream is a thread that runs the work
queued on it in order, and every copy on it is delayed by a random few hundred microseconds, so
work that is not ordered by events is caught out rather than lucky. Events, stream waits and
event queries keep CUDA's meanings: `record(e, s)` marks the work queued on `s` so far,
`stream_wait(s, e)` makes later work on `s` wait for that mark, `event_done(e)` says whether it
was reached.

`FakeGpuArray` is a NumPy array presented through `__cuda_array_interface__` (with the stream
its producer works on), and `launch(stream, fn)` queues host code on a stream as a kernel.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import random
import threading
import time
from typing import Any, Callable

import numpy as np

_handles = itertools.count(100)


class FakeStream:
    """A stream: a thread running what is queued on it, in order."""

    def __init__(self, jitter_s: float) -> None:
        self.jitter_s = jitter_s
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-gpu-stream")
        self._thread.start()

    def submit(self, fn: Callable[[], None], delay: bool = False) -> None:
        self._work.put((lambda: (time.sleep(random.uniform(0, self.jitter_s)), fn()))
                       if delay and self.jitter_s else fn)

    def _run(self) -> None:
        while True:
            fn = self._work.get()
            if fn is None:
                return
            fn()

    def close(self) -> None:
        self._work.put(None)


class FakeDevice:
    """The simulated GPU: its streams, events and allocations."""

    def __init__(self, jitter_s: float = 300e-6) -> None:
        self.jitter_s = jitter_s
        self.default = FakeStream(jitter_s)
        self.streams: dict[int, FakeStream] = {}
        self.events: dict[int, threading.Event | None] = {}
        self.memory: dict[int, np.ndarray] = {}

    def stream(self, handle: int) -> FakeStream:
        return self.default if handle in (0, 1, 2) else self.streams[handle]

    # ---- what anyccl.gpu offers, simulated -------------------------------------------------------
    def new_stream(self, device: int = 0) -> int:
        handle = next(_handles)
        self.streams[handle] = FakeStream(self.jitter_s)
        return handle

    def destroy_stream(self, handle: int) -> None:
        self.streams.pop(handle).close()

    def new_event(self, device: int = 0) -> int:
        handle = next(_handles)
        self.events[handle] = None
        return handle

    def destroy_event(self, handle: int) -> None:
        self.events.pop(handle, None)

    def record(self, event: int, stream: int) -> None:
        mark = threading.Event()
        self.events[event] = mark
        self.stream(stream).submit(mark.set)

    def stream_wait(self, stream: int, event: int) -> None:
        mark = self.events.get(event)
        if mark is not None:
            self.stream(stream).submit(mark.wait)

    def event_done(self, event: int) -> bool:
        mark = self.events.get(event)
        return mark is None or mark.is_set()

    def synchronize_stream(self, stream: int) -> None:
        done = threading.Event()
        self.stream(stream).submit(done.set)
        done.wait()

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.stream(stream).submit(lambda: ctypes.memmove(dst, src, nbytes), delay=True)

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        buffer = np.zeros(max(nbytes, 1), np.uint8)
        self.memory[buffer.ctypes.data] = buffer
        return buffer.ctypes.data

    def free(self, ptr: int, stream: int | None = None) -> None:
        if stream is not None:  # stream-ordered (the default stream too): once the work
            self.stream(stream).submit(lambda: self.memory.pop(ptr, None))  # before is done
        else:
            self.memory.pop(ptr, None)


def install(monkeypatch_setattr: Callable[[Any, str, Any], None] | None = None,
            jitter_s: float = 300e-6) -> FakeDevice:
    """Replace anyccl.gpu's CUDA calls by a FakeDevice (for this process); returns it."""
    from anyccl import gpu

    device = FakeDevice(jitter_s)
    put = monkeypatch_setattr or setattr
    calls = {
        "device_count": lambda: 1, "set_device": lambda d: None, "use_device": lambda d: None,
        "ensure_context": lambda d: None,
        "current_device": lambda: 0, "device_of_pointer": lambda p: 0,
        "device_name": lambda d: "fake GPU", "relax_capture_mode": lambda: None,
        "is_capturing": lambda s: False,
        "new_stream": device.new_stream, "destroy_stream": device.destroy_stream,
        "new_event": device.new_event, "destroy_event": device.destroy_event,
        "record": device.record, "stream_wait": device.stream_wait,
        "event_done": device.event_done, "synchronize_stream": device.synchronize_stream,
        "copy_async": device.copy_async, "malloc_async": device.malloc,
        "free_async": device.free, "pinned_alloc": device.malloc, "pinned_free": device.free,
    }
    for name, fn in calls.items():
        put(gpu, name, fn)
    return device


def launch(device: FakeDevice, stream: int, fn: Callable[[], None]) -> None:
    """Queue host code `fn` on `stream`, as a kernel launch would."""
    device.stream(stream).submit(fn, delay=True)


class FakeGpuArray:
    """A host array presented as a GPU array on the stream `stream` (0: the default stream)."""

    def __init__(self, array: np.ndarray, stream: int = 0) -> None:
        self.a, self.stream = array, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.ctypes.data, False), "strides": None,
                "stream": self.stream or 1}
