"""Runs a backend's operations in issue order, one thread at a time.

A blocking call runs inline on the caller's thread when nothing asynchronous is outstanding (the
common case, and the fastest). An async message is posted inline too when nothing is queued (a
small send is then done before isend returns). Other asynchronous operations go to a worker
thread, started on first use, which runs queued collectives in order and, in between,
progresses posted point-to-point messages (leaving them to a waiter that drives them itself);
while anything is outstanding, blocking calls queue behind it too. Whoever drives the backend
holds `_drive`; `_state` guards the queue and the counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from .backends.base import Backend
from .errors import REFUSALS, CommunicatorClosedError
from .work import Work

_IDLE_POLL_S = 0.25
_HELPED_S = 0.001  # the worker leaves messages to a waiter that drove them this recently


class Engine:
    def __init__(self, backend: Backend, label: str) -> None:
        self.backend = backend
        self._label = label
        self._drive = threading.Lock()
        self._state = threading.Condition()
        self._queue: deque[tuple[Callable[[Work], None], Work, bool]] = deque()
        self._outstanding = 0     # async works not finished
        self._inline = False      # a blocking call runs on its caller's thread
        self._thread: threading.Thread | None = None
        self._closing = False
        self._helped_at = 0.0     # when a waiter last drove the backend itself
        self._draining = False    # close() waits for outstanding work to finish
        self.failure: BaseException | None = None

    # ---- issuing -----------------------------------------------------------------------------
    def call(self, task: Callable[[], None], work: Callable[[], Work]) -> None:
        """Run `task` to completion after everything issued before it; raise its error.
        `work()` makes the Work that tracks it, needed only if it must queue."""
        if self.run_now(task):
            return
        with self._state:
            self._raise_if_unusable()
            inline = self._outstanding == 0 and not self._inline
            self._inline |= inline
        if not inline:
            queued = work()
            queued.helper = self.help
            self._enqueue(lambda w: task(), queued, False)
            queued.wait()
            return
        try:
            with self._drive:
                task()
        except BaseException as exc:
            self._note_failure(exc)
            raise
        finally:
            with self._state:
                self._inline = False
                self._state.notify_all()

    def run_now(self, fn: Callable[..., None], *args: Any, after_posted: bool = False) -> bool:
        """Run `fn(*args)` on the calling thread if nothing asynchronous is outstanding and no
        other thread drives the backend (True; its error is raised and fails the engine as
        `call`'s would); else do nothing and return False (then `call` queues it). The common
        case, without touching the queue's condition: a submit that races in after the check
        queues behind this call (its worker needs `_drive`), as if issued after it.

        `after_posted` (a message): it may also run while posted messages are outstanding
        (they progress while it waits), as long as nothing is queued: everything issued before
        it has reached the backend, so messages keep their issue order."""
        if (self._queue if after_posted else self._outstanding) \
                or not self._drive.acquire(False):
            return False
        try:
            if (self._queue if after_posted else self._outstanding) or self.failure is not None \
                    or self._closing:
                return False
            try:
                fn(*args)
            except BaseException as exc:
                self._note_failure(exc)
                raise
            return True
        finally:
            self._drive.release()

    def submit(self, task: Callable[[Work], None], work: Work, *,
               finishes_itself: bool = False) -> Work:
        """Queue `task`. It completes `work` by returning, or, with `finishes_itself` (posted
        messages), through the callback of `completion(work)`."""
        work.helper = self.help
        self._enqueue(task, work, finishes_itself)
        return work

    def post(self, task: Callable[[Work], None], work: Work) -> Work:
        """Start a message: `task(work)` posts it to the backend, which completes `work` through
        the callback of `completion(work)`. Posted on the calling thread when nothing is queued
        and no other thread drives (a small send is then done before this returns, with no
        hand-off to the worker); else queued like `submit`. The worker, started if need be,
        progresses whatever the post left outstanding, so it finishes without the caller."""
        work.helper = self.help
        if not self._queue and self._drive.acquire(False):
            try:
                if not self._queue and self.failure is None and not self._closing:
                    with self._state:
                        self._outstanding += 1
                    self._run_queued(task, work, True)
                    if not work._finished:
                        # the caller usually waits on it next and drives it then: the worker
                        # takes over only if nobody has driven it for _HELPED_S
                        self._helped_at = time.monotonic()
                        self._start_worker()
                    return work
            finally:
                self._drive.release()
        self._enqueue(task, work, True)
        return work

    def _start_worker(self) -> None:
        with self._state:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, daemon=True,
                                                name=f"anyccl-{self._label}")
                self._thread.start()
            self._state.notify_all()

    def help(self) -> bool:
        """Do a step of the worker's job on the calling thread (one waiting on a Work): run the
        next queued operation, else progress posted messages. False when another thread drives
        or nothing is outstanding. A waiter that drives itself saves two thread hand-offs per
        message, which cost more than a small message itself."""
        if not self._drive.acquire(False):
            return False
        try:
            item = self._take()
            if item is not None:
                self._run_queued(*item)
                return True
            if self._outstanding == 0 or self.failure is not None or self._closing:
                return False
            self._helped_at = time.monotonic()
            try:
                self.backend.progress()
            except BaseException as exc:  # a lost peer: everything outstanding fails
                self._note_failure(exc)
                self.backend.fail_pending(exc)
                return False
            return True
        finally:
            self._drive.release()

    def _take(self) -> tuple[Callable[[Work], None], Work, bool] | None:
        """The next queued operation, taken by the thread holding `_drive`, so that operations
        run in issue order whichever thread runs them."""
        with self._state:
            return self._queue.popleft() if self._queue else None

    def _enqueue(self, task: Callable[[Work], None], work: Work, finishes_itself: bool) -> None:
        with self._state:
            self._raise_if_unusable()
            self._outstanding += 1
            self._queue.append((task, work, finishes_itself))
        self._start_worker()
        self.backend.wake()

    def completion(self, work: Work) -> Callable[[BaseException | None], None]:
        """The callback a backend calls when a posted message of `work` is done."""
        def done(error: BaseException | None) -> None:
            if error is not None:
                self._note_failure(error)
            self._finished(work, error)
        return done

    def _finished(self, work: Work, error: BaseException | None) -> None:
        work.complete(error)
        with self._state:
            self._outstanding -= 1
            if self._draining:  # only close() waits for the count (the idle worker does not)
                self._state.notify_all()

    # ---- the worker --------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._state:
                while not self._queue and self._outstanding == 0 and not self._closing:
                    self._state.wait()
                queued = bool(self._queue)
                closing = self._closing
            if queued:
                with self._drive:
                    item = self._take()
                    if item is not None:
                        self._run_queued(*item)
                        item = None  # the operation's arrays are the caller's again
                continue
            if closing:
                self._fail_all(CommunicatorClosedError(
                    f"{self._label}: the communicator was closed before this message finished"))
                return
            if time.monotonic() - self._helped_at < _HELPED_S:
                # a waiter drives its messages itself: stay off the cores and the lock (woken
                # by every arriving message, this thread would only take turns with it)
                time.sleep(_HELPED_S)
                continue
            error = None
            with self._drive:
                try:
                    self.backend.progress()
                except BaseException as exc:  # a lost peer: everything outstanding fails
                    error = exc
            if error is not None:
                self._note_failure(error)
                self._fail_all(error)
                continue
            self.backend.wait_for_activity(_IDLE_POLL_S)

    def _run_queued(self, task: Callable[[Work], None], work: Work, finishes_itself: bool) -> None:
        """Run one queued operation; the caller holds `_drive`."""
        error: BaseException | None = None
        if self.failure is not None:
            error = CommunicatorClosedError(
                f"{work.record} was not run: the communicator broke earlier: {self.failure}")
        else:
            try:
                task(work)
            except BaseException as exc:
                error = exc
                self._note_failure(exc)
        if error is not None or not finishes_itself:
            self._finished(work, error)

    def _fail_all(self, exc: BaseException) -> None:
        with self._drive:
            self.backend.fail_pending(exc)

    # ---- state -------------------------------------------------------------------------------
    def _note_failure(self, exc: BaseException) -> None:
        """anyccl's refusals (errors.REFUSALS: raised before any byte moves) leave the
        communicator usable; anything else (a timeout, a lost peer, a ValueError from NumPy
        halfway through) breaks it."""
        if self.failure is None and not isinstance(exc, REFUSALS):
            self.failure = exc

    def _raise_if_unusable(self) -> None:
        if self._closing:
            raise CommunicatorClosedError(f"{self._label}: the communicator is closed")
        if self.failure is not None:
            raise CommunicatorClosedError(
                f"{self._label}: the communicator broke on an earlier error and cannot be used: "
                f"{self.failure}") from self.failure

    def close(self, timeout_s: float = 5.0) -> None:
        """Let queued work finish (up to `timeout_s`), stop the worker, close the backend."""
        with self._state:
            if self._closing:
                return
            deadline = time.monotonic() + timeout_s
            self._draining = True
            while self._outstanding and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state.wait(min(left, 0.05))
            self._closing = True
            self._state.notify_all()
        self.backend.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        with self._drive:
            self.backend.close()
