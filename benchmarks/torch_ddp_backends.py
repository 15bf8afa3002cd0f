"""Data-parallel training step time on the "anyccl" process-group backend against torch's own
(gloo on CPU, NCCL on CUDA): torch DDP, FSDP2 (`fully_shard`) and anyccl's GradientAverager,
the same model and data for each, in the same processes, in rotating order (medians of rounds).
Also checks what each trained to against torch DDP on torch's backend.

    python benchmarks/torch_ddp_backends.py [--device cpu|cuda] [--ranks 2] [--width 1024]
        [--layers 4] [--batch 32] [--dtype float32|bfloat16] [--steps 30] [--rounds 3]
        [--variants ddp:gloo,ddp:anyccl] [--profile DIR]

A variant is `<how>:<group>`: how is ddp, fsdp2 or averager (anyccl's GradientAverager, on the
group's communicator); group is torch's backend (gloo, nccl: the default group) or `anyccl`,
`anyccl-<transport>` (an anyccl group whose transport ANYCCL_BACKEND names: auto, ipc, nccl,
shm, mpi). The issue's GPU setting: --device cuda --width 4096 --layers 12 --batch 64.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import anyccl.torch  # noqa: F401 - registers "anyccl" where the entry point is not installed

DEFAULT_VARIANTS = {
    "cpu": "ddp:gloo,ddp:anyccl",
    "cuda": "ddp:nccl,ddp:anyccl-auto,ddp:anyccl-ipc,ddp:anyccl-nccl,fsdp2:nccl,"
            "fsdp2:anyccl-auto,averager:anyccl-auto,averager:anyccl-ipc",
}
WARMUP = 3   # steps per variant and round left out of the times (buckets, plans, first calls)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nothing() -> None:
    pass


def model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                for _ in range(args.layers)])
    return net.to(device=device, dtype=getattr(torch, args.dtype))


class Trainer:
    """One variant's model, optimizer and step: DDP, FSDP2 or the GradientAverager on a group."""

    def __init__(self, variant: str, group: Any, args: argparse.Namespace,
                 device: torch.device) -> None:
        how = variant.split(":")[0]
        self.group = group
        net = model(args, device)
        self.averager = None
        if how == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(net, process_group=group, bucket_cap_mb=25,
                      device_ids=[device.index] if device.type == "cuda" else None)
        elif how == "fsdp2":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(group, device.type)
            for layer in net:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        elif how == "averager":
            from anyccl.ddp import GradientAverager

            self.averager = GradientAverager.for_module(group.comm, net, bucket_mb=25)
        else:
            raise SystemExit(f"--variants: {variant!r}: expected ddp:, fsdp2: or averager:")
        self.net = net
        self.opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.net(x).float().square().mean().backward()
        if self.averager is not None:
            self.averager.wait()
        self.opt.step()

    def weights(self) -> list[torch.Tensor]:
        out = []
        for p in self.net.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's DTensors
            out.append(full.detach().float().cpu())
        return out


def groups_for(variants: list[str], default: str) -> dict[str, Any]:
    """Every group the variants name, created in the same order on every rank."""
    groups: dict[str, Any] = {default: dist.group.WORLD}
    for name in dict.fromkeys(v.split(":", 1)[1] for v in variants):
        if name in groups:
            continue
        if not name.startswith("anyccl"):
            raise SystemExit(f"--variants: group {name!r}: expected {default} or "
                             f"anyccl[-transport]")
        transport = name.partition("-")[2]
        if transport:
            os.environ["ANYCCL_BACKEND"] = transport
        groups[name] = dist.new_group(backend="anyccl")
        os.environ.pop("ANYCCL_BACKEND", None)
    return groups


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        peer = "nccl"
        dist.init_process_group(peer, rank=rank, world_size=args.ranks, device_id=device)
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
        device, peer = torch.device("cpu"), "gloo"
        dist.init_process_group(peer, rank=rank, world_size=args.ranks)
        sync = _nothing
    variants = args.variants.split(",")
    groups = groups_for(variants, peer)
    trainers = {v: Trainer(v, groups[v.split(":", 1)[1]], args, device) for v in variants}
    data = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=data, device=device,
                    dtype=getattr(torch, args.dtype))
    times: dict[str, list[float]] = {v: [] for v in variants}
    host: dict[str, list[float]] = {v: [] for v in variants}  # in anyccl's group, per step
    for k in range(args.rounds):
        for v in variants[k % len(variants):] + variants[:k % len(variants)]:
            trainer, steps = trainers[v], []
            spent = _HostTime(trainer.group)
            dist.barrier()
            for step in range(WARMUP + args.steps):
                start = time.perf_counter()
                with spent if step >= WARMUP else contextlib.nullcontext():
                    trainer.step(x)
                    sync()
                if step >= WARMUP:
                    steps.append(time.perf_counter() - start)
            host[v].append(spent.seconds / args.steps)
            if k == args.rounds - 1 and rank == 0 and spent.calls:
                print(f"{v}: {spent.report(args.steps).strip()}", flush=True)
            median = torch.tensor([statistics.median(steps)], device=device)  # NCCL: on GPU
            dist.all_reduce(median, op=dist.ReduceOp.MAX, group=groups[peer])  # the slowest
            times[v].append(float(median))
    profiles = profile(trainers, x, sync, args.profile, rank) if args.profile else {}
    weights = {v: t.weights() for v, t in trainers.items()}
    if rank == 0:
        torch.save({"times": times, "host": host, "weights": weights, "profiles": profiles},
                   out)
    dist.barrier()
    dist.destroy_process_group()
    # torch's CPU build sometimes aborts in its exit-time destructors after DDP ("terminate called
    # without an active exception", about 1 exit in 10 with gloo alone, no anyccl loaded): the
    # work is done and saved, so leave without them.
    os._exit(0)


