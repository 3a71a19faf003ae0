"""Property test of the inputs a hostile user gives: every dtype at its limits, odd layouts, factors.

Integers at and near their limits (so sums and products overflow and must wrap as NumPy's),
bool arrays over arbitrary bytes, uint64 above 2**63, byte-swapped and non-contiguous
inputs, integer and float scale factors, sizes that take every path (the check's payload,
the lanes, MPI's all-reduce, shared memory), the check on and off. The expectation is
NumPy's own reduction of every rank's input, the factors applied as NumPy's ``x * factor``
with a Python number. Masked arrays and Python ints beyond int64 are refused: see
test_wrong_numbers.py. Every rank draws the same examples and ends each with a verdict.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import mpitensor as mt
from tests.helpers import OP, agree, every_rank_settings, tolerance

pytestmark = pytest.mark.mpi(min_size=1)

SETTINGS = every_rank_settings(80)
INTEGERS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
DTYPES = [np.bool_, *INTEGERS, np.float32, np.float64]
OPS = [OP.SUM, OP.MEAN, OP.PROD, OP.MAX, OP.MIN]
SIZES = [1, 5, 16, 100, 9000, 70_000]
LAYOUTS = ["contiguous", "byte-swapped", "strided"]


@pytest.fixture(scope="module", params=[True, False], ids=["checked", "unchecked"])
def hostile_ctx(request):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=request.param)) as ctx:
        yield ctx


def _values(seed: int, rank: int, size: int, dtype: np.dtype) -> np.ndarray:
    """Rank `rank`'s values: for integers, a mix of the limits, values near them and small ones."""
    rng = np.random.default_rng([seed, rank])
    if dtype.kind == "b":
        return rng.choice(np.array([0, 1, 2, 127, 255], np.uint8), size).view(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        pool = np.array([info.min, info.min + 1, info.max, info.max - 1, info.max // 2 + 1, 0, 1, 2, 3],
                        dtype=object)
        if dtype.kind == "i":
            pool = np.concatenate([pool, np.array([-1, -2, info.min // 2 - 1], dtype=object)])
        return np.array(rng.choice(pool, size).tolist(), dtype)
    return rng.uniform(-1e3, 1e3, size).astype(dtype)


def _laid_out(values: np.ndarray, layout: str) -> np.ndarray:
    if layout == "byte-swapped":
        return values.astype(values.dtype.newbyteorder("S"))
    if layout == "strided":
        doubled = np.repeat(values, 2)
        return doubled[::2]
    return values.copy()


def _expected(op: mt.ReduceOperation, inputs: list[np.ndarray], pre: object, post: object) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        if pre is not None:
            inputs = [(x * pre).astype(x.dtype) for x in inputs]
        stacked = np.stack(inputs)
        if op is OP.MEAN:
            result = stacked.astype(np.float64).mean(axis=0) if stacked.dtype.kind in "biu" else \
                np.add.reduce(stacked, axis=0, dtype=stacked.dtype) / stacked.dtype.type(len(inputs))
        else:
            ufunc = {OP.SUM: np.add, OP.PROD: np.multiply, OP.MAX: np.maximum, OP.MIN: np.minimum}[op]
            if stacked.dtype.kind == "b":
                ufunc = {np.add: np.logical_or, np.maximum: np.logical_or}.get(ufunc, np.logical_and)
            # dtype=: NumPy's add and multiply reductions would widen small integers.
            result = ufunc.reduce(stacked, axis=0, dtype=stacked.dtype)
        if post is not None:
            result = (result * post).astype(result.dtype)
    return result


def _factor(draw: st.DrawFn, dtype: np.dtype) -> object:
    if dtype.kind == "b":
        return None
    if dtype.kind in "iu":
        return draw(st.sampled_from([None, 2, 3, int(np.iinfo(dtype).max)]))
    return draw(st.sampled_from([None, 0.5, -3.0]))


@st.composite
def _examples(draw: st.DrawFn) -> tuple:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    op = draw(st.sampled_from(OPS))
    pre, post = _factor(draw, dtype), _factor(draw, dtype)
    if op is OP.MEAN and dtype.kind in "biu":
        post = None  # MEAN of integers gives float64: its factor would be a float's
    return dtype, op, draw(st.sampled_from(SIZES)), draw(st.sampled_from(LAYOUTS)), pre, post, draw(
        st.integers(0, 2**31 - 1))


def _same(got: np.ndarray, expected: np.ndarray, count: int) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind == "b":
        return bool(np.array_equal(got.view(np.uint8), expected.view(np.uint8)))
    if expected.dtype.kind == "f":
        tol = tolerance(expected.dtype, count) * float(np.max(np.abs(expected), initial=1.0))
        return bool(np.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True))
    return bool(np.array_equal(got, expected))


@SETTINGS
@given(case=_examples())
# Cases that have given wrong numbers: Open MPI's saturating sums, bool bytes on MPI's path,
# uint64 scaled through float64, an integer MEAN's prescale not wrapping.
@example(case=(np.dtype(np.int8), OP.SUM, 1000, "contiguous", None, None, 1))
@example(case=(np.dtype(np.uint16), OP.SUM, 9000, "strided", 3, None, 2))
@example(case=(np.dtype(np.int16), OP.SUM, 100, "byte-swapped", None, 2, 3))
@example(case=(np.dtype(np.bool_), OP.MAX, 100, "contiguous", None, None, 4))
@example(case=(np.dtype(np.uint64), OP.SUM, 5, "contiguous", 3, 2, 5))
@example(case=(np.dtype(np.int32), OP.MEAN, 16, "contiguous", int(np.iinfo(np.int32).max), None, 6))
def test_hostile_all_reduces_match_numpy(hostile_ctx, case):
    ctx = hostile_ctx
    dtype, op, size, layout, pre, post, seed = case
    inputs = [_values(seed, rank, size, dtype) for rank in range(ctx.size)]
    expected = _expected(op, inputs, pre, post)
    mine = _laid_out(inputs[ctx.rank], layout)
    if dtype.kind == "b" and op is OP.PROD:
        op = OP.MIN  # the same logical and: exercise both names
    got = np.asarray(mt.all_reduce(mine, op, prescale_factor=pre, postscale_factor=post).resolve())
    agree(_same(got, expected, ctx.size),
          f"{dtype} {op.name} x{size} {layout} pre={pre} post={post}: got {got[:4]}, NumPy {expected[:4]}")
