"""Joining back: a communicator grows by processes started after it (a replacement for a lost
rank, or one more worker), at a point its ranks choose.

A newcomer (`join`) finds the job through the environment its launcher gave it (the store's
address and the job key, as `anyccl run` gives every rank it starts, or MASTER_ADDR and
MASTER_PORT) and waits in the job's store, under `grow/`:

1. It takes a ticket: the number of newcomers so far (`arrived`, one atomic add).
2. The ranks of a communicator call `grow(count)` together. Each says what it asks for
   (`want/<rank>`, under the communicator's own key space); its rank 0 checks that all asked
   the same, claims tickets (`claimed`, one atomic add each) until it holds `count` whose
   newcomers came and did not leave meanwhile (None: every newcomer waiting now), and
   writes the round: the meeting's key space, the size, the backend. Each claimed ticket
   gets its newcomer's place (`ticket/<n>`): its rank, after the communicator's own ranks,
   in ticket order.
3. The communicator's ranks and the newcomers build the new communicator through the store,
   as init() does (bootstrap.connect), in the meeting's key space. The old ranks keep their
   numbers.

Every step has the caller's deadline. Past it, rank 0 gives the round up: its claimed tickets
are written as abandoned (a newcomer holding one takes a new ticket and waits for the next
grow), every rank of the communicator gets TimeoutError saying how many came, and the
communicator goes on as it was. A newcomer that gives up says so (`left/<n>`), and no later
round counts on it.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import bootstrap, settings
from .arguments import seconds
from .errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    InvalidArgumentError,
    TimeoutError,
    UnsupportedError,
)
from .recovery import _pauses
from .store import PrefixStore, Store, connection_of

if TYPE_CHECKING:
    from .communicator import Communicator

_ROOM = "grow"   # the job-wide key space newcomers wait in
_GRACE_S = 5.0   # how much longer than the deadline a rank waits for rank 0's word


def grow(comm: Communicator, count: int | None, timeout_s: float) -> Communicator:
    """The communicator of `comm`'s ranks and `count` newcomers (see the module's docstring);
    `comm` itself when `count` is None and nobody was waiting."""
    comm._check_open("grow")
    if comm.failure is not None:
        raise CommunicatorClosedError(
            f"rank {comm.rank}: grow: this communicator failed ({comm.failure}); its survivors "
            f"shrink it first (comm.shrink()), then grow the shrunk one") from comm.failure
    backend = comm._engine.backend
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or count < 0):
        raise InvalidArgumentError(f"rank {comm.rank}: grow: count={count!r} must be an int "
                                   f">= 0, or None for every newcomer waiting now")
    if not backend.admits_newcomers:
        raise UnsupportedError(
            f"rank {comm.rank}: grow: the {backend.name} backend cannot admit a process started "
            f"later (MPI's world is fixed at launch); use shm on one host, shm+gloo between "
            f"hosts")
    deadline = time.monotonic() + timeout_s
    comm._grows += 1
    name = f"{comm._name}.grow{comm._grows}"
    meeting = f"{_key_space(comm._store)}/{name}"
    here = PrefixStore(meeting, connection_of(comm._store))
    here.set(f"want/{comm.rank}", json.dumps(count).encode())
    if comm.rank == 0:
        _lead(comm, here, count, name, meeting, deadline)
    try:   # rank 0 writes the round by the deadline, whatever happens
        round_ = json.loads(here.get("round", max(0.0, deadline - time.monotonic()) + _GRACE_S))
    except TimeoutError:
        raise TimeoutError(f"rank {comm.rank}: grow: rank 0 said nothing of the round within "
                           f"{timeout_s:g} s") from None
    if "error" in round_:
        raise (CollectiveMismatchError if round_["kind"] == "mismatch" else TimeoutError)(
            f"rank {comm.rank}: grow: {round_['error']}")
    if round_["size"] == comm.size:
        return comm
    new = bootstrap.connect(connection_of(comm._store), comm.rank, round_["size"],
                            backend=round_["backend"], timeout_s=_build_s(deadline, comm),
                            local_rank=None, debug=comm.debug, device_id=comm._gpu_side.device,
                            meeting=meeting, job_id=comm.job_id, comm_name=name)
    new.timeout_s = comm.timeout_s
    new.grown_from = {"ranks": comm.size, "joined": list(range(comm.size, round_["size"]))}
    return new


def _lead(comm: Communicator, here: Store, count: int | None, name: str, meeting: str,
          deadline: float) -> None:
    """Rank 0's part: check that every rank asked for the same, claim the newcomers' tickets,
    write the round and each newcomer's place (or the error every rank raises)."""
    asked: list[Any] = []
    for r in range(comm.size):
        try:
            asked.append(json.loads(here.get(f"want/{r}", max(0.001, deadline -
                                                               time.monotonic()))))
        except TimeoutError:
            missing = ", ".join(str(q) for q in range(r, comm.size)
                                if not here.check(f"want/{q}"))
            here.set("round", json.dumps({"kind": "timeout", "error": (
                f"rank(s) {missing} did not call grow in time; the communicator goes on as "
                f"it was")}).encode())
            return
    differ = [r for r in range(comm.size) if asked[r] != count]
    if differ:
        here.set("round", json.dumps({"kind": "mismatch", "error": (
            f"rank 0 asked for {_newcomers(count)}, but rank(s) "
            f"{', '.join(f'{r} for {_newcomers(asked[r])}' for r in differ)}; the "
            f"communicator goes on as it was")}).encode())
        return
    room = PrefixStore(_ROOM, connection_of(comm._store))
    tickets = _claim(room, count, deadline)
    if isinstance(tickets, str):
        here.set("round", json.dumps({"kind": "timeout", "error": tickets}).encode())
        return
    size = comm.size + len(tickets)
    spec = comm._backend.name if comm._gpu_side.kind is None else \
        f"cpu:{comm._backend.name},cuda:{comm._gpu_side.kind}"
    here.set("round", json.dumps({"size": size, "backend": spec}).encode())
    for i, ticket in enumerate(tickets):
        room.set(f"ticket/{ticket}", json.dumps({
            "meeting": meeting, "name": name, "rank": comm.size + i, "size": size,
            "backend": spec, "job_id": comm.job_id, "debug": comm.debug,
            "timeout_s": comm.timeout_s,
            "grown_from": {"ranks": comm.size, "joined": list(range(comm.size, size))}}).encode())


