"""Work: the handle of an operation started with ``async_op=True`` (and of isend/irecv)."""

from __future__ import annotations

import threading
import time

from .errors import TimeoutError
from .trace import OpRecord


class Work:
    """Completion of one asynchronous operation.

    ``wait()`` blocks until the operation finished and re-raises its error, if any; the arrays it
    writes hold the result once ``wait()`` returns or ``is_completed()`` is true. An operation
    that cannot finish fails by itself when the communicator's timeout passes, so ``wait()``
    without a timeout never hangs for ever.
    """

    __slots__ = ("record", "rank", "_done", "_error")

    def __init__(self, record: OpRecord, rank: int) -> None:
        self.record, self.rank = record, rank
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; return True. Raise the operation's error, or anyccl.TimeoutError if
        `timeout` seconds pass first (the operation itself goes on)."""
        if not self._done.wait(timeout):
            waited = time.monotonic() - self.record.issued_at
            raise TimeoutError(f"rank {self.rank}: {self.record} is not complete after "
                               f"wait(timeout={timeout:g}) ({waited:.3g} s since it was issued)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished, successfully or not. Never blocks."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """The error the operation finished with; None while running or after success."""
        return self._error if self._done.is_set() else None

    def __repr__(self) -> str:
        state = ("failed" if self._error else "completed") if self._done.is_set() else "pending"
        return f"<anyccl.Work rank {self.rank}: {self.record} {state}>"
