"""all_to_all with splits: rows per destination (MPI_Ialltoallv), counts swapped non-blocking."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import mpitensor as mt
from tests.collectives.option_helpers import agree, close, expect_mismatch, still_usable
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, every_rank_settings, rank_input

pytestmark = pytest.mark.mpi(min_size=1)


def _splits(seed: int, rank: int, n: int) -> list[int]:
    return np.random.default_rng([seed, rank, 7]).integers(0, 4, n).tolist()


@every_rank_settings(40)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    rest=array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
    use_out=st.booleans(),
)
def test_splits_match_numpy(module_ctx, dtype, rest, group_kind, seed, use_out):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    n, me = len(members), members.index(ctx.rank)
    splits = {r: _splits(seed, r, n) for r in members}
    inputs = {r: rank_input(seed, r, (sum(splits[r]), *rest), dtype) for r in members}
    pieces = []
    for r in members:
        start = sum(splits[r][:me])
        pieces.append(inputs[r][start : start + splits[r][me]])
    expected = np.concatenate(pieces)
    out = np.empty(expected.shape, expected.dtype) if use_out else None
    before = inputs[ctx.rank].copy()
    got = mt.all_to_all(inputs[ctx.rank], splits=splits[ctx.rank], devices=members, out=out).resolve()
    ok = close(got, expected, None, n) and np.array_equal(inputs[ctx.rank], before)
    if use_out and out.size:
        ok = ok and np.shares_memory(got.numpy(), out)
    agree(ok, f"all_to_all splits {np.dtype(dtype).name} {rest} on {members}")


def test_splits_as_numpy_array_and_tensor(ctx):
    n = ctx.size
    data = mt.tensor(np.arange(2 * n, dtype=np.int64).reshape(n, 2) + 100 * ctx.rank)
    got = mt.all_to_all(data, splits=np.ones(n, np.int64)).resolve()
    expected = np.stack([np.arange(2 * ctx.rank, 2 * ctx.rank + 2) + 100 * r for r in range(n)])
    np.testing.assert_array_equal(got.numpy(), expected)


def test_equal_splits_give_the_equal_block_result(ctx):
    n = ctx.size
    data = np.arange(3 * n, dtype=np.float32) + ctx.rank
    plain = mt.all_to_all(data).resolve().numpy()
    split = mt.all_to_all(data, splits=[3] * n).resolve().numpy()
    np.testing.assert_array_equal(plain, split)


@pytest.mark.parametrize(
    ("splits", "error", "message"),
    [
        (lambda n: [1] * (n + 1), ValueError, "entries"),
        (lambda n: [-1] + [1] * n if n > 1 else [-1], ValueError, "non-negative"),
        (lambda n: [1.5] * n, TypeError, "must hold ints"),
        (lambda n: "ab", TypeError, "list of ints"),
        (lambda n: [5] * n, ValueError, "sum to"),
    ],
)
def test_bad_splits(ctx, splits, error, message):
    with pytest.raises(error, match=message):
        mt.all_to_all(np.ones((ctx.size, 2)), splits=splits(ctx.size))
    still_usable(ctx)


def test_splits_need_a_dimension(ctx):
    with pytest.raises(ValueError, match="at least one dimension"):
        mt.all_to_all(np.ones(()), splits=[0] * ctx.size)
    still_usable(ctx)


def test_out_of_the_wrong_length_is_raised_at_resolve(ctx):
    n = ctx.size
    handle = mt.all_to_all(np.ones((n, 2)), splits=[1] * n, out=np.empty((n + 1, 2)))
    with pytest.raises(ValueError, match="out= has shape"):
        handle.resolve()
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_splits_on_some_ranks_only_mismatch(ctx):
    n = ctx.size
    splits = [1] * n if ctx.rank == n - 1 else None
    expect_mismatch(
        lambda: mt.all_to_all(np.ones((n, 2)), splits=splits), "Mismatched all_to_all", f"rank {n - 1}", "splits"
    )
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_splits_with_other_row_shapes_mismatch(ctx):
    n = ctx.size
    width = 3 if ctx.rank == n - 1 else 2
    expect_mismatch(lambda: mt.all_to_all(np.ones((n, width)), splits=[1] * n), "tensor shapes", "(?, 3)")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_bad_splits_on_one_rank_fail_every_rank(ctx):
    n = ctx.size
    splits = [n] * n if ctx.rank == 0 else [1] * n
    if ctx.rank == 0:
        with pytest.raises(ValueError, match="sum to"):
            mt.all_to_all(np.ones((n, 2)), splits=splits)
    else:
        expect_mismatch(lambda: mt.all_to_all(np.ones((n, 2)), splits=splits), "failed on that rank", "sum to")
    still_usable(ctx)
