"""Losing ranks and going on: every survivor of a communicator that lost ranks calls
`comm.shrink()` and gets a communicator of the survivors, ranked in their old order, that runs
every collective and message correctly (tests/scripts/shrink_after_kill.py checks them). Ranks
die by SIGKILL in the middle of an all_reduce loop: one rank, two at once, rank 0 (the lowest,
whose ranks all move), all but one, and one that dies after the survivors agreed on it (they go
round again without it); and in each kind of collective and message, where some survivors do
not wait on the lost rank (the others' revoke stops them); on one host (shm) and across two
simulated hosts (shm inside, gloo between), under `anyccl run --keep-going`. The mpi backend,
which cannot go on, says so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simhosts
from harness import openmpi_python, remove_mpi_leftovers, run_ranks
from simhosts import Cluster

import anyccl

pytestmark = pytest.mark.shm_only   # each job picks its own transport

SCRIPT = Path(__file__).parent / "scripts" / "shrink_after_kill.py"
DONE = re.compile(r"rank (\d+) of (\d+) -> rank (\d+) of (\d+): ok lost=\[([\d, ]*)\] "
                  r"seconds=([\d.]+)[^\n]*")


def _job(nprocs: int, victims: str, during: str = "", timeout_s: float = 120,
         **more: str) -> tuple[int, str]:
    env = dict(os.environ, VICTIMS=victims, DURING=during, KILL_AT="3", ANYCCL_TIMEOUT="30",
               PYTHONUNBUFFERED="1")
    env.pop("ANYCCL_BACKEND", None)   # each job picks its own, unless `more` names one
    env.update(more)
    done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(nprocs),
                           "--keep-going", str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("nprocs, victims, during, stage", [
    (4, "2", "", ""),           # one rank
    (4, "1,3", "", ""),         # two at once
    (4, "0", "", ""),           # rank 0: every survivor's rank moves
    (3, "0,2", "", ""),         # all but one: a communicator of one
    (5, "1", "2", "agree"),     # rank 2 dies after the survivors agreed on it: a second round
    (5, "1", "2", "build"),     # ... or once it built its side of the new transport
])
def test_survivors_shrink_and_run_every_collective_on_one_host(nprocs, victims, during, stage):
    code, text = _job(nprocs, victims, during, DURING_AT=stage or "agree")
    lost = sorted({int(v) for v in victims.split(",")} | ({int(during)} if during else set()))
    survivors = [r for r in range(nprocs) if r not in lost]
    done = {int(m[1]): m for m in DONE.finditer(text)}
    assert code == 0 and sorted(done) == survivors, text[-3000:]
    for old, m in done.items():
        assert int(m[2]) == nprocs and int(m[3]) == survivors.index(old), m[0]
        assert int(m[4]) == len(survivors) and m[5].replace(" ", "") == \
            ",".join(map(str, lost)), m[0]
    for r in lost:
        assert re.search(rf"rank {r} was killed by SIGKILL; the other ranks keep going", text)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("anyccl-") and
                _mine(f)], "shared memory left behind"


def test_the_torch_process_group_says_it_errored_and_shrinks_to_the_survivors():
    """torchft's shape: the group's allreduce fails, errored() names the error, and shrink()
    gives a group of the survivors that runs (the script checks every collective on it)."""
    pytest.importorskip("torch")
    code, text = _job(4, "1", TORCH_PG="1")
    done = {int(m[1]): m for m in DONE.finditer(text)}
    assert code == 0 and sorted(done) == [0, 2, 3], text[-3000:]


@pytest.mark.parametrize("kill_at", range(16))
def test_a_kill_in_any_kind_of_operation_is_survived_fast(kill_at):
    """The loop goes through every collective, a ring of sendrecvs and neighbour isend/irecv;
    rank 1 of 4 dies in operation `kill_at` (each kind twice over the cases). Survivors that
    were not waiting on it when it died learn of it from the others' revoke, so every survivor
    is on the shrunk communicator within seconds, far inside the 30 s deadline."""
    code, text = _job(4, "1", KILL_AT=str(kill_at), MIXED="1")
    done = {int(m[1]): m for m in DONE.finditer(text)}
    assert code == 0 and sorted(done) == [0, 2, 3], text[-3000:]
    assert all(float(m[6]) < 10 for m in done.values()), text[-2000:]


def _mine(name: str) -> bool:
    """Whether /dev/shm/`name` is this user's (other jobs of other users may run here)."""
    try:
        return os.stat(f"/dev/shm/{name}").st_uid == os.getuid()
    except OSError:
        return False


