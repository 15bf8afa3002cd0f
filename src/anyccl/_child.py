"""What `anyccl run` starts in each rank: arm the parent-death signal, then run the user's
script (or module) as __main__, so that no rank outlives a launcher that was killed."""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from . import settings
from .errors import AnycclError, PeerLostError

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = settings.LAUNCHER_PID.get() or 0
    if launcher and os.getppid() != launcher:  # the launcher died before the signal was armed
        os._exit(1)


def lost_marker(job_id: str, rank: int) -> str:
    """Where a rank that ends on an uncaught PeerLostError says which rank it lost, so the
    launcher blames that rank, not the ones that only reacted to its loss."""
    from .trace import flight_directory

    return os.path.join(flight_directory(job_id), f"lost-by-rank{rank}")


def main() -> None:
    _die_with_launcher()
    mode, target, *args = sys.argv[1:]
    sys.argv = [target, *args]
    try:
        if mode == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except PeerLostError as exc:
        try:
            from . import private

            path = lost_marker(settings.JOB_ID.get() or "local", int(os.environ["RANK"]))
            private.write(path, str(exc.lost_rank).encode())
        except (OSError, KeyError, ValueError, AnycclError):
            pass
        raise


if __name__ == "__main__":
    main()
