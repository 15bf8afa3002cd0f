"""What the links between this machine's GPUs carry with no collective library in the way: copy
engine transfers (torch's peer copies, cudaMemcpyPeerAsync underneath) of --mib MiB, timed with
CUDA events. One process drives every GPU.

    python3 benchmarks/link_ceiling.py [--mib 1024] [--repeat 5]

Prints, in GB/s (bytes moved / time, best of --repeat):
  one way      GPU 0 -> GPU 1 alone
  both ways    GPU 0 -> GPU 1 and GPU 1 -> GPU 0 at once (per direction)
  fan out      GPU 0 -> every other GPU at once (GPU 0's total egress)
  all pairs    every GPU -> every other GPU at once (per GPU's egress)
These are the rooflines the bus-bandwidth model of each collective is held against.
"""

from __future__ import annotations

import argparse
import itertools

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, default=1024)
parser.add_argument("--repeat", type=int, default=5)
args = parser.parse_args()

n = torch.cuda.device_count()
if n < 2:
    raise SystemExit("link_ceiling.py needs at least 2 GPUs")
nbytes = args.mib << 20
src = [torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in range(n)]
dst = {(a, b): torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{b}")
       for a, b in itertools.permutations(range(n), 2)}
streams = {pair: torch.cuda.Stream(device=f"cuda:{pair[0]}") for pair in dst}


def timed(pairs: list[tuple[int, int]]) -> float:
    """Seconds for every copy of `pairs` to finish, all started together (best of --repeat)."""
    best = float("inf")
    for _ in range(args.repeat + 1):          # the first round warms up
        for d in range(n):
            torch.cuda.synchronize(d)
        starts, ends = {}, {}
        for pair in pairs:
            s = streams[pair]
            starts[pair] = torch.cuda.Event(enable_timing=True)
            ends[pair] = torch.cuda.Event(enable_timing=True)
            starts[pair].record(s)
        for pair in pairs:
            with torch.cuda.stream(streams[pair]):
                dst[pair].copy_(src[pair[0]], non_blocking=True)
            ends[pair].record(streams[pair])
        for d in range(n):
            torch.cuda.synchronize(d)
        # the copies began together on the host; the longest one bounds them all
        took = max(starts[p].elapsed_time(ends[p]) for p in pairs) / 1e3
        best = min(best, took)
    return best


rows = [("one way (0 -> 1)", [(0, 1)], 1),
        ("both ways (0 <-> 1), per direction", [(0, 1), (1, 0)], 1)]
if n > 2:
    rows.append((f"fan out (0 -> {n - 1} others), GPU 0 egress", [(0, b) for b in range(1, n)],
                 n - 1))
    rows.append((f"all pairs ({n} GPUs), per GPU egress", list(dst), n - 1))
print(f"{n} GPUs: {torch.cuda.get_device_name(0)}; {args.mib} MiB per copy, copy engines "
      f"(torch peer copies), best of {args.repeat}")
for label, pairs, per_gpu in rows:
    seconds = timed(pairs)
    print(f"  {label:<44} {nbytes * per_gpu / seconds / 1e9:8.1f} GB/s", flush=True)
