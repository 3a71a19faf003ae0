"""all_gather: every rank gets everyone's tensors, concatenated."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(3,), (2, 4), (0, 2)], ids=str)
def test_equal_shapes(module_ctx, dtype, shape):
    ctx = module_ctx
    seed = seed_of("gather", np.dtype(dtype).name, shape)
    result = mt.all_gather(rank_input(seed, ctx.rank, shape, dtype)).resolve()
    expected = np.concatenate([rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    np.testing.assert_array_equal(result.numpy(), expected)
    assert result.dtype == np.dtype(dtype)


def test_unequal_first_dimensions(module_ctx):
    ctx = module_ctx
    parts = [rank_input(3, r, (r + 1, 3), np.int32) for r in range(ctx.size)]
    result = mt.all_gather(mt.tensor(parts[ctx.rank])).resolve()
    np.testing.assert_array_equal(result.numpy(), np.concatenate(parts))


@pytest.mark.parametrize("axis", [1, -1, 2])
def test_other_axes_with_unequal_lengths(module_ctx, axis):
    ctx = module_ctx
    parts = []
    for r in range(ctx.size):
        shape = [2, 3, 4]
        shape[axis] = r + 2
        parts.append(rank_input(4, r, shape, np.float64))
    result = mt.all_gather(parts[ctx.rank], axis=axis).resolve()
    np.testing.assert_array_equal(result.numpy(), np.concatenate(parts, axis=axis))


def test_scalars_become_a_vector(module_ctx):
    ctx = module_ctx
    result = mt.all_gather(np.array(float(ctx.rank))).resolve()
    np.testing.assert_array_equal(result.numpy(), np.arange(ctx.size, dtype=np.float64))


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups(module_ctx, kind):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip("outside the group")
    result = mt.all_gather(np.full((1, 2), ctx.rank), devices=members).resolve()
    np.testing.assert_array_equal(result.numpy(), np.array([[r, r] for r in members]))


def test_assume_resolved_is_the_resolved_tensor(module_ctx):
    ctx = module_ctx
    pending = mt.all_gather(np.full(2, ctx.rank))
    early = pending.assume_resolved()
    assert pending.resolve() is early


def test_a_bad_axis_is_rejected(module_ctx):
    with pytest.raises(ValueError, match="axis 3 is out of range for a tensor of 2 dimension"):
        mt.all_gather(np.ones((2, 2)), axis=3)
