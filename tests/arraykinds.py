"""The kinds of array every collective is checked over (as mpi4py's test/arrayimpl.py): each
shows a NumPy array's memory as that kind, so a check writes its expectations in NumPy and
calls anyccl with the kind under test."""

from __future__ import annotations

from typing import Any

import numpy as np

from anyccl.buffers import BFLOAT16

KINDS = ("numpy", "torch", "dlpack")


class DLPackOnly:
    """An array known only through DLPack (`__dlpack__`, `__dlpack_device__`), as a library
    with its own array type hands one over."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


def _torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype == BFLOAT16:   # NumPy's bfloat16 (ml_dtypes), reinterpreted
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def as_kind(kind: str, a: Any) -> Any:
    """`a` (a NumPy array, a list of them, or None) as `kind`, sharing its memory."""
    if a is None or kind == "numpy":
        return a
    if isinstance(a, list):
        return [as_kind(kind, piece) for piece in a]
    if kind == "torch":
        return _torch(a)
    if kind == "dlpack":   # bfloat16 travels from torch: NumPy cannot export it over DLPack
        return DLPackOnly(_torch(a) if a.dtype == BFLOAT16 else a)
    raise ValueError(kind)
