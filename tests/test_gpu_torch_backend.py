"""torch.distributed's "anyccl" backend on GPUs: collectives on CUDA tensors with torch's stream
semantics (Lightning's `device_id=` start included), and DDP, FSDP2 and the GradientAverager on
anyccl groups training to what torch DDP on NCCL gives. Needs 2 CUDA GPUs; skipped without."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from anyccl import gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu.device_count() < 2, reason="needs 2 GPUs")]

ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_collectives_on_cuda_tensors_follow_torchs_stream_semantics(transport):
    proc = subprocess.run([sys.executable, str(ROOT / "tests/scripts/torch_cuda_collectives.py"),
                           "2", str(_free_port())], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "ANYCCL_BACKEND": transport})
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_ddp_fsdp2_and_the_averager_on_anyccl_train_to_ddp_on_nccls_weights():
    variants = "ddp:nccl,ddp:anyccl-ipc,ddp:anyccl-nccl,fsdp2:anyccl-auto,averager:anyccl-auto"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/torch_ddp_backends.py"),
                           "--device", "cuda", "--width", "256", "--layers", "3", "--steps", "3",
                           "--rounds", "1", "--variants", variants],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("| ") and ":" in line.split("|")[1]}
    assert set(rows) == set(variants.split(",")), proc.stdout
    for name in ("ddp:anyccl-ipc", "ddp:anyccl-nccl"):
        assert rows[name].rstrip().endswith("| identical |"), rows[name]
