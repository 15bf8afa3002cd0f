"""Going on without a lost rank: `shrink`, ULFM's and NCCL's word for it.

Every survivor of a communicator that lost ranks calls `shrink`; each gets a new communicator
of the survivors, ranked in their old order, on the same kinds of transport. The survivors meet
in the job's store, never through the broken transport, in rounds (generations) under one
prefix per communicator:

0. Each survivor first revokes the old communicator (`Backend.revoke`): a survivor still
   waiting on it there, in an operation that did not involve the lost rank, fails at once
   instead of at its deadline, and comes to the shrink too. Its GPU work on the old one is
   cut short (the queue aborted: kernels return, the NCCL communicator is aborted).
1. Each survivor says it is alive (`alive/<rank>`) and publishes every rank its transport's
   liveness checks find gone (`dead/<rank>`: a process that ended, a host that fell silent).
   The error a survivor caught is no proof: across hosts a rank that is alive but closed its
   connections after losing a peer of its own is named in it too.
2. It waits until every rank of the old communicator is either alive or gone in its view; a
   rank that did both (it came, then died) counts as gone.
3. The first survivor to get there proposes the members (`members`, one atomic `add` picks
   it); every survivor takes that one list, so all agree even when they noticed different
   ranks at different times.
4. The members build the new transport through the store (the backend's `subgroup`), within
   `_BUILD_S`, then each says so (`built/<rank>`) and waits for the others' word. If a member
   dies before it said so, every member fails the round (a member's word is read before its
   liveness) and they go round again, one generation up, without it.

Every step has the caller's deadline; past it the error names the ranks that neither came nor
were seen to leave. A rank the others declared gone (it came too late) is told so and gets no
communicator. The GPU backend of the new communicator is made on its first GPU call, like any
communicator's, among the survivors alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import groups
from .errors import (
    CommunicatorClosedError,
    PeerLostError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
)
from .store import PrefixStore, Store

if TYPE_CHECKING:
    from .communicator import Communicator

_POLL_S = (0.002, 0.05)   # the store is polled from every 2 ms up to every 50 ms


def _pauses() -> Iterator[float]:
    """The waits between two looks at the store: doubling from _POLL_S[0] to _POLL_S[1]."""
    pause = _POLL_S[0]
    while True:
        yield pause
        pause = min(pause * 2, _POLL_S[1])
# a round's transport is given this long (at most) to be built: a member that died after the
# agreement is then found in the next round instead of at the caller's deadline
_BUILD_S = 15.0


def shrink(comm: Communicator, timeout_s: float) -> Communicator:
    """The communicator of `comm`'s surviving ranks (see the module's docstring)."""
    backend = comm._engine.backend
    if not backend.survives_peer_loss:
        raise UnsupportedError(
            f"rank {comm.rank}: shrink: the {backend.name} backend cannot go on without a lost "
            f"rank (MPI without ULFM ends the job or its communicators when a process dies; "
            f"Open MPI 5 run with `mpiexec --with-ft ulfm` reports it instead, and then the "
            f"mpi backend on one communicator of all ranks can); use shm on one host, "
            f"shm+gloo between hosts")
    deadline = time.monotonic() + timeout_s
    known: dict[int, str] = {}
    backend.revoke()   # a survivor still waiting on this rank in the old one fails now
    # and this rank's GPU work on the old one is cut short (kernels return, NCCL aborts)
    comm._gpu_side.abort(CommunicatorClosedError(
        f"rank {comm.rank}: the communicator was revoked: its ranks are shrinking it"))
    while True:
        comm._shrinks += 1
        name = f"{comm._name}.shrink{comm._shrinks}"
        store = PrefixStore(name, comm._store)
        members, gone = _agree(comm, store, known, deadline)
        try:
            return _build(comm, store, members, gone, name,
                          min(deadline, time.monotonic() + _BUILD_S))
        except (PeerLostError, TimeoutError, RendezvousError):   # a member left meanwhile
            if time.monotonic() >= deadline:
                raise
            known.update(gone)


def _agree(comm: Communicator, store: Store, known: dict[int, str],
           deadline: float) -> tuple[list[int], dict[int, str]]:
    """The members of the next communicator, the same list on every survivor, and what this
    rank knows of the ranks left out."""
    rank, size, backend = comm.rank, comm.size, comm._engine.backend
    store.set(f"alive/{rank}", b"1")
    alive, gone, told = {rank}, dict(known), set()
    pauses = _pauses()
    while True:
        gone.update((r, why) for r, why in backend.departed().items() if r not in gone)
        for r in gone.keys() - told:
            store.set(f"dead/{r}", gone[r].encode())
            told.add(r)
        for r in range(size):
            if r == rank or r in gone:
                continue
            if store.check(f"dead/{r}"):
                gone[r] = store.get(f"dead/{r}", 1.0).decode()
                told.add(r)
            elif r not in alive and store.check(f"alive/{r}"):
                alive.add(r)
        if len(alive - gone.keys()) + len(gone) >= size:
            break
        if time.monotonic() >= deadline:
            missing = sorted(set(range(size)) - alive - gone.keys())
            raise TimeoutError(
                f"rank {rank}: shrink: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} neither joined the shrink nor were seen to "
                f"leave before the deadline; {len(alive)} of {size} ranks joined")
        time.sleep(next(pauses))
    if store.add("proposer", 1) == 1:
        store.set("members", json.dumps(sorted(alive - gone.keys())).encode())
    members = json.loads(store.get("members", max(0.0, deadline - time.monotonic())))
    if rank not in members:
        raise PeerLostError(f"rank {rank}: shrink: the other survivors counted this rank as "
                            f"gone (it came after they decided); it has no communicator",
                            rank)
    left_out = {r: why for r, why in gone.items() if r not in members}
    for r, why in left_out.items():   # comm.lost_ranks() says it from now on
        backend.liveness.report(r, why)
    return members, left_out


def _build(comm: Communicator, store: Store, members: list[int], gone: dict[int, str],
           name: str, deadline: float) -> Communicator:
    """The communicator of `members` (ranks of `comm`), its transport built through the
    store, once every member has built its side (`_all_built`)."""
    timeout_s = max(0.001, deadline - time.monotonic())
    backend = comm._engine.backend.subgroup(members, name, timeout_s)
    try:
        _all_built(comm, store, members, deadline)
    except BaseException:
        backend.close()
        raise
    mine = comm.hosts[comm.rank] if comm.hosts else None
    local_rank = sum(1 for r in members if r < comm.rank and comm.hosts[r] == mine) \
        if comm.hosts else members.index(comm.rank)
    left = ", ".join(f"{r}" for r in sorted(gone)) or "none"
    child = groups.child_of(comm, backend, members, name,
                            f"shrunk from {comm._name} without rank(s) {left} "
                            f"({comm.backend_reason})", local_rank=local_rank)
    child.shrunk_from = {"ranks": members, "lost": dict(sorted(gone.items()))}
    return child


def _all_built(comm: Communicator, store: Store, members: list[int], deadline: float) -> None:
    """Return once every member said it built its side of the round's transport; raise
    PeerLostError if one was found gone first. A member's word is looked at before its
    liveness, and it says it before it can die after building: so either every member
    returns (a member that died later fails the next operation, and the survivors shrink the
    new communicator) or every member raises (and all go round again): never some of each."""
    backend, rank = comm._engine.backend, comm.rank
    store.set(f"built/{rank}", b"1")
    waiting = [r for r in members if r != rank]
    pauses = _pauses()
    while waiting:
        waiting = [r for r in waiting if not store.check(f"built/{r}")]
        if not waiting:
            return
        gone = backend.departed()
        for r in waiting:
            if r in gone and not store.check(f"built/{r}"):
                raise PeerLostError(f"rank {rank}: shrink: {gone[r]} before it built its side "
                                    f"of the shrunk communicator", r)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank {rank}: shrink: rank(s) {', '.join(map(str, waiting))} "
                               f"did not build their side of the shrunk communicator in time")
        time.sleep(next(pauses))

