"""Work: the handle of an operation started with ``async_op=True`` (and of isend/irecv)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .errors import TimeoutError
from .trace import OpRecord

_HELP_S = 0.002  # how long a waiter drives the engine itself before it sleeps
_EVENTS = threading.Lock()  # makes one event per Work when several threads wait on it


class Work:
    """Completion of one asynchronous operation.

    ``wait()`` blocks until the operation finished and re-raises its error, if any; the arrays it
    writes hold the result once ``wait()`` returns or ``is_completed()`` is true. An operation
    that cannot finish fails by itself when the communicator's timeout passes, so ``wait()``
    without a timeout never hangs for ever.
    """

    __slots__ = ("record", "rank", "helper", "poke", "source", "_finished", "_event", "_error")

    def __init__(self, record: OpRecord, rank: int, finished: bool = False) -> None:
        """`finished`: the Work of an operation that already finished, without error."""
        self.record, self.rank = record, rank
        # irecv(src=None): the rank whose message it received, once it has completed
        self.source: int | None = None
        # a step of the engine's work that a waiter may do itself (False: it cannot now)
        self.helper: Callable[[], bool] | None = None
        # a message its engine holds instead of posting: `poke(wait)` settles it (engine.py)
        self.poke: Callable[[bool], None] | None = None
        self._finished = finished
        self._event: threading.Event | None = None  # made only if someone must block on it
        self._error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        """Mark the operation finished, with `error` if it failed (called by the engine).

        No lock: it sets `_finished`, then looks for a waiter's event; a waiter publishes its
        event, then looks at `_finished` again (`_wait_finished`). Each does its write before
        its read, in the one order the interpreter lock gives all threads, so one of them
        sees the other's write: the waiter returns, or its event is set (or both)."""
        self._error = error
        self._finished = True
        event = self._event
        if event is not None:
            event.set()

    def _wait_finished(self, timeout: float | None) -> bool:
        # drive the engine for a moment rather than sleep at once; not under a timeout: a
        # queued collective run here would block past it (the worker thread runs it instead)
        if self.helper is not None and timeout is None:
            until = time.monotonic() + _HELP_S
            while not self._finished and self.helper() and time.monotonic() < until:
                pass
            if self._finished:
                return True
        with _EVENTS:   # waiters on one Work share one event
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if self._finished:   # after publishing the event: see `complete`
            return True
        return event.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; return True. Raise the operation's error, or anyccl.TimeoutError if
        `timeout` seconds pass first (the operation itself goes on)."""
        if self.poke is not None:   # held by its engine: taken now (spinning a while), or posted
            self.poke(True)
        if not self._finished and not self._wait_finished(timeout):
            waited = time.monotonic() - self.record.issued_at
            raise TimeoutError(f"rank {self.rank}: {self.record} is not complete after "
                               f"wait(timeout={timeout:g}) ({waited:.3g} s since it was issued)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished, successfully or not. Never blocks."""
        if not self._finished and self.poke is not None:
            self.poke(False)
        return self._finished

    def exception(self) -> BaseException | None:
        """The error the operation finished with; None while running or after success."""
        return self._error if self.is_completed() else None

    def __repr__(self) -> str:
        state = ("failed" if self._error else "completed") if self._finished else "pending"
        return f"<anyccl.Work rank {self.rank}: {self.record} {state}>"


class GpuWork(Work):
    """Completion of an operation queued on a GPU stream (the nccl backend).

    ``wait()`` makes the caller's current stream wait for the operation without blocking the host
    (for JAX arrays, which have no stream to order after, it blocks the host instead);
    ``wait(timeout)`` blocks the host until the operation finished on the GPU, raising
    anyccl.TimeoutError if `timeout` seconds pass first; ``is_completed()`` asks the GPU.
    """

    __slots__ = ("_backend", "_event", "_deadline", "_current_stream")

    def __init__(self, record: OpRecord, rank: int, backend: Any,
                 current_stream: Callable[[], int | None]) -> None:
        super().__init__(record, rank)
        self._backend = backend
        self._event: int | None = None
        self._deadline = 0.0
        self._current_stream = current_stream

    def bind(self, event: int, deadline: float) -> None:
        """Attach the event that marks the operation's end (set by the GPU dispatch)."""
        self._event, self._deadline = event, deadline

    def bound_to(self) -> tuple[int, float]:
        """(event, deadline) this Work was bound to (a batch's Works share one)."""
        return self._bound(), self._deadline

    def _bound(self) -> int:
        if self._event is None:
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"rank {self.rank}: {self.record} is part of a "
                                       f"`with comm.batch():` block; wait on it after the block")
        return self._event

    def wait(self, timeout: float | None = None) -> bool:
        from . import gpu

        event = self._bound()
        if timeout is not None:
            if not gpu.wait_event(event, time.monotonic() + timeout,
                                  self._backend.raise_if_failed):
                waited = time.monotonic() - self.record.issued_at
                raise TimeoutError(
                    f"rank {self.rank}: {self.record} is not complete on the GPU after "
                    f"wait(timeout={timeout:g}) ({waited:.3g} s since it was issued)")
            self._backend.raise_if_failed()
            return True
        self._backend.raise_if_failed()
        stream = self._current_stream()
        if stream is None:
            self._backend.host_wait(event, self.record, self._deadline)
        else:
            gpu.stream_wait(stream, event)
        return True

    def is_completed(self) -> bool:
        if self._event is None:
            return False
        if self._backend.failure is not None:
            return True
        from . import gpu

        return gpu.event_done(self._event)

    def exception(self) -> BaseException | None:
        return self._backend.failure if self.is_completed() else None

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "queued"
        return f"<anyccl.GpuWork rank {self.rank}: {self.record} {state}>"
