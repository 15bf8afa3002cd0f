"""Host arrays that are not laid out C-contiguously (a column, a transposed or channels_last
tensor, a reversed NumPy view): an operation runs on a contiguous copy, and what it writes is
copied back into the caller's array once it completes, as gloo does. Backends see only flat,
contiguous arrays.

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

Staged = list[tuple[np.ndarray, np.ndarray]]   # (the caller's array, the copy an operation ran on)


def elements_apart(a: np.ndarray) -> bool:
    """Whether no two elements of `a` share a byte, judged from shape and strides alone: the
    axes, smallest stride first, must each step past all that the smaller ones span. (A layout
    that interleaves axes without overlap fails this test; no framework makes one.)"""
    span = a.itemsize
    for stride, length in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            return False
        span += stride * (length - 1)
    return True


def contiguous_copy(a: np.ndarray, name: str, writable: bool, staged: Staged) -> np.ndarray:
    """A C-contiguous copy of non-contiguous `a`; when the operation writes it (`writable`),
    the pair goes on `staged`, for `copy_back` once the operation completes."""
    if writable and not elements_apart(a):
        raise InvalidArgumentError(
            f"{name} has elements that share memory (shape {a.shape}, strides {a.strides}), "
            f"so it cannot receive a result; pass an array whose elements are distinct (for "
            f"example a copy: np.array(...), tensor.clone())")
    copy = np.ascontiguousarray(a)
    if writable:
        staged.append((a, copy))
    return copy


def copy_back(staged: Staged) -> None:
    """Write each copy's contents into the caller's array it was made from."""
    for target, copy in staged:
        np.copyto(target, copy.reshape(target.shape))


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
