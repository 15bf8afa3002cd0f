"""GPU arrays on the nccl backend: every collective x every dtype on 1, 2, 4 and 8 GPUs (as many
as are visible) against NumPy, stream ordering, async Works, CuPy / JAX / DLPack arrays, host and
GPU arrays on one communicator, batched point-to-point, sub-groups, and timeouts and dead peers
that abort NCCL instead of hanging. Needs CUDA GPUs and nccl4py; skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from harness import eventually, run_ranks, spawn_processes
from reference import (
    COUNTS,
    DTYPES,
    FAMILY_DTYPES,
    assert_matches,
    make_input,
    reduce_reference,
    valid_ops,
)

from anyccl import ReduceOp, gpu
from anyccl.ops import dtype_kind

pytestmark = pytest.mark.gpu

# JAX must not take most of the GPU's memory for itself; NCCL multicast stays off (shared hosts)
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0",
           "ANYCCL_TIMEOUT": "60"}


def world_sizes():
    """1, 2, 4 and 8 ranks, one GPU each; a size needing more GPUs than visible is skipped."""
    return [pytest.param(n, marks=pytest.mark.skipif(gpu.device_count() < n,
                                                     reason=f"needs {n} GPUs"))
            for n in (1, 2, 4, 8)]


def two_gpus():
    return pytest.mark.skipif(gpu.device_count() < 2, reason="needs 2 GPUs")


class OnlyDLPack:
    """An array that offers DLPack alone (what anyccl reads of an array it does not know)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


# ---- arrays on the GPU, and back ---------------------------------------------------------------
def to_gpu(a: np.ndarray, device: int):
    """A GPU copy of `a`: torch for bfloat16 (CuPy has none), CuPy for everything else."""
    if a.dtype.name == "bfloat16":
        import torch

        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(f"cuda:{device}")
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(a)


def to_host(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        import ml_dtypes
        import torch

        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


def nccl_reduces(dtype: np.dtype, op: ReduceOp) -> bool:
    """What the nccl backend promises to reduce (else it must refuse with UnsupportedError)."""
    kind = dtype_kind(dtype)
    if kind == "b":
        return op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR, ReduceOp.PROD, ReduceOp.MIN,
                      ReduceOp.BAND)
    if kind == "c":
        return op in (ReduceOp.SUM, ReduceOp.AVG)
    if dtype in (np.int16, np.uint16):
        return False
    return op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


def cases():
    for count in COUNTS:
        for dtype in (DTYPES if count <= 1000 else FAMILY_DTYPES):
            yield np.dtype(dtype), count


# ---- every op x every dtype ---------------------------------------------------------------------
def check_every_collective(comm):
    import anyccl

    d, n, r = comm.device, comm.size, comm.rank
    checked = refused = 0
    for dtype, count in cases():
        inputs = [make_input(q, count, dtype) for q in range(n)]
        for op in valid_ops(dtype):
            what = f"{dtype} x {count} {op.name}"
            x = to_gpu(inputs[r], d)
            if not nccl_reduces(dtype, op):
                with pytest.raises(anyccl.UnsupportedError, match="nccl"):
                    comm.all_reduce(x, op=op)
                refused += 1
                continue
            comm.all_reduce(x, op=op)
            assert_matches(to_host(x), reduce_reference(inputs, op), f"all_reduce {what}")
            for root in range(n):
                x = to_gpu(inputs[r], d)
                comm.reduce(x, root, op=op)
                expected = reduce_reference(inputs, op) if r == root else inputs[r]
                assert_matches(to_host(x), expected, f"reduce root {root} {what}")
            pieces = [make_input(q, count * n, dtype, salt=1) for q in range(n)]
            out = to_gpu(np.zeros(count, dtype), d)
            comm.reduce_scatter(out, to_gpu(pieces[r], d), op=op)
            expected = reduce_reference([p[r * count:(r + 1) * count] for p in pieces], op)
            assert_matches(to_host(out), expected, f"reduce_scatter {what}")
            checked += 3
        for root in range(n):
            x = to_gpu(inputs[r] if r == root else np.zeros(count, dtype), d)
            comm.broadcast(x, root)
            assert_matches(to_host(x), inputs[root], f"broadcast {dtype} x {count}")
        out = to_gpu(np.zeros(count * n, dtype), d)
        comm.all_gather(out, to_gpu(inputs[r], d))
        assert_matches(to_host(out), np.concatenate(inputs), f"all_gather {dtype} x {count}")
        outs = [to_gpu(np.zeros(count, dtype), d) for _ in range(n)] if r == 0 else None
        comm.gather(to_gpu(inputs[r], d), outs, 0)
        if r == 0:
            for q in range(n):
                assert_matches(to_host(outs[q]), inputs[q], f"gather {dtype} x {count}")
        chunks = [to_gpu(make_input(q, count, dtype, salt=2), d) for q in range(n)]
        out = to_gpu(np.zeros(count, dtype), d)
        comm.scatter(out, chunks if r == n - 1 else None, n - 1)
        assert_matches(to_host(out), make_input(r, count, dtype, salt=2),
                       f"scatter {dtype} x {count}")
        send = [make_input(q * n + p, count, dtype, salt=3) for q in range(n) for p in range(n)]
        out = to_gpu(np.zeros(count * n, dtype), d)
        comm.all_to_all(out, to_gpu(np.concatenate(send[r * n:(r + 1) * n]), d))
        expected = np.concatenate([send[q * n + r] for q in range(n)])
        assert_matches(to_host(out), expected, f"all_to_all {dtype} x {count}")
        inplace = to_gpu(np.concatenate(send[r * n:(r + 1) * n]), d)
        comm.all_to_all(inplace, inplace)
        assert_matches(to_host(inplace), expected, f"all_to_all in place {dtype} x {count}")
        checked += 6
    return checked, refused


