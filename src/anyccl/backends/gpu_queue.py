"""The GPU queue: how a GPU backend's operations are ordered on CUDA streams, followed, and
stopped. Every stream-ordered GPU backend (nccl, ipc) queues through one of these.

Ordering, as torch.distributed's NCCL backend does it: an async operation runs on the queue's
own stream, after the work already queued on the callers' streams (an event recorded there,
waited on here); a blocking one runs right on the caller's stream. Either way it also follows
the queue's previous operation, wherever that ran, so one communicator's operations run in
issue order. An event recorded after each operation is what the caller's stream, a `GpuWork`,
or the watchdog wait for. Queuing never blocks the host.

The watchdog thread follows every queued operation's event. When one is not finished by its
deadline, a health check reports a problem (the transport's asynchronous error, a peer process
that died), the queue is aborted: the backend's abort actions run (so no kernel stays stuck and
a host blocked on the stream wakes up), and the error is recorded; the next call raises it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable

from .. import gpu
from ..errors import (
    AnycclError,
    CommunicatorClosedError,
    PeerLostError,
    TimeoutError,
    UnsupportedError,
)
from ..trace import Entry, FlightRecorder, OpRecord

Enqueue = Callable[[int], None]          # issues an operation's GPU work on the stream given
Health = Callable[[OpRecord], "BaseException | None"]
LostPeer = Callable[[], "tuple[int, str] | None"]

_EVENT_RING = 1024          # events recycled in order; reuse only ever waits for a later point
_WATCH_POLL_S = 0.05        # how often the watchdog looks at queued events (never per op:
                            # each look takes the GIL from the caller; at 10 ms an eager loop
                            # of small calls lost ~1.7 us per call to it on a GPU machine)
_HEALTH_POLL_S = 0.1        # how often it runs the health checks
_RETIRE_EVERY = 64          # the caller retires finished operations itself every this many:
                            # an eager loop queues thousands per watchdog poll, whose records
                            # would otherwise live long enough to reach the garbage collector's
                            # oldest generation and set off its full collections


# The queue's ordering state, one list that the compiled replay (_cudacore.replay) updates too:
# the next event of the ring, the stream of the last operation (None: none yet) and its event.
_NEXT, _LAST_STREAM, _LAST_EVENT = range(3)

# One queued operation the watchdog follows, as a plain tuple (made on every call): its record,
# the event that marks its end, its deadline, the arrays kept alive until then and its
# flight-recorder lines.
_RECORD, _EVENT, _DEADLINE, _KEEP, _ENTRIES = range(5)
Queued = tuple  # (OpRecord, event, deadline, keep, entries)


class GpuQueue:
    """One GPU's ordered queue for one communicator: its stream, events and watchdog.

    `lost_peer` is the host transport's word on peers (a process that died); `what` names the
    queue's transport in messages ("NCCL communicator"). `enqueue_errors` are the exceptions an
    enqueue function may raise for a call the transport refused, turned into AnycclErrors by
    `describe_error(record, exc)`.
    """

    retire_every = _RETIRE_EVERY

    def __init__(self, device: int, label: str, lost_peer: LostPeer, *, rank: int,
                 what: str = "communicator",
                 enqueue_errors: tuple[type[BaseException], ...] = (),
                 describe_error: Callable[[OpRecord, BaseException], AnycclError] | None = None
                 ) -> None:
        self.device, self.rank, self.label, self.what = device, rank, label, what
        self._lost_peer = lost_peer
        self._enqueue_errors = enqueue_errors
        self._describe_error = describe_error
        self.stream = gpu.new_stream(device)
        self._start = gpu.new_event(device)
        self._events = [gpu.new_event(device) for _ in range(_EVENT_RING)]
        self._order: list[Any] = [0, None, 0]   # [_NEXT, _LAST_STREAM, _LAST_EVENT]
        self.lock = threading.Lock()             # enqueueing vs aborting
        self._wake = threading.Event()           # set when work arrives in an empty queue
        self._queued: deque[Queued] = deque()   # appended here, popped by the watchdog
        self._retiring = threading.Lock()        # one thread pops finished operations
        self._watchdog: threading.Thread | None = None
        self._closing = False
        self.failure: BaseException | None = None
        self._reported = False
        self._health: list[Health] = []
        self._aborts: list[Callable[[], None]] = []
        self._alarm: Any = None                  # (words, index) of the transport's alarm
        self.replay_state = self._replay_state()

    def watch(self, health: Health | None = None,
              abort: Callable[[], None] | None = None,
              alarm: tuple[Any, int] | None = None) -> None:
        """Have the watchdog call `health(record)` at its health polls (an error it returns
        aborts the queue) and `abort()` when the queue is aborted, the last added first, under
        `lock` (abort actions must not wait for work queued on the GPU). `alarm`, (words,
        index): a host word the transport's kernels set when they end an operation early (a
        ctypes array over host-mapped memory); every call looks at it and, when it is set,
        runs the health checks at once instead of at the watchdog's next poll."""
        if health is not None:
            self._health.append(health)
        if abort is not None:
            self._aborts.append(abort)
        if alarm is not None:
            self._alarm = alarm
            self.replay_state = self._replay_state()

    def _replay_state(self) -> tuple:
        """What the compiled replay (_cudacore.replay) reads of this queue, in one tuple: the
        lock, the event ring, the ordering state, the queued operations, the retiring lock,
        the alarm word's address (0: no alarm; None: one it cannot read, so it declines), how
        often it retires, and the queue itself (for `_followed` and errors)."""
        alarm: int | None = 0
        if self._alarm is not None:
            words, index = self._alarm
            alarm = ctypes.addressof(words) + 8 * index \
                if isinstance(words, ctypes.Array) and ctypes.sizeof(words._type_) == 8 and \
                0 <= index < len(words) else None
        return (self.lock, self._events, self._order, self._queued, self._retiring, alarm,
                self.retire_every, self)

    # ---- queuing -----------------------------------------------------------------------------
    def run(self, record: OpRecord, after: Sequence[int], deadline: float, enqueue: Enqueue,
            keep: Any, entries: list[Entry], on: int | None = None) -> int:
        """Queue `enqueue(stream)` and return the event that marks its end.

        on=None: on this queue's stream, after the work queued so far on each stream of `after`
        (async operations, which may overlap the caller's later work). on=stream: right on the
        caller's stream (blocking calls: already ordered both ways, no extra sync). Either way
        it also follows the previous operation of this queue, wherever that was queued."""
        alarm = self._alarm
        if self.failure is not None or alarm is not None and alarm[0][alarm[1]]:
            self.raise_if_failed()
        event = 0
        if on is not None:
            one_call = gpu.ONE_CALL.get(type(enqueue))   # its driver calls in one
            if one_call is not None:
                event = self._queue_one_call(one_call, enqueue, on, record)
        if not event:
            event = self._queue(record, after, enqueue, entries, on)
            if not event:
                return 0   # captured into a CUDA graph: nothing to follow
        for entry in entries:
            FlightRecorder.started(entry)
        self._follow((record, event, deadline, keep, entries))
        return event

    def replay_one(self, record: OpRecord, call: Enqueue, one_call: Callable[..., bool],
                   stream: int, deadline: float) -> None:
        """`run(record, [stream], deadline, call, None, [record], on=stream)` for an operation
        of one compiled call (`one_call`, from gpu.ONE_CALL; a cached plan's blocking replay),
        without run's general cases: the same checks, ordering, event and following."""
        alarm = self._alarm
        if self.failure is not None or alarm is not None and alarm[0][alarm[1]]:
            self.raise_if_failed()
        event = self._queue_one_call(one_call, call, stream, record)
        if not event:   # the stream is being captured: run captures it
            self.run(record, (stream,), deadline, call, None, [record], stream)
            return
        FlightRecorder.started(record)
        self._follow((record, event, deadline, None, (record,)))

    def _follow(self, queued_op: Queued) -> None:
        """The watchdog follows `queued_op` from here; every so often the caller retires the
        finished ones itself. (_cudacore.replay does the same: append, then `_followed` where
        the queue was empty, or its own `_retire` where its length is a multiple of
        `retire_every`.)"""
        queued = self._queued
        was_empty = not queued
        queued.append(queued_op)
        if was_empty or not len(queued) % self.retire_every:
            self._followed(was_empty)

    def _followed(self, was_empty: bool) -> None:
        """What handing an operation to the watchdog sets off: the watchdog woken where the
        queue was empty, else the finished operations retired by the caller."""
        if was_empty:
            self._wake_watchdog()
        elif self._retiring.acquire(False):
            try:   # (never waits for the watchdog: it is retiring them already)
                self._retire()
            except gpu.CudaError:
                pass   # the operation is queued; the error fails the watchdog's look or a call
            finally:
                self._retiring.release()

    def _queue(self, record: OpRecord, after: Sequence[int], enqueue: Enqueue,
               entries: list[Entry], on: int | None) -> int:
        """`run`'s queuing, any operation: its event, or 0 when it was captured into the CUDA
        graph being captured on stream `on` (its flight-recorder entries are then done)."""
        gpu.ensure_context(self.device)  # the caller may be a thread new to CUDA
        if on is not None:  # a blocking call: right on the caller's stream
            if gpu.is_capturing(on):
                return self._captured(on, enqueue, record, entries)
            stream = on
            null = on in gpu.NULL_STREAMS
        else:
            for user_stream in after:
                if gpu.is_capturing(user_stream):
                    raise UnsupportedError(f"rank {self.rank}: {record}: async_op=True while "
                                           f"the stream is captured into a CUDA graph; capture "
                                           f"blocking calls")
            stream = self.stream
            null = any(s in gpu.NULL_STREAMS for s in after)
        order = self._order
        with self.lock:
            if null:
                gpu.use_device(self.device)  # a null stream is the current device's
            if on is None:
                for user_stream in after:
                    gpu.record(self._start, user_stream)
                    gpu.stream_wait(stream, self._start)
            if order[_LAST_STREAM] != stream and order[_LAST_STREAM] is not None:
                gpu.stream_wait(stream, order[_LAST_EVENT])
            self._enqueue(enqueue, stream, record)
            event = self._events[order[_NEXT]]
            order[_NEXT] = (order[_NEXT] + 1) % len(self._events)
            gpu.record(event, stream)
            order[_LAST_STREAM], order[_LAST_EVENT] = stream, event
        return event

    def _queue_one_call(self, one_call: Callable[..., bool], enqueue: Enqueue, stream: int,
                        record: OpRecord) -> int:
        """`_queue` of one kernel or one NCCL call right on `stream`, in one compiled call
        (`one_call`, from gpu.ONE_CALL): its event, or 0 when the stream is being captured
        (nothing was queued; `_queue` captures it)."""
        order = self._order
        with self.lock:   # (a null stream is the current device's: one_call makes it ours)
            event = self._events[order[_NEXT]]
            last = order[_LAST_STREAM]
            after = order[_LAST_EVENT] if last is not None and last != stream else 0
            try:
                if not one_call(enqueue, stream, event, after, self.device):
                    return 0
            except self._enqueue_errors as exc:
                assert self._describe_error is not None
                raise self._describe_error(record, exc) from None
            order[_NEXT] = (order[_NEXT] + 1) % len(self._events)
            order[_LAST_STREAM], order[_LAST_EVENT] = stream, event
        return event

    def _enqueue(self, enqueue: Enqueue, stream: int, record: OpRecord) -> None:
        try:
            enqueue(stream)
        except self._enqueue_errors as exc:
            assert self._describe_error is not None
            raise self._describe_error(record, exc) from None

    def _captured(self, stream: int, enqueue: Enqueue, record: OpRecord,
                  entries: list[Entry]) -> int:
        """Record the operation into the CUDA graph being captured on `stream`: no event, no
        deadline (it runs each time the graph is launched); ordering is the graph's."""
        with self.lock:
            self._enqueue(enqueue, stream, record)
        for entry in entries:
            FlightRecorder.started(entry)
            FlightRecorder.ended(entry)
        return 0

    # ---- waiting -----------------------------------------------------------------------------
    def host_wait(self, event: int, record: OpRecord, deadline: float) -> None:
        """Block the host until `event` completed; TimeoutError at `deadline`, or the
        watchdog's error if it aborted the queue meanwhile."""
        if not gpu.wait_event(event, deadline, self.raise_if_failed):
            raise TimeoutError(f"rank {self.rank}: {record} is not complete on GPU "
                               f"{self.device} after {time.monotonic() - record.issued_at:.3g} s")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise the error that aborted the queue: itself the first time, then as
        CommunicatorClosedError. With the alarm word set, the health checks run first (the
        record they name is the oldest queued operation's)."""
        alarm = self._alarm
        if self.failure is None and alarm is not None and alarm[0][alarm[1]]:
            queued = self._queued
            problem = self.check_health(queued[0][_RECORD] if queued else
                                        OpRecord("(last operation)", 0))
            if problem is not None:
                self.abort(problem)
        failure = self.failure
        if failure is None:
            return
        if not self._reported:
            self._reported = True
            raise failure
        raise CommunicatorClosedError(
            f"{self.label}: the {self.what} was aborted on an earlier error: {failure}"
        ) from failure

    # ---- the watchdog ------------------------------------------------------------------------
    def _wake_watchdog(self) -> None:
        """Work arrived in an empty queue: start the watchdog (the first time) or wake it."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watchdog_loop, daemon=True,
                                              name=f"anyccl-gpu-watchdog-{self.label}")
            self._watchdog.start()
        self._wake.set()

    def _finished(self) -> int:
        """Retire the operations that completed; how many. They complete in issue order, so
        the boundary between done and not done is found in a few event queries (the newest
        first, then a bisection), not one per queued operation: this thread takes the GIL
        from the caller for as long as it queries."""
        with self._retiring:
            return self._retire()

    def _retire(self) -> int:
        """Pop the finished operations (the caller holds `_retiring`); how many. The compiled
        replay retires the same way (_cudacore.c: retire)."""
        queued = self._queued
        count = len(queued)  # items appended from here on are not looked at
        if not count:
            return 0
        if gpu.event_done(queued[count - 1][_EVENT]):
            done = count
        else:  # items [0, done) are finished, item `last` is not
            done, last = 0, count - 1
            while done < last:
                middle = (done + last) // 2
                if gpu.event_done(queued[middle][_EVENT]):
                    done = middle + 1
                else:
                    last = middle
        for _ in range(done):
            for entry in queued.popleft()[_ENTRIES]:
                FlightRecorder.ended(entry)
        return done

    def _watchdog_loop(self) -> None:
        gpu.set_device(self.device)
        gpu.relax_capture_mode()   # its event queries must not break the caller's graph capture
        last_health = 0.0
        while not self._closing:
            if not self._queued:
                self._wake.wait()
                self._wake.clear()
                continue
            time.sleep(_WATCH_POLL_S)
            retired = self._finished()
            head = self._queued[0] if self._queued else None
            record = head[_RECORD] if head is not None else OpRecord("(last operation)", 0)
            problem: BaseException | None = None
            now = time.monotonic()
            if head is not None and now >= head[_DEADLINE]:
                problem = TimeoutError(
                    f"rank {self.rank}: {record} did not finish on GPU {self.device} within "
                    f"{head[_DEADLINE] - record.issued_at:.3g} s (the anyccl timeout); the "
                    f"{self.what} was aborted")
            elif retired or now - last_health >= _HEALTH_POLL_S:
                # also as operations finish: one may have ended early on an error its
                # transport reports (an ipc kernel's status word)
                last_health = now
                problem = self.check_health(record)
            if problem is not None:
                self.abort(problem)
                return

    def check_health(self, record: OpRecord) -> BaseException | None:
        """The first problem a health check reports: a lost peer, then the backend's own."""
        lost = self._lost_peer()
        if lost is not None:
            return PeerLostError(f"rank {self.rank}: {lost[1]} while {record} was queued on GPU "
                                 f"{self.device}; the {self.what} was aborted", lost[0])
        for health in self._health:
            problem = health(record)
            if problem is not None:
                return problem
        return None

    def abort(self, problem: BaseException) -> None:
        """Record `problem`, run the abort actions (stuck kernels return), and fail every
        queued operation with it. Safe from any thread; the first problem wins."""
        if self.failure is None:
            self.failure = problem
        got = self.lock.acquire(timeout=1.0)  # a call stuck in the transport must not block us
        try:
            for stop in reversed(self._aborts):  # the last added (the innermost) first
                stop()
        finally:
            if got:
                self.lock.release()
        failed = list(self._queued)
        self._queued.clear()
        for item in failed:
            for entry in item[_ENTRIES]:
                FlightRecorder.ended(entry, self.failure)

    @property
    def pending(self) -> bool:
        """Whether operations are queued that the watchdog has not seen finish."""
        return bool(self._queued)

    # ---- lifetime ----------------------------------------------------------------------------
    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait (briefly) for queued work; whether it all finished without a failure."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and self._queued and time.monotonic() < deadline:
            if not self._finished():
                time.sleep(0.001)
        return self.failure is None and not self._queued

    def stop(self) -> None:
        """Stop the watchdog (idempotent): before the backend releases its transport, which the
        watchdog's health checks ask about (an NCCL communicator asked after it was destroyed
        raises in the watchdog's thread)."""
        self._closing = True
        self._wake.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=1.0)

    def close(self) -> None:
        """Stop the watchdog and free the stream and events (after `drain`, and after the
        backend released its transport)."""
        self.stop()
        for event in (self._start, *self._events):
            gpu.destroy_event(event)
        gpu.destroy_stream(self.stream)
