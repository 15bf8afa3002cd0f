"""GPU arrays on the `mpi` backend, staged through pinned host memory, on real GPUs: every
collective x dtype on 1, 2, 4 and 8 GPUs (as many as are visible) against NumPy, arrays that
span many pipeline chunks, and calls ordered after the caller's stream. Ranks are started by
mpiexec. Needs CUDA GPUs and an MPI; skipped without them. (The pipeline's logic is also tested
without a GPU, in test_mpi_staging.py, with the CUDA calls simulated.)"""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
from harness import run_ranks
from reference import assert_matches, make_input, reduce_reference, valid_ops
from test_gpu import (
    check_uneven_forms_of_cuda_tensors,
    to_gpu,
    to_host,
    two_gpus,
    world_sizes,
)

from anyccl import ReduceOp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("mpiexec") is None
                       or importlib.util.find_spec("mpi4py") is None,
                       reason="needs mpiexec and mpi4py"),
]

# 64 KiB chunks: a 1 MiB array crosses the ring of pinned slots many times
STAGED_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0",
              "ANYCCL_TIMEOUT": "60", "ANYCCL_MPI_STAGING_CHUNK": str(64 << 10)}
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, "bfloat16"]
COUNTS = [1, 1000, (1 << 18) + 3]


def check_staged_collectives(comm) -> int:
    from anyccl.buffers import BFLOAT16

    assert comm.backend.split(",")[0].removeprefix("cpu:") == "mpi"   # host arrays: mpi
    d, n, r = comm.device, comm.size, comm.rank
    checked = 0
    for name in DTYPES:
        dtype = BFLOAT16 if name == "bfloat16" else np.dtype(name)
        for count in COUNTS:
            inputs = [make_input(q, count, dtype) for q in range(n)]
            ops = valid_ops(dtype) if count <= 1000 else [ReduceOp.SUM, ReduceOp.MAX]
            for op in ops:
                x = to_gpu(inputs[r], d)
                comm.all_reduce(x, op=op)
                assert_matches(to_host(x), reduce_reference(inputs, op),
                               f"all_reduce {dtype} x {count} {op.name}")
                checked += 1
            root = n - 1
            x = to_gpu(inputs[r] if r == root else np.zeros(count, dtype), d)
            comm.broadcast(x, root)
            assert_matches(to_host(x), inputs[root], f"broadcast {dtype} x {count}")
            x = to_gpu(inputs[r], d)
            comm.reduce(x, 0, op=ReduceOp.SUM)
            assert_matches(to_host(x), reduce_reference(inputs, ReduceOp.SUM) if r == 0
                           else inputs[r], f"reduce {dtype} x {count}")
            out = to_gpu(np.zeros(count * n, dtype), d)
            comm.all_gather(out, to_gpu(inputs[r], d))
            assert_matches(to_host(out), np.concatenate(inputs), f"all_gather {dtype} x {count}")
            pieces = [make_input(q, count * n, dtype, salt=1) for q in range(n)]
            out = to_gpu(np.zeros(count, dtype), d)
            comm.reduce_scatter(out, to_gpu(pieces[r], d), op=ReduceOp.SUM)
            expected = reduce_reference([p[r * count:(r + 1) * count] for p in pieces],
                                        ReduceOp.SUM)
            assert_matches(to_host(out), expected, f"reduce_scatter {dtype} x {count}")
            send = [make_input(q * n + p, count, dtype, salt=3) for q in range(n)
                    for p in range(n)]
            out = to_gpu(np.zeros(count * n, dtype), d)
            comm.all_to_all(out, to_gpu(np.concatenate(send[r * n:(r + 1) * n]), d))
            assert_matches(to_host(out), np.concatenate([send[q * n + r] for q in range(n)]),
                           f"all_to_all {dtype} x {count}")
            checked += 5
    return checked


@pytest.mark.parametrize("world", world_sizes())
def test_staged_collectives_on_gpu_arrays_match_numpy(world):
    checked = run_ranks(check_staged_collectives, world, env=STAGED_ENV, deadline_s=240,
                        backend="mpi")
    assert checked[0] > 100


def check_staged_stream_order(comm) -> bool:
    import torch

    side = torch.cuda.Stream(comm.device)
    n = 1 << 20  # 4 MiB of float32: 64 chunks of 64 KiB
    with torch.cuda.stream(side):
        x = torch.empty(n, device=f"cuda:{comm.device}")
        torch.cuda._sleep(200_000_000)   # GPU busy a while before x is written
        x.fill_(comm.rank + 1.0)
        comm.all_reduce(x)                # must see the fill, not what x held before
        y = x * 2                         # and this must see the sum
    side.synchronize()
    assert torch.all(y == comm.size * (comm.size + 1)), y[:4]
    work = comm.all_reduce(torch.full((n,), 1.0, device=f"cuda:{comm.device}"), async_op=True)
    assert work.wait(timeout=30) and work.is_completed()
    return True


@two_gpus()
def test_staged_calls_follow_the_callers_stream_on_two_gpus():
    assert all(run_ranks(check_staged_stream_order, 2, env=STAGED_ENV, backend="mpi"))


@pytest.mark.parametrize("world", (1, 2))   # ranks may share a GPU here: the wire is MPI's
def test_uneven_forms_of_staged_cuda_tensors(world):
    for r, right in enumerate(run_ranks(check_uneven_forms_of_cuda_tensors, world,
                                        env=STAGED_ENV, deadline_s=120, backend="mpi")):
        assert all(right), (r, right)
