"""`anyccl bench`: nccl-tests style measurements of every collective, side by side with
torch.distributed and MPI in the same run.

Columns, size/count conventions and bus-bandwidth factors follow nccl-tests (PERFORMANCE.md):
`size` is the bytes of the largest buffer an op touches, `count` the elements each rank sends,
algbw = size / time and busbw = algbw x the op's factor from `anyccl.ops.COLLECTIVES`. Time is
the mean over the iterations of the slowest rank, after warm-up and a barrier. Every size is
also run once more on fresh inputs and checked element by element: #wrong counts the elements,
over all ranks, that differ from what NumPy computes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from .. import settings
from .._optional import missing
from .._units import parse_size
from ..buffers import BFLOAT16
from ..communicator import Communicator
from ..errors import AnycclError
from ..ops import COLLECTIVES, ReduceOp
from .peers import NEEDS, AnycclPeer, peers

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
       "all_to_all", "sendrecv")
_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half",
               "bfloat16": "bfloat16", "int8": "int8", "uint8": "uint8", "int32": "int32",
               "uint32": "uint32", "int64": "int64", "uint64": "uint64"}
_IN_PLACE_ONLY = ("all_reduce", "broadcast", "reduce")  # anyccl's API is in place for these
_OUT_OF_PLACE_ONLY = ("gather", "scatter", "sendrecv")
_TARGET_S = 0.3  # automatic iteration counts aim at this much time per size and library
_MAX_ITERS = 50_000  # ... but no more calls than this per round
_HEADER = (  # as nccl-tests prints it
    "#                                                              out-of-place"
    "                       in-place\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
    "     (us)  (GB/s)  (GB/s)")


def bus_factor(op: str, n: int) -> float:
    return 1.0 if op == "sendrecv" else COLLECTIVES[op].bus_factor(n)


@dataclass
class Row:
    library: str
    op: str
    variant: str  # "out-of-place" | "in-place"
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None
    spread: float | None = None  # (slowest - fastest round) / median round


# ---- inputs, buffers and expected results -------------------------------------------------
@functools.lru_cache(maxsize=16)
def _cached_values(rank: int, count: int, dtype: np.dtype, salt: int) -> np.ndarray:
    period = (np.arange(5, dtype=np.int64) * 3 + rank * 7 + salt) % 5   # repeats every 5
    period = period if dtype.kind == "u" else period - 2
    if dtype == BFLOAT16:   # through float32's bits (the values are exact in both)
        period = (period.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    values = np.empty(count, period.dtype)
    values[:5] = period[:count]
    filled = min(5, count)
    while filled < count:   # doubling copies: a 1 GiB array in a few memcpys
        step = min(filled, count - filled)
        values[filled:filled + step] = values[:step]
        filled += step
    values = values.view(dtype) if dtype == BFLOAT16 else values.astype(dtype, copy=False)
    values.flags.writeable = False
    return values


def _values(rank: int, count: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s inputs: a fresh writable copy (the large ones are computed once)."""
    return _cached_values(rank, count, dtype, salt).copy()


def _reduce(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """What `op` over the ranks' `arrays` must give, computed by NumPy alone (never by
    anyccl's own kernels, which the check is to judge): in a wider floating type for floating
    types (`_wide`), in the arrays' own type otherwise (integers wrap as NumPy's). One array
    is widened at a time, so a 1 GiB check holds the sum and one operand, not every rank's
    copy."""
    dtype = arrays[0].dtype
    if dtype == np.bool_:
        logical = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or,
                   ReduceOp.BOR: np.logical_or, ReduceOp.PROD: np.logical_and,
                   ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and}
        ufunc = logical.get(op, np.logical_xor)
        wide = np.dtype(np.bool_)
    else:
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
                 ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                 ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                 ReduceOp.BXOR: np.bitwise_xor}[op]
        wide = _wide(dtype) if dtype == BFLOAT16 or dtype.kind in "fc" else dtype
    result = _widened(arrays[0], wide, copy=True)     # the inputs stay as they are
    for a in arrays[1:]:
        ufunc(result, _widened(a, wide), out=result)
    return result / len(arrays) if op is ReduceOp.AVG else result


