"""`anyccl run`: start N ranks on this machine, stream their output, and stop them together.

With torchrun's multi-node flags (`--nnodes N --node-rank I --master-addr HOST --master-port
PORT`), one launcher per machine starts that machine's ranks of one job: node 0's serves the
store at HOST:PORT (keyed by ANYCCL_JOB_KEY or a key file every node reads), every node's
ranks get RANK = I * n + LOCAL_RANK, and MASTER_PORT = PORT + 1 for torch's own store.

The launcher serves the rendezvous store (loopback, keyed by a fresh job secret), starts each
rank with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, the store's address, and the
MASTER_ADDR / MASTER_PORT torchrun would give (a free port for torch's own store), and watches
them. When a rank
exits non-zero or dies, the others get SIGTERM, then SIGKILL after a grace period, and the
launcher exits with the first failing rank's code (with `--keep-going`, the others run on,
for a job that shrinks its communicator: recovery.py). Ctrl-C and SIGTERM stop every rank. Ranks
die with the launcher (PR_SET_PDEATHSIG), and shared-memory segments of the job are removed.
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, TextIO

from . import settings
from ._console import say
from .errors import AnycclError
from .store import StoreServer

GRACE_S = 3.0
_REACTION_GRACE_S = 1.0  # how long a rank that lost a peer may wait for the rank it lost
_POLL_S = 0.02


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


_TRACEBACK_START = b"Traceback (most recent call last):\n"
_TRACEBACK_LINKS = (_TRACEBACK_START, b"\n",
                    b"During handling of the above exception, another exception occurred:\n",
                    b"The above exception was the direct cause of the following exception:\n")
_LONGEST_BLOCK = 2000   # lines: a traceback longer than this is passed on in parts


def _ends_traceback(line: bytes) -> bool:
    """Whether `line` is a traceback's last: the exception itself, the first line neither
    indented (frames, source, carets) nor linking one exception to the next."""
    return not line.startswith((b" ", b"\t")) and line not in _TRACEBACK_LINKS


class _LineRelay:
    """Copies every rank's output to the launcher's own stdout/stderr a whole line at a time.

    Ranks run unbuffered (their output shows as it is printed), so one `print` may reach the
    pipe in several writes; a line is passed on only once it is complete, with one write under
    a lock shared by every rank, so lines of different ranks never mix. A traceback is passed on
    whole, in one write (untagged: after a line saying whose it is), so the tracebacks of
    several failing ranks never interleave. A last line without a newline is passed on, with
    one, when the rank closes its end.
    """

    def __init__(self, tag_output: bool) -> None:
        self.tag_output = tag_output
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def follow(self, stream: IO[bytes], rank: int, out: TextIO) -> None:
        t = threading.Thread(target=self._pump, args=(stream, rank, out), daemon=True,
                             name=f"anyccl-run-output-{rank}")
        t.start()
        self._threads.append(t)

    def _pump(self, stream: IO[bytes], rank: int, out: TextIO) -> None:
        prefix = f"[rank {rank}] ".encode() if self.tag_output else b""
        block: list[bytes] = []   # a traceback being read: passed on whole, never interleaved
        chained = False           # only the links of a chained exception since the last one
        try:
            for line in iter(stream.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if block or line == _TRACEBACK_START:
                    if not block and not self.tag_output and not chained:
                        block.append(f"anyccl run: rank {rank} raised:\n".encode())
                    block.append(prefix + line)
                    if _ends_traceback(line) or len(block) > _LONGEST_BLOCK:
                        self._write(out, b"".join(block))
                        block, chained = [], True
                    continue
                chained = chained and line in _TRACEBACK_LINKS
                self._write(out, prefix + line)
            if block:
                self._write(out, b"".join(block))
        except ValueError:  # the launcher's own stream was closed under us: nothing to copy to
            pass
        finally:
            stream.close()

    def _write(self, out: TextIO, data: bytes) -> None:
        with self._lock:
            out.flush()  # what the launcher itself printed comes first
            raw = getattr(out, "buffer", None)
            if raw is None:  # a text-only stream (one a caller swapped in)
                out.write(data.decode(errors="replace"))
                out.flush()
            else:
                raw.write(data)
                raw.flush()

    def join(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_job_segments(job_id: str) -> list[str]:
    """Delete shared-memory segments left by job `job_id` (only its own, by name)."""
    removed = []
    for path in glob.glob(f"/dev/shm/anyccl-{job_id}-*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit in a job of several machines (torchrun's flags):
    `count` nodes of `nprocs` ranks each, this one number `rank`; node 0's launcher serves the
    rendezvous store at `master_addr:master_port`, keyed by ANYCCL_JOB_KEY or `key_file`."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    key_file: str | None = None


def job_key_for(nodes: Nodes, env: dict, timeout_s: float = 60.0) -> bytes:
    """The secret every node's ranks prove to the store: ANYCCL_JOB_KEY (hex), else the
    contents of `nodes.key_file` (hex; node 0 writes a fresh one, 0600, where none exists;
    the other nodes wait up to `timeout_s` for it on a filesystem they share)."""
    text = env.get(settings.JOB_KEY.name)
    if not text and nodes.key_file:
        from . import private

        path = nodes.key_file
        if nodes.rank == 0 and not os.path.exists(path):
            private.write(path, secrets.token_hex(32).encode())
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            text = private.read(path).decode().strip()
        except OSError as exc:
            raise AnycclError(f"anyccl run: cannot read the job key file {path}: "
                              f"{exc.strerror or exc}") from None
    if not text:
        raise AnycclError(f"anyccl run: a job on {nodes.count} nodes needs a secret every node "
                          f"knows: export {settings.JOB_KEY.name}=$(python -c 'import secrets; "
                          f"print(secrets.token_hex(32))') on every node, or pass --job-key-file "
                          f"PATH on a filesystem they share")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise AnycclError("anyccl run: the job key is not hexadecimal digits") from None


def check_before_start(target: str, module: bool, backend: str | None,
                       command: str = "anyccl run") -> None:
    """AnycclError, said once before any rank starts, when the job cannot run: `target` is no
    file (or no importable module), or the backend (given or ANYCCL_BACKEND) is unknown, is
    mpi (whose ranks mpiexec starts), or needs a GPU this machine does not have."""
    if module:
        if not _module_found(target):
            raise AnycclError(f"{command}: -m {target}: no module of that name can be imported "
                              f"from {os.getcwd()}")
    elif not os.path.isfile(target):
        raise AnycclError(f"{command}: {target}: no such file" + (
            "" if os.path.isabs(target) else f" (looked in {os.getcwd()})"))
    try:
        check_backend(backend or settings.BACKEND.get(),
                      named_by=None if backend else settings.BACKEND.name)
    except AnycclError as exc:
        raise AnycclError(f"{command}: {exc}") from None


def check_backend(backend: str | None, mpiexec_starts: bool = False,
                  named_by: str | None = None) -> None:
    """See `check_before_start`: the backend's part (`mpiexec_starts`: the command starts the
    ranks with mpiexec itself, so mpi is fine). Errors name where the backend came from: the
    --backend option, or the environment variable `named_by`."""
    if not backend:
        return
    from .bootstrap import parse_backend

    where = f"{named_by}={backend}" if named_by else f"--backend {backend}"
    try:
        host, gpu_backend = parse_backend(backend)
    except AnycclError as exc:
        raise AnycclError(f"{where}: {exc}") from None
    if host == "mpi" and not mpiexec_starts:
        raise AnycclError(f"{where}: the mpi backend's ranks are "
                          f"started by mpiexec: mpiexec -n N python SCRIPT (pip install mpich "
                          f"mpi4py)")
    if gpu_backend is not None:
        from . import gpu

        if gpu.device_count() == 0:
            raise AnycclError(f"{where}: {gpu_backend} runs on CUDA "
                              f"GPUs, and none is visible here")


def _module_found(name: str) -> bool:
    """Whether `python -m name`, started in this directory, would find the module."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())


