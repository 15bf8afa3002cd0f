"""The communicators open in this process: closed together at exit, disowned in a child forked
after init() (a child must not act as its parent's rank), and what a call on a closed one says."""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

from .errors import AnycclError, CommunicatorClosedError
from .store import connection_of

# every communicator open in this process (Communicator adds and discards itself)
live: weakref.WeakSet[Any] = weakref.WeakSet()


def closed_error(rank: int, op: str, owner_pid: int) -> CommunicatorClosedError:
    """The error for `op` on a closed communicator of `rank`; one created by process
    `owner_pid` and used in a child forked from it says so, and what to do instead."""
    if owner_pid != os.getpid():
        return CommunicatorClosedError(
            f"rank {rank}: {op}: this communicator belongs to process {owner_pid}, and this "
            f"process ({os.getpid()}) was forked from it after init(): a child cannot use its "
            f"parent's communicator (it would take its parent's place as rank {rank}). Call "
            f"anyccl.init() in the child as a rank of its own, or fork before init()")
    return CommunicatorClosedError(f"rank {rank}: {op}: the communicator is closed")


def close(comm: Any, gpu_side: Any, engine: Any, store: Any) -> None:
    """Close `comm` once: its GPU engine (and GPU backend), then its host engine (its worker
    and host backend), then `store` (None: the store is a parent communicator's) -- unless
    a communicator still open uses its connection (one split, shrunk or grown from `comm`,
    which may still meet its peers there, to make its GPU backend, say): that one then owns
    it."""
    if comm._closed:
        return
    comm._closed = True
    live.discard(comm)
    try:
        gpu_side.close()
    finally:
        try:
            engine.close()
        finally:
            if store is not None:
                connection = connection_of(store)
                heir = next((c for c in live if connection_of(c._store) is connection
                             and not c._closed), None)
                if heir is None:
                    store.close()
                else:
                    heir._owns_store = True


def _after_fork_in_child() -> None:
    """In a child forked after init(): every communicator refuses every call, and leaves the
    parent's shared memory, threads and connections to the parent (closing them here would
    tell the parent's peers that it left)."""
    for comm in list(live):
        comm._closed = True
        comm._gpu_side.plans = None
        live.discard(comm)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# called after close_all closed every communicator at exit (a transport's threads to end
# while the interpreter is still whole: backends/gloo.py)
at_exit_after_close: list[Callable[[], None]] = []


def close_all() -> None:
    """Close every communicator still open (registered with atexit), then run
    `at_exit_after_close`."""
    for comm in list(live):
        try:
            comm.close()
        except AnycclError:
            pass
    for hook in at_exit_after_close:
        hook()
