"""What the GPU path decides without a GPU: backend specs, device ids, NCCL's dtype/op table,
refusals on machines without CUDA, and `anyccl info`. Runs everywhere (CI has no GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from harness import run_ranks, suite_backend

import anyccl
from anyccl import ReduceOp, gpu
from anyccl.backends.nccl import data_view, reduction_view
from anyccl.bootstrap import _device_index, parse_backend
from anyccl.buffers import BFLOAT16, GpuArray


@pytest.mark.parametrize("spec, expected", [
    ("shm", ("shm", None)), ("gloo", ("shm", None)), ("nccl", ("shm", "nccl")),
    ("cpu:shm,cuda:nccl", ("shm", "nccl")), ("cpu:gloo,cuda:nccl", ("shm", "nccl")),
    (" NCCL ", ("shm", "nccl")), ("ipc", ("shm", "ipc")), ("cpu:shm,cuda:auto", ("shm", "auto")),
])
def test_backend_specs_name_a_host_backend_and_an_optional_gpu_backend(spec, expected):
    assert parse_backend(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("cuda:shm", "'shm' is not a GPU backend"),
    ("tpu:nccl", "device 'tpu' is unknown"),
    ("carrier-pigeon", "is unknown"),
    ("cpu:ipc", "'ipc' is unknown"),
])
def test_bad_backend_specs_are_refused_by_name(spec, message):
    with pytest.raises(anyccl.UnsupportedError, match=message):
        parse_backend(spec)


def test_device_ids_are_ints_or_torch_devices():
    torch = pytest.importorskip("torch")
    assert _device_index(3) == 3 and _device_index(torch.device("cuda:1")) == 1
    for bad in (-1, "0", True, 1.0):
        with pytest.raises(anyccl.InvalidArgumentError, match="device_id"):
            _device_index(bad)


def _gpu(dtype, size=10) -> GpuArray:
    return GpuArray(4096, size, np.dtype(dtype), 0, 0, "test", None)


def test_nccl_moves_any_dtype_and_reduces_what_it_can_exactly():
    assert data_view(_gpu(np.float32)) == (10, 7)
    assert data_view(_gpu(np.complex128)) == (160, 1)          # as bytes
    assert data_view(_gpu(np.int16)) == (20, 1)
    assert reduction_view(_gpu(BFLOAT16), ReduceOp.AVG, 2) == (10, 9, 4)
    assert reduction_view(_gpu(np.complex64), ReduceOp.SUM, 2) == (20, 7, 0)  # real pairs
    assert reduction_view(_gpu(np.bool_), ReduceOp.SUM, 2) == (10, 1, 2)      # or = max
    assert reduction_view(_gpu(np.bool_), ReduceOp.BAND, 2) == (10, 1, 3)     # and = min
    assert reduction_view(_gpu(np.float32), ReduceOp.AVG, 1) == (10, 7, 0)    # mean of one
    for dtype, op in ((np.int16, ReduceOp.SUM), (np.int32, ReduceOp.BXOR),
                      (np.complex64, ReduceOp.PROD), (np.bool_, ReduceOp.BXOR)):
        with pytest.raises(anyccl.UnsupportedError, match="nccl backend cannot reduce"):
            reduction_view(_gpu(dtype), op, 2)


def check_host_only_refusals(comm):
    with pytest.raises(anyccl.InvalidArgumentError, match="stream= applies to GPU arrays"):
        comm.all_reduce(np.ones(3), stream=0)
    with pytest.raises(anyccl.InvalidArgumentError, match="stream= applies to GPU arrays"):
        comm.broadcast(np.ones(3), 0, stream=0)
    with comm.batch():                         # host messages in a batch simply progress
        w = comm.isend(np.ones(3), (comm.rank + 1) % comm.size)
        got = np.zeros(3)
        r = comm.irecv(got, (comm.rank - 1) % comm.size)
    w.wait()
    r.wait()
    assert got.tolist() == [1, 1, 1]
    with pytest.raises(anyccl.InvalidArgumentError, match="do not nest"):
        with comm.batch():
            with comm.batch():
                pass
    return comm.backend


def test_host_calls_refuse_stream_and_batches_work_for_host_messages():
    assert run_ranks(check_host_only_refusals, 2) == [suite_backend()] * 2


@pytest.mark.skipif(gpu.device_count() > 0, reason="this machine has a GPU")
@pytest.mark.parametrize("backend", ["nccl", "ipc", "auto"])
def test_asking_for_a_gpu_backend_without_a_gpu_says_so(backend):
    source = (f"import anyccl\ntry:\n    anyccl.init(backend={backend!r})\n"
              "except anyccl.AnycclError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                         timeout=60).stdout
    assert "UnsupportedError" in out and "a GPU backend was asked for" in out, out
    assert "no CUDA device is visible" in out


def test_anyccl_info_lists_backends_and_gpus():
    out = subprocess.run([sys.executable, "-m", "anyccl", "info"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for needle in ("backends:", "shm ", "nccl ", "GPUs:", "routing:"):
        assert needle in out.stdout
    # `pip install -e .` builds the CUDA core even where there is no CUDA
    assert "CUDA calls: compiled core built" in out.stdout, out.stdout


def test_anyccl_info_says_what_applies_to_this_machine():
    """No run of spaces inside a version, no GPU extra advised where there is no GPU, and the
    same word for an unset CUDA_VISIBLE_DEVICES as the errors use."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-m", "anyccl", "info"], capture_output=True, text=True,
                         timeout=60, env=env).stdout
    assert not re.search(r"Version:\s{2,}", out), out
    assert "CUDA_VISIBLE_DEVICES=(all)" in out and "(unset)" not in out
    if not gpu.machine_has_gpu():
        assert "anyccl[gpu]" not in out, out
        assert re.search(r"^  nccl .*this machine has no NVIDIA GPU$", out, re.M), out
