"""Host arrays across machines: shared memory inside each host, an existing engine between.

A job whose ranks span hosts gets this backend (`shm+gloo` or `shm+mpi`), composed of three
others, each over a group of the job's ranks:

- `local`: the shm backend over the ranks of this host;
- `net`: the network engine (Gloo through torch, or MPI) over every rank;
- `column`: the same engine over the ranks that sit at this rank's position on every host
  (one rank per host), when every host runs as many ranks.

Large all_reduce: reduce-scatter inside the host (shm), all_reduce of this rank's slice between
hosts (its column), all_gather inside the host; each rank sends about 1/(ranks per host) of
what a flat ring would send over the network, and the host's link carries S each way instead
of a ring's 2(n-1)/n S. Small all_reduce: all_reduce inside, then between hosts on every
column at once (no third step). broadcast, reduce, all_gather and reduce_scatter are split the
same way (inside, between on columns, inside); gather, scatter, all_to_all, barrier and
point-to-point messages (tags, any-source) run on `net` over all ranks (on hosts of uneven
size, everything does).

Before any byte moves, the collective's signature is compared across every rank on `net`
(agreement.py), so a rank on one host that disagrees with a rank on another makes every rank
raise; the inner steps then skip their own comparison. AVG reduces as SUM, divided once at the
end (twice-divided integers would round differently).
"""

from __future__ import annotations

import functools
import socket
from typing import Any, Callable

import numpy as np

from .. import tuning
from ..errors import CollectiveMismatchError, PeerLostError, TimeoutError
from ..ops import ReduceOp, finish
from ..trace import OpRecord
from .base import Backend, Completion

_SILENCE_CHECK_S = 0.25   # how often a wait asks the heartbeat of silent hosts (shm+mpi)


def _plain(record: OpRecord) -> OpRecord:
    """`record` without its signature: the inner steps of an agreed collective."""
    inner = OpRecord(record.name, record.seq, record._args, record.nbytes)
    inner.issued_at, inner.deadline = record.issued_at, record.deadline
    return inner


def _explains_losses(method: Callable) -> Callable:
    """A peer lost across hosts, or a deadline passed waiting across hosts, is told to this
    host's other ranks (through the store), which would otherwise only see this rank leave
    (see `_Local`, and gloo's lost connections)."""
    @functools.wraps(method)
    def guarded(self: HierarchicalBackend, *args: Any) -> Any:
        if self._revoked is not None and self._revoked.is_set():
            raise PeerLostError(f"rank {self.rank}: the communicator was revoked: ranks on "
                                f"another host lost a peer and are shrinking it", -1)
        try:
            return method(self, *args)
        except (PeerLostError, TimeoutError) as exc:
            if self._heartbeat is not None and not getattr(exc, "inside_host", False):
                self._heartbeat.tell_lost(str(exc))
            raise
        except CollectiveMismatchError:
            self._agreed()   # shm saw this host's ranks differ: say what every rank called
            raise
    return guarded


def _collective(method: Callable) -> Callable:
    """A collective of the hierarchical backend: the first call with a record (its last
    argument) starts the operation (`_enter`), and the comparison of its signatures across
    every rank has finished when it returns; losses explained (`_explains_losses`)."""
    @functools.wraps(method)
    def run(self: HierarchicalBackend, *args: Any) -> None:
        if args[-1] is not self._record:
            self._enter(args[-1])
        method(self, *args)
        self._agreed()
    return _explains_losses(run)


class _Local:
    """The shm backend of this host's ranks, whose lost-peer errors are said in the group's
    rank numbers (shm counts only this host's ranks), with what the rank that left had lost,
    when it left because it lost a rank of another host."""

    def __init__(self, inner: Backend, owner: HierarchicalBackend) -> None:
        self._inner, self._owner = inner, owner
        self.name = inner.name

    def _lost(self, exc: PeerLostError) -> PeerLostError:
        owner = self._owner
        return owner._renamed(exc, owner._members[owner._host], inside_host=True)

    def _timed_out(self, exc: TimeoutError) -> TimeoutError:
        return self._owner._timed_out_inside(exc)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any) -> Any:
            try:
                return attribute(*args)
            except PeerLostError as exc:
                raise self._lost(exc) from None
            except TimeoutError as exc:
                raise self._timed_out(exc) from None
        setattr(self, name, call)   # made once per method: later calls find it directly
        return call


