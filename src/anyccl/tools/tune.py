"""`anyccl tune`: measure on this machine which implementation of each GPU collective is fastest
at each size -- every algorithm of anyccl's ipc kernels against NCCL, in the same job, on the
same buffers -- and write the routes the `auto` policy follows on this machine shape.

    anyccl tune -n 4 [--min 8] [--max 1G] [--factor 4] [--ops all_reduce,...] [--margin 0.02]
                     [--out FILE] [--dry-run]

Each op is timed at sizes from --min to --max (nccl-tests' size: the whole array of all_reduce
and broadcast, the gathered or scattered array of all_gather and reduce_scatter), on GPU time
alone: the calls are queued while the GPU sleeps and timed from the sleep's end with CUDA events,
the slowest rank's time, the median of --rounds rounds that rotate the implementations. Each
implementation is first checked for the exact result on every rank; one that is wrong is never
routed to. Reductions are timed in float32 and bfloat16, and an implementation takes a size only
if it beats NCCL by --margin in both. A size between two measured ones takes the larger one's
winner. The table goes into the routes cache (`ANYCCL_ROUTES_FILE`, default
~/.cache/anyccl/routes.json) under this machine's shape (GPU model, ranks, links), replacing an
earlier one of that shape; `anyccl info` says which table is in force. Messages (send, recv) are
not tuned: `auto` sends them on NCCL.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .._units import parse_size
from ..errors import AnycclError
from ..ops import ReduceOp

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
REDUCTIONS = ("all_reduce", "reduce_scatter")
_SLEEP_CYCLES = 40_000_000     # ~20 ms: the host queues a round's calls meanwhile
_ROUND_S = 10e-3               # GPU time one round aims at (8 calls at the least)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="anyccl tune", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nprocs", type=int,
                   help="ranks to start, one per GPU (default: every visible GPU)")
    p.add_argument("--min", default="8", help="smallest size (default 8)")
    p.add_argument("--max", default="1G", help="largest size (default 1G)")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--ops", default=",".join(OPS), help=f"some of {','.join(OPS)}")
    p.add_argument("--margin", type=float, default=0.02,
                   help="the kernels take a size only if faster than NCCL by this fraction")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="the routes file to write (default: the routes cache)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    return p.parse_args(argv)


def _checked(ns: argparse.Namespace) -> tuple[list[str], int, int]:
    """(ops, min bytes, max bytes); AnycclError naming the option that is wrong."""
    ops = [o.strip() for o in ns.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise AnycclError(f"--ops {ns.ops}: expected some of {', '.join(OPS)}")
    low, high = parse_size(ns.min, "--min"), parse_size(ns.max, "--max")
    if not 0 < low <= high:
        raise AnycclError(f"--min {ns.min} --max {ns.max}: need 0 < min <= max")
    if ns.factor < 2:
        raise AnycclError(f"--factor {ns.factor}: need at least 2")
    if not 0 <= ns.margin < 1:
        raise AnycclError(f"--margin {ns.margin}: need a fraction in [0, 1)")
    if ns.rounds < 1:
        raise AnycclError(f"--rounds {ns.rounds}: need at least 1")
    if ns.nprocs is not None and ns.nprocs < 2:
        raise AnycclError(f"-n {ns.nprocs}: tuning compares collectives: need at least 2 ranks")
    return ops, low, high


def sizes(low: int, high: int, factor: int) -> list[int]:
    """low, low * factor, ... up to high, and high itself."""
    out, size = [], low
    while size < high:
        out.append(size)
        size *= factor
    return out + [high]


def per_rank(op: str, size: int, n: int, itemsize: int) -> int:
    """The bytes each rank's array has (what the routes decide on) at nccl-tests size `size`:
    a whole number of elements, 0 where the size has none per rank."""
    share = size // n if op in ("all_gather", "reduce_scatter") else size
    return share // itemsize * itemsize


def candidates(op: str, nbytes: int, backend: Any) -> list[str]:
    """NCCL and the kernels' implementations worth timing for `op` at `nbytes` per rank."""
    from ..backends.ipc.routes import IMPLEMENTATIONS, NCCL

    ring = backend.layout.ce_ring_bytes and backend.size > 1
    if op != "all_reduce":
        # the copy engines' ring where the whole (every rank's piece) is 64 MiB or more
        return [NCCL, *(impl for impl in IMPLEMENTATIONS[op] if impl != "copy_engines"
                        or (ring and nbytes * backend.size >= 64 << 20))]
    slot = backend.layout.slot_bytes
    found = [NCCL]
    if nbytes <= 4 << 20 and backend.lines_per_slot("low_latency", nbytes):
        found.append("low_latency")
    if backend.size > 2 and nbytes <= 32 << 20 and \
            backend.lines_per_slot("low_latency_two_shot", nbytes):
        found.append("low_latency_two_shot")
    if nbytes <= min(slot, 32 << 20):
        found.append("one_shot")
    found.append("two_shot")
    if nbytes >= 64 << 20 and ring:
        # the copy engines' ring (ce.py): 0.97-1.01x NCCL's busbw at 128 MiB - 1 GiB on 4 H100s,
        # 1.09-1.11x on 2, in anyccl bench's long loops, eager and CUDA graphs
        # (2026-11-28-h100x4-copy-engine-ring-all-reduce.md)
        found.append("copy_engines")
    return found


