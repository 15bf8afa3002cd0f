"""Joining back: processes started after a job began (`anyccl.join()`) are admitted into a
larger communicator when its ranks call `comm.grow()`; the old ranks keep their numbers, the
newcomers follow in the order they came, and the grown communicator runs every collective and
message (tests/scripts/grow_after_kill.py checks them). After a rank was killed and the others
shrank; without a loss; one newcomer or two; `grow()` admitting whoever waits. A grow nobody
comes to, one whose ranks ask for different numbers, a newcomer nobody admits, and a backend
fixed at launch all fail clearly and leave the communicator as it was."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import run_ranks, spawn_processes
from simhosts import Cluster

import anyccl

pytestmark = pytest.mark.shm_only   # each job picks its own transport

SCRIPT = Path(__file__).parent / "scripts" / "grow_after_kill.py"
GROWN = re.compile(r"grown: rank (\d+) of (\d+): ok was=(-?\d+) joined=\[([\d, ]*)\]")


@pytest.mark.parametrize("nprocs, victim, newcomers, count", [
    (3, "", 1, ""),       # no loss: 3 ranks and one newcomer
    (4, "1", 1, ""),      # a replacement for the lost rank
    (3, "0", 2, ""),      # rank 0 lost, two newcomers
    (3, "2", 1, "none"),  # grow() admits whoever waits, until the newcomer came
])
def test_newcomers_join_a_shrunk_or_whole_communicator_and_run_everything(nprocs, victim,
                                                                           newcomers, count):
    env = dict(os.environ, VICTIM=victim, NEWCOMERS=str(newcomers), GROW_COUNT=count,
               ANYCCL_TIMEOUT="30", PYTHONUNBUFFERED="1")
    env.pop("ANYCCL_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(nprocs),
                           "--keep-going", str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=120)
    text = done.stdout + done.stderr
    before = nprocs - (1 if victim else 0)
    size = before + newcomers
    found = {int(m[1]): m for m in GROWN.finditer(text)}
    assert done.returncode == 0 and sorted(found) == list(range(size)), text[-3000:]
    for rank, m in found.items():
        assert int(m[2]) == size and m[4].replace(" ", "") == \
            ",".join(map(str, range(before, size))), m[0]
        assert int(m[3]) == (rank if rank < before else -1), m[0]   # old ranks keep numbers


NEWCOMER = """
import sys, numpy as np, anyccl
try:
    comm = anyccl.join(timeout=float(sys.argv[1]))
except anyccl.TimeoutError as exc:
    print("timeout:", exc)
    sys.exit(3)
