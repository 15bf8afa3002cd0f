"""torch's own utilities that ask a process group which devices it serves -- distributed
checkpoints with async_save, FSDP2 loading a full state dict broadcast from rank 0, DeviceMesh
and DTensor, the functional collectives -- give on anyccl what they give on gloo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from test_torch_compat import _free_port  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_real_clients.py"
# torch starts these ranks itself, whatever backend the suite runs on: once, in the shm pass
pytestmark = pytest.mark.shm_only


def _run(backend: str, world_size: int, out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), backend, str(world_size),
                           str(_free_port()), str(out_dir)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def _same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("world_size", (2, 3))
def test_checkpoints_fsdp2_dtensor_functional_collectives_and_strided_tensors_match_gloo(
        tmp_path, world_size):
    ours = _run("anyccl", world_size, tmp_path / "anyccl")
    gloo = _run("gloo", world_size, tmp_path / "gloo")
    for rank, (mine, theirs) in enumerate(zip(ours, gloo)):
        assert mine["device_types"] == ["cpu", "cuda"] and mine["default_device"] == "cpu"
        assert mine["fsdp2_matches_rank0"] is True
        assert mine.pop("p2p_matches") is True   # strided tensors in messages: gloo refuses them
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert _same(mine[key], theirs[key]), (rank, key, mine[key], theirs[key])


def test_the_devices_placeholder_refuses_any_collective_that_reaches_it():
    from datetime import timedelta

    import torch.distributed as dist

    from anyccl.torch import create

    group = create(dist.HashStore(), 0, 1, timedelta(seconds=30))
    try:
        assert sorted(d.type for d in group._device_types) == ["cpu", "cuda"]
        # torch's C++ lookup (the group's Python _get_backend answers torch's Python helpers)
        placeholder = dist.ProcessGroup._get_backend(group, torch.device("cpu"))
        with pytest.raises(RuntimeError):
            placeholder.allreduce([torch.ones(2)]).wait()
        t = torch.ones(2)
        group.allreduce([t]).wait()          # the group's own operations run on anyccl
        assert torch.equal(t, torch.ones(2))
    finally:
        group._close()
