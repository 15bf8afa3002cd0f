"""How a job's start-up grows with the number of hosts: simulated hosts (tests/simhosts.py), one
`anyccl run` per host (shm inside each host, gloo between them), from the launch to each rank's
first collective.

    sudo python benchmarks/hosts_startup.py --hosts 2,4,8,16 --per-host 1,2 --rounds 3 --out FILE.md

Each rank reports when its interpreter had imported anyccl, when `anyccl.init()` returned (the
store's rendezvous with every rank, the host map, the backends between and inside the hosts),
when its first all_reduce (4 bytes) returned, and when an uneven all_to_all_single (whose
counts every rank must agree on first) returned. A row is the slowest rank's times from the
launch, the median of the rounds; each round builds the hosts anew.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from simhosts import Cluster  # noqa: E402

_JOB = r'''
import json, os, sys, time
import numpy as np
import anyccl
imported = time.time()
comm = anyccl.init()
joined = time.time()
comm.all_reduce(np.ones(1, np.float32))
first = time.time()
n, r = comm.size, comm.rank
sends = [r % 3 + 1] * n                     # uneven: rank r sends r % 3 + 1 items to each
takes = [s % 3 + 1 for s in range(n)]
out = np.zeros(sum(takes), np.float32)
comm.all_to_all(out, np.full(sum(sends), r, np.float32), in_splits=sends, out_splits=takes)
assert (out == np.repeat(np.arange(n, dtype=np.float32), takes)).all()
uneven = time.time()
times = comm.all_gather_object((imported, joined, first, uneven, comm.backend))
if r == 0:
    print("TIMES " + json.dumps(times), flush=True)
comm.close()
'''

PORT = 29400
KEY = "5e" * 32
STEPS = ("import", "init", "first all_reduce", "uneven all_to_all")


def one_round(hosts: int, per_host: int, job: str) -> tuple[list[float], str]:
    """The slowest rank's seconds from the launch to each step, and the backend it reported."""
    env = dict(os.environ, ANYCCL_JOB_KEY=KEY, ANYCCL_TIMEOUT="300", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    env.pop("ANYCCL_BACKEND", None)
    with Cluster(hosts) as cluster:
        started = time.time()
        procs = [cluster.run(i, [sys.executable, "-m", "anyccl", "run", "-n", str(per_host),
                                 "--nnodes", str(hosts), "--node-rank", str(i), "--master-addr",
                                 "h1", "--master-port", str(PORT), job], env=env)
                 for i in range(hosts)]
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"{hosts} x {per_host}: a host's launcher failed "
                                 f"({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
            outs.append(out)
    line = next(text for out in outs for text in out.splitlines() if "TIMES " in text)
    times = json.loads(line.split("TIMES ", 1)[1])
    return [max(t[k] for t in times) - started for k in range(4)], times[0][4]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,4,8,16")
    p.add_argument("--per-host", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    why = Cluster.unavailable()
    if why:
        raise SystemExit(f"no simulated hosts here: {why}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "startup.py")
        with open(job, "w") as f:
            f.write(_JOB)
        for per_host in (int(v) for v in ns.per_host.split(",")):
            for hosts in (int(v) for v in ns.hosts.split(",")):
                got = [one_round(hosts, per_host, job) for _ in range(ns.rounds)]
                medians = [statistics.median(g[0][k] for g in got) for k in range(4)]
                rows.append((hosts, per_host, medians, got[0][1], [g[0][2] for g in got]))
                print(f"{hosts} x {per_host}: " + ", ".join(
                    f"{name} {t:.2f} s" for name, t in zip(STEPS, medians)), flush=True)
    import anyccl

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    lines = ["# Start-up against the number of simulated hosts", "",
             f"- command: `python benchmarks/hosts_startup.py --hosts {ns.hosts} --per-host "
             f"{ns.per_host} --rounds {ns.rounds} --out {ns.out}`",
             f"- commit {commit}; anyccl {anyccl.__version__}; Python "
             f"{platform.python_version()}; {os.cpu_count()} cores, Linux {platform.release()}",
             "- hosts: network namespaces on one bridge, unshaped veth links; one `anyccl run` "
             "per host; seconds from the launch to the slowest rank's step, median of rounds", "",
             "| hosts x ranks | ranks | backend | " + " | ".join(STEPS)
             + " | first all_reduce, each round | first all_reduce / 2 hosts' |",
             "|---|---:|---|" + "---:|" * (len(STEPS) + 2)]
    for hosts, per_host, medians, backend, each in rows:
        base = next(m for h, p, m, *_ in rows if p == per_host)[2]
        lines.append(f"| {hosts} x {per_host} | {hosts * per_host} | {backend} | "
                     + " | ".join(f"{t:.2f}" for t in medians) + " | "
                     + ", ".join(f"{t:.2f}" for t in each) + f" | {medians[2] / base:.2f}x |")
    Path(ns.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
