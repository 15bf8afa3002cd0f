"""The copy-engine ring (backends/ipc/ce.py) on a real GPU, every rank on the same one: each
rank's ipc backend, with its ring area and flags in device memory of GPU 0, queues its
all_reduce, reduce_scatter and all_gather on streams of its own, and the GPU runs them all at
once -- the real copies, events, flag kernels (ce_flags, ce_wait) and local kernels (ce_step,
ce_copy) at 2, 3 and 4 ranks, odd sizes and unaligned pieces, float32 and bfloat16, in place
and apart, against float64 references. The links between GPUs are what this leaves out (the
multi-GPU tests, test_gpu_ipc.py, cover them). Needs one CUDA GPU, NVRTC and torch; skipped
without.

The ranks run in a child process with CUDA_DEVICE_MAX_CONNECTIONS=32: one process queues
every rank's streams, and with fewer hardware queues than streams one rank's waiting kernel
could sit in front of the push another rank queued later on the same queue (across
processes, every rank's own order keeps that from blocking). So each rank count's streams
are released before the next count's are made: 4 ranks use 16 streams (their own, two
pushing, one copying the own piece of an all_gather), the 9 of all three counts would use
36."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from anyccl import gpu
from anyccl.backends.ipc.memory import STATUS_WORDS, Layout, PeerAddresses

pytestmark = pytest.mark.gpu

ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "ANYCCL_IPC_HALF_MB": "2", "ANYCCL_IPC_CE_MB": "1",
       "ANYCCL_IPC_RING_MB": "4", "ANYCCL_TUNING": "ipc.ce_min=1M"}


@pytest.mark.skipif(gpu.device_count() < 1, reason="needs a CUDA GPU")
def test_the_ring_on_one_gpu_matches_float64_references_at_2_3_and_4_ranks():
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, __file__], env={**os.environ, **ENV},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "checked" in done.stdout, done.stdout


class _Memory(PeerAddresses):
    """What the backend reads of its peer memory, over allocations on GPU 0, with a status
    block of its own."""

    def __init__(self, layout: Layout, rank: int, size: int, datas: list[int],
                 sigs: list[int]) -> None:
        super().__init__(layout, rank, size, datas, sigs)
        self.status_host, self.status_device = gpu.host_alloc_mapped(8 * STATUS_WORDS)
        ctypes.memset(self.status_host, 0, 8 * STATUS_WORDS)
        self.status = (ctypes.c_uint64 * STATUS_WORDS).from_address(self.status_host)

    def aborted(self) -> None:
        pass

    def close(self) -> None:
        gpu.host_free(self.status_host)


def _ranks(n: int):
    """(n ipc backends on GPU 0, each with its own ring area and flags; a stream for each)."""
    from anyccl.backends.ipc import backend as ipc

    layout = Layout(n)
    datas = [gpu.mem_alloc(layout.data_bytes) for _ in range(n)]
    sigs = [gpu.mem_alloc(layout.sig_bytes) for _ in range(n)]
    for sig in sigs:
        gpu.memset(sig, 0, layout.sig_bytes)
    ranks = []
    for r in range(n):
        nccl = SimpleNamespace(rank=r, size=n, device=0, close=lambda: None,
                               queue=SimpleNamespace(watch=lambda **kinds: None))
        ranks.append(ipc.IpcBackend(nccl, _Memory(layout, r, n, datas, sigs), "ipc"))
    return ranks, [gpu.new_stream(0) for _ in range(n)]


def _arr(t, np_dtype):
    from anyccl.buffers import GpuArray

    return GpuArray(t.data_ptr(), t.numel(), np_dtype, 0, None, "torch", t)


def _run(torch, ranks, op: str, args: list[tuple]) -> None:
    """Queue `op` with args[r] on every rank r's backend and stream, then wait for the GPU."""
    torch.cuda.synchronize()                    # the inputs, made on torch's stream
    for b, stream, rank_args in zip(*ranks, args):
        queued = getattr(b, op)(*rank_args)
        assert not isinstance(queued, gpu.KernelLaunch), "not the ring: an SM kernel"
        queued(stream)
    torch.cuda.synchronize()


def _check(got, want, tol, what) -> None:
    err = float((got.double() - want).norm() / max(float(want.norm()), 1e-30))
    assert err <= tol, f"{what}: relative error {err:.3g}"


