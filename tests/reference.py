"""Inputs every rank can compute for every other rank, and what NumPy says the results are."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from anyccl import ReduceOp
from anyccl.buffers import SUPPORTED_DTYPES
from anyccl.errors import UnsupportedError
from anyccl.ops import check_reduce_op, dtype_kind

DTYPES = SUPPORTED_DTYPES
# one dtype per family, for the costly element counts
FAMILY_DTYPES = tuple(np.dtype(d) for d in (np.bool_, np.int32, np.uint8, np.float32,
                                             ml_dtypes.bfloat16, np.complex64))
COUNTS = (0, 1, 7, 1000, 1_048_579)

UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
         ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
         ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}


def valid_ops(dtype: np.dtype) -> list[ReduceOp]:
    ops = []
    for op in ReduceOp:
        try:
            check_reduce_op(op, dtype)
            ops.append(op)
        except UnsupportedError:
            pass
    return ops


def make_input(rank: int, count: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Small values (-2..2, or 0..4 unsigned) so sums and products are exact in every dtype."""
    i = np.arange(count, dtype=np.int64)
    v = (i * 7 + rank * 13 + salt * 5) % 5
    kind = dtype_kind(dtype)
    if kind == "b":
        return (v % 2 == 0).astype(dtype)
    if kind == "u":
        return v.astype(dtype)
    signed = v - 2
    if kind == "c":
        return (signed + 1j * ((v + 3) % 5 - 2)).astype(dtype)
    return signed.astype(dtype)


def reduce_reference(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    total = functools.reduce(lambda a, b: UFUNC[op](a, b), arrays)
    if op is ReduceOp.AVG:
        return (total.astype(np.complex128 if total.dtype.kind == "c" else np.float64)
                / len(arrays))
    return total


def assert_matches(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    if expected.dtype in (np.float64, np.complex128) and actual.dtype != expected.dtype:
        rtol = {2: 1e-2, 4: 1e-6, 8: 1e-6, 16: 1e-12}[actual.dtype.itemsize]
        if actual.dtype == np.float16:
            rtol = 1e-3
        got = actual.astype(expected.dtype)
        ok = np.allclose(got, expected, rtol=rtol, atol=rtol)
    else:
        ok = actual.dtype == expected.dtype and np.array_equal(actual, expected)
    if not ok:
        bad = np.flatnonzero(actual.astype(np.complex128) != expected.astype(np.complex128))[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {actual[bad]}, "
                             f"expected {expected[bad]}")