class _HostTime:
    """Inside the block: the host time spent in anyccl's torch process group (its operations,
    on whichever thread issues them: autograd's, under DDP), how many it ran, and how much of
    it went to anyccl's own calls (the rest: the group's streams, torch Work and future). Where
    the group's all_reduce is compiled (torch.py's _CompiledAllreduceGroup), torch's dispatcher
    calls it without the group's Python: its own counts (calls, those replayed whole in C++,
    seconds, and the replayed ones' time by part) stand for every all_reduce, and the Python
    path's timers for the rest."""

    def __init__(self, group: Any = None) -> None:
        self.parts = {"anyccl call": 0.0}
        self.py_calls, self.py_seconds = 0, 0.0
        # the compiled all_reduce's counts (allreduce_stats) over every run of the block
        self.compiled: dict[str, Any] = {"calls": 0, "replayed": 0, "seconds": 0.0, "parts": {}}
        self._group, self._inside = group, threading.local()
        self._stats = None

    @property
    def calls(self) -> int:
        return self.py_calls + self.compiled["calls"]

    @property
    def seconds(self) -> float:
        return self.py_seconds + self.compiled["seconds"]

    def _compiled_stats(self) -> dict[str, Any] | None:
        from anyccl import torch_core

        core = torch_core.built()
        fn = getattr(core, "allreduce_stats", None)
        if fn is None or self._group is None or not isinstance(self._group, dist.ProcessGroup):
            return None
        return fn(self._group)

    def _timing(self, fn: Any, into: str | None) -> Any:
        inside = self._inside

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "compiled", False):   # counted by the compiled all_reduce
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if into is None:
                    self.py_seconds += time.perf_counter() - t0
                    self.py_calls += 1
                else:
                    self.parts[into] += time.perf_counter() - t0
        return timed

    def _marking(self, fn: Any) -> Any:
        inside = self._inside

        def marked(*args: Any, **kwargs: Any) -> Any:
            inside.compiled = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside.compiled = False
        return marked

    def __enter__(self) -> _HostTime:
        import anyccl.torch as pg
        from anyccl.communicator import Communicator

        self._saved = [(pg.ProcessGroup, "_run", pg.ProcessGroup._run),
                       (pg.ProcessGroup, "_python_allreduce", pg.ProcessGroup._python_allreduce)
                       ] + [(Communicator, name, getattr(Communicator, name))
                            for name in ("all_reduce", "all_gather", "reduce_scatter",
                                         "broadcast")]
        pg.ProcessGroup._run = self._timing(pg.ProcessGroup._run, None)
        self._stats = self._compiled_stats()
        if self._stats is not None:
            pg.ProcessGroup._python_allreduce = self._marking(pg.ProcessGroup._python_allreduce)
        for owner, name, fn in self._saved[2:]:
            setattr(owner, name, self._timing(fn, "anyccl call"))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        after = self._compiled_stats()
        if self._stats is not None and after is not None:   # (the block may run many times)
            total, before = self.compiled, self._stats
            for key in ("calls", "replayed", "seconds"):
                total[key] += after[key] - before[key]
            for name, t in after["parts"].items():
                total["parts"][name] = total["parts"].get(name, 0.0) + t - before["parts"][name]

    def report(self, steps: int) -> str:
        if not self.calls:
            return ""
        line = (f"\nanyccl process group: {self.calls / steps:.0f} operations per step, "
                f"{self.seconds / self.calls * 1e6:.1f} us of host time each")
        compiled, replayed = self.compiled["calls"], self.compiled["replayed"]
        if compiled:
            line += (f" ({compiled / steps:.0f} per step through its compiled all_reduce, "
                     f"{replayed / steps:.0f} of them replayed whole in C++")
            if replayed:
                line += ": " + ", ".join(f"{name} {t / replayed * 1e6:.1f} us" for name, t
                                         in self.compiled["parts"].items())
            line += ")"
        if self.py_calls:
            parts = ", ".join(f"{name} {t / self.py_calls * 1e6:.1f} us" for name, t in
                              self.parts.items())
            rest = (self.py_seconds - sum(self.parts.values())) / self.py_calls * 1e6
            line += (f"; in its Python code {self.py_calls / steps:.0f} per step, "
                     f"{self.py_seconds / self.py_calls * 1e6:.1f} us each ({parts}, streams, "
                     f"torch Work and future {rest:.1f} us)")
        return f"{line}, {self.seconds / steps * 1e3:.2f} ms per step\n"


