"""Which implementation runs each GPU collective at each size: the `auto` policy's measured routes,
and the machine shape each table was measured on.

A table belongs to one machine shape (`Shape`): the GPU model, the number of ranks and the links
between their GPUs. `auto` uses a table only on the shape it was measured on, never one carried
over from another: what was never measured runs on NCCL. Tables come from `anyccl tune`, which
measures every implementation against NCCL on the machine it runs on and writes the table into
the routes cache (`ANYCCL_ROUTES_FILE`, default ~/.cache/anyccl/routes.json); the package ships
the tables measured for the machines in benchmarks/results (`routes.json` beside this file). A
cached table is used only while the kernels are the ones it measured (`kernels_digest`).

Every rank of a communicator takes the same routes: rank 0 decides (`agreed`) and the others
read its decision through the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import settings
from ..._units import size_text
from ...errors import InvalidArgumentError, RendezvousError

NCCL = "nccl"
# the implementations of the kernels for each op they serve; all_reduce has five algorithms
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("low_latency", "low_latency_two_shot", "one_shot", "two_shot", "copy_engines"),
    "reduce_scatter": ("kernels", "copy_engines"),
    "all_gather": ("kernels", "copy_engines"),
    "broadcast": ("kernels",),
    "send": ("kernels",),
    "recv": ("kernels",),
}
NO_END = 1 << 62         # "every larger size"
SHIPPED = Path(__file__).with_name("routes.json")


@dataclass(frozen=True)
class Shape:
    """What a routes table was measured on: the GPU model(s), the number of ranks, and the
    links between the GPUs ("NV18": the fewest NVLinks between any two of them; "PCIe": peer
    access without NVLink; "unknown" where neither NVML nor nvidia-smi says)."""

    gpus: str
    ranks: int
    links: str

    def __str__(self) -> str:
        return f"{self.ranks} x {self.gpus}, {self.links}"

    def as_json(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "ranks": self.ranks, "links": self.links}


class Routes:
    """For each op, (above, at most, implementation) spans of per-rank array bytes (the input of
    all_reduce, broadcast, all_gather and messages; the output of reduce_scatter); a size in no
    span runs on NCCL. `source` says where the table came from."""

    def __init__(self, spans: dict[str, list[tuple[int, int, str]]], source: str) -> None:
        self.spans = spans
        self.source = source

    def pick(self, op: str, nbytes: int) -> str:
        """The implementation that runs `op` on `nbytes` per rank: one of IMPLEMENTATIONS[op],
        or NCCL."""
        for lo, hi, impl in self.spans.get(op, ()):
            if lo < nbytes <= hi:
                return impl
        return NCCL

    @classmethod
    def nccl(cls, source: str) -> Routes:
        """Every op on NCCL."""
        return cls({}, source)

    @classmethod
    def kernels(cls, ll_max: int, one_shot_max: int, ce_min: int, source: str,
                ll_two_shot_max: int = 0, ranks: int = 1) -> Routes:
        """The `ipc` policy: every op the kernels serve on them; all_reduce by the tuning
        table's thresholds (lines of data and flags, one shot up to `ll_max`, then two shots
        up to `ll_two_shot_max`; one shot of tiles up to `one_shot_max`, two shots below
        `ce_min`, the copy engines from it); reduce_scatter and all_gather on the copy engines
        where the whole (`ranks` pieces) is `ce_min` or more."""
        ll_max = min(ll_max, one_shot_max)
        ll2 = max(ll_max, min(ll_two_shot_max, ce_min - 1))
        one = max(ll2, one_shot_max)
        cuts = [(0, ll_max, "low_latency"), (ll_max, ll2, "low_latency_two_shot"),
                (ll2, one, "one_shot"), (one, ce_min - 1, "two_shot"),
                (max(one, ce_min - 1), NO_END, "copy_engines")]
        spans = {op: [(0, NO_END, "kernels")] for op in IMPLEMENTATIONS if op != "all_reduce"}
        spans["all_reduce"] = [(lo, hi, impl) for lo, hi, impl in cuts if lo < hi]
        if ce_min < NO_END:
            piece = max(1, -(-ce_min // max(1, ranks)))   # a rank's piece of ce_min
            for op in ("reduce_scatter", "all_gather"):
                spans[op] = [(lo, hi, impl) for lo, hi, impl in
                             [(0, piece - 1, "kernels"), (piece - 1, NO_END, "copy_engines")]
                             if lo < hi]
        return cls(spans, source)

    @classmethod
    def everywhere(cls, op: str, impl: str, source: str = "forced") -> Routes:
        """`op` on `impl` at every size, every other op on NCCL (what `anyccl tune` times)."""
        return cls({} if impl == NCCL else {op: [(0, NO_END, impl)]}, source)

    def as_json(self) -> dict[str, list[list[Any]]]:
        return {op: [[lo, hi, impl] for lo, hi, impl in spans] for op, spans in self.spans.items()}

    @classmethod
    def from_json(cls, data: Any, source: str) -> Routes:
        """The routes of a table's "routes" entry; InvalidArgumentError naming what is wrong
        (an unknown op or implementation, a span that is not [above, at most, name])."""
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{source}: routes must be an object of ops")
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for op, entries in data.items():
            known = IMPLEMENTATIONS.get(op)
            if known is None:
                raise InvalidArgumentError(f"{source}: op {op!r} has no kernels; routes are for "
                                           f"{', '.join(IMPLEMENTATIONS)}")
            spans[op] = []
            for entry in entries if isinstance(entries, list) else [entries]:
                ok = (isinstance(entry, list) and len(entry) == 3
                      and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[:2])
                      and 0 <= entry[0] < entry[1] and entry[2] in known + (NCCL,))
                if not ok:
                    raise InvalidArgumentError(
                        f"{source}: {op}: {entry!r} is not [above, at most, implementation] "
                        f"with 0 <= above < at most and an implementation of "
                        f"{', '.join(known + (NCCL,))}")
                spans[op].append((entry[0], entry[1], entry[2]))
        return cls(spans, source)

    def describe(self) -> list[str]:
        """One line per op: its spans as people read them."""
        return [f"{op:<15} " + ", ".join(f"({_bound(lo)}, {_bound(hi)}] {impl}"
                                         for lo, hi, impl in spans)
                for op, spans in self.spans.items() if spans]


def _bound(n: int) -> str:
    return "any" if n >= NO_END else size_text(n)


# ---- the measured tables: which apply to a shape ------------------------------------------------
def kernels_digest() -> str:
    """A digest of the kernels' source: a cached table measured other kernels is not used."""
    from . import compiler

    return hashlib.sha256(compiler.source().encode()).hexdigest()[:16]


