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


@pytest.mark.parametrize("code", ("compiled", "python"))
def test_the_backend_torch_finds_per_device_serves_all_reduce_or_refuses(code, monkeypatch):
    """torch's C++ side finds a backend per device. Where the group's compiled part runs, that
    is anyccl's compiled all_reduce: torch's dispatcher brings every all_reduce there (the group
    has no Python allreduce of its own), and any other collective that reaches it is refused.
    With the Python code alone it is a placeholder that refuses every collective: then all of
    them reach the group's own methods."""
    from datetime import timedelta

    import torch.distributed as dist

    from anyccl import torch_core
    from anyccl.torch import ProcessGroup, create

    monkeypatch.setenv("ANYCCL_TORCH_CORE", "1" if code == "compiled" else "0")
    monkeypatch.setattr(torch_core, "_state", {})
    if code == "compiled" and torch_core.load() is None:
        pytest.skip(torch_core.status())
    group = create(dist.HashStore(), 0, 1, timedelta(seconds=30))
    try:
        assert sorted(d.type for d in group._device_types) == ["cpu", "cuda"]
        # torch's C++ lookup (the group's Python _get_backend answers torch's Python helpers)
        backend = dist.ProcessGroup._get_backend(group, torch.device("cpu"))
        t = torch.ones(2)
        if code == "compiled":
            assert backend.name() == "anyccl"
            backend.allreduce([t]).wait()       # served: back in the group's Python code
            assert torch.equal(t, torch.ones(2))
            # until a CUDA all_reduce, host all_reduces skip it; from then on the group's
            # allreduce is torch's own C++ method, which dispatches to it
            assert type(group).allreduce is ProcessGroup.allreduce
            group._use_compiled_allreduce()
            assert type(group).__dict__["allreduce"] is vars(dist.ProcessGroup)["allreduce"]
        else:
            with pytest.raises(RuntimeError):
                backend.allreduce([t]).wait()
        with pytest.raises(RuntimeError):
            backend.broadcast([t]).wait()
        group.allreduce([t]).wait()              # the group's own operations run on anyccl
        dist.all_reduce(t, group=group)
        group.broadcast([t]).wait()
        assert torch.equal(t, torch.ones(2))
        stats = torch_core.load().allreduce_stats(group) if code == "compiled" else None
        if stats is not None:   # three all_reduces reached it, none replayed (host tensors)
            assert (stats["calls"], stats["replayed"]) == (3, 0)
            assert stats["seconds"] > 0
            assert stats["parts"] == {"gil": 0.0, "enter": 0.0, "replay": 0.0, "leave": 0.0}
    finally:
        group._close()
