"""Grouped all_gather, reduce_scatter and broadcast: a list, tuple or dict in one fused call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.collectives.option_helpers import agree, close, expect_mismatch, still_usable
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, ARITHMETIC, every_rank_settings, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)


def _structure(container: str, arrays: list[np.ndarray]):
    if container == "dict":
        return {f"t{i}": a for i, a in enumerate(arrays)}
    return tuple(arrays) if container == "tuple" else list(arrays)


def _leaves(structure):
    return list(structure.values()) if isinstance(structure, dict) else list(structure)


@every_rank_settings(40)
@given(
    kind=st.sampled_from(["all_gather", "reduce_scatter", "broadcast"]),
    dtypes=st.lists(st.sampled_from(ALL_DTYPES), min_size=0, max_size=4),
    container=st.sampled_from(["list", "tuple", "dict"]),
    op=st.sampled_from(ARITHMETIC),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_match_numpy(module_ctx, kind, dtypes, container, op, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    n, me = len(members), members.index(ctx.rank)
    root = members[seed % n]
    plain = [(), (3,), (2, 2)]
    shapes = [((i + 1) * n, 2) if kind == "reduce_scatter" else plain[i % 3] for i in range(len(dtypes))]
    inputs = {r: [rank_input(seed + i, r, s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))] for r in members}
    mine = _structure(container, inputs[ctx.rank])
    if kind == "all_gather":
        got = mt.all_gather(mine, devices=members).resolve()
        expected = [np.concatenate([np.atleast_1d(inputs[r][i]) for r in members]) for i in range(len(dtypes))]
    elif kind == "broadcast":
        got = mt.broadcast(mine, root=root, devices=members).resolve()
        expected = inputs[root]
    else:
        got = mt.reduce_scatter(mine, op, devices=members).resolve()
        expected = []
        for i in range(len(dtypes)):
            full = reference(op, [inputs[r][i] for r in members])
            block = full.shape[0] // n
            expected.append(full[me * block : (me + 1) * block])
    ok = type(got) is type(mine) and (not isinstance(got, dict) or list(got) == list(mine))
    ok = ok and all(close(g, e, op if kind == "reduce_scatter" else None, n) for g, e in zip(_leaves(got), expected))
    agree(ok, f"grouped {kind} {[np.dtype(d).name for d in dtypes]} {container} on {members}")


def test_grouped_reduce_scatter_scales(ctx):
    n = ctx.size
    got = mt.reduce_scatter([np.ones(n), np.ones((n, 2), np.float32)], "sum", prescale_factor=2.0,
                            postscale_factor=0.5).resolve()
    assert got[0].numpy().tolist() == [float(n)]
    assert got[1].numpy().tolist() == [[float(n)] * 2]


def test_grouped_all_gather_along_an_axis(ctx):
    got = mt.all_gather({"a": np.full((2, 1), ctx.rank)}, axis=1).resolve()
    assert got["a"].numpy().tolist() == [list(range(ctx.size))] * 2


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda n: mt.reduce_scatter([np.ones(n)], counts=[1] * n), TypeError, "counts= is not supported"),
        (lambda n: mt.all_gather([np.ones(2)], out=np.empty(2 * n)), TypeError, "out= is not supported"),
        (lambda n: mt.broadcast([np.ones(2), None]), TypeError, "every tensor of the list"),
        (lambda n: mt.reduce_scatter([np.ones(n + 1)]), ValueError, "divisible"),
        (lambda n: mt.all_gather([np.ones(2)], axis=3), ValueError, "out of range"),
    ],
)
def test_bad_grouped_input(ctx, call, error, message):
    if message == "divisible" and ctx.size == 1:
        pytest.skip("every first dimension is divisible by 1")
    with pytest.raises(error, match=message):
        call(ctx.size)
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "broadcast"])
def test_grouped_structures_mismatch(ctx, kind):
    n = ctx.size
    names = ["a", "c"] if ctx.rank == n - 1 else ["a", "b"]
    call = getattr(mt, kind)
    expect_mismatch(lambda: call({k: np.ones(n) for k in names}), f"Mismatched grouped {kind}", f"rank {n - 1}")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_grouped_shapes_mismatch(ctx):
    n = ctx.size
    shape = (2 * n,) if ctx.rank == n - 1 else (n,)
    expect_mismatch(lambda: mt.reduce_scatter([np.ones(n), np.ones(shape)]), "entries at index 1")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_grouped_and_single_calls_mismatch(ctx):
    value = np.ones(ctx.size)
    data = value if ctx.rank == 0 else [value]
    expect_mismatch(lambda: mt.all_gather(data), "Mismatched all_gather operations", "grouped all_gather")
    still_usable(ctx)
