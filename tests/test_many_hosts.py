"""anyccl across machines, on simulated hosts (simhosts.py: network namespaces on a bridge, each
with its own hostname, /dev/shm, IPC and PID namespaces).

Every launcher people start multi-node jobs with runs every collective across hosts: mpiexec
(MPICH, its ssh launcher standing in for ssh), torchrun, `anyccl run --nnodes` and SLURM's
environment; the data crosses the veth links (their byte counters say so), with shared memory
inside each host. Ranks whose arguments disagree across hosts all raise. A host killed, a host
cut off the network, a rank that raises and a node that never starts each end the job on every
node within its deadline, naming the ranks and host lost, with no shared memory left behind.
DDP on the `anyccl` torch backend trains across hosts to the weights gloo gives.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simhosts
from harness import openmpi_python
from simhosts import Cluster

pytestmark = pytest.mark.shm_only   # the suite's backend is moot: the job picks its own

WHY_NOT = Cluster.unavailable()
if WHY_NOT:
    pytestmark = [pytestmark, pytest.mark.skip(reason=WHY_NOT)]

SCRIPT = Path(__file__).parent / "scripts" / "across_hosts.py"
SOURCE = Path(__file__).resolve().parents[1] / "src"
OPENMPI_PYTHON = openmpi_python()
KEY = "5e" * 32
PORT = 29400
JOB_S = 150   # the most one job may take before the test kills it


def _env(**more: str) -> dict[str, str]:
    env = dict(os.environ, ANYCCL_JOB_KEY=KEY, ANYCCL_TIMEOUT="60", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    env.pop("ANYCCL_BACKEND", None)
    env.update(more)
    return env


def launch(cluster: Cluster, launcher: str, per_host: int, args: list[str],
           env: dict[str, str], nodes: list[int] | None = None,
           keep_going: bool = False) -> list[subprocess.Popen]:
    """Start a job of `per_host` ranks on each host (or only on `nodes`) with `launcher`; one
    process per host (mpiexec: one in all, on h1). keep_going: `anyccl run --keep-going` (a
    rank that fails does not stop the others)."""
    hosts = cluster.size
    nodes = list(range(hosts)) if nodes is None else nodes
    script = [str(SCRIPT), *args]
    if launcher == "mpiexec":
        return [cluster.run(0, ["mpiexec", "-launcher", "ssh", "-launcher-exec",
                                cluster.ssh_stand_in(), "-hosts", ",".join(cluster.names),
                                "-ppn", str(per_host), "-n", str(hosts * per_host),
                                sys.executable, *script], env=env)]
    procs = []
    for i in nodes:
        if launcher == "anyccl run":
            argv = [sys.executable, "-m", "anyccl", "run", "-n", str(per_host), "--nnodes",
                    str(hosts), "--node-rank", str(i), "--master-addr", "h1", "--master-port",
                    str(PORT), "--tag-output", *(["--keep-going"] if keep_going else []),
                    *script]
        elif launcher == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts),
                    "--nproc-per-node", str(per_host), "--node-rank", str(i), "--master-addr",
                    "h1", "--master-port", str(PORT), *script]
        elif launcher == "srun":   # what srun gives each task: SLURM_* only, no MASTER_ADDR
            for local in range(per_host):
                task = dict(env, SLURM_PROCID=str(i * per_host + local),
                            SLURM_NTASKS=str(hosts * per_host), SLURM_LOCALID=str(local),
                            SLURM_JOB_NODELIST=f"h[1-{hosts}]", SLURM_JOB_ID="874242")
                procs.append(cluster.run(i, [sys.executable, *script], env=task))
            continue
        else:
            raise ValueError(launcher)
        procs.append(cluster.run(i, argv, env=env))
    return procs


def finish(procs: list[subprocess.Popen], timeout_s: float = JOB_S) -> list[tuple[int, str]]:
    return simhosts.finish(procs, timeout_s)


def _lines(results: list[tuple[int, str]], pattern: str) -> list[str]:
    """The lines matching `pattern`; mpiexec may join two ranks' lines into one, so a line is
    cut before each "rank N " that starts a rank's own line."""
    found = []
    for _, text in results:
        for line in text.splitlines():
            for part in re.split(r"(?<=\S)(?=rank \d+ (?:ok|refused|failed))", line):
                if re.search(pattern, part):
                    found.append(part)
    return found


