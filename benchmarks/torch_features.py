"""The torch features people use on a CPU process group, timed on `gloo` and on `anyccl` side by
side: the same programs, unchanged but for the backend's name, on the same machine in one run.

    python benchmarks/torch_features.py --world-size 2 [--reps 5] [--json F]

Each feature runs `--reps` times after one warm-up, every rank starting together (a barrier);
a repetition's time is the slowest rank's, and the table gives the median per feature and
backend, and gloo's time over anyccl's (above 1: anyccl is faster). Every feature's result is
compared between the backends (tests/test_torch_real_clients.py and the torch test suites check
them in depth); a row whose results differ says so, and where the feature checks its results
itself (the strided tensors), which backend got them wrong. Exit status 1 when anyccl's results
are wrong or differ from gloo's unexplained.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("gloo", "anyccl")


def _features(rank: int, n: int, scratch: str) -> dict[str, Callable[[int], Any]]:
    """Feature name -> a function of the repetition that runs it once and returns its result
    (what the two backends must agree on)."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms.join import Join
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (n,))

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 10))

    def conv_weights() -> torch.Tensor:
        conv = torch.nn.Conv2d(64, 128, 3).to(memory_format=torch.channels_last)
        return conv.weight.data

    big = torch.arange(n << 18, dtype=torch.float32) + rank   # 1 MiB per rank

    def strided(rep: int) -> Any:
        """Whether each result is what arithmetic says (True, True, True)."""
        w = conv_weights()            # channels_last: not contiguous
        w.fill_(rank + rep)
        dist.all_reduce(w)
        t = torch.full((1024, 256), float(rank + 1)).t()   # transposed
        dist.broadcast(t, 0)
        column = torch.full((4096, 8), float(rank))[:, 3]
        dist.all_reduce(column)
        total = sum(range(n))
        return [bool((w == total + n * rep).all()), bool((t == 1).all()),
                bool((column == total).all())]

    def checkpoint(rep: int) -> Any:
        state = model(rank).state_dict()
        where = os.path.join(scratch, f"dcp-{rep}")
        dcp.save(state, checkpoint_id=where)
        fresh = model(99).state_dict()
        dcp.load(fresh, checkpoint_id=where)
        return [fresh[k].sum() for k in sorted(fresh)]

    def async_checkpoint(rep: int) -> Any:
        state = model(rank).state_dict()
        where = os.path.join(scratch, f"dcp-async-{rep}")
        dcp.async_save(state, checkpoint_id=where).result()
        fresh = model(99).state_dict()
        dcp.load(fresh, checkpoint_id=where)
        return [fresh[k].sum() for k in sorted(fresh)]

    def fsdp2_full_load(rep: int) -> Any:
        full = model(7).state_dict()
        sharded = model(8 + rank)
        for layer in sharded:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        set_model_state_dict(sharded, full if rank == 0 else {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return [p.to_local().sum() for p in sharded.parameters()]

    def dtensor(rep: int) -> Any:
        x = torch.arange(float(256 * n * 1024)).reshape(256 * n, 1024)
        dt = distribute_tensor(x, mesh, [Shard(0)])
        return dt.redistribute(mesh, [Replicate()]).to_local().sum()

    def functional(rep: int) -> Any:
        a = fc.all_reduce(big, "sum", group).wait()
        b = fc.all_gather_tensor(big, 0, group).wait()
        c = fc.reduce_scatter_tensor(big, "sum", 0, group).wait()
        return [a.sum(), b.sum(), c.sum()]

    compiled = torch.compile(lambda x: fc.all_reduce(x * 2, "sum", group).wait() + 1,
                             fullgraph=True)

    def functional_compiled(rep: int) -> Any:
        return compiled(big).sum()

    def objects(rep: int) -> Any:
        everyone: list[Any] = [None] * n
        dist.all_gather_object(everyone, {"rank": rank, "rows": list(range(1000 + rank))})
        given = [{"config": list(range(5000)), "rep": rep}] if rank == 0 else [None]
        dist.broadcast_object_list(given, 0)
        return [len(e["rows"]) for e in everyone] + [given[0]["rep"]]

    def subgroups(rep: int) -> Any:
        evens = dist.new_group([r for r in range(n) if r % 2 == 0])
        x = big.clone()
        if rank % 2 == 0:
            dist.all_reduce(x, group=evens)
        dist.destroy_process_group(evens)
        return x.sum()

    def ddp(rep: int) -> Any:
        torch.manual_seed(0)
        net = DistributedDataParallel(model(0))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        steps = 4 + rank           # uneven inputs: Join lets the ranks with fewer end first
        with Join([net]):
            for step in range(steps):
                x = torch.randn(64, 512, generator=torch.Generator().manual_seed(step))
                if step % 2 == 0:
                    with net.no_sync():    # gradient accumulation: no communication
                        net(x).sum().backward()
                else:
                    net(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
        return [p.sum() for p in net.parameters()]

    def fsdp2(rep: int) -> Any:
        net = model(0)
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for step in range(4):
            x = torch.randn(64, 512, generator=torch.Generator().manual_seed(step * n + rank))
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.full_tensor().sum() for p in net.parameters()]

    return {"strided tensors (channels_last, .t(), a column)": strided,
            "DCP save + load": checkpoint, "DCP async_save + load": async_checkpoint,
            "FSDP2 full state dict from rank 0": fsdp2_full_load,
            "DTensor Shard -> Replicate (1 MiB/rank)": dtensor,
            "functional collectives (1 MiB per rank)": functional,
            "functional all_reduce under torch.compile": functional_compiled,
            "object collectives": objects, "subgroup create + all_reduce": subgroups,
            "DDP: no_sync + Join, 4-5 steps": ddp, "FSDP2: 4 training steps": fsdp2}


def _rank(rank: int, backend: str, n: int, port: int, reps: int, out: str) -> None:
    if backend == "anyccl":
        import anyccl.torch  # noqa: F401
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)   # torch renames functional collectives
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=timedelta(seconds=300))
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        scratch = [scratch]
        dist.broadcast_object_list(scratch, 0)    # one directory for the job's checkpoints
        times: dict[str, list[float]] = {}
        results: dict[str, Any] = {}
        for name, feature in _features(rank, n, scratch[0]).items():
            spent = []
            for rep in range(reps + 1):
                dist.barrier()
                start = time.perf_counter()
                result = feature(rep)
                spent.append(time.perf_counter() - start)
            slowest = torch.tensor(spent[1:], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name], results[name] = slowest.tolist(), result
        dist.barrier()
    torch.save({"times": times, "results": results}, os.path.join(out, f"{backend}-{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-3)
    return a == b


def _flags(runs: dict[str, list[dict]], name: str) -> list[dict[str, Any]]:
    """Per rank, per backend: the checks a feature made itself (a list of booleans), flattened;
    empty dicts for features that return values."""
    flags = []
    for r in range(len(runs["gloo"])):
        got = {b: runs[b][r]["results"][name] for b in BACKENDS}
        if all(isinstance(v, list) and all(isinstance(x, bool) for x in v) for v in got.values()):
            flags.append({b: all(v) for b, v in got.items()})
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        for backend in BACKENDS:
            mp.spawn(_rank, args=(backend, args.world_size, _free_port(), args.reps, out),
                     nprocs=args.world_size)
        runs = {b: [torch.load(os.path.join(out, f"{b}-{r}.pt"), weights_only=False)
                    for r in range(args.world_size)] for b in BACKENDS}
    rows = []
    print(f"# torch {torch.__version__}, {args.world_size} ranks, {os.cpu_count()} cores, "
          f"median of {args.reps} (slowest rank each)")
    print(f"# {'feature':<50} {'gloo (ms)':>10} {'anyccl (ms)':>12} {'gloo/anyccl':>12}  results")
    for name in runs["gloo"][0]["times"]:
        medians = {b: statistics.median(runs[b][0]["times"][name]) * 1e3 for b in BACKENDS}
        agree = all(_same(runs["gloo"][r]["results"][name], runs["anyccl"][r]["results"][name])
                    for r in range(args.world_size))
        ratio = medians["gloo"] / medians["anyccl"]
        wrong = [b for b in BACKENDS if any(r[b] is False for r in _flags(runs, name))]
        rows.append({"feature": name, **{f"{b}_ms": medians[b] for b in BACKENDS},
                     "gloo_over_anyccl": ratio, "same_results": agree, "wrong": wrong})
        print(f"  {name:<50} {medians['gloo']:10.1f} {medians['anyccl']:12.1f} {ratio:12.2f}  "
              f"{'same' if agree else 'DIFFER'}"
              + (f" ({' and '.join(wrong)} wrong: {_flags(runs, name)})" if wrong else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "torch": torch.__version__,
                       "reps": args.reps, "rows": rows}, f, indent=1)
    # a failure: anyccl wrong, or the backends differ where neither checked itself
    sys.exit(1 if any("anyccl" in r["wrong"] or (not r["same_results"] and not r["wrong"])
                      for r in rows) else 0)


if __name__ == "__main__":
    main()
