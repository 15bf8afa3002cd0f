"""Fail fast and explain: lost peers, mismatched collectives, deadlines with flight records,
clean-up on every exit path, and a rendezvous no foreign client can stall."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness import (
    eventually,
    job_segments,
    launch_job,
    new_job_id,
    run_ranks,
    run_ranks_outcomes,
    spawn_processes,
    suite_backend,
)

import anyccl
from anyccl.store import StoreServer

SURVIVOR = r"""
import os, signal, sys, time, numpy as np, anyccl
victim, mode = int(sys.argv[1]), sys.argv[2]
comm = anyccl.init()
x = np.ones(4096, np.float32)
step = 0
try:
    while True:
        step += 1
        if comm.rank == victim and step == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "late" and comm.rank == 2 and step == 50:
            time.sleep(2)                 # the others notice the death and exit first
        if mode in ("collective", "late"):
            comm.all_reduce(x)
        elif comm.rank == 0:
            comm.recv(x, victim)          # waits on the victim, which dies
        else:
            comm.send(x, 0)
        if step == 49:
            died_after = time.monotonic()
except anyccl.PeerLostError as exc:
    print(f"LOST {exc.lost_rank} {time.monotonic() - died_after:.2f}", flush=True)
    print(str(exc), flush=True)
"""


def _job_env(world_size: int) -> tuple[StoreServer, list[dict[str, str]]]:
    key = secrets.token_bytes(32)
    server = StoreServer(key)
    common = {"WORLD_SIZE": str(world_size), "ANYCCL_STORE": server.address,
              "ANYCCL_JOB_KEY": key.hex(), "ANYCCL_JOB_ID": new_job_id()}
    return server, [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world_size)]


@pytest.mark.parametrize("mode", ("collective", "recv", "late"))
def test_a_rank_killed_mid_job_makes_the_others_raise_peer_lost_within_ten_seconds(mode):
    """Every survivor names the killed rank and its death, also one that only looks after
    another survivor has noticed and exited ("late")."""
    world = 2 if mode == "recv" else 3
    server, envs = _job_env(world)
    victim = 1
    procs = spawn_processes(SURVIVOR, envs, timeout_s=60, args=[str(victim), mode])
    server.close()
    assert procs[victim].returncode == -signal.SIGKILL
    for rank, proc in enumerate(procs):
        if rank == victim:
            continue
        assert proc.returncode == 0, proc.stderr[-2000:]
        first, message = proc.stdout.splitlines()[:2]
        _, lost, seconds = first.split()
        assert int(lost) == victim and float(seconds) < 10, first
        assert f"rank {victim} (pid" in message and "died while this rank was in" in message
        assert "flight record of rank" in proc.stdout


def check_mismatch(comm, case):
    x = np.ones(8, np.float32)
    if case == "op":
        comm.all_reduce(x) if comm.rank == 0 else comm.broadcast(x, 0)
    elif case == "dtype":
        comm.all_reduce(x if comm.rank == 0 else np.ones(8, np.float64))
    elif case == "count":
        comm.all_reduce(x if comm.rank == 0 else np.ones(9, np.float32))
    elif case == "root":
        comm.broadcast(x, src=0 if comm.rank == 0 else 1)
    elif case == "redop":
        comm.all_reduce(x, op="sum" if comm.rank == 0 else "max")


@pytest.mark.parametrize("case", ("op", "dtype", "count", "root", "redop"))
def test_debug_mode_stops_every_rank_of_a_mismatched_collective_with_a_table(case):
    outcomes = run_ranks_outcomes(check_mismatch, 2, case, env={"ANYCCL_DEBUG": "1"})
    for rank, error in enumerate(outcomes):
        assert isinstance(error, anyccl.CollectiveMismatchError), repr(error)
        text = str(error)
        assert text.startswith(f"rank {rank}: collectives disagree at")
        rows = [line.split() for line in text.splitlines()[2:]]
        assert [r[0] for r in rows] == ["0", "1"] and rows[0] != rows[1]


def check_matching_in_debug_mode(comm):
    x = np.ones(5)
    comm.all_reduce(x)
    comm.broadcast(x, src=1)
    comm.barrier()
    return comm.debug and float(x[0]) == 2.0


def test_debug_mode_lets_agreeing_collectives_through():
    assert all(run_ranks(check_matching_in_debug_mode, 2, env={"ANYCCL_DEBUG": "1"}))


def check_timeout_writes_flight_record(comm):
    if comm.rank == 1:
        comm.barrier()  # rank 0 is elsewhere: this times out after ANYCCL_TIMEOUT
        return "no error"
    time.sleep(2.5)
    return "idle"


@pytest.mark.shm_only
def test_a_timeout_names_the_peers_and_writes_a_flight_record(tmp_path):
    env = {"ANYCCL_TIMEOUT": "1", "ANYCCL_FLIGHT_DIR": str(tmp_path)}
    error = run_ranks_outcomes(check_timeout_writes_flight_record, 2, env=env)[1]
    assert isinstance(error, anyccl.TimeoutError), repr(error)
    text = str(error)
    assert re.match(r"rank 1: barrier\(\) #\d+ timed out after 1 s waiting for rank 0 to arrive",
                    text), text
    path = re.search(r"flight record of rank 1: (\S+)", text).group(1)
    record = json.loads(open(path).read())
    assert record["rank"] == 1 and record["ops"][-1]["op"] == "barrier"
    assert record["ops"][-1]["state"] == "failed" and "TimeoutError" in record["ops"][-1]["error"]


def check_records_keep_no_array(comm):
    import gc
    import weakref

    n, r = comm.size, comm.rank
    x, out = np.ones(8, np.float32), np.zeros(8 * n, np.float32)
    comm.all_reduce(x)
    comm.all_gather(out, x)
    work = comm.isend(x, (r + 1) % n)
    comm.recv(np.zeros(8, np.float32), (r - 1) % n)
    work.wait()
    alive = [weakref.ref(x), weakref.ref(out)]
    del x, out, work
    gc.collect()
    said = [f"{e['op']}({e['args']})" for e in comm.flight_recorder.entries()]
    return [ref() is None for ref in alive], said


def test_the_flight_recorder_keeps_what_ops_did_but_no_array_alive():
    for freed, said in run_ranks(check_records_keep_no_array, 2):
        assert freed == [True, True], "an op record kept the user's array alive"
        assert said[-4:-2] == ["all_reduce(float32 x 8, op=SUM)", "all_gather(float32 x 8)"]
        assert said[-2].startswith("send(dst=") and said[-2].endswith(", tag=0, 32 B)")


def test_the_launcher_summarises_where_each_rank_was(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "scripts", "rank_behaviour.py")
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "3", script, "kill",
                           str(tmp_path), "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert "anyccl run: flight records in" in proc.stderr, proc.stderr
    assert re.search(r"world rank [01]: all_reduce\(float32 x 1000, op=SUM\) #\d+", proc.stderr)


def test_an_exception_in_one_rank_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYCCL_JOB_PREFIX", prefix := new_job_id())
    source = ("import anyccl, numpy as np\nc = anyccl.init()\nc.barrier()\n"
              "if c.rank == 1: raise RuntimeError('boom')\nc.barrier()\n")
    script = tmp_path / "boom.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert not job_segments(prefix)


def test_sigkill_of_every_rank_leaves_no_segment_and_no_process(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYCCL_JOB_PREFIX", prefix := new_job_id())
    script = os.path.join(os.path.dirname(__file__), "scripts", "rank_behaviour.py")
    launcher = subprocess.Popen([sys.executable, "-m", "anyccl", "run", "-n", "3", script,
                                 "forever", str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    files = lambda: list(tmp_path.glob("*.pid"))  # noqa: E731 - each rank writes its pid
    assert eventually(lambda: len(files()) == 3 and all(f.read_text() for f in files()), 30)
    pids = [int(p.read_text()) for p in files()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGKILL
    assert not job_segments(prefix)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"


def test_the_next_job_reclaims_segments_a_crashed_start_left_behind():
    from anyccl.backends import shm

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"/dev/shm/anyccl-deadjob-w-0-{secrets.token_hex(4)}"
    live = f"/dev/shm/anyccl-livejob-w-0-{secrets.token_hex(4)}"
    for path, pid in ((name, dead.pid), (live, os.getpid())):
        with open(path, "wb") as f:
            f.write(np.array([shm._MAGIC, pid], np.uint64).tobytes() + bytes(4080))
    try:
        comm = anyccl.init()
        comm.close()
        assert not os.path.exists(name), "a dead job's segment survived"
        assert os.path.exists(live), "a live process's segment was removed"
    finally:
        for path in (name, live):
            if os.path.exists(path):
                os.unlink(path)


def test_a_stalling_foreign_client_cannot_hold_up_the_job(caplog):
    server, envs = _job_env(2)
    squatter = socket.create_connection((server.host, server.port))  # never answers
    stranger = socket.create_connection((server.host, server.port))
    stranger.recv(32)
    stranger.sendall(b"x" * 32)  # a wrong answer to the challenge
    start = time.monotonic()
    program = ("import anyccl, numpy as np\nc = anyccl.init()\nx = np.ones(2)\n"
               "c.all_reduce(x)\nprint(int(x[0]))\n")
    procs = spawn_processes(program, envs, timeout_s=60)
    assert [p.stdout.strip() for p in procs] == ["2", "2"], [p.stderr for p in procs]
    assert time.monotonic() - start < 4.5  # less than the squatter's handshake deadline
    assert server.refused >= 1
    squatter.close()
    stranger.close()
    server.close()


def test_anyccl_timeout_sets_the_default_deadline():
    proc = spawn_processes("import anyccl\nprint(anyccl.init().timeout_s)",
                           [{"ANYCCL_TIMEOUT": "12.5"}])[0]
    assert proc.stdout.strip() == "12.5", proc.stderr


def check_barrier_then_close(comm):
    for _ in range(25):
        sub = comm.split(0)
        sub.barrier()
        sub.close()  # some ranks close while others still see the barrier complete
    return True


def test_ranks_that_close_right_after_a_barrier_are_not_reported_lost():
    assert all(run_ranks(check_barrier_then_close, 4))


LEAVING = str(Path(__file__).parent / "scripts" / "leaving_rank.py")


@pytest.mark.parametrize("how", ("raise", "exit", "close"))
def test_a_rank_that_leaves_stops_the_others_within_ten_seconds_on_every_backend(how):
    """Started as users start jobs (anyccl run on shm, mpiexec on mpi), with a deadline far
    longer than the promise: the job must not wait for it."""
    proc, seconds = launch_job(LEAVING, 3, [how], env={"ANYCCL_TIMEOUT": "120"})
    output = proc.stdout + proc.stderr
    assert seconds < 10 + 10, f"the job took {seconds:.1f} s:\n{output[-3000:]}"  # + start-up
    assert "NOT LOST" not in output
    if how == "raise":   # the traceback, then the job ends, naming the rank
        assert proc.returncode != 0
        assert "ValueError: rank 1 gives up" in proc.stderr
        assert "rank 1" in proc.stderr.replace("ValueError: rank 1 gives up", "")
        return
    if how == "exit":
        assert proc.returncode != 0
    lost = re.findall(r"LOST (\d+) ([\d.]+)", proc.stdout)  # mpiexec may glue lines together
    if how == "close":
        # every other rank raised; under mpiexec, the first to leave without MPI_Finalize may
        # end the job before the launcher forwarded the other's report
        assert len(lost) == 2 or (suite_backend() == "mpi" and len(lost) == 1), output[-3000:]
    elif suite_backend() == "mpi":  # (anyccl run stops the others once a rank failed)
        assert len(lost) >= 1, output[-3000:]
    for rank, waited in lost:
        assert rank == "1" and float(waited) < 10, output[-3000:]
