"""prescale_factor / postscale_factor on all_reduce, reduce, reduce_scatter and GradientSync (Horovod's semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.collectives.option_helpers import agree, close, expect_mismatch, still_usable
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import COMPLEX, FLOATS, OP, SIGNED, UNSIGNED, every_rank_settings, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)

NUMBERS = [*SIGNED, *UNSIGNED, *FLOATS, *COMPLEX]


def _factor(dtype: np.dtype, draw: int) -> float | int:
    return [1, 2, 3][draw] if np.dtype(dtype).kind in "iu" else [1.0, 0.5, 2.5][draw]


def _expected(op, arrays, pre, post):
    dtype = arrays[0].dtype
    scaled = [(a * pre).astype(dtype) if dtype.kind in "iu" else (a * np.asarray(pre, dtype)) for a in arrays]
    result = reference(op, scaled)
    if result.dtype.kind in "iu":
        return (result * post).astype(result.dtype)
    return (result * np.asarray(post, result.dtype)).astype(result.dtype)


@every_rank_settings(40)
@given(
    kind=st.sampled_from(["all_reduce", "reduce", "reduce_scatter"]),
    dtype=st.sampled_from(NUMBERS),
    op=st.sampled_from([OP.SUM, OP.MEAN, OP.MAX, OP.MIN]),
    draws=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_factors_match_numpy(module_ctx, kind, dtype, op, draws, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    if np.dtype(dtype).kind == "c" and op in (OP.MAX, OP.MIN):
        op = OP.SUM
    n = len(members)
    pre, post = _factor(dtype, draws[0]), _factor(dtype, draws[1])
    inputs = {r: rank_input(seed, r, (2 * n, 3), dtype) for r in members}
    mine = inputs[ctx.rank]
    before = mine.copy()
    expected = _expected(op, [inputs[r] for r in members], pre, post)
    if kind == "all_reduce":
        got = mt.all_reduce(mine, op, devices=members, prescale_factor=pre, postscale_factor=post).resolve()
        ok = close(got, expected, op, n, pre * post)
    elif kind == "reduce":
        root = members[seed % n]
        got = mt.reduce(mine, op, root=root, devices=members, prescale_factor=pre, postscale_factor=post).resolve()
        ok = got is None if ctx.rank != root else close(got, expected, op, n, pre * post)
    else:
        me = members.index(ctx.rank)
        got = mt.reduce_scatter(mine, op, devices=members, prescale_factor=pre, postscale_factor=post).resolve()
        ok = close(got, expected[2 * me : 2 * me + 2], op, n, pre * post)
    ok = ok and np.array_equal(mine, before)  # prescale never changes the caller's input
    agree(ok, f"{kind} {np.dtype(dtype).name} {op.name} pre={pre} post={post} on {members}")


def test_integral_float_factors_on_integers(ctx):
    got = mt.reduce(np.ones(3, np.int32), "sum", prescale_factor=2.0, postscale_factor=3).resolve()
    if ctx.rank == 0:
        assert got.numpy().tolist() == [6 * ctx.size] * 3


def test_factor_one_is_free_and_agrees_with_none(ctx):
    got = mt.reduce_scatter(np.ones(ctx.size), "sum", prescale_factor=1, postscale_factor=1.0).resolve()
    assert got.numpy().tolist() == [float(ctx.size)]


@pytest.mark.parametrize(
    ("dtype", "factors", "message"),
    [
        (np.int32, {"prescale_factor": 0.5}, "not an integer"),
        (np.uint8, {"postscale_factor": 1.5}, "not an integer"),
        (np.bool_, {"prescale_factor": 2}, "bool tensors cannot be scaled"),
        (np.float64, {"postscale_factor": 1j}, "complex"),
        (np.float64, {"prescale_factor": "2"}, "must be a number"),
    ],
)
@pytest.mark.parametrize("kind", ["all_reduce", "reduce", "reduce_scatter"])
def test_bad_factors(ctx, kind, dtype, factors, message):
    call = getattr(mt, kind)
    with pytest.raises(TypeError, match=message):
        call(np.ones(ctx.size, dtype), "sum", **factors)
    still_usable(ctx)


def test_gradient_sync_factors(ctx):
    grads = {"a": np.full(3, ctx.rank + 1.0, np.float32), "b": np.full((2, 2), float(ctx.rank), np.float64)}
    sync = mt.GradientSync({k: v for k, v in grads.items()}, op="sum", prescale_factor=2.0, postscale_factor=0.25)
    for name in ("b", "a"):
        sync.submit(name, grads[name])
    got = sync.wait()
    n = ctx.size
    np.testing.assert_allclose(got["a"].numpy(), np.full(3, 0.5 * n * (n + 1) / 2, np.float32))
    np.testing.assert_allclose(got["b"].numpy(), np.full((2, 2), 0.5 * n * (n - 1) / 2))
    assert grads["a"].tolist() == [ctx.rank + 1.0] * 3  # the submitted gradient is unchanged


def test_gradient_sync_refuses_fractions_for_integers(ctx):
    with pytest.raises(TypeError, match="not an integer"):
        mt.GradientSync({"n": ((2,), np.int64)}, prescale_factor=0.5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["all_reduce", "reduce", "reduce_scatter"])
def test_different_factors_mismatch(ctx, kind):
    factor = 2.0 if ctx.rank == ctx.size - 1 else 3.0
    call = getattr(mt, kind)
    expect_mismatch(
        lambda: call(np.ones(ctx.size), "sum", prescale_factor=factor),
        f"Mismatched {kind} options",
        "prescale_factor=3.0",
        f"rank {ctx.size - 1} passed options prescale_factor=2.0",
    )
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_factor_on_some_ranks_only_mismatch(ctx):
    factor = 2.0 if ctx.rank == 0 else None
    expect_mismatch(lambda: mt.reduce(np.ones(2), "sum", postscale_factor=factor), "options", "no options")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_gradient_sync_factors_mismatch(ctx):
    sync = mt.GradientSync({"w": ((2,), np.float64)}, postscale_factor=2.0 if ctx.rank == 0 else 4.0)
    with pytest.raises(mt.CollectiveMismatchError, match="postscale_factor"):
        sync.submit("w", np.ones(2))  # the bucket starts here: its check may fail here or in wait()
        sync.wait()
    still_usable(ctx)


def test_a_fused_all_reduce_refuses_out(ctx):
    with pytest.raises(TypeError, match="out= is not supported for a list"):
        mt.all_reduce({"a": np.ones(2)}, out=np.empty(2))
    still_usable(ctx)


@every_rank_settings(30)
@given(
    dtypes=st.lists(st.sampled_from(NUMBERS), min_size=1, max_size=4),
    op=st.sampled_from([OP.SUM, OP.MEAN, OP.MAX, OP.MIN]),
    draws=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_factors_match_numpy(module_ctx, dtypes, op, draws, seed):
    ctx = module_ctx
    if any(np.dtype(d).kind == "c" for d in dtypes) and op in (OP.MAX, OP.MIN):
        op = OP.SUM
    # Factors every dtype takes: integers as soon as one tensor is an integer one.
    integral = any(np.dtype(d).kind in "iu" for d in dtypes)
    choices = [1, 2, 3] if integral else [1.0, 0.5, 2.5]
    pre, post = choices[draws[0]], choices[draws[1]]
    inputs = {r: [rank_input(seed + i, r, (3, 2), d) for i, d in enumerate(dtypes)] for r in range(ctx.size)}
    mine = inputs[ctx.rank]
    before = [a.copy() for a in mine]
    got = mt.all_reduce(mine, op, prescale_factor=pre, postscale_factor=post).resolve()
    ok = all(
        close(g, _expected(op, [inputs[r][i] for r in range(ctx.size)], pre, post), op, ctx.size, pre * post)
        for i, g in enumerate(got)
    )
    ok = ok and all(np.array_equal(a, b) for a, b in zip(mine, before))
    agree(ok, f"fused {[np.dtype(d).name for d in dtypes]} {op.name} pre={pre} post={post}")


@pytest.mark.mpi(min_size=2)
def test_fused_factors_mismatch(ctx):
    factor = 2.0 if ctx.rank == 0 else 4.0
    expect_mismatch(lambda: mt.all_reduce([np.ones(2), np.ones(3)], "sum", prescale_factor=factor),
                    "options", "prescale_factor")
    still_usable(ctx)