def _wide(dtype: np.dtype) -> np.dtype:
    """The type floating results are computed and compared in: float32 for 16-bit floats
    (every bench value and the sum of thousands of them is exact there, at half float64's
    memory and time for a 1 GiB check), float64 for the rest, complex128 for complex."""
    if dtype.kind == "c":
        return np.dtype(np.complex128)
    return np.dtype(np.float32 if dtype.itemsize <= 2 else np.float64)


def _widened(a: np.ndarray, wide: np.dtype, copy: bool = False) -> np.ndarray:
    """`a` as `wide`; bfloat16 through its bits (a float32 is a bfloat16 with 16 more bits),
    many times faster than ml_dtypes' element-wise conversion."""
    if a.dtype == BFLOAT16:
        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(wide, copy=copy)


@functools.lru_cache(maxsize=1)
def _expected(op: str, count: int, dtype: np.dtype, rank: int, n: int, root: int,
              redop: ReduceOp) -> np.ndarray:
    """What rank `rank`'s output of `op` must hold (computed once per size: the checks of
    every library at that size share it)."""
    fixed = lambda r, salt=0: _cached_values(r, count, dtype, salt)  # noqa: E731 (read-only)
    if op in ("all_reduce", "reduce"):
        return _reduce([fixed(r) for r in range(n)], redop)
    if op in ("all_gather", "gather"):
        return np.concatenate([fixed(r) for r in range(n)])
    if op == "reduce_scatter":
        return _reduce([fixed(r, rank) for r in range(n)], redop)
    if op == "all_to_all":
        return np.concatenate([fixed(j, rank) for j in range(n)])
    raise ValueError(op)


