"""The interface every GPU backend implements (nccl, ipc, mpi's host staging).

The communicator checks every argument and hands a GPU backend `GpuArray`s on this rank's
device (lists already split into `size` equal pieces; one array's consecutive pieces as a
`buffers.Pieces`), ranks already checked; backends trust them. An operation is two steps:

1. a builder (`all_reduce`, `broadcast`, ...) returns the `Enqueue` function that issues the
   operation's GPU work on a stream, refusing what the backend cannot do (UnsupportedError)
   before any byte moves;
2. `run` queues that function after the work on the callers' streams and returns the event
   that marks its end, which the caller's stream, a `GpuWork` or the host wait for.

Every rank calls the builders and `run` for collectives in the same order. Failures (a
deadline passed, a peer died, the transport broke) are recorded in `failure` and raised by the
next call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from ..buffers import GpuArray
from ..ops import ReduceOp
from ..store import Store
from ..trace import Entry, OpRecord
from .gpu_queue import Enqueue, GpuQueue


class GpuBackend(ABC):
    """A way of moving GPU arrays among the `size` ranks of one communicator, one GPU each."""

    name: str
    rank: int
    size: int
    device: int
    failure: BaseException | None  # what broke the backend; raised by the next call

    # ---- builders: each returns the function that issues the operation on a stream --------------
    @abstractmethod
    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Enqueue: ...

    @abstractmethod
    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Enqueue: ...

    @abstractmethod
    def broadcast(self, x: GpuArray, root: int) -> Enqueue: ...

    @abstractmethod
    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Enqueue: ...

    @abstractmethod
    def gather(self, x: GpuArray, outs: list[GpuArray] | None, root: int) -> Enqueue: ...

    @abstractmethod
    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None, root: int) -> Enqueue: ...

    @abstractmethod
    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray], op: ReduceOp) -> Enqueue: ...

    @abstractmethod
    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Enqueue: ...

    @abstractmethod
    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Enqueue: ...

    @abstractmethod
    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Enqueue: ...

    @abstractmethod
    def group(self, calls: list[Enqueue]) -> Enqueue:
        """One function issuing `calls` (isend/irecv of a `comm.batch()`) so that a ring of
        them cannot deadlock."""

    # Whether `exchange` moves pieces of any size; the uneven collectives then move their
    # pieces through it as they are, else as an even collective on padded buffers.
    exchanges_any_sizes = False

    def exchange(self, sends: list[GpuArray | None],
                 recvs: list[GpuArray | None]) -> Enqueue:
        """Send sends[r] to and receive recvs[r] from every rank r at once, each piece of its
        own size (None or empty: nothing); this rank's own piece is a device copy. Only where
        `exchanges_any_sizes`."""
        raise NotImplementedError(f"the {self.name} backend moves pieces of one size only")

    # ---- queuing and waiting ---------------------------------------------------------------------
    @abstractmethod
    def run(self, record: OpRecord, after: Sequence[int], deadline: float, enqueue: Enqueue,
            keep: Any, entries: list[Entry], on: int | None = None) -> int:
        """Queue `enqueue` after the work on the streams of `after` (or right on stream `on`,
        for blocking calls) and return the event that marks its end; `keep` stays alive and
        the flight recorder's `entries` are updated until then."""

    def runner(self) -> Callable[..., int]:
        """`run` itself, for callers that queue the same operation many times (cached plans):
        the function `run` hands its calls to, where it only hands them on."""
        return self.run

    def replayer(self) -> GpuQueue | None:
        """The queue that `runner()` hands its calls to, which replays a blocking operation of
        one compiled call (a cached plan's, gpu.ONE_CALL) on a shorter way
        (`GpuQueue.replay_one`, or whole in compiled code: `_cudacore.replay`); None where
        there is none."""
        return None

    @abstractmethod
    def host_wait(self, event: int, record: OpRecord, deadline: float) -> None:
        """Block the host until `event`; TimeoutError at `deadline`, or the backend's error."""

    @abstractmethod
    def raise_if_failed(self) -> None:
        """Raise the error that broke the backend, if one did."""

    # ---- lifetime ----------------------------------------------------------------------------
    @abstractmethod
    def split(self, color: int | None, key: int, label: str, store: Store | None = None,
              group: str = "") -> GpuBackend | None:
        """Collective over this backend's ranks: the backend of the ranks passing `color`
        (ordered by `key`), None where color is None or where the child communicator serves
        its GPU arrays by its own means."""

    @abstractmethod
    def close(self) -> None:
        """Finish queued work (briefly), then release everything the backend holds."""


class QueuedGpuBackend(GpuBackend):
    """A GPU backend whose operations are ordered by a `GpuQueue` (stream-ordered transports:
    nccl, ipc); queuing, waiting and failures are the queue's."""

    queue: GpuQueue

    @property
    def failure(self) -> BaseException | None:  # type: ignore[override]
        return self.queue.failure

    @property
    def stream(self) -> int:
        """The queue's own stream (async operations run on it)."""
        return self.queue.stream

    def run(self, record: OpRecord, after: Sequence[int], deadline: float, enqueue: Enqueue,
            keep: Any, entries: list[Entry], on: int | None = None) -> int:
        return self.queue.run(record, after, deadline, enqueue, keep, entries, on)

    def runner(self) -> Callable[..., int]:
        return self.queue.run

    def replayer(self) -> GpuQueue | None:
        return self.queue

    def host_wait(self, event: int, record: OpRecord, deadline: float) -> None:
        self.queue.host_wait(event, record, deadline)

    def raise_if_failed(self) -> None:
        self.queue.raise_if_failed()

