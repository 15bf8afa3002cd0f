"""What `anyccl run` starts in each rank: arm the parent-death signal, then run the user's
script (or module) as __main__, so that no rank outlives a launcher that was killed."""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from . import settings

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = settings.LAUNCHER_PID.get() or 0
    if launcher and os.getppid() != launcher:  # the launcher died before the signal was armed
        os._exit(1)


def main() -> None:
    _die_with_launcher()
    mode, target, *args = sys.argv[1:]
    sys.argv = [target, *args]
    if mode == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
