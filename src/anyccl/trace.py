"""What an operation is, for the messages that name it: op name, sequence number, arguments."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class OpRecord:
    """One operation issued on a communicator.

    `seq` counts the communicator's collectives (every rank numbers them alike) or, for
    point-to-point ops, the messages on that (peer, direction).
    """

    name: str
    seq: int
    args: str = ""
    nbytes: int = 0
    issued_at: float = field(default_factory=time.monotonic)

    def __str__(self) -> str:
        return f"{self.name}({self.args}) #{self.seq}"


def format_bytes(n: int) -> str:
    """12 B, 4 KiB, 1.5 MiB: sizes as people read them."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.4g} {unit}"
        value /= 1024
    return f"{n} B"


class FlightRecorder:
    """The last `capacity` operations of one communicator on this rank, with their states
    (queued, started, done, failed) and times, for post-mortems of hangs and lost peers."""

    def __init__(self, rank: int, name: str, capacity: int = 64) -> None:
        from collections import deque

        self.rank, self.name = rank, name
        self._entries: deque[dict] = deque(maxlen=capacity)
        self.dumped_to: str | None = None

    def queued(self, record: OpRecord) -> dict:
        entry = {"op": record.name, "seq": record.seq, "args": record.args,
                 "bytes": record.nbytes, "state": "queued", "queued_at": time.time(),
                 "started_at": None, "ended_at": None, "error": None}
        self._entries.append(entry)
        return entry

    @staticmethod
    def started(entry: dict) -> None:
        entry["state"], entry["started_at"] = "started", time.time()

    @staticmethod
    def ended(entry: dict, error: BaseException | None = None) -> None:
        entry["state"] = "done" if error is None else "failed"
        entry["ended_at"] = time.time()
        if error is not None:
            entry["error"] = f"{type(error).__name__}: {error}"

    def entries(self) -> list[dict]:
        return list(self._entries)

    def dump(self, directory: str) -> str:
        """Write the entries as JSON to `directory`/flight-<name>-rank<r>.json; return the path."""
        import json
        import os

        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, f"flight-{self.name}-rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "communicator": self.name, "pid": os.getpid(),
                       "written_at": time.time(), "ops": self.entries()}, f, indent=1)
        self.dumped_to = path
        return path


def flight_directory(job_id: str) -> str:
    """Where ranks of job `job_id` write flight records (ANYCCL_FLIGHT_DIR overrides)."""
    import os
    import tempfile

    from . import settings

    root = settings.FLIGHT_DIR.get() or tempfile.gettempdir()
    return os.path.join(root, f"anyccl-{job_id}")
