"""torch.distributed on the "anyccl" backend with CUDA tensors, as Lightning starts it
(`init_process_group(..., device_id=...)`): each collective on a non-default stream whose input
a kernel has just written, its result read by the next kernel on that stream, blocking and
async_op=True, uneven all_to_all_single and all_gather among them; every rank checks its values
against what the collective must give. A repeated all_reduce and broadcast of the same tensor
(DDP's buckets, replayed from plans) keep the stream order and values.

    python tests/scripts/torch_cuda_collectives.py WORLD_SIZE PORT
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import anyccl.torch  # noqa: F401 - registers "anyccl" where the entry point is not installed


def check(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    n = 1 << 20   # large enough that a missing wait shows as stale values
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for async_op in (False, True):
            x = torch.arange(n, device=device, dtype=torch.float32) + rank  # a kernel writes it
            work = dist.all_reduce(x, async_op=async_op)
            if async_op:
                work.wait()
            total = (x * 1).double().sum().item()  # kernels read it; exact in float64
            expected = world_size * (n * (n - 1) // 2) + n * sum(range(world_size))
            assert total == expected, (rank, async_op, total, expected)

        out = torch.empty(world_size * 4, device=device)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=device))
        assert out.tolist() == [float(r) for r in range(world_size) for _ in range(4)], out

        part = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(part, torch.arange(world_size * 4.0, device=device) + rank)
        base = torch.arange(rank * 4.0, rank * 4.0 + 4)
        assert part.cpu().tolist() == (world_size * base + sum(range(world_size))).tolist()

        b = torch.full((8,), float(rank), device=device)
        dist.broadcast(b, src=world_size - 1)
        assert b.tolist() == [float(world_size - 1)] * 8

        a = torch.empty(world_size * 2, device=device)
        dist.all_to_all_single(a, torch.arange(world_size * 2.0, device=device) + 100 * rank)
        assert a.tolist() == [100.0 * r + 2 * rank + k for r in range(world_size)
                              for k in range(2)], a

        # uneven: all_to_all_single with rows per pair of ranks, all_gather of a size per rank
        sends = [(rank + 2 * j) % 3 + 1 for j in range(world_size)]
        receives = [(j + 2 * rank) % 3 + 1 for j in range(world_size)]
        rows = torch.cat([torch.full((c, 2), 100.0 * rank + j, device=device)
                          for j, c in enumerate(sends)])
        got = torch.empty(sum(receives), 2, device=device)
        dist.all_to_all_single(got, rows * 1, receives, sends)   # its input just written
        want = torch.cat([torch.full((c, 2), 100.0 * j + rank) for j, c in enumerate(receives)])
        assert torch.equal((got * 1).cpu(), want), (rank, got)
        parts = [torch.empty(j + 1, device=device) for j in range(world_size)]
        dist.all_gather(parts, torch.arange(rank + 1.0, device=device))
        assert [p.tolist() for p in parts] == [[float(k) for k in range(j + 1)]
                                               for j in range(world_size)], parts
        repeated(rank, world_size, device)
    torch.cuda.synchronize(device)

    # from a thread that never touched CUDA (its first CUDA call is the collective), as torch's
    # NCCL group allows: the group makes the device's context current there itself
    y = torch.full((16,), float(rank + 1), device=device)
    torch.cuda.synchronize(device)
    failed: list[BaseException] = []

    def in_thread() -> None:
        try:
            dist.all_reduce(y)
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)
    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert not failed, failed
    assert y.tolist() == [float(sum(range(1, world_size + 1)))] * 16, y


def repeated(rank: int, world_size: int, device: torch.device) -> None:
    """The same bucket all-reduced and broadcast again and again (replayed from the
    communicator's plans after the first calls), a kernel writing it just before and reading it
    just after each call: every value right."""
    bucket = torch.empty(1 << 18, device=device)
    for k in range(12):
        bucket.fill_(float(rank + k))
        dist.all_reduce(bucket)
        got = (bucket * 1).sum().item()
        want = bucket.numel() * float(sum(range(world_size)) + world_size * k)
        assert got == want, (rank, k, got, want)
        bucket.fill_(float(rank * 10 + k))
        dist.broadcast(bucket, src=0)
        assert (bucket * 1).sum().item() == bucket.numel() * float(k), (rank, k)


def main(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("anyccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    check(rank, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(main, args=(world_size, port), nprocs=world_size)
