"""anyccl as a torch.distributed backend: `init_process_group("anyccl")` runs torch's own
DistributedDataParallel (plain, find_unused_parameters, no_sync, the fp16 compression hook,
static_graph), FSDP2 (`fully_shard`), PyTorch Lightning's DDPStrategy and torch's functional and
object collectives to exactly the weights and values gloo gives, and a CPU tensor passed to
anyccl stays resizable (FSDP frees storage so)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.shm_only  # torch starts its own processes; the suite's backend is moot

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
VARIANTS = "plain,unused,no_sync,fp16_hook,static_graph,functional,fsdp2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(backend: str, world_size: int, variants: str, out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), backend, str(world_size),
                           str(_free_port()), str(out_dir), variants],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.mark.parametrize("world_size, variants", [(2, VARIANTS), (4, "plain,unused,fsdp2")])
def test_ddp_on_the_anyccl_backend_trains_to_the_weights_gloo_gives(tmp_path, world_size,
                                                                     variants):
    """Two ranks: bit for bit (a sum of two is the same in any order). Four: gloo adds in
    another order, so the weights agree to float32 rounding, and every rank holds exactly the
    same weights as the others."""
    gloo = _train("gloo", world_size, variants, tmp_path / "gloo")
    ours = _train("anyccl", world_size, variants, tmp_path / "anyccl")
    for rank in range(world_size):
        assert gloo[rank].keys() == ours[rank].keys()
        for key, expected in gloo[rank].items():
            got = ours[rank][key]
            if not isinstance(expected, torch.Tensor):
                assert got == expected, (rank, key)
            elif world_size == 2:
                assert got.dtype == expected.dtype and torch.equal(got, expected), (rank, key)
            else:
                assert torch.equal(got, ours[0][key]), (rank, key)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_lightning_ddp_on_the_anyccl_backend_trains_to_the_weights_gloo_gives(tmp_path):
    pytest.importorskip("lightning")
    script = Path(__file__).parent / "scripts" / "lightning_train.py"
    weights = {}
    for backend in ("gloo", "anyccl"):
        out = tmp_path / f"{backend}.pt"
        proc = subprocess.run([sys.executable, str(script), backend, str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[backend] = torch.load(out, weights_only=False)
    gloo, ours = weights["gloo"], weights["anyccl"]
    for key, expected in gloo["trained"].items():
        assert torch.equal(ours["trained"][key], expected), key
        assert not torch.equal(ours["trained"][key], ours["initial"][key]), key  # it trained


def test_importing_torch_registers_the_backend_through_the_entry_point():
    check = "import torch.distributed as d; print('ANYCCL' in d.Backend._plugins)"
    for autoload, expected in (("1", "True"), ("0", "False")):
        proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                              timeout=120, env={**os.environ,
                                                "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload})
        assert proc.stdout.strip() == expected, (autoload, proc.stderr[-2000:])
    info = subprocess.run([sys.executable, "-m", "anyccl", "info"], capture_output=True,
                          text=True, timeout=120)
    assert 'torch.distributed backend: "anyccl" is registered when torch is imported' \
        in info.stdout, info.stdout[-2000:]


def test_a_cpu_tensor_anyccl_reads_stays_resizable():
    import numpy as np

    from anyccl.buffers import as_numpy

    t = torch.arange(6.0)
    view = as_numpy(t, "t", writable=True)
    view[0] = 7.0
    assert t[0].item() == 7.0 and isinstance(view, np.ndarray)
    t.resize_(12)  # raises "Trying to resize storage that is not resizable" after .numpy()
    assert t.numel() == 12


def test_the_backend_is_registered_on_import_and_refuses_what_it_lacks_by_name():
    from types import SimpleNamespace

    import torch.distributed as dist

    import anyccl.torch as backend

    assert "ANYCCL" in dist.Backend._plugins
    backend.register()  # again: nothing happens
    premul = SimpleNamespace(reduceOp=SimpleNamespace(op=SimpleNamespace(name="PREMUL_SUM")))
    with pytest.raises(backend.UnsupportedError, match="no PREMUL_SUM reduction"):
        backend._reduce_op(premul)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    assert backend._reduce_op(opts).name == "MAX"


def test_the_ddp_backend_benchmark_runs_and_checks_the_weights():
    script = Path(__file__).parent.parent / "benchmarks" / "torch_ddp_backends.py"
    variants = ["ddp:gloo", "ddp:anyccl", "fsdp2:anyccl", "averager:anyccl"]
    proc = subprocess.run([sys.executable, str(script), "--width", "16", "--layers", "2",
                           "--steps", "3", "--rounds", "1", "--variants", ",".join(variants)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.rstrip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and ":" in line.split("|")[1]}
    assert list(rows) == variants, proc.stdout
    assert rows["ddp:anyccl"].endswith("| identical |"), proc.stdout   # 2 ranks: same bits
    for name in ("fsdp2:anyccl", "averager:anyccl"):   # other orders of the same sums
        weights = rows[name].split("|")[-2].strip()
        assert weights == "identical" or float(weights.split()[-1]) < 1e-5, rows[name]


def test_torch_helpers_that_ask_for_the_group_backend_get_one_without_extras():
    """init_process_group(device_id=...) (Lightning passes it on CUDA), new_group's split and
    FSDP2's allocator ask `group._get_backend(device)`; a Python group has no C++ backend to
    give, so the anyccl group answers with one that offers no splitting, coalescing or
    allocation, and torch takes its ordinary path."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_split_source

    dist.init_process_group("anyccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        group = dist.group.WORLD
        for device in (torch.device("cpu"), torch.device("cuda", 0)):
            backend = group._get_backend(device)
            assert not backend.supports_splitting and not backend.supports_coalescing
            assert not backend.supports_tensor_alloc(device)
        assert _get_split_source(group) is None
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert isinstance(dist.new_group([0], backend="anyccl"), dist.ProcessGroup)
    finally:
        dist.destroy_process_group()
