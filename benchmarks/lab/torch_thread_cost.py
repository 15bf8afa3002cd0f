"""Host time of one dist.all_reduce (4 MiB, CUDA) on torch's NCCL group and on anyccl's groups,
from the main thread, from a plain Python thread, and from a tensor hook inside backward (the
thread DDP's reducer calls from, between backward kernels); and what a CUDA Future plus its Work
cost alone on each. Also checks that anyccl's own API works from a thread new to CUDA. One GPU,
medians of 3 rounds. Then, inside the backward hook, where anyccl's group spends its time: the
stream switch before anyccl's call (`enter`), the call, the Work and future after it (`leave`),
and what is left (torch's dispatch to the Python group, the group's own Python).

    python benchmarks/lab/torch_thread_cost.py
"""
from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

import anyccl
import anyccl.torch  # noqa: F401 - registers "anyccl" where the entry point is not installed

CALLS = 300


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def future_and_work(x: torch.Tensor) -> None:
    """What every operation of a Python process group pays for its CUDA future and Work."""
    future = torch.futures.Future(devices=[x.device])
    future.set_result([x])
    _create_work_from_future(future)


def main_thread_us(op: Callable[[], None]) -> float:
    for _ in range(50):
        op()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        op()
    return (time.perf_counter() - start) / CALLS * 1e6


def new_thread_us(op: Callable[[], None]) -> float:
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(main_thread_us(op)))
    thread.start()
    thread.join()
    return result[0]


def backward_hook_us(op: Callable[[], None], layers: list[torch.Tensor]) -> float:
    """`op` timed in a hook on every layer's gradient during 20 backward passes."""
    times: list[float] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
        return grad
    for _ in range(20):
        h = torch.randn(64, 512, device="cuda")
        for w in layers:
            h = h @ w
            h.register_hook(hook)
        h.sum().backward()
    torch.cuda.synchronize()
    return statistics.median(times[len(layers) * 8:]) * 1e6


class _Parts:
    """While active: the host time of each step of anyccl's group per CUDA operation (the
    compiled part's enter, anyccl's call, leave), by wrapping GroupStreams.run."""

    STEPS = ("enter", "anyccl call", "leave")

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {s: [] for s in self.STEPS}

    def __enter__(self) -> _Parts:
        from anyccl import gpu
        from anyccl.torch_streams import GroupStreams
        self._saved = GroupStreams.run
        spent, clock = self.spent, time.perf_counter

        def run(streams, index, call, used, result):  # GroupStreams.run's compiled branch
            side = streams._sides.get(index) or streams._sides.setdefault(
                index, streams._side(index))
            t0 = clock()
            previous = side.enter()
            t1 = clock()
            gpu.ensure_context(index)
            call()
            t2 = clock()
            work = side.leave(previous, used, result)
            t3 = clock()
            for name, dt in zip(self.STEPS, (t1 - t0, t2 - t1, t3 - t2)):
                spent[name].append(dt)
            return work
        GroupStreams.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        from anyccl.torch_streams import GroupStreams
        GroupStreams.run = self._saved

    def medians_us(self, skip: int) -> dict[str, float]:
        return {name: statistics.median(times[skip:]) * 1e6 for name, times in self.spent.items()}


def own_api_from_new_thread(backend: str) -> str:
    os.environ["MASTER_PORT"] = free_port()
    comm = anyccl.init(backend, rank=0, world_size=1)
    z = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    failed: list[str] = []

    def calls() -> None:
        try:
            comm.all_reduce(z)
        except Exception as exc:  # reported below
            failed.append(repr(exc))
    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    comm.close()
    return failed[0] if failed else "works"


def main() -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", free_port()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    groups = {"torch nccl": dist.group.WORLD}
    for transport in ("nccl", "ipc"):
        os.environ["ANYCCL_BACKEND"] = transport
        groups[f"anyccl-{transport}"] = dist.new_group(backend="anyccl")
    os.environ.pop("ANYCCL_BACKEND")
    x = torch.ones(1 << 20, device="cuda")
    layers = [torch.randn(512, 512, device="cuda", requires_grad=True) for _ in range(24)]
    ops: dict[str, Callable[[], None]] = {
        name: (lambda g=g: dist.all_reduce(x, group=g)) for name, g in groups.items()}
    ops["CUDA future + Work alone"] = lambda: future_and_work(x)
    rows: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):
        for name, op in ops.items():
            rows.setdefault((name, "main"), []).append(main_thread_us(op))
            rows.setdefault((name, "thread"), []).append(new_thread_us(op))
            rows.setdefault((name, "hook"), []).append(backward_hook_us(op, layers))
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}; host us per call, "
          f"median of 3 rounds of {CALLS} (hook: of 20 backward passes x 24 layers)")
    print("| call | main thread | new thread | backward hook |")
    print("|---|---:|---:|---:|")
    for name in ops:
        cells = " | ".join(f"{statistics.median(rows[(name, where)]):.1f}"
                           for where in ("main", "thread", "hook"))
        print(f"| {name} | {cells} |")
    from anyccl import torch_core
    if torch_core.load() is not None:
        print("\nInside the backward hook, anyccl's group per operation (median us):")
        print("| group | whole call | enter | anyccl call | leave | the rest |")
        print("|---|---:|---:|---:|---:|---:|")
        stats = getattr(torch_core.load(), "allreduce_stats", None)
        for name in [n for n in groups if n.startswith("anyccl")]:
            with _Parts() as parts:
                whole = backward_hook_us(ops[name], layers)
            if len(parts.spent["enter"]) <= len(layers) * 8:   # none in the group's Python
                print(f"| {name} | {whole:.1f} | (every call replayed in the compiled all_reduce,"
                      f" without the group's Python) | | | |")
                continue
            p = parts.medians_us(len(layers) * 8)
            print(f"| {name} | {whole:.1f} | " + " | ".join(f"{v:.1f}" for v in p.values())
                  + f" | {whole - sum(p.values()):.1f} |")
        if stats is not None:
            for name in [n for n in groups if n.startswith("anyccl")]:
                got = stats(groups[name])
                calls, replayed = got["calls"], got["replayed"]
                parts = ", ".join(f"{part} {t / max(replayed, 1) * 1e6:.1f} us"
                                  for part, t in got["parts"].items())
                print(f"{name}: {calls} all_reduces through the compiled all_reduce, {replayed} "
                      f"replayed whole in C++, {got['seconds'] / max(calls, 1) * 1e6:.1f} us "
                      f"each (a replayed one: {parts})")
        print(f"python threads: {[t.name for t in threading.enumerate()]}")
    for backend in ("nccl", "ipc"):
        print(f"anyccl's own all_reduce from a thread new to CUDA, {backend}: "
              f"{own_api_from_new_thread(backend)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
