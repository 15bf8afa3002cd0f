"""The kinds of array every collective is checked over (as mpi4py's test/arrayimpl.py): each
shows a NumPy array's memory as that kind, so a check writes its expectations in NumPy and
calls anyccl with the kind under test.

"fakegpu" is a GPU array of the simulated device (tests/fake_gpu.py: host memory behind
`__cuda_array_interface__`, streams that really run later), served by the fake GPU backend
(tests/test_gpu_dispatch.py, set up by `FAKE_GPU`'s environment); a check on it reads results
once the work it queued has landed (`for_kind`). `__cuda_array_interface__` has no bfloat16
(its typestr would be raw bytes), so that kind skips that dtype, as CuPy arrays must."""

from __future__ import annotations

from typing import Any

import numpy as np

from anyccl.buffers import BFLOAT16

KINDS = ("numpy", "torch", "dlpack", "fakegpu")
# the environment of ranks that serve "fakegpu" arrays (the shm backend carries their bytes)
FAKE_GPU = {"ANYCCL_TEST_SETUP": "test_gpu_dispatch:setup", "ANYCCL_BACKEND": "cpu:shm,cuda:fake"}


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
    if kind == "fakegpu":
        from fake_gpu import FakeGpuArray

        return FakeGpuArray(a)
    raise ValueError(kind)


def has_dtype(kind: str, dtype: np.dtype) -> bool:
    """Whether arrays of `kind` can hold `dtype` (see the module's docstring)."""
    return not (kind == "fakegpu" and dtype == BFLOAT16)


class _Landed:
    """A communicator whose every call returns once the GPU work it queued has landed."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def landed(*args: Any, **kwargs: Any) -> Any:
            from anyccl import gpu

            result = attr(*args, **kwargs)
            gpu.synchronize_stream(0)
            return result
        return landed


def for_kind(kind: str, comm: Any) -> Any:
    """`comm` as a check of `kind` uses it: for GPU arrays, each call waits for its result."""
    return _Landed(comm) if kind == "fakegpu" else comm
