"""anyccl.init() meets its peers however the job was started: explicit arguments, env://,
tcp://, file://, torchrun's and SLURM's variables, mpiexec, or alone."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from harness import spawn_processes

import anyccl

PROGRAM = r"""
import sys, numpy as np, anyccl
kwargs = eval(sys.argv[1]) if len(sys.argv) > 1 else {}
comm = anyccl.init(**kwargs)
x = np.array([comm.rank + 1.0])
comm.all_reduce(x)
sys.stdout.write(f"{comm.rank} {comm.size} {comm.local_rank} {int(x[0])}\n")
sys.stdout.flush()
comm.close()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outputs(procs) -> list[list[int]]:
    for p in procs:
        assert p.returncode == 0, p.stderr[-2000:]
    return sorted([int(v) for v in p.stdout.split()] for p in procs)


def test_a_plain_python_process_is_a_world_of_one():
    assert _outputs(spawn_processes(PROGRAM, [{}])) == [[0, 1, 0, 1]]


def test_torchrun_style_environment_with_env_init_method():
    port = _port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(3)]
    assert _outputs(spawn_processes(PROGRAM, envs, args=["{'init_method': 'env://'}"])) == \
        [[r, 3, r, 6] for r in range(3)]


def test_explicit_rank_and_world_size_with_tcp_init_method():
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM,
                               f"{{'rank': {r}, 'world_size': 2, "
                               f"'init_method': 'tcp://127.0.0.1:{port}'}}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    # local_rank is derived from host names when no launcher gives it
    assert sorted(o.split() for o, _ in outs) == [["0", "2", "0", "3"], ["1", "2", "1", "3"]]


def test_file_init_method_and_explicit_arguments_win_over_the_environment(tmp_path):
    store = tmp_path / "rendezvous"
    envs = [{"RANK": "7", "WORLD_SIZE": "9"} for _ in range(2)]  # ignored: arguments win
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM,
                               f"{{'rank': {r}, 'world_size': 2, "
                               f"'init_method': 'file://{store}'}}"],
                              env={**envs[r], "PATH": "/usr/bin:/bin"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert sorted(o.split()[:2] for o, _ in outs) == [["0", "2"], ["1", "2"]]
    assert not store.exists(), "the last rank to close removes the file store"


def test_slurm_variables_give_rank_size_and_local_rank():
    port = _port()
    envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
    assert _outputs(spawn_processes(PROGRAM, envs)) == [[0, 2, 0, 3], [1, 2, 1, 3]]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_ranks_started_by_mpiexec_meet_through_mpi_and_run_on_shared_memory_by_default():
    """On one host the default is shm under mpiexec too; ranks keep MPI's numbering, and a
    program's own MPI calls work beside anyccl's."""
    pytest.importorskip("mpi4py")
    program = PROGRAM + (
        "from mpi4py import MPI\n"
        "assert MPI.COMM_WORLD.Get_rank() == comm.rank, (MPI.COMM_WORLD.Get_rank(), comm.rank)\n"
        "assert MPI.COMM_WORLD.allreduce(comm.rank) == comm.size * (comm.size - 1) // 2\n"
        "sys.stdout.write(f'{comm.rank} {comm.backend} {comm.backend_reason}\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "ANYCCL_BACKEND"}
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-c", program],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    sums = [line.split() for line in lines if line.split()[1] == "3"]
    assert sorted(s[:2] + s[3:] for s in sums) == [[str(r), "3", "6"] for r in range(3)]
    said = [line for line in lines if line.split()[1] != "3"]
    assert len(said) == 3 and all(line.split()[1] == "shm" and "also under mpiexec" in line
                                  for line in said), lines
    named = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", program],
                           capture_output=True, text=True, timeout=120,
                           env={**env, "ANYCCL_BACKEND": "mpi"})
    assert named.returncode == 0 and " mpi named" in named.stdout, named.stderr[-2000:]


def test_a_rank_without_any_way_to_meet_says_how_to_launch():
    procs = spawn_processes(PROGRAM, [{}], args=["{'rank': 1, 'world_size': 2}"])
    assert procs[0].returncode != 0
    assert "anyccl run -n 2" in procs[0].stderr


def test_a_foreign_client_without_the_job_key_is_refused_and_logged(caplog):
    from anyccl.store import StoreServer, TCPStore

    server = StoreServer(b"k" * 32)
    assert server.host == "127.0.0.1"  # loopback unless told otherwise
    with pytest.raises(anyccl.RendezvousError, match="job key differs"):
        TCPStore(server.host, server.port, b"wrong" * 6, timeout_s=5)
    good = TCPStore(server.host, server.port, b"k" * 32, timeout_s=5)
    good.set("a", b"1")
    assert good.get("a", 1) == b"1" and server.refused == 1
    assert "refused a connection from 127.0.0.1: wrong job key" in caplog.text
    server.close()


def test_the_store_waits_for_keys_and_counts_atomically(tmp_path):
    from anyccl.store import FileStore, StoreServer, TCPStore

    server = StoreServer(b"k")
    for store in (TCPStore(server.host, server.port, b"k", 5), FileStore(tmp_path / "fs")):
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert not store.check("x")
        with pytest.raises(anyccl.TimeoutError, match="'x' was not set"):
            store.get("x", 0.2)
        store.set("x", b"v")
        assert store.check("x") and store.get("x", 1) == b"v"
        store.delete("x")
        assert not store.check("x")
    server.close()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="no torchrun (torch) installed")
