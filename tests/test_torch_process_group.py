"""The anyccl process group does what torch's own distributed suite checks gloo does: a batch of
isend/irecv posted before any wait, coalesced all_gather's layout, sparse all_reduce, a
receive from any rank, and a timeout in the words torch's tools look for (benchmarks/
torch_suite.py runs the suite itself). Each case runs on the group's compiled part
(torch_core.py) and on its Python code alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from test_torch_compat import _free_port  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_pg_cases.py"
# torch starts these ranks itself, whatever backend the suite runs on: once, in the shm pass
pytestmark = pytest.mark.shm_only


CODES = ("compiled", "python")


@pytest.fixture(params=CODES)
def group_code(request, monkeypatch):
    """Which code runs the group's streams, Works and futures: its compiled part, or its
    Python code alone (ANYCCL_TORCH_CORE=0), here and in the ranks this test starts."""
    from anyccl import torch_core

    monkeypatch.setenv("ANYCCL_TORCH_CORE", "1" if request.param == "compiled" else "0")
    monkeypatch.setattr(torch_core, "_state", {})
    if request.param == "compiled":
        if "cannot be built" in torch_core.status():   # no compiler or no torch headers here
            pytest.skip(torch_core.status())
        if torch_core.load() is None:                   # the compiler ran and failed
            pytest.fail(f"the compiled part was not built: {torch_core.status()}")
    return request.param


def _run(backend: str, world_size: int, out_dir: Path) -> tuple[list[dict], str]:
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), backend, str(world_size),
                           str(_free_port()), str(out_dir)], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ([torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)],
            (out_dir / "timeout.txt").read_text())


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_cases_torchs_suite_checks_give_gloos_results(tmp_path, world_size, group_code):
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


def _one_rank_group():
    from datetime import timedelta

    import torch.distributed as dist

    from anyccl.torch import create

    return create(dist.HashStore(), 0, 1, timedelta(seconds=30))


@pytest.mark.parametrize("bucket_view", (False, True))
def test_ddp_over_an_anyccl_group_object_gives_the_local_gradients(bucket_view, group_code):
    """What torch's Python-process-group tests ask of a group passed as `process_group=`
    (test_c10d_pypg.py's DDP cases, here on a real anyccl group of one rank); with the compiled
    part, on the route through torch's dispatcher to the group's compiled all_reduce."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _one_rank_group()
    if group_code == "compiled":   # the route a group takes after its first CUDA all_reduce:
        group._use_compiled_allreduce()   # the reducer's all_reduce through torch's dispatcher
    try:
        torch.manual_seed(123)
        local = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        model = DDP(local, process_group=group, gradient_as_bucket_view=bucket_view)
        x = torch.rand(4, 2)
        model(x).sum().backward()
        ddp_grads = [p.grad.clone() for p in local.parameters()]
        local.zero_grad()
        local(x).sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(ddp_grads, local.parameters()))
    finally:
        group.shutdown()


def test_the_coalescing_manager_and_work_objects_of_an_anyccl_group(group_code):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    group = _one_rank_group()
    try:
        assert group._streams.compiled == (group_code == "compiled")
        t = torch.ones(3)
        with _coalescing_manager(group, torch.device("cpu"), async_ops=True) as cm:
            group.allreduce([t])
        cm.wait()
        work = group.allreduce([t])
        assert work.wait() and work.is_completed()
        assert torch.equal(work.get_future().value()[0], torch.ones(3))
        assert isinstance(work, dist.Work)
        outs = [[torch.zeros(2)]]   # a list of lists: all_gather's outputs, as the future's value
        gathered = group.allgather(outs, [torch.full((2,), 5.0)]).get_future().value()
        assert torch.equal(gathered[0][0], torch.full((2,), 5.0)) and gathered[0][0] is outs[0][0]
        assert group.barrier().get_future().value() is None
    finally:
        group.shutdown()


def test_where_the_compiled_part_cannot_be_built_the_group_runs_its_python_code(
        tmp_path, monkeypatch):
    from anyccl import torch_core

    monkeypatch.setenv("ANYCCL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(torch_core, "_state", {})
    assert "cannot be built" in torch_core.status() and "no-such-compiler" in torch_core.status()
    group = _one_rank_group()
    try:
        assert not group._streams.compiled
        assert torch_core.status().startswith("the group's Python code: the compiled part was "
                                              "not built")
        t = torch.ones(3)
        assert torch.equal(group.allreduce([t]).get_future().value()[0], t)
    finally:
        group.shutdown()
    assert not list(tmp_path.rglob("*.so"))
