"""The physical model of the shm backend: bytes each rank reads plus writes per operation, for
the algorithm anyccl picks at each size, against the memory bandwidth measured in the same run.

    python benchmarks/roofline/model.py run.json          # a markdown table for the results file

N is the size column of nccl-tests (the largest buffer of the op). Copies cost 2 bytes of
traffic per byte (read + write), reductions 3 per element pair (read both, write one); data a
schedule keeps in L2 on purpose (the direct all_reduce's 512 KiB scratch and the block it
pushes) is not counted. A rank's
time is at least its traffic divided by B, the bytes one core moves per second in a NumPy copy
(read + written) measured in the same run; with more ranks than cores, cores are shared:
time >= traffic x ceil(ranks / cores) / B. The model's bus bandwidth is N / time times the op's
nccl-tests factor; the table shows how much of it each size reaches.
"""

import json
import os
import sys

from anyccl import tuning
from anyccl.tools.bench import bus_factor

ONE_SHOT_MAX_BYTES = tuning.value("shm.one_shot_max")
DIRECT_MIN_BYTES = {op: tuning.value(f"shm.direct_min.{op}")
                    for op in ("all_reduce", "broadcast", "all_gather", "gather", "scatter")}


def traffic(op: str, size: int, n: int) -> tuple[str, float]:
    """(algorithm, bytes read + written per rank in units of N) for `op` at nccl-tests size."""
    f = (n - 1) / n
    direct = size >= DIRECT_MIN_BYTES.get(op, 1 << 62)
    if op == "all_reduce":
        if size <= ONE_SHOT_MAX_BYTES:
            return "one-shot", n + 3.0                  # stage 2, reduce n reads + 1 write
        if direct:  # scratch and pushed blocks stay in L2: only these bytes touch memory
            return "direct", 2.0                        # read peers' f + own 1/n, write same
        return "two-shot", 4 * f + 1 + 3 / n            # stage 2f, reduce 1+1/n, publish, copy
    if op == "broadcast":
        return ("direct", 2 * f) if direct else ("staged", 2.0)
    if op in ("all_gather", "gather"):
        return ("direct", 2.0) if direct else ("staged", 2.0 + 2 / n)
    if op == "scatter":
        return ("direct", 2 / n) if direct else ("staged", 2 / n + 2 * f)
    if op == "reduce_scatter":
        return "staged", (5 * n - 3) / n                # stage 2f, own copy 2/n, reduce 3f
    if op == "all_to_all":
        return "staged", 4 * f + 2 / n                  # stage 2f, copy out 2f, own 2/n
    if op == "reduce":
        return ("one-shot", n + 3.0) if size <= ONE_SHOT_MAX_BYTES else \
            ("two-shot", 4 * f + 1 + 3 / n)
    return "channel", 4.0                               # sendrecv: into the ring and out


def main() -> None:
    data = json.load(open(sys.argv[1]))
    n, bandwidth = data["meta"]["ranks"], data["meta"]["memory_copy_gbs"]
    cores = os.cpu_count() or 1
    share = -(-n // cores)
    print(f"B = {bandwidth:.1f} GB/s (one core, NumPy copy, read + written); {n} ranks on "
          f"{cores} cores, so each core serves {share} rank(s).\n")
    print("| op | size | algorithm | traffic per rank (x N) | model busbw (GB/s) | "
          "measured busbw | of model |")
    print("|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        if r["library"] != "anyccl" or r["busbw"] is None or r["size"] < (1 << 20):
            continue
        if r["variant"] != ("in-place" if r["op"] in ("all_reduce", "broadcast", "reduce")
                            else "out-of-place"):
            continue
        algorithm, factor = traffic(r["op"], r["size"], n)
        model = bandwidth / (factor * share) * bus_factor(r["op"], n)
        print(f"| {r['op']} | {r['size'] >> 20} MiB | {algorithm} | {factor:.2f} | "
              f"{model:.2f} | {r['busbw']:.2f} | {100 * r['busbw'] / model:.0f}% |")


if __name__ == "__main__":
    main()
