"""The `auto` routing table (`AUTO_IPC_RANGES` in src/anyccl/backends/ipc/backend.py) derived
from measurements: for each op, the per-rank array sizes where anyccl's ipc kernels were faster
than anyccl on NCCL in the same run.

    python benchmarks/auto_table.py RUN.json [RUN.json ...] [--margin 0.03]

Each RUN.json is written by `anyccl bench --device cuda --json`, with the ipc kernels either the
main backend (`--backend ipc --compare nccl`) or a peer (`--backend auto --compare ipc,nccl`).
Several files (e.g. a small-size and a large-size sweep) merge; they must have one rank count.
A size goes to ipc when its time is below NCCL's by more than --margin (a fraction); sizes
between two measured ones go with the larger one's winner. Prints the routes,
and a table of the ratios it was decided on; with --write, the routes go into the package's
routes.json, the data `AUTO_IPC_RANGES` is loaded from.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# nccl-tests' size (bytes) -> the size routes_to_ipc decides on (each rank's array)
PER_RANK = {"all_reduce": lambda size, n: size, "broadcast": lambda size, n: size,
            "all_gather": lambda size, n: size // n, "reduce_scatter": lambda size, n: size // n,
            "sendrecv": lambda size, n: size}
VARIANT = {"all_reduce": "in-place", "broadcast": "in-place"}  # else out-of-place
NO_END = 1 << 62


def load(paths: list[str]) -> tuple[int, dict[str, dict[int, dict[str, float]]]]:
    """(ranks, {op: {per-rank bytes: {"ipc": us, "nccl": us}}}) from the runs."""
    ranks, table = None, defaultdict(lambda: defaultdict(dict))
    for path in paths:
        run = json.load(open(path))
        n = run["meta"]["ranks"]
        if ranks not in (None, n):
            raise SystemExit(f"{path}: {n} ranks, but an earlier file has {ranks}")
        ranks = n
        has_peer = any(row["library"] == "anyccl-ipc" for row in run["rows"])
        main_is_ipc = run["meta"]["backend"].endswith("cuda:ipc") and not has_peer
        for row in run["rows"]:
            op, lib = row["op"], row["library"]
            kind = ("ipc" if lib == "anyccl-ipc" or (lib == "anyccl" and main_is_ipc) else
                    "nccl" if lib == "anyccl-nccl" else None)
            if (kind is None or op not in PER_RANK or row["time_us"] is None
                    or row["variant"] != VARIANT.get(op, "out-of-place")):
                continue
            table[op][PER_RANK[op](row["size"], n)][kind] = row["time_us"]
    if ranks is None:
        raise SystemExit("no runs given")
    return ranks, table


def ranges(sizes: dict[int, dict[str, float]], margin: float) -> list[tuple[int, int]]:
    """(above, at most] ranges of per-rank bytes that go to ipc: each measured size decides for
    the sizes above the measured size below it; the largest also for every larger size."""
    measured = sorted(s for s, t in sizes.items() if "ipc" in t and "nccl" in t)
    spans: list[tuple[int, int]] = []
    for i, size in enumerate(measured):
        if sizes[size]["ipc"] >= sizes[size]["nccl"] * (1 - margin):
            continue
        lo = measured[i - 1] if i else 0
        hi = size if i + 1 < len(measured) else NO_END
        if spans and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


def _bytes(v: int) -> str:
    if v >= NO_END:
        return "1 << 62"
    for shift in (30, 20, 10):
        if v and v % (1 << shift) == 0:
            return f"{v >> shift} << {shift}"
    return str(v)


ROUTES = Path(__file__).resolve().parent.parent / "src" / "anyccl" / "backends" / "ipc" / \
    "routes.json"


def derived(table: dict[str, dict[int, dict[str, float]]], margin: float
            ) -> dict[str, list[tuple[int, int]]]:
    """{op: ranges} as routes_to_ipc reads them (a send/recv row decides both directions)."""
    routes: dict[str, list[tuple[int, int]]] = {}
    for op, sizes in table.items():
        spans = ranges(sizes, margin)
        for name in (("send", "recv") if op == "sendrecv" else (op,)):
            routes[name] = spans
    return routes


def write(path: Path, ranks: int, routes: dict[str, list[tuple[int, int]]], runs: list[str],
          machine: str) -> None:
    """Put `routes` into the routes file for `ranks`: ops measured now replace the old ones,
    ops not measured now stay as they were."""
    doc = json.loads(path.read_text())
    entry = doc["ranks"].setdefault(str(ranks), {"measured_on": machine, "from": [],
                                                 "routes": {}})
    entry["routes"].update({op: [list(span) for span in spans] for op, spans in routes.items()})
    entry["from"] = sorted(set(entry["from"]) | {Path(r).name for r in runs})
    if machine:
        entry["measured_on"] = machine
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--margin", type=float, default=0.03)
    p.add_argument("--write", action="store_true",
                   help=f"update the routes file ({ROUTES.name}) the auto policy reads")
    p.add_argument("--machine", default="", help="what the runs were measured on")
    a = p.parse_args()
    n, table = load(a.runs)
    print(f"# {n} ranks; ratio = ipc time / nccl time (below {1 - a.margin:.2f}: ipc)")
    for op, sizes in table.items():
        cells = [f"{s}:{t['ipc'] / t['nccl']:.2f}" for s, t in sorted(sizes.items())
                 if "ipc" in t and "nccl" in t]
        print(f"#   {op:<15} " + " ".join(cells))
    routes = derived(table, a.margin)
    for op, spans in routes.items():
        print(f"    {op}: " + ", ".join(f"({_bytes(lo)}, {_bytes(hi)}]" for lo, hi in spans))
    if a.write:
        write(ROUTES, n, routes, a.runs, a.machine)
        print(f"wrote the {n}-rank routes into {ROUTES}")


if __name__ == "__main__":
    main()
