"""float16 and bfloat16: reduced in float32, rounded once, so results are within one unit
in the last place of the exact sum of the 16-bit inputs."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP, seed_of

ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = pytest.mark.mpi(min_size=1)

HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _inputs(seed: int, size: int, count: int, dtype: np.dtype) -> list[np.ndarray]:
    return [np.random.default_rng([seed, r]).standard_normal(count).astype(dtype) for r in range(size)]


def _ulp(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The spacing of `dtype` just above each value's magnitude (one unit in the last place)."""
    magnitude = np.abs(values).astype(np.float32).astype(dtype)
    above = (magnitude.view(np.uint16) + np.uint16(1)).view(dtype)
    return above.astype(np.float64) - magnitude.astype(np.float64)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("op", [OP.SUM, OP.MEAN], ids=lambda o: o.name)
def test_sum_and_mean_are_within_one_ulp(module_ctx, dtype, op):
    ctx = module_ctx
    everyone = _inputs(seed_of("half", dtype.name, op.name), ctx.size, 10_000, dtype)
    got = mt.all_reduce(everyone[ctx.rank], op).resolve()
    assert got.dtype == dtype
    exact = np.sum([x.astype(np.float64) for x in everyone], axis=0)
    if op is OP.MEAN:
        exact /= ctx.size
    error = np.abs(got.numpy().astype(np.float64) - exact)
    assert (error <= _ulp(exact, dtype)).all(), float(error.max())


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("op", [OP.MAX, OP.MIN, OP.PROD], ids=lambda o: o.name)
def test_max_min_are_exact_and_prod_close(module_ctx, dtype, op):
    ctx = module_ctx
    everyone = _inputs(seed_of("half2", dtype.name, op.name), ctx.size, 1000, dtype)
    got = mt.all_reduce(mt.tensor(everyone[ctx.rank]), op).resolve().numpy().astype(np.float64)
    wide = [x.astype(np.float64) for x in everyone]
    if op is OP.MAX:
        np.testing.assert_array_equal(got, np.maximum.reduce(wide))
    elif op is OP.MIN:
        np.testing.assert_array_equal(got, np.minimum.reduce(wide))
    else:
        exact = np.prod(wide, axis=0)
        assert (np.abs(got - exact) <= 2 * _ulp(exact, dtype)).all()


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_fused_gradient_sync_and_other_collectives_keep_the_dtype(module_ctx, dtype):
    ctx = module_ctx
    x = (np.arange(6) * 0.25 + ctx.rank).astype(dtype)
    fused = mt.all_reduce([x, np.ones(3, np.float32)], "mean").resolve()
    assert fused[0].dtype == dtype and fused[1].dtype == np.float32
    single = mt.all_reduce(x, "mean").resolve()
    np.testing.assert_array_equal(fused[0].numpy().view(np.uint16), single.numpy().view(np.uint16))
    sync = mt.GradientSync({"w": ((6,), dtype), "b": ((3,), np.float32)})
    sync.submit("b", np.ones(3, np.float32))
    sync.submit("w", x)
    grads = sync.wait()
    assert grads["w"].dtype == dtype
    np.testing.assert_array_equal(grads["w"].numpy().view(np.uint16), single.numpy().view(np.uint16))
    gathered = mt.all_gather(x).resolve()
    assert gathered.dtype == dtype and gathered.shape == (6 * ctx.size,)
    assert mt.broadcast(x, root=0).resolve().dtype == dtype
