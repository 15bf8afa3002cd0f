"""Starts N ranks that each init() and all_reduce 50 MB over shm (no cross-memory attach), and
prints one JSON line: every rank's exit code and the last line of its stderr. Run it where
/dev/shm is small (a private mount namespace) to see what ranks do when it is full."""

import json
import os
import secrets
import subprocess
import sys

from anyccl.store import StoreServer

RANK_CODE = """
import numpy as np, anyccl
comm = anyccl.init()
x = np.ones(50_000_000 // 4, np.float32)
comm.all_reduce(x)
comm.close()
"""

n = int(sys.argv[1])
key = secrets.token_bytes(32)
server = StoreServer(key)
base = {k: v for k, v in os.environ.items() if not k.startswith(("ANYCCL_", "RANK"))}
env = {**base, "WORLD_SIZE": str(n), "ANYCCL_STORE": server.address, "ANYCCL_JOB_KEY": key.hex(),
       "ANYCCL_JOB_ID": secrets.token_hex(4), "ANYCCL_SHM_CMA": "0", "ANYCCL_TIMEOUT": "60"}
procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE], env={**env, "RANK": str(r)},
                          stderr=subprocess.PIPE, text=True) for r in range(n)]
outcome = []
for p in procs:
    _, err = p.communicate(timeout=120)
    lines = err.strip().splitlines()
    outcome.append({"code": p.returncode, "last": lines[-1] if lines else ""})
server.close()
print(json.dumps(outcome))