@pytest.mark.parametrize("world", world_sizes())
def test_every_collective_and_dtype_matches_numpy_or_is_refused_by_name(world):
    results = run_ranks(check_every_collective, world, env=GPU_ENV, deadline_s=150)
    checked, refused = results[0]
    assert checked > 500 and refused > 0


# ---- streams and Works ------------------------------------------------------------------------
def check_stream_order(comm):
    import time

    import torch

    comm.connect_gpu()  # NCCL's start (imports, init: up to a second of CPU) is not timed below
    side = torch.cuda.Stream(comm.device)
    n = 1 << 20
    with torch.cuda.stream(side):
        x = torch.empty(n, device=f"cuda:{comm.device}")
        torch.cuda._sleep(2_000_000_000)          # ~1 s of GPU time before x is written
        x.fill_(comm.rank + 1.0)
        started = time.perf_counter()
        comm.all_reduce(x)                        # queued after the fill; returns at once
        took = time.perf_counter() - started     # far less than the sleep: no host block
        y = x * 2                                 # runs after the all_reduce on this stream
    side.synchronize()
    total = comm.size * (comm.size + 1) / 2
    assert took < 0.2, f"all_reduce blocked the host for {took:.3f} s"
    assert torch.all(y == 2 * total), y[:4]

    # async: wait() orders the current stream; wait(timeout) and is_completed() follow the GPU
    x = torch.full((n,), comm.rank + 1.0, device=f"cuda:{comm.device}")
    work = comm.all_reduce(x, async_op=True)
    work.wait()
    z = x.clone()
    assert work.wait(timeout=30) and work.is_completed() and work.exception() is None
    assert torch.all(z == total)

    # stream= names the stream explicitly
    other = torch.cuda.Stream(comm.device)
    x = torch.full((n,), 1.0, device=f"cuda:{comm.device}")
    torch.cuda.current_stream(comm.device).synchronize()
    comm.all_reduce(x, stream=other)
    other.synchronize()
    assert torch.all(x == comm.size)
    return True


@pytest.mark.parametrize("world", world_sizes())
def test_calls_queue_after_the_callers_stream_and_works_follow_cuda_events(world):
    assert all(run_ranks(check_stream_order, world, env=GPU_ENV, deadline_s=90))


