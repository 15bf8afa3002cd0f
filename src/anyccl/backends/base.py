"""The interface every host transport implements: collectives, messages and lifecycle.

The communicator validates arguments and hands a backend flat, contiguous NumPy arrays of one
dtype, lists already split into equal pieces, and ranks already checked; backends trust them.
Collectives are blocking calls made in the same order on every rank. Each gets the operation's
record as its per-operation options (as Gloo's `AllreduceOptions`): `record.deadline`, the
monotonic time by which it must finish, and `record.agree`, its signature (agreement.py), which
the backend compares across ranks before any rank touches another's memory, raising
`CollectiveMismatchError` on every rank when they differ (a backend that cannot may leave that
to debug mode). A composite backend may call its parts several times with one record: the first
call of a record starts the operation, the others continue it.

Point-to-point messages are posted and then progressed, so that sends and receives issued in any
order can complete. When to progress them, and how to wait meanwhile, is the host engine's
(engine.py): it calls `progress()` and sleeps on the backend's `doorbell`, which a peer (or a
local thread) rings when there may be something to do.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Protocol, TypeVar

import numpy as np

from ..liveness import Liveness
from ..ops import ReduceOp
from ..trace import OpRecord
from .doorbell import PollingBell

Completion = Callable[[Optional[BaseException]], None]
_F = TypeVar("_F", bound=Callable[..., Any])


def per_operation(collective: _F) -> _F:
    """A collective of a backend that keeps its operation's state on itself (its `_record`):
    the first call with a record starts the operation (`self._enter(record)`); the method
    itself is written without the record, its last argument."""
    @functools.wraps(collective)
    def run(self: Any, *args: Any) -> Any:
        record = args[-1]
        if record is not self._record:
            self._enter(record)
        return collective(self, *args[:-1])
    return run  # type: ignore[return-value]


class Bell(Protocol):
    """What the host engine sleeps on (backends/doorbell.py has two kinds); a waiter polls
    without sleeping for `spin_s` first, yielding the core at every look if `yields` (more
    ranks than cores)."""

    spin_s: float
    yields: bool

    def ring(self) -> None: ...

    def drain(self) -> None: ...

    def sleep(self, timeout_s: float) -> None: ...


class Backend(ABC):
    """A way of moving bytes among the `size` ranks of one communicator."""

    name: str
    rank: int
    size: int
    # rung by a peer or a local thread when there may be something to progress
    doorbell: Bell

    # ---- collectives (the record: per-operation options, see the module's docstring) --------
    @abstractmethod
    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None: ...

    @abstractmethod
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp, record: OpRecord) -> None: ...

    @abstractmethod
    def broadcast(self, x: np.ndarray, root: int, record: OpRecord) -> None: ...

    @abstractmethod
    def all_gather(self, outs: list[np.ndarray], x: np.ndarray, record: OpRecord) -> None: ...

    @abstractmethod
    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int,
               record: OpRecord) -> None: ...

    @abstractmethod
    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int,
                record: OpRecord) -> None: ...

    @abstractmethod
    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp,
                       record: OpRecord) -> None: ...

    @abstractmethod
    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray],
                   record: OpRecord) -> None: ...

    @abstractmethod
    def barrier(self, record: OpRecord) -> None: ...

    # ---- messages ----------------------------------------------------------------------------
    @abstractmethod
    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        """Queue `x` for `dst`; `on_done` is called once it is sent, or failed (at
        `record.deadline` at the latest)."""

    @abstractmethod
    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  on_done: Completion, found: Callable[[int], None] | None = None) -> None:
        """Ask for the next message from `src` with `tag` into `x`; `on_done` once it landed
        (or failed, at `record.deadline` at the latest). src=None: from whichever rank's
        message with `tag` is matched first (the earliest posted receive that fits a message
        takes it, as in MPI); `found(sender)` is called before `on_done`."""

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
        """Advance posted messages as far as possible without blocking: complete those done,
        fail those past their deadline; raise PeerLostError where a peer left."""

    # ---- lifecycle ---------------------------------------------------------------------------
    @abstractmethod
    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        """A backend over `ranks` (this rank among them); collective over those ranks."""

    #: the collectives a hot path (`hot_context`) runs, by their index: the `kind` argument
    HOT_KINDS = ("all_reduce", "broadcast", "all_gather")

    def hot_context(self, engine: Any,
                    log: Callable[[Any], Any]) -> tuple[Callable, tuple] | None:
        """A compiled call and its context that run a blocking small all_reduce, broadcast or
        all_gather (into one array) on NumPy arrays whole, as the communicator, `engine` and
        this backend would: `call(context, comm, kind, x, arg)` (kind: an index of HOT_KINDS;
        arg: the op, the source rank, the output) returns x once done, None
        where it does not take the call (nothing done). None where this transport has none
        (shm and mpi: `_shmcore.hot`). `log` records each operation issued."""
        return None

    def exchange_context(self, engine: Any, log: Callable[[Any], Any],
                         seqs: Any) -> tuple[Callable, tuple] | None:
        """A compiled call and its context that run a blocking sendrecv of NumPy arrays whole,
        as the communicator, `engine` and this backend would: `call(context, comm, x, dst, y,
        src, tag)` returns src once done, None where it does not take the call (nothing done).
        None where this transport has none (shm and mpi: `_shmcore.exchange`). `log` records each
        operation issued; `seqs[(kind, dst, src)]` numbers them (MessageCalls.record)."""
        return None

    @property
    def liveness(self) -> Liveness:
        """Who of this communicator's ranks is gone (liveness.py): the transport adds its ways
        of telling when it is made; a composite one may share its own with a part."""
        try:
            return self._liveness
        except AttributeError:
            self._liveness: Liveness = Liveness()
            return self._liveness

    @liveness.setter
    def liveness(self, liveness: Liveness) -> None:
        self._liveness = liveness

    def lost_peer(self) -> tuple[int, str] | None:
        """The first peer found gone and what happened (`liveness`; called from other threads
        too, e.g. the GPU backend's watchdog). None when all seem alive."""
        return self.liveness.first()

    #: set by a composite engine (hierarchical.py) on the backend it made of one rank per host:
    #: a transport may then choose algorithms for the links between hosts
    between_hosts = False

    #: whether a communicator on this transport can go on without a lost rank (recovery.py):
    #: its sub-communicators are built through the store alone, never through the lost rank
    survives_peer_loss = True

    #: whether a communicator on this transport can grow by processes started later (grow.py):
    #: its transport is built through the store, not fixed at launch as MPI's world
    admits_newcomers = True

    def revoke(self) -> None:  # noqa: B027 - a transport may have no way to tell its peers
        """Tell the peers that this rank has left this communicator (it is recovering), so
        that an operation of theirs that waits on it fails now, as on a lost peer, instead of
        at its deadline; this rank's process stays alive (ULFM's revoke)."""

    def departed(self) -> dict[int, str]:
        """Every peer found gone: rank -> what happened, in the order found (`liveness`; what
        recovery asks; `lost_peer` names only the first)."""
        return self.liveness.gone()

    @abstractmethod
    def abort(self, error: BaseException) -> None:
        """Complete every posted message with `error` (a peer was lost: nothing will arrive)."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; peers still waiting on this rank learn that it left."""


class PolledMessages:
    """What a backend whose messages a library completes when polled (mpi, gloo) does alike
    with its list `_pending` of posted messages (each with an `on_done`). Sends are buffered:
    they complete at once, and a delivery that fails later (`_late`) is kept in `_late_error`
    for the backend's next operation to raise (`_raise_late`)."""

    _pending: list
    _late_error: BaseException | None
    doorbell: PollingBell   # the library progresses only when polled: the engine naps

    def _late(self, error: BaseException | None) -> None:
        if error is not None and self._late_error is None:
            self._late_error = error

    _record: OpRecord | None
    _enter: Callable[[OpRecord], None]   # the backend's own start of an operation

    def enter(self, record: OpRecord) -> None:
        """Start operation `record` now, as its first collective call would (`per_operation`):
        for a composite backend that drives this one's own steps (`start_agreement`,
        `all_reduce_start`) under its record."""
        if record is not self._record:
            self._enter(record)

    def _raise_late(self) -> None:
        if self._late_error is not None:
            error, self._late_error = self._late_error, None
            raise error

    def abort(self, error: BaseException) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.on_done(error)
