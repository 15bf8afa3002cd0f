"""Host time of eager GPU calls on one GPU, anyccl beside its peers, in one process: each of the
CUDA driver calls a queued operation makes, through anyccl's compiled driver calls
(`anyccl/_cudacore.c`) and through cuda-bindings (switched per round); `comm.all_reduce` of 8 bytes
on the ipc and nccl backends (blocking, and async_op=True then wait()) and `dist.all_reduce` on
anyccl's torch group, both ways; torch's
NCCL group and symmetric-memory all_reduces; then an eager loop of 20000 calls with the caller
retiring finished operations every 64 calls (gpu_queue.py) against the watchdog alone, with and
without the garbage collector. Host time only: batches of 400 calls with the GPU drained between
them (fewer than the launch queue holds), medians of 5 alternating rounds. A one-kernel operation
(what a cached plan replays) is also timed with one compiled driver call per step instead of one
call for all (`gpu.queue_in_steps`). Last, the GPU's own time per call: calls captured
into a CUDA graph and replayed.

    python3 benchmarks/lab/eager_host_cost.py
"""

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import anyccl
import anyccl.torch  # noqa: F401 - registers "anyccl" where the entry point is not installed
from anyccl import gpu
from anyccl.backends import gpu_queue
from anyccl.buffers import torch_stream

ROUNDS = 5


def per_call(fn, n: int = 400, batches: int = 10) -> float:
    """Host us per call until it returns: batches of `n` calls, the GPU drained in between."""
    for _ in range(100):
        fn()
    total = 0.0
    for _ in range(batches):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return total / (n * batches) * 1e6


def loop(comm, x, n: int = 20000) -> float:
    """Host us per call of one long eager loop (longer than the watchdog's 50 ms poll)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        comm.all_reduce(x)
    took = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return took


def graph_time(fn, n: int = 100, replays: int = 20) -> float:
    """GPU us per call: `n` calls captured into one CUDA graph, replayed back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (n * replays)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    core = gpu._core
    rows: dict[tuple[str, bool | str | None], list[float]] = {}

    one_call = gpu.ONE_CALL[gpu.KernelLaunch]

    def both_ways(name: str, fn, steps: bool = False) -> None:
        """Rounds of `fn` with the compiled calls and with the bindings (and, with `steps`, a
        compiled call per step of a one-kernel operation instead of one call)."""
        ways = (True, "steps", False) if steps else (True, False)
        for _ in range(ROUNDS):
            for way in ways:
                gpu._core = core if way else None
                gpu.ONE_CALL[gpu.KernelLaunch] = gpu.queue_in_steps if way == "steps" \
                    else one_call
                rows.setdefault((name, way), []).append(per_call(fn))
        gpu._core, gpu.ONE_CALL[gpu.KernelLaunch] = core, one_call

    stream, event, side = torch_stream(0), gpu.new_event(0), gpu.new_stream(0)
    both_ways("gpu.record", lambda: gpu.record(event, stream))
    both_ways("gpu.stream_wait", lambda: gpu.stream_wait(side, event))
    both_ways("gpu.is_capturing", lambda: gpu.is_capturing(stream))
    both_ways("gpu.event_done", lambda: gpu.event_done(event))
    os.environ.pop("MASTER_ADDR")
    os.environ.pop("MASTER_PORT")
    comms, groups = {}, {}
    for backend in ("ipc", "nccl"):
        os.environ["ANYCCL_BACKEND"] = f"cpu:shm,cuda:{backend}"
        comms[backend] = anyccl.init()
        os.environ["ANYCCL_BACKEND"] = backend
        groups[backend] = dist.new_group(backend="anyccl")
    os.environ.pop("ANYCCL_BACKEND")
    tiny = torch.ones(2, device="cuda")
    for backend, comm in comms.items():
        both_ways(f"comm.all_reduce 8 B ({backend})", lambda c=comm: c.all_reduce(tiny),
                  steps=True)
        both_ways(f"comm.all_reduce 8 B, async_op=True + wait() ({backend})",
                  lambda c=comm: c.all_reduce(tiny, async_op=True).wait())
    for backend, group in groups.items():
        both_ways(f"dist.all_reduce 8 B, anyccl group ({backend})",
                  lambda g=group: dist.all_reduce(tiny, group=g), steps=True)
    peers = {"dist.all_reduce 8 B, torch NCCL": lambda: dist.all_reduce(tiny),
             "dist.all_reduce 8 B, async_op=True + wait(), torch NCCL":
                 lambda: dist.all_reduce(tiny, async_op=True).wait()}
    try:
        import torch.distributed._symmetric_memory as symm

        buf = symm.empty(2, device="cuda").fill_(1)
        world = dist.group.WORLD.group_name
        symm.rendezvous(buf, world)
        peers["symm_mem two_shot_all_reduce_ 8 B"] = \
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", world)
        peers["symm_mem one_shot_all_reduce 8 B"] = \
            lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", world)
    except Exception as exc:  # noqa: BLE001 - a peer this torch lacks is left out, said why
        print(f"torch symmetric memory left out: {exc!r}"[:300])
    peers["a tiny torch op, x.add_(0)"] = lambda: tiny.add_(0)
    for name, fn in peers.items():
        rows[(name, None)] = [per_call(fn) for _ in range(ROUNDS)]
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, 1 rank; host us per "
          f"call, batches of 400 with the GPU drained in between, median of {ROUNDS} rounds")
    print("| call | compiled driver calls | compiled, a call per step | cuda-bindings | peer |\n"
          "|---|---:|---:|---:|---:|")

    def cell(values: list[float] | None) -> str:
        return f"{statistics.median(values):.2f}" if values else ""
    for name in dict.fromkeys(k[0] for k in rows):
        print(f"| {name} | {cell(rows.get((name, True)))} | {cell(rows.get((name, 'steps')))} | "
              f"{cell(rows.get((name, False)))} | {cell(rows.get((name, None)))} |")

    print("\n# GPU us per call: 100 calls captured into a CUDA graph, replayed 20 times, median "
          f"of {ROUNDS}")
    print("| call | GPU us per call |\n|---|---:|")
    captured = {f"comm.all_reduce 8 B ({b})": (lambda c=c: c.all_reduce(tiny))
                for b, c in comms.items()}
    captured.update({name: fn for name, fn in peers.items() if "one_shot" not in name})
    for name, fn in captured.items():
        try:
            print(f"| {name} | {statistics.median(graph_time(fn) for _ in range(ROUNDS)):.2f} |")
        except Exception as exc:  # noqa: BLE001 - what cannot be captured is said, not timed
            print(f"| {name} | not captured: {type(exc).__name__}: {str(exc)[:120]} |")
            torch.cuda.synchronize()

    variants = {"caller retires every 64": (64, True), "watchdog alone": (1 << 40, True),
                "watchdog alone, gc off": (1 << 40, False)}
    loops: dict[tuple[str, str], list[float]] = {}
    for backend, comm in comms.items():
        for _ in range(ROUNDS):
            for name, (every, collect) in variants.items():
                gpu_queue._RETIRE_EVERY = every
                (gc.enable if collect else gc.disable)()
                loops.setdefault((backend, name), []).append(loop(comm, tiny))
                gc.enable()
    gpu_queue._RETIRE_EVERY = 64
    print(f"\n# host us per comm.all_reduce(8 B), loops of 20000 eager calls, median of {ROUNDS}")
    print("| backend | " + " | ".join(variants) + " |\n|---|" + "---:|" * len(variants))
    for backend in comms:
        print(f"| {backend} | " + " | ".join(cell(loops[(backend, n)]) for n in variants) + " |")
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
