"""The all-reduce carried inside the consistency check (small groups, small inputs).

Results must equal NumPy's on every rank, bit for bit the same everywhere, for every op,
dtype and size around the payload's limit; a rank whose call differs (a larger input, another
collective, another dtype) must get `CollectiveMismatchError` on every rank, never a result.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from mpitensor._core.dtypes import reduce_plan
from mpitensor._transport.base import ReduceCall, select
from mpitensor._transport.inline import PAYLOAD_BYTES
from mpitensor._transport.select import ALL_REDUCE_CHECKED, IN_CHECK
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import (
    ALL_DTYPES,
    OP,
    agree,
    every_rank_settings,
    expect_mismatch,
    rank_input,
    reference,
    rejects,
    still_usable,
    tolerance,
)

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = [*ALL_DTYPES, np.longdouble]


def _count_near_limit(dtype: np.dtype, op: mt.ReduceOperation, offset: int) -> int:
    """An element count whose work buffer is `offset` elements from the payload's limit."""
    work = reduce_plan(op, dtype).work_dtype
    return max(0, PAYLOAD_BYTES // work.itemsize + offset)


def _matches(got: object, expected: np.ndarray, op: mt.ReduceOperation, count: int) -> bool:
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind not in "fc" or op in (OP.MAX, OP.MIN):
        return bool(np.array_equal(got, expected, equal_nan=expected.dtype.kind in "fc"))
    tol = tolerance(expected.dtype, count)
    return bool(np.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True))


def _same_everywhere(got: object, members: list[int]) -> bool:
    """Every member of the group got the same bits (of an x87 long double, the 10 that hold its value)."""
    array = np.ascontiguousarray(np.asarray(got)).reshape(-1)
    bits = array.view(np.uint8)
    if array.dtype == np.longdouble and array.dtype.itemsize == 16 and np.finfo(np.longdouble).nmant == 63:
        bits = np.ascontiguousarray(bits.reshape(-1, 16)[:, :10]).reshape(-1)
    gathered = mt.all_gather(bits, devices=members).resolve().numpy().reshape(len(members), -1)
    return bool((gathered == gathered[0]).all())