def cache_file() -> Path:
    """Where `anyccl tune` writes and `auto` looks first: ANYCCL_ROUTES_FILE, else
    ~/.cache/anyccl/routes.json (beside the compiled kernels' cache, ANYCCL_CACHE_DIR)."""
    chosen = settings.ROUTES_FILE.get()
    if chosen:
        return Path(chosen)
    root = settings.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "anyccl")
    return Path(root) / "routes.json"


def read_tables(path: Path) -> list[dict[str, Any]]:
    """The tables in a routes file ([] if there is none); InvalidArgumentError naming the file
    if it is not one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise InvalidArgumentError(f"routes file {path}: cannot be read ({exc})") from None
    try:
        tables = json.loads(text)["tables"]
        if not isinstance(tables, list):
            raise TypeError("tables is not a list")
        for t in tables:
            Shape(**t["shape"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"routes file {path}: not a routes table ({exc}); "
                                   f"`anyccl tune` writes a new one") from None
    return tables


def lookup(shape: Shape, files: Iterable[tuple[Path, bool]] | None = None) -> Routes:
    """The routes for `shape`: from the first file (the cache, then the shipped tables) with a
    table of exactly this shape (a cached one only if it measured these kernels); else every op
    on NCCL. `files` are (path, cached) pairs. The Routes' source says which and why."""
    files = files if files is not None else [(cache_file(), True), (SHIPPED, False)]
    digest, stale = None, []
    for path, cached in files:
        try:
            tables = read_tables(path)
        except InvalidArgumentError as exc:
            stale.append(str(exc))
            continue
        for table in tables:
            if Shape(**table["shape"]) != shape:
                continue
            if cached:
                digest = digest or kernels_digest()
                if table.get("kernels") != digest:
                    stale.append(f"{path} has one measured with other kernels")
                    continue
            where = f"{path} ({'measured here by anyccl tune' if cached else 'shipped'}, " \
                    f"{table.get('measured', 'date unknown')})"
            return Routes.from_json(table["routes"], f"table for {shape} from {where}")
    why = f"; {'; '.join(stale)}" if stale else ""
    return Routes.nccl(f"no table measured for {shape}{why}: every op on NCCL (anyccl tune "
                       f"measures one)")


