"""The job's store in a process of its own (ANYCCL_KEEP_GOING): it serves the job's ranks
like rank 0's store, admits only holders of the job key, outlives the process that started
it, and ends by itself once its last client has been gone for a few seconds, or when no rank
ever came."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from anyccl import store_process
from anyccl.errors import RendezvousError
from anyccl.store import TCPStore

pytestmark = pytest.mark.shm_only


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a store process this test started may be a zombie of its own until reaped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, limit_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not _alive(pid):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def test_it_serves_the_job_and_ends_a_few_seconds_after_its_last_client_left():
    key = secrets.token_bytes(32)
    host, port, pid = store_process.start(key, "127.0.0.1", 0, 10.0)
    a, b = TCPStore(host, port, key, 5.0), TCPStore(host, port, key, 5.0)
    a.set("x", b"1")
    assert b.get("x", 1.0) == b"1" and b.add("n", 2) == 2
    a.close()
    time.sleep(store_process.LINGER_S + 1)
    assert _alive(pid), "ended while a client was still connected"
    b.close()
    assert _gone_within(pid, store_process.LINGER_S + 3) is not None


def test_a_rank_without_the_job_key_is_refused_and_does_not_keep_it_alive():
    host, port, pid = store_process.start(secrets.token_bytes(32), "127.0.0.1", 0, 1.0)
    with pytest.raises(RendezvousError, match="job key differs"):
        TCPStore(host, port, secrets.token_bytes(32), 2.0)
    assert _gone_within(pid, 1.0 + store_process.LINGER_S + 3) is not None


def test_nobody_coming_ends_it_after_the_rendezvous_timeout():
    _, _, pid = store_process.start(secrets.token_bytes(32), "127.0.0.1", 0, 0.5)
    assert _gone_within(pid, 0.5 + store_process.LINGER_S + 3) is not None


def test_a_port_in_use_is_a_clear_error():
    key = secrets.token_bytes(32)
    host, port, _ = store_process.start(key, "127.0.0.1", 0, 0.5)
    with pytest.raises(RendezvousError, match=f"cannot start the rendezvous store.*{port}"):
        store_process.start(key, "127.0.0.1", port, 0.5)


_RANK_0 = """
import os, secrets, sys, time
from anyccl import store_process
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # as a launcher binds a rank
key = secrets.token_bytes(32)
host, port, pid = store_process.start(key, "127.0.0.1", 0, 10.0)
print(key.hex(), host, port, pid, flush=True)
time.sleep(60)
"""


def test_it_stays_in_rank_0s_session_on_its_launchers_cores_and_outlives_rank_0s_group():
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK_0], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        key, host, port, pid = rank0.stdout.readline().split()
        pid = int(pid)
        # one session with rank 0: one scheduling group where Linux groups sessions (autogroup)
        assert os.getsid(pid) == os.getsid(rank0.pid)
        assert os.getpgid(pid) == pid != os.getpgid(rank0.pid)
        # not only on the core the launcher bound rank 0 to: every thread on the launcher's
        assert len(os.sched_getaffinity(rank0.pid)) == 1
        assert {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")} \
            == {frozenset(os.sched_getaffinity(0))}
        os.killpg(rank0.pid, signal.SIGTERM)   # as a launcher ends a rank
        rank0.wait(10)
        client = TCPStore(host, int(port), bytes.fromhex(key), 5.0)
        client.set("after", b"1")
        assert client.get("after", 1.0) == b"1"
        client.close()
        assert _gone_within(pid, store_process.LINGER_S + 3) is not None
    finally:
        rank0.kill()
        rank0.wait()
