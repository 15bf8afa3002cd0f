"""The ipc backend's correctness run: the GPU op matrix (all_reduce, reduce_scatter, all_gather,
broadcast, send/recv x float32/float16/bfloat16 x SUM/AVG/MIN/MAX x sizes across the one-shot,
two-shot and several-kernel paths), repeated back to back with fresh random data every time,
each result compared with a float64 reference computed on the GPU from every rank's inputs.

    anyccl run -n 2 benchmarks/ipc_check.py [--iters 1000] [--max-elems 4194304]

Every rank regenerates every rank's inputs from (iteration, rank) seeds, so the reference needs
no communication. Prints a summary line per op and exits non-zero on any mismatch.
"""

import argparse
import collections
import sys
import time

import torch

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--iters", type=int, default=1000)
parser.add_argument("--max-elems", type=int, default=1 << 22)
parser.add_argument("--backend", default="ipc")
args = parser.parse_args()

comm = anyccl.init(args.backend)
r, n, dev = comm.rank, comm.size, torch.device(f"cuda:{comm.device}")
torch.cuda.set_device(dev)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = ["sum", "avg", "min", "max"]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ||d|| / ||ref||
SIZES = [1, 3, 8, 1000, 4099, 65536, 131075, 1 << 20, args.max_elems]


def inputs(seed: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input for this step, generated alike everywhere."""
    out = []
    for q in range(n):
        g = torch.Generator(device=dev).manual_seed(seed * 64 + q)
        out.append(torch.randn(count, generator=g, device=dev, dtype=torch.float32).to(dtype))
    return out


def reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0)
    return stack.min(0).values if op == "min" else stack.max(0).values


def magnitude(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """What rounding errors scale with: for sums the sum of the inputs' absolute values (a sum
    that cancels to nearly zero still carries the rounding of its large terms), else the
    result itself."""
    return reference([x.abs() for x in xs], op) if op in ("sum", "avg") else reference(xs, op)


def error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||got - want|| relative to ||scale|| (default: ||want||); inf for any NaN."""
    if got.isnan().any():
        return float("inf")
    scale = want if scale is None else scale
    return float((got.double() - want).norm() / max(float(scale.norm()), 1e-30))


results: dict[str, list[float]] = collections.defaultdict(list)
wrong = collections.Counter()
rng = torch.Generator().manual_seed(1234)  # the same schedule on every rank
kinds = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "sendrecv"]
started = time.perf_counter()
for it in range(args.iters):
    kind = kinds[it % len(kinds)]
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=rng))]
    op = OPS[int(torch.randint(len(OPS), (1,), generator=rng))]
    count = SIZES[int(torch.randint(len(SIZES), (1,), generator=rng))]
    key = f"{kind} {str(dtype).removeprefix('torch.')}" + (f" {op}" if kind in (
        "all_reduce", "reduce_scatter") else "")
    if kind == "all_reduce":
        xs = inputs(it, count, dtype)
        x = xs[r].clone()
        comm.all_reduce(x, op=op)
        want, scale = reference(xs, op), magnitude(xs, op)
        tol = TOLERANCE[dtype] if op in ("sum", "avg") else 0.0
    elif kind == "reduce_scatter":
        xs = inputs(it, count * n, dtype)
        out = torch.full((count,), float("nan"), device=dev, dtype=dtype)
        comm.reduce_scatter(out, xs[r], op=op)
        x, want = out, reference(xs, op)[r * count:(r + 1) * count]
        scale = magnitude(xs, op)[r * count:(r + 1) * count]
        tol = TOLERANCE[dtype] if op in ("sum", "avg") else 0.0
    elif kind == "all_gather":
        xs = inputs(it, count, dtype)
        out = torch.full((count * n,), float("nan"), device=dev, dtype=dtype)
        comm.all_gather(out, xs[r])
        x, want, tol, scale = out, torch.cat(xs).double(), 0.0, None
    elif kind == "broadcast":
        root = it % n
        xs = inputs(it, count, dtype)
        x = xs[r].clone() if r == root else torch.full_like(xs[r], float("nan"))
        comm.broadcast(x, root)
        want, tol, scale = xs[root].double(), 0.0, None
    else:  # a ring: send to the right, receive from the left, as one batch
        xs = inputs(it, count, dtype)
        x = torch.full_like(xs[r], float("nan"))
        with comm.batch():
            comm.isend(xs[r], (r + 1) % n, tag=it)
            work = comm.irecv(x, (r - 1) % n, tag=it)
        work.wait()
        want, tol, scale = xs[(r - 1) % n].double(), 0.0, None
    e = error(x, want, scale)
    results[key].append(e)
    if not e <= tol:
        wrong[key] += 1
        if wrong[key] <= 3:
            print(f"rank {r}: iteration {it}: {key} x {count}: relative error {e:.3g} > {tol:g}",
                  flush=True)
torch.cuda.synchronize()
took = time.perf_counter() - started

# CUDA graph: capture one all_reduce, replay it on fresh data
static = torch.zeros(1 << 16, device=dev)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        comm.all_reduce(static)          # warm up outside the graph
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    comm.all_reduce(static)
graph_bad = 0
for step in range(20):
    xs = inputs(10_000 + step, static.numel(), torch.float32)
    static.copy_(xs[r])
    graph.replay()
    graph_bad += error(static, reference(xs, "sum"), magnitude(xs, "sum")) > 1e-6
torch.cuda.synchronize()

total_wrong = sum(wrong.values()) + graph_bad
everyone = comm.all_gather_object(total_wrong)
if r == 0:
    print(f"{args.iters} operations on {n} ranks ({comm.backend}) in {took:.1f} s, fresh random "
          f"data each, vs float64:")
    for key in sorted(results):
        errs = results[key]
        print(f"  {key:<34} {len(errs):4d} runs  max relative error {max(errs):.2e}  "
              f"wrong {wrong[key]}")
    print(f"  CUDA graph replays of a captured all_reduce: 20, wrong {graph_bad}")
    print(f"wrong on each rank: {everyone}: {'OK' if not any(everyone) else 'WRONG'}", flush=True)
comm.close()
sys.exit(1 if any(everyone) else 0)