def check_array_kinds(comm):
    import cupy
    import jax
    import jax.numpy as jnp
    import torch

    d, total = comm.device, comm.size * (comm.size + 1) / 2
    with cupy.cuda.Device(d):
        c = cupy.full(1000, comm.rank + 1, cupy.float32)
        comm.all_reduce(c)
        assert float(c[0]) == total and float(c[-1]) == total

    j = jax.device_put(jnp.full(1000, comm.rank + 1, jnp.float32), jax.devices("gpu")[d])
    comm.all_reduce(j)                             # written in place; visible on return
    assert float(j[0]) == total and float(j.sum()) == 1000 * total

    t = torch.full((1000,), comm.rank + 1.0, device=f"cuda:{d}")
    comm.all_reduce(OnlyDLPack(t))
    assert torch.all(t == total)

    # one communicator, host and GPU arrays: host ones go to shm, GPU ones to nccl
    h = np.full(10, comm.rank + 1.0)
    comm.all_reduce(h)
    assert np.all(h == total)
    assert comm.backend == "cpu:shm,cuda:nccl"
    return True


@pytest.mark.parametrize("world", world_sizes())
def test_cupy_jax_and_dlpack_arrays_and_host_arrays_on_one_communicator(world):
    assert all(run_ranks(check_array_kinds, world, env=GPU_ENV, deadline_s=90))


def check_non_contiguous_gpu_arrays(comm):
    """torch CUDA tensors and CuPy arrays that are not contiguous run on contiguous copies and
    get the result in place; the memory between their elements is never written."""
    import cupy
    import torch

    d, n, r = comm.device, comm.size, comm.rank
    dev = f"cuda:{d}"
    total = n * (n + 1) / 2
    # a column: all_reduce, blocking and async; the other columns stay as they were
    m = torch.full((64, 5), -7.0, device=dev)
    m[:, 1] = r + 1
    comm.all_reduce(m[:, 1])
    assert torch.all(m[:, 1] == total) and torch.all(m[:, [0, 2, 3, 4]] == -7)
    m[:, 3] = r + 1
    work = comm.all_reduce(m[:, 3], async_op=True)
    work.wait()
    assert torch.all(m[:, 3] == total) and torch.all(m[:, [0, 2, 4]] == -7)
    # transposed and channels_last: broadcast from the last rank
    t = torch.arange(12.0, device=dev).reshape(3, 4) * (r + 1)
    comm.broadcast(t.t(), n - 1)
    assert torch.equal(t, torch.arange(12.0, device=dev).reshape(3, 4) * n)
    w = torch.nn.Conv2d(3, 8, 3).to(dev).weight.data.to(memory_format=torch.channels_last)
    assert not w.is_contiguous()
    root = w.clone()
    comm.broadcast(root, 0)                         # every rank's reference: rank 0's weight
    comm.broadcast(w, 0)
    assert torch.equal(w, root) and not w.is_contiguous()
    # all_gather into a column of a wider matrix, reduce_scatter out of a transposed input
    wide = torch.full((4 * n, 3), -7.0, device=dev)
    comm.all_gather(wide[:, 2], torch.full((4,), float(r), device=dev))
    assert torch.equal(wide[:, 2], torch.arange(n, device=dev).repeat_interleave(4).float())
    assert torch.all(wide[:, :2] == -7)
    inp = torch.ones(3, n, device=dev).t()          # (n, 3): not contiguous once n > 1
    out = torch.full((3, 2), -7.0, device=dev)
    comm.reduce_scatter(out[:, 1], inp)
    assert torch.all(out[:, 1] == n) and torch.all(out[:, 0] == -7)
    # reduce to the last rank, gather to rank 0 and scatter from it, all_to_all: columns
    red = torch.full((8, 2), -7.0, device=dev)
    red[:, 1] = r + 1
    comm.reduce(red[:, 1], n - 1)
    assert torch.all(red[:, 1] == (total if r == n - 1 else r + 1)) and torch.all(red[:, 0] == -7)
    got = [torch.full((6, 2), -7.0, device=dev) for _ in range(n)]
    comm.gather(torch.full((6,), float(r), device=dev), [g[:, 0] for g in got] if r == 0
                else None, 0)
    assert r != 0 or all(torch.all(g[:, 0] == q) and torch.all(g[:, 1] == -7)
                         for q, g in enumerate(got))
    box = torch.full((6, 2), -7.0, device=dev)
    chunks = [torch.full((6,), 10.0 + q, device=dev) for q in range(n)]
    comm.scatter(box[:, 1], chunks if r == 0 else None, 0)
    assert torch.all(box[:, 1] == 10 + r) and torch.all(box[:, 0] == -7)
    mixed = torch.full((2 * n, 2), -7.0, device=dev)
    comm.all_to_all(mixed[:, 0], torch.arange(2 * n, device=dev).float() + 100 * r)
    want = torch.tensor([100.0 * q + 2 * r + k for q in range(n) for k in range(2)], device=dev)
    assert torch.equal(mixed[:, 0], want) and torch.all(mixed[:, 1] == -7)
    # uneven all_gather (rank q gives q + 1 elements) into columns; a column through DLPack
    outs = [torch.full((q + 1, 2), -7.0, device=dev) for q in range(n)]
    comm.all_gather([o[:, 1] for o in outs], torch.full((r + 1,), float(r), device=dev))
    assert all(torch.all(o[:, 1] == q) and torch.all(o[:, 0] == -7) for q, o in enumerate(outs))

    m[:, 4] = r + 1
    comm.all_reduce(OnlyDLPack(m[:, 4]))
    assert torch.all(m[:, 4] == total) and torch.all(m[:, [0, 2]] == -7)
    # a message into a column
    if n > 1:
        peer = r ^ 1
        if peer < n:
            box = torch.full((16, 2), -7.0, device=dev)
            if r % 2 == 0:
                comm.send(torch.full((16,), r + 1.0, device=dev), peer)
                comm.recv(box[:, 0], peer)
            else:
                comm.recv(box[:, 0], peer)
                comm.send(torch.full((16,), r + 1.0, device=dev), peer)
            assert torch.all(box[:, 0] == peer + 1) and torch.all(box[:, 1] == -7)
    # CuPy: a reversed view and a column
    with cupy.cuda.Device(d):
        c = cupy.full((32, 3), -7.0, cupy.float32)
        c[:, 2] = r + 1
        comm.all_reduce(c[::-1, 2])
        assert bool((c[:, 2] == total).all()) and bool((c[:, :2] == -7).all())
    torch.cuda.synchronize(dev)
    return True


