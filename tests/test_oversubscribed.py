"""More ranks than cores, as laptops and CI run every day: 4 ranks on 2 cores run many small
collectives of every kind on the suite's backend in a few seconds. Waits that held their core
while the rank they waited for had none made such a job crawl (each wait lasting a scheduler
time slice); here the ranks yield the core at every turn of a spin instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import launch_job

SCRIPT = str(Path(__file__).parent / "scripts" / "oversubscribed.py")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_four_ranks_on_two_cores_run_small_collectives_without_crawling():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    os.sched_setaffinity(0, cores[:2])   # the job's ranks inherit it
    try:
        proc, seconds = launch_job(SCRIPT, 4, ["300"], timeout_s=240)
    finally:
        os.sched_setaffinity(0, cores)
    assert proc.returncode == 0, proc.stderr[-3000:]
    took = float(proc.stdout.split()[-1])
    # 2,100 operations (300 rounds of six collectives and a pair of messages): well under a
    # second each round on 2 cores
    assert took < 60, f"300 rounds took {took:.1f} s ({seconds:.1f} s with start-up)"


# a program that keeps a core busy without ever yielding it, for at most LIMIT seconds
_SPINNER = ("import os, sys, time\n"
            "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
            "end = time.monotonic() + float(sys.argv[2])\n"
            "while time.monotonic() < end:\n"
            "    pass\n")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_beside_programs_that_never_yield_their_cores_the_job_still_runs():
    """4 ranks on 2 cores, each rank bound to one of them (as launchers bind ranks), each core
    also busy with a program that spins without yielding (an MPI library's blocking loop, a
    neighbour's job). On Linux's scheduler (EEVDF) a task that yields beside such a spinner
    gets well under 1% of the core: a wait yields only for its spin, then sleeps, and a
    sleeper's wake-up gets the core back at once."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    spinners = [subprocess.Popen([sys.executable, "-c", _SPINNER, str(c), "200"])
                for c in cores[:2]]
    os.sched_setaffinity(0, cores[:2])   # the job's ranks inherit it
    try:
        proc, seconds = launch_job(SCRIPT, 4, ["100", "bind"], timeout_s=200)
    finally:
        os.sched_setaffinity(0, cores)
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    took = float(proc.stdout.split()[-1])
    assert took < 60, f"100 rounds took {took:.1f} s ({seconds:.1f} s with start-up)"
