"""broadcast: every rank gets the root's tensor."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, SHAPES, rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_and_shape_from_the_last_rank(module_ctx, dtype, shape):
    ctx = module_ctx
    root = ctx.size - 1
    seed = seed_of("bcast", np.dtype(dtype).name, shape)
    mine = rank_input(seed, ctx.rank, shape, dtype)
    result = mt.broadcast(mine, root=root).resolve()
    np.testing.assert_array_equal(result.numpy(), rank_input(seed, root, shape, dtype))
    assert result.dtype == np.dtype(dtype)


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups_with_the_last_member_as_root(module_ctx, kind):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip("outside the group")
    root = members[-1]
    mine = rank_input(5, ctx.rank, (4, 3), np.float32)
    result = mt.broadcast(mt.tensor(mine), root=root, devices=members).resolve()
    np.testing.assert_array_equal(result.numpy(), rank_input(5, root, (4, 3), np.float32))


def test_non_roots_may_pass_none_with_shape_and_dtype(module_ctx):
    ctx = module_ctx
    data = np.arange(12, dtype=np.int16).reshape(3, 4)
    mine = data if ctx.rank == 0 else None
    result = mt.broadcast(mine, root=0, shape=(3, 4), dtype=np.int16).resolve()
    np.testing.assert_array_equal(result.numpy(), data)


def test_root_given_as_a_device(module_ctx):
    ctx = module_ctx
    root_device = ctx.devices[-1]
    result = mt.broadcast(np.full(2, float(ctx.rank)), root=root_device).resolve()
    np.testing.assert_array_equal(result.numpy(), np.full(2, float(ctx.size - 1)))


def test_the_root_gets_a_copy_and_its_input_is_untouched(module_ctx):
    mine = mt.arange(3.0)
    result = mt.broadcast(mine, root=0).resolve()
    assert result is not mine
    np.testing.assert_array_equal(mine.numpy(), np.arange(3.0))


def test_none_at_the_root_and_none_without_shape_are_rejected(module_ctx):
    ctx = module_ctx
    with pytest.raises(TypeError, match="the root must pass the tensor"):
        mt.broadcast(None, root=ctx.rank)
    if ctx.size > 1:
        with pytest.raises(TypeError, match="must give shape= and dtype="):
            mt.broadcast(None, root=(ctx.rank + 1) % ctx.size)


def test_a_root_outside_the_group_is_an_error_on_every_rank(module_ctx):
    ctx = module_ctx
    with pytest.raises(ValueError, match=rf"root {ctx.size + 2} is not in the group"):
        mt.broadcast(np.ones(2), root=ctx.size + 2).resolve()
    with pytest.raises(ValueError, match="root must be a rank >= 0, got -1"):
        mt.broadcast(np.ones(2), root=-1).resolve()
    # The context is still usable.
    assert mt.broadcast(np.ones(2), root=0).resolve().numpy().tolist() == [1.0, 1.0]
