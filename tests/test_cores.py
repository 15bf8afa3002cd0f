"""Where anyccl's service threads run: a launcher may bind a rank to one core, but the store's
server, the store's own process and the heartbeat run on every core the launcher may use, so
that a rank spinning on its core cannot silence them (cores.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from anyccl import cores

pytestmark = pytest.mark.shm_only

_BOUND_RANK = r"""
import json, os, secrets, threading, time
from anyccl import store_process
from anyccl.heartbeat import Heartbeat
from anyccl.store import StoreServer, TCPStore

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # as a launcher binds a rank
key = secrets.token_bytes(32)
server = StoreServer(key)                                   # rank 0's store, in its process
client = TCPStore(server.host, server.port, key, 5.0)
client.set("x", b"1")
heartbeat = Heartbeat(client, 0, ["h1", "h2"], 10.0)
host, port, pid = store_process.start(key, "127.0.0.1", 0, 10.0)   # the store of its own
other = TCPStore(host, port, key, 5.0)
other.set("y", b"2")
time.sleep(0.2)
threads = {t.name: sorted(os.sched_getaffinity(t.native_id))
           for t in threading.enumerate() if t.name.startswith("anyccl-")}
tasks = {int(tid): sorted(os.sched_getaffinity(int(tid)))
         for tid in os.listdir(f"/proc/{pid}/task")}
print(json.dumps({"rank": sorted(os.sched_getaffinity(0)), "threads": threads,
                  "store process": tasks}))
heartbeat.close()
other.close()
"""


def _launcher_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_rank_bound_to_one_core_serves_the_store_and_its_heartbeat_from_every_core():
    proc = subprocess.run([sys.executable, "-c", _BOUND_RANK], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    everywhere = _launcher_cores()
    assert seen["rank"] == everywhere[:1]          # the rank itself stays where it was bound
    assert {"anyccl-store", "anyccl-store-conn", "anyccl-heartbeat"} <= seen["threads"].keys()
    assert all(mask == everywhere for mask in seen["threads"].values()), seen["threads"]
    assert seen["store process"] and \
        all(mask == everywhere for mask in seen["store process"].values()), seen


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_the_launchers_cores_are_its_mask_where_it_bound_the_rank_and_none_where_it_did_not():
    said = "from anyccl import cores; print(sorted(cores.launcher_cores() or []))"
    bound = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " + said
    for source, expected in ((bound, _launcher_cores()), (said, [])):
        proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == expected
    assert cores.available() == len(os.sched_getaffinity(0))
