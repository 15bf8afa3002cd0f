"""What all_reduce, broadcast and reduce answer before their full path: an input that cannot be
written in place (a JAX array on the host, a read-only NumPy array) is reduced in a writable
copy and returned as a new array of its kind; a GPU call on arrays an earlier call checked
replays that call's plan (plans.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .buffers import immutable_copy
from .errors import InvalidArgumentError
from .gpu_dispatch import FULL_PATH

if TYPE_CHECKING:
    from .communicator import Communicator


def early(comm: Communicator, tag: tuple, tensor: Any, async_op: bool, stream: Any,
          again: Callable[[np.ndarray], Any]) -> Any:
    """What collective `tag[0]` (`tag`: its name and arguments) of `comm` answers before its
    full path: a replayed plan's outcome (GPU); for an input that cannot be written in place,
    `again(copy)` on a writable copy, and the result as a new array of the input's kind
    (blocking only: an async call is refused, on every rank, as any refused argument is); else
    FULL_PATH."""
    gpu_side = comm._gpu_side
    if gpu_side.plans is not None:   # (a plan is only ever made for a GPU array)
        replayed = gpu_side.replay(tag, (tensor,), async_op, stream)
        if replayed is not FULL_PATH:
            return tensor if replayed is None else replayed
    staged = immutable_copy(tensor)
    if staged is not None:
        copy, back = staged
        name = tag[0]
        if async_op:
            comm._check_open(name)
            exc = InvalidArgumentError(
                f"rank {comm.rank}: {name}: tensor ({type(tensor).__name__}) cannot be written "
                f"in place, so async_op=True has nowhere to put the result; call it blocking "
                f"and use what it returns: y = comm.{name}(x, ...)")
            comm._refused(name, exc, (copy,))
            raise exc
        again(copy)
        return back(copy)
    return FULL_PATH
