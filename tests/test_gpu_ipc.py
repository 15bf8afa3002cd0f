"""GPU arrays on the ipc backend (anyccl's kernels over CUDA IPC peer memory) on 1, 2, 4 and 8
GPUs (as many as are visible): every op the kernels serve x float32/float16/bfloat16 x
SUM/AVG/MIN/MAX against a float64 reference, through the one-shot, two-shot, several-kernel and
copy-engine paths (small buffers and thresholds force them), with the blocks of a kernel
split into pushers and takers and without, unaligned views, all_gather and reduce_scatter in
place, tagged messages
and batched rings larger than the message ring, what the kernels do not serve falling to NCCL,
a CUDA graph replaying a captured all_reduce, and a deadline that stops spinning kernels. Needs
CUDA GPUs, NVRTC and nccl4py; skipped without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks
from test_gpu import check_timeout, two_gpus, world_sizes

from anyccl import gpu

pytestmark = pytest.mark.gpu

# small buffers: 2 MiB halves (256 KiB-1 MiB slots); lines of data and flags up to 16 KiB, in
# two shots up to 128 KiB on 3 ranks or more, one shot of tiles up to 256 KiB, two shots
# above, copy engines from 1 MiB (a 1 MiB area: chunks of 64-512 KiB taking turns in its
# positions); a 4-slot message ring
IPC_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0",
           "ANYCCL_TIMEOUT": "60", "ANYCCL_BACKEND": "cpu:shm,cuda:ipc",
           "ANYCCL_IPC_HALF_MB": "2", "ANYCCL_IPC_CE_MB": "1", "ANYCCL_IPC_RING_MB": "4",
           "ANYCCL_TUNING": "ipc.ll_max=16K,ipc.ll_two_shot_max=128K,ipc.one_shot_max=256K,"
                            "ipc.ce_min=1M"}
TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
COUNTS = [1, 7, 1000, 16387, 65536 * 3 + 5, 1 << 20]   # 4 MiB: several kernels or copy engines


def _inputs(torch, comm, seed, count, dtype):
    dev = f"cuda:{comm.device}"
    return [torch.randn(count, generator=torch.Generator(device=dev).manual_seed(seed * 16 + q),
                        device=dev).to(dtype) for q in range(comm.size)]


def _reduce(torch, xs, op):
    stack = torch.stack([x.double() for x in xs])
    return {"sum": lambda: stack.sum(0), "avg": lambda: stack.mean(0),
            "min": lambda: stack.min(0).values, "max": lambda: stack.max(0).values}[op]()


def _close(got, want, tol, what, scale=None):
    """||got - want|| <= tol * ||scale|| (scale: want, or for sums the sum of the inputs'
    absolute values, which rounding scales with even where the sum cancels to nearly zero)."""
    scale = want if scale is None else scale
    err = float((got.double() - want).norm() / max(float(scale.norm()), 1e-30))
    assert not got.isnan().any() and err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _magnitude(torch, xs, op):
    return _reduce(torch, [x.abs() for x in xs], op) if op in ("sum", "avg") else None


def check_ipc_collectives(comm) -> int:
    import torch

    assert comm.backend.endswith("cuda:ipc"), comm.backend
    r, n, checked, seed = comm.rank, comm.size, 0, 0
    for name in ("float32", "float16", "bfloat16"):
        dtype = getattr(torch, name)
        for count in COUNTS:
            for op in ("sum", "avg", "min", "max"):
                tol = TOLERANCE[name] if op in ("sum", "avg") else 0.0
                seed += 1
                xs = _inputs(torch, comm, seed, count + 1, dtype)
                x = xs[r].clone()
                comm.all_reduce(x[1:], op=op)        # an unaligned view: element by element
                views = [v[1:] for v in xs]
                _close(x[1:], _reduce(torch, views, op), tol,
                       f"all_reduce {name} x {count} {op} (offset view)",
                       _magnitude(torch, views, op))
                x = xs[r][:count].clone()
                comm.all_reduce(x, op=op)
                views = [v[:count] for v in xs]
                _close(x, _reduce(torch, views, op), tol, f"all_reduce {name} x {count} {op}",
                       _magnitude(torch, views, op))
                # every rank holds the same bits
                digests = comm.all_gather_object(x.cpu().view(torch.uint8).numpy().tobytes())
                assert all(d == digests[0] for d in digests), f"all_reduce {name} differs"
                ins = _inputs(torch, comm, seed + 5000, count * n, dtype)
                pieces = [ins[r][q * count:(q + 1) * count].clone() for q in range(n)]
                out = torch.full((count,), float("nan"), device=x.device, dtype=dtype)
                comm.reduce_scatter(out, pieces, op=op)  # separate pieces
                mine = slice(r * count, (r + 1) * count)
                scale = _magnitude(torch, ins, op)
                _close(out, _reduce(torch, ins, op)[mine], tol,
                       f"reduce_scatter {name} x {count} {op}",
                       None if scale is None else scale[mine])
                checked += 3
            xs = _inputs(torch, comm, seed + 9000, count, dtype)
            outs = [torch.full((count,), float("nan"), device=x.device, dtype=dtype)
                    for _ in range(n)]
            comm.all_gather(outs, xs[r])
            for q in range(n):
                _close(outs[q], xs[q].double(), 0.0, f"all_gather {name} x {count} from {q}")
            whole = torch.full((n * count,), float("nan"), device=x.device, dtype=dtype)
            whole[r * count:(r + 1) * count] = xs[r]
            comm.all_gather(whole, whole[r * count:(r + 1) * count])   # in place
            for q in range(n):
                _close(whole[q * count:(q + 1) * count], xs[q].double(), 0.0,
                       f"all_gather in place {name} x {count} from {q}")
            if n == 2:                # reduce_scatter in place: out is this rank's own piece
                ins = _inputs(torch, comm, seed + 7000, count * n, dtype)
                own = slice(r * count, (r + 1) * count)
                want, scale = _reduce(torch, ins, "sum")[own], _magnitude(torch, ins, "sum")[own]
                comm.reduce_scatter(ins[r][own], ins[r])
                _close(ins[r][own], want, TOLERANCE[name],
                       f"reduce_scatter in place {name} x {count}", scale)
            for root in range(n):
                y = xs[r].clone() if r == root else torch.full_like(xs[r], float("nan"))
                comm.broadcast(y, root)
                _close(y, xs[root].double(), 0.0, f"broadcast {name} x {count} root {root}")
            checked += 1 + n
    return checked


@pytest.mark.parametrize("world", [*world_sizes(), pytest.param(3, marks=pytest.mark.skipif(
    gpu.device_count() < 3, reason="needs 3 GPUs"))])
@pytest.mark.parametrize("takers,tile_min", [(0, "64K"), (3, "64K"), (0, "1K")])
def test_ipc_collectives_match_a_float64_reference(world, takers, tile_min):
    # takers 0: every block pushes, then takes; 3: three blocks of each kernel take (copy out,
    # reduce) what arrives while the others push; tiles down to 1 KiB: small arrays in many
    # tiles (odd counts end mid-tile)
    env = {**IPC_ENV, "ANYCCL_TUNING": f"{IPC_ENV['ANYCCL_TUNING']},ipc.takers={takers},"
                                       f"ipc.tile_min={tile_min}"}
    checked = run_ranks(check_ipc_collectives, world, env=env, deadline_s=240)
    assert checked[0] > 200


def check_ipc_messages(comm) -> bool:
    import torch

    import anyccl

    r, dev = comm.rank, f"cuda:{comm.device}"
    peer = 1 - r
    for nbytes in (0, 1, 4, 1000, (1 << 20) + 5, 10 << 20):   # 10 MiB wraps a 4 MiB ring
        x = torch.arange(nbytes, device=dev, dtype=torch.int64).to(torch.uint8)
        y = torch.empty(nbytes, device=dev, dtype=torch.uint8)
        for turn in range(2):                                   # ping, then pong
            if r == turn:
                comm.send(x, peer, tag=nbytes)
            else:
                comm.recv(y, peer, tag=nbytes)
        assert torch.equal(y, x) if r == 1 else True
        comm.barrier()
    # a batched ring: each rank sends 24 MiB while receiving 24 MiB (6x the ring)
    big = torch.full((6 << 20,), float(r + 1), device=dev)
    got = torch.zeros_like(big)
    with comm.batch():
        comm.isend(big, peer, tag=7)
        work = comm.irecv(got, peer, tag=7)
    work.wait()
    assert torch.all(got == peer + 1)
    # other dtypes and ops go to NCCL: int32 sums, reduce, gather, all_to_all
    z = torch.full((1000,), r + 1, device=dev, dtype=torch.int32)
    comm.all_reduce(z)
    assert torch.all(z == 3)
    w = torch.full((10,), float(r), device=dev)
    comm.reduce(w, 0)
    parts = torch.arange(4.0, device=dev) + 10 * r
    mixed = torch.empty(4, device=dev)
    comm.all_to_all(mixed, parts)
    torch.cuda.synchronize()
    assert mixed.tolist() == [2.0 * r, 2.0 * r + 1, 10.0 + 2 * r, 11.0 + 2 * r]
    assert r != 0 or torch.all(w == 1)
    # a tag the receiver does not expect: the receive stops and the next call names both
    if r == 0:
        comm.send(torch.ones(16, device=dev), 1, tag=3)
        torch.cuda.synchronize()
        return True
    comm.recv(torch.zeros(16, device=dev), 0, tag=4)
    torch.cuda.synchronize()
    with pytest.raises(anyccl.AnycclError, match="carries tag 3 and 64 bytes.*expects tag 4"):
        comm.all_reduce(torch.ones(4, device=dev))
    return True


@two_gpus()
def test_ipc_messages_check_tags_and_batched_rings_do_not_deadlock():
    assert all(run_ranks(check_ipc_messages, 2, env=IPC_ENV, deadline_s=120))


@two_gpus()
@pytest.mark.parametrize("path", ["kernels", "copy engines"])
def test_an_ipc_operation_past_its_deadline_is_stopped_and_the_next_call_names_it(path):
    # check_timeout's 256 KiB all_reduce: a spinning two-shot kernel, or streams waiting on
    # copy-engine flags (released when the communicator is aborted)
    env = {**IPC_ENV, "ANYCCL_TIMEOUT": "3",
           "ANYCCL_TUNING": "ipc.ll_max=16K,ipc.one_shot_max=256K,ipc.ce_min="
                            + ("128K" if path == "copy engines" else "1M")}
    waited = run_ranks(check_timeout, 2, env=env, deadline_s=60)[0]
    assert waited < 6


@pytest.mark.parametrize("world", world_sizes()[1:])
def test_the_repeated_random_check_and_a_captured_cuda_graph_pass(world):
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in IPC_ENV.items() if k != "ANYCCL_BACKEND"}
    done = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(world),
                           str(root / "benchmarks" / "ipc_check.py"), "--iters", "150",
                           "--max-elems", "300000"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrong on each rank: {[0] * world}: OK" in done.stdout
