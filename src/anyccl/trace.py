"""What an operation is, for the messages that name it: op name, sequence number, arguments.

Both are made for every operation, so both are cheap: an `OpRecord` formats its argument text
only when something reads it (an error message, a dump), and a flight-recorder entry is a short
list that becomes a dict only when the record is dumped.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Union

_NEVER = float("inf")

# an operation's argument text: the text, or (function, *arguments) that make it when read
ArgsText = Union[str, tuple]


class _OpRecord:
    """One operation issued on a communicator, and its flight-recorder entry.

    `seq` counts the communicator's collectives (every rank numbers them alike) or, for
    point-to-point ops, the messages on that (peer, direction). `args` may be given as a tuple
    (function, *arguments) whose call makes the text, once, when it is first read. `state` is
    "queued", "started", "done" or "failed" (with `error`); the times are monotonic seconds;
    `replayed`: a GPU call that took no checks of its own but replayed an earlier call's plan.
    A host operation's record is also its options for the backend (backends/base.py): its
    signature `agree` and its `deadline`, set when it starts.
    """

    __slots__ = ("name", "seq", "nbytes", "issued_at", "_args", "agree", "deadline", "state",
                 "started_at", "ended_at", "error", "replayed")

    def __init__(self, name: str, seq: int, args: ArgsText = "", nbytes: int = 0) -> None:
        self.name, self.seq, self.nbytes = name, seq, nbytes
        self._args = args
        self.issued_at = time.monotonic()
        # a host collective's signature (agreement.py), which the backend compares across
        # ranks before any byte moves; None for messages and GPU operations
        self.agree: tuple | None = None
        self.deadline = _NEVER   # set when it starts (the host engine, the GPU queue)
        self.state = "queued"
        self.started_at = self.ended_at = self.error = None
        self.replayed = False   # a GPU call that replayed the plan of an earlier one (plans.py)

    @property
    def args(self) -> str:
        if type(self._args) is tuple:
            make, *values = self._args
            self._args = make(*values)
        return self._args

    def __str__(self) -> str:
        return f"{self.name}({self.args}) #{self.seq}"

    def __repr__(self) -> str:
        return f"OpRecord({self})"


if TYPE_CHECKING:
    OpRecord = _OpRecord
else:
    try:   # the same record compiled (_recordcore.c): a third of the construction's time
        from ._recordcore import OpRecord
    except ImportError:   # where it could not be built
        OpRecord = _OpRecord


def format_bytes(n: int) -> str:
    """12 B, 4 KiB, 1.5 MiB: sizes as people read them."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.4g} {unit}"
        value /= 1024
    return f"{n} B"


# a flight-recorder entry is the operation's record itself
Entry = OpRecord


class FlightRecorder:
    """The last `capacity` operations of one communicator on this rank, with their states
    (queued, started, done, failed) and times, for post-mortems of hangs and lost peers."""

    def __init__(self, rank: int, name: str, capacity: int = 64) -> None:
        self.rank, self.name = rank, name
        self._entries: deque[Entry] = deque(maxlen=capacity)
        # `queued` without returning the record: the deque's own append, for the hot path
        self.add = self._entries.append
        self.dumped_to: str | None = None

    def queued(self, record: OpRecord) -> Entry:
        self._entries.append(record)
        return record

    @staticmethod
    def started(entry: Entry) -> None:
        entry.state, entry.started_at = "started", time.monotonic()

    @staticmethod
    def ended(entry: Entry, error: BaseException | None = None) -> None:
        entry.ended_at = time.monotonic()
        if error is None:
            entry.state = "done"
        else:
            entry.state, entry.error = "failed", f"{type(error).__name__}: {error}"

    def records(self) -> list[OpRecord]:
        """The operations recorded, oldest first."""
        return list(self._entries)

    def entries(self) -> list[dict]:
        """The entries, oldest first, as dicts (op, seq, args, bytes, state, wall-clock times,
        error, whether a GPU call replayed a plan)."""
        offset = time.time() - time.monotonic()

        def wall(t: float | None) -> float | None:
            return None if t is None else t + offset

        return [{"op": r.name, "seq": r.seq, "args": r.args, "bytes": r.nbytes, "state": r.state,
                 "queued_at": wall(r.issued_at), "started_at": wall(r.started_at),
                 "ended_at": wall(r.ended_at), "error": r.error, "replayed": r.replayed}
                for r in self.records()]

    def dump(self, directory: str) -> str:
        """Write the entries as JSON to `directory`/flight-<name>-rank<r>.json (a directory
        `flight_directory` checked; the file replaced atomically, never followed through a
        link); return the path."""
        import json
        import os

        from . import private

        path = os.path.join(directory, f"flight-{self.name}-rank{self.rank}.json")
        private.write(path, json.dumps(
            {"rank": self.rank, "communicator": self.name, "pid": os.getpid(),
             "written_at": time.time(), "ops": self.entries()}, indent=1).encode())
        self.dumped_to = path
        return path


def flight_directory(job_id: str) -> str:
    """Where ranks of job `job_id` write flight records: a directory of this user only (0700,
    checked: see private.py), under ANYCCL_FLIGHT_DIR if set, else under the user's anyccl
    directory. Created here."""
    from . import private, settings

    return private.job_directory(job_id, settings.FLIGHT_DIR.get())


def about(x: Any, more: str = "", *values: Any) -> tuple:
    """An op record's argument text, made when read: array `x` as "float32 x 4", then `more`
    formatted with `values` (str.format). Records are kept (flight recorder, plans), so the
    text captures `x`'s dtype and size, never `x`: a record keeps no array alive."""
    return (about_text, x.dtype, x.size, more, values)


def about_text(dtype: Any, size: int, more: str, values: tuple) -> str:
    return f"{dtype.name} x {size}{more.format(*values)}"


def message_text(kind: str, peer: int | None, tag: int, nbytes: int, src: int | None) -> str:
    """A message's argument text ("dst=1, tag=0, 8 B"), made when first read."""
    if kind == "sendrecv":
        return (f"dst={peer}, src={'any' if src is None else src}, tag={tag}, "
                f"{format_bytes(nbytes)}")
    arrow = "dst" if kind == "send" else "src"
    return f"{arrow}={'any' if peer is None else peer}, tag={tag}, {format_bytes(nbytes)}"

