"""README's test command, run several times in a row while another anyccl job loops beside it
on the same machine: the suite must judge only its own jobs (their shared memory, processes
and files), whatever the other job does meanwhile.

    python benchmarks/busy_machine.py --times 5 --out results/DATE-MACHINE-WHAT.md

The other job is `anyccl run -n 2 examples/hello_collectives.py` started again as soon as it
ends (its shared-memory segments come and go under /dev/shm while the suite runs). Each run of
the test command is recorded with its exit code, its time and the last line pytest printed;
the other job's runs are counted. Every run is bounded in time (--limit) and the loop is
stopped at the end, also when a run fails.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- test-command", 1)[1].split("```bash\n", 1)[1]
    return block.split("\n```", 1)[0].strip()


class OtherJob:
    """`anyccl run -n 2 examples/hello_collectives.py`, again and again, until stopped."""

    def __init__(self) -> None:
        self.runs = self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2",
                                   str(ROOT / "examples" / "hello_collectives.py")],
                                  capture_output=True, text=True, timeout=300, cwd="/tmp")
            self.runs += 1
            self.failures += proc.returncode != 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", type=int, default=5)
    p.add_argument("--limit", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    command = readme_test_command()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    other = OtherJob()
    other.start()
    rows = []
    try:
        for i in range(ns.times):
            start = time.monotonic()
            try:
                proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                      timeout=ns.limit, cwd=ROOT)
                code, out = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                code, out = "timeout", str(exc.stdout or "")
            took = time.monotonic() - start
            summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", out, re.M)
            rows.append((i + 1, code, took, " / ".join(summaries) or out.strip()[-300:]))
            print(f"run {i + 1}: exit {code} in {took:.0f} s: {rows[-1][3]}", flush=True)
            if code != 0:
                Path(ns.out).with_suffix(".log").write_text(out)
                break
    finally:
        other.stop()
    passed = sum(code == 0 for _, code, _, _ in rows)
    lines = [
        f"# README's test command {ns.times} times in a row beside a looping anyccl job",
        "",
        f"- command: `python benchmarks/busy_machine.py --times {ns.times} --out {ns.out}`",
        f"- commit {commit}; Python {platform.python_version()}; {platform.node()}: "
        f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        f"- the test command (README.md): `{command}`",
        f"- beside it, the whole time: `anyccl run -n 2 examples/hello_collectives.py` in a "
        f"loop: {other.runs} runs, {other.failures} failed",
        "",
        "| run | exit code | seconds | pytest's summary (shm pass / mpi pass) |",
        "|---:|---:|---:|---|",
        *[f"| {i} | {code} | {took:.0f} | {summary} |" for i, code, took, summary in rows],
        "",
        f"{passed} of {ns.times} runs passed.",
        "",
    ]
    Path(ns.out).write_text("\n".join(lines))
    return 0 if passed == ns.times else 1


if __name__ == "__main__":
    sys.exit(main())