def sizes_of(op: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """(count, size) as nccl-tests prints them for a requested size of `nbytes`."""
    elems = nbytes // itemsize
    if op in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"):
        count = elems // n
        return count, count * n * itemsize
    return elems, elems * itemsize


def build(op: str, count: int, dtype: np.dtype, rank: int, n: int, root: int, in_place: bool,
          redop: ReduceOp) -> tuple[dict[str, Any], Callable[[dict[str, Any]], int]]:
    """Buffers for one run of `op`, and a function counting the wrong elements after it."""
    b: dict[str, Any] = {"kind": "in" if in_place else "out"}
    values = lambda r, salt=0: _values(r, count, dtype, salt)  # noqa: E731
    fixed = lambda r, salt=0: _cached_values(r, count, dtype, salt)  # noqa: E731 (read-only)

    def wrong(actual: np.ndarray, expected: np.ndarray) -> int:
        if dtype.kind == "c":
            bad = ~np.isclose(actual.astype(np.complex128), expected.astype(np.complex128),
                              rtol=1e-2, atol=1e-2)
        elif dtype.kind == "f" or dtype == BFLOAT16:   # NaN compares false: counted wrong
            want = _widened(expected, _wide(dtype))
            diff = _widened(actual, want.dtype, copy=True)
            np.subtract(diff, want, out=diff)
            np.abs(diff, out=diff)
            bad = ~(diff <= 1e-2 + 1e-2 * np.abs(want))
        else:
            bad = actual != expected
        return int(np.count_nonzero(bad))

    expected = lambda: _expected(op, count, dtype, rank, n, root, redop)  # noqa: E731
    if op in ("all_reduce", "reduce", "broadcast"):
        b["buf"] = values(rank)
        if op == "broadcast":
            return b, lambda b: wrong(b["buf"], fixed(root))
        if op == "reduce" and rank != root:
            return b, lambda b: 0  # non-root contents are unspecified (nccl-tests checks root)
        return b, lambda b: wrong(b["buf"], expected())
    if op in ("all_gather", "gather"):
        whole = np.zeros(n * count, dtype)
        b["inp"] = whole[rank * count:(rank + 1) * count] if in_place else np.zeros(count, dtype)
        b["inp"][:] = fixed(rank)
        receives = op == "all_gather" or rank == root
        if op == "all_gather":
            b["out"] = whole
        elif receives:
            b["out_whole"] = whole
            b["outs"] = [whole[j * count:(j + 1) * count] for j in range(n)]
        else:
            b["outs"] = None
        return b, (lambda b: wrong(whole, expected())) if receives else (lambda b: 0)
    if op == "scatter":
        b["out"] = np.zeros(count, dtype)
        if rank == root:
            b["chunks_whole"] = np.concatenate([fixed(root, j) for j in range(n)])
            b["chunks"] = [b["chunks_whole"][j * count:(j + 1) * count] for j in range(n)]
        else:
            b["chunks"] = None
        return b, lambda b: wrong(b["out"], fixed(root, rank))
    if op in ("reduce_scatter", "all_to_all"):
        b["inp"] = np.concatenate([fixed(rank, j) for j in range(n)])
        if op == "reduce_scatter":
            b["out"] = b["inp"][rank * count:(rank + 1) * count] if in_place \
                else np.zeros(count, dtype)
        else:
            b["out"] = b["inp"] if in_place else np.zeros(n * count, dtype)
        return b, lambda b: wrong(b["out"], expected())
    if op == "sendrecv":
        b["inp"], b["out"] = values(rank), np.zeros(count, dtype)
        return b, lambda b: wrong(b["out"], fixed((rank - 1) % n))
    raise ValueError(op)


# ---- where the buffers live -------------------------------------------------------------------
class HostPlacement:
    """Buffers stay the NumPy arrays `build` made."""

    device = "cpu"

    def describe(self) -> str:
        return "cpu"

    def place(self, b: dict[str, Any]) -> dict[str, Any]:
        return b

    def fetch(self, placed: dict[str, Any], b: dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass


class CudaPlacement:
    """Buffers copied to GPU `device` as torch tensors, keeping which ones share memory (an
    in-place input stays a piece of the output); `fetch` copies them back for the checks."""

    def __init__(self, device: int) -> None:
        import torch

        self.torch, self.index = torch, device
        self.device = f"cuda:{device}"
        self.symmetric = False  # allocate in torch's symmetric memory (--compare symm)

    def _on_device(self, host: Any) -> Any:
        if not self.symmetric:
            return host.to(self.device)
        import torch.distributed._symmetric_memory as symm_mem

        placed = symm_mem.empty(host.numel(), dtype=host.dtype, device=self.device)
        placed.copy_(host)
        return placed

    def describe(self) -> str:
        props = self.torch.cuda.get_device_properties(self.index)
        return f"{self.index} [{props.name}]"

    def _root(self, a: np.ndarray) -> np.ndarray:
        return a if a.base is None or not isinstance(a.base, np.ndarray) else a.base

    def place(self, b: dict[str, Any]) -> dict[str, Any]:
        torch, roots = self.torch, {}

        def move(a: Any) -> Any:
            if isinstance(a, list):
                return [move(x) for x in a]
            if not isinstance(a, np.ndarray):
                return a
            root = self._root(a)
            if id(root) not in roots:
                host = torch.from_numpy(np.ascontiguousarray(root).view(np.uint8))
                roots[id(root)] = (root, self._on_device(host))
            offset = a.ctypes.data - root.ctypes.data
            raw = roots[id(root)][1][offset:offset + a.nbytes]
            return raw.view(_torch_dtype(torch, a.dtype))
        placed = {k: move(v) for k, v in b.items()}
        placed["_roots"] = roots
        return placed

    def fetch(self, placed: dict[str, Any], b: dict[str, Any]) -> None:
        self.sync()
        for root, device_copy in placed["_roots"].values():
            root.view(np.uint8)[...] = device_copy.cpu().numpy().reshape(root.view(np.uint8).shape)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.index)

    def graphed(self, run: Callable[[], None], calls: int) -> Callable[[], None]:
        """A runner that replays a CUDA graph of `calls` back-to-back calls of `run`: what the
        GPU takes for them, without the host's time per call (nccl-tests' -G)."""
        torch = self.torch
        side = torch.cuda.Stream(self.index)
        side.wait_stream(torch.cuda.current_stream(self.index))
        with torch.cuda.stream(side):
            run()                                  # outside the graph first (lazy set-ups)
        torch.cuda.current_stream(self.index).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                run()
        self.sync()
        return graph.replay


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    if dtype == BFLOAT16:
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype)).dtype


# ---- measuring ----------------------------------------------------------------------------
@dataclass
class Settings:
    ops: list[str]
    min_bytes: int
    max_bytes: int
    factor: float
    dtype: np.dtype
    redop: ReduceOp
    root: int
    iters: int | None
    warmup: int
    graph: bool = False  # time replays of a CUDA graph of the calls (GPU time, no host cost)
    rounds: int = 3  # timed rounds per size, alternating between the libraries; median kept