def store_table(path: Path, shape: Shape, routes: Routes, about: dict[str, Any]) -> None:
    """Put the table for `shape` into the routes file at `path` (replacing one of that shape,
    keeping the others), written whole under a temporary name then renamed."""
    try:
        tables = read_tables(path)
    except InvalidArgumentError:
        tables = []
    tables = [t for t in tables if Shape(**t["shape"]) != shape]
    tables.append({"shape": shape.as_json(), **about, "routes": routes.as_json()})
    doc = {"about": "anyccl's auto policy: for each machine shape, the per-rank sizes (bytes, "
                    "as (above, at most] spans) that run on each implementation of the ipc "
                    "kernels; every other size runs on NCCL. Written by anyccl tune.",
           "tables": tables}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


# ---- the machine shape, and one decision for every rank ----------------------------------------
def link_summary(pcis: list[str]) -> str:
    """"NV<k>": the fewest NVLinks between any two of the GPUs at these PCI addresses (NVML,
    else nvidia-smi); "PCIe" where some pair has none; "unknown" where neither tool answers."""
    from ...tools import info

    keys = [info.pci_key(p) for p in pcis]
    devices = [{"index": i, "pci": p} for i, p in enumerate(pcis)]
    counts = info._try(lambda: info._nvlink_counts(devices), {})
    if not counts:
        smi = info._try(info._nvidia_smi_pci_topology, {})
        counts = {(i, j): smi.get((a, b), 0) for i, a in enumerate(keys)
                  for j, b in enumerate(keys)} if smi else {}
    if not counts:
        return "unknown"
    pairs = [counts.get((i, j), 0) for i in range(len(pcis)) for j in range(len(pcis))
             if keys[i] != keys[j]]
    if not pairs:
        return "one GPU"
    return f"NV{min(pairs)}" if min(pairs) else "PCIe"


def gpu_identity(device: int) -> tuple[str, str]:
    """(model name, PCI address) of `device`: what a rank tells the others of its GPU."""
    from ... import gpu

    return gpu.device_name(device), gpu.pci_address(device)


def shape_of(identities: list[tuple[str, str]]) -> Shape:
    """The shape of a job whose rank q runs on the GPU `identities[q]` describes."""
    return Shape(" + ".join(sorted({name for name, _ in identities})), len(identities),
                 link_summary([pci for _, pci in identities]))


def agreed(store: Any, key: str, rank: int, size: int, device: int, timeout_s: float,
           decide: Any = lookup) -> tuple[Shape, Routes]:
    """Collective: every rank publishes its GPU's model and PCI address; rank 0 works out the
    shape, decides the routes (`decide(shape)`) and publishes them; every rank returns rank 0's
    decision, so all take the same route for every call."""
    store.set(f"{key}/gpu/{rank}", json.dumps(gpu_identity(device)).encode())
    if rank == 0:
        shape = shape_of([tuple(json.loads(store.get(f"{key}/gpu/{q}", timeout_s)))
                          for q in range(size)])
        routes = decide(shape)
        store.set(f"{key}/routes", json.dumps({"shape": shape.as_json(), "source": routes.source,
                                               "routes": routes.as_json()}).encode())
        return shape, routes
    try:
        data = json.loads(store.get(f"{key}/routes", timeout_s))
        return Shape(**data["shape"]), Routes.from_json(data["routes"], data["source"])
    except (ValueError, KeyError, TypeError, InvalidArgumentError) as exc:
        raise RendezvousError(f"rank {rank}: the routes rank 0 published are not a routes "
                              f"table ({exc}); is another program using this job's store?") \
            from None
