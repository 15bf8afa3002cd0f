"""Host time of one torch.distributed all_reduce on CUDA tensors: the NCCL process group against
anyccl's (over its nccl and ipc transports), one process per GPU, same tensors, rotating order.

For each group and size: the host time until `dist.all_reduce` returns (what DDP's autograd
hook pays per bucket), and the time per call once the GPU has finished a run of calls. Then, on
rank 0, where anyccl's group spends its host time: the group's wrapper with an empty operation
(stream switch, record_stream, the Work and its future), and a cProfile of the real calls.

    python benchmarks/lab/torch_pg_cost.py [--sizes 8,26214400] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import anyccl.torch  # noqa: F401 - registers "anyccl" where the entry point is not installed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_groups() -> dict[str, object]:
    """torch's NCCL group (the world) and anyccl's groups over its nccl and ipc transports."""
    groups = {"nccl": dist.group.WORLD}
    for transport in ("nccl", "ipc"):
        os.environ["ANYCCL_BACKEND"] = transport
        groups[f"anyccl-{transport}"] = dist.new_group(backend="anyccl")
    os.environ.pop("ANYCCL_BACKEND", None)
    return groups


def timed(fn, calls: int) -> tuple[float, float]:
    """(host us per call until return, us per call once the GPU finished)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def join(rank: int, size: int, port: int) -> dict[str, object]:
    """This rank's process in torch's NCCL world on GPU `rank`; the groups to compare."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    return torch_groups()


def rotating(calls: dict, rounds: int, n: int, warm: int) -> dict[str, list[tuple[float, float]]]:
    """`timed` of each named call, `rounds` times in a rotating order, after `warm` calls each
    (plans, NCCL channels, kernels)."""
    for call in calls.values():
        for _ in range(warm):
            call()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    names = list(calls)
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            results[name].append(timed(calls[name], n))
    return results


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace) -> None:
    groups = join(rank, size, port)
    rows = []
    for nbytes in args.sizes:
        t = torch.ones(max(1, nbytes // 4), device="cuda")
        results = rotating({name: (lambda g=group, x=t: dist.all_reduce(x, group=g))
                            for name, group in groups.items()}, args.rounds, args.calls, 20)
        for name, got in results.items():
            rows.append((nbytes, name, statistics.median(h for h, _ in got),
                         statistics.median(w for _, w in got)))
    if rank == 0:
        print(f"# torch {torch.__version__}, {size} rank(s), {torch.cuda.get_device_name()}; "
              f"median of {args.rounds} rotating rounds of {args.calls} calls")
        print("| bytes | group | host us per call (until return) | us per call (GPU done) |")
        print("|---:|---|---:|---:|")
        for nbytes, name, host, whole in rows:
            print(f"| {nbytes} | {name} | {host:.1f} | {whole:.1f} |")
    pg = groups["anyccl-nccl"]
    inner = pg if isinstance(pg, anyccl.torch.ProcessGroup) else None
    t = torch.ones(max(1, args.sizes[-1] // 4), device="cuda")
    if inner is not None:  # every rank: the breakdown runs collectives too
        host, _ = timed(lambda: inner._run(lambda: None, [t], [t]), args.calls)
        if rank == 0:
            print(f"\nanyccl group wrapper alone (stream switch, record_stream, Work): "
                  f"{host:.1f} us")
        _parts(inner, t, args.calls, rank)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        dist.all_reduce(t, group=pg)
    profile.disable()
    torch.cuda.synchronize()
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(f"\ncProfile of {args.calls} all_reduce calls on anyccl-nccl, rank 0:")
        print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _parts(inner: anyccl.torch.ProcessGroup, t: torch.Tensor, calls: int, rank: int) -> None:
    """Host us per call of each step of the group's wrapper and of the operation itself, run
    on every rank (two steps are collectives), printed by rank 0."""
    from torch._C._distributed_c10d import _create_work_from_future

    dev = t.device
    side = torch.cuda.Stream(dev)
    cur = torch.cuda.current_stream(dev)
    from anyccl.buffers import torch_stream

    def future_of(value: object) -> None:
        f = torch.futures.Future(devices=[dev])
        f.set_result(value)
        _create_work_from_future(f)

    def switch() -> None:
        with torch.cuda.stream(side):
            pass

    def op_on_side() -> None:
        with torch.cuda.stream(side):
            inner.comm.all_reduce(t)

    steps = {
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(dev),
        "torch._C._cuda_getCurrentStream(index)": lambda: torch._C._cuda_getCurrentStream(
            dev.index),
        "side.wait_stream(current)": lambda: side.wait_stream(cur),
        "with torch.cuda.stream(side): pass": switch,
        "t.record_stream(side)": lambda: t.record_stream(side),
        "CUDA Future + set_result([t]) + Work": lambda: future_of([t]),
        "CUDA Future + set_result(None) + Work": lambda: future_of(None),
        "CPU Future + set_result([t]) + Work": lambda: _create_work_from_future(
            _completed(torch.futures.Future(), [t])),
        "anyccl.gpu.torch_stream(device)": lambda: torch_stream(dev.index),
        "comm.all_reduce(t) (cached plan)": lambda: inner.comm.all_reduce(t),
        "comm.all_reduce(t) on the side stream": op_on_side,
    }
    if rank == 0:
        print("\n| step | host us per call |\n|---|---:|")
    for name, fn in steps.items():
        for _ in range(20):
            fn()
        took = timed(fn, calls)[0]
        if rank == 0:
            print(f"| {name} | {took:.1f} |", flush=True)


def _completed(future: torch.futures.Future, value: object) -> torch.futures.Future:
    future.set_result(value)
    return future


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,26214400",
                   type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    size = torch.cuda.device_count()
    mp.spawn(rank_main, args=(size, free_port(), args), nprocs=size)


if __name__ == "__main__":
    main()
