"""`anyccl viz`: pictures of what a collective does, made by running it.

    anyccl viz all_reduce -n 4 [--op max] [--root 0] [--out DIR] [--gif]

Every rank starts with a small image of its own (a disk or a square, placed and shaded by rank);
the collective runs on those arrays through anyccl, on N real ranks; rank 0 gathers what each
rank held before and after and draws one row per rank, before on the left, after on the right,
with the arrays a rank sends or receives in pieces drawn side by side, and an arrow for every
rank-to-rank movement of data (found by running the collective once more on markers worth
2**rank: the bits of each result name the ranks it came from). `--gif` also writes an animation
that alternates the two states. Nothing is drawn from a script of what should happen.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import numpy as np

from .. import settings
from .._optional import missing
from ..ops import COLLECTIVES, ReduceOp

SIDE = 16  # pixels per image side
OPS = tuple(name for name in COLLECTIVES if name != "barrier")


def image(rank: int, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s picture: a disk (even ranks) or a square (odd), placed and valued by rank."""
    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    cx, cy = 4 + (3 * rank + salt) % 8, 4 + (5 * rank + 2 * salt) % 8
    if (rank + salt) % 2 == 0:
        shape = (xx - cx) ** 2 + (yy - cy) ** 2 <= 12
    else:
        shape = (abs(xx - cx) <= 3) & (abs(yy - cy) <= 3)
    return (shape * float(rank + 1 + salt)).astype(np.float32)


