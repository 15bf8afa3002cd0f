"""A torch.distributed script runs on anyccl.distributed with only its import changed, and
every rank ends with exactly what gloo gives it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).parent / "scripts" / "tutorial_collectives.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: Path, world_size: int, out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(world_size), str(_free_port()),
                           str(out_dir)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size", (2, 3))
def test_tutorial_script_gives_gloo_results_with_only_the_import_changed(tmp_path, world_size):
    text = SCRIPT.read_text()
    ported = text.replace("import torch.distributed as dist",
                          "import anyccl.distributed as dist")
    assert ported.count("import anyccl.distributed as dist") == 1 and ported != text
    anyccl_script = tmp_path / "tutorial_on_anyccl.py"
    anyccl_script.write_text(ported)
    gloo = _run(SCRIPT, world_size, tmp_path / "gloo")
    ours = _run(anyccl_script, world_size, tmp_path / "anyccl")
    for rank in range(world_size):
        assert gloo[rank].keys() == ours[rank].keys()
        for key, expected in gloo[rank].items():
            got = ours[rank][key]
            if isinstance(expected, torch.Tensor):
                assert got.dtype == expected.dtype and torch.equal(got, expected), (rank, key)
            else:
                assert got == expected, (rank, key)