x = np.full(4, float(comm.rank + 1))
comm.all_reduce(x)
print("joined", comm.rank, comm.size, comm.grown_from, x[0])
comm.close()
"""


def _start_newcomer(timeout_s: float) -> subprocess.Popen:
    """A process started with this rank's environment (the job's store and key) that joins."""
    return subprocess.Popen([sys.executable, "-c", NEWCOMER, str(timeout_s)], env=os.environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_grow_refusals_leave_the_communicator_usable(comm):
    """In turn: a grow nobody comes to, counts that differ, a bad count, grow() with nobody
    waiting, a newcomer nobody admits, then one that is admitted (after the first grow's
    abandoned ticket and the lone newcomer's, both skipped). Returns what each step saw."""
    seen = {}

    def usable() -> bool:
        x = np.ones(3)
        comm.all_reduce(x)
        return bool(np.all(x == comm.size))

    with pytest.raises(anyccl.TimeoutError) as info:
        comm.grow(1, timeout=0.5)
    seen["nobody"] = (str(info.value), usable())
    with pytest.raises(anyccl.CollectiveMismatchError) as mismatch:
        comm.grow(1 if comm.rank == 0 else 2, timeout=5)
    seen["mismatch"] = (str(mismatch.value), usable())
    with pytest.raises(anyccl.InvalidArgumentError) as bad:
        comm.grow(-1)
    seen["bad"] = str(bad.value)
    seen["none waiting"] = comm.grow(timeout=5) is comm
    if comm.rank == 0:   # a newcomer that gives up: no later grow counts on it
        lone = _start_newcomer(0.5)
        seen["lone"] = (lone.wait(timeout=60), lone.stdout.read())
    comm.barrier()
    seen["after the lone one"] = comm.grow(timeout=5) is comm
    newcomer = _start_newcomer(30) if comm.rank == 0 else None
    grown = comm.grow(1, timeout=30)
    seen["grown"] = (grown.rank, grown.size, grown.grown_from)
    x = np.full(4, float(grown.rank + 1))
    grown.all_reduce(x)
    seen["sum"] = float(x[0])
    grown.close()
    if newcomer is not None:
        seen["newcomer"] = (newcomer.wait(timeout=60), newcomer.stdout.read())
    seen["still"] = usable()
    return seen


WHY_NOT = Cluster.unavailable()


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "")
def test_across_two_hosts_the_launcher_replaces_a_lost_rank_and_the_job_grows_back():
    """h1 runs ranks 0 and 1, h2 ranks 2 and 3; rank 3 dies, the three others shrink, h2's
    `anyccl run --replace` starts a new process there, and the survivors grow back to four
    (shared memory inside each host, gloo between), all of whom check every operation."""
    key, port = "6f" * 32, 29480
    with Cluster(2) as cluster:
        env = dict(os.environ, ANYCCL_JOB_KEY=key, ANYCCL_TIMEOUT="30", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", VICTIM="3", REPLACED="1", ANYCCL_PEER_SILENCE="3")
        env.pop("ANYCCL_BACKEND", None)
        results = cluster.run_job(2, port, ["--keep-going", "--replace", str(SCRIPT)], env, 150)
        text = "\n".join(t for _, t in results)
        found = {int(m[1]): m for m in GROWN.finditer(text)}
        assert all(code == 0 for code, _ in results) and sorted(found) == [0, 1, 2, 3], \
            text[-4000:]
        assert [int(found[r][3]) for r in range(4)] == [0, 1, 2, -1], text[-2000:]
        assert "a new process starts in its place" in results[1][1], results[1][1][-2000:]
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


def test_a_grow_that_fails_says_why_on_every_rank_and_changes_nothing():
    results = run_ranks(check_grow_refusals_leave_the_communicator_usable, 2)
    for rank, seen in enumerate(results):
        text, ok = seen["nobody"]
        assert ok and re.match(rf"rank {rank}: grow: 0 of 1 newcomer joined before the "
                               rf"deadline; the communicator goes on as it was", text), text
        text, ok = seen["mismatch"]
        assert ok and "rank 0 asked for 1 newcomer, but rank(s) 1 for 2 newcomers" in text, text
        assert f"rank {rank}: grow: count=-1 must be an int >= 0" in seen["bad"]
        assert seen["none waiting"] and seen["after the lone one"]
        assert seen["grown"] == (rank, 3, {"ranks": 2, "joined": [2]})
        assert seen["sum"] == 6.0 and seen["still"]
    code, out = results[0]["lone"]
    assert code == 3 and "no communicator of the job grew to admit this process" in out, out
    code, out = results[0]["newcomer"]
    assert code == 0 and "joined 2 3 {'ranks': 2, 'joined': [2]} 6.0" in out, out


TORCH_NEWCOMER = """
import torch, anyccl
from anyccl.torch import ProcessGroup
group = ProcessGroup(anyccl.join(timeout=30))
t = torch.full((4,), float(group.rank() + 1))
group.allreduce([t]).wait()
print("torch joined", group.rank(), group.size(), float(t[0]))
group.comm.close()
"""


def check_the_torch_group_grows(comm):
    """torchft's shape: the group grows into a new group (this one closed), which runs."""
    import torch

    from anyccl.torch import ProcessGroup

    group = ProcessGroup(comm.split(0, comm.rank))   # grow closes it: not the pool's own
    newcomer = subprocess.Popen([sys.executable, "-c", TORCH_NEWCOMER], env=os.environ,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) if comm.rank == 0 else None
    grown = group.grow(1, timeout=30)
    t = torch.full((4,), float(grown.rank() + 1))
    grown.allreduce([t]).wait()
    seen = (grown.rank(), grown.size(), float(t[0]), group.comm.closed)
    grown.comm.close()
    if newcomer is not None:
        seen += (newcomer.wait(timeout=60), newcomer.stdout.read())
    return seen


def test_the_torch_process_group_grows_into_a_new_group():
    pytest.importorskip("torch")
    results = run_ranks(check_the_torch_group_grows, 2)
    assert [r[:4] for r in results] == [(0, 3, 6.0, True), (1, 3, 6.0, True)], results
    assert results[0][4] == 0 and "torch joined 2 3 6.0" in results[0][5], results[0][5]


def test_a_newcomer_without_its_jobs_environment_is_told_how_to_find_it():
    done = spawn_processes("import anyccl\ntry:\n    anyccl.join(timeout=1)\n"
                           "except anyccl.RendezvousError as exc:\n    print(exc)\n", [{}])[0]
    assert "join: this process has no way to find its job's store" in done.stdout, \
        done.stdout + done.stderr


def check_grow_refused_on_mpi(comm):
    with pytest.raises(anyccl.UnsupportedError, match="mpi backend cannot admit a process"):
        comm.grow(1, timeout=5)
    x = np.ones(3)
    comm.all_reduce(x)
    return bool(np.all(x == comm.size))


def test_the_mpi_backend_says_it_cannot_grow():
    pytest.importorskip("mpi4py")
    assert all(run_ranks(check_grow_refused_on_mpi, 2, backend="mpi"))
