"""Arrays that are not laid out C-contiguously (a column, a transposed or channels_last
tensor, a reversed NumPy view): an operation runs on a contiguous copy, and what it writes is
copied back into the caller's array once it completes, as gloo does. Backends see only flat,
contiguous arrays.

Host arrays are copied by NumPy. torch CUDA tensors and CuPy arrays are copied by their own
framework on the caller's current stream: the operation is queued after that copy, and the
copy back is queued on the current stream once the operation is done (right after a blocking
call; at a Work's `wait()`), so later work on that stream sees the result, with no host sync.
With `stream=` (an operation ordered after another stream) they are refused instead.

An array an operation writes must have distinct elements: one whose strides make elements
share memory (NumPy's broadcast_to, torch's expand) is refused, since no write into it could
hold every rank's result.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .work import Work

Staged = list[tuple[Any, Any]]   # (the caller's array, the copy an operation ran on)


def elements_apart(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether no two elements of an array of `shape` and byte `strides` share a byte: the
    axes, smallest stride first, must each step past all that the smaller ones span. (A layout
    that interleaves axes without overlap fails this test; no framework makes one.)"""
    span = itemsize
    for stride, length in sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1):
        if stride < span:
            return False
        span += stride * (length - 1)
    return True


def _refuse_shared(name: str, shape: tuple[int, ...], strides: tuple[int, ...],
                   unit: str, example: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{name} has elements that share memory (shape {shape}, strides {strides}{unit}), so "
        f"it cannot receive a result; pass an array whose elements are distinct (for example "
        f"a copy: {example})")


def contiguous_copy(a: np.ndarray, name: str, writable: bool, staged: Staged) -> np.ndarray:
    """A C-contiguous copy of non-contiguous host array `a`; when the operation writes it
    (`writable`), the pair goes on `staged`, for `copy_back` once the operation completes."""
    if writable and not elements_apart(a.shape, a.strides, a.itemsize):
        raise _refuse_shared(name, a.shape, a.strides, "", "np.array(...), tensor.clone()")
    copy = np.ascontiguousarray(a)
    if writable:
        staged.append((a, copy))
    return copy


def gpu_contiguous_copy(x: Any, name: str, writable: bool, staged: Staged) -> Any:
    """A contiguous copy of `x`, a torch CUDA tensor or CuPy array that is not contiguous,
    made by its framework on the caller's current stream; when the operation writes it, the
    pair goes on `staged` (`copy_back` queues the copy into `x` on the current stream)."""
    if type(x).__module__.startswith("torch"):
        strides = tuple(s * x.element_size() for s in x.stride())
        if writable and not elements_apart(tuple(x.shape), strides, x.element_size()):
            raise _refuse_shared(name, tuple(x.shape), tuple(x.stride()), " elements",
                                 "tensor.clone()")
        copy = x.contiguous()
    else:
        import cupy

        if writable and not elements_apart(x.shape, x.strides, x.itemsize):
            raise _refuse_shared(name, x.shape, x.strides, " bytes", "x.copy()")
        with cupy.cuda.Device(x.device.id):
            copy = cupy.ascontiguousarray(x)
    if writable:
        staged.append((x, copy))
    return copy


def copy_back(staged: Staged) -> None:
    """Write each copy's contents into the caller's array it was made from: host arrays at
    once, GPU arrays queued on their framework's current stream."""
    for target, copy in staged:
        if isinstance(target, np.ndarray):
            np.copyto(target, copy.reshape(target.shape))
        elif type(target).__module__.startswith("torch"):
            target.copy_(copy)
        else:
            import cupy

            with cupy.cuda.Device(target.device.id):
                target[...] = copy


def check_stream(staged: Staged, stream: Any, fail: Any) -> None:
    """Refuse `stream=` for a call that staged GPU arrays (their copies are made and written
    back on the current stream, which `stream=` does not order): `fail(message)` is the
    error to raise."""
    if stream is not None and any(not isinstance(target, np.ndarray) for target, _ in staged):
        raise fail("a GPU array that is not contiguous runs on a contiguous copy made on the "
                   "current stream, which stream= does not order; pass contiguous arrays "
                   "(tensor.contiguous()) with stream=, or leave stream= out")


def settle(result: Any, staged: Staged) -> Any:
    """An operation's result once its staged copies are dealt with: a blocking operation's
    (None, or a receive's sender) after they were copied back; a Work that copies them back
    when it is seen complete."""
    if not staged:
        return result
    if isinstance(result, Work):
        return StagedWork(result, staged)
    copy_back(staged)
    return result


class StagedWork(Work):
    """The Work of an operation that ran on contiguous copies: once `wait()` returns or
    `is_completed()` is true, the caller's arrays hold the result (copied back exactly once,
    and only if the operation succeeded)."""

    __slots__ = ("_inner", "_staged", "_lock")

    def __init__(self, inner: Work, staged: Staged) -> None:
        super().__init__(inner.record, inner.rank)
        self._inner, self._staged = inner, staged
        self._lock = threading.Lock()

    def _copied_back(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
        if staged:
            copy_back(staged)
        self.source = self._inner.source

    def wait(self, timeout: float | None = None) -> bool:
        self._inner.wait(timeout)   # raises the operation's error: nothing is copied back
        self._copied_back()
        return True

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        if self._inner.exception() is None:
            self._copied_back()
        return True

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def __repr__(self) -> str:
        return repr(self._inner)
