"""The anyccl process group does what torch's own distributed suite checks gloo does: a batch of
isend/irecv posted before any wait, coalesced all_gather's layout, sparse all_reduce, a
receive from any rank, and a timeout in the words torch's tools look for (benchmarks/
torch_suite.py runs the suite itself)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from test_torch_compat import _free_port  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_pg_cases.py"


def _run(backend: str, world_size: int, out_dir: Path) -> tuple[list[dict], str]:
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), backend, str(world_size),
                           str(_free_port()), str(out_dir)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ([torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)],
            (out_dir / "timeout.txt").read_text())


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_cases_torchs_suite_checks_give_gloos_results(tmp_path, world_size):
    ours, timeout = _run("anyccl", world_size, tmp_path / "anyccl")
    gloo, _ = _run("gloo", world_size, tmp_path / "gloo")
    for rank, (mine, theirs) in enumerate(zip(ours, gloo)):
        assert mine.keys() == theirs.keys()
        for key in mine:
            a, b = mine[key], theirs[key]
            if isinstance(a, list):
                assert len(a) == len(b) and all(
                    torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b)), \
                    (rank, key, a, b)
            else:
                assert torch.equal(a, b), (rank, key, a, b)
    assert re.search(" (Timed out|closed|timeout) ", timeout), timeout   # torch's own test
    assert "barrier() #" in timeout and "waiting for rank 0" in timeout, timeout