@pytest.mark.parametrize("world", world_sizes())
def test_gpu_arrays_that_are_not_contiguous_get_results_in_place(world):
    assert all(run_ranks(check_non_contiguous_gpu_arrays, world, env=GPU_ENV, deadline_s=90))


def check_refusals(comm):
    import torch

    import anyccl

    t = torch.ones(8, device=f"cuda:{comm.device}")
    with pytest.raises(anyccl.InvalidArgumentError,
                       match=r"tensor is a GPU array but out is in host memory"):
        comm.all_gather(np.zeros(8 * comm.size, np.float32), t)
    with pytest.raises(anyccl.InvalidArgumentError, match="stream= applies to GPU arrays"):
        comm.all_reduce(np.ones(3), stream=0)
    with pytest.raises(anyccl.UnsupportedError, match="nccl backend cannot reduce int32.*BXOR"):
        comm.all_reduce(torch.ones(8, dtype=torch.int32, device=t.device), op="bxor")
    with pytest.raises(anyccl.InvalidArgumentError, match="elements that share memory"):
        comm.all_reduce(torch.ones(8, device=t.device).expand(4, 8))
    with pytest.raises(anyccl.InvalidArgumentError, match="stream= does not order"):
        comm.all_reduce(torch.ones(8, 8, device=t.device).t(),
                        stream=torch.cuda.current_stream(t.device))
    if gpu.device_count() > 1:
        elsewhere = torch.ones(8, device=f"cuda:{(comm.device + 1) % gpu.device_count()}")
        with pytest.raises(anyccl.InvalidArgumentError, match="this rank's communicator uses GPU"):
            comm.all_reduce(elsewhere)
    comm.all_reduce(t)                              # still usable
    assert torch.all(t == comm.size)
    return True


@pytest.mark.parametrize("world", world_sizes())
def test_bad_gpu_calls_are_refused_by_name_and_leave_the_communicator_usable(world):
    assert all(run_ranks(check_refusals, world, env=GPU_ENV, deadline_s=90))