_GRAPH_CALLS = 20  # calls captured in one graph with --graph


def sweep_sizes(s: Settings) -> list[int]:
    sizes, size = [], s.min_bytes
    while size <= s.max_bytes:
        sizes.append(size)
        size = max(size + 1, int(size * s.factor))
    return sizes


@dataclass
class _Timed:
    """One library's side of a measurement: its runner on the shared buffers and its times."""

    peer: Any
    row: Row
    run: Callable[[], None] | None
    iters: int = 0
    per_run: int = 1
    seconds: list[float] = field(default_factory=list)


def measure(comm: Communicator, peers: list[Any], op: str, nbytes: int, s: Settings,
            in_place: bool, where: Any = None) -> list[Row]:
    """One row per library for `op` on `nbytes`: every library runs on the same buffers, timed
    in `s.rounds` rounds that alternate between the libraries (the order rotates each round, so
    no library always goes first), and its row reports its median round, the slowest rank's
    time. Then each library's result is checked on fresh inputs (#wrong)."""
    n, itemsize = comm.size, s.dtype.itemsize
    count, size = sizes_of(op, nbytes, itemsize, n)
    spec = COLLECTIVES.get(op)  # sendrecv is no collective: no root, no reduction
    root = s.root if spec and spec.takes_root else -1
    redop = s.redop.name.lower() if spec and spec.reduces else "none"
    where = where or HostPlacement()
    buffers, _ = build(op, count, s.dtype, comm.rank, n, max(root, 0), in_place, s.redop)
    if spec and spec.reduces:
        hold_steady(buffers, s.redop)
    placed = where.place(buffers)
    timed = []
    for peer in peers:
        row = Row(peer.name, op, "in-place" if in_place else "out-of-place", size, count,
                  _TYPE_NAMES.get(s.dtype.name, s.dtype.name), redop, root, None, None, None,
                  None)
        run = peer.runner(op, placed, s.redop, max(root, 0))
        if s.graph and (op == "sendrecv" or not getattr(peer, "captures", True)):
            run = None  # batched messages are async: not capturable
        timed.append(_Timed(peer, row, run))
    for t in timed:
        if t.run is None:
            continue
        if s.graph:
            t.per_run = _GRAPH_CALLS
            t.run = where.graphed(t.run, t.per_run)
        for _ in range(s.warmup):
            t.run()
        where.sync()
        t.iters = s.iters or _agreed_iters(comm, t.run, where, s.rounds)
    active = [t for t in timed if t.run is not None]
    for k in range(s.rounds):
        for j in range(len(active)):
            t = active[(j + k) % len(active)]
            assert t.run is not None
            t.peer.barrier()
            where.sync()
            t0 = time.perf_counter()
            for _ in range(t.iters):
                t.run()
            where.sync()
            elapsed = np.array([(time.perf_counter() - t0) / t.iters / t.per_run])
            comm.all_reduce(elapsed, ReduceOp.MAX)
            t.seconds.append(float(elapsed[0]))
    for t in active:
        fresh, count_wrong = build(op, count, s.dtype, comm.rank, n, max(root, 0), in_place,
                                   s.redop)
        again = where.place(fresh)
        t.peer.runner(op, again, s.redop, max(root, 0))()
        where.fetch(again, fresh)
        wrong = np.array([count_wrong(fresh)], np.int64)
        comm.all_reduce(wrong)
        seconds = float(np.median(t.seconds))
        t.row.spread = (max(t.seconds) - min(t.seconds)) / seconds if seconds > 0 else 0.0
        t.row.time_us = seconds * 1e6
        t.row.algbw = size / seconds / 1e9
        t.row.busbw = t.row.algbw * bus_factor(op, n)
        t.row.wrong = int(wrong[0])
    return [t.row for t in timed]


def hold_steady(buffers: dict[str, Any], redop: ReduceOp) -> None:
    """Fill the timed buffers of a reduction with its fixed point (0 for SUM, 1 for PROD), so
    that thousands of in-place repetitions neither overflow nor slow down on infinities; the
    results are checked afterwards, on fresh inputs."""
    steady = {ReduceOp.SUM: 0, ReduceOp.PROD: 1}.get(redop)
    if steady is None:  # AVG, MIN, MAX and the bitwise ops stay within their inputs' range
        return
    for value in buffers.values():
        for array in value if isinstance(value, list) else [value]:
            if isinstance(array, np.ndarray):
                array[...] = steady