def main() -> None:
    import numpy as np
    import torch

    from anyccl import ReduceOp
    from anyccl.buffers import BFLOAT16

    gpu.set_device(0)
    torch.cuda.init()
    checked = 0
    kinds = {"float32": (torch.float32, np.dtype(np.float32), 1e-6),
             "bfloat16": (torch.bfloat16, BFLOAT16, 1.6e-2)}
    for n in (2, 3, 4):
        ranks = _ranks(n)
        g = torch.Generator(device="cuda:0").manual_seed(n)
        for name, (dtype, np_dtype, tol) in kinds.items():
            # all_reduce: 1 MiB and more (the ring), odd counts: segments end mid-chunk
            for count in ((1 << 20) // dtype.itemsize + 3, 1_000_003):
                xs = [torch.randn(count + 1, generator=g, device="cuda:0").to(dtype)
                      for _ in range(n)]
                want = torch.stack([x.double() for x in xs]).sum(0)
                for offset in (0, 1):                   # 1: an unaligned view
                    ys = [x.clone() for x in xs]
                    _run(torch, ranks, "all_reduce", [
                        (_arr(y[offset:offset + count], np_dtype), ReduceOp.SUM) for y in ys])
                    for r, y in enumerate(ys):
                        _check(y[offset:offset + count], want[offset:offset + count], tol,
                               f"all_reduce {name} n={n} count={count} offset={offset} rank {r}")
                    checked += 1
            # reduce_scatter: pieces over ce_min / n, odd; separate pieces; SUM, AVG, MAX
            piece = 300_007
            ins = [[torch.randn(piece, generator=g, device="cuda:0").to(dtype)
                    for _ in range(n)] for _ in range(n)]
            for op, fold in ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"),
                             (ReduceOp.MAX, "amax")):
                outs = [torch.full((piece,), float("nan"), device="cuda:0", dtype=dtype)
                        for _ in range(n)]
                _run(torch, ranks, "reduce_scatter", [
                    (_arr(outs[r], np_dtype), [_arr(p, np_dtype) for p in ins[r]], op)
                    for r in range(n)])
                for r in range(n):
                    stack = torch.stack([ins[q][r].double() for q in range(n)])
                    want = getattr(stack, fold)(0)
                    _check(outs[r], want, tol if fold != "amax" else 0.0,
                           f"reduce_scatter {name} {op} n={n} rank {r}")
                checked += 1
            if n == 2:                                  # in place: out is the own input piece
                wholes = [torch.cat(ins[r]).clone() for r in range(n)]
                want = [sum(ins[q][r].double() for q in range(n)) for r in range(n)]
                _run(torch, ranks, "reduce_scatter", [
                    (_arr(wholes[r][r * piece:(r + 1) * piece], np_dtype),
                     [_arr(wholes[r][q * piece:(q + 1) * piece], np_dtype) for q in range(n)],
                     ReduceOp.SUM) for r in range(n)])
                for r in range(n):
                    _check(wholes[r][r * piece:(r + 1) * piece], want[r], tol,
                           f"reduce_scatter in place {name} rank {r}")
                checked += 1
        # all_gather: bytes, an odd count; apart, and in place (the input is the own piece)
        nbytes = 4 * 300_007 + 3
        xs = [torch.randint(0, 256, (nbytes,), generator=g, device="cuda:0",
                            dtype=torch.uint8) for _ in range(n)]
        u8 = np.dtype(np.uint8)
        gathered = [[torch.zeros(nbytes, device="cuda:0", dtype=torch.uint8) for _ in range(n)]
                    for _ in range(n)]
        _run(torch, ranks, "all_gather",
             [([_arr(o, u8) for o in gathered[r]], _arr(xs[r], u8)) for r in range(n)])
        wholes = [torch.zeros(n * nbytes, device="cuda:0", dtype=torch.uint8) for _ in range(n)]
        for r in range(n):
            wholes[r][r * nbytes:(r + 1) * nbytes] = xs[r]
        _run(torch, ranks, "all_gather", [
            ([_arr(wholes[r][q * nbytes:(q + 1) * nbytes], u8) for q in range(n)],
             _arr(wholes[r][r * nbytes:(r + 1) * nbytes], u8)) for r in range(n)])
        for r in range(n):
            for q in range(n):
                assert torch.equal(gathered[r][q], xs[q]), f"all_gather n={n}: {r} from {q}"
                assert torch.equal(wholes[r][q * nbytes:(q + 1) * nbytes], xs[q]), \
                    f"all_gather in place n={n}: {r} from {q}"
        checked += 2
        for b, stream in zip(*ranks):                   # every flag cleared again
            flags = torch.ones(b.layout.ce_flag_words, dtype=torch.int64, device="cuda:0")
            torch.cuda.synchronize()
            gpu.copy_async(flags.data_ptr(), b.memory.sigs[b.rank] + b.layout.ce_sig_offset,
                           8 * b.layout.ce_flag_words, stream)
            torch.cuda.synchronize()
            assert not flags.any(), f"n={n}: rank {b.rank} left flags raised"
        for b, stream in zip(*ranks):   # their streams released before the next n's are made
            b.close()
            gpu.destroy_stream(stream)
    print(f"checked {checked} ring collectives on one GPU")


if __name__ == "__main__":
    main()