# ---- point to point, groups ---------------------------------------------------------------------
def check_point_to_point(comm):
    import torch

    dev = f"cuda:{comm.device}"
    comm.barrier()
    comm.all_reduce(torch.zeros(1, device=dev))     # creates the NCCL communicator, if not yet
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    mine = torch.arange(1 << 20, dtype=torch.float32, device=dev) + comm.rank
    got = torch.empty_like(mine)
    with comm.batch():                             # a ring: would deadlock unbatched
        comm.isend(mine, right)
        work = comm.irecv(got, left)
    work.wait()
    assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32, device=dev) + left)
    again = torch.empty_like(mine)                 # the same ring in one call, on the stream
    assert comm.sendrecv(mine + 1, right, again, left) == left
    assert torch.equal(again, got + 1)

    # ping-pong of fp16 GPU0 -> GPU1 -> GPU0, exact
    x = torch.randn(4096, device=dev).half() if comm.rank == 0 else \
        torch.empty(4096, dtype=torch.float16, device=dev)
    if comm.rank == 0:
        original = x.clone()
        comm.send(x, 1, tag=7)
        back = torch.empty_like(x)
        comm.recv(back, 1, tag=8)
        assert (back.float() - original.float()).abs().max().item() == 0
    else:
        comm.recv(x, 0, tag=7)
        comm.send(x, 0, tag=8)
    torch.cuda.synchronize(comm.device)

    singles = comm.split(color=comm.rank)           # NCCL communicators split too
    y = torch.full((16,), 5.0, device=dev)
    singles.all_reduce(y)
    assert torch.all(y == 5.0) and singles.size == 1
    pair = comm.new_group([0, 1])
    z = torch.ones(16, device=dev)
    pair.all_reduce(z)
    assert torch.all(z == 2.0)
    singles.close()
    pair.close()
    return True


@two_gpus()
def test_batched_ring_ping_pong_and_split_on_two_gpus():
    assert all(run_ranks(check_point_to_point, 2, env=GPU_ENV, deadline_s=90))


# ---- fail fast ----------------------------------------------------------------------------------
def check_timeout(comm):
    import time

    import torch

    import anyccl

    x = torch.ones(1 << 16, device=f"cuda:{comm.device}")
    comm.all_reduce(x)                              # both ranks: the NCCL communicator exists
    torch.cuda.synchronize(comm.device)
    if comm.rank == 1:
        time.sleep(8)                               # never joins the next all_reduce
        return "idle"
    work = comm.all_reduce(x, async_op=True)
    with pytest.raises(anyccl.TimeoutError, match="not complete on the GPU"):
        work.wait(timeout=0.5)
    started = time.monotonic()
    torch.cuda.synchronize(comm.device)             # returns: the watchdog aborts NCCL at 3 s
    waited = time.monotonic() - started
    with pytest.raises(anyccl.TimeoutError, match=r"all_reduce\(.*#\d+.*aborted"):
        comm.all_reduce(x)
    return waited


@two_gpus()
def test_an_op_past_its_deadline_aborts_nccl_and_the_next_call_names_it():
    waited = run_ranks(check_timeout, 2, env={**GPU_ENV, "ANYCCL_TIMEOUT": "3"},
                       deadline_s=60)[0]
    assert waited < 6


DEAD_PEER = r"""
import os, time, torch, anyccl
comm = anyccl.init(device_id=int(os.environ["RANK"]))
x = torch.ones(1 << 16, device=f"cuda:{comm.device}")
comm.all_reduce(x); torch.cuda.synchronize()
if comm.rank == 1:
    os._exit(3)
started = time.monotonic()
try:
    for _ in range(1000):
        comm.all_reduce(x)
        torch.cuda.synchronize()
except anyccl.PeerLostError as exc:
    print(f"LOST {exc.lost_rank} {time.monotonic() - started:.2f}", flush=True)
    print(exc, flush=True)
"""


@two_gpus()
def test_a_dead_peer_aborts_nccl_and_raises_peer_lost_within_seconds():
    from test_reliability import _job_env

    server, envs = _job_env(2)
    try:
        survivor, victim = spawn_processes(DEAD_PEER, [{**GPU_ENV, **e} for e in envs],
                                           timeout_s=60)
    finally:
        server.close()
    assert victim.returncode == 3
    lines = survivor.stdout.splitlines()
    assert lines and lines[0].startswith("LOST 1"), survivor.stdout + survivor.stderr
    assert float(lines[0].split()[2]) < 10
    assert "rank 1 (pid" in survivor.stdout and "died" in survivor.stdout


