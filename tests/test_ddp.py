"""anyccl.ddp.GradientAverager: buckets of gradients averaged asynchronously, in the same order
on every rank whatever order gradients become ready in; PyTorch's hook mode during backward."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

import anyccl
from anyccl.ddp import GradientAverager

SHAPES = [(3, 4), (7,), (2, 2, 2), (100,), (1,), (33, 3)]


def local_grads(rank: int, dtype=np.float32) -> list[np.ndarray]:
    return [(rank + 0.001 * np.arange(int(np.prod(s)))).astype(dtype).reshape(s) for s in SHAPES]


def check_numpy_buckets(comm, order_seed):
    grads = local_grads(comm.rank)
    avg = GradientAverager(comm, grads, bucket_mb=400 / 2**20)  # ~400 B: several buckets
    for step in range(3):
        for g, fresh in zip(grads, local_grads(comm.rank)):
            g[...] = fresh * (step + 1)
        order = np.random.default_rng(order_seed + comm.rank + step).permutation(len(grads))
        for i in order:                                  # every rank: its own order
            avg.ready(int(i))
        out = avg.wait()
        assert all(o is g for o, g in zip(out, grads))  # NumPy: averaged in place
        for g, s in zip(grads, SHAPES):
            n = int(np.prod(s))
            expected = ((comm.size - 1) / 2 + 0.001 * np.arange(n)) * (step + 1)
            np.testing.assert_allclose(g.reshape(-1), expected, rtol=1e-5)
    return len(avg.buckets)


@pytest.mark.parametrize("world", (1, 2, 4))
def test_buckets_average_in_place_whatever_order_gradients_become_ready(world):
    buckets = run_ranks(check_numpy_buckets, world, 7)
    assert buckets[0] >= 3 and len(set(buckets)) == 1


def check_torch_hooks(comm):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)                                 # the same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    avg = GradientAverager.for_module(comm, model, bucket_mb=0.0005)

    def data(r):
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)

    # reference: the mean over ranks of each rank's gradient, computed here for every rank
    reference = [torch.zeros_like(p) for p in model.parameters()]
    with avg.no_sync():                                  # backward without reductions
        for r in range(comm.size):
            model.zero_grad(set_to_none=False)
            x, y = data(r)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for ref, p in zip(reference, model.parameters()):
                ref += p.grad / comm.size
    model.zero_grad(set_to_none=False)
    x, y = data(comm.rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()   # buckets start in backward
    avg.wait()
    for ref, p in zip(reference, model.parameters()):
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6)
    return len(avg.buckets)


@pytest.mark.parametrize("world", (2, 3))
def test_torch_hook_mode_averages_during_backward(world):
    pytest.importorskip("torch")
    assert min(run_ranks(check_torch_hooks, world)) >= 2


def check_refusals(comm):
    with pytest.raises(anyccl.InvalidArgumentError, match="empty"):
        GradientAverager(comm, [])
    with pytest.raises(anyccl.InvalidArgumentError, match="one dtype"):
        GradientAverager(comm, [np.zeros(2, np.float32), np.zeros(2, np.float64)])
    with pytest.raises(anyccl.InvalidArgumentError, match="floating dtype"):
        GradientAverager(comm, [np.zeros(2, np.int32)])
    avg = GradientAverager(comm, [np.ones(3, np.float32)])
    avg.ready(0)
    with pytest.raises(anyccl.InvalidArgumentError, match="twice"):
        avg.ready(0)
    avg.wait()
    with pytest.raises(anyccl.InvalidArgumentError, match="not marked ready"):
        avg.wait()
    return True


def test_bad_use_is_refused_by_name():
    assert all(run_ranks(check_refusals, 2))


def check_lone_gradients(comm):
    """A gradient alone in its bucket is reduced where it lies when contiguous; a strided one
    (here a transposed view) goes through the bucket's own buffer; both end up averaged, in the
    arrays given, step after step."""
    strided = np.zeros((64, 32), np.float64).T        # not C-contiguous
    plain = np.zeros(2048, np.float64)
    avg = GradientAverager(comm, [strided, plain], bucket_mb=8192 / 2**20)   # one each
    assert [len(b.members) for b in avg.buckets] == [1, 1]
    for step in range(3):
        strided[...] = comm.rank + step + np.arange(strided.size).reshape(strided.shape)
        plain[...] = 10.0 * comm.rank + step
        out = avg.average()
        assert out[0] is strided and out[1] is plain
        mean = (comm.size - 1) / 2
        np.testing.assert_array_equal(
            strided, mean + step + np.arange(strided.size).reshape(strided.shape))
        np.testing.assert_array_equal(plain, 10.0 * mean + step)
    return {b.members[0]: b.own is not None for b in avg.buckets}   # gradient: has a buffer


def test_a_lone_contiguous_gradient_is_averaged_in_place_and_a_strided_one_through_a_buffer():
    for owns in run_ranks(check_lone_gradients, 2):
        assert owns == {0: True, 1: False}   # a buffer only where a copy is needed


def check_large_and_small_gradients(comm):
    """Gradients larger than the bucket each have a bucket of their own, reduced where they lie
    and started as soon as they are ready; the small ones between them share one bucket, which
    starts when its last gradient arrives."""
    sizes = [3, 5000, 4, 6000, 5]          # float32: 20 KB and 24 KB against an 8 KB bucket
    grads = [np.zeros(n, np.float32) for n in sizes]
    avg = GradientAverager(comm, grads, bucket_mb=8192 / 2**20)
    layout = [b.members for b in avg.buckets]
    started = []
    for step in range(2):
        for i, g in enumerate(grads):
            g[...] = comm.rank * (i + 1) + step
        for i in reversed(range(len(grads))):   # backward's order
            avg.ready(i)
            started.append([b.work is not None for b in avg.buckets])
        out = avg.wait()
        assert all(o is g for o, g in zip(out, grads))
        mean = (comm.size - 1) / 2
        for i, g in enumerate(grads):
            np.testing.assert_array_equal(g, mean * (i + 1) + step)
    return layout, started[:5], [b.own is None for b in avg.buckets]


def test_large_gradients_have_buckets_of_their_own_and_small_ones_share_one():
    for layout, started, in_place in run_ranks(check_large_and_small_gradients, 2):
        assert layout == [[3], [1], [4, 2, 0]]
        # ready 4, 3, 2, 1, 0: gradient 3's bucket starts at once, 1's likewise, the small
        # ones' when 0 arrives
        assert started == [[False, False, False], [True, False, False],
                           [True, False, False], [True, True, False], [True, True, True]]
        assert in_place == [True, True, False]
