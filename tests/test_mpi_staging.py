"""GPU arrays on the mpi backend go through pinned host memory in chunks: the pipeline's logic,
checked on CPU with the CUDA calls simulated (tests/scripts/staged_pipeline.py). The real GPU
run is benchmarks/mpi_staging.py on a GPU machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "staged_pipeline.py"


@pytest.mark.shm_only  # starts its own mpiexec job
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("n", (2, 3))
def test_staged_gpu_collectives_through_a_ring_of_pinned_chunks(n):
    pytest.importorskip("mpi4py")
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, str(SCRIPT)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # mpiexec merges the ranks' output as it comes: count the verdicts, not the lines
    assert proc.stdout.count("OK") == n and "WRONG" not in proc.stdout, proc.stdout
    assert "cpu:mpi,cuda:mpi-staged" in proc.stdout
