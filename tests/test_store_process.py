"""The job's store in a process of its own (ANYCCL_KEEP_GOING): it serves the job's ranks
like rank 0's store, admits only holders of the job key, outlives the process that started
it, and ends by itself once its last client has been gone for a few seconds, or when no rank
ever came."""

from __future__ import annotations

import os
import secrets
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
    try:   # the store process is not our child (its own session) once `start` returned,
        with open(f"/proc/{pid}/stat") as f:   # but it may be a zombie of ours until reaped
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