def _agreed_iters(comm: Communicator, run: Callable[[], None], where: Any, rounds: int) -> int:
    """Iterations per round, the same on every rank: the slowest rank's probe call sets them so
    that all rounds together take about _TARGET_S."""
    t0 = time.perf_counter()
    run()
    where.sync()
    probe = np.array([time.perf_counter() - t0])
    comm.all_reduce(probe, ReduceOp.MAX)
    return int(min(_MAX_ITERS, max(5, _TARGET_S / rounds / max(float(probe[0]), 1e-7))))


def memory_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """One core copying `nbytes` with NumPy: bytes read plus written per second."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


# ---- printing -----------------------------------------------------------------------------
def _fmt_variant(r: Row | None) -> str:
    if r is None or r.time_us is None:
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>5}"  # nccl-tests' widths
    t = f"{r.time_us:7.2f}" if r.time_us < 1e5 else f"{r.time_us:7.0f}"
    return f"  {t}  {r.algbw:6.2f}  {r.busbw:6.2f}  {r.wrong:5d}"


def print_header(out, op: str, libraries: list[str]) -> None:
    """The head of `op`'s table: nccl-tests' columns, then the spread of the rounds and, when
    several libraries are measured, which one a line is."""
    print(f"#\n# {op}", file=out)
    lines = _HEADER.split("\n")
    extra = [("", ""), ("  spread", "  library" if len(libraries) > 1 else ""),
             ("     (%)", "")]
    print("\n".join(line + a + b for line, (a, b) in zip(lines, extra)), file=out)
    if op in _IN_PLACE_ONLY:
        print(f"# (out-of-place N/A: {op} writes its result into its input in anyccl's API, as "
              f"in torch.distributed's; the in-place columns are measured)", file=out)
    elif op in _OUT_OF_PLACE_ONLY:
        print(f"# (in-place N/A: {op} has no in-place form; the out-of-place columns are "
              f"measured)", file=out)


def print_size(out, library: str, rows: list[Row], several: bool) -> None:
    """One table line: `library`'s rows (its variants) of one size, as soon as measured."""
    by_variant = {r.variant: r for r in rows}
    first = rows[0]
    spreads = [r.spread for r in rows if r.spread is not None]
    spread = f"{100 * max(spreads):8.0f}" if spreads else f"{'N/A':>8}"
    print(f"{first.size:12d}  {first.count:12d}  {first.type:>8}  {first.redop:>6}  "
          f"{first.root:6d}" + _fmt_variant(by_variant.get("out-of-place"))
          + _fmt_variant(by_variant.get("in-place")) + spread
          + (f"  {library}" if several else ""), file=out, flush=True)


def print_footer(out, library: str, rows: list[Row], several: bool) -> None:
    wrong = sum(r.wrong or 0 for r in rows)
    busbws = [r.busbw for r in rows if r.busbw is not None]
    who = f" ({library})" if several else ""
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}{who}", file=out)
    avg = sum(busbws) / len(busbws) if busbws else 0.0
    print(f"# Avg bus bandwidth    : {avg:g}{who or ' '}", file=out)
    noisy = [r for r in rows if r.spread is not None and r.spread > 0.5]
    if noisy:
        print(f"# Noisy                : {len(noisy)} of {len(rows)} rows{who} had rounds more "
              f"than 50% apart; the machine was busy, or use more --rounds", file=out)


def comparison_variant(op: str) -> str:
    return "in-place" if op in _IN_PLACE_ONLY else "out-of-place"


