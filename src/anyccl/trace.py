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
