"""The `mpi` backend: host arrays over any MPI, through mpi4py (``pip install 'anyccl[mpi]'``).

Every operation is a non-blocking MPI call (Iallreduce, Ibcast, Isend, ...) completed by polling
its request, so the communicator's deadlines hold here too: an operation that does not finish in
time raises anyccl.TimeoutError naming the op (MPI itself would wait for ever).

Types: buffers travel as bytes where no reduction is involved, so every dtype moves. Reductions
use MPI's own types and operations where they mean the same as anyccl's (floats, integers,
complex sums and products; bool as logical and/or/xor), and otherwise (float16, bfloat16,
bitwise ops on bool, ...) a user-defined MPI operation running anyccl's NumPy kernels on a
contiguous type of the element's size. AVG is a SUM followed by one division.

The agreement: before a host collective moves data, its signature (agreement.py) is compared
across ranks by one all-reduce of an `Envelope` with anyccl's compiled MPI op, which marks any
difference on every rank. An all_reduce small enough to fit the envelope (64 bytes, of a dtype
and op the compiled core reduces) rides inside it: the same op reduces its data where the
signatures agree, so that call is one MPI all-reduce, not two. Where some rank cannot make the
envelope (no compiled core, the MPI library not found), every rank agrees by an all-reduce
(MAX) of the signature alone, as they decide together when the communicator is made.

Point-to-point: anyccl tags are carried in MPI tags as tag * 16 + dtype code, so a receive
only matches a message of its own dtype; a message with the right tag but another dtype or
size is reported (and discarded) instead of being reinterpreted.

Lost peers, as on shm: MPI itself never says that a rank left, so a rank that closes its
communicator (at exit too) says so in the job's store, and a rank waiting on an operation that
does not finish soon after raises PeerLostError naming it. An uncaught exception in a rank
prints its traceback and aborts the MPI job (as `python -m mpi4py` does): without that, MPI's
finalization would hold the failed rank, and the others would wait for it until the deadline.
A rank that lost a peer ends without MPI_Finalize, which would wait for the lost rank forever.

With ULFM (Open MPI 5 run with `mpiexec --with-ft ulfm`: MPI itself then reports a failed
process instead of ending the job), MPI's own word counts: an MPI call that failed because a
process died, or because a survivor revoked the communicator, raises PeerLostError naming the
failed ranks (`_ulfm_losses`); `revoke` is MPIX_Comm_revoke, its word in the communicator's
`liveness` MPIX_Comm_get_failed, and the survivors' communicator is made by MPIX_Comm_shrink,
or in a later round by MPI_Comm_create_from_group of the members (`subgroup`, `_shrunk`), so
that recovery.py shrinks a communicator of this backend, or of shm+mpi across hosts, as it
does shm's. Operations then take the Python path (the compiled steps' MPI calls report no
failed rank).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import functools
import os
import queue
import struct
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import agreement, settings, tuning
from .._console import say
from ..buffers import SUPPORTED_DTYPES, Pieces
from ..errors import (
    AnycclError,
    InvalidArgumentError,
    PeerLostError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
)
from ..ops import ReduceOp, accumulate, dtype_kind, finish
from ..ops import finish as finish_op
from ..store import Store
from ..trace import OpRecord, about_text, format_bytes, message_text
from .base import Backend, Completion, PolledMessages, per_operation
from .doorbell import PollingBell, cores_available
from .registry import HostContext

_DTYPE_CODE = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}
_BYTES = np.dtype(np.uint8)   # what a broadcast or all_gather in the envelope is reduced as
_CODES = 16  # > len(SUPPORTED_DTYPES): the low 4 bits of an MPI tag name the dtype
_INT_MAX = (1 << 31) - 1   # the largest count an MPI call takes
_SPIN_S = 0.02  # how long a wait spins on MPI_Test before it tests every 100 us (where this
# host's ranks outnumber its cores, each turn of the spin yields the core: os.sched_yield)
_DEPARTURE_CHECK_S = 0.25  # how often a waiting rank asks the store whether a peer left
# what _shmcore.mpi_ring runs on the ring thread (its `kind`), and the words errors use for it
_ALL_REDUCE, _REDUCE_SCATTER, _BROADCAST = 0, 1, 2
_RING_NAMES = {_ALL_REDUCE: "all_reduce ring", _REDUCE_SCATTER: "reduce_scatter ring",
               _BROADCAST: "broadcast chain"}
_DEPARTURE_GRACE_S = 2.0   # a peer that left may have done its part: wait this long first
# four int64 words: the signature alone (word, count, -word, -count: one MAX finds any
# difference), or an Envelope's head (word, count, code, status)
_WORDS = struct.Struct("=4q")
_QUICK_TESTS = 64   # MPI_Test calls before an agreement waits the way every operation waits


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        raise UnsupportedError("the mpi backend needs mpi4py and an MPI library: "
                               "pip install 'anyccl[mpi]'") from None
    return MPI


def library_version() -> str:
    """The MPI library in use, e.g. 'MPICH Version: 5.0.2'."""
    return " ".join(_mpi().Get_library_version().strip().splitlines()[0].split())


class Departures:
    """Which ranks of the job have closed anyccl, through the job's store: a counter, and one
    key per rank that left saying why.

    The store is asked by a thread of its own, and only while some wait has gone on for a
    while, never by the waiting loop itself: the store is served by rank 0's process, which
    stops answering while it sits in MPI_Finalize (a C call that keeps the GIL), and a wait
    must keep its deadline whatever the store does."""

    def __init__(self, store: Store, world_rank: int, world_size: int) -> None:
        self._store, self.world_rank, self.world_size = store, world_rank, world_size
        self._left: dict[int, tuple[int, str]] = {}  # rank -> (the rank it lost or -1, why)
        self.lost_world_rank = -1  # set once this process reported losing that rank
        self._wanted_until = 0.0
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        self._announced = False
        self._doing: str | None = None   # what this rank waits in, not yet told to the store

    def announce(self, why: str) -> None:
        """Tell every rank that this one is leaving (once; gives up after a second: at the end
        of a job rank 0 may already be in MPI_Finalize, and then nobody is waiting)."""
        if self._announced:
            return
        self._announced = True

        def tell() -> None:
            try:
                self._store.set(f"mpi/left/{self.world_rank}",
                                f"{self.lost_world_rank}\n{why}".encode())
                self._store.add("mpi/left", 1)
            except Exception:  # noqa: BLE001 - the store may be gone with rank 0 at exit
                pass
        teller = threading.Thread(target=tell, daemon=True, name="anyccl-mpi-leaving")
        teller.start()
        teller.join(timeout=1.0)

    def left(self, world_ranks: list[int]) -> tuple[int, str] | None:
        """(world rank, why) of the first of `world_ranks` known to have left, else None; asks
        the watcher to keep looking for the next second."""
        self._wanted_until = time.monotonic() + 1.0
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="anyccl-mpi-departures")
            self._watcher.start()
        self._wake.set()
        for r in world_ranks:
            if r in self._left:
                origin, seen = r, {r}   # name the rank whose loss made the others leave
                while self._left.get(origin, (-1, ""))[0] not in (-1, *seen):
                    origin = self._left[origin][0]
                    seen.add(origin)
                if origin != r and origin in self._left:
                    return origin, f"{self._left[origin][1]} (rank {r} left after losing it)"
                return r, self._left[r][1]
        return None

    def waiting_in(self, what: str) -> None:
        """Tell the other ranks (through the store, from the watcher thread: never blocking the
        wait) that this rank has been waiting a while in `what`, for their timeout messages."""
        self._doing = f"{time.time()}\n{what}"
        self.left([])   # wakes the watcher, which tells the store

    def peers_doing(self, world_ranks: list[int], timeout_s: float = 1.0) -> dict[int, str]:
        """What each of `world_ranks` last said it waits in, with how long ago (absent: it
        has said nothing); read by a helper thread given at most `timeout_s`."""
        found: dict[int, str] = {}

        def read() -> None:
            for r in world_ranks:
                try:
                    if self._store.check(f"mpi/doing/{r}"):
                        when, _, what = self._store.get(f"mpi/doing/{r}", 1.0).decode() \
                            .partition("\n")
                        found[r] = f"{what} (said {time.time() - float(when):.2g} s ago)"
                except Exception:  # noqa: BLE001 - a store that stopped answering
                    return
        reader = threading.Thread(target=read, daemon=True, name="anyccl-mpi-peers")
        reader.start()
        reader.join(timeout=timeout_s)
        return dict(found)

    def _watch(self) -> None:
        seen = 0
        while True:
            self._wake.wait()
            if time.monotonic() > self._wanted_until:
                self._wake.clear()
                continue
            try:
                doing, self._doing = self._doing, None
                if doing is not None:
                    self._store.set(f"mpi/doing/{self.world_rank}", doing.encode())
                count = self._store.add("mpi/left", 0)
                if count != seen:
                    seen = count
                    for r in range(self.world_size):
                        if r not in self._left and r != self.world_rank and \
                                self._store.check(f"mpi/left/{r}"):
                            lost, _, why = self._store.get(f"mpi/left/{r}", 1.0).decode() \
                                .partition("\n")
                            self._left[r] = (int(lost), why)
            except Exception:  # noqa: BLE001 - a store that stopped answering: rank 0 left
                return
            time.sleep(_DEPARTURE_CHECK_S)


class Envelope:
    """The agreement's all-reduce as one MPI call over one envelope of `nbytes`: int64 words
    (agreement word, count, code, status), then room for a small all_reduce's data, which so
    rides along with its agreement instead of following it. The op is anyccl's compiled
    `anyccl_envelope_op` (_shmcore.c), made an MPI op through the MPI library's own
    MPI_Op_create: where every rank's word, count and code are equal it reduces the data (code:
    the core's dtype * n_ops + op), else it sets the status, on every rank."""

    WORDS = 4

    def __init__(self, MPI: Any, op: Any, nbytes: int, n_ops: int) -> None:
        from .shm import CORE_REDUCTIONS

        self.op, self.nbytes, self.n_ops = op, nbytes, n_ops
        self.datatype = MPI.BYTE.Create_contiguous(nbytes).Commit()
        self.room = nbytes - 8 * self.WORDS   # the data's bytes at most
        self.codes = CORE_REDUCTIONS          # (dtype, op) -> the core's (dtype, op) codes