def decide(times: dict[str, dict[str, float]], margin: float) -> tuple[str, float]:
    """(winner, its time over NCCL's in the dtype where it does worst) from times[impl][dtype]:
    the implementation whose worst ratio to NCCL is lowest, if below 1 - margin; else NCCL."""
    from ..backends.ipc.routes import NCCL

    worst = {impl: max(t[d] / times[NCCL][d] for d in t)
             for impl, t in times.items() if impl != NCCL}
    if not worst:
        return NCCL, 1.0
    best = min(worst, key=worst.__getitem__)
    return (best, worst[best]) if worst[best] < 1 - margin else (NCCL, worst[best])


def spans(decisions: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """(above, at most, impl) spans from (measured size, winner) pairs, sizes ascending: each
    size decides for the sizes above the one measured before it, the largest for every larger
    one; NCCL's spans are left out (a size in no span runs there)."""
    from ..backends.ipc.routes import NCCL, NO_END

    out: list[tuple[int, int, str]] = []
    for i, (size, impl) in enumerate(decisions):
        lo = decisions[i - 1][0] if i else 0
        hi = size if i + 1 < len(decisions) else NO_END
        if impl == NCCL:
            continue
        if out and out[-1][1] == lo and out[-1][2] == impl:
            out[-1] = (out[-1][0], hi, impl)
        else:
            out.append((lo, hi, impl))
    return out


class _Bench:
    """One rank's side: its communicator on the ipc backend, torch tensors on its GPU, and the
    timing of one op under one implementation (the backend's routes set to it)."""

    def __init__(self, comm: Any, high: int) -> None:
        import torch

        self.torch, self.comm = torch, comm
        self.dev = torch.device(f"cuda:{comm.device}")
        torch.cuda.set_device(self.dev)
        self.backend = comm.gpu_backend
        self.n = comm.size
        self.a = torch.empty(high // 4 + 1024, dtype=torch.float32, device=self.dev)
        self.b = torch.empty(high // 4 + 1024, dtype=torch.float32, device=self.dev)

    def operands(self, op: str, nbytes: int, dtype: str) -> tuple[Any, Any]:
        t = getattr(self.torch, dtype)
        count = nbytes // t.itemsize
        a, b = self.a.view(t), self.b.view(t)
        if op == "all_gather":
            return a[:count], b[:count * self.n]
        if op == "reduce_scatter":
            return a[:count * self.n], b[:count]
        return a[:count], a[:count]

    def call(self, op: str, inp: Any, out: Any, stream: Any) -> None:
        c = self.comm
        if op == "all_reduce":
            c.all_reduce(inp, stream=stream)
        elif op == "broadcast":
            c.broadcast(inp, 0, stream=stream)
        elif op == "all_gather":
            c.all_gather(out, inp, stream=stream)
        else:
            c.reduce_scatter(out, inp, stream=stream)

    def use(self, op: str, impl: str) -> None:
        from ..backends.ipc.routes import Routes

        self.backend.routes = Routes.everywhere(op, impl, "anyccl tune")

    def correct(self, op: str, inp: Any, out: Any, stream: Any) -> bool:
        """Whether the implementation in use gives the exact result on every rank (small
        integers, exact in every dtype)."""
        torch, r, n = self.torch, self.comm.rank, self.n
        if op == "broadcast":
            inp.fill_(7.0 if r == 0 else 0.0)
        else:
            inp.fill_(r + 1.0)
        self.call(op, inp, out, stream)
        if op == "all_gather":
            want = torch.arange(1, n + 1, device=self.dev, dtype=inp.dtype)
            good = bool((out.view(n, -1) == want[:, None]).all())
        else:
            result = out if op == "reduce_scatter" else inp
            good = bool((result == (7.0 if op == "broadcast" else n * (n + 1) / 2)).all())
        ok = np.array([float(good)])
        self.comm.all_reduce(ok, op=ReduceOp.MIN)
        return bool(ok[0])

    def seconds(self, op: str, inp: Any, out: Any, stream: Any, calls: int) -> float:
        """GPU seconds per call of `calls` back-to-back calls, the slowest rank's."""
        torch = self.torch
        torch.cuda.synchronize()
        self.comm.barrier()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)
        begin.record()
        for _ in range(calls):
            self.call(op, inp, out, stream)
        end.record()
        end.synchronize()
        mine = np.array([begin.elapsed_time(end) / 1e3 / calls])
        self.comm.all_reduce(mine, op=ReduceOp.MAX)
        return float(mine[0])


def measure(bench: _Bench, op: str, nbytes: int, dtype: str, impls: list[str],
            rounds: int) -> dict[str, float]:
    """impl -> GPU seconds per call of `op` on `nbytes` per rank in `dtype`; an implementation
    that gave a wrong result is left out (and said)."""
    stream = bench.torch.cuda.current_stream()
    inp, out = bench.operands(op, nbytes, dtype)
    good, calls = [], {}
    for impl in impls:
        bench.use(op, impl)
        if not bench.correct(op, inp, out, stream):
            if bench.comm.rank == 0:
                print(f"# {op} {nbytes} B {dtype}: {impl} gave a wrong result: never routed to",
                      flush=True)
            continue
        inp.zero_()   # SUM's fixed point: repeated calls neither grow nor overflow
        probe = bench.seconds(op, inp, out, stream, 1)
        calls[impl] = int(min(48, max(8, _ROUND_S / max(probe, 1e-6))))
        good.append(impl)
    times: dict[str, list[float]] = {impl: [] for impl in good}
    for k in range(rounds):
        for impl in good[k % len(good):] + good[:k % len(good)] if good else []:
            bench.use(op, impl)
            times[impl].append(bench.seconds(op, inp, out, stream, calls[impl]))
    return {impl: statistics.median(t) for impl, t in times.items()}


def tune(comm: Any, ops: list[str], low: int, high: int, ns: argparse.Namespace) -> int:
    """Collective over the job: measure, print, and (rank 0) write the table. 0 on success."""
    from ..backends.ipc.routes import (
        NCCL,
        Routes,
        cache_file,
        gpu_identity,
        kernels_digest,
        shape_of,
        store_table,
    )

    bench = _Bench(comm, high)
    if getattr(bench.backend, "routes", None) is None:
        raise AnycclError(f"rank {comm.rank}: the GPU backend is {comm.backend}, not the ipc "
                          f"kernels: nothing to tune")
    shape = shape_of(comm.all_gather_object(gpu_identity(comm.device)))
    lead = comm.rank == 0
    if lead:
        print(f"# anyccl tune on {shape}: GPU time per call, each implementation over NCCL's "
              f"(below {1 - ns.margin:.2f}: it takes the size)", flush=True)
    table: dict[str, list[tuple[int, int, str]]] = {}
    for op in ops:
        dtypes = ("float32", "bfloat16") if op in REDUCTIONS else ("float32",)
        decisions: list[tuple[int, str]] = []
        for size in sizes(low, high, ns.factor):
            nbytes = per_rank(op, size, comm.size, 4)
            if nbytes == 0:
                continue
            impls = candidates(op, nbytes, bench.backend)
            times: dict[str, dict[str, float]] = {}
            for dtype in dtypes:
                for impl, t in measure(bench, op, nbytes, dtype, impls, ns.rounds).items():
                    times.setdefault(impl, {})[dtype] = t
            times = {i: t for i, t in times.items() if len(t) == len(dtypes)}
            if NCCL not in times:
                raise AnycclError(f"{op} at {nbytes} B: NCCL gave a wrong result")
            winner, ratio = decide(times, ns.margin)
            decisions.append((nbytes, winner))
            if lead:
                cells = "  ".join(
                    f"{impl} " + "/".join(f"{t[d] * 1e6:.1f}" for d in dtypes) + " us"
                    + ("" if impl == NCCL else
                       " (" + "/".join(f"{t[d] / times[NCCL][d]:.2f}" for d in dtypes) + ")")
                    for impl, t in times.items())
                print(f"{op:<15} {size:>11} B  {cells}  -> {winner}", flush=True)
        table[op] = spans(decisions)
    routes = Routes(table, "anyccl tune")
    if lead:
        print(f"# routes for {shape}:")
        for line in routes.describe() or ["every op on NCCL"]:
            print(f"#   {line}")
        if not ns.dry_run:
            import anyccl

            path = Path(ns.out) if ns.out else cache_file()
            about = {"measured": f"{datetime.date.today()} on {socket.gethostname()}",
                     "anyccl": anyccl.__version__, "kernels": kernels_digest(),
                     "margin": ns.margin, "sizes": f"{ns.min}..{ns.max} x{ns.factor}"}
            store_table(path, shape, routes, about)
            print(f"# wrote the table for {shape} into {path}", flush=True)
    comm.barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        ops, low, high = _checked(ns)
    except AnycclError as exc:
        print(f"anyccl tune: {exc}", file=sys.stderr)
        return 2
    from .bench import _in_a_job

    if not _in_a_job():
        from .. import gpu

        count = gpu.device_count()
        nprocs = ns.nprocs or count
        if count < 2 or nprocs > count:
            print(f"anyccl tune: it needs one GPU per rank and at least 2; this machine shows "
                  f"{count} (CUDA_VISIBLE_DEVICES={gpu.visible_devices()})", file=sys.stderr)
            return 2
        from ..launch import run
        from .bench import _without_nprocs

        rest = _without_nprocs(list(argv if argv is not None else sys.argv[1:]))
        return run(nprocs, "anyccl.tools.tune", rest, module=True)
    try:
        import torch  # noqa: F401 - tune times on torch CUDA tensors and events
    except ImportError:
        print("anyccl tune: it measures on torch CUDA tensors: pip install torch",
              file=sys.stderr)
        return 2
    import anyccl

    comm = anyccl.init(backend="ipc")   # the kernels, with NCCL beside them
    try:
        comm.connect_gpu()
        return tune(comm, ops, low, high, ns)
    finally:
        comm.close()


if __name__ == "__main__":
    sys.exit(main())
