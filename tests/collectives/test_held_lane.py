"""The held all-reduce's compiled plan: repeated calls of a kind reduced in one C call, as the Python path reduces them.

From the second call of a kind (dtype, shape, op, in place or into `out`) on the full group
with the check on, a call takes the kind's compiled lane: the check's row, then MPI's
blocking all-reduce from the caller's input into the caller's buffer. Every result is
compared with NumPy's reduction of every rank's input; a peer late past the lane's wait,
a mismatch met on the lane and calls the lane declines (another thread, a sub-group, the
check off, a traced context) must behave as on the Python path.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.lane import CopiedInto
from tests.helpers import (
    OP,
    assert_matches,
    expect_mismatch,
    kept_plan,
    rank_input,
    reference,
    rejects,
    seed_of,
    still_usable,
)

pytestmark = pytest.mark.mpi(min_size=1)

switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
needs_compiled = pytest.mark.skipif(switched_off or not native.built(),
                                    reason="MPITENSOR_NATIVE=0, or built without a C compiler: the Python path only")

SHAPE = (20_000,)  # 80 KB at 4 bytes: in place, held calls are larger than 64 KiB
DTYPES = [np.int32, np.int64, np.uint64, np.float32, np.float64, np.complex128]
OPS = [OP.SUM, OP.PROD, OP.MAX, OP.MIN, OP.MEAN, OP.BAND, OP.BOR, OP.BXOR]


def _lane(ctx: mt.DistributedContext, dtype: object, op: object, into: bool) -> object:
    """The compiled held lane of the kind, or None (none kept, or a plan the ordinary all-reduce serves)."""
    plan = kept_plan(ctx, "all_reduce", np.dtype(dtype), SHAPE, op, "held", into)
    return None if isinstance(plan, CopiedInto) else plan


def _kept_lane(ctx: mt.DistributedContext, into: bool) -> object:
    """The compiled lane of float64 SUM calls of `SHAPE` (in place or into `out`), kept by two calls."""
    for _ in range(2):
        _held(np.ones(SHAPE), OP.SUM, into)
    lane = _lane(ctx, np.float64, OP.SUM, into)
    assert lane is not None
    return lane


def _held(array: np.ndarray, op: object, into: bool) -> np.ndarray:
    """The held all-reduce of `array`, in place or into a fresh `out` (the caller's buffer where it is held)."""
    out = np.empty_like(array) if into else None
    result = mt.all_reduce(array, op, out=out, held=True).resolve().numpy()
    assert np.shares_memory(result, out if into else array), "the result is the caller's buffer"
    return result


def _takes_lane(op: mt.ReduceOperation, dtype: object, size: int) -> bool:
    """Whether calls of this kind have a compiled held lane (checked, 2-8 ranks, held, a compiled MEAN)."""
    dtype = np.dtype(dtype)
    if not 2 <= size <= 8 or rejects(op, dtype) or (op in (OP.MAX, OP.MIN) and dtype.kind in "fc"):
        return False
    return op is not OP.MEAN or dtype in (np.float32, np.float64)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("into", [False, True], ids=["in_place", "into_out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_repeated_calls_on_the_lane_match_numpy(op, dtype, into):
    """Five calls of a kind, the last with a peer late past the lane's wait (its check queued)."""
    if rejects(op, dtype) or (op is OP.MEAN and np.dtype(dtype).kind not in "fc"):
        pytest.skip("not a held call (refused, or MEAN of integers: a float64 result)")
    with mt.DistributedContext.init() as ctx:
        for turn in range(5):
            seed = seed_of("held-lane", op.name, np.dtype(dtype).name, into, turn)
            inputs = [rank_input(seed, r, SHAPE, dtype) for r in range(ctx.size)]
            if turn == 4 and ctx.rank == ctx.size - 1:
                time.sleep(0.05)
            assert_matches(_held(inputs[ctx.rank].copy(), op, into), reference(op, inputs), op, ctx.size)
        lane = _lane(ctx, dtype, op, into)
        assert (lane is not None) == _takes_lane(op, dtype, ctx.size), lane
        assert not ctx.engine.busy()
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
def test_a_mismatch_met_on_the_lane_is_caught_on_every_rank():
    """Every rank has the lane of a kind; the last rank then calls another shape: both named, context usable."""
    with mt.DistributedContext.init() as ctx:
        _kept_lane(ctx, True)
        shape = (19_999,) if ctx.rank == ctx.size - 1 else SHAPE
        expect_mismatch(lambda: mt.all_reduce(np.ones(shape), OP.SUM, out=np.empty(shape), held=True), "20000", "19999")
        np.testing.assert_array_equal(_held(np.ones(SHAPE), OP.SUM, True), np.full(SHAPE, float(ctx.size)))
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
def test_calls_the_lane_declines_take_the_python_path():
    """Another thread's call and arrays not of the lane are declined; sub-groups, traced, unchecked calls have none."""
    with mt.DistributedContext.init() as ctx:
        lane = _kept_lane(ctx, False)
        array, out = np.ones(SHAPE), np.empty(SHAPE)
        assert lane.start_held(array, out) is None, "an in-place lane declines a call into another array"
        assert lane.start_held(np.ones(SHAPE, np.float32), np.ones(SHAPE, np.float32)) is None
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lane.start_held(array, array)))
        thread.start()
        thread.join()
        assert seen == [None], "another thread's call is declined"
        members = list(range(ctx.size))
        for _ in range(2):
            result = mt.all_reduce(np.ones(SHAPE), OP.SUM, members, held=True).resolve().numpy()
            np.testing.assert_array_equal(result, np.full(SHAPE, float(ctx.size)))
        still_usable(ctx)
    for config in (mt.DistributedConfig(check=False), mt.DistributedConfig(trace=os.devnull)):
        with mt.DistributedContext.init(config=config) as ctx:
            for _ in range(3):
                np.testing.assert_array_equal(_held(np.ones(SHAPE), OP.SUM, True), np.full(SHAPE, float(ctx.size)))
            assert _lane(ctx, np.float64, OP.SUM, True) is None


@needs_compiled
@pytest.mark.mpi(min_size=2)
def test_run_held_reduces_at_once_and_declines_as_start_held():
    """`run_held` (what a compiled program's handler calls): the result in `out` when it returns,
    a late peer waited for; overlapping arrays and another thread's call declined, and an
    overlapping `out` refused by the held all-reduce as on its first call."""
    with mt.DistributedContext.init() as ctx:
        lane = _kept_lane(ctx, True)
        for turn in range(3):
            seed = seed_of("run-held", turn)
            inputs = [rank_input(seed, r, SHAPE, np.float64) for r in range(ctx.size)]
            if turn == 2 and ctx.rank == ctx.size - 1:
                time.sleep(0.05)
            out = np.empty(SHAPE)
            assert lane.run_held(inputs[ctx.rank], out) is True
            assert_matches(out, reference(OP.SUM, inputs), OP.SUM, ctx.size)
        whole = np.ones(SHAPE[0] + 1)
        array, overlapping = whole[:-1], whole[1:]
        assert lane.start_held(array, overlapping) is None and lane.run_held(array, overlapping) is None
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lane.run_held(np.ones(SHAPE), np.empty(SHAPE))))
        thread.start()
        thread.join()
        assert seen == [None], "another thread's call is declined"
        with pytest.raises(ValueError, match="overlaps the input"):
            mt.all_reduce(array, OP.SUM, out=overlapping, held=True)
        np.testing.assert_array_equal(_held(np.ones(SHAPE), OP.SUM, True), np.full(SHAPE, float(ctx.size)))
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [True, False])
def test_the_entry_starts_repeated_held_calls_in_place_without_python(check, monkeypatch):
    """``all_reduce(array, op, held=True)`` in place: once the Python path started a kind on its compiled
    lane, the compiled entry starts the next calls of that kind there (Python's entry no more);
    other kinds, ``out=`` and another op object still come through Python. Every result NumPy's."""
    from mpitensor._collectives import lane as lane_module

    entered = []
    python_entry = lane_module.on_held_plan
    monkeypatch.setattr(lane_module, "on_held_plan", lambda *args: entered.append(1) or python_entry(*args))
    kinds = [((2,), np.float32, OP.SUM), (SHAPE, np.float64, OP.SUM), ((3,), np.int64, OP.MAX)]
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for shape, dtype, op in kinds:
            for turn in range(5):
                inputs = [rank_input(seed_of("entry-held", shape, turn), r, shape, dtype) for r in range(ctx.size)]
                before = len(entered)
                result = mt.all_reduce(inputs[ctx.rank].copy(), op, held=True).resolve().numpy()
                assert_matches(result, reference(op, inputs), op, ctx.size)
                plan = kept_plan(ctx, "all_reduce", np.dtype(dtype), shape, op, "held", False)
                compiled = plan.lane.compiled if isinstance(plan, CopiedInto) else plan
                if turn >= 3 and compiled is not None:
                    assert len(entered) == before, f"{shape} {np.dtype(dtype)} {op.name}: Python's entry, turn {turn}"
        assert kept_plan(ctx, "all_reduce", np.dtype(np.float32), (2,), OP.SUM, "held", False) is not None
        before = len(entered)
        out = np.empty(2, np.float32)
        mt.all_reduce(np.ones(2, np.float32), OP.SUM, out=out, held=True).resolve()
        mt.all_reduce(np.ones(2, np.float32), "sum", held=True).resolve()
        assert len(entered) == before + 2, "into out=, and another op object: Python's entry"
        np.testing.assert_array_equal(out, np.full(2, ctx.size, np.float32))
        still_usable(ctx)
    with mt.DistributedContext.init() as ctx:  # a new context: its own plans, its first call in Python
        before = len(entered)
        result = mt.all_reduce(np.ones(2, np.float32), OP.SUM, held=True).resolve().numpy()
        np.testing.assert_array_equal(result, np.full(2, ctx.size, np.float32))
        assert len(entered) == before + 1
