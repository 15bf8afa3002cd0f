"""The interface every host transport implements.

The communicator validates arguments and hands a backend flat, contiguous NumPy arrays of one
dtype, lists already split into equal pieces, and ranks already checked; backends trust them.
Collectives are blocking calls made in the same order on every rank. Each collective's record
carries its signature (`record.agree`, see agreement.py), which the backend compares across
ranks before any rank touches another's memory, raising `CollectiveMismatchError` on every rank
when they differ; a backend that cannot may leave that to debug mode. Point-to-point messages are
posted and then progressed, so that sends and receives issued in any order can complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

import numpy as np

from ..ops import ReduceOp
from ..trace import OpRecord

Completion = Callable[[Optional[BaseException]], None]


class Backend(ABC):
    """A way of moving bytes among the `size` ranks of one communicator."""

    name: str
    rank: int
    size: int

    @abstractmethod
    def begin(self, record: OpRecord, deadline: float) -> None:
        """Note the collective about to run and the monotonic time by which it must finish."""

    @abstractmethod
    def end(self, record: OpRecord) -> None:
        """Note that `record` finished on this rank (what peers see while it is idle)."""

    @abstractmethod
    def all_reduce(self, x: np.ndarray, op: ReduceOp) -> None: ...

    @abstractmethod
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp) -> None: ...

    @abstractmethod
    def broadcast(self, x: np.ndarray, root: int) -> None: ...

    @abstractmethod
    def all_gather(self, outs: list[np.ndarray], x: np.ndarray) -> None: ...

    @abstractmethod
    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int) -> None: ...

    @abstractmethod
    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int) -> None: ...

    @abstractmethod
    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> None: ...

    @abstractmethod
    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray]) -> None: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord, deadline: float,
                  on_done: Completion) -> None:
        """Queue `x` for `dst`; `on_done` is called once it is sent (or failed)."""

    @abstractmethod
    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  deadline: float, on_done: Completion,
                  found: Callable[[int], None] | None = None) -> None:
        """Ask for the next message from `src` with `tag` into `x`; `on_done` once it landed.
        src=None: from whichever rank's message with `tag` is matched first (the earliest
        posted receive that fits a message takes it, as in MPI); `found(sender)` is called
        before `on_done`."""

    def send_now(self, x: np.ndarray, dst: int, tag: int) -> bool:
        """A blocking send's fast path: True once `x` went out whole, here and now; False,
        with nothing done, where the transport has none (the caller then posts it)."""
        return False

    def receive_now(self, x: np.ndarray, src: int, tag: int, wait: bool = True) -> bool:
        """A receive's fast path: True once the next message from `src` with `tag` landed in
        `x` (wait=False: only if it is there already; True: the transport may wait a moment);
        False, with nothing done, in every other case (the caller then posts the receive, which
        reports mismatches, deadlines and lost peers)."""
        return False

    @abstractmethod
    def progress(self) -> None:
        """Advance posted messages as far as possible without blocking; fail expired ones."""

    @abstractmethod
    def fail_pending(self, error: BaseException) -> None:
        """Complete every posted message with `error` (a peer was lost)."""

    @abstractmethod
    def wait_for_activity(self, timeout_s: float) -> None:
        """Sleep until a peer or a local thread signals this rank, or `timeout_s` passes."""

    @abstractmethod
    def wake(self) -> None:
        """Interrupt `wait_for_activity` (called by a thread that queued new work)."""

    @abstractmethod
    def wait_for_messages(self, finished: Callable[[], bool], record: OpRecord,
                          deadline: float) -> None:
        """Progress until `finished()`; TimeoutError at `deadline`."""

    @abstractmethod
    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        """A backend over `ranks` (this rank among them); collective over those ranks."""

    def lost_peer(self) -> tuple[int, str] | None:
        """If this transport can tell that a peer process left: its rank and what happened
        (called from other threads, e.g. the GPU backend's watchdog). None when all seem alive."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release every resource; peers still waiting on this rank learn that it left."""


class PolledMessages:
    """What a backend whose messages a library completes when polled (mpi, gloo) does alike
    with its list `_pending` of posted messages (each with an `on_done`). Sends are buffered:
    they complete at once, and a delivery that fails later (`_late`) is kept in `_late_error`
    for the backend's next call to raise."""

    _pending: list
    _late_error: BaseException | None

    def _late(self, error: BaseException | None) -> None:
        if error is not None and self._late_error is None:
            self._late_error = error

    def fail_pending(self, error: BaseException) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.on_done(error)

    def wait_for_activity(self, timeout_s: float) -> None:
        import time

        time.sleep(min(timeout_s, 1e-4))   # the library progresses only when polled

    def wake(self) -> None:
        pass
