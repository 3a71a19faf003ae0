"""reduce: the root gets the reduction, the other ranks None."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, OP, assert_matches, rank_input, reference, rejects, seed_of

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_every_op_and_dtype_to_the_last_rank(module_ctx, op, dtype, shape):
    ctx = module_ctx
    root = ctx.size - 1
    seed = seed_of("reduce", op.name, np.dtype(dtype).name, shape)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.reduce(rank_input(seed, ctx.rank, shape, dtype), op, root=root)
        return
    result = mt.reduce(rank_input(seed, ctx.rank, shape, dtype), op, root=root).resolve()
    if ctx.rank != root:
        assert result is None
        return
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    assert_matches(result, expected, op, ctx.size)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_groups(module_ctx, kind, op):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip("outside the group")
    root = members[0]
    seed = seed_of("reduce-group", kind, op.name)
    dtype = np.int64 if rejects(op, np.float64) else np.float64
    result = mt.reduce(rank_input(seed, ctx.rank, (6,), dtype), op, root=root, devices=members).resolve()
    if ctx.rank == root:
        expected = reference(op, [rank_input(seed, r, (6,), dtype) for r in members])
        assert_matches(result, expected, op, len(members))
    else:
        assert result is None