def print_comparison(out, op: str, rows: list[Row], libraries: list[str],
                     ours_label: str = "anyccl") -> None:
    """busbw side by side and anyccl's ratio to each peer (`ours_label` says which anyccl:
    its backend)."""
    variant = comparison_variant(op)
    peers = [lib for lib in libraries if lib != "anyccl"]
    head = f"# {'size':>10}  {'anyccl':>8}" + "".join(f"  {p:>8}  {'ratio':>6}" for p in peers)
    print(f"#\n# {op}: busbw (GB/s, {variant}); ratio = {ours_label} / peer\n{head}", file=out)
    table: dict[int, dict[str, Row]] = {}
    for r in rows:
        if r.variant == variant:
            table.setdefault(r.size, {})[r.library] = r
    for size, libs in table.items():
        ours = libs.get("anyccl")
        line = f"{size:12d}  {_bw(ours):>8}"
        for p in peers:
            theirs = libs.get(p)
            ratio = (f"{ours.busbw / theirs.busbw:6.2f}" if ours and theirs and ours.busbw
                     and theirs.busbw else f"{'N/A':>6}")
            line += f"  {_bw(theirs):>8}  {ratio}"
        print(line, file=out)
    print("# latency at the smallest size (us, spread of the rounds): " + ", ".join(
        f"{lib} {r.time_us:.1f} ({100 * (r.spread or 0):.0f}%)"
        for lib, r in table[min(table)].items() if r.time_us) if table else "#", file=out)


def _bw(r: Row | None) -> str:
    return "N/A" if r is None or r.busbw is None else f"{r.busbw:.3f}"


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r.op for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        variant = comparison_variant(op)
        for lib in dict.fromkeys(r.library for r in rows):
            pts = [r for r in rows if r.op == op and r.library == lib and r.variant == variant
                   and r.busbw]
            if not pts:
                continue
            axes[i][0].plot([p.size for p in pts], [p.busbw for p in pts], marker="o", label=lib)
            axes[i][1].plot([p.size for p in pts], [p.time_us for p in pts], marker="o",
                            label=lib)
        for j, (ylabel, name) in enumerate((("busbw (GB/s)", "bus bandwidth"),
                                            ("time (us)", "latency"))):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op} {name} ({variant})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the command --------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="anyccl bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--nprocs", type=int, help="launch this many ranks (else: this job)")
    p.add_argument("--op", default="all_reduce", help="|".join(OPS) + "|all, or a list a,b")
    p.add_argument("--min", default="8", help="smallest size (default 8)")
    p.add_argument("--max", default="64M", help="largest size (default 64M)")
    p.add_argument("--factor", type=float, default=2.0, help="size step factor (default 2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--redop", default="sum")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--iters", type=int, help="timed iterations per size (default: automatic)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds per size, alternating between the libraries compared; "
                        "each row reports the median round (default 3)")
    p.add_argument("--backend", default=None, help="anyccl backend (default shm)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--compare", default="", help="peers to run in the same job: torch, symm "
                   "(torch's symmetric-memory all_reduce; GPUs), mpi, shm, nccl, ipc, auto "
                   "(anyccl on that backend)")
    p.add_argument("--graph", action="store_true",
                   help="--device cuda: capture the calls in a CUDA graph and time its replays "
                        "(the GPU's time per call, without the host's)")
    p.add_argument("--json", help="write every row to this JSON file")
    p.add_argument("--plot", help="draw busbw and latency against size into this PNG")
    return p.parse_args(argv)


def _settings(ns: argparse.Namespace) -> Settings:
    from ..buffers import SUPPORTED_DTYPES

    ops = list(OPS) if ns.op == "all" else [o.strip() for o in ns.op.split(",")]
    for op in ops:
        if op not in OPS:
            raise AnycclError(f"--op {op}: expected one of {', '.join(OPS)}, all")
    by_name = {d.name: d for d in SUPPORTED_DTYPES}
    if ns.dtype not in by_name:
        raise AnycclError(f"--dtype {ns.dtype}: expected one of {', '.join(by_name)}")
    return Settings(ops, parse_size(ns.min, "--min"), parse_size(ns.max, "--max"), ns.factor,
                    by_name[ns.dtype], ReduceOp.parse(ns.redop), ns.root, ns.iters, ns.warmup,
                    _graph_needs_cuda(ns), _positive(ns.rounds, "--rounds"))


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise AnycclError(f"{flag} {value}: expected at least 1")
    return value


def _graph_needs_cuda(ns: argparse.Namespace) -> bool:
    if ns.graph and ns.device != "cuda":
        raise AnycclError("--graph times CUDA graph replays: add --device cuda")
    return bool(ns.graph)