# ---- gradient averaging on GPU arrays -----------------------------------------------------------
def check_gradient_averager_on_gpu_arrays(comm):
    import cupy
    import jax
    import jax.numpy as jnp
    import torch

    from anyccl.ddp import GradientAverager

    d, mean = comm.device, (comm.size - 1) / 2
    shapes = [(5, 3), (1000,), (7,)]
    expected = [mean + 0.001 * np.arange(int(np.prod(s))).reshape(s) for s in shapes]
    mine = [comm.rank + 0.001 * np.arange(int(np.prod(s))).reshape(s) for s in shapes]
    torch_grads = [torch.tensor(m, dtype=torch.float32, device=f"cuda:{d}") for m in mine]
    with cupy.cuda.Device(d):
        cupy_grads = [cupy.asarray(m, dtype=cupy.float32) for m in mine]
    jax_grads = [jax.device_put(jnp.asarray(m, jnp.float32), jax.devices("gpu")[d])
                 for m in mine]
    for grads in (torch_grads, cupy_grads, jax_grads):
        out = GradientAverager(comm, grads, bucket_mb=0.002).average()
        for o, e in zip(out, expected):
            got = o.cpu().numpy() if hasattr(o, "cpu") and not hasattr(o, "devices") else \
                np.asarray(cupy.asnumpy(o) if type(o).__module__.startswith("cupy") else o)
            np.testing.assert_allclose(got, e, rtol=1e-5)
    return True


@pytest.mark.parametrize("world", world_sizes())
def test_gradient_averager_on_torch_cupy_and_jax_gpu_arrays(world):
    assert all(run_ranks(check_gradient_averager_on_gpu_arrays, world, env=GPU_ENV,
                         deadline_s=90))


# ---- bit-identical reductions on every GPU backend --------------------------------------------
def check_order_dependent_sums(comm, count: int, dtype_name: str) -> list[str]:
    import hashlib

    from test_collectives import order_sensitive

    from anyccl.buffers import BFLOAT16

    dtype = np.dtype(BFLOAT16 if dtype_name == "bfloat16" else dtype_name)
    d, n, r = comm.device, comm.size, comm.rank
    mine = order_sensitive(r, count, dtype)
    digests = []
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        x = to_gpu(mine, d)
        comm.all_reduce(x, op=op)
        digests.append(hashlib.sha256(to_host(x).tobytes()).hexdigest())
        out = to_gpu(np.zeros(count, dtype), d)
        comm.reduce_scatter(out, to_gpu(np.concatenate([mine] * n), d), op=op)
        everything = to_gpu(np.zeros(count * n, dtype), d)
        comm.all_gather(everything, out)
        digests.append(hashlib.sha256(to_host(everything).tobytes()).hexdigest())
    return digests


