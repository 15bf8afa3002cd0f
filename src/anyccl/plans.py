"""Cached plans of GPU collectives: the second call on the same arrays skips the work the first
one did.

A GPU collective on torch CUDA tensors, without stream=, is a pure function of what
identifies its arrays (device pointer, element count, dtype) and its other arguments (op, root):
every argument check, the routing to the ipc kernels or NCCL, and the function that queues the
operation come out the same. The first call takes the full path and leaves its `Plan` here, under
a key built from those values; a later call with an equal key only reads the key (a few cheap
tensor attribute reads) and queues the plan's function, with its own sequence number, op record,
flight-recorder entry, deadline and watchdog like any other operation: a blocking call right on
the caller's current stream, an async one on the backend's stream after the caller's, returning
its Work (the queued operation holds the call's tensors until it is done). Anything else (host
arrays, CuPy or JAX arrays, stream=, debug mode) always takes the full path.

What a plan may not do: keep the user's arrays alive. Its function is built again, once, from
the first call's `GpuArray`s without their owners (`GpuArray.bare`). A replayed call
holds its tensors as any queued operation holds its arrays' owners, only where it needs to:
torch's caching allocator orders a freed block after the work already queued on the caller's
stream, which is where a blocking call runs, so a blocking call needs no reference of its own;
an async call runs on another stream, so its queued operation holds the call's tensors until
it is done.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import gpu
from .backends.gpu_queue import Enqueue
from .buffers import GpuArray, cuda_tensor_key, torch_stream_function
from .ops import ReduceOp
from .trace import ArgsText, OpRecord

_LIMIT = 512          # plans kept per communicator; all are dropped when it is reached
_TAG_TYPES = (int, str, ReduceOp)   # the plain values an argument may be to take part in a key


class Plan:
    """What the first call of a key built: the operation's name, argument text and size for
    its op record, the function that queues it on a stream, its device, the GPU backend (an
    async replay's Work asks it), and the functions a replay calls: `run` (the backend's),
    `current_stream` (torch's current stream on a device, as a handle), and, where the
    function is one compiled call (gpu.ONE_CALL) the backend replays on a shorter way,
    `one_call` and `queue` (the backend's `replayer()`; else both None), and `compiled`, what
    the compiled replay reads of the plan in one tuple (the call's packed arguments, device,
    name, argument text, size and queue; None where there is no queue)."""

    __slots__ = ("name", "args", "nbytes", "enqueue", "device", "backend", "run",
                 "current_stream", "one_call", "queue", "compiled")

    def __init__(self, name: str, args: ArgsText, nbytes: int, enqueue: Enqueue,
                 device: int, backend: Any, run: Callable[..., int]) -> None:
        self.name, self.args, self.nbytes = name, args, nbytes
        self.enqueue, self.device, self.backend, self.run = enqueue, device, backend, run
        self.current_stream = torch_stream_function()
        self.one_call = gpu.ONE_CALL.get(type(enqueue))
        self.queue = backend.replayer() if self.one_call is not None else None
        if self.queue is None:
            self.one_call = None
        self.compiled = None if self.queue is None else (
            enqueue.packed, device, name, args, nbytes, self.queue)  # type: ignore[attr-defined]


class Plans:
    """One communicator's plans, by key. `find` looks a call up; on a miss it remembers the
    call's key as pending, and the full path that follows stores its plan there (`keep`)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}
        self._pending: tuple | None = None
        self._tensor: Any = ()   # torch.Tensor once a plan exists: found inline then

    def __len__(self) -> int:
        return len(self._plans)

    def find(self, tag: tuple, tensors: Sequence[Any]) -> Plan | None:
        """The plan of the call `tag` (the operation's name, then its non-array arguments as
        given) on `tensors` (each a tensor, a list of them or None), or None (then the call
        must take the full path)."""
        self._pending = None
        for value in tag:   # (the name, a str, passes)
            if type(value) not in _TAG_TYPES:  # bool, NumPy ints, other spellings: no plan
                return None
        key = tag
        tensor = self._tensor
        for t in tensors:
            if isinstance(t, tensor):   # the common case: cuda_tensor_key, inline
                try:
                    if t.is_neg() or not t.is_contiguous():
                        return None
                    key += (t.data_ptr(), t.numel(), t.dtype)
                except RuntimeError:    # sparse and other layouts without a data pointer
                    return None
                continue
            if t is None:               # a root-only argument on another rank
                key += (None,)
                continue
            if type(t) is list or type(t) is tuple:   # one array per rank
                key += (len(t),)
                for piece in t:
                    found = cuda_tensor_key(piece)
                    if found is None:
                        return None
                    key += found
                continue
            found = cuda_tensor_key(t)
            if found is None:
                return None
            key += found
        plan = self._plans.get(key)
        if plan is None:
            self._pending = key
        return plan

    def keep(self, name: str, args: ArgsText, nbytes: int, bare_enqueue: Callable[[], Enqueue],
             arrays: Sequence[GpuArray], backend: Any) -> None:
        """Store the plan of the call whose full path is running now, if `find` saw that call
        miss (the pending key names the same operation): its function, `bare_enqueue()`, built
        from the call's arrays without their owners; `backend` is the GPU backend."""
        key, self._pending = self._pending, None
        if key is None or key[0] != name or arrays[0].dtype.kind == "c":
            return  # (complex: a conjugate view has the same key as its tensor)
        if len(self._plans) >= _LIMIT:
            self._plans.clear()
        self._plans[key] = Plan(name, args, nbytes, bare_enqueue(), arrays[0].device, backend,
                                backend.runner())
        torch = sys.modules.get("torch")
        self._tensor = torch.Tensor if torch is not None else ()

    def compiled(self, number: Callable[[], int], recorder_add: Callable[[OpRecord], Any],
                 owner: Any) -> Callable[[tuple, Any], bool] | None:
        """The whole blocking replay of a one-tensor call in compiled code, where the CUDA core
        loaded and torch is in use: a function (tag, tensor) that finds the plan as `find`
        does and, for a plan of one compiled call, queues it on torch's current stream with
        the queue's checks, ordering and event, numbers it (`number`), records it
        (`recorder_add`) and hands it to the queue's watchdog, deadline from
        `owner.timeout_s`; it returns False wherever the Python way must take the call (a miss,
        another kind of plan, a failed or busy queue, a stream being captured, a launch that
        failed), having queued nothing that the Python way would not redo (an event that could
        not be recorded after a launch raises gpu.CudaError). None where it cannot run
        (`_cudacore.replay`). Where the torch group's compiled part is built (torch_core.py),
        its `tensor_key` reads the tensor's part of the key, else the tensor's methods do."""
        torch = sys.modules.get("torch")
        core = gpu._core
        if core is None or torch is None:
            return None
        from . import torch_core

        context = (self._plans, torch.Tensor, ReduceOp, torch_stream_function(), number,
                   OpRecord, recorder_add, owner, gpu.CudaError,
                   getattr(torch_core.built(), "tensor_key", None))
        return functools.partial(core.replay, context)

    def forget(self) -> None:
        """Drop every plan (the communicator closes)."""
        self._plans.clear()
        self._pending = None