def test_ranks_started_by_torchrun_meet_through_its_agent_store(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line.split() for line in proc.stdout.splitlines() if line.strip()) == \
        [["0", "2", "0", "3"], ["1", "2", "1", "3"]]


def test_the_host_map_is_read_once_by_rank_0_and_its_failures_say_who(tmp_path):
    """Every rank leaves its host in the store; rank 0 reads them all and publishes the map,
    which the others read in one request. A rank that never arrived, a rank 0 that never
    published and a world size that differs are each said by name."""
    import threading

    from anyccl import bootstrap
    from anyccl.errors import AnycclError, TimeoutError
    from anyccl.store import FileStore

    store = FileStore(tmp_path / "store")
    got: dict[int, object] = {}

    def rank(r: int, size: int, timeout_s: float = 20.0) -> None:
        try:
            got[r] = bootstrap._hosts(store, r, size, timeout_s)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r, 3)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    names = got[0][0]
    assert got[1] == got[2] == got[0] and len(names) == 3 and names[0] == socket.gethostname()
    gets = []
    store = FileStore(tmp_path / "counted")
    real_get = store.get
    store.get = lambda key, timeout_s: gets.append(key) or real_get(key, timeout_s)
    threads = [threading.Thread(target=rank, args=(r, 3)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(gets) == ["host/0", "host/1", "host/2", "hosts", "hosts"]

    store = FileStore(tmp_path / "missing")
    rank(1, 3, timeout_s=1.0)       # rank 2 never comes (and neither does rank 0)
    assert isinstance(got[1], TimeoutError) and "ranks 0, 2 never arrived" in str(got[1])
    store = FileStore(tmp_path / "unpublished")
    for r in (0, 2):
        store.set(f"host/{r}", b"h\n")
    rank(1, 3, timeout_s=1.0)       # every rank arrived; rank 0 published nothing
    assert isinstance(got[1], TimeoutError) and "rank 0 did not publish" in str(got[1])
    store = FileStore(tmp_path / "sizes")
    first = threading.Thread(target=rank, args=(0, 2))
    first.start()
    rank(1, 3, timeout_s=5.0)      # started for 3 ranks where rank 0 was started for 2
    first.join(30)
    assert isinstance(got[1], AnycclError) and "world size differs" in str(got[1]), got[1]
