"""Kill a rank at random points of every kind of operation, many times, and check that the
survivors always recover: for each kind (all_reduce, broadcast, all_gather, reduce_scatter,
all_to_all, a ring of sendrecvs, neighbour isend/irecv, barrier), --per-kind jobs of
`anyccl run --keep-going -n N tests/scripts/shrink_after_kill.py`, each looping on that kind
alone; a random rank arms a timer at its 3rd operation and dies by SIGKILL a random time
within --within seconds later, inside whatever operation it is in. Every survivor must raise,
shrink, and pass the script's checks of every collective and message on the shrunk
communicator; nothing may be left in /dev/shm; no job may run past --job-timeout.

    python benchmarks/kill_stress.py [-n 4] [--per-kind 30] [--within 0.05] [--seed 1]

Prints one row per kind: jobs, jobs where every survivor recovered, the slowest survivor's
time from the kill to its error and from its error to the shrunk communicator (max over the
jobs), and the slowest job."""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "shrink_after_kill.py"
KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
         "sendrecv ring", "isend/irecv", "barrier"]
DONE = re.compile(r"rank (\d+) of \d+ -> rank \d+ of \d+: ok lost=\[(\d+)\] "
                  r"seconds=([\d.]+) first=[\d.]+ detect=([-\d.]+)")


def leftovers() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("anyccl-")}


def one_job(n: int, kind: int, victim: int, within: float, timeout_s: float
            ) -> tuple[bool, float, float, float, str]:
    """(every survivor recovered, max detect, max shrink, wall seconds, output tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, VICTIMS=str(victim), KILL_AT="2", KILL_WITHIN_S=str(within),
                   ONLY=str(kind), KILL_FILE=os.path.join(tmp, "kills"), ANYCCL_TIMEOUT="30",
                   PYTHONUNBUFFERED="1")
        env.pop("ANYCCL_BACKEND", None)
        start = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(n),
                                   "--keep-going", str(SCRIPT)], env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = -1, f"timed out: {exc}"
        wall = time.monotonic() - start
    found = {int(m[1]): m for m in DONE.finditer(text)}
    ok = code == 0 and sorted(found) == [r for r in range(n) if r != victim] and \
        all(int(m[2]) == victim for m in found.values())
    detect = max((float(m[4]) for m in found.values()), default=-1.0)
    shrink = max((float(m[3]) for m in found.values()), default=-1.0)
    return ok, detect, shrink, wall, text[-1500:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--per-kind", type=int, default=30)
    p.add_argument("--within", type=float, default=0.05)
    p.add_argument("--kinds", default=",".join(map(str, range(len(KINDS)))))
    p.add_argument("--job-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    before = leftovers()
    failures = 0
    print(f"{args.n} ranks on shm, {args.per_kind} jobs per kind, kill within "
          f"{args.within * 1000:.0f} ms of a random rank's 3rd operation")
    print("| kind | jobs | recovered | kill to error, max (s) | error to shrunk, max (s) | "
          "slowest job (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in (int(k) for k in args.kinds.split(",")):
        rows = []
        for _ in range(args.per_kind):
            row = one_job(args.n, kind, rng.randrange(args.n), args.within, args.job_timeout)
            rows.append(row)
            if not row[0]:
                failures += 1
                print(f"FAILED ({KINDS[kind]}):\n{row[4]}", file=sys.stderr)
        good = [r for r in rows if r[0]]
        print(f"| {KINDS[kind]} | {len(rows)} | {len(good)} | "
              f"{max((r[1] for r in good), default=-1):.3f} | "
              f"{max((r[2] for r in good), default=-1):.3f} | "
              f"{max(r[3] for r in rows):.1f} |", flush=True)
    left = leftovers() - before
    print(f"shared memory left behind: {sorted(left) or 'none'}")
    sys.exit(1 if failures or left else 0)


if __name__ == "__main__":
    main()
