"""Who of a communicator's ranks is gone, and why: the one place a communicator's transports
report what they learn of lost peers, and the one place everything that must know asks (the
transports' waits, the GPU queue's watchdog, `shrink`, `Communicator.lost_ranks`).

Each transport learns of a loss in its own way, and adds that way here as a *source* when it is
made (a function returning {rank: what happened}, asked at most every `every_s`):

- shm: the peers' processes on this host, by pid (`process_alive`: a process that ended, or a
  zombie), with whether it closed its communicator first;
- mpi: MPI's own word under ULFM (the failed processes), and what ranks said in the job's store
  as they closed (`mpi.Departures`), asked at most every quarter second;
- gloo between hosts: the heartbeat's silence of another host's ranks (heartbeat.py);
- shm+gloo, shm+mpi: both parts, this host's in the communicator's numbering. The engine's part
  asks this view too, so that a wait on MPI or gloo learns of a death on this host from its pid
  at once, whatever the engine itself has noticed.

A verdict holds: once a rank is gone here it stays gone, with the first reason given, and the
order in which losses were found is kept (`first` is the earliest). So the answer never shrinks
as a transport closes, and the waits, the watchdog and the shrink that ask at different times
agree. Sources are asked from any thread; a lock keeps one asking at a time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

Source = Callable[[], Mapping[int, str]]


def process_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) is all we have


class Liveness:
    """The ranks of one communicator known to be gone (its transports' sources, asked on
    demand), and why."""

    def __init__(self) -> None:
        self._sources: list[list] = []   # [source, every_s, next time it may be asked]
        self._gone: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, source: Source, every_s: float = 0.0) -> None:
        """Ask `source` from now on, at most every `every_s` seconds."""
        with self._lock:
            self._sources.append([source, every_s, 0.0])

    def include(self, other: Liveness, ranks: list[int]) -> None:
        """Ask `other` too: the liveness of a part over `ranks` of this communicator (its rank
        i is this one's ranks[i])."""
        self.add(lambda: {ranks[r]: why for r, why in other.gone().items()})

    def report(self, rank: int, why: str) -> None:
        """Record that `rank` is gone (what a transport learned outside its sources)."""
        with self._lock:
            self._gone.setdefault(rank, why)

    def gone(self) -> dict[int, str]:
        """Every rank known to be gone -> what happened, in the order they were found."""
        with self._lock:
            self._ask()
            return dict(self._gone)

    def first(self) -> tuple[int, str] | None:
        """The first rank found gone and what happened to it; None while all seem alive."""
        with self._lock:
            if not self._gone:
                self._ask()
            return next(iter(self._gone.items()), None)

    def _ask(self) -> None:
        now = time.monotonic()
        for entry in self._sources:
            source, every_s, due = entry
            if now < due:
                continue
            entry[2] = now + every_s
            for rank, why in source().items():
                self._gone.setdefault(rank, why)