@every_rank_settings(80)
@given(
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(list(OP)),
    offset=st.integers(-3, 2),
    nan=st.booleans(),
    swapped=st.booleans(),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_small_all_reduce_matches_numpy(module_ctx, dtype, op, offset, nan, swapped, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    if rejects(op, dtype):
        dtype = np.int64
    dtype = np.dtype(dtype)
    count = _count_near_limit(dtype, op, offset)
    inputs = {r: rank_input(seed, r, (count,), dtype) for r in members}
    if nan and dtype.kind in "fc" and count:
        inputs[members[seed % len(members)]][seed % count] = np.nan
    mine = inputs[ctx.rank]
    if swapped and dtype.itemsize > 1 and dtype.kind != "b":
        mine = mine.astype(dtype.newbyteorder())
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference(op, [inputs[r] for r in members])
    got = mt.all_reduce(mine, op, devices=members).resolve()
    ok = _matches(got, expected, op, len(members))
    ok = _same_everywhere(got, members) and ok
    agree(ok, f"{op.name} of {count} x {dtype} on {members}")


@pytest.mark.mpi(min_size=2)
def test_small_checked_calls_travel_in_the_check(ctx):
    """Inputs whose work buffer fits the payload take the in-check transport; others do not."""
    group = ctx.full_group
    for dtype, op in [(np.float32, OP.SUM), (np.int8, OP.MEAN), (np.float64, OP.MAX), (np.complex128, OP.MIN)]:
        work = reduce_plan(op, np.dtype(dtype)).work_dtype.itemsize
        for count, inline in [(PAYLOAD_BYTES // work, True), (PAYLOAD_BYTES // work + 1, False)]:
            array = np.ones(count, dtype)
            source = type("Source", (), {"array": array, "buffer": array})()
            call = ReduceCall(ctx, group, source, reduce_plan(op, array.dtype), array.nbytes)
            assert (select(ALL_REDUCE_CHECKED, call) is IN_CHECK) == (inline and ctx.size <= 8), (dtype, op, count)
    half = np.ones(4, np.float16)
    source = type("Source", (), {"array": half, "buffer": half})()
    call = ReduceCall(ctx, group, source, reduce_plan(OP.SUM, half.dtype), half.nbytes)
    assert select(ALL_REDUCE_CHECKED, call) is not IN_CHECK, "half precision is rounded back: left to MPI"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("large", [17, 100_000])
def test_small_meets_large_all_reduce(ctx, large):
    """A small call on one rank meets a larger one (above the payload, or on the shared-memory path)."""
    count = large if ctx.rank == ctx.size - 1 else 2
    expect_mismatch(lambda: mt.all_reduce(np.ones(count)), "Mismatched all_reduce tensor shapes", f"({large},)")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["broadcast", "all_gather", "reduce", "barrier", "fused"])
def test_small_meets_another_collective(ctx, other):
    small = np.full(2, float(ctx.rank))
    calls = {
        "broadcast": lambda: mt.broadcast(small),
        "all_gather": lambda: mt.all_gather(small),
        "reduce": lambda: mt.reduce(small, root=0),
        "barrier": mt.barrier,
        "fused": lambda: mt.all_reduce([small, small]),
    }
    call = calls[other] if ctx.rank == ctx.size - 1 else (lambda: mt.all_reduce(small))
    expect_mismatch(call, "called all_reduce", "but rank")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["dtype", "op"])
def test_small_calls_that_differ(ctx, what):
    odd = ctx.rank == ctx.size - 1
    if what == "dtype":
        expect_mismatch(lambda: mt.all_reduce(np.ones(2, np.float32 if odd else np.int32)),
                         "Mismatched all_reduce tensor dtypes")
    else:
        expect_mismatch(lambda: mt.all_reduce(np.ones(2), "max" if odd else "sum"), "Mismatched all_reduce reduce ops")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_small_call_failed_on_one_rank(ctx):
    """A call that fails on its own rank stands in with a row of the same size: peers learn it."""
    if ctx.rank == ctx.size - 1:
        with pytest.raises(TypeError):
            mt.all_reduce(np.array(["a", "b"])).resolve()
    else:
        expect_mismatch(lambda: mt.all_reduce(np.ones(2)), "Collective failed on another rank")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["out", "prescale"])
@pytest.mark.parametrize("op", [OP.SUM, OP.MEAN, OP.MAX])
def test_small_call_meets_the_same_call_through_mpi(ctx, how, op):
    """One rank reduces the same call through MPI (``out=``, a factor of 1): no row carries alone.

    The ranks whose rows carried their input see that one did not, and reduce theirs through
    MPI too: every rank gets the reference (NaN through MAX's keys included), and the data
    communicator stays in step for the calls after it.
    """
    inputs = [np.arange(4, dtype=np.float64) * (r + 1) - r for r in range(ctx.size)]
    inputs[0][1] = np.nan if op is OP.MAX else inputs[0][1]
    expected = reference(op, inputs)
    mine = inputs[ctx.rank].copy()
    if ctx.rank == ctx.size - 1:
        if how == "out":
            out = np.empty(4)
            got = mt.all_reduce(mine, op, out=out).resolve()
            assert np.shares_memory(np.asarray(got), out)
        else:
            got = mt.all_reduce(mine, op, prescale_factor=1).resolve()
    else:
        pending = mt.all_reduce(mine, op)
        mine[:] = -7.0  # the copy taken at the call is what is reduced, whatever path it takes
        got = pending.resolve()
    ok = np.allclose(np.asarray(got), expected, equal_nan=True)
    agree(ok, f"{op.name} with {how} on rank {ctx.size - 1}: {np.asarray(got)} vs {expected}")
    larger = mt.all_reduce(np.ones(1000)).resolve()
    agree(bool((larger.numpy() == ctx.size).all()), "the all-reduce after it")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("late", [0, -1])
@pytest.mark.parametrize("op", [OP.SUM, OP.MAX])
def test_small_calls_with_a_late_rank(ctx, late, op):
    """Calls whose check agrees at once complete at the call; a late member's peers queue theirs.

    Both ways reduce the same rows: every rank gets the reference, on every call, and nothing
    is left in flight.
    """
    late_rank = late % ctx.size
    for step in range(4):
        inputs = [np.arange(3, dtype=np.float64) * (r + 1) - step for r in range(ctx.size)]
        if ctx.rank == late_rank and step % 2 == 0:
            time.sleep(0.05)  # the others' checks cannot agree within their first spin
        mine = inputs[ctx.rank].copy()
        pending = mt.all_reduce(mine, op)
        mine[:] = -7.0  # the copy taken at the call is reduced, on either way
        got = pending.resolve().numpy()
        agree(np.array_equal(got, reference(op, inputs)), f"step {step}, rank {late_rank} late: {got}")
    assert not ctx.engine.busy()
    still_usable(ctx)