class _Column(_Local):
    """The engine's group of the ranks at this rank's place on every host (the column), whose
    lost-peer errors are said in the group's rank numbers too (the column counts only its own
    ranks: a rank lost there is "rank 0" of the column, not of the group)."""

    def __init__(self, inner: Backend, owner: HierarchicalBackend, members: list[int]) -> None:
        super().__init__(inner, owner)
        self._members = members

    def _lost(self, exc: PeerLostError) -> PeerLostError:
        return self._owner._renamed(exc, self._members, inside_host=False)

    def _timed_out(self, exc: TimeoutError) -> TimeoutError:
        return exc   # a wait between hosts: told to this host's other ranks as it is


class HierarchicalBackend(Backend):
    """See the module's docstring. `hosts[r]` names the host of this group's rank r."""

    def __init__(self, rank: int, hosts: list[str], local: Backend, net: Backend,
                 name: str, timeout_s: float, owns: list | None = None) -> None:
        self.rank, self.size = rank, len(hosts)
        self.name = f"{local.name}+{net.name}"
        # the tuning table's thresholds (tuning.py): a large all_reduce crosses the network in
        # chunks (measured on 2 and 3 hosts x 2 ranks with 2 Gbit/s links,
        # benchmarks/results/2026-11-25-ci2core-*hosts*)
        self._slice_min = tuning.value("hierarchical.slice_min")
        self._chunk_bytes = tuning.value("hierarchical.chunk")
        self._max_chunks = tuning.value("hierarchical.max_chunks")
        self.hosts = hosts
        self._local, self._net = _Local(local, self), net
        self.doorbell = net.doorbell   # messages travel on the network engine
        net.defer_agreement = True   # _enter() starts it, and each step awaits it in time
        self._agreement: Callable[[], None] | None = None
        order = list(dict.fromkeys(hosts))               # hosts in order of their first rank
        self._members = [[r for r in range(self.size) if hosts[r] == h] for h in order]
        self._position = {}
        for h, members in enumerate(self._members):
            for i, r in enumerate(members):
                self._position[r] = (h, i)
        self._host, self._index = self._position[rank]
        # one view of who is gone: this host's deaths (shm's pid checks, in this numbering),
        # then the engine's; the engine's own waits ask it too, so that a wait on MPI or gloo
        # for a rank of this host learns of its death at once, whatever the engine noticed
        self.liveness.include(local.liveness, self._members[self._host])
        self.liveness.include(net.liveness, list(range(self.size)))
        net.liveness = self.liveness
        self._per_host = len(self._members[0]) \
            if len({len(m) for m in self._members}) == 1 else 0
        self._column: Backend | None = None
        column_engine: Backend | None = None
        if self._per_host and len(self._members) > 1:
            column = [members[self._index] for members in self._members]
            column_engine = net.subgroup(column, f"{name}-column{self._index}", timeout_s)
            column_engine.between_hosts = True
            self._column = _Column(column_engine, self, column)   # type: ignore[assignment]
        self._owns = owns or []   # what closes with this backend (the heartbeat)
        self._record: OpRecord | None = None
        self._column_record: OpRecord | None = None   # the column's steps of `_record`
        heartbeat = getattr(getattr(net, "peers", None), "heartbeat", None)
        self._heartbeat = heartbeat if heartbeat is not None else \
            next((o for o in self._owns if hasattr(o, "tell_lost")), None)
        self._name = name
        self._revoked = self._heartbeat.follow(name) if self._heartbeat is not None else None
        if heartbeat is None and self._heartbeat is not None:
            # an engine without heartbeats of its own (MPI): theirs go into the view here, so
            # that a host that fell silent (cut off the network) is gone for every wait
            self.liveness.add(self._silent_hosts, _SILENCE_CHECK_S)
        for part in (net, column_engine):   # their waits between hosts look at it too
            if part is not None and hasattr(part, "revoked"):
                part.revoked = self._revoked

    def _silent_hosts(self) -> dict[int, str]:
        """A source of this communicator's liveness where the engine has no heartbeats: the
        ranks whose heartbeat fell silent. Being asked means a wait goes on: the heartbeat's
        thread reads the peers' counters for the next few periods (its `watch`)."""
        heartbeat = self._heartbeat
        assert heartbeat is not None
        heartbeat.watch()
        return heartbeat.gone([r for r in range(self.size) if r != self.rank])

    def _timed_out_inside(self, exc: TimeoutError) -> TimeoutError:
        """A step inside the host timed out, most likely because a rank of this host waits on
        another host: add what the heartbeat knows (silent peers, or a store that stopped
        answering this host)."""
        heartbeat = self._heartbeat
        if heartbeat is None:
            return exc
        note = heartbeat.at_deadline([r for r in range(len(heartbeat.hosts))
                                      if r != heartbeat.rank])
        if not note:
            return exc
        error = TimeoutError(f"{exc}; {note}")
        error.inside_host = True   # type: ignore[attr-defined]
        return error

    def _renamed(self, exc: PeerLostError, members: list[int],
                 inside_host: bool) -> PeerLostError:
        """`exc` of a part whose rank r is this group's rank members[r], said in the group's
        numbers, with what the lost rank had lost first where the heartbeat knows it."""
        text = str(exc)
        if not 0 <= exc.lost_rank < len(members):
            return exc
        lost = members[exc.lost_rank]
        said = self._heartbeat.lost_said([lost]) if self._heartbeat is not None else None
        why = text.split(": ", 1)[1] if ": " in text else text
        renamed = why.replace(f"rank {exc.lost_rank} ", f"rank {lost} ", 1)
        more = f"; it had failed across hosts first: {said[1].split(': ', 1)[-1]}" \
            if said and inside_host else ""
        error = PeerLostError(f"rank {self.rank} (on {socket.gethostname()}): {renamed}{more}",
                              lost)
        error.inside_host = inside_host   # type: ignore[attr-defined]
        return error

    # ---- per operation ---------------------------------------------------------------------
    def _enter(self, record: OpRecord) -> None:
        """Operation `record` starts. Its signature is compared inside the host by shm at its
        first step, and across every rank on the engine: started here, awaited (`_agreed`)
        before anything is written that another rank or the caller can see."""
        self._record = record
        self._net.enter(record)
        if self._column is not None:
            self._column_record = _plain(record)
            self._column.enter(self._column_record)
        self._agreement = None if record.agree is None else \
            self._net.start_agreement(record.agree)

    def _agreed(self) -> None:
        """Wait for the signatures' comparison across every rank (raises where they differ)."""
        pending, self._agreement = self._agreement, None
        if pending is not None:
            pending()

    # ---- collectives -----------------------------------------------------------------------
    @_collective
    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None:
        column = self._column
        if column is None:
            self._agreed()
            self._net.all_reduce(x, op, record)
            return
        base = ReduceOp.SUM if op is ReduceOp.AVG else op
        per_host, n = self._per_host, x.size
        if x.nbytes < self._slice_min or n < per_host:
            mine = x.copy()          # x is written only once every rank has agreed
            self._local.all_reduce(mine, base, record)
            self._agreed()
            column.all_reduce(mine, base, self._column_record)
            x[...] = mine
            finish(x, op, self.size)
            return
        # in chunks, so that chunk k crosses the network while chunk k+1 is reduced inside
        # the host and chunk k-1 gathered back
        chunks = max(1, min(self._max_chunks, x.nbytes // self._chunk_bytes))
        piece = -(-n // (per_host * chunks))
        span = piece * per_host
        whole = x if span * chunks == n else np.zeros(span * chunks, x.dtype)
        if whole is not x:
            whole[:n] = x
        mine = np.empty((chunks, piece), x.dtype)
        waiting: tuple | None = None
        for k in range(chunks):
            chunk = whole[k * span:(k + 1) * span]
            pieces = [chunk[i * piece:(i + 1) * piece] for i in range(per_host)]
            self._local.reduce_scatter(mine[k], pieces, base, record)
            if k == 0:
                self._agreed()
            started = column.all_reduce_start(mine[k], base)
            if waiting is not None:
                self._gather_back(*waiting, record)
            waiting = (started, pieces, mine[k])
        self._gather_back(*waiting, record)
        if whole is not x:
            x[...] = whole[:n]
        finish(x, op, self.size)

    def _gather_back(self, crossing: Callable[[], None], pieces: list[np.ndarray],
                     mine: np.ndarray, record: OpRecord) -> None:
        crossing()
        self._local.all_gather(pieces, mine, record)

    @_collective
    def reduce(self, x: np.ndarray, root: int, op: ReduceOp, record: OpRecord) -> None:
        if self._column is None:
            self._agreed()
            self._net.reduce(x, root, op, record)
            return
        base = ReduceOp.SUM if op is ReduceOp.AVG else op
        root_host, root_index = self._position[root]
        leads = self._index == root_index     # this rank reduces its host's part
        target = x if self.rank == root or not leads else x.copy()
        self._agreed()
        self._local.reduce(target, root_index, base, record)
        if leads:
            self._column.reduce(target, root_host, base, self._column_record)
        if self.rank == root:
            finish(x, op, self.size)

    @_collective
    def broadcast(self, x: np.ndarray, root: int, record: OpRecord) -> None:
        self._agreed()
        if self._column is None:
            self._net.broadcast(x, root, record)
            return
        root_host, root_index = self._position[root]
        if self._index == root_index:
            self._column.broadcast(x, root_host, self._column_record)
        self._local.broadcast(x, root_index, record)

    @_collective
    def all_gather(self, outs: list[np.ndarray], x: np.ndarray, record: OpRecord) -> None:
        self._agreed()
        if self._column is None:
            self._net.all_gather(outs, x, record)
            return
        hosts, per_host, s = len(self._members), self._per_host, x.size
        across = np.empty(hosts * s, x.dtype)     # this rank's column, host by host
        self._column.all_gather([across[h * s:(h + 1) * s] for h in range(hosts)],
                                x.reshape(-1), self._column_record)
        blocks = np.empty(per_host * hosts * s, x.dtype)
        self._local.all_gather([blocks[i * hosts * s:(i + 1) * hosts * s]
                                for i in range(per_host)], across, record)
        for r, out in enumerate(outs):
            h, i = self._position[r]
            at = (i * hosts + h) * s
            out.reshape(-1)[...] = blocks[at:at + s]

    @_collective
    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp,
                       record: OpRecord) -> None:
        self._agreed()
        if self._column is None:
            self._net.reduce_scatter(out, inputs, op, record)
            return
        base = ReduceOp.SUM if op is ReduceOp.AVG else op
        hosts, per_host, s = len(self._members), self._per_host, out.size
        # local rank i reduces, for every host h, the piece of the rank at (h, i)
        local_inputs = [np.concatenate([inputs[self._members[h][i]].reshape(-1)
                                        for h in range(hosts)]) for i in range(per_host)]
        partial = np.empty(hosts * s, out.dtype)
        self._local.reduce_scatter(partial, local_inputs, base, record)
        self._column.reduce_scatter(out.reshape(-1), [partial[h * s:(h + 1) * s]
                                                      for h in range(hosts)], base,
                                    self._column_record)
        finish(out, op, self.size)

    @_collective
    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int,
               record: OpRecord) -> None:
        self._agreed()
        self._net.gather(x, outs, root, record)

    @_collective
    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int,
                record: OpRecord) -> None:
        self._agreed()
        self._net.scatter(out, chunks, root, record)

    @_collective
    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray],
                   record: OpRecord) -> None:
        self._agreed()
        self._net.all_to_all(outs, inputs, record)

    @_collective
    def barrier(self, record: OpRecord) -> None:
        self._agreed()
        self._net.barrier(record)

    # ---- point to point: on the network engine ----------------------------------------------
    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        self._net.post_send(x, dst, tag, record, on_done)

    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  on_done: Completion, found: Callable[[int], None] | None = None) -> None:
        self._net.post_recv(x, src, tag, record, on_done, found)

    @_explains_losses
    def progress(self) -> None:
        self._net.progress()

    def abort(self, error: BaseException) -> None:
        self._net.abort(error)

    # ---- groups and lifetime ---------------------------------------------------------------
    @property
    def survives_peer_loss(self) -> bool:  # type: ignore[override]
        return self._net.survives_peer_loss

    @property
    def admits_newcomers(self) -> bool:  # type: ignore[override]
        return self._net.admits_newcomers

    def revoke(self) -> None:
        for part in (self._local, self._net, self._column):   # the column is a group too
            if part is not None:
                part.revoke()
        if self._heartbeat is not None:   # and the other hosts' ranks are told
            self._heartbeat.revoke(self._name)

    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        here = [r for r in ranks if self.hosts[r] == self.hosts[self.rank]]
        inside = [self._position[r][1] for r in here]
        if len(here) == len(ranks):       # every member on this host: shared memory alone
            return self._local.subgroup(inside, name, timeout_s)
        made: list[Backend] = []
        try:   # (a member may die meanwhile: what was made is closed, recovery goes round)
            # the engine first: every member then reaches its call, whatever befalls a host
            net = self._net.subgroup(ranks, name, timeout_s)
            made.append(net)
            local = self._local.subgroup(inside, name, timeout_s)
            made.append(local)
            return HierarchicalBackend(ranks.index(self.rank), [self.hosts[r] for r in ranks],
                                       local, net, name, timeout_s)
        except BaseException:
            for part in reversed(made):
                part.close()
            raise

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.forget(self._name)
        for part in (self._column, self._net, self._local, *self._owns):
            if part is not None:
                part.close()