def _in_a_job() -> bool:
    launched = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    return settings.STORE.is_set() or any(os.environ.get(v) for v in launched)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:   # every argument is checked here, once, before any rank starts
        chosen = _settings(ns)
        compare = _compared(ns)
    except AnycclError as exc:
        print(f"anyccl bench: {exc}", file=sys.stderr)
        return 2
    problem = ns.plot and missing("matplotlib", extra="plot", feature="anyccl bench --plot")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if not _in_a_job():
        if not ns.nprocs:
            print("anyccl bench: -n N: how many ranks to start (-n 1 measures one rank alone); "
                  "or start it under a launcher: anyccl run, mpiexec, torchrun", file=sys.stderr)
            return 2
        return _launch(ns, argv if argv is not None else sys.argv[1:], compare)
    return _bench(ns, chosen, compare)


def _compared(ns: argparse.Namespace) -> list[str]:
    """The --compare list, each peer known and runnable here (GPU peers: on GPUs that exist),
    and the backend anyccl itself runs on; AnycclError naming the option otherwise."""
    from ..backends import registry
    from ..launch import check_backend

    compare = [c.strip() for c in ns.compare.split(",") if c.strip()]
    for c in compare:
        if c not in peers():
            raise AnycclError(f"--compare {c}: expected some of {', '.join(peers())}")
        module, extra = NEEDS.get(c, (None, ""))
        problem = module and missing(module, extra=extra, feature=f"--compare {c}")
        if problem:
            raise AnycclError(problem)
    if "gloo" in compare and ns.device == "cuda":
        raise AnycclError("--compare gloo measures host arrays (torch's gloo); on GPUs torch "
                          "runs NCCL: --compare torch")
    if ns.nprocs is not None and ns.nprocs < 1:
        raise AnycclError(f"-n {ns.nprocs}: need at least one rank")
    on_gpus = [c for c in compare if c == "symm" or c in registry.selectable_gpu_backends()]
    if on_gpus and ns.device != "cuda":
        raise AnycclError(f"--compare {','.join(on_gpus)} measures GPU arrays: add --device "
                          f"cuda")
    check_backend(ns.backend, mpiexec_starts=True)
    if ns.device == "cuda":
        from .. import gpu

        if gpu.device_count() == 0:
            raise AnycclError("--device cuda: no CUDA GPU is visible here")
    return compare


def _launch(ns: argparse.Namespace, argv: list[str], compare: list[str]) -> int:
    rest = _without_nprocs(argv)
    if "mpi" in compare or (ns.backend or "").startswith("mpi"):
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise SystemExit("anyccl bench: --compare mpi and --backend mpi need mpiexec on "
                             "PATH (pip install mpich mpi4py)")
        import subprocess

        return subprocess.call([mpiexec, "-n", str(ns.nprocs), sys.executable, "-m",
                                "anyccl.tools.bench", *rest])
    from ..launch import run

    return run(ns.nprocs, "anyccl.tools.bench", rest, module=True, backend=ns.backend)


def _communicator(ns: argparse.Namespace) -> tuple[Communicator, Any]:
    """The communicator and where the buffers live: --device cuda creates the NCCL
    communicator up front on this rank's GPU (local rank modulo the visible GPUs)."""
    import anyccl

    if ns.device == "cpu":   # anyccl's default even where a peer needs mpiexec (--compare mpi)
        return anyccl.init(ns.backend or settings.BACKEND.get() or "shm"), HostPlacement()
    from .. import gpu

    count = gpu.device_count()
    if count == 0:
        raise SystemExit("anyccl bench: --device cuda, but no CUDA device is visible")
    comm = anyccl.init(ns.backend or "nccl")  # its GPU: local rank modulo the visible GPUs
    import torch

    torch.cuda.set_device(comm.device)
    return comm, CudaPlacement(comm.device)


