"""all_to_all: block j of rank i goes to rank j."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype(module_ctx, dtype):
    ctx = module_ctx
    n = ctx.size
    seed = seed_of("a2a", np.dtype(dtype).name)
    inputs = [rank_input(seed, r, (2 * n, 3), dtype) for r in range(n)]
    result = mt.all_to_all(inputs[ctx.rank]).resolve()
    me = ctx.rank
    expected = np.concatenate([inputs[src][2 * me : 2 * me + 2] for src in range(n)])
    np.testing.assert_array_equal(result.numpy(), expected)


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups(module_ctx, kind):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip("outside the group")
    k = len(members)
    mine = np.array([100 * ctx.rank + j for j in range(k)])
    result = mt.all_to_all(mine, devices=members).resolve()
    me = members.index(ctx.rank)
    np.testing.assert_array_equal(result.numpy(), [100 * src + me for src in members])


@pytest.mark.mpi(min_size=2)
def test_indivisible_first_dimension_is_an_error(module_ctx):
    ctx = module_ctx
    with pytest.raises(ValueError, match="must be divisible by the group size"):
        mt.all_to_all(np.ones(ctx.size + 1)).resolve()
