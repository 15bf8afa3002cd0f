"""Every anyccl operation once, on small arrays, with what each rank holds before and after.

    anyccl run -n 4 examples/hello_collectives.py            # NumPy arrays
    anyccl run -n 4 examples/hello_collectives.py --torch    # PyTorch CPU tensors

Each step checks its own result; the script exits non-zero if any is wrong.
"""

import sys

import numpy as np

import anyccl

use_torch = "--torch" in sys.argv
if use_torch:
    import torch

comm = anyccl.init()
rank, n = comm.rank, comm.size


def array(values, dtype="float32"):
    a = np.asarray(values, dtype=dtype)
    return torch.from_numpy(a.copy()) if use_torch else a


def fmt(values):
    if isinstance(values, str):
        return values
    return np.array2string(np.asarray(values, dtype=float).reshape(-1), precision=2,
                           separator=",")


def show(op, before, after):
    lines = comm.all_gather_object(f"  rank {rank}: {fmt(before):>22} -> {fmt(after)}")
    if rank == 0:
        print(f"{op}")
        print("\n".join(lines), flush=True)


def check(ok, what):
    if not ok:
        print(f"rank {rank}: WRONG result for {what}", file=sys.stderr)
        sys.exit(1)


if rank == 0:
    kind = "PyTorch CPU tensors" if use_torch else "NumPy arrays"
    print(f"anyccl {anyccl.__version__}: {n} ranks, backend {comm.backend}, {kind}\n")

x = array([rank + 1] * 3)
before = x.clone() if use_torch else x.copy()
comm.all_reduce(x)  # SUM by default
show("all_reduce (sum): every rank gets the sum", before, x)
check(np.all(np.asarray(x) == n * (n + 1) / 2), "all_reduce")

x = array([rank, -rank, 2 * rank])
comm.all_reduce(x, op=anyccl.ReduceOp.MAX)
show("all_reduce (max)", [rank, -rank, 2 * rank], x)
check(np.array_equal(np.asarray(x), [n - 1, 0, 2 * (n - 1)]), "all_reduce max")

x = array([10 * rank] * 2)
comm.reduce(x, dst=0)
show("reduce to rank 0 (others keep their input)", [10 * rank] * 2, x)
check(rank != 0 or np.all(np.asarray(x) == 10 * n * (n - 1) / 2), "reduce")

x = array([42, 43] if rank == 0 else [0, 0])
comm.broadcast(x, src=0)
show("broadcast from rank 0", [42, 43] if rank == 0 else [0, 0], x)
check(np.array_equal(np.asarray(x), [42, 43]), "broadcast")

out = array(np.zeros(n))
comm.all_gather(out, array([rank]))
show("all_gather: everyone's value, in rank order", [rank], out)
check(np.array_equal(np.asarray(out), np.arange(n)), "all_gather")

gathered = [array([0]) for _ in range(n)] if rank == 0 else None
comm.gather(array([rank * rank]), gathered, dst=0)
show("gather to rank 0", [rank * rank], np.concatenate(gathered) if gathered else "-")
check(rank != 0 or np.array_equal(np.concatenate(gathered), np.arange(n) ** 2), "gather")

out = array([0, 0])
chunks = [array([100 + r, 200 + r]) for r in range(n)] if rank == 0 else None
comm.scatter(out, chunks, src=0)
show("scatter from rank 0: piece i to rank i", "-", out)
check(np.array_equal(np.asarray(out), [100 + rank, 200 + rank]), "scatter")

inp = array(np.arange(n) + rank)
out = array([0])
comm.reduce_scatter(out, inp)
show("reduce_scatter (sum): rank i gets the sum of pieces i", np.arange(n) + rank, out)
check(np.asarray(out)[0] == n * rank + n * (n - 1) / 2, "reduce_scatter")

inp = array(rank * 10 + np.arange(n))
out = array(np.zeros(n))
comm.all_to_all(out, inp)
show("all_to_all: rank i gets piece i of every rank", rank * 10 + np.arange(n), out)
check(np.array_equal(np.asarray(out), np.arange(n) * 10 + rank), "all_to_all")

if n > 1:
    right, left = (rank + 1) % n, (rank - 1) % n
    got = array([0])
    work = comm.irecv(got, left, tag=7)
    comm.send(array([rank]), right, tag=7)
    work.wait()
    show("send/recv around a ring (tag 7): each rank gets its left neighbour's rank", [rank], got)
    check(np.asarray(got)[0] == left, "send/recv")

works = [comm.all_reduce(array([i]), async_op=True) for i in range(4)]
for w in works:
    w.wait()
check(all(w.is_completed() for w in works), "async all_reduce")

evens = comm.split(color=rank % 2)
x = array([1])
evens.all_reduce(x)
show("split by rank parity, then all_reduce inside each group", [1], x)
check(np.asarray(x)[0] == len(range(rank % 2, n, 2)), "split")
evens.close()

names = comm.all_gather_object(f"rank-{rank}")
check(names == [f"rank-{r}" for r in range(n)], "all_gather_object")
comm.barrier()
if rank == 0:
    print("\nall operations checked: OK")
comm.close()