@pytest.mark.parametrize("launcher, hosts, per_host, engine, debug", [
    ("anyccl run", 2, 2, "shm+gloo", "0"),
    ("anyccl run", 3, 2, "shm+gloo", "0"),
    ("anyccl run", 8, 1, "shm+gloo", "0"),     # (a host per rank: every step crosses)
    ("anyccl run", 2, 2, "shm+gloo", "1"),
    ("torchrun", 2, 2, "shm+gloo", "0"),
    ("mpiexec", 2, 2, "shm+mpi", "0"),
    ("mpiexec", 3, 2, "shm+mpi", "0"),
    ("mpiexec", 2, 2, "shm+mpi", "1"),
    ("srun", 2, 2, "shm+gloo", "0"),
])
def test_every_collective_runs_across_hosts_with_each_launcher(launcher, hosts, per_host,
                                                               engine, debug):
    """debug=1: with debug mode's check before every collective too."""
    with Cluster(hosts) as cluster:
        results = finish(launch(cluster, launcher, per_host, ["suite"],
                                _env(ANYCCL_DEBUG=debug)))
        for code, text in results:
            assert code == 0, text[-4000:]
        oks = _lines(results, r"rank \d+ ok")
        assert len(oks) == hosts * per_host, "\n".join(t for _, t in results)[-4000:]
        for line in oks:
            rank = int(re.search(r"rank (\d+) ok", line).group(1))
            assert f"ok {engine} on h{rank // per_host + 1}" in line, line
        for i in range(hosts):   # the data crossed the links: MBs each way on every host
            sent, received = cluster.link_bytes(i)
            assert sent > 2e6 and received > 2e6, (cluster.names[i], sent, received)
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")], \
                cluster.shm_files(i)


@pytest.mark.skipif(not OPENMPI_PYTHON, reason="set ANYCCL_TEST_OPENMPI_PYTHON to a Python "
                    "whose mpi4py runs on Open MPI (tests/install.sh makes one as root) to "
                    "launch with Open MPI")
