"""Data-parallel gradient averaging: gradients in buckets, each bucket all-reduced (AVG)
asynchronously as soon as all of its gradients are ready, waited on before the optimizer step.

    avg = GradientAverager(comm, grads, bucket_mb=25)    # grads: arrays of one framework
    ...                                                  # compute this step's gradients in grads
    avg.average()                                        # every rank: the mean over the ranks

or, to overlap the reductions with the backward pass of a PyTorch module (as DDP does)::

    avg = GradientAverager.for_module(comm, model, bucket_mb=25)
    loss.backward()                                      # buckets start while backward runs
    avg.wait()                                           # p.grad hold the averages
    optimizer.step()

Works with NumPy, PyTorch (CPU and CUDA), CuPy and JAX arrays: a bucket is one flat array of
the gradients' framework and device, so one all_reduce moves many small gradients (a contiguous
gradient alone in its bucket, as a large weight's is, is reduced where it lies). Buckets are
filled from the last gradient to the first (the order backward produces them) and always start
in the same order on every rank, whatever order their gradients become ready in, so every rank
issues the same collectives. JAX arrays are immutable: `average` returns new arrays for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .communicator import Communicator
from .errors import InvalidArgumentError
from .ops import ReduceOp, dtype_kind
from .work import Work


class _Bucket:
    """Gradients reduced together: `own` is the bucket's flat buffer (made when first needed);
    `flat` what this step reduces: `own`, or a lone contiguous gradient itself (`borrowed`)."""

    __slots__ = ("members", "offsets", "own", "flat", "borrowed", "ready", "work")

    def __init__(self, members: list[int], offsets: list[int]) -> None:
        self.members, self.offsets = members, offsets
        self.own: Any = None
        self.flat: Any = None
        self.borrowed = False
        self.ready: set[int] = set()
        self.work: Work | None = None


class GradientAverager:
    """Averages a fixed list of gradient arrays over the ranks of `comm`, in buckets of about
    `bucket_mb` MiB, each reduced asynchronously once all of its gradients are marked ready."""

    def __init__(self, comm: Communicator, grads: Sequence[Any], bucket_mb: float = 25.0) -> None:
        if not grads:
            raise InvalidArgumentError("GradientAverager: grads is empty")
        if not bucket_mb > 0:
            raise InvalidArgumentError(f"GradientAverager: bucket_mb={bucket_mb!r} must be > 0")
        self.comm = comm
        self.grads = list(grads)
        self._kind = _framework(self.grads[0])
        dtype = _dtype_of(self.grads[0])
        for i, g in enumerate(self.grads):
            if _framework(g) != self._kind:
                raise InvalidArgumentError(f"GradientAverager: grads[{i}] is a {_framework(g)} "
                                           f"array, grads[0] a {self._kind} one")
            if _dtype_of(g) != dtype:
                raise InvalidArgumentError(f"GradientAverager: grads[{i}] has dtype "
                                           f"{_dtype_of(g)}, grads[0] {dtype}; one dtype a run")
        if dtype_kind(np.dtype(dtype)) not in "fc":
            raise InvalidArgumentError(f"GradientAverager: gradients of dtype {dtype} cannot be "
                                       f"averaged; use a floating dtype")
        self.buckets = self._make_buckets(bucket_mb * 2**20, np.dtype(dtype).itemsize)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.members}
        self._next_to_start = 0
        self._paused = False
        self._params: list[Any] | None = None

    # ---- set-up ------------------------------------------------------------------------------
    def _make_buckets(self, limit: float, itemsize: int) -> list[_Bucket]:
        """Buckets in the order backward fills them (it produces the last gradients first).
        Consecutive gradients share a bucket of up to `limit` bytes; a gradient larger than
        that has a bucket of its own (reduced where it lies) and leaves the open bucket of
        smaller ones open, so that a model of large weights and small biases reduces each weight
        in place and the biases together, not each bias alone. Buckets start in the order their
        last gradient arrives. Depends on the shapes alone: the same on every rank."""
        closed: list[tuple[int, list[int]]] = []   # (position of its last gradient, members)
        members: list[int] = []
        size = last = 0
        for position, i in enumerate(reversed(range(len(self.grads)))):
            n = _size(self.grads[i])
            if n * itemsize > limit:
                closed.append((position, [i]))
                continue
            if members and (size + n) * itemsize > limit:
                closed.append((last, members))
                members, size = [], 0
            members.append(i)
            size += n
            last = position
        if members:
            closed.append((last, members))
        closed.sort(key=lambda bucket: bucket[0])
        return [self._bucket(m) for _, m in closed]

    def _bucket(self, members: list[int]) -> _Bucket:
        offsets = [0]
        for i in members:
            offsets.append(offsets[-1] + _size(self.grads[i]))
        return _Bucket(members, offsets)

    @classmethod
    def for_module(cls, comm: Communicator, module: Any,
                   bucket_mb: float = 25.0) -> GradientAverager:
        """Averager over a PyTorch module's trainable parameters whose reductions start during
        backward: each parameter's gradient is marked ready by a hook as soon as it has been
        accumulated. Call `wait()` after backward; the parameters' .grad then hold the averages."""
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise InvalidArgumentError("GradientAverager.for_module: no trainable parameters")
        for p in params:
            if p.grad is None:  # the buckets need the gradients' memory from the start
                p.grad = p.detach().new_zeros(p.shape)
        averager = cls(comm, [p.grad for p in params], bucket_mb)
        averager._params = params
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: None if averager._paused else averager.ready(i))
        return averager

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients (no reduction starts), as
        DDP's no_sync: for gradient accumulation over several micro-batches."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    # ---- a step ------------------------------------------------------------------------------
    def ready(self, index: int) -> None:
        """Gradient `index` holds this step's value: copy it into its bucket and start every
        bucket that is now full, in bucket order."""
        if self._params is not None:
            self.grads[index] = self._params[index].grad  # the hook's tensor is the live one
        bucket = self.buckets[self._bucket_of[index]]
        if index in bucket.ready:
            raise InvalidArgumentError(f"GradientAverager: gradient {index} was marked ready "
                                       f"twice in one step")
        if self._kind != "jax":
            g = self.grads[index]
            bucket.borrowed = len(bucket.members) == 1 and _contiguous(g, self._kind)
            if bucket.borrowed:   # a gradient alone in its bucket is reduced where it lies
                bucket.flat = g.detach().view(-1) if self._kind == "torch" else g.reshape(-1)
            else:
                if bucket.own is None:
                    bucket.own = _empty_like(g, bucket.offsets[-1])
                bucket.flat = bucket.own
                _copy_in(bucket.flat, bucket.offsets[bucket.members.index(index)], g)
        bucket.ready.add(index)
        while self._next_to_start < len(self.buckets):
            nxt = self.buckets[self._next_to_start]
            if len(nxt.ready) < len(nxt.members):
                break
            if self._kind == "jax":
                nxt.flat = _jax_bucket([self.grads[i] for i in nxt.members])
            nxt.work = self.comm.all_reduce(nxt.flat, ReduceOp.AVG, async_op=True)
            self._next_to_start += 1

    def wait(self) -> list[Any]:
        """Wait for every bucket and write the averages back into the gradients; return them
        (new arrays for JAX). Every gradient must have been marked ready this step."""
        missing = [i for b in self.buckets for i in b.members if i not in b.ready]
        if missing:
            raise InvalidArgumentError(f"GradientAverager.wait: gradients {missing[:8]} were not "
                                       f"marked ready this step")
        out = list(self.grads)
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            if not bucket.borrowed:
                for k, i in enumerate(bucket.members):
                    out[i] = _copy_out(self.grads[i], bucket.flat, bucket.offsets[k])
            bucket.ready.clear()
            bucket.work = bucket.flat = None
            bucket.borrowed = False
        self._next_to_start = 0
        if self._kind == "jax":
            self.grads = out
        if self._params is not None:
            for p, g in zip(self._params, out):
                if p.grad is not g:
                    p.grad = g
        return out

    def average(self, grads: Sequence[Any] | None = None) -> list[Any]:
        """Average `grads` (default: the arrays given at construction), all ready now."""
        if grads is not None:
            if len(grads) != len(self.grads):
                raise InvalidArgumentError(f"GradientAverager.average: {len(grads)} arrays, "
                                           f"expected {len(self.grads)}")
            self.grads = list(grads)
        for i in reversed(range(len(self.grads))):
            self.ready(i)
        return self.wait()


