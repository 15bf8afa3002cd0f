"""Views of users' arrays as NumPy arrays over the same memory, without copying.

Accepted: NumPy arrays, PyTorch CPU tensors (bfloat16 included), and any object NumPy can view
through the buffer protocol or ``__array_interface__``. The adapters check what a collective must
know before a byte moves (contiguity, writability, dtype) and name the argument when they refuse.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError, UnsupportedError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, BFLOAT16, np.float32, np.float64, np.complex64, np.complex128,
))
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _torch_module() -> Any:
    # Only look at torch if the user already imported it: anyccl never imports torch itself.
    return sys.modules.get("torch")


def _torch_to_numpy(t: Any, name: str) -> np.ndarray:
    torch = _torch_module()
    if t.device.type != "cpu":
        raise UnsupportedError(
            f"{name} is a torch tensor on {t.device}; this communicator's backend serves CPU "
            f"arrays only (GPU arrays need the nccl or ipc backend)")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedError(f"{name} has layout {t.layout}; only dense (strided) tensors")
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(
            f"{name} is a lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first")
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            f"pass tensor.contiguous() and copy the result back if you need it in place")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    try:
        return t.numpy()
    except TypeError as exc:
        raise UnsupportedError(f"{name} has dtype {t.dtype}, which anyccl does not support") \
            from exc


def as_numpy(x: Any, name: str, *, writable: bool) -> np.ndarray:
    """Return a contiguous NumPy array sharing memory with `x`.

    Raises InvalidArgumentError for non-contiguous arrays and for read-only arrays when `writable`,
    UnsupportedError for unsupported types and dtypes. Never copies: what a collective writes into
    the returned array lands in `x`.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif type(x).__module__.startswith("torch") and _torch_module() is not None \
            and isinstance(x, _torch_module().Tensor):
        arr = _torch_to_numpy(x, name)
    elif x is None:
        raise InvalidArgumentError(f"{name} is None; expected an array")
    elif isinstance(x, (int, float, complex, bool, list, tuple)):
        raise InvalidArgumentError(
            f"{name} is a Python {type(x).__name__}; expected an array (a collective writes its "
            f"result in place, so wrap values in a NumPy array or a tensor)")
    else:
        if hasattr(x, "__cuda_array_interface__"):
            raise UnsupportedError(
                f"{name} is a GPU array ({type(x).__name__}); this communicator's backend serves "
                f"CPU arrays only")
        try:
            arr = np.asarray(x)
        except Exception as exc:  # numpy raises many types for objects it cannot view
            raise UnsupportedError(f"{name} of type {type(x).__name__} is not an array") from exc
        if arr.dtype == object:
            raise UnsupportedError(f"{name} of type {type(x).__name__} is not an array")
        if writable and arr.base is None:  # NumPy had to build a new array: writes would be lost
            raise InvalidArgumentError(
                f"{name} of type {type(x).__name__} cannot be written in place; pass a NumPy "
                f"array or a tensor")
    if arr.dtype not in _SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"{name} has dtype {arr.dtype}; supported: {names}")
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{name} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); pass "
            f"np.ascontiguousarray(...) and copy the result back if you need it in place")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(f"{name} is read-only but receives the result; pass a writable "
                                   f"array")
    return arr
