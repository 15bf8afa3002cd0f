"""The examples a newcomer runs first work, and check themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("flavour", ("numpy", "torch"))
def test_hello_collectives_runs_every_operation(n, flavour):
    if flavour == "torch":
        pytest.importorskip("torch")
    args = ["--torch"] if flavour == "torch" else []
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(n),
                           str(EXAMPLES / "hello_collectives.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all operations checked: OK" in proc.stdout
    assert f"{n} ranks, backend shm" in proc.stdout