_envelope: list[Envelope | None] = []   # made once per process: MPI ops live until Finalize


def _libmpi() -> str | None:
    """The path of the MPI library this process loaded (mpi4py's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return None
    names = sorted(path for path in paths
                   if os.path.basename(path).startswith(("libmpi.so", "libmpi_abi.so")))
    return names[0] if names else None


def envelope(MPI: Any) -> Envelope | None:
    """This process's Envelope, or None where it cannot be made (no compiled core, an mpi4py
    without Op.fromhandle, no MPI library found to call): then the agreement is an all-reduce
    (MAX) of the signature alone."""
    if _envelope:
        return _envelope[0]
    made = None
    try:
        from . import _shmcore
        lib = _libmpi()
        if lib is not None and hasattr(MPI.Op, "fromhandle"):
            function = ctypes.cast(ctypes.CDLL(_shmcore.__file__).anyccl_envelope_op,
                                   ctypes.c_void_p)
            create = ctypes.CDLL(lib).MPI_Op_create
            create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            create.restype = ctypes.c_int
            size = MPI._sizeof(MPI.Op)
            handle = (ctypes.c_uint8 * max(8, size))()
            if create(function, 1, handle) == 0:
                op = MPI.Op.fromhandle(int.from_bytes(bytes(handle)[:size], sys.byteorder))
                made = Envelope(MPI, op, _shmcore.ENVELOPE_BYTES, _shmcore.N_OPS)
    except Exception:  # noqa: BLE001 - whatever stops it, the agreement works without it
        made = None
    _envelope.append(made)
    return made


_lost_a_peer: list[str] = []  # set once this process has raised PeerLostError
_ulfm_lost: list[bool] = []   # set once a process failed under ULFM, as seen from here


def _failed_here() -> None:
    """A process of the job failed under ULFM (MPI said so, or this rank shrinks): MPI_Finalize
    is watched at exit from now on (`_watch_finalize`)."""
    if not _ulfm_lost:
        _ulfm_lost.append(True)
        atexit.register(_watch_finalize)   # after mpi4py's: runs before its MPI_Finalize


def ulfm_enabled(MPI: Any) -> bool:
    """Whether MPI reports failed processes instead of ending the job (ULFM): Open MPI 5 with
    fault tolerance on (`mpiexec --with-ft ulfm` sets OMPI_MCA_mpi_ft_enable) and mpi4py's
    ULFM calls present."""
    on = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on")
    return on and hasattr(MPI.Comm, "Revoke") and hasattr(MPI.Intracomm, "Create_from_group") \
        and "Open MPI" in MPI.Get_library_version()


_MAKE_GRACE_S = 1.0   # under ULFM: see MpiBackend._bounded
_FINALIZE_S = 10.0   # under ULFM after a failure: how long MPI_Finalize may take at exit


def _watch_finalize() -> None:
    """At exit after a peer failed under ULFM (registered then): Open MPI 5.0.11's
    MPI_Finalize, which runs after this, never returns in about one job of eight then. The
    process then ends _FINALIZE_S later without it, saying so, from a thread of the compiled
    core: with status 1 if an exception went uncaught, else 0."""
    try:
        from . import _shmcore
    except ImportError:  # pragma: no cover - built without a C compiler: no watchdog
        return
    rank = _mpi().COMM_WORLD.Get_rank()
    _shmcore.exit_after(_FINALIZE_S, 1 if getattr(sys, "last_value", None) is not None else 0,
                        f"anyccl: rank {rank}: MPI_Finalize did not return within "
                        f"{_FINALIZE_S:g} s after a peer failed (ULFM); leaving without it\n"
                        .encode())


def _ulfm_losses(method: Callable) -> Callable:
    """Under ULFM, an MPI error that says a process failed, or that the communicator was
    revoked, becomes PeerLostError naming who failed (MPI's exception otherwise); so too in
    the function a `*_start` method returns to finish what it started."""
    @functools.wraps(method)
    def guarded(self: MpiBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            made = method(self, *args, **kwargs)
        except Exception as exc:
            self._raise_ulfm_loss(exc)
            raise
        if self._ulfm and callable(made):
            return _ulfm_losses(lambda _, *more: made(*more)).__get__(self)
        return made
    return guarded


def _exit_without_finalize() -> None:
    """At exit, after a peer was lost: MPI_Finalize would wait for it for ever, so leave
    without it (the MPI launcher then ends the job)."""
    if not _lost_a_peer:
        return
    say(f"anyccl: {_lost_a_peer[0]}: leaving without MPI_Finalize, which would wait for the "
        f"lost rank")
    sys.stdout.flush()
    time.sleep(0.5)  # the MPI launcher ends the job when we go: let peers finish their reports
    os._exit(1)


def abort_job_on_uncaught_exceptions() -> None:
    """Make an uncaught exception in this process print its traceback, then abort the MPI job,
    so that the other ranks stop instead of waiting for this one (python -m mpi4py does the
    same). Installed once, in front of whatever hook was there."""
    previous = sys.excepthook
    if getattr(previous, "anyccl_aborts", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt) or not _mpi().Is_initialized() or \
                _mpi().Is_finalized():
            return
        rank = _mpi().COMM_WORLD.Get_rank()
        say(f"anyccl: rank {rank} raised {kind.__name__} and did not catch it; aborting the "
            f"MPI job so that the other ranks do not wait for it")
        sys.stdout.flush()
        time.sleep(0.5)  # MPI_Abort tears the job down at once: let the launcher forward this
        _mpi().COMM_WORLD.Abort(1)

    hook.anyccl_aborts = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class _Pending:
    __slots__ = ("request", "on_done", "record", "deadline", "check", "keep", "tag", "source")

    def __init__(self, request: Any, on_done: Completion, record: OpRecord, deadline: float,
                 check: Callable[[Any], BaseException | None] | None, keep: Any) -> None:
        self.request, self.on_done, self.record = request, on_done, record
        self.deadline, self.check, self.keep = deadline, check, keep
        # a receive not yet posted to MPI (request None): the MPI tag it waits for, and its
        # source (None: any source, found by probing)
        self.tag, self.source = -1, None


class MpiBackend(PolledMessages, Backend):
    """One MPI communicator (a duplicate of the one given, so anyccl's traffic never meets the
    program's own MPI messages)."""

    name = "mpi"
    # MPI_COMM_WORLD is fixed at launch: a process started later is not in it
    admits_newcomers = False

    @property
    def survives_peer_loss(self) -> bool:  # type: ignore[override]
        """An MPI without ULFM ends the job, or leaves its communicators unusable, once a
        process dies: no sub-communicator can be built without the lost rank. With ULFM,
        `_shrunk` builds it."""
        return self._ulfm

    def __init__(self, comm: Any, timeout_s: float, departures: Departures | None = None,
                 world_ranks: list[int] | None = None) -> None:
        self.MPI = _mpi()
        self._ulfm = ulfm_enabled(self.MPI)
        self._comm = comm.Dup()
        if self._ulfm:   # failures come back as errors (mpi4py's exceptions), not an abort
            self._comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        self._ring_comm: Any = None
        try:
            self._start(timeout_s, departures, world_ranks)
        except BaseException:
            if self._ulfm:   # the other members may wait in a call of _start for this one
                for made in (self._comm, self._ring_comm):
                    if made is not None and not made.Is_revoked():
                        made.Revoke()
            raise

    def _start(self, timeout_s: float, departures: Departures | None,
               world_ranks: list[int] | None) -> None:
        """The rest of __init__: calls collective over the communicator's ranks among them."""
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._timeout_s = timeout_s
        self._departures = departures
        self._world_ranks = world_ranks if world_ranks is not None else list(range(self.size))
        self.liveness.add(self._failed_here_by_mpi)
        if departures is not None:
            self.liveness.add(self._said_they_left, _DEPARTURE_CHECK_S)
        self._lost_since: float | None = None
        self._lost: tuple[int, str] = (-1, "")
        self._announces_departure = False  # the world backend speaks for the whole process
        self._record: OpRecord | None = None
        self._told_for: OpRecord | None = None   # the message peers were told this rank waits in
        self._deadline = float("inf")
        self._pending: list[_Pending] = []
        self._late_error: BaseException | None = None  # of a buffered send, for the next call
        self._ops: dict[tuple[ReduceOp, np.dtype], tuple[Any, Any]] = {}
        self._types: list[Any] = []
        self._tag_limit = (int(self._comm.Get_attr(self.MPI.TAG_UB)) + 1) // _CODES
        self._next_source = 0   # where the next any-source receive starts probing
        # set by a composite backend that starts the agreement itself (start_agreement)
        self.defer_agreement = False
        self._spin_s, self._yields = _spinning(self._comm, self.MPI)
        self.doorbell = PollingBell(spin_s=self._spin_s, yields=self._yields)
        self._closed = False
        self._agrees = self.size > 1 and settings.MPI_AGREE.get()
        self._split_min = tuning.value("mpi.split_all_reduce_min")   # the tuning table
        self._chain_min = tuning.value("mpi.chain_broadcast_min")
        self._pair_ring_min = tuning.value("mpi.pair_ring_min")
        # between_hosts (Backend's): a broadcast and a reduce_scatter run as rings on the ring
        # thread, which keep every link busy where MPI's collectives of 3-4 ranks send the
        # data twice from one rank
        # the all_reduce ring's messages, apart from the program's own (any tag is theirs)
        self._ring_comm = self._comm.Dup() if self.size >= 2 else None
        self._rings = 0
        self._ring_thread: _RingThread | None | bool = None   # False: it cannot be made
        self._signature = array.array("q", bytes(32))      # this rank's, for _agree
        self._signature_max = array.array("q", bytes(32))  # every rank's, reduced
        self._envelope: Envelope | None = None
        self._env_request: Any = None
        self._step: Any = None   # the compiled step (hot_context), once made
        if self._agrees:
            self._make_envelope()

    def _make_envelope(self) -> None:
        """The agreement in an envelope (a small all_reduce's data inside it) where every rank
        can make one, all-reduced by a persistent request (MPI 4: its schedule is made once;
        0.85 us a call against 2.3 for an Iallreduce on 2 ranks of one machine) where every
        rank's MPI has them. All ranks must take the same form: they agree on it here, once."""
        MPI, made = self.MPI, envelope(self.MPI)
        can = np.array([made is not None, MPI.Get_version() >= (4, 0)
                        and hasattr(self._comm, "Allreduce_init")], np.int64)
        self._comm.Allreduce(MPI.IN_PLACE, can, op=MPI.MIN)
        if made is None or not can[0]:
            return
        self._envelope = made
        self._env_out = np.zeros(made.nbytes, np.uint8)
        self._env_in = np.zeros(made.nbytes, np.uint8)
        self._env_got = self._env_in[:8 * Envelope.WORDS].view(np.int64)
        self._env_out_bytes = memoryview(self._env_out)
        self._env_in_bytes = memoryview(self._env_in)
        self._env_args = ([self._env_out, 1, made.datatype], [self._env_in, 1, made.datatype],
                          made.op)
        if can[1]:
            self._env_request = self._comm.Allreduce_init(*self._env_args)

    def hot_context(self, engine: Any,
                    log: Callable[[OpRecord], Any]) -> tuple[Callable, tuple] | None:
        """`_shmcore.hot` with the envelope's step (`_shmcore.MpiStep`): a blocking all_reduce,
        broadcast or all_gather (into one array) of NumPy arrays that fits the envelope runs
        whole in one compiled call, from the communicator's checks to the record's end, its
        data riding in the agreement's all-reduce as `_carry` and `_carry_bytes` send it (the
        same request, the same envelope, the same words). None without the compiled core,
        the envelope's persistent request or the MPI library's own MPI_Start and MPI_Test to
        call."""
        step = self._compiled_step()
        if step is None or self._ulfm:
            return None
        from . import _shmcore
        env = self._envelope
        largest = max(step.data_max, env.room)   # x's bytes
        more = {"all_reduce": ", op={0.name}", "broadcast": ", src={}", "all_gather": ""}
        too_large = {"all_reduce": largest + 1, "broadcast": largest + 1,
                     "all_gather": (largest if step.data_max else env.room // self.size) + 1}
        kinds = tuple((name, agreement.NAME_BITS[name], 0, more[name], too_large[name])
                      for name in self.HOT_KINDS)
        sum_codes = {dtype: codes for (dtype, op), codes in env.codes.items()
                     if op is ReduceOp.SUM}
        reductions = {(dtype, op): (*(sum_codes[dtype] if op is ReduceOp.AVG else codes),
                                    op is ReduceOp.AVG, *self._data_call_handles(op, dtype))
                      for (dtype, op), codes in env.codes.items()}
        return _shmcore.hot, (engine, self, step, log, OpRecord, about_text, agreement.DTYPE_BITS,
                                reductions, np.ndarray, ReduceOp, float(engine.timeout_s),
                                largest, kinds, self._hot_rest, engine.failed)

    def exchange_context(self, engine: Any, log: Callable[[OpRecord], Any],
                         seqs: Any) -> tuple[Callable, tuple] | None:
        """`_shmcore.exchange` with this backend's compiled step: a blocking sendrecv of NumPy
        arrays, where nothing of this backend's is pending, posts both messages from one
        compiled call (MPI_Isend from a copy, MPI_Irecv) and tests them for the spin; a
        receive not there by then is taken back (MPI_Cancel) and posted the general way.
        None without the compiled step."""
        step = self._compiled_step()
        if step is None or step.data_max == 0 or self._ulfm:
            return None
        from . import _shmcore
        return _shmcore.exchange, (engine, self, log, OpRecord, message_text, seqs, _DTYPE_CODE,
                                   np.ndarray, engine.exchange_rest, engine.exchange_failed,
                                   "sendrecv", self.rank, self.size, step)

    def _exchange_outcome(self, record: OpRecord, y: np.ndarray, src: int, tag: int,
                          send: int | None, copy: bytearray, got: int | None) -> bool:
        """What the compiled sendrecv left: `send`, the handle of its send not done within the
        spin (handed over to the pending messages, as post_send's, delivered or reported
        later); `got`, the bytes of the message received (-1: longer than y; None: the
        receive not done). True when the receive is done; raises where its message had
        another size."""
        if send is not None:
            self._pending.append(_Pending(self.MPI.Request.fromhandle(send), self._late, record,
                                          record.deadline or time.monotonic() + self._timeout_s,
                                          None, copy))
        if got is None:
            return False
        if got != y.nbytes:
            raise self._size_mismatch(y, src, tag, got if got >= 0 else None, record)
        return True

    def _handle(self, obj: Any) -> int:
        """The MPI handle of mpi4py's `obj` as the unsigned integer the compiled calls pass."""
        return obj.handle % (1 << 8 * self.MPI._sizeof(type(obj)))

    def _data_call_handles(self, op: ReduceOp, dtype: np.dtype) -> tuple[int, ...]:
        """(MPI datatype, MPI op) handles of the all_reduce of `dtype` with `op` where the
        compiled step may call MPI with them (the MPI library's own datatype and op); () where
        not (anyccl's Python kernel: the Python path)."""
        mpi_type, mpi_op = self._reduction(op, dtype)
        if mpi_op in self._types:      # made from a Python function
            return ()
        return self._handle(mpi_type), self._handle(mpi_op)

    def _compiled_step(self) -> Any:
        """This backend's one compiled step (`_hot_step`), made at the first call; or None."""
        if self._step is None:
            self._step = self._hot_step()
        return self._step

    def _hot_step(self) -> Any:
        """The compiled envelope step over this backend's persistent request, or None."""
        request = self._env_request
        if request is None or self._envelope is None or self.size == 1 or not self._agrees:
            return None
        try:
            from . import _shmcore
            lib = _libmpi()
            if lib is None or not hasattr(_shmcore, "MpiStep"):
                return None
            mpi = ctypes.CDLL(lib)
            start, test, iallreduce, ibcast, iallgather = (
                ctypes.cast(getattr(mpi, name), ctypes.c_void_p).value
                for name in ("MPI_Start", "MPI_Test", "MPI_Iallreduce", "MPI_Ibcast",
                             "MPI_Iallgather"))
            width = self.MPI._sizeof(self.MPI.Request)
            handle = self._handle(request).to_bytes(width, sys.byteorder)
            hot_max = min(tuning.value("mpi.hot_max"), _INT_MAX)   # MPI's counts are ints
            calls = (iallreduce, ibcast, iallgather, self._handle(self._comm),
                     self._handle(self.MPI.BYTE), hot_max,
                     int(self.MPI.IN_PLACE) % (1 << 64)) if hot_max > 0 else None
            messages = (*(ctypes.cast(getattr(mpi, name), ctypes.c_void_p).value
                          for name in ("MPI_Isend", "MPI_Irecv", "MPI_Cancel", "MPI_Wait",
                                       "MPI_Test_cancelled", "MPI_Get_count")),
                        tuning.value("mpi.exchange_max"), self._tag_limit)
            if calls is None or _shmcore.MPI_TAG_CODES != _CODES:
                messages = None
            return _shmcore.MpiStep(start, test, handle, self._env_out, self._env_in,
                                    self.rank, self.size, int(self._spin_s * 1e9),
                                    self._yields, calls, messages)
        except Exception:  # noqa: BLE001 - whatever stops it, the Python path runs
            return None

    def _hot_rest(self, x: np.ndarray, record: OpRecord, arg: Any, status: int) -> None:
        """What the compiled step left of a hot collective (arg: an all_reduce's op, a
        broadcast's root, an all_gather's output): 0, the envelope started but not back within
        the spin (waited for here, then read, or the data call made here where the data did
        not ride in it); 4, the data call started but not done within the spin (completed
        here); 2, the signatures differed (every rank says what each called); 3, an MPI call
        failed."""
        if status == 3:
            raise AnycclError(f"rank {self.rank}: {record}: an MPI call failed in the compiled "
                              f"step (MPI_Start or MPI_Test of the agreement's envelope, or the "
                              f"collective's own call) (mpi backend)")
        op = arg if isinstance(arg, ReduceOp) else None
        if status == 4:
            request = self.MPI.Request.fromhandle(self._step.data_request())
            self._complete(request, f"the other ranks' {record.name}")
            if op is not None:
                finish_op(x, op, self.size)
            return
        if status == 0:
            self._complete(self._env_request, "the other ranks to reach the collective")
        if self._env_got[3]:
            self._disagree(record.agree)
        span = arg.nbytes if type(arg) is np.ndarray else x.nbytes
        if span > self._envelope.room:   # the signature alone rode: the data call now
            if op is not None:
                self._all_reduce_call(x, op)
            elif type(arg) is int:
                self._broadcast_call(x, arg)
            else:
                self._all_gather_call(arg, x)
            return
        head, got = 8 * Envelope.WORDS, self._env_in_bytes
        if type(arg) is np.ndarray:                 # all_gather: every piece, into out
            _byte_view(arg)[:] = got[head:head + arg.nbytes]
        elif type(arg) is not int or arg != self.rank:   # an all_reduce; a broadcast's taker
            _byte_view(x)[:] = got[head:head + x.nbytes]
            if type(arg) is not int:
                finish_op(x, arg, self.size)

    def _start_envelope(self) -> Any:
        """Start the all-reduce of the envelope as it is filled now; its request."""
        request = self._env_request
        if request is None:
            return self._comm.Iallreduce(*self._env_args)
        request.Start()
        return request

    @classmethod
    def world(cls, timeout_s: float, store: Store | None = None) -> MpiBackend:
        """The backend over MPI_COMM_WORLD; with the job's `store`, ranks that leave say so
        there and uncaught exceptions abort the job (see the module's docstring)."""
        world = _mpi().COMM_WORLD
        departures = Departures(store, world.Get_rank(), world.Get_size()) \
            if store is not None else None
        if departures is not None and threading.current_thread() is threading.main_thread():
            abort_job_on_uncaught_exceptions()
        backend = cls(world, timeout_s, departures)
        backend._announces_departure = departures is not None
        return backend

    def duplicate(self) -> MpiBackend:
        """Another backend over the same ranks, whose traffic never meets this one's."""
        return MpiBackend(self._comm, self._timeout_s, self._departures, self._world_ranks)

    @_ulfm_losses
    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        if self._ulfm and (self._comm.Is_revoked() or self._failed_ranks()):
            return self._shrunk(ranks, name, timeout_s)
        # collective over this communicator's ranks only when every rank calls it: the
        # communicator's split() calls subgroup on members only, so build the group directly
        def make() -> MpiBackend:
            return self._over(self._comm, ranks, ranks, len(name) % 32768, timeout_s)
        if not _ulfm_lost:   # (on a thread only once a process failed: see _bounded)
            return make()
        return self._bounded(make, timeout_s, f"building the communicator of ranks {ranks}",
                             ranks)

    def _bounded(self, make: Callable[[], Any], timeout_s: float, what: str,
                 members: list[int] | None = None) -> Any:
        """What `make()` returns (or raises), made on a thread of its own (under ULFM, once a
        process failed): Open MPI 5.0.11's calls that make a communicator
        (MPI_Comm_create_from_group, MPI_Comm_dup) may wait for ever for a member that died
        before or during them, even once another member revoked the communicator.
        PeerLostError once MPI reports one of `members` (ranks of this communicator) failed and
        the call still has not returned `_MAKE_GRACE_S` later (the member may have done its
        part: a rank that finished making a communicator may go on and die while another still
        makes it), TimeoutError past `timeout_s`; the thread is then left where it waits
        (recovery.py goes round again without the member that died)."""
        made: list[Any] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                made.append(make())
            except BaseException as exc:   # noqa: BLE001 - handed to the waiting thread
                failed.append(exc)
        making = threading.Thread(target=run, daemon=True, name="anyccl-mpi-make")
        making.start()
        deadline = time.monotonic() + timeout_s
        pause, seen = 0.001, None   # seen: when MPI first reported a member failed
        while making.is_alive() and time.monotonic() < deadline:
            making.join(pause)
            pause = min(2 * pause, 0.05)
            lost = sorted(set(self._failed_ranks()) & set(members or ()))
            if lost and seen is None:
                seen = time.monotonic()
            if lost and making.is_alive() and time.monotonic() - seen >= _MAKE_GRACE_S:
                raise PeerLostError(f"rank {self.rank}: {what}: rank(s) "
                                    f"{', '.join(map(str, lost))} failed during it (MPI's "
                                    f"ULFM; mpi backend)", lost[0])
        if failed:
            raise failed[0]
        if not made:
            raise TimeoutError(f"rank {self.rank}: {what} did not finish within "
                               f"{timeout_s:g} s: a member died during it (mpi backend, ULFM)")
        return made[0]

    def _over(self, comm: Any, mine: list[int], ranks: list[int], tag: int,
              timeout_s: float) -> MpiBackend:
        """The backend of `ranks` (this communicator's), made of MPI communicator `comm`'s
        ranks `mine` (`comm` itself where those are all of it and it is not this backend's
        own). Under ULFM a failure on the way revokes `comm` (and the group made of it):
        their other members may wait in the same call for a process that died, and then fail
        too instead of hanging (recovery goes round again)."""
        child = comm
        try:
            if comm is self._comm or len(mine) != comm.Get_size():
                group = comm.Get_group().Incl(mine)
                child = comm.Create_group(group, tag=tag)
                group.Free()
            backend = MpiBackend(child, timeout_s, self._departures,
                                 [self._world_ranks[r] for r in ranks])
        except BaseException:
            if self._ulfm:   # (left unfreed: a member may still wait in a call on them)
                for made in {id(c): c for c in (comm, child)}.values():
                    if made != self.MPI.COMM_NULL and not made.Is_revoked():
                        made.Revoke()
            raise
        if child is not self._comm:
            child.Free()
        if comm is not self._comm and comm is not child:
            comm.Free()
        return backend

    # ---- ULFM: MPI's own word on failed processes ---------------------------------------------
    def _failed_ranks(self) -> list[int]:
        """The ranks of this communicator MPI knows to have failed (ULFM), in order. MPI learns
        of a failure in its progress engine: a probe on COMM_SELF runs it first (a survivor
        shrinking waits in the store, not in MPI, and would not hear of a second failure)."""
        try:
            self.MPI.COMM_SELF.Iprobe(self.MPI.ANY_SOURCE, self.MPI.ANY_TAG)
        except self.MPI.Exception:  # noqa: S110 - progress only; what failed is asked next
            pass
        failed = self._comm.Get_failed()
        try:
            ranks = self.MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                                   self._comm.Get_group())
        finally:
            failed.Free()
        return sorted(r for r in ranks if r >= 0)

    def _raise_ulfm_loss(self, exc: BaseException) -> None:
        """Raise the PeerLostError MPI's `exc` stands for under ULFM (see `_ulfm_loss`)."""
        if self._ulfm and isinstance(exc, self.MPI.Exception):
            lost = self._ulfm_loss(exc)
            if lost is not None:
                raise lost from exc

    def _ulfm_loss(self, exc: Any) -> PeerLostError | None:
        """The PeerLostError for MPI's `exc` where it says a process failed or the communicator
        was revoked, or where MPI reports a failed process of this communicator (Open MPI
        5.0.11 also says MPI_ERR_OTHER of a collective that met one); None for any other MPI
        error."""
        MPI, kind = self.MPI, exc.Get_error_class()
        failed_kinds = (MPI.ERR_PROC_FAILED, getattr(MPI, "ERR_PROC_FAILED_PENDING", -1))
        failed = self._failed_ranks()
        if kind not in (*failed_kinds, MPI.ERR_REVOKED) and not failed:
            return None
        _failed_here()
        what = f"in {self._record}" if self._record is not None else "in an operation"
        if failed:
            many = len(failed) > 1
            whose = "their processes" if many else "its process"
            text = (f"rank{'s' if many else ''} {', '.join(map(str, failed))} failed while "
                    f"this rank was {what} (MPI's ULFM reports {whose} ended; mpi backend)")
        else:
            text = (f"the communicator was revoked while this rank was {what}: another rank "
                    f"lost a peer and is shrinking it (mpi backend)")
        return PeerLostError(f"rank {self.rank}: {text}", failed[0] if failed else -1)

    def revoke(self) -> None:
        if self._ulfm and not self._closed:
            _failed_here()   # (the loss may have been seen in the store or in shared memory)
            for comm in (self._comm, self._ring_comm):
                if comm is not None and not comm.Is_revoked():
                    comm.Revoke()

    def _failed_here_by_mpi(self) -> dict[int, str]:
        """A source for `liveness`: the ranks MPI knows to have failed (ULFM only)."""
        if not self._ulfm or self._closed:
            return {}
        return {r: f"rank {r} failed (MPI's ULFM: its process ended)"
                for r in self._failed_ranks()}

    def _said_they_left(self) -> dict[int, str]:
        """A source for `liveness`: the first rank that said in the job's store that it closed
        anyccl or exited (`Departures`)."""
        gone = self._departures.left(self._world_ranks)
        if gone is None:
            return {}
        world_rank, why = gone
        rank = self._world_ranks.index(world_rank)
        return {rank: f"rank {rank} {why}"}

    def _shrunk(self, ranks: list[int], name: str, timeout_s: float) -> MpiBackend:
        """The backend of `ranks` (agreed through the store by recovery.py) after a failure,
        within `timeout_s` (`_bounded`, which also gives up as soon as a member fails). The
        first round: MPIX_Comm_shrink over every surviving process, then the members' group of
        it where it holds more. A later round (a member died during the first): an MPI
        communicator of the members alone (MPI_Comm_create_from_group, MPI 4, tagged with the
        round's name), never a second shrink of this one, in which Open MPI 5.0.11 crashed;
        nor in the first, where the same call, made while the launcher across hosts still
        handled the death, waited for ever at times."""
        what = f"shrink: the communicator of ranks {ranks}"
        if name.rsplit(".shrink", 1)[-1] == "1":   # recovery.py names round n "<comm>.shrink<n>"
            def shrunk() -> tuple[Any, list[int]]:
                made = self._comm.Shrink()
                return made, self.MPI.Group.Translate_ranks(self._comm.Get_group(), ranks,
                                                            made.Get_group())
            start = time.monotonic()   # (MPIX_Comm_shrink survives a death during it)
            made, mine = self._bounded(shrunk, timeout_s, what)
            if any(r < 0 for r in mine):
                raise RendezvousError(f"rank {self.rank}: shrink: MPI counts rank(s) "
                                      f"{[r for r, m in zip(ranks, mine) if m < 0]} among "
                                      f"the failed, which the survivors did not (mpi backend)")
            timeout_s = max(0.001, timeout_s - (time.monotonic() - start))
        else:
            group = self._comm.Get_group().Incl(ranks)
            start = time.monotonic()
            made = self._bounded(lambda: self.MPI.Intracomm.Create_from_group(
                group, f"anyccl.{name}"), timeout_s, what, ranks)
            group.Free()
            mine = list(range(len(ranks)))
            timeout_s = max(0.001, timeout_s - (time.monotonic() - start))
        return self._bounded(lambda: self._over(made, mine, ranks, 0, timeout_s), timeout_s,
                             what, ranks)

    def _check_peers(self, record: OpRecord | None, waiting_for: str) -> None:
        """Raise PeerLostError if a peer left and what this rank waits for still has not
        finished a grace period later (the peer may have done its part before leaving)."""
        lost = self.lost_peer()
        if lost is None and self._lost_since is None:
            return
        now = time.monotonic()
        if lost is not None and self._lost_since is None:
            self._lost_since, self._lost = now, lost
            return
        if now - self._lost_since < _DEPARTURE_GRACE_S:
            return
        rank, what = self._lost
        self._lost_since = None
        if self._ulfm:   # MPI_Finalize works after a failure (watched: _failed_here)
            _failed_here()
        elif not _lost_a_peer:
            self._departures.lost_world_rank = self._world_ranks[rank]
            _lost_a_peer.append(f"rank {self._departures.world_rank} lost {what.split(' ')[0]} "
                                f"{what.split(' ')[1]}")
            atexit.register(_exit_without_finalize)  # after mpi4py's: runs before it
        raise PeerLostError(f"rank {self.rank}: {what} while this rank was in {record} "
                            f"waiting for {waiting_for} (mpi backend)", rank)

    # ---- waiting -----------------------------------------------------------------------------
    def _enter(self, record: OpRecord,
               carried: Callable[[tuple], bool] | None = None) -> bool:
        """Operation `record` starts (`per_operation`): its deadline, a failed delivery of an
        earlier send raised, and its signature compared across ranks. `carried(agree)`: the
        operation itself inside the agreement's envelope where it fits (`_carry`,
        `_carry_bytes`); True when it did (the operation is then done)."""
        self._record, self._deadline = record, record.deadline
        self._raise_late()
        if record.agree is not None and self._agrees and not self.defer_agreement:
            if carried is not None and carried(record.agree):
                return True
            self._agree(record.agree)
        return False

    def _carry(self, agree: tuple, x: np.ndarray, op: ReduceOp) -> bool:
        """The all_reduce of `x` inside its agreement's envelope, where the envelope holds it
        and the compiled core reduces its dtype and op: one MPI call for both. False, having
        done nothing, where it does not."""
        env = self._envelope
        if env is None or x.nbytes > env.room or not x.flags.c_contiguous:
            return False
        codes = env.codes.get((x.dtype, ReduceOp.SUM if op is ReduceOp.AVG else op))
        if codes is None:
            return False
        data = _byte_view(x)
        self._in_envelope(agree, agree[1], codes[0] * env.n_ops + codes[1], 0, data,
                          x.nbytes, ((0, data),))
        finish_op(x, op, self.size)
        return True

    def _bytes_carrier(self, span: int, x: np.ndarray, at: int | None,
                       pieces: Callable[[], tuple[tuple[int, np.ndarray], ...]]
                       ) -> Callable[[tuple], bool] | None:
        """A broadcast or all_gather inside its agreement's envelope (`_enter`'s `carried`),
        where its `span` bytes (the same on every rank) fit, else None: this rank's `x` at
        byte `at` (None: nothing), every other place zero, reduced by bitwise OR over bytes,
        so that each place holds the one rank's bytes put there; then `pieces()` (byte
        offset, array) are read out of it. One MPI call for the agreement and the data."""
        env = self._envelope
        if env is None or span > env.room:
            return None
        return lambda agree: self._carry_bytes(agree, span, x, at, pieces())

    def _carry_bytes(self, agree: tuple, span: int, x: np.ndarray, at: int | None,
                     pieces: tuple[tuple[int, np.ndarray], ...]) -> bool:
        """(`_bytes_carrier`'s call)"""
        env = self._envelope
        code = env.codes[_BYTES, ReduceOp.BOR]
        dense = tuple((start, piece, np.ascontiguousarray(piece)) for start, piece in pieces)
        data = _byte_view(np.ascontiguousarray(x)) if at is not None else None
        self._in_envelope(agree, span, code[0] * env.n_ops + code[1], at or 0, data, span,
                          tuple((start, _byte_view(copy)) for start, _, copy in dense))
        for _, piece, copy in dense:
            if copy is not piece:   # a strided output, read into a copy: written back
                np.copyto(piece, copy)
        return True

    def _in_envelope(self, agree: tuple, count: int, code: int, at: int, data: Any,
                     span: int, reads: tuple[tuple[int, Any], ...]) -> None:
        """One all-reduce of the envelope: the signature's word, `count` and the core's
        `code`; `data` (bytes, or None) at byte `at` of its data, the rest of its first
        `span` bytes zero where `data` does not fill them. Where every rank's words agree, each
        (offset, view) of `reads` takes its bytes of the reduced data; else every rank says
        what each called (CollectiveMismatchError)."""
        head = 8 * Envelope.WORDS
        _WORDS.pack_into(self._env_out, 0, agree[0], count, code, 0)
        if data is None or len(data) != span:
            self._env_out[head:head + span] = 0
        if data is not None:
            self._env_out_bytes[head + at:head + at + len(data)] = data
        self._complete(self._start_envelope(), "the other ranks to reach the collective")
        if self._env_got[3]:
            self._disagree(agree)
        got = self._env_in_bytes
        for start, view in reads:
            view[:] = got[head + start:head + start + len(view)]

    def _agree(self, agree: tuple) -> None:
        """The collective's signature (agreement.py) compared across ranks before it runs: one
        all-reduce (MAX) of (word, count, -word, -count) finds any difference; only then do
        the ranks gather every signature (and refusal reason) to say what differed."""
        self.start_agreement(agree)()

    @_ulfm_losses
    def start_agreement(self, agree: tuple) -> Callable[[], None]:
        """Start `_agree`'s all-reduce and return the function that finishes it (raising
        CollectiveMismatchError on every rank where signatures differ), so that a caller can
        do work of its own that touches no peer's data in between (hierarchical.py)."""
        word, count = agree[0], agree[1]
        env = self._envelope
        if env is not None:   # the signature alone in the envelope (code -1: no data)
            _WORDS.pack_into(self._env_out, 0, word, count, -1, 0)
            request = self._start_envelope()
        else:
            _WORDS.pack_into(self._signature, 0, word, count, -word, -count)
            request = self._comm.Iallreduce(self._signature, self._signature_max, self.MPI.MAX)

        def finish() -> None:
            for _ in range(0 if self._yields else _QUICK_TESTS):   # the common case: every
                if request.Test():                                 # rank is already there
                    break
            else:
                self._complete(request, "the other ranks to reach the collective")
            if env is not None:
                agreed = not self._env_got[3]
            else:
                top_word, top_count, low_word, low_count = _WORDS.unpack_from(
                    self._signature_max)
                agreed = top_word == -low_word and top_count == -low_count
            if not agreed:
                self._disagree(agree)
        return finish

    def _disagree(self, agree: tuple) -> None:
        """Signatures differ: every rank learns every signature and refusal, and raises."""
        everyone = self._comm.allgather((agree[0], agree[1], agree[2] if len(agree) > 2
                                         else ""))
        words = [(w, c) for w, c, _ in everyone]
        reasons = {r: why for r, (_, _, why) in enumerate(everyone) if why}
        raise agreement.mismatch(self.rank, self._record, words, reasons, self.name)

    @_ulfm_losses
    def all_reduce_start(self, x: np.ndarray, op: ReduceOp) -> Callable[[], None]:
        """Start an all_reduce of `x` and return the function that finishes it (x holds the
        result after), so that a caller can overlap it with work of its own. From
        `mpi.split_all_reduce_min` (on 2 ranks from `mpi.pair_ring_min`): a ring over
        point-to-point messages, each rank sending 2(n-1)/n of x, on the ring thread
        (`_on_ring_thread`) where it can run, else in this thread (`_Ring`, 3 ranks or more).
        MPICH's all_reduce, and its reduce-scatter and all-gather, of 3 ranks reached 37-47% of
        a 500 Mbit/s link at 1-16 MiB where the ring reached 95-100%
        (benchmarks/lab/mpi_column_ring.py)."""
        if x.nbytes >= self._split_min and (self.size > 2 or x.nbytes >= self._pair_ring_min):
            wait = self._on_ring_thread(x, _ALL_REDUCE, op)
            if wait is not None:
                def finish_ring() -> None:
                    wait()
                    finish_op(x, op, self.size)
                return finish_ring
        if self.size < 3 or x.nbytes < self._split_min:
            _, mpi_op = self._reduction(op, x.dtype)
            request = self._comm.Iallreduce(self.MPI.IN_PLACE, self._reduced(x, op), mpi_op)

            def finish() -> None:
                self._complete(request, "the other ranks' all_reduce")
                finish_op(x, op, self.size)
            return finish
        ring = _Ring(self, x, op)
        return ring.finish

    def _on_ring_thread(self, x: np.ndarray, kind: int, op: ReduceOp | None = None,
                        root: int = 0) -> Callable[[], None] | None:
        """Operation `kind` (_ALL_REDUCE, _REDUCE_SCATTER: x holds every rank's piece in rank
        order, and this rank's piece ends reduced by `op`'s base; _BROADCAST from `root`) on
        a ring of this communicator's ranks, run whole in compiled code (_shmcore.mpi_ring) on
        the backend's ring thread, without the GIL, so that it moves while this thread works
        (MPI moves data only inside its calls, and the hierarchical all_reduce reduces and
        gathers the next chunk inside the host meanwhile). Returns the function that waits for
        it, with the deadline and the peers' departures (AVG's division is the caller's). None
        where the thread cannot run it: a dtype or op the core does not reduce, x not
        contiguous, an MPI without MPI_THREAD_MULTIPLE or without its library's calls to hand,
        no compiled core."""
        from .shm import CORE_REDUCTIONS

        if kind == _BROADCAST:
            codes: tuple[int, int] | None = (0, 0)
        else:
            assert op is not None
            codes = CORE_REDUCTIONS.get((x.dtype, ReduceOp.SUM if op is ReduceOp.AVG else op))
        if codes is None or not x.flags.c_contiguous or x.nbytes == 0:
            return None
        if self._ring_thread is None:
            self._ring_thread = _RingThread.make(self) or False
        thread = self._ring_thread
        if thread is False:
            return None
        tag = self._rings % 32767        # MPI promises tags up to 32767
        self._rings += 1
        record, deadline = self._record, self._deadline
        data = x.reshape(-1) if kind != _BROADCAST else x.reshape(-1).view(np.uint8)
        job = thread.submit(data, codes, tag, deadline, kind, root)
        name = _RING_NAMES[kind]

        def wait() -> None:
            self._lost_since = None
            told = False
            while not job.done.wait(_DEPARTURE_CHECK_S):
                if not told:
                    told = self._tell_waiting(record, name)
                try:
                    self._check_peers(record, name)
                except BaseException:
                    thread.stop(job)
                    raise
            status, step, waiting = job.outcome()
            if status == 0:
                return
            n = self.size
            if kind == _BROADCAST:
                steps = -(-data.size // thread.segment)
                where = f"segment {step + 1} of {steps} of the {name}"
            else:
                steps = 2 * (n - 1) if kind == _ALL_REDUCE else n - 1
                where = f"step {step + 1} of {steps} of the {name}"
            peer = (self.rank - 1) % n if waiting == 0 else (self.rank + 1) % n
            what = (f"rank {peer}'s piece" if waiting == 0 else f"rank {peer} to take its piece") \
                + f" ({where})"
            if status == 1:
                waited = time.monotonic() - record.issued_at if record else self._timeout_s
                raise TimeoutError(f"rank {self.rank}: {record} timed out after {waited:.3g} s "
                                   f"waiting for {what} (mpi backend)" + self._what_peers_do())
            if status == 2:
                raise AnycclError(f"rank {self.rank}: {record}: the {name} was stopped "
                                  f"while waiting for {what}: an earlier ring of this "
                                  f"communicator failed, or it was closed (mpi backend)")
            raise PeerLostError(f"rank {self.rank}: {record}: MPI failed while waiting for "
                                f"{what} (mpi backend); rank {peer} may have died", peer)
        return wait

    def _complete(self, request: Any, what: str) -> None:
        """Poll `request` until done: MPI progresses only inside its calls, so spin on Test as
        MPI's blocking calls do (yielding the core at each turn where this host's ranks
        outnumber its cores), then, after the spin, test every 100 us; TimeoutError at the
        current operation's deadline."""
        self._lost_since = None
        if request.Test():
            return
        started = time.monotonic()
        told, yields = False, self._yields
        while not request.Test():
            now = time.monotonic()
            if now >= self._deadline:
                waited = now - self._record.issued_at if self._record else self._timeout_s
                raise TimeoutError(f"rank {self.rank}: {self._record} timed out after "
                                   f"{waited:.3g} s waiting for {what} (mpi backend)"
                                   + self._what_peers_do())
            if now - started > self._spin_s:
                if not told:
                    told = self._tell_waiting(self._record, what)
                self._check_peers(self._record, what)
                time.sleep(1e-4)
            elif yields:
                os.sched_yield()

    def _tell_waiting(self, record: OpRecord | None, what: str) -> bool:
        if self._departures is not None:
            self._departures.waiting_in(f"{record} waiting for {what}")
        return True

    def _what_peers_do(self) -> str:
        """'; rank 1 is in recv(...) ...' for every peer, as they told the store."""
        if self._departures is None:
            return ""
        mine = self._world_ranks[self.rank]
        others = [r for r in self._world_ranks if r != mine]
        said = self._departures.peers_doing(others)
        return "".join(f"; rank {self._world_ranks.index(r)} is in {said[r]}" if r in said
                       else f"; rank {self._world_ranks.index(r)} has not said it waits in "
                            f"anything (busy outside anyccl, stopped, or not yet waiting)"
                       for r in others)

    # ---- types and reductions ----------------------------------------------------------------
    def _bytes(self, x: np.ndarray) -> list[Any]:
        return [x.reshape(-1).view(np.uint8), self.MPI.BYTE]

    def _reduction(self, op: ReduceOp, dtype: np.dtype) -> tuple[Any, Any]:
        """(MPI datatype, MPI op) computing anyccl's `op` on `dtype` (AVG as SUM)."""
        key = (op, dtype)
        if key in self._ops:
            return self._ops[key]
        MPI = self.MPI
        kind = dtype_kind(dtype)
        base = ReduceOp.SUM if op is ReduceOp.AVG else op
        builtin = None
        if kind == "b":
            builtin = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.BOR: MPI.LOR,
                       ReduceOp.PROD: MPI.LAND, ReduceOp.MIN: MPI.LAND, ReduceOp.BAND: MPI.LAND,
                       ReduceOp.BXOR: MPI.LXOR}[base]
            mpi_type = MPI.C_BOOL
        else:
            mpi_type = _native_type(MPI, dtype)
            if mpi_type is not None and not (kind == "c" and base not in (ReduceOp.SUM,
                                                                          ReduceOp.PROD)):
                builtin = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                           ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                           ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
                           ReduceOp.BXOR: MPI.BXOR}[base]
        if builtin is None:  # anyccl's own kernel on elements of dtype.itemsize bytes
            mpi_type = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
            self._types.append(mpi_type)

            def kernel(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
                mine = np.frombuffer(inbuf, dtype)
                theirs = np.frombuffer(inoutbuf, dtype)
                accumulate(theirs, mine, base)

            builtin = MPI.Op.Create(kernel, commute=True)
            self._types.append(builtin)
        self._ops[key] = (mpi_type, builtin)
        return mpi_type, builtin

    def _reduced(self, x: np.ndarray, op: ReduceOp, count: int | None = None) -> list[Any]:
        """The MPI buffer of `x` for reducing with `op`: `count` elements (default all)."""
        mpi_type, _ = self._reduction(op, x.dtype)
        view = x.view(np.uint8) if x.dtype.kind == "V" else x
        return [view, x.size if count is None else count, mpi_type]

    # ---- collectives -------------------------------------------------------------------------
    @_ulfm_losses
    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None:
        """(per_operation's start, with x carried in the agreement where it fits)"""
        if record is not self._record and self._enter(
                record, lambda agree: self._carry(agree, x, op)):
            return
        self._all_reduce_call(x, op)

    def _all_reduce_call(self, x: np.ndarray, op: ReduceOp) -> None:
        """The all_reduce's own MPI call, once the ranks agreed."""
        _, mpi_op = self._reduction(op, x.dtype)
        self._complete(self._comm.Iallreduce(self.MPI.IN_PLACE, self._reduced(x, op), mpi_op),
                       "the other ranks' all_reduce")
        finish(x, op, self.size)

    @_ulfm_losses
    @per_operation
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp) -> None:
        _, mpi_op = self._reduction(op, x.dtype)
        if self.rank == root:
            request = self._comm.Ireduce(self.MPI.IN_PLACE, self._reduced(x, op), mpi_op, root)
        else:
            request = self._comm.Ireduce(self._reduced(x, op), None, mpi_op, root)
        self._complete(request, "the other ranks' reduce")
        if self.rank == root:
            finish(x, op, self.size)

    @_ulfm_losses
    def broadcast(self, x: np.ndarray, root: int, record: OpRecord) -> None:
        """(per_operation's start, with x carried in the agreement where it fits)"""
        if record is not self._record and self._enter(record, self._bytes_carrier(
                x.nbytes, x, 0 if self.rank == root else None,
                lambda: () if self.rank == root else ((0, x),))):
            return
        self._broadcast_call(x, root)

    def _broadcast_call(self, x: np.ndarray, root: int) -> None:
        """The broadcast's own MPI call, once the ranks agreed; between hosts, on 3 ranks or
        more from `mpi.chain_broadcast_min`, a chain in segments (`_on_ring_thread`)."""
        if self.between_hosts and self.size >= 3 and x.nbytes >= self._chain_min:
            wait = self._on_ring_thread(x, _BROADCAST, root=root)
            if wait is not None:
                wait()
                return
        self._complete(self._comm.Ibcast(self._bytes(x), root), f"rank {root}'s broadcast")

    @_ulfm_losses
    def all_gather(self, outs: list[np.ndarray], x: np.ndarray, record: OpRecord) -> None:
        """(per_operation's start, with every piece carried in the agreement where they fit)"""
        if record is not self._record and self._enter(record, self._bytes_carrier(
                self.size * x.nbytes, x, self.rank * x.nbytes,
                lambda: tuple((q * x.nbytes, out) for q, out in enumerate(outs)
                              if q != self.rank or not np.may_share_memory(out, x)))):
            return
        self._all_gather_call(outs, x)

    def _all_gather_call(self, outs: list[np.ndarray] | np.ndarray, x: np.ndarray) -> None:
        """The all_gather's own MPI call, once the ranks agreed (outs: one array per rank, or
        one array holding every rank's piece in order)."""
        if isinstance(outs, np.ndarray):
            outs = list(outs.reshape(self.size, -1))
        whole, scatter_back = _joined(outs)
        if x.size and np.may_share_memory(outs[self.rank], x):
            if scatter_back is not None:
                whole[self.rank * x.size:(self.rank + 1) * x.size] = x
            request = self._comm.Iallgather(self.MPI.IN_PLACE, self._bytes(whole))
        else:
            request = self._comm.Iallgather(self._bytes(x), self._bytes(whole))
        self._complete(request, "the other ranks' all_gather")
        if scatter_back is not None:
            scatter_back()

    @_ulfm_losses
    @per_operation
    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int) -> None:
        if self.rank != root:
            self._complete(self._comm.Igather(self._bytes(x), None, root), "gather at the root")
            return
        assert outs is not None
        whole, scatter_back = _joined(outs)
        self._complete(self._comm.Igather(self._bytes(np.ascontiguousarray(x)),
                                          self._bytes(whole), root), "the other ranks' gather")
        if scatter_back is not None:
            scatter_back()

    @_ulfm_losses
    @per_operation
    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int) -> None:
        if self.rank != root:
            self._complete(self._comm.Iscatter(None, self._bytes(out), root),
                           f"rank {root}'s scatter")
            return
        assert chunks is not None
        whole = np.concatenate([c.reshape(-1).view(np.uint8) for c in chunks])
        self._complete(self._comm.Iscatter([whole, self.MPI.BYTE], self._bytes(out), root),
                       "the other ranks' scatter")

    @_ulfm_losses
    @per_operation
    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> None:
        """Between hosts, on 3 ranks or more from `mpi.split_all_reduce_min` of all inputs: the
        reduce-scatter steps of the all_reduce ring (`_on_ring_thread`); else MPI's call."""
        whole = np.concatenate([i.reshape(-1) for i in inputs])  # a copy: MPI's buffers
        # must not overlap, and the ring reduces in it
        if self.between_hosts and self.size >= 3 and out.nbytes * self.size >= self._split_min:
            wait = self._on_ring_thread(whole, _REDUCE_SCATTER, op)
            if wait is not None:
                wait()
                out[...] = whole[self.rank * out.size:(self.rank + 1) * out.size] \
                    .reshape(out.shape)
                finish(out, op, self.size)
                return
        _, mpi_op = self._reduction(op, out.dtype)
        self._complete(self._comm.Ireduce_scatter_block(self._reduced(whole, op, out.size),
                                                        self._reduced(out, op), mpi_op),
                       "the other ranks' reduce_scatter")
        finish(out, op, self.size)

    @_ulfm_losses
    @per_operation
    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray]) -> None:
        send = np.concatenate([i.reshape(-1).view(np.uint8) for i in inputs])  # a copy
        whole, scatter_back = _joined(outs)
        self._complete(self._comm.Ialltoall([send, self.MPI.BYTE], self._bytes(whole)),
                       "the other ranks' all_to_all")
        if scatter_back is not None:
            scatter_back()

    @_ulfm_losses
    @per_operation
    def barrier(self) -> None:
        self._complete(self._comm.Ibarrier(), "the other ranks to reach the barrier")

    # ---- point to point ----------------------------------------------------------------------
    def _mpi_tag(self, tag: int, dtype: np.dtype, record: OpRecord) -> int:
        if tag >= self._tag_limit:
            raise UnsupportedError(f"rank {self.rank}: {record}: tag={tag} is beyond what this "
                                   f"MPI can carry on the mpi backend (tags < {self._tag_limit})")
        return tag * _CODES + _DTYPE_CODE[dtype]

    @_ulfm_losses
    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        deadline = record.deadline
        # Buffered, as the shm backend's ring is: the message leaves from a copy, so the send
        # completes now and a large message cannot wait on a receive the peer posts later (MPI's
        # rendezvous would make "send 0, send 1 / recv 1, recv 0" deadlock). A failure of the
        # copy's delivery is raised by this communicator's next call.
        copy = x.reshape(-1).view(np.uint8).copy()
        request = self._comm.Isend([copy, self.MPI.BYTE], dst,
                                   self._mpi_tag(tag, x.dtype, record))
        self._pending.append(_Pending(request, self._late, record, deadline, None, copy))
        on_done(None)

    @_ulfm_losses
    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  on_done: Completion, found: Callable[[int], None] | None = None) -> None:
        deadline = record.deadline
        mpi_tag = self._mpi_tag(tag, x.dtype, record)
        if src is not None:
            self._check_mismatch(x, src, tag, mpi_tag, record)

        def check(st: Any) -> BaseException | None:
            sender = st.Get_source()
            if found is not None:
                found(sender)
            got = st.Get_count(self.MPI.BYTE)
            if got != x.nbytes:
                return self._size_mismatch(x, sender, tag, got, record)
            return None

        # From any source: found by probing each peer in turn, then received from that one. An
        # MPI_ANY_SOURCE receive was seen to miss a message for ever (MPICH 5.0, ranks on two
        # hosts: shared memory and network both in play). A receive posted after an any-source
        # one of the same tag waits until that one is matched, as MPI's matching order says.
        waits = src is None or any(p.request is None and p.tag == mpi_tag
                                   for p in self._pending)
        request = None if waits else self._comm.Irecv(self._bytes(x), src, mpi_tag)
        self._pending.append(_Pending(request, on_done, record, deadline, check, x))
        if waits:
            self._pending[-1].tag, self._pending[-1].source = mpi_tag, src

    def _post(self, p: _Pending) -> bool:
        """Post a receive from a named source that waited for an earlier any-source one."""
        p.request = self._comm.Irecv(self._bytes(p.keep), p.source, p.tag)
        return True

    def _probe_any(self, p: _Pending) -> bool:
        """Start the receive of an any-source message once a peer's message with its tag is
        there (the first peer found, starting after the last one served)."""
        status = self.MPI.Status()
        for step in range(self.size):
            peer = (self._next_source + step) % self.size
            if self._comm.Iprobe(peer, p.tag, status):
                self._next_source = (peer + 1) % self.size
                p.request = self._comm.Irecv(self._bytes(p.keep), peer, p.tag)
                return True
        return False

    def _size_mismatch(self, x: np.ndarray, src: int, tag: int, got: int | None,
                       record: OpRecord) -> InvalidArgumentError:
        theirs = (f"{x.dtype.name} x {got // x.dtype.itemsize} ({format_bytes(got)})"
                  if got is not None else f"more than {format_bytes(x.nbytes)}")
        return InvalidArgumentError(
            f"rank {self.rank}: {record}: rank {src} sent {theirs} with tag {tag}, but the "
            f"receiving array is {x.dtype.name} x {x.size} ({format_bytes(x.nbytes)})")

    def _check_mismatch(self, x: np.ndarray, src: int, tag: int, mpi_tag: int,
                        record: OpRecord) -> None:
        """The next message from `src` carries this tag but another dtype: report and discard
        it rather than let the receive wait for ever or reinterpret bytes."""
        status = self.MPI.Status()
        if not self._comm.Iprobe(src, self.MPI.ANY_TAG, status):
            return
        other = status.Get_tag()
        if other == mpi_tag or other // _CODES != tag:
            return
        nbytes, sender = status.Get_count(self.MPI.BYTE), status.Get_source()
        self._comm.Recv([np.empty(nbytes, np.uint8), self.MPI.BYTE], sender, other)
        theirs = SUPPORTED_DTYPES[other % _CODES]
        raise InvalidArgumentError(
            f"rank {self.rank}: {record}: rank {sender} sent {theirs.name} x "
            f"{nbytes // theirs.itemsize} ({format_bytes(nbytes)}) with tag {tag}, but the "
            f"receiving array is {x.dtype.name} x {x.size}; the message was discarded")

    @_ulfm_losses
    def progress(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        still = []
        waiting_tags: set[int] = set()   # tags of any-source receives not yet matched
        for p in self._pending:
            status = self.MPI.Status()
            if p.request is None and (p.tag in waiting_tags or (
                    not self._probe_any(p) if p.source is None else not self._post(p))):
                if p.source is None:
                    waiting_tags.add(p.tag)
                if now >= p.deadline:
                    p.on_done(self._expired(p, now))
                else:
                    still.append(p)
                continue
            try:
                done = p.request.Test(status)
            except self.MPI.Exception as exc:  # a message longer than the receiving array
                if exc.Get_error_class() != self.MPI.ERR_TRUNCATE or p.check is None:
                    raise
                p.on_done(self._size_mismatch(p.keep, status.Get_source(),
                                              status.Get_tag() // _CODES, None, p.record))
                continue
            if done:
                p.on_done(p.check(status) if p.check is not None else None)
            elif now >= p.deadline:
                p.on_done(self._expired(p, now))
            else:
                still.append(p)
        self._pending = still
        if still:  # messages from (or to) a rank that left will never complete
            self._check_peers(still[0].record, "its peer")
            self._say_what_waits(still, now)

    def _say_what_waits(self, still: list[_Pending], now: float) -> None:
        """Once a message this rank waits for (not a buffered send's delivery) has waited past
        the spin, tell the peers which (what their timeouts then say this rank is in)."""
        waiting = next((p for p in still if p.on_done != self._late), None)
        if waiting is None or waiting.record is self._told_for:
            return
        record = waiting.record
        if now - (record.started_at or record.issued_at) > self._spin_s:
            self._tell_waiting(record, "its peer")
            self._told_for = record

    def _expired(self, p: _Pending, now: float) -> TimeoutError:
        return TimeoutError(f"rank {self.rank}: {p.record} timed out after "
                            f"{now - p.record.issued_at:.3g} s waiting for its peer (mpi "
                            f"backend)" + self._what_peers_do())

    # ---- lifetime ----------------------------------------------------------------------------
    def _finish_sends(self) -> None:
        """Before closing (also at exit): deliver the sends still in flight. A send returned
        once its data was copied aside, but the receiver still reads that copy from this
        process, so leaving now would lose it. Each waits until its own deadline; one that
        passes it, or a lost peer, is reported on stderr, naming the messages not delivered."""
        sends = [p for p in self._pending if p.on_done == self._late]
        if not sends:
            return
        failure: BaseException | None = None
        end = max(p.deadline for p in sends)
        self._lost_since = None
        try:
            while any(p.on_done == self._late for p in self._pending):
                self.progress()
                if time.monotonic() >= end + 1.0:
                    break
                time.sleep(1e-4)
        except Exception as exc:  # noqa: BLE001 - a lost peer: what is left is undeliverable
            failure = exc
        failure = failure or self._late_error
        left = [p.record for p in self._pending if p.on_done == self._late]
        if failure is not None or left:
            what = "; ".join(map(str, left)) or str(failure)
            say(f"anyccl: rank {self.rank} closed with sends not delivered: {what}"
                + (f" ({failure})" if failure is not None and left else ""))

    def close(self) -> None:
        if self._closed:
            return
        self._finish_sends()
        self._closed = True
        if self._announces_departure:
            self._departures.announce("closed its communicator or exited")
        if isinstance(self._ring_thread, _RingThread):
            self._ring_thread.close()
        for obj in self._types + ([self._env_request] if self._env_request is not None else []):
            try:
                obj.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalised at exit
                pass
        try:
            if not self.MPI.Is_finalized():
                self._comm.Free()
                if self._ring_comm is not None:
                    self._ring_comm.Free()
        except Exception:  # noqa: BLE001
            pass


class _RingJob:
    """One operation handed to the ring thread: its kind (_ALL_REDUCE, _REDUCE_SCATTER,
    _BROADCAST), array, (dtype, op) codes, tag, deadline and root; `stop`, set to end it early;
    `done`, set once the thread has finished it."""

    __slots__ = ("x", "codes", "tag", "deadline", "kind", "root", "stop", "done", "result")

    def __init__(self, x: np.ndarray, codes: tuple[int, int], tag: int, deadline: float,
                 kind: int, root: int) -> None:
        self.x, self.codes, self.tag, self.deadline = x, codes, tag, deadline
        self.kind, self.root = kind, root
        self.stop = np.zeros(1, np.int64)
        self.done = threading.Event()
        self.result: Any = None

    def outcome(self) -> tuple[int, int, int]:
        """(status, step, waiting) as _shmcore.mpi_ring returns it; raises what the thread
        raised."""
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


class _RingThread:
    """A backend's thread for rings between hosts (`_shmcore.mpi_ring`: all_reduce,
    reduce_scatter, and the broadcast chain in segments of `mpi.chain_segment`): it takes them
    in the order given and runs each whole in compiled code without the GIL, so that the rings
    move while the thread that gave them reduces and gathers inside its host. Made only where
    MPI runs with MPI_THREAD_MULTIPLE (mpi4py's default), since the giving thread may call MPI
    meanwhile."""

    def __init__(self, backend: MpiBackend, calls: tuple[int, ...]) -> None:
        self._calls, self._rank, self._size = calls, backend.rank, backend.size
        self.segment = min(tuning.value("mpi.chain_segment"), _INT_MAX)
        self._spin_ns = 0 if backend._yields else int(min(backend._spin_s, 2e-4) * 1e9)
        self._jobs: queue.SimpleQueue[_RingJob | None] = queue.SimpleQueue()
        self._open: list[_RingJob] = []
        self._scratch = np.empty(0, np.uint8)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="anyccl-mpi-ring")
        self._thread.start()

    @classmethod
    def make(cls, backend: MpiBackend) -> _RingThread | None:
        """The thread, or None where it cannot run rings (see the class)."""
        MPI = backend.MPI
        try:
            from . import _shmcore
            lib = _libmpi()
            if (lib is None or not hasattr(_shmcore, "mpi_ring")
                    or MPI.Query_thread() < MPI.THREAD_MULTIPLE
                    or backend._ring_comm is None):
                return None
            mpi = ctypes.CDLL(lib)
            calls = tuple(ctypes.cast(getattr(mpi, name), ctypes.c_void_p).value
                          for name in ("MPI_Isend", "MPI_Irecv", "MPI_Test", "MPI_Cancel"))
            calls += (backend._handle(backend._ring_comm), backend._handle(MPI.BYTE))
        except Exception:  # noqa: BLE001 - whatever stops it, the rings run on this thread
            return None
        return cls(backend, calls)

    def submit(self, x: np.ndarray, codes: tuple[int, int], tag: int, deadline: float,
               kind: int = _ALL_REDUCE, root: int = 0) -> _RingJob:
        job = _RingJob(x, codes, tag, deadline, kind, root)
        self._open = [j for j in self._open if not j.done.is_set()] + [job]
        self._jobs.put(job)
        return job

    def _serve(self) -> None:
        from . import _shmcore

        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.stop[0]:
                job.result = (2, 0, 0)
                job.done.set()
                continue
            try:
                need = 0 if job.kind == _BROADCAST else -(-job.x.size // self._size) \
                    * job.x.itemsize
                if self._scratch.nbytes < need:
                    self._scratch = np.empty(need, np.uint8)
                deadline_ns = int(job.deadline * 1e9) if job.deadline < 9e9 else (1 << 63) - 1
                job.result = _shmcore.mpi_ring(self._calls, job.x, job.codes[0], job.codes[1],
                                               self._rank, self._size, job.tag, self._spin_ns,
                                               deadline_ns, job.stop, self._scratch, job.kind,
                                               job.root, self.segment)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.result = exc
            job.done.set()

    def stop(self, job: _RingJob) -> None:
        """End `job` and every ring given after it (they belong to the same operation, or to
        later ones that would wait on it), waiting for the thread to leave MPI for at most
        1 s."""
        later = self._open[self._open.index(job):] if job in self._open else [job]
        for j in later:
            j.stop[0] = 1
        job.done.wait(1.0)

    def close(self) -> None:
        """Stop every ring not done and end the thread (waiting for it at most 1 s)."""
        for job in self._open:
            job.stop[0] = 1
        self._jobs.put(None)
        self._thread.join(1.0)


class _Ring:
    """One all_reduce of `x` on a ring of the backend's ranks, over point-to-point messages:
    n - 1 steps in which each rank sends a piece to the next rank and adds the piece that
    arrives from the previous one (after them rank r holds piece r + 1 reduced), then n - 1
    steps passing the reduced pieces on. Each rank sends 2(n-1)/n of x; every rank ends with
    the same bits (each piece is reduced once, by one chain of additions, then copied).

    The first step's messages are posted when the ring is made; `finish` runs the rest. Its
    messages travel on a communicator of their own, under a tag of this call, so that no
    message of the program's, nor of another ring still in flight, can match them."""

    def __init__(self, backend: MpiBackend, x: np.ndarray, op: ReduceOp) -> None:
        self.b, self.x, self.op = backend, x, op
        self.base = ReduceOp.SUM if op is ReduceOp.AVG else op
        n, r = backend.size, backend.rank
        self.flat = x.reshape(-1)
        self.bounds = [i * x.size // n for i in range(n + 1)]
        self.right, self.left = (r + 1) % n, (r - 1) % n
        self.tag = backend._rings % 32767        # MPI promises tags up to 32767
        backend._rings += 1
        self.arrived = np.empty(-(-x.size // n), x.dtype)   # the largest piece
        self.step = 0
        self.posted = self._post(0)

    def _piece(self, i: int) -> np.ndarray:
        return self.flat[self.bounds[i % self.b.size]:self.bounds[i % self.b.size + 1]]

    def _post(self, step: int) -> tuple[Any, Any]:
        """(the receive, the send) of `step`: the first n - 1 reduce, the rest copy."""
        n, r, comm = self.b.size, self.b.rank, self.b._ring_comm
        if step < n - 1:
            send, recv = self._piece(r - step), self.arrived[:self._piece(r - step - 1).size]
        else:
            k = step - (n - 1)
            send, recv = self._piece(r + 1 - k), self._piece(r - k)
        return (comm.Irecv(self.b._bytes(recv), self.left, self.tag),
                comm.Isend(self.b._bytes(send), self.right, self.tag))

    def finish(self) -> None:
        n, b = self.b.size, self.b
        steps = 2 * (n - 1)
        while self.step < steps:
            recv, send = self.posted
            b._complete(recv, f"rank {self.left}'s piece (step {self.step + 1} of {steps} of "
                              f"the all_reduce ring)")
            if self.step < n - 1:
                mine = self._piece(b.rank - self.step - 1)
                accumulate(mine, self.arrived[:mine.size], self.base)
            b._complete(send, f"rank {self.right} to take its piece (step {self.step + 1} of "
                              f"{steps} of the all_reduce ring)")
            self.step += 1
            if self.step < steps:
                self.posted = self._post(self.step)
        finish_op(self.x, self.op, n)


def _byte_view(x: np.ndarray) -> memoryview:
    """The bytes of C-contiguous `x`, of any dtype (bfloat16's too), as a writable view."""
    return memoryview(x.reshape(-1).view(np.uint8))


def _spinning(comm: Any, MPI: Any) -> tuple[float, bool]:
    """(how long a wait spins on MPI_Test before it sleeps between tests, whether each turn
    yields the core): ANYCCL_SPIN_US or _SPIN_S; yielding where this host's ranks outnumber
    the cores this process may use (a spin that keeps its core would starve the very rank it
    waits for)."""
    spin_us = settings.SPIN_US.get()
    spin_s = _SPIN_S if spin_us is None else spin_us * 1e-6
    try:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        ranks_here = local.Get_size()
        local.Free()
    except Exception:  # noqa: BLE001 - an MPI without shared-memory groups: assume a core each
        return spin_s, False
    return spin_s, ranks_here > cores_available()


def _native_type(MPI: Any, dtype: np.dtype) -> Any:
    """MPI's predefined datatype for `dtype`, or None (float16, bfloat16: no standard type)."""
    names = {"int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
             "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T",
             "uint64": "UINT64_T", "float32": "FLOAT", "float64": "DOUBLE",
             "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX"}
    name = names.get(dtype.name)
    return getattr(MPI, name) if name is not None else None


def _joined(outs: list[np.ndarray]) -> tuple[np.ndarray, Callable[[], None] | None]:
    """One contiguous array over `outs`: their own memory when they lie back to back (the
    communicator's pieces of one array), else a scratch array and the function that copies it
    back into them."""
    if isinstance(outs, Pieces):   # pieces of one array: that array
        return outs.whole.reshape(-1), None
    flat = [o.reshape(-1) for o in outs]
    if len(flat) == 1:
        return flat[0], None
    address = [o.__array_interface__["data"][0] for o in flat]
    if all(address[i + 1] == address[i] + flat[i].nbytes for i in range(len(flat) - 1)):
        total = sum(o.size for o in flat)
        return np.lib.stride_tricks.as_strided(flat[0], shape=(total,),
                                               strides=(flat[0].itemsize,)), None
    scratch = np.empty(sum(o.size for o in flat), flat[0].dtype)

    def scatter_back() -> None:
        at = 0
        for o in flat:
            o[...] = scratch[at:at + o.size]
            at += o.size
    return scratch, scatter_back


def create(ctx: HostContext) -> MpiBackend:
    """The mpi backend over MPI_COMM_WORLD, which must be the job anyccl was told of."""
    backend = MpiBackend.world(ctx.timeout_s, ctx.store)
    if (backend.rank, backend.size) != (ctx.rank, ctx.size):
        backend.close()
        raise RendezvousError(f"backend='mpi': this process is rank {backend.rank} of "
                              f"{backend.size} in MPI_COMM_WORLD but rank {ctx.rank} of "
                              f"{ctx.size} for anyccl; start the job with mpiexec -n {ctx.size}")
    return backend


def status() -> str:
    """What `anyccl info` says of the mpi backend here."""
    try:
        import mpi4py

        return f"available (mpi4py {mpi4py.__version__} on {library_version()})"
    except Exception:  # noqa: BLE001 - any failure to load means: not usable here
        return "not usable: pip install 'anyccl[mpi]' (mpi4py and MPICH)"
