"""The cores anyccl's processes and threads run on.

A launcher may bind each rank to one core or a few (Open MPI binds ranks to cores by default,
Slurm's `--cpu-bind`, `taskset`). `available()` says how many a rank has, so that its waits
yield the core where a host's ranks outnumber their cores.

anyccl's service threads -- the rendezvous store's server, the heartbeat between hosts, the
watcher of departures -- must answer while the rank that hosts them spins in a wait or in an MPI
call. Bound to that rank's core beside busy peers they can go unscheduled for seconds (measured:
the job's store, a child of a bound rank 0, answered nothing for 10 s while the shrinking ranks
spun), and their silence then reads as a lost store or a lost host. So they run on the cores
the rank's launcher may use (`serve_from_launcher_cores`): the cores the job was given on this
host, not only the rank's own.
"""

from __future__ import annotations

import os


def available() -> int:
    """The cores this process may run on (its affinity mask, which taskset, cgroups' cpusets
    and launchers' binding narrow), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launcher_cores() -> set[int] | None:
    """The cores this process's launcher may run on (its parent's affinity mask: mpiexec's
    proxy, Open MPI's daemon, slurmstepd, `anyccl run`), where they are more than this
    process's own (the launcher bound it); else None."""
    try:
        mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):
        return None
    return set(theirs) if theirs > mine else None


def serve_from(cores: set[int] | None) -> None:
    """Let the calling thread, and the threads it starts from now on, run on `cores` (None:
    leave it as it is). Best effort: where Linux refuses (a cpuset without those cores), the
    thread stays where it was."""
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)   # 0: the calling thread
    except (AttributeError, OSError):
        pass


def serve_from_launcher_cores() -> None:
    """At the start of a service thread: run on the launcher's cores (`launcher_cores`), not
    only on the core the rank was bound to."""
    serve_from(launcher_cores())