def creator(engine: str) -> Callable[[Any], HierarchicalBackend]:
    """The `create` of backend `shm+<engine>` (engine: "gloo" or "mpi") for the registry."""
    from .registry import HostContext

    def create(ctx: HostContext) -> HierarchicalBackend:
        from .. import settings
        from ..errors import RendezvousError
        from ..heartbeat import Heartbeat
        from ..netaddr import named_interface
        from ..store import PrefixStore
        from . import shm

        hosts = list(ctx.hosts)
        if len(hosts) != ctx.size:
            raise RendezvousError(f"backend 'shm+{engine}' needs the host of every rank")
        order = list(dict.fromkeys(hosts))
        members = [r for r in range(ctx.size) if hosts[r] == hosts[ctx.rank]]
        made: list = []
        try:
            local = shm.SharedMemoryBackend(
                PrefixStore(f"host{order.index(hosts[ctx.rank])}", ctx.store),
                members.index(ctx.rank), len(members), job_id=ctx.job_id,
                comm_name=shm.segment_part(ctx.comm_name),
                timeout_s=ctx.timeout_s)
            made.append(local)
            heartbeat = Heartbeat(PrefixStore("alive", ctx.store), ctx.rank, hosts,
                                  settings.PEER_SILENCE.get())
            made.append(heartbeat)
            if engine == "gloo":
                from .gloo import GlooBackend, Peers

                net: Backend = GlooBackend(PrefixStore("net", ctx.store), ctx.rank, ctx.size,
                                           ctx.timeout_s, Peers(hosts, list(ctx.addresses),
                                                                heartbeat),
                                           list(range(ctx.size)), ctx.addresses[ctx.rank],
                                           named_interface())
            else:
                from . import mpi

                net = mpi.create(ctx)
            made.append(net)
            return HierarchicalBackend(ctx.rank, hosts, local, net, ctx.comm_name, ctx.timeout_s,
                                       owns=[heartbeat])
        except BaseException:
            for part in reversed(made):
                part.close()
            raise

    return create


def status(engine: str) -> Callable[[], str]:
    """What `anyccl info` says of `shm+<engine>` here."""
    def says() -> str:
        import importlib.util

        module = "torch" if engine == "gloo" else "mpi4py"
        if importlib.util.find_spec(module) is None:
            return (f"not usable: between hosts it needs {module} "
                    f"({'pip install torch' if engine == 'gloo' else 'pip install mpi4py'})")
        when = " under mpiexec" if engine == "mpi" else ""
        return (f"available (chosen when ranks span hosts{when}: shm inside each host, "
                f"{engine} between hosts)")
    return says
