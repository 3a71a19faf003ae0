"""reduce_scatter with counts: rank k gets counts[k] rows of the reduction (MPI_Ireduce_scatter)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import mpitensor as mt
from tests.collectives.option_helpers import agree, close, expect_mismatch, still_usable
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, ARITHMETIC, every_rank_settings, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)


@every_rank_settings(40)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    rest=array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),
    op=st.sampled_from(ARITHMETIC),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
    use_out=st.booleans(),
)
def test_counts_match_numpy(module_ctx, dtype, rest, op, group_kind, seed, use_out):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    n, me = len(members), members.index(ctx.rank)
    counts = np.random.default_rng(seed).integers(0, 4, n).tolist()
    shape = (sum(counts), *rest)
    inputs = {r: rank_input(seed, r, shape, dtype) for r in members}
    start = sum(counts[:me])
    expected = reference(op, [inputs[r] for r in members])[start : start + counts[me]]
    out = np.empty(expected.shape, expected.dtype) if use_out else None
    got = mt.reduce_scatter(inputs[ctx.rank], op, counts=counts, devices=members, out=out).resolve()
    ok = close(got, expected, op, n)
    if use_out and out.size:
        ok = ok and np.shares_memory(got.numpy(), out)
    agree(ok, f"reduce_scatter counts {counts} {np.dtype(dtype).name} {rest} {op.name} on {members}")


def test_equal_counts_give_the_block_result(ctx):
    n = ctx.size
    data = np.arange(2 * n * 3, dtype=np.float64).reshape(2 * n, 3) * (ctx.rank + 1)
    plain = mt.reduce_scatter(data, "sum").resolve().numpy()
    counted = mt.reduce_scatter(data, "sum", counts=[2] * n).resolve().numpy()
    np.testing.assert_array_equal(plain, counted)


@pytest.mark.parametrize(
    ("counts", "error", "message"),
    [
        (lambda n: [1] * (n + 1), ValueError, "entries"),
        (lambda n: [-1] * n, ValueError, "non-negative"),
        (lambda n: [True] * n, TypeError, "must hold ints"),
        (lambda n: 3, TypeError, "list of ints"),
        (lambda n: [2] * n, ValueError, "sum to"),
    ],
)
def test_bad_counts(ctx, counts, error, message):
    with pytest.raises(error, match=message):
        mt.reduce_scatter(np.ones((ctx.size, 2)), counts=counts(ctx.size))
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_different_counts_mismatch(ctx):
    n = ctx.size
    counts = [0] * (n - 1) + [n] if ctx.rank == n - 1 else [1] * n
    expect_mismatch(
        lambda: mt.reduce_scatter(np.ones((n, 2)), counts=counts),
        "Mismatched reduce_scatter options",
        f"rank {n - 1} passed options counts=",
    )
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_counts_on_some_ranks_only_mismatch(ctx):
    n = ctx.size
    counts = [1] * n if ctx.rank == 0 else None
    expect_mismatch(lambda: mt.reduce_scatter(np.ones((n, 2)), counts=counts), "options", "no options")
    still_usable(ctx)
