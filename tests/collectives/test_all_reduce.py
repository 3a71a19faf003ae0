"""all_reduce against NumPy references of every rank's input, on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, OP, SHAPES, assert_matches, rank_input, reference, rejects, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

OPS = list(OP)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_every_op_dtype_shape_on_the_world(module_ctx, op, dtype, shape):
    ctx = module_ctx
    seed = seed_of(op.name, np.dtype(dtype).name, shape)
    mine = rank_input(seed, ctx.rank, shape, dtype)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match=f"{op.name} is a bitwise reduction, defined for integer and bool"):
            mt.all_reduce(mt.tensor(mine), op)
        return
    result = mt.all_reduce(mt.tensor(mine), op).resolve()
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    assert isinstance(result, mt.Tensor)
    assert result.device == ctx.device
    assert_matches(result, expected, op, ctx.size)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.bool_, np.complex64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_groups(module_ctx, kind, op, dtype):
    ctx = module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip(f"rank {ctx.rank} is outside the {kind} group")
    seed = seed_of(kind, op.name, np.dtype(dtype).name)
    mine = rank_input(seed, ctx.rank, (3, 4), dtype)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.all_reduce(mine, op, devices=[ctx.devices[r] for r in members])
        return
    result = mt.all_reduce(mine, op, devices=[ctx.devices[r] for r in members]).resolve()
    expected = reference(op, [rank_input(seed, r, (3, 4), dtype) for r in members])
    assert_matches(result, expected, op, len(members))


@pytest.mark.mpi(min_size=2)
def test_group_excluding_rank_zero_given_as_ranks(module_ctx):
    ctx = module_ctx
    members = list(range(1, ctx.size))
    if ctx.rank == 0:
        # Rank 0 takes no part; it does something else meanwhile.
        result = mt.all_reduce(np.array([5.0]), devices=[0]).resolve()
        assert_matches(result, np.array([5.0]))
        return
    result = mt.all_reduce(np.array([float(ctx.rank)]), devices=members).resolve()
    assert_matches(result, np.array([float(sum(members))]))


def test_group_communicators_are_created_once(ctx):
    before = ctx.group_count()
    for _ in range(3):
        mt.all_reduce(np.ones(2), devices=[ctx.rank]).resolve()
    # A group of this rank alone is the whole context when there is one rank.
    assert ctx.group_count() == before + (1 if ctx.size > 1 else 0)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_a_million_elements(module_ctx, op):
    ctx = module_ctx
    dtype = np.uint32 if rejects(op, np.float32) else np.float32  # large bitwise reductions of integers
    mine = rank_input(7, ctx.rank, (10**6,), dtype)
    result = mt.all_reduce(mine, op).resolve()
    expected = reference(op, [rank_input(7, r, (10**6,), dtype) for r in range(ctx.size)])
    assert_matches(result, expected, op, ctx.size)


@pytest.mark.parametrize(
    "view",
    [lambda a: a[::2, ::3], lambda a: a.T, lambda a: a[:, 1], lambda a: a.astype(">f8")],
    ids=["strided", "transposed", "column", "byteswapped"],
)
def test_non_contiguous_and_byteswapped_inputs_are_copied(module_ctx, view):
    ctx = module_ctx
    full = [rank_input(11, r, (8, 6), np.float64) for r in range(ctx.size)]
    mine = view(full[ctx.rank])
    result = mt.all_reduce(mine).resolve()
    expected = reference(OP.SUM, [np.asarray(view(a), dtype=np.float64) for a in full])
    assert result.numpy().flags.c_contiguous
    assert_matches(result, expected.astype(np.float64), OP.SUM, ctx.size)


def test_mean_of_integers_and_bools_is_float64(module_ctx):
    ctx = module_ctx
    ints = mt.all_reduce(np.array([1, 2, 3], np.int16) * (ctx.rank + 1), "mean").resolve()
    assert ints.dtype == np.float64
    np.testing.assert_allclose(ints.numpy(), np.array([1, 2, 3]) * (ctx.size + 1) / 2)
    flags = mt.all_reduce(np.array([ctx.rank == 0, True]), OP.MEAN).resolve()
    assert flags.dtype == np.float64
    np.testing.assert_allclose(flags.numpy(), [1 / ctx.size, 1.0])


def test_default_op_comes_from_the_config(module_ctx):
    with mt.DistributedContext.init(config=mt.DistributedConfig(all_reduce_op=OP.MEAN)) as ctx:
        result = mt.all_reduce(np.array([2.0 * (ctx.rank + 1)])).resolve()
        np.testing.assert_allclose(result.numpy(), [ctx.size + 1.0])


def test_op_names_are_accepted_and_bad_ops_rejected(module_ctx):
    ctx = module_ctx
    assert mt.all_reduce(np.ones(1), "max").resolve().item() == 1.0
    assert mt.all_reduce(np.ones(1), "avg").resolve().item() == 1.0
    with pytest.raises(ValueError, match="unknown reduce operation 'median'"):
        mt.all_reduce(np.ones(1), "median")
    with pytest.raises(TypeError, match="op must be a ReduceOperation"):
        mt.all_reduce(np.ones(1), 3)
    assert ctx.size >= 1


def test_longdouble(module_ctx):
    ctx = module_ctx
    result = mt.all_reduce(np.full(3, 0.5, np.longdouble)).resolve()
    assert result.dtype == np.longdouble
    assert np.all(result.numpy() == np.longdouble(0.5) * ctx.size)


def test_resolve_twice_and_assume_resolved_give_the_same_tensor(module_ctx):
    ctx = module_ctx
    pending = mt.all_reduce(mt.arange(4, dtype=np.float64), OP.MEAN)
    early = pending.assume_resolved()
    resolved = pending.resolve()
    assert resolved is early
    assert pending.resolve() is resolved
    assert pending.done and pending.test()
    np.testing.assert_allclose(resolved.numpy(), np.arange(4.0))
    assert ctx.size >= 1


def test_result_is_a_fresh_tensor_not_the_input(module_ctx):
    mine = mt.ones(5)
    result = mt.all_reduce(mine).resolve()
    assert result is not mine
    assert not np.shares_memory(result.numpy(), mine.numpy())
    result[0] = -1  # the result is the caller's to write
    assert result[0].item() == -1