def test_without_keep_going_the_launcher_still_stops_every_rank():
    env = dict(os.environ, VICTIMS="1", KILL_AT="3", ANYCCL_TIMEOUT="30")
    env.pop("ANYCCL_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "3", str(SCRIPT)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "rank 1 failed first: it was killed by SIGKILL" in \
        done.stdout + done.stderr
    assert "-> rank" not in done.stdout


def check_shrink_refused_on_mpi(comm):
    with pytest.raises(anyccl.UnsupportedError, match="mpi backend cannot go on without a lost"):
        comm.shrink(timeout=5)
    x = np.ones(3)
    comm.all_reduce(x)                      # the communicator is still usable
    return bool(np.all(x == comm.size))


def _hydra() -> str | None:
    """Why a job cannot run under MPICH's mpiexec (Hydra) here, or None."""
    import shutil

    if shutil.which("mpiexec") is None:
        return "no mpiexec"
    try:
        version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mpiexec --version failed: {exc}"
    return None if "HYDRA" in version else "mpiexec is not MPICH's Hydra"


@pytest.mark.skipif(bool(_hydra()), reason=_hydra() or "")
@pytest.mark.parametrize("victim", ["0", "2"])
def test_under_mpiexec_the_survivors_shrink_also_without_rank_0(victim, tmp_path):
    """Under `mpiexec -disable-auto-cleanup` with ANYCCL_KEEP_GOING=1 (shm, one host), rank 0
    starts the store as a process of its own: when rank 0 itself dies, the others still meet
    there, shrink and run everything on the shrunk communicator. Hydra itself sometimes
    SIGKILLs every rank once one was killed (16 of 240 jobs in
    benchmarks/results/2026-11-29-ci2core-kills-at-random-points-under-mpiexec.md): a job in
    which no rank wrote a line is run again, three times at most."""
    pytest.importorskip("mpi4py")
    for attempt in range(3):
        out = tmp_path / str(attempt)
        out.mkdir()
        env = dict(os.environ, VICTIMS=victim, KILL_AT="3", ANYCCL_TIMEOUT="30",
                   PYTHONUNBUFFERED="1", ANYCCL_KEEP_GOING="1", OUT_DIR=str(out))
        env.pop("ANYCCL_BACKEND", None)
        # each rank's output to a file of its own: Hydra stops relaying once a rank was killed
        before = set(os.listdir("/dev/shm"))
        try:
            subprocess.run(["mpiexec", "-disable-auto-cleanup", "-n", "4", "sh", "-c",
                            f'exec "{sys.executable}" "{SCRIPT}" > "$OUT_DIR/rank$PMI_RANK" '
                            f'2>&1'], env=env, capture_output=True, text=True, timeout=120)
        finally:
            remove_mpi_leftovers(before)
        text = "\n".join(f.read_text() for f in sorted(out.glob("rank*")))
        if text.strip():
            break
    found = {int(m[1]): m for m in DONE.finditer(text)}
    assert sorted(found) == [r for r in range(4) if r != int(victim)], text[-3000:]
    assert all(m[5] == victim and int(m[4]) == 3 for m in found.values()), text[-2000:]


OPENMPI = openmpi_python()


@pytest.mark.skipif(not OPENMPI, reason="no Open MPI 5 environment (tests/install.sh makes "
                    "one as root; or set ANYCCL_TEST_OPENMPI_PYTHON)")
@pytest.mark.parametrize("victims, more", [
    ("2", {}),                                       # one rank, in an all_reduce loop
    ("0", {}),                                       # rank 0: every survivor's rank moves
    ("1,3", {}),                                     # two at once
    ("1", {"MIXED": "1", "KILL_AT": "5"}),           # in a broadcast, amid every kind
    ("1", {"DURING": "2", "DURING_AT": "agree"}),    # and another during the shrink
])
def test_on_the_mpi_backend_with_ulfm_the_survivors_shrink_and_go_on(victims, more):
    """Open MPI 5 run with `mpiexec --with-ft ulfm` reports a failed process instead of ending
    the job: the mpi backend's survivors raise PeerLostError naming it (MPI's own word), shrink
    (MPIX_Comm_shrink under recovery's agreement) and run every collective and message on the
    shrunk communicator."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = dict(os.environ, VICTIMS=victims, KILL_AT="3", ANYCCL_TIMEOUT="30",
               PYTHONUNBUFFERED="1", ANYCCL_KEEP_GOING="1", ANYCCL_BACKEND="mpi",
               PYTHONPATH=str(Path(anyccl.__file__).parents[1]))
    env.update(more)
    before = set(os.listdir("/dev/shm"))
    job = subprocess.Popen([str(Path(OPENMPI).parent / "mpiexec"), "--with-ft", "ulfm",
                            "--oversubscribe", *root, "-n", "4", OPENMPI, str(SCRIPT)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        text, _ = job.communicate()
        pytest.fail(f"the job did not end within 120 s:\n{text[-4000:]}")
    finally:
        remove_mpi_leftovers(before)
    done = subprocess.CompletedProcess(job.args, job.returncode)
    lost = sorted({int(v) for v in victims.split(",")} | ({int(more["DURING"])} if "DURING" in
                                                          more else set()))
    survivors = [r for r in range(4) if r not in lost]
    found = {int(m[1]): m for m in DONE.finditer(text)}
    assert done.returncode == 0 and sorted(found) == survivors, text[-3000:]
    for old, m in found.items():
        assert int(m[3]) == survivors.index(old) and m[5].replace(" ", "") == \
            ",".join(map(str, lost)), m[0]


def test_the_mpi_backend_says_it_cannot_shrink():
    pytest.importorskip("mpi4py")
    assert all(run_ranks(check_shrink_refused_on_mpi, 2, backend="mpi"))


WHY_NOT = Cluster.unavailable()


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
@pytest.mark.parametrize("victim, only", [
    ("3", ""),    # in an all_reduce loop
    ("1", "6"),   # in isend/irecv pairs: ranks 2 and 3 on h2 never wait on rank 1; they learn
                  # of the revoke from the store, and no survivor's Gloo wait aborts its exit
    ("1,3", ""),  # one rank of each host at once: the two survivors are on different hosts
])
def test_survivors_across_two_hosts_shrink_to_shm_and_gloo_and_go_on(victim, only):
    """h1 runs ranks 0 and 1, h2 ranks 2 and 3; one rank dies. The three others shrink:
    shared memory on the host with two of them, gloo between the hosts, and every collective
    right; every survivor exits 0."""
    key, port = "5e" * 32, 29460 + len(victim) + int(victim[0])
    with Cluster(2) as cluster:
        env = dict(os.environ, ANYCCL_JOB_KEY=key, ANYCCL_TIMEOUT="30", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", VICTIMS=victim, KILL_AT="3", ANYCCL_PEER_SILENCE="3",
                   ONLY=only, LOOP_S="25" if only else "0")
        env.pop("ANYCCL_BACKEND", None)
        results = cluster.run_job(2, port, ["--keep-going", str(SCRIPT)], env, 150)
        text = "\n".join(t for _, t in results)
        done = {int(m[1]): m for m in DONE.finditer(text)}
        lost = [int(r) for r in victim.split(",")]
        survivors = [r for r in range(4) if r not in lost]
        assert all(code == 0 for code, _ in results) and sorted(done) == survivors, text[-4000:]
        assert all(m[5] == ", ".join(map(str, lost)) and int(m[4]) == len(survivors)
                   for m in done.values()), text[-2000:]
        assert "terminate called" not in text, text[-2000:]
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


@pytest.mark.skipif(bool(WHY_NOT) or not OPENMPI, reason=WHY_NOT or "no Open MPI 5 environment")
@pytest.mark.parametrize("victims, more", [
    ("3", {}),                                       # one rank, in an all_reduce loop
    ("0", {}),                                       # rank 0: every survivor's rank moves
    ("1,3", {}),                                     # one of each host at once
    ("1", {"MIXED": "1", "KILL_AT": "5"}),           # in a broadcast, amid every kind
    ("1", {"DURING": "2", "DURING_AT": "agree"}),    # and another during the shrink
])
def test_survivors_across_two_hosts_shrink_to_shm_and_mpi_under_ulfm(victims, more):
    """Open MPI's mpirun with ULFM (`--with-ft ulfm`) across two hosts, two ranks each: MPI
    reports the failed process, the survivors raise PeerLostError, shrink (shared memory on
    each host, an MPI communicator of the survivors between them) and run every collective
    and message on the shrunk communicator; the job ends 0, nothing left in /dev/shm."""
    names = ["PYTHONPATH", "ANYCCL_TIMEOUT", "PYTHONUNBUFFERED", "ANYCCL_KEEP_GOING",
             "ANYCCL_JOB_KEY", "VICTIMS", "KILL_AT", *more]
    env = dict(os.environ, PATH=f"{Path(OPENMPI).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(Path(anyccl.__file__).parents[1]), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", ANYCCL_TIMEOUT="30", PYTHONUNBUFFERED="1",
               ANYCCL_KEEP_GOING="1", ANYCCL_JOB_KEY="7a" * 32, VICTIMS=victims, KILL_AT="3")
    env.update(more)
    env.pop("ANYCCL_BACKEND", None)
    with Cluster(2) as cluster:
        job = cluster.run(0, ["mpirun", "--with-ft", "ulfm", "--prtemca", "plm_ssh_agent",
                              cluster.ssh_stand_in(), "--host", "h1:2,h2:2", "-n", "4",
                              *[a for n in names for a in ("-x", n)], OPENMPI, str(SCRIPT)],
                          env=env)
        results = simhosts.finish([job], 120, cluster)
        code, text = results[0]
        lost = sorted({int(v) for v in victims.split(",")} | ({int(more["DURING"])} if "DURING"
                                                              in more else set()))
        survivors = [r for r in range(4) if r not in lost]
        found = {int(m[1]): m for m in DONE.finditer(text)}
        assert code == 0 and sorted(found) == survivors, text[-4000:]
        for old, m in found.items():
            assert int(m[3]) == survivors.index(old) and m[5].replace(" ", "") == \
                ",".join(map(str, lost)), m[0]
        on_both = {old // 2 for old in survivors}
        for line in (m[0] for m in found.values()):
            assert line.endswith(" on shm+mpi" if len(on_both) == 2 else " on shm"), line
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_when_a_host_is_cut_off_the_other_hosts_ranks_shrink_and_go_on(tmp_path):
    """h1 runs ranks 0 and 1, h2 ranks 2 and 3, looping on all_reduce; h2's link goes down.
    h1's ranks see h2's ranks fall silent (3 s of heartbeat), shrink to the two of them (shared
    memory on h1) and go on; h2's ranks can reach neither h1 nor the store (on h1) and fail
    within their deadlines: nobody hangs, and no shared memory is left on either host."""
    import time

    key, port = "6f" * 32, 29470
    ready = tmp_path / "ready"
    ready.mkdir()
    with Cluster(2) as cluster:
        env = dict(os.environ, ANYCCL_JOB_KEY=key, ANYCCL_TIMEOUT="20", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", LOOP_S="60", EXPECT_LOST="2,3", SHRINK_S="20",
                   ANYCCL_PEER_SILENCE="3", READY_DIR=str(ready))
        env.pop("ANYCCL_BACKEND", None)
        procs = [cluster.run(i, [sys.executable, "-m", "anyccl", "run", "-n", "2", "--nnodes",
                                 "2", "--node-rank", str(i), "--master-addr", "h1",
                                 "--master-port", str(port), "--keep-going", str(SCRIPT)],
                             env=env) for i in range(2)]
        until = time.monotonic() + 60
        while len(list(ready.iterdir())) < 4 and time.monotonic() < until:
            time.sleep(0.1)
        assert len(list(ready.iterdir())) == 4, "the job did not start"
        cut_at = time.monotonic()
        cluster.cut(1)
        results = []
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, 90 - (time.monotonic() - cut_at)))
            except subprocess.TimeoutExpired:   # a hang: end the host, then report it
                cluster.kill_host(i)
                proc.kill()
                out, err = proc.communicate(timeout=10)
                err += f"\n(host h{i + 1} still running 90 s after the cut)"
            results.append((proc.returncode, out + err))
        took = time.monotonic() - cut_at
        (h1_code, h1), (h2_code, h2) = results
        done = {int(m[1]): m for m in DONE.finditer(h1)}
        assert h1_code == 0 and sorted(done) == [0, 1], h1[-4000:] + h2[-2000:]
        assert all(m[5].replace(" ", "") == "2,3" and int(m[4]) == 2 for m in done.values())
        assert h2_code != 0 and "-> rank" not in h2, h2[-3000:]   # h2's ranks failed
        assert took < 60, f"took {took:.1f} s"
        assert "did not answer within" in h2, h2[-2000:]         # and said why
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


def check_abort_ends_a_wait_at_once(comm):
    """Rank 0 waits in an all_reduce that rank 1 joins only 5 s later; a thread of rank 0
    aborts its communicator after 0.3 s. Rank 0's call fails then, and every later call; rank
    1's next collective without rank 0 fails at once (its peer left), far inside the 30 s
    deadline."""
    import threading
    import time

    x = np.ones(4)
    start = time.monotonic()
    if comm.rank == 0:
        threading.Timer(0.3, comm.abort).start()
        with pytest.raises(anyccl.CommunicatorClosedError, match="aborted"):
            comm.all_reduce(x)
        took = time.monotonic() - start
        assert isinstance(comm.failure, anyccl.CommunicatorClosedError)
        with pytest.raises(anyccl.CommunicatorClosedError):
            comm.broadcast(x, 0)
        comm.abort()                        # idempotent, after close too
        return took
    time.sleep(5)
    with pytest.raises(anyccl.PeerLostError, match="rank 0"):
        comm.all_reduce(x)   # (rank 0 published its part before it aborted: this one may end)
        comm.barrier()       # ... but rank 0 is gone from this one
    return time.monotonic() - start - 5


def test_abort_ends_this_ranks_wait_at_once_and_its_peers_fail_fast():
    took = run_ranks(check_abort_ends_a_wait_at_once, 2, backend="shm",
                     env={"ANYCCL_TIMEOUT": "30"})
    assert took[0] < 2.0 and took[1] < 2.0, took


def check_a_child_outlives_its_parents_store(comm):
    child = comm.split(0, comm.rank)
    comm.close()                            # the parent owned the store the child meets in
    child._store.set(f"still/{child.rank}", b"1")
    assert child._store.get(f"still/{1 - child.rank}", 10.0) == b"1"
    x = np.ones(3)
    child.all_reduce(x)
    child.close()
    return bool(np.all(x == 2))


def test_a_communicator_split_or_shrunk_from_another_keeps_the_store_when_that_one_closes():
    assert all(run_ranks(check_a_child_outlives_its_parents_store, 2, backend="shm"))


def _ranks_running(cluster: Cluster, host: int) -> int:
    """How many of the script's processes still run on simulated host `host`."""
    out = cluster.check_output(host, ["ps", "-ww", "-eo", "comm=,args="])
    return sum(1 for line in out.splitlines()
               if line.startswith("python") and SCRIPT.name in line)


@pytest.mark.skipif(bool(WHY_NOT) or not OPENMPI, reason=WHY_NOT or "no Open MPI 5 environment")
def test_when_a_host_is_cut_off_under_ulfm_the_other_hosts_ranks_shrink_to_shm(tmp_path):
    """Open MPI's mpirun with ULFM across two hosts, two ranks each, looping on all_reduce;
    h2's link goes down. MPI never hears of h2 again; h1's ranks find h2's ranks gone in the
    communicator's view of who is gone (their heartbeats fell silent), shrink to the two of
    them (shared memory on h1), pass every check and end; h2's ranks, cut off from the store
    and from h1, end within their deadlines. mpirun itself waits on h2's daemon for ever and
    is ended here: the ranks are what must not hang. Nothing is left in /dev/shm."""
    import time

    ready = tmp_path / "ready"
    ready.mkdir()
    os.chmod(ready, 0o777)
    names = ["PYTHONPATH", "ANYCCL_TIMEOUT", "PYTHONUNBUFFERED", "ANYCCL_KEEP_GOING",
             "ANYCCL_JOB_KEY", "LOOP_S", "EXPECT_LOST", "SHRINK_S", "ANYCCL_PEER_SILENCE",
             "READY_DIR"]
    env = dict(os.environ, PATH=f"{Path(OPENMPI).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(Path(anyccl.__file__).parents[1]), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", ANYCCL_TIMEOUT="20", PYTHONUNBUFFERED="1",
               ANYCCL_KEEP_GOING="1", ANYCCL_JOB_KEY="7b" * 32, LOOP_S="60",
               EXPECT_LOST="2,3", SHRINK_S="20", ANYCCL_PEER_SILENCE="3",
               READY_DIR=str(ready))
    env.pop("ANYCCL_BACKEND", None)
    with Cluster(2) as cluster:
        job = cluster.run(0, ["mpirun", "--with-ft", "ulfm", "--prtemca", "plm_ssh_agent",
                              cluster.ssh_stand_in(), "--host", "h1:2,h2:2", "-n", "4",
                              *[a for n in names for a in ("-x", n)], OPENMPI, str(SCRIPT)],
                          env=env)
        until = time.monotonic() + 60
        while len(list(ready.iterdir())) < 4 and time.monotonic() < until:
            time.sleep(0.1)
        if len(list(ready.iterdir())) < 4:
            code, text = simhosts.finish([job], 1, cluster)[0]
            raise AssertionError(f"the job did not start: {text[-3000:]}")
        cut_at = time.monotonic()
        cluster.cut(1)
        ended = {}   # host -> seconds from the cut until its ranks had all ended
        while len(ended) < 2 and time.monotonic() - cut_at < 75:
            for host in (0, 1):
                if host not in ended and _ranks_running(cluster, host) == 0:
                    ended[host] = time.monotonic() - cut_at
            time.sleep(0.5)
        code, text = simhosts.finish([job], 1, cluster)[0]
        assert sorted(ended) == [0, 1], (ended, text[-4000:])
        print(f"a host cut off (shm+mpi, ULFM): h1's ranks shrank, passed and ended "
              f"{ended[0]:.1f} s after the cut, h2's ended {ended[1]:.1f} s after it")
        # h2's ranks: their deadline (20 s) and the store's silence (10 s); h1's: the
        # heartbeats' silence (3 s), the shrink and checks, then MPI_Finalize's 10 s watchdog
        assert max(ended.values()) < 60, (ended, text[-4000:])
        done = {int(m[1]): m for m in DONE.finditer(text)}
        assert sorted(done) == [0, 1], text[-4000:]
        assert all(m[5].replace(" ", "") == "2,3" and int(m[4]) == 2 for m in done.values())
        assert all(m[0].endswith(" on shm") for m in done.values()), text[-2000:]
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]