def _claim(room: Store, count: int | None, deadline: float) -> list[int] | str:
    """The tickets of `count` newcomers that came (None: of every newcomer waiting now), in
    the order they came; past the deadline, the claimed tickets abandoned and what to say."""
    claimed: list[int] = []
    tickets: list[int] = []
    try:
        if count is None:   # as many claims as newcomers wait now, keeping those still there
            for _ in range(max(0, room.add("arrived", 0) - room.add("claimed", 0))):
                tickets += _claim_one(room, claimed, deadline)
        else:
            while len(tickets) < count:
                tickets += _claim_one(room, claimed, deadline)
    except TimeoutError:
        for t in claimed:
            room.set(f"ticket/{t}", json.dumps({"abandoned": True}).encode())
        return (f"{len(tickets)} of {_newcomers(count)} joined before the deadline; the "
                f"communicator goes on as it was")
    return tickets


def _claim_one(room: Store, claimed: list[int], deadline: float) -> list[int]:
    """Claim the next ticket (added to `claimed`) and wait until its newcomer came: [it], or
    [] when that newcomer gave up meanwhile. TimeoutError past the deadline."""
    ticket = room.add("claimed", 1)
    claimed.append(ticket)
    pauses = _pauses()
    while room.add("arrived", 0) < ticket:
        if time.monotonic() >= deadline:
            raise TimeoutError("grow: newcomers did not come in time")
        time.sleep(next(pauses))
    return [] if room.check(f"left/{ticket}") else [ticket]


def join(timeout: float | timedelta | None = None, *, init_method: str | None = None,
         device_id: object = None) -> Communicator:
    """Join a running job as a newcomer: wait until a communicator of the job grows
    (`Communicator.grow`), then return the grown communicator, in which this process has a
    rank after the communicator's own ranks.

    The process finds the job through the environment its launcher gave it (`anyccl run`:
    the store's address and the job key; or MASTER_ADDR and MASTER_PORT, or `init_method`).

    Args:
        timeout: seconds to wait for a communicator to grow (default: ANYCCL_TIMEOUT, else
            600); the grown communicator's operations then take its ranks' timeout.
        init_method: as init()'s, to reach the job's store.
        device_id: this process's CUDA device, as init()'s.

    Raises:
        RendezvousError: the job's store cannot be reached.
        TimeoutError: no communicator grew to admit this process in time.
    """
    timeout_s = seconds(timeout, settings.TIMEOUT.get())
    deadline = time.monotonic() + timeout_s
    connection = bootstrap.newcomer_store(init_method, timeout_s)
    try:
        room = PrefixStore(_ROOM, connection)
        while True:
            ticket = room.add("arrived", 1)
            try:
                place = json.loads(room.get(f"ticket/{ticket}",
                                            max(0.001, deadline - time.monotonic())))
            except TimeoutError:
                room.set(f"left/{ticket}", b"1")
                raise TimeoutError(f"join: no communicator of the job grew to admit this "
                                   f"process (newcomer {ticket}) within {timeout_s:g} s; its "
                                   f"ranks admit newcomers with comm.grow()") from None
            if not place.get("abandoned"):
                break
        comm = bootstrap.connect(connection, place["rank"], place["size"],
                                 backend=place["backend"], timeout_s=place["timeout_s"],
                                 local_rank=None, debug=place["debug"], device_id=device_id,
                                 owns_store=True, meeting=place["meeting"],
                                 job_id=place["job_id"], comm_name=place["name"])
    except BaseException:
        connection.close()
        raise
    comm.grown_from = place["grown_from"]
    return comm


def _key_space(store: Store) -> str:
    """The key space `store` is in, below its connection ("init1"): where its communicator's
    keys live."""
    parts: list[str] = []
    while isinstance(store, PrefixStore):
        parts.append(store.prefix)
        store = store.inner
    return "/".join(reversed(parts))


def _build_s(deadline: float, comm: Communicator) -> float:
    return max(1.0, min(deadline - time.monotonic(), comm.timeout_s))


def _newcomers(count: Any) -> str:
    return "every newcomer waiting" if count is None else \
        f"{count} newcomer{'s' if count != 1 else ''}"

