"""The `gloo` engine: host arrays between machines over torch.distributed's ProcessGroupGloo.

anyccl never invents a network transport; where ranks span hosts and MPI is not the launcher,
it drives Gloo (the engine torch's own CPU process groups use) through a `ProcessGroupGloo`
built on anyccl's store. NumPy arrays go to Gloo as zero-copy torch views. Every operation is
posted and then polled, so anyccl's deadlines, lost-peer reports and mismatch checks hold as on
the other backends:

- agreement: before each collective, one all-reduce (MAX) of (word, count, -word, -count)
  compares the signatures (agreement.py); only on a difference do the ranks exchange every
  signature and refusal reason to say what differed;
- a connection Gloo loses (a peer process died) is PeerLostError naming the ranks of the host
  at the other end; a peer that gives no sign of life (heartbeat.py: a host cut off the network)
  is PeerLostError naming it and its host, before the deadline;
- dtypes and reduce ops Gloo lacks (int16, unsigned, bool, complex products, bitwise ops on
  what Gloo does not do them on) reduce with anyccl's own kernels on gathered inputs, in rank
  order; AVG is a SUM and one division.

Used as the network half of the hierarchical backend (hierarchical.py), where it is created
with the job's world and the column groups; it can also serve a whole job (backend="gloo-net",
mostly to measure against).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from .. import agreement
from .._console import say
from ..buffers import BFLOAT16, SUPPORTED_DTYPES
from ..errors import AnycclError, InvalidArgumentError, PeerLostError, TimeoutError
from ..heartbeat import Heartbeat
from ..lifetime import at_exit_after_close
from ..ops import ReduceOp, accumulate, finish
from ..ops import finish as finish_op
from ..store import Store, client_sockets
from ..trace import OpRecord
from .base import Backend, Completion, PolledMessages, per_operation
from .doorbell import PollingBell

_CODES = 16           # the low 4 bits of a Gloo tag name the dtype (as on mpi)
_SPIN_S = 0.002       # how long a wait for messages polls without sleeping
_QUICK_POLLS = 200    # polls of a collective before its wait blocks
_WATCH_AFTER_S = 1.0  # a wait this long starts asking the heartbeat about peers
_REASON_BYTES = 448   # a refusal reason, as exchanged when signatures differ
_NATIVE_REDUCE = {"float16", "float32", "float64", "int8", "uint8", "int32", "int64",
                  "bfloat16"}
_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_LOST_WORDS = ("closed by peer", "Connection reset", "Broken pipe", "Connection refused",
               "Socket closed", "connection closed", "EOF", "Connection timed out")


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        raise AnycclError("the gloo engine between hosts needs PyTorch (pip install torch); or "
                          "launch with mpiexec to use MPI between hosts") from None
    return dist


def c10d_store(store: Store, timeout_s: float) -> Any:
    """`store` as a torch.distributed Store (what ProcessGroupGloo meets its peers through)."""
    from ..bootstrap import C10dStore
    from ..store import PrefixStore

    dist = _dist()
    prefixes = []
    inner: Store = store
    while isinstance(inner, PrefixStore):
        prefixes.append(inner.prefix)
        inner = inner.inner
    if isinstance(inner, C10dStore):   # torch's own store (torchrun's agent): no Python hop
        view = dist.PrefixStore("anyccl", inner._inner)
        for prefix in reversed(prefixes):
            view = dist.PrefixStore(prefix, view)
        return view
    return _AsC10d(store, timeout_s)


def _c10d_store_class() -> type:
    dist = _dist()

    class AsC10d(dist.Store):  # type: ignore[misc, name-defined]
        """An anyccl Store seen as a torch.distributed Store."""

        def __init__(self, store: Store, timeout_s: float) -> None:
            super().__init__()
            self._s, self._timeout_s = store, timeout_s

        def set(self, key: str, value: Any) -> None:
            self._s.set(key, value if isinstance(value, bytes) else bytes(value, "utf-8")
                        if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            return self._s.get(key, self._timeout_s)

        def add(self, key: str, amount: int) -> int:
            return self._s.add(key, amount)

        def check(self, keys: list[str]) -> bool:
            return all(self._s.check(k) for k in keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            limit = self._timeout_s if timeout is None else timeout.total_seconds()
            for k in keys:
                self._s.get(k, limit)

        def delete_key(self, key: str) -> bool:
            self._s.delete(key)
            return True

    return AsC10d


_as_c10d_class: type | None = None


def _AsC10d(store: Store, timeout_s: float) -> Any:
    global _as_c10d_class
    if _as_c10d_class is None:
        _as_c10d_class = _c10d_store_class()
    return _as_c10d_class(store, timeout_s)


def _device(address: str, interface: str | None) -> Any:
    dist = _dist()
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=address)


class _Waited:
    """A Gloo send or receive, waited for by a thread of its own: Gloo completes those only
    inside a blocking wait (their `is_completed` stays False until then)."""

    __slots__ = ("_work", "_done", "_any_source", "error", "source")

    def __init__(self, work: Any, limit_s: float, any_source: bool = False) -> None:
        self._work, self._done, self._any_source = work, threading.Event(), any_source
        self.error: BaseException | None = None
        self.source = -1
        thread = threading.Thread(target=self._run, args=(limit_s,), daemon=True,
                                  name="anyccl-gloo-message")
        _waits_in_gloo(thread)
        thread.start()

    def _run(self, limit_s: float) -> None:
        try:
            self._work.wait(timedelta(seconds=limit_s))
            if self._any_source:
                self.source = self._work.source_rank()
        except Exception as exc:  # noqa: BLE001 - reported by the waiting rank
            self.error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if self.error is not None:
            raise self.error

    def source_rank(self) -> int:
        return self.source


class _Pending:
    __slots__ = ("work", "on_done", "record", "deadline", "check", "keep")

    def __init__(self, work: Any, on_done: Completion, record: OpRecord, deadline: float,
                 check: Callable[[Any], BaseException | None] | None, keep: Any) -> None:
        self.work, self.on_done, self.record = work, on_done, record
        self.deadline, self.check, self.keep = deadline, check, keep


_WAITERS: set[threading.Thread] = set()   # threads inside a Gloo message wait
_PEER_ADDRESSES: set[str] = set()   # where this process's Gloo groups have peers
_WAITERS_LOCK = threading.Lock()
_AT_EXIT_S = (0.5, 2.0)   # at exit: how long the waits may end by themselves, then once shut


def _waits_in_gloo(thread: threading.Thread) -> None:
    """Count `thread` among those that may block inside Gloo (a message's wait, a group's
    shutdown) until it ends (`_end_waits`)."""
    with _WAITERS_LOCK:
        if _end_waits not in at_exit_after_close:   # once every communicator is closed
            at_exit_after_close.append(_end_waits)
        _WAITERS.difference_update([t for t in _WAITERS if not t.is_alive()])
        _WAITERS.add(thread)


def _end_waits() -> None:
    """At exit: end every Gloo message wait still running. A Python thread that comes back
    from Gloo once the interpreter is shutting down is ended by CPython inside torch's C++
    frames, and that aborts the process ("terminate called without an active exception"):
    after a lost peer, a receive from a survivor that went on without this rank can still be
    waiting. Waits get `_AT_EXIT_S[0]` to end; then this process's connections to other
    processes (not to the job's store) are shut down, which makes Gloo fail them, and they
    are given `_AT_EXIT_S[1]` more, while the interpreter is whole."""
    for limit_s, shut in zip(_AT_EXIT_S, (False, True)):
        with _WAITERS_LOCK:
            alive = [t for t in _WAITERS if t.is_alive()]
        if not alive:
            return
        if shut:
            _shut_peer_connections()
        end = time.monotonic() + limit_s
        for t in alive:
            t.join(max(0.0, end - time.monotonic()))


def _shut_peer_connections() -> None:
    """Shut down (both ways) every TCP connection of this process to an address where its
    Gloo groups have peers, but the store's."""
    keep = client_sockets()
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd in keep:
            continue
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET,
                                                                      socket.AF_INET6):
                    address = sock.getpeername()[0]   # connected (a listener raises)
                    if address.removeprefix("::ffff:") in _PEER_ADDRESSES:
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Peers:
    """What the engine knows of the job's ranks: host name and address of each (job ranks),
    and this process's heartbeat (None on one host)."""

    def __init__(self, hosts: list[str], addresses: list[str],
                 heartbeat: Heartbeat | None) -> None:
        self.hosts, self.addresses, self.heartbeat = hosts, addresses, heartbeat

    def on_address(self, address: str) -> list[int]:
        return [r for r, a in enumerate(self.addresses) if a == address]


