"""The host engine: runs a backend's operations in issue order, one thread at a time.

A blocking call runs inline on the caller's thread when nothing asynchronous is outstanding (the
common case, and the fastest); a blocking message, or sendrecv's pair, when nothing is queued. An
async send is posted inline too when nothing is queued (a small one is then done before isend
returns), and a small receive issued with nothing outstanding is held, not posted, until its
Work is waited on or polled or something else needs it posted (`HostEngine.message`). Other
asynchronous operations go to a worker thread, started on first use, which runs queued
collectives in order and, in between, progresses posted point-to-point messages (leaving them
to a waiter that drives them itself); while anything is outstanding, blocking calls queue
behind it too. Whoever drives the backend holds `_drive`; `_state` (its lock `_lock`) guards
the queue and the counters; held receives sit in a deque of their own.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from . import agreement, tuning
from .backends.base import Backend
from .buffers import SUPPORTED_DTYPES
from .errors import (
    REFUSALS,
    CollectiveMismatchError,
    CommunicatorClosedError,
    PeerLostError,
    TimeoutError,
)
from .ops import COLLECTIVES, ReduceOp
from .trace import FlightRecorder, OpRecord, flight_directory
from .work import Work

_IDLE_POLL_S = 0.25
_WAIT_POLL_S = 0.05  # a wait for messages looks again this often at the latest (bells wake it)
_HELPED_S = 0.001  # the worker leaves messages to a waiter that drove them this recently
_PARK_S = 0.1      # an idle worker looks for new work by itself this long, then parks


class Engine:
    def __init__(self, backend: Backend, label: str) -> None:
        self.backend = backend
        self._label = label
        self._drive = threading.Lock()
        # guards the queue and the counts; `_lock` is the condition's own lock, taken directly
        # where nothing waits on or notifies the condition (a C call, not two Python ones)
        self._lock = threading.RLock()
        self._state = threading.Condition(self._lock)
        self._queue: deque[tuple[Callable[[Work], None], Work, bool]] = deque()
        self._outstanding = 0     # async works posted or queued and not finished
        self._inline = False      # a blocking call runs on its caller's thread
        self._thread: threading.Thread | None = None
        self._closing = False
        self._helped_at = 0.0     # when a waiter last drove the backend itself
        self._parked = False      # the worker waits to be woken (idle for _PARK_S)
        self._draining = False    # close() waits for outstanding work to finish
        # small receives held instead of posted (`HostEngine.message`), in issue order (one,
        # unless threads hold theirs at once): (Work, array, peer, tag); not outstanding until
        # `flush` (HostEngine's) posts them. Added and taken by the deque's atomic calls
        self._held: deque[tuple[Work, np.ndarray, int, int]] = deque()
        self.failure: BaseException | None = None

    # ---- issuing -----------------------------------------------------------------------------
    def call(self, task: Callable[[], None], work: Callable[[], Work]) -> None:
        """Run `task` to completion after everything issued before it; raise its error.
        `work()` makes the Work that tracks it, needed only if it must queue."""
        if self._held:
            self.flush()
        if self.run_now(task):
            return
        with self._lock:
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

    def run_now(self, fn: Callable[[], None]) -> bool:
        """Run `fn()` on the calling thread if it may drive the backend now (`_may_drive`;
        True, its error raised and failing the engine as `call`'s would); else do nothing and
        return False (then `call` queues it)."""
        if not self._may_drive():
            return False
        try:
            fn()
        except BaseException as exc:
            self._note_failure(exc)
            raise
        finally:
            self._drive.release()
        return True

    def _may_drive(self, after_posted: bool = False) -> bool:
        """Take `_drive` (True: the caller runs its operation, then releases it) if nothing
        asynchronous is outstanding, no other thread drives the backend and the engine is
        usable. The common case, without touching the queue's condition: a submit that races
        in after the check queues behind this call (its worker needs `_drive`), as if issued
        after it.

        `after_posted` (a message): it may also run while posted messages are outstanding
        (they progress while it waits), as long as nothing is queued: everything issued before
        it has reached the backend, so messages keep their issue order."""
        if (self._queue if after_posted else self._outstanding) \
                or not self._drive.acquire(False):
            return False
        if (self._queue if after_posted else self._outstanding) or self.failure is not None \
                or self._closing:
            self._drive.release()
            return False
        return True

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
                    with self._lock:
                        self._outstanding += 1
                    self._run_queued(task, work, True)
                    if not work._finished:
                        # the caller usually waits on it next and drives it then: the worker
                        # takes over only if nobody has driven it for _HELPED_S. A worker that
                        # was busy lately looks by itself; only a parked one is woken (a
                        # wake-up per message cost more than the message)
                        self._helped_at = time.monotonic()
                        if self._thread is None or self._parked:
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
        if self._held:
            self.flush()
        if not self._drive.acquire(False):
            return False
        try:
            item = self._take() if self._queue else None
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
                self.backend.abort(exc)
                return False
        finally:
            self._drive.release()
        if self.backend.doorbell.yields:
            # more ranks than cores: a waiter's loop of steps gives the core away at every
            # turn, as every other wait then does; one that keeps it starves the waits that
            # yield on the same core (Linux's EEVDF: a yielding task beside a spinning one
            # gets well under 1% of the core) and the rank it waits for may be one of them
            os.sched_yield()
        return True

    def _take(self) -> tuple[Callable[[Work], None], Work, bool] | None:
        """The next queued operation, taken by the thread holding `_drive`, so that operations
        run in issue order whichever thread runs them."""
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _enqueue(self, task: Callable[[Work], None], work: Work, finishes_itself: bool) -> None:
        if self._held:
            self.flush()
        with self._lock:
            self._raise_if_unusable()
            self._outstanding += 1
            self._queue.append((task, work, finishes_itself))
        self._start_worker()
        self.backend.doorbell.ring()

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
                idle_since = None
                # (a held message is the waiter's to settle: no work of this thread's)
                while not self._queue and not self._closing and self._outstanding == 0:
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if now - idle_since < _PARK_S:   # posts do not wake it: it looks again
                        self._state.wait(_HELPED_S)
                        continue
                    self._parked = True
                    self._state.wait()
                    self._parked = False
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
            self.backend.doorbell.sleep(_IDLE_POLL_S)

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
            self.backend.abort(exc)

    def wait_for_messages(self, finished: Callable[[], bool], deadline: float) -> None:
        """Progress posted messages until `finished()`, on the thread that drives the backend:
        polling for the doorbell's `spin_s`, then sleeping on it between looks, and looking
        at their `deadline`, when the backend fails a message past it (`progress`); a lost
        peer raises here."""
        backend = self.backend
        progress, bell = backend.progress, backend.doorbell
        spin_until, yields = time.perf_counter() + bell.spin_s, bell.yields
        while True:
            progress()
            if finished():
                return
            if time.perf_counter() >= spin_until:
                break
            if yields:
                os.sched_yield()
        while True:
            bell.drain()
            progress()
            if finished():
                return
            bell.sleep(min(_WAIT_POLL_S, max(deadline - time.monotonic(), 1e-4)))

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

    def abort(self, error: BaseException) -> None:
        """Fail this engine with `error` now, from any thread: later calls raise it, and the
        backend is revoked, so that a wait of this rank's (and of its peers' on it) ends at
        its next check instead of at its deadline (the waiting thread then fails its own
        work). Waits for nothing."""
        with self._state:
            if self.failure is None:
                self.failure = error
            self._state.notify_all()
        self.backend.revoke()
        self.backend.doorbell.ring()

    def close(self, timeout_s: float = 5.0) -> None:
        """Let queued work finish (up to `timeout_s`), stop the worker, close the backend."""
        self.flush()
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
        self.backend.doorbell.ring()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        with self._drive:
            self.backend.close()


# ---- the host operations -------------------------------------------------------------------
_OP_CODES = list(COLLECTIVES)
_REDOP_CODES = list(ReduceOp)
_DTYPE_CODES = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}
_NAME_BITS, _DTYPE_BITS = agreement.NAME_BITS, agreement.DTYPE_BITS

# a blocking host message: kind ("send" or "recv"), array, peer (None: any rank), tag
HostMessage = tuple[str, np.ndarray, Optional[int], int]


class HostEngine(Engine):
    """The host engine of one communicator's rank: every host operation, collectives and
    messages, reaches the host backend here, in issue order, with one deadline model (each
    operation's deadline starts when it starts on the backend) and one failure policy
    (`Engine._note_failure`). It also runs debug mode's agreement check for GPU collectives,
    and writes the flight record when an operation times out or loses a peer."""

    def __init__(self, backend: Backend, label: str, *, rank: int, size: int, timeout_s: float,
                 recorder: FlightRecorder, job_id: str) -> None:
        super().__init__(backend, label)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._recorder, self._job_id = recorder, job_id
        # the backend's compiled whole-call path for blocking small collectives, if it has
        # one: `hot_call(hot, comm, kind, x, arg)` (Backend.hot_context)
        self.hot_call, self.hot = backend.hot_context(self, recorder.add) or (None, None)
        self._held_max = tuning.value("engine.held_recv_max")
        self._help, self._flush = self.help, self.flush   # a held receive's Work calls them

    # ---- collectives -----------------------------------------------------------------------
    def collective(self, record: OpRecord, operands: tuple, async_op: bool,
                   like: np.ndarray | None, root: int, op: ReduceOp | None,
                   debug: bool) -> Work | None:
        """Run host collective `record`: the backend's method of its name with `operands`
        (and the record, its per-operation options), after everything issued before it, with
        its signature (`like`'s dtype and size, `root`, `op`) for the backend to compare
        across ranks, and in debug mode the full check first. Blocking: returns None once done
        (raising its error); async: its Work."""
        name = record.name
        if like is not None:  # agreement.word(), inline
            record.agree = (_NAME_BITS[name] | _DTYPE_BITS[like.dtype] | (root + 1) << 15
                            | (0 if op is None else op.agree_bits), like.size)
        else:
            record.agree = (_NAME_BITS[name], 0)
        if not (async_op or debug or self._outstanding) and self._drive.acquire(False):
            # the common blocking case (`_may_drive`, inline): right here, on the caller's
            # thread; `_run` notes its failure, as `run_now` would. A held receive stays held:
            # receives keep their order among themselves, and its sender does not need it
            try:
                if not self._outstanding and self.failure is None and not self._closing:
                    self._run(record, name, operands, None, record.issued_at)
                    return None
            finally:
                self._drive.release()
        signature = self._signature(record, like, root, op) if debug else None
        task = self._task(record, name, operands, signature)
        if async_op:
            return self.submit(task, Work(record, self.rank))
        self.call(task, lambda: Work(record, self.rank))
        return None

    def subgroup(self, ranks: list[int], name: str) -> Backend:
        """Collective over `ranks`: the host backend of a sub-communicator of them (this rank
        among them), with this engine's timeout for its start-up."""
        return self.backend.subgroup(ranks, name, self.timeout_s)

    def check_agreement(self, record: OpRecord, like: Any, root: int,
                        op: ReduceOp | None) -> None:
        """Debug mode's check alone, for a collective that runs elsewhere (on a GPU)."""
        self.call(self._task(record, None, (), self._signature(record, like, root, op)),
                  lambda: Work(record, self.rank))

    def refuse(self, record: OpRecord, reason: str) -> None:
        """This rank refused its arguments to collective `record.name`: arrive at it all the
        same, with a refused signature and the reason, so that every other rank raises too."""
        record.agree = agreement.refused(record.name, reason)
        try:
            self.call(self._task(record, "barrier", (), None), lambda: Work(record, self.rank))
        except CollectiveMismatchError:
            pass  # what the peers called: they raise their side of it

    def _signature(self, record: OpRecord, like: Any, root: int,
                   op: ReduceOp | None) -> np.ndarray:
        return np.array([_OP_CODES.index(record.name), record.seq,
                         _DTYPE_CODES[like.dtype] if like is not None else -1,
                         like.size if like is not None else -1, root,
                         _REDOP_CODES.index(op) if op is not None else -1], np.int64)

    def _task(self, record: OpRecord, method: str | None, operands: tuple,
              signature: np.ndarray | None) -> Callable[[Work | None], None]:
        """`_run` as the task the engine queues."""
        return lambda _=None: self._run(record, method, operands, signature)

    def _run(self, record: OpRecord, method: str | None, operands: tuple,
             signature: np.ndarray | None = None, now: float = 0.0) -> None:
        """One operation on the host backend: debug mode's agreement check (if `signature`),
        then the backend's `method` with `operands` and the record (None: the operation itself
        runs on a GPU). `now`: when it starts, if the caller knows (a call run as it is issued
        starts when it was issued); its deadline is the communicator's timeout after that."""
        record.state = "started"   # FlightRecorder.started, inline: every host op passes here
        record.started_at = now = now or time.monotonic()
        record.deadline = now + self.timeout_s
        try:
            if signature is not None:
                self._agree(record, signature)
            if method is not None:
                getattr(self.backend, method)(*operands, record)
        except BaseException as exc:
            self.failed(record, exc)
            raise
        if method is not None:  # FlightRecorder.ended, inline
            record.state, record.ended_at = "done", time.monotonic()

    def failed(self, record: OpRecord, exc: BaseException) -> None:
        """Host operation `record` raised `exc` (which the caller raises next): the engine's
        failure policy, the record ended with it, the flight record written where it says."""
        self._note_failure(exc)
        FlightRecorder.ended(record, exc)
        self.post_mortem(exc)

    def _agree(self, record: OpRecord, signature: np.ndarray) -> None:
        """Debug mode: every rank learns what every rank called; all raise on a difference."""
        everyone = [np.empty_like(signature) for _ in range(self.size)]
        self.backend.all_gather(everyone, signature, record)
        if all((s == signature).all() for s in everyone):
            return
        lines = [f"rank {self.rank}: collectives disagree at {record} (debug mode):",
                 f"  {'rank':>4}  {'op':<15}{'seq':>6}  {'dtype':<10}{'count':>10}{'root':>6}  "
                 f"redop"]
        for r, (op, seq, dtype, count, root, redop) in enumerate(everyone):
            lines.append(
                f"  {r:>4}  {_OP_CODES[op]:<15}{seq:>6}  "
                f"{SUPPORTED_DTYPES[dtype].name if dtype >= 0 else '-':<10}"
                f"{count if count >= 0 else '-':>10}{root if root >= 0 else '-':>6}  "
                f"{_REDOP_CODES[redop].name if redop >= 0 else '-'}")
        raise CollectiveMismatchError("\n".join(lines))

    def post_mortem(self, exc: BaseException) -> None:
        """On a timeout or a lost peer: write the flight record once and point the error at it."""
        if not isinstance(exc, (TimeoutError, PeerLostError)):
            return
        path = self._recorder.dumped_to or self._recorder.dump(flight_directory(self._job_id))
        if exc.args and isinstance(exc.args[0], str) and path not in exc.args[0]:
            exc.args = (f"{exc.args[0]}\n  flight record of rank {self.rank}: {path}",
                        *exc.args[1:])

    # ---- messages --------------------------------------------------------------------------
    def message(self, kind: str, x: np.ndarray, peer: int | None, tag: int,
                record: OpRecord) -> Work:
        """Start a send or receive (isend, irecv; peer=None: receive from any rank); its Work.
        A receive of at most `engine.held_recv_max` bytes, issued with nothing else
        outstanding, is held rather than posted (`flush` settles it): its wait takes it on the
        transport's fast path, as a blocking receive would. Its sender never needs it posted:
        so small a message is written whole into the transport's buffers without it."""
        if kind == "recv":
            if self._held:   # receives match in issue order
                self.flush()
            if peer is not None and record.nbytes <= self._held_max:
                work = Work(record, self.rank)
                if self._outstanding or self._queue or self._held \
                        or self.failure is not None or self._closing:
                    return self.post(self._post_task(kind, x, peer, tag, record), work)
                # held, as nothing is outstanding or queued (what another thread issues at the
                # same time has no order against it; `flush` settles each in turn)
                work.helper, work.poke = self._help, self._flush
                self._held.append((work, x, peer, tag))
                return work
        elif peer is not None and not self._queue and self._drive.acquire(False):
            try:   # `_may_drive`, inline
                done = not self._queue and self.failure is None and not self._closing \
                    and self.backend.send_now(x, peer, tag)
            except BaseException as exc:
                self._note_failure(exc)
                raise
            finally:
                self._drive.release()
            if done:   # the transport's fast path finished it here and now
                record.state, record.started_at = "done", time.monotonic()
                record.ended_at = record.started_at
                return Work(record, self.rank, True)
        return self.post(self._post_task(kind, x, peer, tag, record), Work(record, self.rank))

    def flush(self, wait: bool = False) -> None:
        """Settle the held receives, if any (`message`), in issue order: each taken now
        through the transport's fast path (`wait`: spinning a while for it), else posted. They
        are settled when a Work of theirs is waited on or polled, before any later receive (so
        that receives keep their issue order) and before anything queued. Where another
        thread drives the backend, they are queued instead, ahead of anything issued after
        them."""
        held = self._held
        if not held:
            return
        if not self._drive.acquire(False):
            queued = False
            with self._lock:
                while held:
                    try:
                        work, x, peer, tag = held.popleft()
                    except IndexError:   # the driving thread took the last one
                        break
                    work.poke = None
                    self._outstanding += 1
                    self._queue.append((self._post_task("recv", x, peer, tag, work.record),
                                        work, True))
                    queued = True
            if queued:
                self._start_worker()
                self.backend.doorbell.ring()
            return
        try:
            while held:
                try:
                    work, x, peer, tag = held.popleft()
                except IndexError:   # another thread's flush took the last one
                    return
                work.poke = None
                record = work.record
                try:
                    taken = self.failure is None and not self._closing \
                        and self.backend.receive_now(x, peer, tag, wait)
                except BaseException as exc:
                    self._note_failure(exc)
                    work.complete(exc)
                    continue
                if taken:
                    record.state, record.started_at = "done", time.monotonic()
                    record.ended_at, work.source = record.started_at, peer
                    work.complete()
                    continue
                with self._lock:   # else posted, as `post` does
                    self._outstanding += 1
                self._run_queued(self._post_task("recv", x, peer, tag, record), work, True)
                if not work._finished:   # the worker finishes it if nobody waits
                    self._helped_at = time.monotonic()
                    if self._thread is None or self._parked:
                        self._start_worker()
        finally:
            self._drive.release()

    def _post_task(self, kind: str, x: np.ndarray, peer: int | None, tag: int,
                   record: OpRecord) -> Callable[[Work], None]:
        """The task that posts message `record` to the backend, which completes its Work."""
        backend = self.backend
        sender: list[int] = []   # a receive from any rank: whose message it took
        if kind == "send":
            post = backend.post_send
        elif peer is None:
            post = functools.partial(backend.post_recv, found=sender.append)
        else:
            post = backend.post_recv

        def task(w: Work) -> None:
            FlightRecorder.started(record)
            record.deadline = record.started_at + self.timeout_s
            done = self.completion(w)

            def on_done(error: BaseException | None) -> None:
                self._message_ended(record, error)
                if kind == "recv":
                    w.source = sender[0] if sender else peer
                done(error)
            post(x, peer, tag, record, on_done)
        return task

    def exchange(self, record: OpRecord,
                 messages: tuple[HostMessage, ...]) -> int | None:
        """Send and receive `messages` together as the one blocking operation `record`, on
        this thread when it may drive the host backend (else in turn on the engine); return
        the sender of the receive among them."""
        if self._held and messages[-1][0] == "recv":
            self.flush()   # receives match in issue order (a sendrecv's receive comes last)
        found: list[int] = []
        if self._may_drive(after_posted=True):
            try:
                self._exchange_now(record, messages, found)
            except BaseException as exc:
                self._note_failure(exc)
                raise
            finally:
                self._drive.release()
        else:
            self.call(lambda: self._exchange_now(record, messages, found),
                      lambda: Work(record, self.rank))
        return found[0] if found else messages[-1][2]

    def blocking(self, kind: str, x: np.ndarray, peer: int | None, tag: int,
                 record: OpRecord) -> int | None:
        """A blocking send or receive (peer=None: receive from any rank): `exchange` of one
        message, its common case first (as `sendrecv`; `_may_drive`, inline). Returns the
        sender of a receive."""
        if peer is not None and not self._queue and (kind == "send" or not self._held) \
                and self._drive.acquire(False):
            try:
                if not self._queue and self.failure is None and not self._closing:
                    record.state, record.started_at = "started", record.issued_at
                    backend = self.backend
                    if backend.send_now(x, peer, tag) if kind == "send" else \
                            backend.receive_now(x, peer, tag):
                        record.state, record.ended_at = "done", time.monotonic()
                    else:
                        self._exchange_now(record, ((kind, x, peer, tag),), [])
                    return peer
            except BaseException as exc:
                self._note_failure(exc)
                raise
            finally:
                self._drive.release()
        return self.exchange(record, ((kind, x, peer, tag),))

    def sendrecv(self, record: OpRecord, x: np.ndarray, dst: int, y: np.ndarray,
                 src: int | None, tag: int) -> int | None:
        """`exchange` of one send and one receive (comm.sendrecv), its common case first: on
        this thread, both through the transport's fast paths (started as issued: it runs
        now); what they do not take goes the general way. Returns the sender."""
        if src is None or self._held or not self._may_drive(after_posted=True):
            return self.exchange(record, (("send", x, dst, tag), ("recv", y, src, tag)))
        try:
            backend = self.backend
            record.state, record.started_at = "started", record.issued_at
            if not backend.send_now(x, dst, tag):
                self.exchange_rest(record, x, dst, y, src, tag, False)
            elif backend.receive_now(y, src, tag):
                record.state, record.ended_at = "done", time.monotonic()
            else:   # the send went: the receive alone is left
                self.exchange_rest(record, x, dst, y, src, tag, True)
        except BaseException as exc:
            self._note_failure(exc)
            raise
        finally:
            self._drive.release()
        return src

    def exchange_rest(self, record: OpRecord, x: np.ndarray, dst: int, y: np.ndarray,
                      src: int, tag: int, sent: bool) -> None:
        """What `sendrecv`'s fast paths (its own, or the compiled one of
        Backend.exchange_context) left, `_drive` held: the receive alone once the send went
        (`sent`), else both, the general way."""
        both = (("send", x, dst, tag), ("recv", y, src, tag))
        self._exchange_now(record, both[1:] if sent else both, [])

    def exchange_failed(self, exc: BaseException) -> None:
        """The compiled sendrecv raised `exc` (raised next): `sendrecv`'s failure policy."""
        self._note_failure(exc)

    def _exchange_now(self, record: OpRecord, messages: tuple[HostMessage, ...],
                      found: list[int]) -> None:
        """Blocking messages, on the thread that drives the host backend: each through the
        transport's fast path where it takes it (send_now, receive_now: done at once), the
        others posted; return once all are done, raising the first error. A receive from any
        rank appends its sender to `found`. Only posted messages tell the backend that this
        rank is in `record` (what peers see while it waits) and get a deadline."""
        record.state, record.started_at = "started", time.monotonic()   # FlightRecorder.started
        backend = self.backend
        posted = 0
        outcomes: list[BaseException | None] = []
        for kind, x, peer, tag in messages:
            if peer is not None and (backend.send_now if kind == "send"
                                     else backend.receive_now)(x, peer, tag):
                continue
            if not posted:
                record.deadline = time.monotonic() + self.timeout_s
            posted += 1
            if kind == "send":
                backend.post_send(x, peer, tag, record, outcomes.append)
            else:
                backend.post_recv(x, peer, tag, record, outcomes.append, found=found.append)
        if not posted:
            record.state, record.ended_at = "done", time.monotonic()   # FlightRecorder.ended
            return
        if len(outcomes) < posted:
            try:
                self.wait_for_messages(lambda: len(outcomes) == posted, record.deadline)
            except BaseException as exc:
                self._message_ended(record, exc)
                raise
        error = next((e for e in outcomes if e is not None), None)
        self._message_ended(record, error)
        if error is not None:
            raise error

    def _message_ended(self, record: OpRecord, error: BaseException | None) -> None:
        FlightRecorder.ended(record, error)
        if error is not None:
            self.post_mortem(error)
