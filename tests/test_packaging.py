"""What `pip install anyccl` gives a user: a wheel that carries every file the package needs,
installed into a fresh virtual environment (not editable, away from this checkout), runs a
2-rank job, `anyccl info` and `anyccl --version`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import anyccl

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.project

JOB = """
import numpy as np
import anyccl
comm = anyccl.init()
x = np.full(5, comm.rank + 1.0)
comm.all_reduce(x)
assert x.tolist() == [3.0] * 5, x
from anyccl.backends.ipc.compiler import SOURCES
print(f"rank {comm.rank}: {anyccl.__file__} kernels {all(p.is_file() for p in SOURCES)}")
comm.close()
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("ANYCCL_", "PYTHON", "VIRTUAL_ENV", "RANK", "WORLD_SIZE"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a copy of the sources alone: a build/ folder left in the checkout by an
    # earlier build would otherwise lend the wheel files its own rules would leave out
    source = tmp_path_factory.mktemp("source") / "anyccl"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "site"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("anyccl-*.whl")
    return built


def test_the_wheel_carries_the_kernels_source_and_the_typing_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    from anyccl.backends.ipc.compiler import SOURCES

    for path in SOURCES:
        assert f"anyccl/backends/ipc/kernels/{path.name}" in names
    assert "anyccl/py.typed" in names
    assert f"anyccl-{anyccl.__version__}.dist-info/entry_points.txt" in names
    in_tree = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "anyccl").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert in_tree <= names, f"files of the package missing from the wheel: {in_tree - names}"


def test_the_wheel_installed_in_a_fresh_environment_runs_a_job(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / "bin"
    env = _clean_env()
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=600, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    away = tmp_path / "elsewhere"  # not the checkout: nothing can come from src/
    away.mkdir()
    (away / "job.py").write_text(JOB)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "anyccl"), *args], capture_output=True, text=True,
                              timeout=300, cwd=away, env=env)

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"anyccl {anyccl.__version__}"
    info = run("info")
    assert info.returncode == 0, info.stderr[-3000:]
    assert re.search(r"^\s+shm\s+cpu\s+available", info.stdout, re.M), info.stdout
    assert "lacks its kernels" not in info.stdout
    job = run("run", "-n", "2", "job.py")
    assert job.returncode == 0, job.stderr[-3000:]
    site = str(venv / "lib")
    lines = sorted(line for line in job.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: {site}") and line.endswith("kernels True"), line