class GlooBackend(PolledMessages, Backend):
    """A ProcessGroupGloo over `size` ranks meeting through `store`; `job_ranks[i]` is the
    job rank of this group's rank i (for naming lost peers and their hosts)."""

    name = "gloo"

    def __init__(self, store: Store, rank: int, size: int, timeout_s: float, peers: Peers,
                 job_ranks: list[int], address: str, interface: str | None) -> None:
        dist = _dist()
        self._dist = dist
        self.rank, self.size = rank, size
        self._said_rank = job_ranks[rank]   # what messages call this rank: its rank in the job
        self._store, self._timeout_s, self.peers = store, timeout_s, peers
        self._job_ranks = job_ranks
        self._address, self._interface = address, interface
        _PEER_ADDRESSES.update(a for a in (*peers.addresses, address) if a)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [_device(address, interface)]
        options._threads = 2
        try:
            self._pg = dist.ProcessGroupGloo(c10d_store(store, timeout_s), rank, size, options)
        except Exception as exc:  # noqa: BLE001 - gloo's rendezvous: say who was missing
            raise self._translated(exc, None, "the other ranks to connect") from None
        self._record: OpRecord | None = None
        self._deadline = float("inf")
        self._pending: list[_Pending] = []
        self._late_error: BaseException | None = None
        self.doorbell = PollingBell(spin_s=_SPIN_S)
        self._subgroups = 0
        self._closed = False
        self._broken = False   # a peer was lost, or this rank revoked it: close waits for none
        # set by the hierarchical backend: set once a rank revoked the communicator
        self.revoked: threading.Event | None = None
        # set by a composite backend that starts the agreement itself (start_agreement)
        self.defer_agreement = False
        self._torch = sys.modules["torch"]
        self.liveness.add(self._silent_peers)

    # ---- helpers -------------------------------------------------------------------------
    def _t(self, x: np.ndarray) -> Any:
        """A zero-copy torch view of `x` (bytes where torch has no such dtype)."""
        if x.dtype == BFLOAT16:
            return self._torch.from_numpy(x.view(np.int16)).view(self._torch.bfloat16)
        try:
            return self._torch.from_numpy(x)
        except TypeError:
            return self._torch.from_numpy(x.view(np.uint8))

    def _b(self, x: np.ndarray) -> Any:
        return self._torch.from_numpy(x.reshape(-1).view(np.uint8))

    def _timeout(self) -> timedelta:
        return timedelta(seconds=max(0.05, self._deadline - time.monotonic()) + 2.0)

    def _opts(self, kind: str, **values: Any) -> Any:
        opts = getattr(self._dist, kind)()
        for key, value in values.items():
            setattr(opts, key, value)
        opts.timeout = self._timeout()
        return opts

    def _wait(self, work: Any, what: str) -> None:
        """Wait for `work`: TimeoutError at the operation's deadline, PeerLostError when a peer
        is lost (a connection Gloo lost, or a silent peer). A few polls first (a small
        operation is often done), then blocking waits of at most 50 ms, which leave the cores
        to Gloo's own threads."""
        for _ in range(_QUICK_POLLS):
            if work.is_completed():
                break
        else:
            started = time.monotonic()
            while True:
                now = time.monotonic()
                if now >= self._deadline:
                    raise self._timed_out(what, now)
                if now - started > _WATCH_AFTER_S:
                    self._check_peers(what)
                try:
                    work.wait(timedelta(seconds=min(0.05, self._deadline - now)))
                    break
                except Exception:  # noqa: BLE001 - a slice ran out (or gloo failed: below)
                    if work.is_completed():   # it may have finished just as the slice ran out
                        break
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo's own errors, said in anyccl's words
            raise self._translated(exc, self._record, what) from None

    def _timed_out(self, what: str, now: float) -> TimeoutError:
        record = self._record
        waited = now - record.issued_at if record is not None else self._timeout_s
        heartbeat = self.peers.heartbeat
        note = "" if heartbeat is None else heartbeat.at_deadline(self._others(heartbeat))
        more = f"; {note}" if note else ""
        return TimeoutError(f"rank {self._said_rank}: {record} timed out after {waited:.3g} s "
                            f"waiting for {what} (gloo between hosts){more}")

    def _me(self) -> int:
        return self._job_ranks[self.rank]

    def _others(self, heartbeat: Any) -> list[int]:
        """Every job rank but this one: what a report of lost peers names (this engine may
        serve a subgroup, a hierarchical collective's column, while a whole host is gone)."""
        me = self._me()
        return [r for r in range(len(heartbeat.hosts)) if r != me]

    def _lost(self) -> tuple[list[int], str]:
        """The lost ranks of this engine's group (job ranks) and what to say of every lost
        rank of the job ('' and [] while none of this group's is lost)."""
        heartbeat = self.peers.heartbeat
        if heartbeat is None:
            return [], ""
        everyone = heartbeat.lost(self._others(heartbeat))
        mine = [r for r in everyone if r in self._job_ranks]
        return mine, heartbeat.describe(everyone) if mine else ""

    def _check_peers(self, what: str) -> None:
        if self.revoked is not None and self.revoked.is_set():
            # a survivor that lost a rank of another column went on to shrink without us
            raise PeerLostError(f"rank {self._said_rank}: the communicator was revoked while "
                                f"this rank was in {self._record} waiting for {what} (ranks "
                                f"that lost a peer are shrinking it; gloo between hosts)", -1)
        heartbeat = self.peers.heartbeat
        if heartbeat is not None:
            heartbeat.watch()
        lost = self.lost_peer()   # (the communicator's liveness: this host's deaths too)
        if lost is not None:
            mine, said = self._lost()   # silent hosts: every silent rank, by host
            raise PeerLostError(f"rank {self._said_rank}: {said if mine else lost[1]}, while "
                                f"this rank was in {self._record} waiting for {what} (gloo "
                                f"between hosts)", lost[0])

    def _silent_peers(self) -> dict[int, str]:
        """This transport's source for `liveness`: the ranks of this group whose heartbeat
        fell silent (heartbeat.py)."""
        heartbeat = self.peers.heartbeat
        if heartbeat is None:
            return {}
        return {self._job_ranks.index(r): why
                for r, why in heartbeat.gone(self._others(heartbeat)).items()
                if r in self._job_ranks}

    def _translated(self, exc: BaseException, record: OpRecord | None,
                    what: str) -> AnycclError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"{record}" if record is not None else "setting up the gloo engine"
        if ("Timed out" in text or "timed out" in text) and record is not None:
            # Gloo's own timer (set just past the deadline) fired before this rank's: the same
            # report, with what the heartbeat knows of the peers and of the store
            saved, self._record = self._record, record
            try:
                return self._timed_out(what, time.monotonic())
            finally:
                self._record = saved
        if "Timed out" in text or "timed out" in text:
            return TimeoutError(f"rank {self._said_rank}: {where} timed out waiting for {what} "
                                f"(gloo between hosts: {text})")
        if any(word in text for word in _LOST_WORDS):
            found = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text)
            lost = self.peers.on_address(found.group(1)) if found else []
            lost = [r for r in lost if r in self._job_ranks and r != self._me()]
            if lost:
                host = self.peers.hosts[lost[0]]
                who = ", ".join(map(str, lost))
                heartbeat = self.peers.heartbeat
                said = heartbeat.lost_said(lost) if heartbeat is not None else None
                cause = (f"; rank {said[0]} had failed first: "
                         f"{said[1].split(': ', 1)[-1]}") if said else \
                    f": the process{'es' if len(lost) > 1 else ''} there died or the host went away"
                there = [r for r, h in enumerate(self.peers.hosts) if h == host]
                plural = "s" if len(lost) > 1 else ""
                return PeerLostError(
                    f"rank {self._said_rank}: lost the connection to rank{plural} {who} on host "
                    f"{host} (ranks {', '.join(map(str, there))} run there) in "
                    f"{where} waiting for {what}"
                    f"{cause} (gloo: {text.split('. This is typically')[0]})",
                    self._job_ranks.index(lost[0]))
            return PeerLostError(f"rank {self._said_rank}: lost a peer's connection in {where} "
                                 f"waiting for {what} (gloo: {text})", -1)
        if "size" in text.lower() and "mismatch" in text.lower():
            return InvalidArgumentError(f"rank {self._said_rank}: {where}: the peer's message and "
                                        f"this rank's array differ in size (gloo: {text})")
        return AnycclError(f"rank {self._said_rank}: {where} failed in gloo: {text}")

    # ---- collectives -----------------------------------------------------------------------
    def _enter(self, record: OpRecord) -> None:
        """Operation `record` starts (`per_operation`): its deadline, a failed delivery of an
        earlier send raised, and its signature compared across ranks."""
        self._record, self._deadline = record, record.deadline
        self._raise_late()
        if record.agree is not None and self.size > 1 and not self.defer_agreement:
            self._agree(record.agree)

    def _agree(self, agree: tuple) -> None:
        """Signatures compared across ranks before the collective moves a byte (see the
        module's docstring); every rank raises the same CollectiveMismatchError."""
        self.start_agreement(agree)()

    def start_agreement(self, agree: tuple) -> Callable[[], None]:
        """Start `_agree`'s all-reduce; return the function that finishes it (and raises where
        signatures differ), so a caller may do work that touches no peer's data meanwhile."""
        word, count = agree[0], agree[1]
        sig = np.array([word, count, -word, -count], np.int64)
        work = self._pg.allreduce([self._torch.from_numpy(sig)],
                                  self._opts("AllreduceOptions", reduceOp=self._dist.ReduceOp.MAX))

        def finish() -> None:
            self._wait(work, "the other ranks to reach the collective")
            if sig[0] == -sig[2] and sig[1] == -sig[3]:
                return
            mine = np.zeros(2 + _REASON_BYTES // 8, np.int64)
            mine[0], mine[1] = word, count
            reason = (agree[2] if len(agree) > 2 else "").encode()[:_REASON_BYTES]
            mine[2:].view(np.uint8)[:len(reason)] = np.frombuffer(reason, np.uint8)
            everyone = [np.zeros_like(mine) for _ in range(self.size)]
            self._wait(self._pg.allgather([[self._torch.from_numpy(e) for e in everyone]],
                                          [self._torch.from_numpy(mine)]),
                       "the other ranks' signatures")
            words = [(int(e[0]), int(e[1])) for e in everyone]
            reasons = {r: bytes(e[2:].view(np.uint8)).rstrip(b"\0").decode(errors="replace")
                       for r, e in enumerate(everyone) if e[2:].any()}
            raise agreement.mismatch(self.rank, self._record, words, reasons, "gloo")
        return finish


    def _native(self, dtype: np.dtype, op: ReduceOp) -> bool:
        if dtype.name not in _NATIVE_REDUCE and dtype != BFLOAT16:
            return False
        return op not in _BITWISE or dtype.kind in "iu"

    def _reduce_op(self, op: ReduceOp) -> Any:
        R = self._dist.ReduceOp
        return {ReduceOp.SUM: R.SUM, ReduceOp.AVG: R.SUM, ReduceOp.PROD: R.PRODUCT,
                ReduceOp.MIN: R.MIN, ReduceOp.MAX: R.MAX, ReduceOp.BAND: R.BAND,
                ReduceOp.BOR: R.BOR, ReduceOp.BXOR: R.BXOR}[op]

    def _gathered(self, x: np.ndarray) -> list[np.ndarray]:
        everyone = [np.empty_like(x) for _ in range(self.size)]
        self.all_gather(everyone, x, self._record)
        return everyone

    def _reduce_gathered(self, everyone: list[np.ndarray], out: np.ndarray,
                         op: ReduceOp) -> None:
        """anyccl's kernels over every rank's input, in rank order (dtypes Gloo lacks)."""
        base = ReduceOp.SUM if op is ReduceOp.AVG else op
        out[...] = everyone[0]
        for other in everyone[1:]:
            accumulate(out, other, base)
        finish(out, op, self.size)

    @per_operation
    def all_reduce(self, x: np.ndarray, op: ReduceOp) -> None:
        self.all_reduce_start(x, op)()

    def all_reduce_start(self, x: np.ndarray, op: ReduceOp) -> Callable[[], None]:
        """Start an all_reduce of `x`; return the function that finishes it (x holds the
        result after), so that a caller can overlap it with work of its own."""
        if not self._native(x.dtype, op):
            return lambda: self._reduce_gathered(self._gathered(x), x, op)
        work = self._pg.allreduce([self._t(x)], self._opts("AllreduceOptions",
                                                           reduceOp=self._reduce_op(op)))

        def finish() -> None:
            self._wait(work, "the other ranks' all_reduce")
            finish_op(x, op, self.size)
        return finish

    @per_operation
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp) -> None:
        if not self._native(x.dtype, op):
            everyone = self._gathered(x)   # every rank sends its part to every rank: simple
            if self.rank == root:
                self._reduce_gathered(everyone, x, op)
            return
        target = x if self.rank == root else x.copy()   # gloo may write a non-root's input
        self._wait(self._pg.reduce([self._t(target)],
                                   self._opts("ReduceOptions", rootRank=root, rootTensor=0,
                                              reduceOp=self._reduce_op(op))),
                   "the other ranks' reduce")
        if self.rank == root:
            finish(x, op, self.size)

    @per_operation
    def broadcast(self, x: np.ndarray, root: int) -> None:
        self._wait(self._pg.broadcast([self._b(x)], self._opts("BroadcastOptions",
                                                               rootRank=root, rootTensor=0)),
                   f"rank {root}'s broadcast")

    @per_operation
    def all_gather(self, outs: list[np.ndarray], x: np.ndarray) -> None:
        self._wait(self._pg.allgather([[self._b(o) for o in outs]], [self._b(x)]),
                   "the other ranks' all_gather")

    @per_operation
    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int) -> None:
        targets = [[self._b(o) for o in outs]] if self.rank == root and outs is not None else []
        self._wait(self._pg.gather(targets, [self._b(np.ascontiguousarray(x))],
                                   self._opts("GatherOptions", rootRank=root)),
                   "the other ranks' gather" if self.rank == root else "gather at the root")

    @per_operation
    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int) -> None:
        sources = [[self._b(np.ascontiguousarray(c)) for c in chunks]] \
            if self.rank == root and chunks is not None else []
        self._wait(self._pg.scatter([self._b(out)], sources,
                                    self._opts("ScatterOptions", rootRank=root)),
                   f"rank {root}'s scatter")

    @per_operation
    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> None:
        whole = np.concatenate([i.reshape(-1) for i in inputs])   # a copy: reduced in place
        self.all_reduce(whole, op, self._record)
        out.reshape(-1)[...] = whole[self.rank * out.size:(self.rank + 1) * out.size]

    @per_operation
    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray]) -> None:
        send = np.concatenate([i.reshape(-1).view(np.uint8) for i in inputs])
        receive = np.empty(sum(o.nbytes for o in outs), np.uint8)
        self._wait(self._pg.alltoall_base(self._torch.from_numpy(receive),
                                          self._torch.from_numpy(send), [], [],
                                          self._opts("AllToAllOptions")),
                   "the other ranks' all_to_all")
        at = 0
        for o in outs:
            o.reshape(-1).view(np.uint8)[...] = receive[at:at + o.nbytes]
            at += o.nbytes

    @per_operation
    def barrier(self) -> None:
        self._wait(self._pg.barrier(self._opts("BarrierOptions")),
                   "the other ranks to reach the barrier")

    # ---- point to point --------------------------------------------------------------------
    def _tag(self, tag: int, dtype: np.dtype) -> int:
        return tag * _CODES + SUPPORTED_DTYPES.index(dtype)

    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        deadline = record.deadline
        # buffered, as on shm and mpi: the message leaves from a copy, so the send completes
        # now; delivery is finished by later calls (and at close)
        copy = x.reshape(-1).view(np.uint8).copy()
        try:   # Gloo refuses at once where the connection to a peer already broke
            posted = self._pg.send([self._torch.from_numpy(copy)], dst, self._tag(tag, x.dtype))
        except Exception as exc:  # noqa: BLE001
            raise self._translated(exc, record, "its peer") from None
        work = _Waited(posted, deadline - time.monotonic() + 2)
        self._pending.append(_Pending(work, self._late, record, deadline, None, copy))
        on_done(None)

    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  on_done: Completion, found: Callable[[int], None] | None = None) -> None:
        deadline = record.deadline
        gloo_tag = self._tag(tag, x.dtype)
        view = self._b(x)
        try:
            posted = self._pg.recv_anysource([view], gloo_tag) if src is None \
                else self._pg.recv([view], src, gloo_tag)
        except Exception as exc:  # noqa: BLE001 - as in post_send
            raise self._translated(exc, record, "its peer") from None
        work = _Waited(posted, deadline - time.monotonic() + 2, any_source=src is None)

        def check(w: Any) -> BaseException | None:
            if found is not None:
                found(w.source_rank() if src is None else src)
            return None

        self._pending.append(_Pending(work, on_done, record, deadline, check, x))

    def progress(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        still = []
        for p in self._pending:
            if p.work.is_completed():
                try:
                    p.work.wait()
                except Exception as exc:  # noqa: BLE001
                    p.on_done(self._translated(exc, p.record, "its peer"))
                    continue
                p.on_done(p.check(p.work) if p.check is not None else None)
            elif now >= p.deadline:
                saved, self._record = self._record, p.record
                p.on_done(self._timed_out("its peer", now))
                self._record = saved
            else:
                still.append(p)
        self._pending = still
        waiting = next((p for p in still if p.on_done != self._late), None)
        if waiting is not None and now - (waiting.record.started_at or
                                          waiting.record.issued_at) > _WATCH_AFTER_S:
            saved, self._record = self._record, waiting.record   # a lost peer names it
            try:
                self._check_peers("its peer")
            finally:
                self._record = saved

    # ---- groups and lifetime ---------------------------------------------------------------
    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> GlooBackend:
        from ..store import PrefixStore

        return GlooBackend(PrefixStore(f"gloo-{name}", self._store), ranks.index(self.rank),
                           len(ranks), timeout_s, self.peers,
                           [self._job_ranks[r] for r in ranks], self._address, self._interface)

    def abort(self, error: BaseException) -> None:
        self._broken = True
        super().abort(error)

    def revoke(self) -> None:
        # Gloo cannot tell its peers: the hierarchical backend tells them through the
        # heartbeat's store (`revoked`, which their waits look at). This rank's close then
        # waits for nothing.
        self._broken = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.revoked is not None and self.revoked.is_set():
            self._broken = True   # its ranks went on to shrink it: nothing more to deliver
        sends = [] if self._broken else [p for p in self._pending if p.on_done == self._late]
        end = time.monotonic() + 5.0
        while sends and time.monotonic() < end:
            try:
                self.progress()
            except AnycclError:   # a peer was lost meanwhile: what is left is not delivered
                break
            sends = [p for p in self._pending if p.on_done == self._late]
            time.sleep(1e-3)
        if sends:
            say(f"anyccl: rank {self.rank} closed with sends not delivered: "
                f"{'; '.join(str(p.record) for p in sends)}")
        # End Gloo's threads now, while the interpreter is whole: left to exit-time
        # destructors, torch's CPU build was seen to abort the process ("terminate called
        # without an active exception") after the job was done
        pg, self._pg = self._pg, None
        closer = threading.Thread(target=_shut_down, args=(pg,), daemon=True,
                                  name="anyccl-gloo-close")
        del pg
        _waits_in_gloo(closer)   # inside Gloo too: ended before the interpreter shuts down
        closer.start()
        # Gloo's shutdown can wait on a peer that is gone or cut off: a broken group's is
        # left to finish (or not) in the background
        closer.join(timeout=0.2 if self._broken else 5.0)


def _shut_down(pg: Any) -> None:
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - a group whose peers are gone: nothing left to end
        pass
