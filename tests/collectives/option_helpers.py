"""Helpers of the tests of collective options (splits, counts, out=, factors, grouped calls)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP, tolerance


def agree(ok: bool, what: str) -> None:
    """Every rank passes or fails an example together (no rank may stop early)."""
    verdict = mt.all_reduce(np.array(ok), "min").resolve().item()
    assert verdict, f"{what}: failed on {'this rank' if not ok else 'another rank'}"


def close(got, expected: np.ndarray, op: mt.ReduceOperation | None, count: int, scale: float = 1.0) -> bool:
    """`got` equals `expected`: exactly for integers and selections, to round-off otherwise."""
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind not in "fc" or (op in (None, OP.MAX, OP.MIN) and scale == 1.0):
        return bool(np.array_equal(got, expected))
    tol = 4 * tolerance(expected.dtype, count) * max(1.0, abs(scale))
    return bool(np.allclose(got, expected, rtol=tol, atol=tol))


def expect_mismatch(call: Callable[[], mt.CollectiveTensor], *fragments: str) -> None:
    """`call` (or resolving it) raises CollectiveMismatchError naming every fragment."""
    with pytest.raises(mt.CollectiveMismatchError) as info:
        call().resolve()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def still_usable(ctx: mt.DistributedContext) -> None:
    """The context still runs collectives after a mismatch."""
    assert mt.all_reduce(np.ones(3)).resolve().numpy().tolist() == [float(ctx.size)] * 3
