"""Checks of the project as a whole: the code is lint-clean and the documentation builds with
every link and reference resolved."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.project


def test_ruff_finds_nothing_to_fix():
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    site = tmp_path / "site"
    front = (site / "index.html").read_text()
    assert "Install and run the demo" in front  # README is the front page
    api = (site / "api" / "index.html").read_text()
    assert "all_reduce" in api and "Communicator" in api  # generated from the docstrings
    from anyccl import settings

    page = (site / "settings" / "index.html").read_text()
    assert all(name in page for name in settings.SETTINGS)  # generated from the declarations
    results = ROOT / "benchmarks" / "results"
    for page in results.glob("*.md"):
        assert (site / "results" / page.stem / "index.html").is_file(), page.name
    shutil.rmtree(site)


def test_every_recorded_run_the_code_and_docs_cite_exists():
    results = ROOT / "benchmarks" / "results"
    cited: dict[str, str] = {}
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.cu*"),
                 *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "docs").rglob("*.md"),
                 ROOT / "README.md", *(ROOT / "src").rglob("*.json")]:
        for name in re.findall(r"(20\d\d-\d\d-\d\d-[\w.-]+?\.(?:md|json|png))", path.read_text()):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    assert cited, "found no citations at all: the pattern is wrong"
    missing = {name: where for name, where in cited.items() if not (results / name).is_file()}
    assert not missing, f"cited but not recorded: {missing}"


def test_the_host_time_benchmark_runs_anywhere_and_times_every_op_on_every_backend(tmp_path):
    out = tmp_path / "host-time.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time.py"), "--calls",
                           "50", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(out.read_text())["us_per_call"]
    for op in ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "send+recv"):
        assert set(table[op]) == {"shm", "host", "nccl", "ipc", "nccl-again", "ipc-again"}, \
            (op, table[op])
        assert all(t > 0 for t in table[op].values()), (op, table[op])
    assert "| all_reduce |" in proc.stdout
