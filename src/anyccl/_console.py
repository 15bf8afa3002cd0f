"""Lines for the terminal that the launcher and its ranks share."""

from __future__ import annotations

import os
import sys


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one write: lines of processes that share the
    terminal then never run into each other (print writes the text and the newline apart)."""
    sys.stderr.flush()
    data = (line + "\n").encode(errors="replace")
    while data:
        try:
            data = data[os.write(2, data):]
        except InterruptedError:
            continue
        except OSError:
            return   # stderr closed or a broken pipe: the line has nowhere to go
