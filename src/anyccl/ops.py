"""Reduce operations, the host reduction kernels, and the table of per-collective facts.

The table (`COLLECTIVES`) is the one place that says which collectives take a root, which reduce,
and how nccl-tests converts algorithm bandwidth to bus bandwidth; the communicator, the bench and
the tests all read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import UnsupportedError


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' values, element by element.

    ``SUM``, ``PROD``, ``MIN``, ``MAX`` and ``AVG`` (the mean over the ranks; floating and complex
    only) work on every numeric dtype, with ``MIN``/``MAX`` excluding complex. ``BAND``, ``BOR``
    and ``BXOR`` are bitwise and take integer and bool arrays only. On bool arrays ``SUM`` and
    ``MAX`` are logical or, ``PROD`` and ``MIN`` logical and. Integer arithmetic wraps as NumPy's.
    """

    SUM = "sum"
    PROD = "prod"
    PRODUCT = "prod"   # torch.distributed's name of PROD (the same member)
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ReduceOp, its name or value in any case ("sum", "SUM"), or torch's ReduceOp."""
        if isinstance(op, ReduceOp):
            return op
        name = getattr(op, "name", op)  # torch.distributed.ReduceOp.SUM has .name == "SUM"
        if isinstance(name, str):
            key = name.strip().upper()
            if key in cls.__members__:
                return cls[key]
        choices = ", ".join(member.name for member in cls)   # PRODUCT is PROD
        raise UnsupportedError(f"op={op!r} is not a reduce op; expected one of {choices}")


# Members are singletons compared by identity, so identity is their hash too: the C slot, where
# Enum's own __hash__ (hash of the name) is a Python call on every dict look-up of a hot path.
ReduceOp.__hash__ = object.__hash__  # type: ignore[method-assign]

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}


def dtype_kind(dtype: np.dtype) -> str:
    """'b' bool, 'i' signed, 'u' unsigned, 'f' floating (bfloat16 included), 'c' complex."""
    if dtype.kind == "V" and dtype.name == "bfloat16":  # ml_dtypes reports kind 'V'
        return "f"
    return dtype.kind


def check_reduce_op(op: ReduceOp, dtype: np.dtype) -> None:
    """Raise UnsupportedError if `op` is not defined on `dtype`, naming both."""
    kind = dtype_kind(dtype)
    if op in _BITWISE and kind not in "biu":
        raise UnsupportedError(f"op=ReduceOp.{op.name} is bitwise and takes integer or bool arrays;"
                               f" got dtype {dtype.name}")
    if op is ReduceOp.AVG and kind not in "fc":
        raise UnsupportedError(f"op=ReduceOp.AVG needs a floating or complex dtype, got "
                               f"{dtype.name}: integer averages would truncate; reduce with SUM "
                               f"and divide, or cast to float first")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise UnsupportedError(f"op=ReduceOp.{op.name} is undefined on complex dtype {dtype.name}")


def accumulate(acc: np.ndarray, other: np.ndarray, op: ReduceOp) -> None:
    """acc = acc (op) other, in place. AVG accumulates as SUM; call `finish` once at the end."""
    _UFUNCS[op](acc, other, out=acc)


def combine(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """out = a (op) b, reading both inputs once; `out` may alias `a`."""
    _UFUNCS[op](a, b, out=out)


def finish(acc: np.ndarray, op: ReduceOp, world_size: int) -> None:
    """Apply what remains after all inputs are combined: the division of AVG."""
    if op is ReduceOp.AVG and world_size > 1:
        np.divide(acc, world_size, out=acc, casting="unsafe")


@dataclass(frozen=True)
class CollectiveSpec:
    """Facts about one collective that every layer agrees on."""

    name: str
    takes_root: bool
    reduces: bool
    bus_factor: Callable[[int], float]  # nccl-tests PERFORMANCE.md: busbw = algbw * factor(n)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 1.0


COLLECTIVES: dict[str, CollectiveSpec] = {spec.name: spec for spec in (
    CollectiveSpec("all_reduce", False, True, lambda n: 2 * _ring(n)),
    CollectiveSpec("reduce", True, True, lambda n: 1.0),
    CollectiveSpec("broadcast", True, False, lambda n: 1.0),
    CollectiveSpec("all_gather", False, False, _ring),
    CollectiveSpec("gather", True, False, _ring),
    CollectiveSpec("scatter", True, False, _ring),
    CollectiveSpec("reduce_scatter", False, True, _ring),
    CollectiveSpec("all_to_all", False, False, _ring),
    CollectiveSpec("barrier", False, False, lambda n: 0.0),
)}
