"""reduce_scatter: reduce, then each rank gets its block of the first axis."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, OP, assert_matches, rank_input, reference, rejects, seed_of

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_every_op_and_dtype(module_ctx, op, dtype):
    ctx = module_ctx
    shape = (2 * ctx.size, 3)
    seed = seed_of("rs", op.name, np.dtype(dtype).name)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.reduce_scatter(rank_input(seed, ctx.rank, shape, dtype), op)
        return
    result = mt.reduce_scatter(rank_input(seed, ctx.rank, shape, dtype), op).resolve()
    full = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    assert_matches(result, full[2 * ctx.rank : 2 * ctx.rank + 2], op, ctx.size)


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups(module_ctx, kind):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip("outside the group")
    shape = (len(members), 2)
    seed = seed_of("rs-group", kind)
    result = mt.reduce_scatter(rank_input(seed, ctx.rank, shape, np.int64), devices=members).resolve()
    full = reference(OP.SUM, [rank_input(seed, r, shape, np.int64) for r in members])
    index = members.index(ctx.rank)
    assert_matches(result, full[index : index + 1])


@pytest.mark.mpi(min_size=2)
def test_indivisible_first_dimension_is_an_error_on_every_rank(module_ctx):
    ctx = module_ctx
    with pytest.raises(ValueError, match=rf"first dimension \({ctx.size + 1}\) must be divisible by the group size"):
        mt.reduce_scatter(np.ones(ctx.size + 1), "sum").resolve()


def test_zero_dimensional_input_is_an_error(module_ctx):
    with pytest.raises(ValueError, match="at least one dimension"):
        mt.reduce_scatter(np.ones(())).resolve()