def _torch_group_host_time(prof: Any, steps: int) -> str:
    """A group's host time per operation in a profiled run, as torch's dispatcher records it:
    its c10d operations' CPU time, children included (the dispatch and the backend's call).
    torch's own groups have such records for every operation; anyccl's group for its all_reduce
    where that is compiled (torch's dispatcher calls it), and none otherwise. Under the
    profiler, as _HostTime's figure beside it in the same table."""
    ops = [e for e in prof.key_averages() if e.key.startswith("c10d::") and e.count]
    calls = sum(e.count for e in ops)
    if not calls:
        return ""
    spent = sum(e.cpu_time_total for e in ops)   # microseconds
    names = ", ".join(sorted(e.key for e in ops))
    return (f"\nthe group's c10d operations ({names}): {calls / steps:.0f} per step, "
            f"{spent / calls:.1f} us of host time each, under the profiler\n")


def profile(trainers: dict[str, Trainer], x: torch.Tensor, sync: Any, directory: str,
            rank: int) -> dict[str, str]:
    """Three more steps of each variant on every rank, rank 0's under torch.profiler: its
    tables (by variant, also written under `directory`, each beside its timeline as a Chrome
    trace)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    tables = {}
    for v, trainer in trainers.items():
        dist.barrier()
        spent = _HostTime(trainer.group)
        with torch_profile(activities=activities) if rank == 0 else \
                contextlib.nullcontext() as prof, spent:
            for _ in range(3):
                trainer.step(x)
            sync()
        if prof is not None:
            tables[v] = (prof.key_averages().table(sort_by=key, row_limit=15) + spent.report(3)
                         + _torch_group_host_time(prof, 3))
            os.makedirs(directory, exist_ok=True)
            stem = os.path.join(directory, v.replace(":", "-"))
            with open(stem + ".txt", "w") as f:
                f.write(tables[v])
            prof.export_chrome_trace(stem + ".json")   # the timeline: streams, overlap
    return tables


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write rank 0's torch.profiler table of 3 steps of each variant")
    args = p.parse_args()
    args.variants = args.variants or DEFAULT_VARIANTS[args.device]
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(rank_main, args=(args, _free_port(), out), nprocs=args.ranks)
        got = torch.load(out)
    import anyccl

    params = args.layers * (args.width * args.width + args.width)
    itemsize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    versions = f"torch {torch.__version__}, anyccl {anyccl.__version__}, Python " \
               f"{sys.version.split()[0]}, {os.cpu_count()} CPUs"
    if args.device == "cuda":
        versions += f", {torch.cuda.get_device_name(0)}, NCCL " \
                    f"{'.'.join(map(str, torch.cuda.nccl.version()))}"
    print(f"# {versions}; {args.ranks} ranks on {args.device}, {args.layers} x Linear("
          f"{args.width}, {args.width}) = {params / 1e6:.1f} M {args.dtype} parameters ("
          f"{params * itemsize / 2**20:.0f} MiB of gradients per step), batch {args.batch}, "
          f"{args.steps} timed steps (+{WARMUP}) x {args.rounds} rotating rounds, SGD")
    base = variants[0]
    base_ms = statistics.median(got["times"][base]) * 1e3
    print(f"| variant | step time (ms, median of rounds) | rounds (ms) | step time / {base}'s "
          f"| host time in anyccl's group (ms per step, rank 0) | weights vs {base} |")
    print("|---|---:|---|---:|---:|---|")
    for v in variants:
        ms = statistics.median(got["times"][v]) * 1e3
        diff = max(float((a - b).abs().max()) for a, b in zip(got["weights"][v],
                                                              got["weights"][base]))
        same = "identical" if diff == 0 else f"max diff {diff:.2e}"
        in_group = statistics.median(got["host"][v]) * 1e3
        print(f"| {v} | {ms:.2f} | {', '.join(f'{t * 1e3:.2f}' for t in got['times'][v])} | "
              f"{ms / base_ms:.2f} | {in_group:.2f} | {same} |")
    for v, table in got["profiles"].items():
        print(f"\n## profile of rank 0, 3 steps of {v}\n```\n{table}\n```")
    # DDP divides before it sums, so 2 ranks give the same bits in any order of addition
    ddp = [v for v in variants if v.startswith("ddp:anyccl")]
    identical = all(torch.equal(a, b) for v in ddp
                    for a, b in zip(got["weights"][v], got["weights"][base]))
    return 0 if identical or args.ranks > 2 else 1

if __name__ == "__main__":
    sys.exit(main())
