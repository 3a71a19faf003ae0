"""Helpers of the tests of collective options (splits, counts, out=, factors, grouped calls)."""

from __future__ import annotations

import numpy as np

import mpitensor as mt
from tests.helpers import OP, agree, expect_mismatch, still_usable, tolerance

# The checks these tests share with the others live in tests.helpers; kept importable from here.
__all__ = ["agree", "close", "expect_mismatch", "still_usable"]


def close(got, expected: np.ndarray, op: mt.ReduceOperation | None, count: int, scale: float = 1.0) -> bool:
    """`got` equals `expected`: exactly for integers and selections, to round-off otherwise."""
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind not in "fc" or (op in (None, OP.MAX, OP.MIN) and scale == 1.0):
        return bool(np.array_equal(got, expected))
    tol = 4 * tolerance(expected.dtype, count) * max(1.0, abs(scale))
    return bool(np.allclose(got, expected, rtol=tol, atol=tol))