def run(nprocs: int, target: str, args: list[str], *, module: bool = False,
        backend: str | None = None, tag_output: bool = False, env: dict | None = None,
        nodes: Nodes | None = None, keep_going: bool = False, replace: bool = False) -> int:
    """Run `target` (a script path, or a module with `module=True`) on `nprocs` ranks of this
    machine (of every node, with `nodes`); return the exit code the launcher should exit with.
    keep_going: a rank that dies does not stop the others (`_watch_keep_going`); replace:
    and a new process (ANYCCL_NEWCOMER=1) starts in its place, once per rank."""
    import hashlib

    from .bootstrap import new_job_id

    check_before_start(target, module, backend)
    base_env = dict(os.environ if env is None else env)
    server: StoreServer | None
    if nodes is None or nodes.count == 1 and nodes.rank == 0 and not nodes.master_addr:
        job_key = secrets.token_bytes(32)
        job_id = new_job_id(secrets.token_hex(4))
        server = StoreServer(job_key, host="127.0.0.1")
        store_address = server.address
        first_rank, world = 0, nprocs
        # what torchrun exports too, so a torch.distributed script starts here unchanged
        # (env://: its rank 0 serves torch's own store on this free port)
        master = ("127.0.0.1", _free_port())
    else:
        job_key = job_key_for(nodes, base_env)
        # the same on every node
        job_id = new_job_id(hashlib.sha256(job_key).hexdigest()[:8])
        server = StoreServer(job_key, host=_bind_address(nodes.master_addr),
                             port=nodes.master_port) if nodes.rank == 0 else None
        store_address = f"{nodes.master_addr}:{nodes.master_port}"
        first_rank, world = nodes.rank * nprocs, nodes.count * nprocs
        master = (nodes.master_addr, nodes.master_port + 1)   # torch's own store, if used
    base_env.update({
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": str(0 if nodes is None else nodes.rank),
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        settings.STORE.name: store_address, settings.JOB_KEY.name: job_key.hex(),
        settings.JOB_ID.name: job_id, settings.LAUNCHER_PID.name: str(os.getpid()),
        "PYTHONUNBUFFERED": base_env.get("PYTHONUNBUFFERED", "1"),
    })
    if backend:
        base_env[settings.BACKEND.name] = backend
    if keep_going:
        base_env[settings.KEEP_GOING.name] = "1"
    ranks: list[RankProcess] = []
    relay = _LineRelay(tag_output)
    stop_requested: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop_requested.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    def start(rank: int, local: int, **more: str) -> RankProcess:
        rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(local), **more)
        cmd = [sys.executable, "-m", "anyccl._child", "-m" if module else "-s", target, *args]
        proc = subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        ranks.append(RankProcess(rank, proc))
        relay.follow(proc.stdout, rank, sys.stdout)
        relay.follow(proc.stderr, rank, sys.stderr)
        return ranks[-1]

    def start_replacement(dead: RankProcess) -> RankProcess:
        return start(dead.rank, dead.rank - first_rank, **{settings.NEWCOMER.name: "1"})

    try:
        for local in range(nprocs):
            start(first_rank + local, local)
        if keep_going:
            code = _watch_keep_going(ranks, stop_requested, start_replacement if replace
                                     else None)
        else:
            code = _watch(ranks, stop_requested, job_id)
    finally:
        for rp in ranks:
            if rp.proc.poll() is None:
                rp.proc.kill()
                rp.proc.wait()
        relay.join(timeout_s=5.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if server is not None:
            server.close()
        for path in remove_job_segments(job_id):
            say(f"anyccl run: removed leftover shared memory {path}")
        if code != 0:
            print_flight_summary(job_id)
        else:  # nothing to look at: the job's private directory goes
            remove_job_directory(job_id)
    return code


def _bind_address(master_addr: str) -> str:
    """Where node 0's launcher listens: the address `master_addr` names (it must be this
    machine's), loopback for a loopback name."""
    import socket

    from .netaddr import is_loopback

    if is_loopback(master_addr):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(master_addr)
    except OSError as exc:
        raise AnycclError(f"anyccl run: --master-addr {master_addr}: cannot resolve it "
                          f"({exc})") from None


def remove_job_directory(job_id: str) -> None:
    """Delete job `job_id`'s private directory (flight records, markers) if it exists."""
    from . import private
    from .trace import flight_directory

    try:
        private.remove_tree(flight_directory(job_id))
    except (AnycclError, OSError):   # checked or removed by another host's launcher meanwhile
        pass


def print_flight_summary(job_id: str) -> None:
    """After a failure: what each rank was doing, from the flight records ranks wrote."""
    import json

    from . import private
    from .trace import flight_directory

    try:
        directory = flight_directory(job_id)
    except AnycclError as exc:
        say(f"anyccl run: {exc}")
        return
    records = []
    for path in sorted(glob.glob(os.path.join(directory, "flight-*.json"))):
        try:
            records.append(json.loads(private.read(path)))
        except (OSError, ValueError):
            continue
    if not records:
        try:
            os.rmdir(directory)   # made by looking (flight_directory); an empty one says nothing
        except OSError:
            pass
        return
    say(f"anyccl run: flight records in {directory}:")
    for rec in sorted(records, key=lambda r: (r["communicator"], r["rank"])):
        ops = rec["ops"]
        pending = [o for o in ops if o["state"] in ("started", "queued", "failed")]
        last = pending[0] if pending else (ops[-1] if ops else None)
        what = f"{last['op']}({last['args']}) #{last['seq']} {last['state']}" if last else "-"
        done = sum(o["state"] == "done" for o in ops)
        say(f"  {rec['communicator']} rank {rec['rank']}: {what}; {done} of its last "
            f"{len(ops)} operation{'s' if len(ops) != 1 else ''} done")


def _lost_by(job_id: str, rank: int) -> int | None:
    """The rank that caused `rank`'s failure, where it said so (`_child.lost_marker`)."""
    from . import private
    from ._child import lost_marker

    try:
        return int(private.read(lost_marker(job_id, rank)))
    except (OSError, ValueError, AnycclError):
        return None


def _watch(ranks: list[RankProcess], stop_requested: list[int], job_id: str) -> int:
    first_failure: RankProcess | None = None
    cause: tuple[int, str] | None = None
    stopped = False
    grace_until = 0.0
    while True:
        if stop_requested:
            return _stop_on_request(ranks, stop_requested[0])
        running = [rp for rp in ranks if rp.proc.poll() is None]
        failed = [rp for rp in ranks if rp.proc.returncode not in (None, 0)]
        if failed and first_failure is None:
            lost = {rp.rank: _lost_by(job_id, rp.rank) for rp in failed}
            reacting = {r for r, j in lost.items() if j is not None}
            if len(reacting) == len(failed) and running and \
                    time.monotonic() < (grace_until := grace_until or
                                        time.monotonic() + _REACTION_GRACE_S):
                time.sleep(_POLL_S)  # only ranks that lost a peer so far: wait for the cause
                continue
            # Seen in the same poll, a rank killed by a signal is the likelier cause: the others
            # often exit because they lost it; and a rank that ended on a lost peer is not.
            first_failure = min(failed, key=lambda rp: (rp.rank in reacting,
                                                        rp.proc.returncode >= 0, rp.rank))
            cause = _cause(ranks, running, first_failure, lost.get(first_failure.rank))
            stopped = bool(running)
            if stopped:
                _stop(ranks)
            break
        if not running:
            break
        time.sleep(_POLL_S)
    if first_failure is None:
        return 0
    then = "; the other ranks were stopped" if stopped else ""
    if cause is not None:
        say(f"anyccl run: rank {cause[0]} failed first: it {cause[1]}; rank "
            f"{first_failure.rank} then {_describe(first_failure.proc.returncode)}{then}")
    else:
        say(f"anyccl run: rank {first_failure.rank} failed first: it "
            f"{_describe(first_failure.proc.returncode)}{then}")
    return _exit_code(first_failure.proc.returncode)


def _watch_keep_going(ranks: list[RankProcess], stop_requested: list[int],
                      replace: Callable[[RankProcess], RankProcess] | None) -> int:
    """`--keep-going`: report each rank that ends badly and let the others run on; with
    `replace` (`--replace`), start a new process in its place (once per rank: a replacement
    that dies is not replaced). The exit code: 0 when every process that was not killed by a
    signal exited 0 (and one at least ran to its end); else the first such one's code, or the
    signal's when every process was killed."""
    told: set[int] = set()
    while True:
        if stop_requested:
            return _stop_on_request(ranks, stop_requested[0])
        running = False
        for rp in list(ranks):
            code = rp.proc.poll()
            running = running or code is None
            if code not in (None, 0) and id(rp) not in told:
                told.add(id(rp))
                again = replace is not None and sum(r.rank == rp.rank for r in ranks) == 1
                say(f"anyccl run: rank {rp.rank} {_describe(code)}; the other ranks keep "
                    f"going (--keep-going)" + ("; a new process starts in its place, to join "
                                              "when they grow (--replace)" if again else ""))
                if again:
                    replace(rp)
                    running = True
        if not running:
            break
        time.sleep(_POLL_S)
    failed = [rp for rp in ranks if rp.proc.returncode > 0]
    if failed:
        return _exit_code(failed[0].proc.returncode)
    if all(rp.proc.returncode < 0 for rp in ranks):
        return _exit_code(ranks[0].proc.returncode)
    return 0


def _stop_on_request(ranks: list[RankProcess], signum: int) -> int:
    """The launcher got `signum` (Ctrl-C, SIGTERM): stop every rank; the exit code."""
    say(f"anyccl run: got {signal.Signals(signum).name}; stopping all ranks")
    _stop(ranks)
    return 128 + signum


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _cause(ranks: list[RankProcess], running: list[RankProcess], failed: RankProcess,
           lost: int | None) -> tuple[int, str] | None:
    """The rank that made `failed` fail, where it is not `failed` itself: a rank that is
    stopped (the others timed out waiting for it); the rank `failed` named (`lost`) when that
    one ended with code 0 (it left early, while `failed` still needed it) or still runs (it
    never arrived where `failed` timed out waiting for it)."""
    stopped = [rp for rp in running if _stopped(rp.proc.pid)]
    if stopped:
        return stopped[0].rank, "was stopped (by a signal such as SIGSTOP) while the others " \
                                "waited for it"
    by_rank = {rp.rank: rp for rp in ranks}
    if lost is not None and lost in by_rank:
        if by_rank[lost].proc.poll() == 0:
            return lost, f"exited early (code 0) while rank {failed.rank} still needed it"
        if by_rank[lost].proc.poll() is None:
            return lost, f"never arrived at the operation rank {failed.rank} timed out in"
    return None


def _stop(ranks: list[RankProcess]) -> None:
    for rp in ranks:
        if rp.proc.poll() is None:
            rp.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for rp in ranks:
        try:
            rp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            rp.proc.wait()
