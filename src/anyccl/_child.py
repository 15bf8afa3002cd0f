"""What `anyccl run` starts in each rank: arm the parent-death signal, then run the user's
script (or module) as __main__, so that no rank outlives a launcher that was killed."""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback
from types import TracebackType

from . import settings
from ._console import say
from .errors import AnycclError, CollectiveMismatchError, PeerLostError, TimeoutError

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
    """Where a rank that ends on an error another rank caused (an uncaught PeerLostError: the
    rank it lost; a CollectiveMismatchError because a rank refused its arguments: that rank; a
    TimeoutError waiting for ranks in no operation: the first of them) says which rank that
    was, so the launcher blames it, not the ones that only reacted."""
    from .trace import flight_directory

    return os.path.join(flight_directory(job_id), f"lost-by-rank{rank}")


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its first frames of this module and runpy: the user's code only."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or
                              tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def _shown_frames(tb: TracebackType | None) -> tuple[TracebackType | None, int]:
    """`tb` as the user reads it, and how many frames it leaves out: from their code on, and
    of each run of anyccl's own frames only the first, the call their code made (all of them
    with ANYCCL_FULL_TRACEBACK)."""
    tb = _user_frames(tb)
    if settings.FULL_TRACEBACK.get():
        return tb, 0
    kept: list[TracebackType] = []
    inside_before, hidden = False, 0
    while tb is not None:
        inside = os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)
        if inside and inside_before:
            hidden += 1
        else:
            kept.append(tb)
        inside_before, tb = inside, tb.tb_next
    shown = None
    for frame in reversed(kept):
        shown = TracebackType(shown, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return shown, hidden


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
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        # one line, not a traceback per rank: where the interrupt found this rank
        where = traceback.extract_tb(_user_frames(exc.__traceback__))
        at = f" at {where[-1].filename}:{where[-1].lineno}" if where else ""
        say(f"KeyboardInterrupt{at}")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)   # end as an interrupted process does
    except BaseException as exc:
        if isinstance(exc, PeerLostError):
            _note_cause(exc.lost_rank)
        elif isinstance(exc, CollectiveMismatchError) and exc.refused_by:
            _note_cause(exc.refused_by[0])
        elif isinstance(exc, TimeoutError) and exc.waited_for:
            _note_cause(exc.waited_for[0])
        shown, hidden = _shown_frames(exc.__traceback__)
        traceback.print_exception(type(exc), exc.with_traceback(shown), shown)
        sys.stderr.flush()
        if hidden:
            say(f"({hidden} frame{'s' if hidden > 1 else ''} inside anyccl not shown; "
                f"{settings.FULL_TRACEBACK.name}=1 shows them)")
        sys.exit(1)   # what Python exits with on an uncaught exception


def _note_cause(rank: int) -> None:
    """Tell the launcher which rank caused this one's failure (see `lost_marker`)."""
    try:
        from . import private

        path = lost_marker(settings.JOB_ID.get() or "local", int(os.environ["RANK"]))
        private.write(path, str(rank).encode())
    except (OSError, KeyError, ValueError, AnycclError):
        pass


if __name__ == "__main__":
    main()
