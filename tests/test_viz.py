"""`anyccl viz` pictures come from running the collective: the states it draws are the arrays
each rank held before and after, equal to what every rank's images must give."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

from anyccl import ReduceOp
from anyccl.tools.viz import OPS, describe, figure, image, run_collective, trace_moves


def states(comm, op, redop_name):
    return run_collective(comm, op, ReduceOp.parse(redop_name), root=comm.size - 1)


@pytest.mark.parametrize("op", OPS)
def test_viz_states_are_the_collectives_real_results(op):
    n = 3
    got = run_ranks(states, n, op, "max")
    everyone = [image(j) for j in range(n)]
    root = n - 1
    for r, (before, after) in enumerate(got):
        if op == "all_reduce":
            assert np.array_equal(after[0], np.maximum.reduce(everyone))
        elif op == "reduce":
            want = np.maximum.reduce(everyone) if r == root else everyone[r]
            assert np.array_equal(after[0], want)
        elif op == "broadcast":
            assert np.array_equal(after[0], everyone[root])
        elif op == "all_gather" or (op == "gather" and r == root):
            assert all(np.array_equal(a, e) for a, e in zip(after, everyone))
        elif op == "gather":   # the others receive nothing and keep their image
            assert len(after) == 1 and np.array_equal(after[0], everyone[r])
        elif op == "scatter":
            assert np.array_equal(after[0], image(root, salt=r + 1))
        elif op == "reduce_scatter":
            assert np.array_equal(after[0], np.maximum.reduce([image(j, salt=r)
                                                               for j in range(n)]))
        elif op == "all_to_all":
            assert all(np.array_equal(after[j], image(j, salt=r)) for j in range(n))
        # what is drawn on the left is what the rank started with
        if op in ("scatter",):
            started = ([image(root, salt=j + 1) for j in range(n)] if r == root
                       else [np.zeros_like(image(r))])
        elif op in ("reduce_scatter", "all_to_all"):
            started = [image(r, salt=j) for j in range(n)]
        else:
            started = [image(r)]
        assert len(before) == len(started)
        assert all(np.array_equal(b, s) for b, s in zip(before, started))


def moves(comm, op):
    return trace_moves(comm, op, root=1)


@pytest.mark.parametrize("op", OPS)
def test_viz_arrows_are_the_moves_the_collective_really_made(op):
    n, root = 3, 1
    everyone = {(q, r) for q in range(n) for r in range(n) if q != r}
    expected = {
        "reduce": {(q, root) for q in range(n) if q != root},
        "gather": {(q, root) for q in range(n) if q != root},
        "broadcast": {(root, r) for r in range(n) if r != root},
        "scatter": {(root, r) for r in range(n) if r != root},
    }.get(op, everyone)
    found = run_ranks(moves, n, op)
    assert all(f == found[0] for f in found)
    assert set(map(tuple, found[0])) == expected


def _inside(fig, artist) -> bool:
    box = artist.get_window_extent(fig.canvas.get_renderer())
    return 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_viz_titles_and_labels_lie_inside_the_picture(op, n):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    got = run_ranks(states, n, op, "sum")
    title = f"{op} on {n} ranks: {describe(op, ReduceOp.SUM, n - 1)}"
    fig = figure(got, title)
    try:
        texts = [fig._suptitle] + [t for ax in fig.axes for t in (ax.title, ax.yaxis.label)
                                   if t.get_text()]
        outside = [t.get_text() for t in texts if not _inside(fig, t)]
        assert not outside, f"cut off at the figure's edge: {outside}"
        assert fig._suptitle.get_text().replace("\n", " ") == title
    finally:
        plt.close(fig)