def _without_nprocs(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-n", "--nprocs"):
            skip = True
        elif not a.startswith(("-n=", "--nprocs=")):
            out.append(a)
    return out


def _bench(ns: argparse.Namespace, s: Settings, compare: list[str]) -> int:
    comm, where = _communicator(ns)
    out = sys.stdout
    known = peers()
    libraries: list[Any] = [AnycclPeer(comm)] + [known[c](comm, where.device) for c in compare]
    if any(getattr(peer, "symmetric", False) for peer in libraries):
        where.symmetric = True  # every library's buffers where the symmetric-memory peer works
    sizes = sweep_sizes(s)
    lead = comm.rank == 0
    membw = memory_bandwidth_gbs() if lead else 0.0
    comm.barrier()
    hosts = comm.all_gather_object((os.getpid(), socket.gethostname(), where.describe()))
    if lead:
        print(f"# anyccl bench: {','.join(s.ops)} on {comm.size} ranks, backend {comm.backend} "
              f"({where.device}), {s.dtype.name}, redop {s.redop.name.lower()}, root "
              f"{s.root}, sizes {s.min_bytes} B .. {s.max_bytes} B x{s.factor:g}, warmup "
              f"{s.warmup}, iters {s.iters or 'auto'} x {s.rounds} rounds (median)"
              f"{', timed as CUDA graph replays' if s.graph else ''}", file=out)
        print(f"# libraries: {', '.join(_versions(compare, where.device))}", file=out)
        print(f"# memory: one core copying 256 MiB with NumPy moves {membw:.1f} GB/s "
              f"(read + written)", file=out)
        print("#", file=out)
        for r, (pid, host, device) in enumerate(hosts):
            print(f"#  Rank {r:2d} Pid {pid:7d} on {host} device {device}", file=out)
        out.flush()
    names = [peer.name for peer in libraries]
    several = len(names) > 1
    rows: list[Row] = []
    for op in s.ops:
        if op == "sendrecv" and comm.size == 1:
            continue
        if lead:
            print_header(out, op, names)
        op_rows: list[Row] = []
        for nbytes in sizes:
            if sizes_of(op, nbytes, s.dtype.itemsize, comm.size)[0] == 0:
                continue   # no element per rank at this size
            variants = [True] if op in _IN_PLACE_ONLY else \
                [False] if op in _OUT_OF_PLACE_ONLY else [False, True]
            measured: list[Row] = []
            for in_place in variants:
                measured += measure(comm, libraries, op, nbytes, s, in_place, where)
            op_rows += measured
            if lead:   # each size's lines as soon as it is measured
                for name in names:
                    print_size(out, name, [r for r in measured if r.library == name], several)
        rows += op_rows
        if lead:
            for name in names:
                print_footer(out, name, [r for r in op_rows if r.library == name], several)
            if compare:
                print_comparison(out, op, op_rows, names, f"anyccl ({comm.backend})")
            out.flush()
        if lead and ns.json:  # after every op: a run cut short keeps what it measured
            meta = {"ranks": comm.size, "backend": comm.backend, "memory_copy_gbs": membw,
                    "libraries": _versions(compare, where.device), "device": where.device,
                    "host": socket.gethostname(), "routes": _routes(libraries)}
            with open(ns.json, "w") as f:
                json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    wrong = sum(r.wrong or 0 for r in rows)
    if lead:
        if ns.plot:
            plot(rows, ns.plot, f"anyccl bench, {comm.size} ranks, {s.dtype.name}")
    for peer in libraries:
        peer.close()
    comm.close()
    return 1 if wrong else 0


def _routes(libraries: list[Any]) -> dict[str, Any]:
    """library name -> the routes its GPU backend ran with (the ipc backend's policies), for
    the roofline model (benchmarks/roofline/gpu_model.py) to say which algorithm ran."""
    found = {}
    for peer in libraries:
        comm = getattr(peer, "comm", None)
        routes = getattr(comm.gpu_backend, "routes", None) if comm is not None else None
        if routes is not None:
            found[peer.name] = routes.as_json()
    return found


def _versions(compare: list[str], device: str = "cpu") -> list[str]:
    import anyccl

    found = [f"anyccl {anyccl.__version__}", f"numpy {np.__version__}"]
    if device != "cpu":
        from .info import _nccl_version

        found.append(str(_nccl_version()))
    if "torch" in compare or "symm" in compare:
        import torch

        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device != "cpu" else ""
        found.append(f"torch {torch.__version__} " + (f"(nccl {nccl})" if nccl else "(gloo)"))
    if "mpi" in compare:
        import mpi4py

        from ..backends.mpi import library_version

        found.append(f"mpi4py {mpi4py.__version__} on {library_version()}")
    return found


if __name__ == "__main__":
    sys.exit(main())
