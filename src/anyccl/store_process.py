"""The job's rendezvous store in a process of its own, for jobs that go on when a rank dies.

Under mpiexec, SLURM or a tcp:// address, rank 0 serves the store (`store.StoreServer`) from a
thread of its own process, so the store dies with rank 0, and survivors that lose rank 0 have
nowhere to meet and shrink. With ANYCCL_KEEP_GOING=1 rank 0 starts it as a process of its own
instead (`start`), in a process group of its own (signals to rank 0's group, as launchers send
them, do not reach it), which outlives any rank: it ends once it has had clients and none has
been connected for `LINGER_S`, or when nobody came in time. The job key reaches it on its
standard input, never on its command line.

It stays in rank 0's session, and runs on the cores rank 0's launcher may use, not only on the
core a launcher bound rank 0 to. Where Linux groups a session's processes for scheduling
(autogroup, on by default), a group that mostly sleeps gets so little weight each time it wakes
that beside busy processes of other groups on its core its threads waited on the run queue for
up to 20 s (measured, kernel 6.18), and ranks gave up on a store that was alive. In rank 0's
session it belongs to the group of the ranks it serves, and off rank 0's core it is not left
alone there when rank 0 dies.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from .errors import RendezvousError
from .store import StoreServer

LINGER_S = 5.0   # how long the store outlives its last client
_POLL_S = 0.5


def start(job_key: bytes, host: str, port: int, timeout_s: float) -> tuple[str, int, int]:
    """Start the store on `host`:`port` (0: any free port) in a process of its own; its
    (host, port, pid) once it listens. It ends by itself if no rank connects within `timeout_s`.
    RendezvousError if it cannot start (the port is taken, the address is not this host's)."""
    proc = subprocess.Popen([sys.executable, "-m", "anyccl.store_process"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps({"key": job_key.hex(), "host": host, "port": port,
                                     "first_s": timeout_s,
                                     "cores": _launcher_cores()}).encode() + b"\n")
        proc.stdin.close()
        ready, _, _ = select.select([proc.stdout], [], [], max(timeout_s, 10.0))
        line = proc.stdout.readline().decode().split() if ready else []
    finally:
        proc.stdout.close()
    if line[:1] != ["ok"]:
        proc.kill()
        proc.wait()
        why = " ".join(line[1:]) or "it did not say where it listens"
        raise RendezvousError(f"cannot start the rendezvous store's own process on "
                              f"{host}:{port}: {why}")
    return line[1], int(line[2]), proc.pid


def _launcher_cores() -> list[int] | None:
    """The cores rank 0's launcher may run on (its parent's affinity mask), where the launcher
    bound rank 0 to fewer (Open MPI binds ranks to cores, Slurm's --cpu-bind); else None."""
    try:
        mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):
        return None
    return sorted(theirs) if theirs > mine else None


def _serve() -> None:
    """The store process: serve until the last client has been gone for LINGER_S."""
    os.setpgid(0, 0)   # its own process group, in rank 0's session (see above)
    config = json.loads(sys.stdin.readline())
    if config.get("cores"):   # before its threads start: they take the same cores
        try:
            os.sched_setaffinity(0, config["cores"])
        except OSError:
            pass
    try:
        server = StoreServer(bytes.fromhex(config["key"]), host=config["host"],
                             port=config["port"])
    except RendezvousError as exc:
        print(f"error {exc}", flush=True)
        return
    print(f"ok {server.host} {server.port}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)   # the parent's pipe closes; nothing more is written there
    began, idle_since = time.monotonic(), None
    while True:
        time.sleep(_POLL_S)
        now = time.monotonic()
        if server.clients:
            idle_since = None
        elif server.served:
            idle_since = idle_since or now
            if now - idle_since >= LINGER_S:
                break
        elif now - began >= float(config["first_s"]) + LINGER_S:
            break
    server.close()


if __name__ == "__main__":
    _serve()
