"""Soak: thousands of mixed, verified operations with random sizes; resident memory and open
file descriptors must stay flat from the first thousand to the last.

    anyccl run -n 4 benchmarks/soak.py --ops 10000 --max-bytes 16M     # the recorded run
    anyccl run -n 4 benchmarks/soak.py --ops 400 --max-bytes 1M        # CI's short form

Every rank draws the same sequence from one seed, so all agree on each op and size. Exits
non-zero, naming the op, if any result differs from NumPy's.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

import anyccl
from anyccl._units import parse_size

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
       "ring", "async_batch", "barrier")
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint8)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def values(rank: int, count: int, dtype, salt: int) -> np.ndarray:
    v = (np.arange(count, dtype=np.int64) * 3 + rank * 7 + salt) % 5
    return (v if np.dtype(dtype).kind == "u" else v - 2).astype(dtype)


def one_op(comm, rng, step: int, max_bytes: int) -> str:
    n, r = comm.size, comm.rank
    op = OPS[rng.integers(len(OPS))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    itemsize = np.dtype(dtype).itemsize
    count = int(rng.integers(0, max_bytes // itemsize // n + 1)) if rng.random() < 0.7 else \
        int(rng.integers(0, 64))
    root = int(rng.integers(n))
    inputs = [values(j, count, dtype, step) for j in range(n)]
    if op in ("all_reduce", "reduce"):
        x = inputs[r].copy()
        comm.all_reduce(x) if op == "all_reduce" else comm.reduce(x, root)
        expected = sum(a.astype(np.int64) for a in inputs).astype(dtype)
        ok = (op == "reduce" and r != root and np.array_equal(x, inputs[r])) or \
            np.array_equal(x, expected)
    elif op == "broadcast":
        x = inputs[r].copy()
        comm.broadcast(x, root)
        ok = np.array_equal(x, inputs[root])
    elif op == "all_gather":
        out = np.empty(n * count, dtype)
        comm.all_gather(out, inputs[r])
        ok = np.array_equal(out, np.concatenate(inputs))
    elif op == "reduce_scatter":
        per = [values(r, count, dtype, step + 1 + j) for j in range(n)]
        out = np.empty(count, dtype)
        comm.reduce_scatter(out, per)
        ok = np.array_equal(out, sum(values(j, count, dtype, step + 1 + r).astype(np.int64)
                                     for j in range(n)).astype(dtype))
    elif op == "all_to_all":
        per = [values(r, count, dtype, step + 1 + j) for j in range(n)]
        outs = [np.empty(count, dtype) for _ in range(n)]
        comm.all_to_all(outs, per)
        ok = all(np.array_equal(outs[j], values(j, count, dtype, step + 1 + r)) for j in range(n))
    elif op == "ring":
        got = np.empty(count, dtype)
        w = comm.irecv(got, (r - 1) % n, tag=step % 7)
        comm.send(inputs[r], (r + 1) % n, tag=step % 7)
        w.wait()
        ok = np.array_equal(got, inputs[(r - 1) % n])
    elif op == "async_batch":
        xs = [values(r, min(count, 4096), dtype, step + k) for k in range(4)]
        works = [comm.all_reduce(x, async_op=True) for x in xs]
        for w in works:
            w.wait()
        ok = all(np.array_equal(x, sum(values(j, x.size, dtype, step + k).astype(np.int64)
                                       for j in range(n)).astype(dtype)) for k, x in enumerate(xs))
    else:
        comm.barrier()
        ok = True
    if not ok:
        raise SystemExit(f"rank {r}: step {step}: {op} {np.dtype(dtype).name} x {count} is wrong")
    return op


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=10000)
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--json")
    a = p.parse_args()
    max_bytes = parse_size(a.max_bytes)
    comm = anyccl.init()
    rng = np.random.default_rng(a.seed)
    window = max(1, min(1000, a.ops // 10))
    samples, counts = [], {}
    start = time.monotonic()
    for step in range(a.ops):
        op = one_op(comm, rng, step, max_bytes)
        counts[op] = counts.get(op, 0) + 1
        if step + 1 == window or step + 1 == a.ops:
            samples.append({"after_ops": step + 1, "rss_mb": round(rss_mb(), 1),
                            "open_fds": open_fds()})
    elapsed = time.monotonic() - start
    everyone = comm.all_gather_object(samples)
    if comm.rank == 0:
        report = {"ranks": comm.size, "ops": a.ops, "max_bytes": max_bytes,
                  "seconds": round(elapsed, 1), "op_counts": counts,
                  "per_rank": {r: s for r, s in enumerate(everyone)}}
        print(json.dumps(report, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    growth = samples[-1]["rss_mb"] - samples[0]["rss_mb"]
    fd_growth = samples[-1]["open_fds"] - samples[0]["open_fds"]
    comm.close()
    if growth > 64 or fd_growth > 0:
        print(f"rank {comm.rank}: resident memory grew {growth:.1f} MB and open fds by "
              f"{fd_growth} between op {window} and op {a.ops}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