def test_every_collective_runs_across_hosts_under_open_mpi():
    """Open MPI's mpirun, its ssh launcher standing in for ssh; anyccl from this checkout."""
    env = _env(PATH=f"{Path(OPENMPI_PYTHON).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(SOURCE), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with Cluster(2) as cluster:
        results = finish([cluster.run(0, [
            "mpirun", "--prtemca", "plm_ssh_agent", cluster.ssh_stand_in(), "--host",
            "h1:2,h2:2", "-n", "4", "-x", "PYTHONPATH", "-x", "ANYCCL_TIMEOUT", "-x",
            "PYTHONUNBUFFERED", OPENMPI_PYTHON, str(SCRIPT), "suite"], env=env)])
        assert results[0][0] == 0, results[0][1][-4000:]
        oks = _lines(results, r"rank \d+ ok")
        assert len(oks) == 4 and all("ok shm+mpi on h" in line for line in oks), oks
        for i in range(2):
            sent, received = cluster.link_bytes(i)
            assert sent > 2e6 and received > 2e6, (cluster.names[i], sent, received)


@pytest.mark.parametrize("launcher", ["anyccl run", "mpiexec"])
def test_ranks_whose_sizes_disagree_across_hosts_all_raise_and_the_job_goes_on(launcher):
    with Cluster(2) as cluster:
        results = finish(launch(cluster, launcher, 2, ["mismatch"], _env()))
        text = "\n".join(t for _, t in results)
        assert all(code == 0 for code, _ in results), text[-4000:]
        refused = _lines(results, r"rank \d+ refused")
        assert len(refused) == 4, text[-4000:]
        assert all("collectives disagree" in line for line in refused), refused
        assert len(_lines(results, r"ok after the mismatch")) == 4, text[-4000:]


def _wait_for(procs: list[subprocess.Popen], count: int, pattern: str,
              timeout_s: float) -> None:
    """Read the processes' stdout until `count` lines match `pattern` (bytes straight from the
    pipes: a buffered reader would hide lines from select)."""
    import selectors

    text = {proc.stdout.fileno(): "" for proc in procs}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for proc in procs:
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sum(len(re.findall(pattern, t)) for t in text.values()) >= count:
                return
            for key, _ in sel.select(timeout=0.5):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    text[key.fd] += chunk.decode(errors="replace")
                else:
                    sel.unregister(key.fd)
    raise AssertionError(f"fewer than {count} lines matching {pattern!r} in {timeout_s} s: "
                         f"{list(text.values())}")


def test_a_host_that_dies_fails_every_other_rank_fast_naming_its_ranks_and_host():
    with Cluster(2) as cluster:
        procs = launch(cluster, "anyccl run", 2, ["loop"], _env(ANYCCL_TIMEOUT="30"))
        _wait_for(procs, 4, r"running", 60)
        killed_at = time.monotonic()
        cluster.kill_host(1)
        (code, text), _ = finish(procs, 60)
        took = time.monotonic() - killed_at
        assert code != 0, text
        failed = _lines([(code, text)], r"rank [01] failed after")
        assert len(failed) == 2, text[-3000:]
        for line in failed:
            assert "PeerLostError" in line and "h2" in line and "2, 3" in line, line
        assert took < 30, f"the survivors took {took:.1f} s, past their 30 s deadline"
        assert not [f for f in cluster.shm_files(0) if f.startswith("anyccl-")]


def test_a_host_cut_off_the_network_fails_every_rank_within_its_deadline():
    """h1's ranks see h2's ranks fall silent (their heartbeats stop) and name them; h2's ranks
    can reach nobody, not even the store, and say that their host may be the one cut off."""
    with Cluster(2) as cluster:
        procs = launch(cluster, "anyccl run", 2, ["loop"],
                       _env(ANYCCL_TIMEOUT="20", ANYCCL_PEER_SILENCE="3"))
        _wait_for(procs, 4, r"running", 60)
        cut_at = time.monotonic()
        cluster.cut(1)
        results = finish(procs, 60)
        took = time.monotonic() - cut_at
        assert all(code != 0 for code, _ in results), results
        h1, h2 = results[0][1], results[1][1]
        survivors = _lines([(0, h1)], r"rank [01] failed after")
        assert len(survivors) == 2, h1[-3000:]
        for line in survivors:
            assert "PeerLostError" in line and "host h2" in line, line
        # the first of h2's ranks to reach its deadline fails; its launcher then stops the other
        cut_off = _lines([(0, h2)], r"rank [23] failed after")
        assert cut_off, h2[-3000:]
        for line in cut_off:
            assert "TimeoutError" in line and "may be the one cut off" in line, line
        assert took < 20 + 15, f"took {took:.1f} s"
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


def test_every_survivor_names_the_cut_off_host_whichever_deadline_fires_first():
    """With the default silence limit (10 s) as long as the timeout, a survivor's own deadline
    can fire before its heartbeat watch has seen a peer silent that long. Its timeout then
    consults the heartbeats before it raises (the peers whose counters stood still all the
    time it watched), so every one of h1's ranks names h2's ranks and host, in every run.
    (--keep-going: each survivor lives to raise its own error; by default the first to fail
    has its launcher stop the other.)"""
    for attempt in range(3):
        with Cluster(2) as cluster:
            procs = launch(cluster, "anyccl run", 2, ["loop"], _env(ANYCCL_TIMEOUT="10"),
                           keep_going=True)
            _wait_for(procs, 4, r"running", 60)
            cluster.cut(1)
            results = finish(procs, 60)
            h1 = results[0][1]
            survivors = _lines([(0, h1)], r"rank [01] failed after")
            assert len(survivors) == 2, (attempt, h1[-3000:])
            for line in survivors:
                assert "ranks 2, 3 on host h2" in line, (attempt, line)


def test_a_rank_that_raises_on_one_host_ends_the_job_on_every_node():
    with Cluster(2) as cluster:
        started = time.monotonic()
        results = finish(launch(cluster, "anyccl run", 2, ["raise"], _env(ANYCCL_TIMEOUT="30")))
        assert all(code != 0 for code, _ in results), results
        assert "ValueError: rank 3 gives up" in results[1][1]
        assert time.monotonic() - started < 30
        for i in range(2):
            assert not [f for f in cluster.shm_files(i) if f.startswith("anyccl-")]


def test_a_node_that_never_starts_is_a_timeout_naming_the_missing_ranks():
    with Cluster(2) as cluster:
        results = finish(launch(cluster, "anyccl run", 2, ["suite"], _env(ANYCCL_TIMEOUT="4"),
                                nodes=[0]), 60)
        code, text = results[0]
        assert code != 0
        assert "TimeoutError" in text and "ranks 2-3 never arrived" in text, text[-3000:]


def test_a_rank_that_cannot_reach_the_rendezvous_says_which_address_it_tried():
    with Cluster(2) as cluster:
        results = finish([cluster.run(1, [sys.executable, str(SCRIPT), "suite"], env=_env(
            ANYCCL_TIMEOUT="2", RANK="1", WORLD_SIZE="2", MASTER_ADDR="h1",
            MASTER_PORT=str(PORT)))], 60)
        code, text = results[0]
        assert code != 0
        assert "cannot reach the rendezvous store at h1:29400" in text, text[-2000:]


def test_ddp_on_the_anyccl_backend_trains_across_hosts_to_the_weights_gloo_gives(tmp_path):
    torch = pytest.importorskip("torch")
    script = Path(__file__).parent / "scripts" / "ddp_train.py"
    weights = {}
    with Cluster(2) as cluster:
        for backend in ("gloo", "anyccl"):
            out = tmp_path / backend
            out.mkdir()
            procs = [cluster.run(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes",
                                     "2", "--nproc-per-node", "2", "--node-rank", str(i),
                                     "--master-addr", "h1", "--master-port", str(PORT),
                                     str(script), backend, "torchrun", "-", str(out),
                                     "plain,functional"], env=_env(GLOO_SOCKET_IFNAME="eth0"))
                     for i in range(2)]
            for code, text in finish(procs):
                assert code == 0, text[-4000:]
            weights[backend] = [torch.load(out / f"rank{r}.pt", weights_only=False)
                                for r in range(4)]
    for rank in range(4):
        gloo, ours = weights["gloo"][rank], weights["anyccl"][rank]
        assert gloo.keys() == ours.keys()
        for key, expected in gloo.items():
            got = ours[key]
            if isinstance(expected, torch.Tensor):
                assert torch.equal(got, weights["anyccl"][0][key]) or "all_" in key \
                    or "recv" in key or "reduce_scatter" in key, (rank, key)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            else:
                assert got == expected, (rank, key)