@two_gpus()
@pytest.mark.parametrize("backend", ["nccl", "ipc", "auto"])
@pytest.mark.parametrize("count", [1000, 300_001, 4_194_307])  # low latency, one, two shots
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_order_dependent_sums_are_bit_identical_on_every_gpu(backend, count, dtype_name):
    env = {**GPU_ENV, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    n = gpu.device_count()
    results = run_ranks(check_order_dependent_sums, n, count, dtype_name, env=env,
                        deadline_s=240)
    assert all(digests == results[0] for digests in results), \
        f"{backend}: ranks hold different results of one reduction"


# ---- repeated blocking calls: cached plans ----------------------------------------------------
def check_repeated_calls(comm) -> tuple[list[bool], bool, set[str], dict, bool]:
    """A training loop's calls: the same torch tensors, new values each step. From the second
    call on, each op replays its plan (plans.py); results stay right, and a plan does not keep
    the tensors alive. Also: what the plans queue (the kinds of their enqueue functions), and
    how many all_reduce and broadcast replays took the Python way (the others ran whole in
    compiled code), per size."""
    import gc
    import weakref

    import torch

    from anyccl.gpu_dispatch import FULL_PATH

    d, n, r = comm.device, comm.size, comm.rank
    dev = f"cuda:{d}"
    side, python_replays = comm._gpu_side, {}
    replay = side.replay

    def counted(tag, *rest):
        got = replay(tag, *rest)
        if got is not FULL_PATH and tag[0] in ("all_reduce", "broadcast"):
            python_replays[count] = python_replays.get(count, 0) + 1
        return got
    side.replay = counted
    for count in (2, 70_000):   # ipc: the low-latency kernel and the one-shot one
        x = torch.zeros(count, device=dev)
        out = torch.zeros(count * n, device=dev)
        part = torch.zeros(count, device=dev)
        for step in range(4):
            x.fill_(r + step)
            comm.all_reduce(x)
            total = sum(q + step for q in range(n))
            assert (x == total).all(), (count, step)
            comm.all_gather(out, x)
            assert (out == total).all(), (count, step)
            out.copy_(torch.arange(count * n, device=dev, dtype=torch.float32) + r)
            comm.reduce_scatter(part, out)
            expected = n * torch.arange(r * count, (r + 1) * count, device=dev) + sum(range(n))
            assert (part == expected).all(), (count, step)
            x.fill_(r + 10 * step)
            comm.broadcast(x, n - 1)
            assert (x == n - 1 + 10 * step).all(), (count, step)
    calls = comm.flight_recorder.entries()[-32:]   # 2 sizes x 4 steps x 4 operations
    replayed = [e["replayed"] for e in calls]
    kinds = {type(plan.enqueue).__name__ for plan in comm._gpu_side.plans._plans.values()}
    gone = weakref.ref(x)
    del x
    torch.cuda.synchronize()
    # the watchdog lets finished operations go (and their hold on x) soon after
    return (replayed, eventually(lambda: gc.collect() >= 0 and gone() is None), kinds,
            python_replays, side.compiled_replay is not None)


@two_gpus()
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_repeated_blocking_calls_on_the_same_tensors_stay_right_and_free_them(backend):
    env = {**GPU_ENV, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    for replayed, freed, kinds, python_replays, compiled in run_ranks(
            check_repeated_calls, gpu.device_count(), env=env):
        # each (size, op): steps of 4 ops each; once a call replays, the later ones do too, and
        # the last two steps replay (the first GPU call leaves no plan, so the op after it in
        # the same position plans one step later)
        for size in (0, 16):
            for op in range(4):
                steps = replayed[size + op:size + 16:4]
                assert steps == sorted(steps) and steps[2:] == [True, True], (size, op, steps)
        assert freed, "a cached plan kept the user's tensor alive"
        # each replay is one compiled call: an ipc kernel's launch, or NCCL's call itself
        assert ("KernelLaunch" if backend == "ipc" else "NcclCall") in kinds, kinds
        # the small all_reduce and broadcast (one compiled call each) replay whole in compiled
        # code where the CUDA core loaded: none of them took the Python way
        assert compiled == (gpu._core is not None)
        if compiled:
            assert python_replays.get(2, 0) == 0, python_replays


def check_repeated_async_calls(comm) -> tuple[list[bool], int, bool]:
    """A GradientAverager's or DDP's calls: async all_reduce of the same buckets on a side
    stream, step after step, waited on before use. From the second call on each replays its
    plan on the backend's stream; results stay right, and once done nothing keeps the tensors
    alive."""
    import gc
    import weakref

    import torch

    d, n, r = comm.device, comm.size, comm.rank
    side = torch.cuda.Stream(d)
    right = []
    with torch.cuda.stream(side):
        for count in (2, 70_000, 3_000_000):   # ipc: low latency, one shot, two shots
            x = torch.zeros(count, device=f"cuda:{d}")
            for step in range(4):
                x.fill_(r + step)                 # a kernel writes it just before
                work = comm.all_reduce(x, async_op=True)
                work.wait()
                right.append(bool((x * 1 == sum(q + step for q in range(n))).all()))
    side.synchronize()
    replayed = [e["replayed"] for e in comm.flight_recorder.entries()[-12:]]   # 3 sizes x 4
    gone = weakref.ref(x)
    del x
    torch.cuda.synchronize()
    return right, replayed, eventually(lambda: gc.collect() >= 0 and gone() is None)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("world", world_sizes()[:2])
def test_repeated_async_calls_on_the_same_tensors_stay_right_and_free_them(backend, world):
    env = {**GPU_ENV, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    for right, replayed, freed in run_ranks(check_repeated_async_calls, world, env=env,
                                            deadline_s=120):
        assert right == [True] * 12, right
        # each size: once a call replays its plan, the later ones do too, and the last two
        # replay (the very first GPU call leaves no plan: the second plans, the third replays)
        for steps in (replayed[0:4], replayed[4:8], replayed[8:12]):
            assert steps == sorted(steps) and steps[2:] == [True, True], replayed
        assert freed, "a cached plan or a finished operation kept the tensor alive"


def check_calls_from_a_thread_new_to_cuda(comm):
    """A thread whose first CUDA call is anyccl's: blocking, async and a message-free plan
    replay all work (the communicator gives the thread its device's context)."""
    import threading

    import torch

    x = torch.full((64,), float(comm.rank + 1), device=f"cuda:{comm.device}")
    torch.cuda.synchronize()
    failed = []

    def calls() -> None:
        try:
            comm.all_reduce(x)
            comm.all_reduce(x)                      # the second: the cached plan
            comm.all_reduce(x, async_op=True).wait()
        except BaseException as exc:                # reported by the main thread
            failed.append(exc)
    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert not failed, failed
    total = sum(range(1, comm.size + 1))
    return bool(torch.all(x == float(total * comm.size ** 2)).item())


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("world", world_sizes()[:2])
def test_calls_from_a_thread_that_never_used_cuda_work(backend, world):
    env = {**GPU_ENV, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    assert all(run_ranks(check_calls_from_a_thread_new_to_cuda, world, env=env, deadline_s=120))


def check_uneven_forms_of_cuda_tensors(comm):
    """all_to_all with split sizes and all_gather, gather and scatter with a size per rank, on
    torch CUDA tensors: blocking on a side stream whose input a kernel just wrote, async, and
    with stream=; values against what each must give."""
    import torch

    n, r = comm.size, comm.rank
    device = torch.device("cuda", comm.device)
    sends = [(r + 2 * j) % 4 for j in range(n)]            # zeros included
    receives = [(j + 2 * r) % 4 for j in range(n)]
    want = torch.cat([torch.full(((j + 2 * r) % 4,), 100.0 * j + r) for j in range(n)])
    side = torch.cuda.Stream(device)
    results = []
    with torch.cuda.stream(side):
        inp = torch.cat([torch.full((c,), 100.0 * r + j, device=device)
                         for j, c in enumerate(sends)]) * 1
        out = torch.full((sum(receives),), -1.0, device=device)
        comm.all_to_all(out, inp, out_splits=receives, in_splits=sends)
        results.append(out * 1)
        out = torch.full((sum(receives),), -1.0, device=device)
        comm.all_to_all(out, inp, out_splits=receives, in_splits=sends, async_op=True).wait()
        results.append(out * 1)
    out = torch.full((sum(receives),), -1.0, device=device)
    comm.all_to_all(out, inp, out_splits=receives, in_splits=sends, stream=side)
    side.synchronize()
    results.append(out)
    right = [torch.equal(x.cpu(), want) for x in results]
    size = lambda j: 2 * j + 1  # noqa: E731 - rank j's size
    mine = torch.arange(size(r), device=device, dtype=torch.float32) + 100 * r
    gathered = [torch.full((size(j),), -1.0, device=device) for j in range(n)]
    comm.all_gather(gathered, mine)
    at_root = [torch.full((size(j),), -1.0, device=device) for j in range(n)] if r == 0 else None
    comm.gather(mine, at_root, 0, uneven=True)
    got = torch.full((size(r),), -1.0, device=device)
    chunks = [torch.full((size(j),), 10.0 * j, device=device) for j in range(n)] \
        if r == n - 1 else None
    comm.scatter(got, chunks, n - 1, uneven=True)
    expected = [(torch.arange(size(j), dtype=torch.float32) + 100 * j) for j in range(n)]
    right.append(all(torch.equal(g.cpu(), e) for g, e in zip(gathered, expected)))
    right.append(r != 0 or all(torch.equal(g.cpu(), e) for g, e in zip(at_root, expected)))
    right.append(torch.equal(got.cpu(), torch.full((size(r),), 10.0 * r)))
    return right


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("world", world_sizes()[:2])
def test_uneven_forms_of_cuda_tensors_on_every_gpu_backend(backend, world):
    env = {**GPU_ENV, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    for r, right in enumerate(run_ranks(check_uneven_forms_of_cuda_tensors, world, env=env,
                                        deadline_s=120)):
        assert all(right), (r, right)