def run_collective(comm: Any, op: str, redop: ReduceOp = ReduceOp.SUM,
                   root: int = 0, device: str = "cpu",
                   picture: Callable[..., np.ndarray] = image
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run `op` on this rank's images (made by `picture(rank, salt)`), held in host memory
    (device="cpu") or as CuPy arrays on this rank's GPU (device="cuda"); return (before, after)
    as lists of host images (one, or one per rank for the arrays that hold a piece per rank)."""
    r, n = comm.rank, comm.size
    if device == "cuda":
        import cupy

        cupy.cuda.Device(comm.device if comm.device is not None
                         else comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        put, get = cupy.asarray, cupy.asnumpy
    else:
        put, get = (lambda a: a), (lambda a: a)

    def blank() -> Any:
        return put(np.zeros((SIDE, SIDE), np.float32))

    if op in ("all_reduce", "reduce", "broadcast"):
        before = [picture(r)]
        x = put(before[0].copy())
        if op == "all_reduce":
            comm.all_reduce(x, redop)
        elif op == "reduce":
            comm.reduce(x, root, redop)
        else:
            comm.broadcast(x, root)
        return before, [get(x)]
    if op in ("all_gather", "gather"):
        x = put(picture(r))
        outs = [blank() for _ in range(n)]
        if op == "all_gather":
            comm.all_gather(outs, x)
            return [picture(r)], [get(o) for o in outs]
        comm.gather(x, outs if r == root else None, root)
        # a rank other than the root receives nothing: it keeps its own image
        return [picture(r)], [get(o) for o in outs] if r == root else [get(x)]
    if op == "scatter":
        chunks = [picture(r, salt=j + 1) for j in range(n)] if r == root else None
        out = blank()
        before = [c.copy() for c in chunks] if chunks else [np.zeros((SIDE, SIDE), np.float32)]
        comm.scatter(out, [put(c) for c in chunks] if chunks else None, root)
        return before, [get(out)]
    if op == "reduce_scatter":
        pieces = [picture(r, salt=j) for j in range(n)]
        out = blank()
        comm.reduce_scatter(out, [put(p) for p in pieces], redop)
        return pieces, [get(out)]
    if op == "all_to_all":
        pieces = [picture(r, salt=j) for j in range(n)]
        outs = [blank() for _ in range(n)]
        comm.all_to_all(outs, [put(p) for p in pieces])
        return pieces, [get(o) for o in outs]
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


def marker(rank: int, salt: int = 0) -> np.ndarray:
    """A uniform picture worth 2**rank: sums of markers name every rank that contributed."""
    return np.full((SIDE, SIDE), 2.0 ** rank, np.float32)


def trace_moves(comm: Any, op: str, root: int = 0) -> list[tuple[int, int]]:
    """(from rank, to rank) for every piece of data `op` moves between two ranks, found by
    running it (summing, for reductions) on markers worth 2**rank and reading which ranks' bits
    each result holds. Collective; the same list on every rank."""
    if comm.size > 23:  # float32 holds the sum of 24 distinct powers of two exactly
        return []
    _, after = run_collective(comm, op, ReduceOp.SUM, root, picture=marker)
    sources = set()
    for piece in after:
        bits = int(round(float(piece.flat[0])))
        sources |= {q for q in range(comm.size) if bits >> q & 1 and q != comm.rank}
    found = comm.all_gather_object(sorted(sources))
    return [(q, r) for r, qs in enumerate(found) for q in qs]


def describe(op: str, redop: ReduceOp, root: int) -> str:
    how = redop.name.lower()
    return {
        "all_reduce": f"every rank gets the element-wise {how} of all images",
        "reduce": f"rank {root} gets the {how} of all images; the others keep theirs",
        "broadcast": f"every rank gets rank {root}'s image",
        "all_gather": "every rank gets every rank's image, in rank order",
        "gather": f"rank {root} gets every rank's image, in rank order; the others keep theirs",
        "scatter": f"rank {root}'s i-th image goes to rank i",
        "reduce_scatter": f"rank i gets the {how} of every rank's i-th image",
        "all_to_all": "rank i's j-th image goes to rank j, as its i-th",
    }[op]


def _strip(images: list[np.ndarray]) -> np.ndarray:
    """Images side by side with a one-pixel transparent gap."""
    gap = np.full((SIDE, 1), np.nan, np.float32)
    parts = []
    for img in images:
        parts += [img, gap]
    return np.concatenate(parts[:-1], axis=1)


def _scale(states: list[tuple[list[np.ndarray], list[np.ndarray]]]) -> float:
    return max(float(np.max(np.abs(img))) for before, after in states
               for img in (*before, *after)) or 1.0


def _fit_title(fig: Any, title: str, fontsize: float) -> Any:
    """The figure's title, wrapped onto as many lines as it takes to lie inside the figure."""
    import textwrap

    width_pt = fig.get_figwidth() * 72 * 0.92
    chars = max(16, int(width_pt / (0.6 * fontsize)))  # a generous average glyph width
    return fig.suptitle(textwrap.fill(title, chars, break_on_hyphens=False), fontsize=fontsize)


def figure(states: list[tuple[list[np.ndarray], list[np.ndarray]]], title: str,
           moves: list[tuple[int, int]] = ()) -> Any:
    """The picture of one collective: one row per rank, before | after, with an arrow from
    rank q's before to rank r's after for each (q, r) in `moves`; the title wrapped to fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import ConnectionPatch

    n, vmax = len(states), _scale(states)
    width = max(len(b) + len(a) for b, a in states)
    fig, axes = plt.subplots(n, 2, figsize=(2.5 + 1.1 * width, 1.3 * n + 1.1), squeeze=False)
    for r, (before, after) in enumerate(states):
        for c, (images, label) in enumerate(((before, "before"), (after, "after"))):
            ax = axes[r][c]
            ax.imshow(_strip(images), vmin=0, vmax=vmax, cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(label)
            if c == 0:
                ax.set_ylabel(f"rank {r}")
    _fit_title(fig, title, fontsize=10)
    fig.tight_layout()
    fig.subplots_adjust(wspace=0.5)
    colors = plt.get_cmap("tab10")
    for q, r in moves:  # data leaving rank q (its colour) for rank r
        fig.add_artist(ConnectionPatch(
            xyA=(1.02, 0.5), coordsA=axes[q][0].transAxes, xyB=(-0.02, 0.5),
            coordsB=axes[r][1].transAxes, arrowstyle="-|>", color=colors(q % 10), lw=1.2,
            alpha=0.8))
    return fig


def draw(states: list[tuple[list[np.ndarray], list[np.ndarray]]], op: str, title: str,
         path: str, gif: bool = False, moves: list[tuple[int, int]] = ()) -> list[str]:
    """Writes `figure(states, title, moves)` to `path` (PNG) and, with gif, an animation of
    the two states to path.gif; returns the paths written."""
    import matplotlib.pyplot as plt

    fig = figure(states, title, moves)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    written = [path]
    if gif:
        from matplotlib.animation import FuncAnimation, PillowWriter

        n, vmax = len(states), _scale(states)
        width = max(len(b) + len(a) for b, a in states)
        fig2, axes2 = plt.subplots(n, 1, figsize=(1.5 + 1.1 * width, 1.3 * n + 0.9),
                                   squeeze=False)
        shown = [axes2[r][0].imshow(_strip(states[r][0]), vmin=0, vmax=vmax, cmap="viridis")
                 for r in range(n)]
        for r in range(n):
            axes2[r][0].set_xticks([])
            axes2[r][0].set_yticks([])
            axes2[r][0].set_ylabel(f"rank {r}")

        def frame(k: int) -> list[Any]:
            for r in range(n):
                shown[r].set_data(_strip(states[r][k % 2]))
            fig2.suptitle(f"{op}: {'before' if k % 2 == 0 else 'after'}", fontsize=10)
            return shown

        gif_path = os.path.splitext(path)[0] + ".gif"
        FuncAnimation(fig2, frame, frames=4, interval=900).save(gif_path,
                                                                writer=PillowWriter(fps=1))
        plt.close(fig2)
        written.append(gif_path)
    return written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="anyccl viz", description=__doc__.split("\n\n")[0])
    p.add_argument("collective", help="|".join(OPS) + "|all")
    p.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--op", default="sum", help="reduce op for reducing collectives")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--out", default=".", help="folder for the pictures (default .)")
    p.add_argument("--gif", action="store_true", help="also write an animated GIF")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = parse_args(argv)
    ops = list(OPS) if ns.collective == "all" else [ns.collective]
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"anyccl viz: {op!r} is not a collective; expected one of "
                             f"{', '.join(OPS)} or all")
    redop = ReduceOp.parse(ns.op)
    if not 0 <= ns.root < ns.nprocs:
        raise SystemExit(f"anyccl viz: --root {ns.root} must be below -n {ns.nprocs}")
    problem = missing("matplotlib", extra="plot", feature="anyccl viz")
    if problem:  # said once, before any rank starts
        print(problem, file=sys.stderr)
        return 2
    if not settings.STORE.is_set() and not os.environ.get("RANK"):
        from ..launch import run

        return run(ns.nprocs, "anyccl.tools.viz", argv, module=True)
    import anyccl

    comm = anyccl.init()
    os.makedirs(ns.out, exist_ok=True)
    for op in ops:
        states = comm.all_gather_object(run_collective(comm, op, redop, ns.root))
        moves = trace_moves(comm, op, ns.root)
        if comm.rank == 0:
            title = f"{op} on {comm.size} ranks: {describe(op, redop, ns.root)}"
            for path in draw(states, op, title, os.path.join(ns.out, f"{op}.png"), ns.gif,
                             moves):
                print(f"wrote {path}", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