# ---- the few framework operations a bucket needs -------------------------------------------------
def _framework(x: Any) -> str:
    module = type(x).__module__
    for name in ("torch", "cupy", "jax"):
        if module.startswith(name) or (name == "jax" and module.startswith("jaxlib")):
            return name
    if isinstance(x, np.ndarray):
        return "numpy"
    raise InvalidArgumentError(f"GradientAverager: {type(x).__name__} is not a NumPy, PyTorch, "
                               f"CuPy or JAX array")


def _dtype_of(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _size(x: Any) -> int:
    return int(x.numel()) if hasattr(x, "numel") and callable(x.numel) else int(x.size)


def _empty_like(x: Any, n: int) -> Any:
    kind = _framework(x)
    if kind == "torch":
        return x.new_zeros(n)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(x.device.id):
            return cupy.zeros(n, x.dtype)
    if kind == "jax":
        return None  # made when the bucket starts: see _jax_bucket
    return np.zeros(n, x.dtype)


def _contiguous(g: Any, kind: str) -> bool:
    """Whether a flat view of mutable `g` (a `kind` array, not JAX) shares its memory (then
    it can be reduced in place)."""
    if kind == "torch":
        return bool(g.is_contiguous())
    return bool(g.flags.c_contiguous) and (kind != "numpy" or g.flags.writeable)


def _copy_in(flat: Any, offset: int, g: Any) -> None:
    n = _size(g)
    if _framework(flat) == "torch":
        flat[offset:offset + n].copy_(g.detach().reshape(-1))
    else:
        flat[offset:offset + n] = g.reshape(-1)


def _jax_bucket(grads: list[Any]) -> Any:
    """JAX arrays are immutable: a bucket is a new flat array made when it starts (on the GPU a
    JAX array anyccl owns and reduces in place; on the CPU a NumPy copy)."""
    import jax
    import jax.numpy as jnp

    flat = jnp.concatenate([jnp.ravel(g) for g in grads])
    if all(d.platform == "cpu" for d in flat.devices()):
        return np.array(jax.device_get(flat))
    return flat


def _copy_out(g: Any, flat: Any, offset: int) -> Any:
    n = _size(g)
    kind = _framework(g)
    if kind == "torch":
        g.copy_(flat[offset:offset + n].view(g.shape))
        return g
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(flat[offset:offset + n]).reshape(g.shape)
    g[...] = flat[offset:offset + n].reshape(g.shape)
    return g
