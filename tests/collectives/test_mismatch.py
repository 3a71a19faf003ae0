"""Ranks that disagree get CollectiveMismatchError on every rank, naming both values, and the
context stays usable."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import still_usable

pytestmark = pytest.mark.mpi(min_size=2)


def _odd_one_out(ctx: mt.DistributedContext, usual, odd):
    return odd if ctx.rank == ctx.size - 1 else usual


def _expect_mismatch(call, *fragments: str) -> float:
    start = time.monotonic()
    with pytest.raises(mt.CollectiveMismatchError) as info:
        handle = call()
        handle.resolve()
    seconds = time.monotonic() - start
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return seconds


def test_shapes(ctx):
    last = ctx.size - 1
    shape = _odd_one_out(ctx, (3, 4), (3, 5))
    seconds = _expect_mismatch(
        lambda: mt.all_reduce(np.ones(shape)),
        "Mismatched all_reduce tensor shapes",
        "sent a tensor of shape (3, 4)",
        f"but rank {last} sent a tensor of shape (3, 5)",
    )
    assert seconds < 5
    still_usable(ctx)


def test_dtypes(ctx):
    dtype = _odd_one_out(ctx, np.float32, np.float64)
    _expect_mismatch(
        lambda: mt.all_reduce(np.ones(4, dtype)),
        "Mismatched all_reduce tensor dtypes",
        "sent a tensor of dtype float32",
        f"rank {ctx.size - 1} sent a tensor of dtype float64",
    )
    still_usable(ctx)


def test_ops(ctx):
    op = _odd_one_out(ctx, "sum", "max")
    _expect_mismatch(
        lambda: mt.all_reduce(np.ones(4), op),
        "Mismatched all_reduce reduce ops",
        "asked for SUM",
        f"rank {ctx.size - 1} asked for MAX",
    )
    still_usable(ctx)


def test_roots(ctx):
    root = _odd_one_out(ctx, 0, 1)
    _expect_mismatch(
        lambda: mt.broadcast(np.ones(2), root=root),
        "Mismatched broadcast roots",
        "named root 0",
        f"rank {ctx.size - 1} named root 1",
    )
    still_usable(ctx)


def test_operations(ctx):
    if ctx.rank == ctx.size - 1:
        call = lambda: mt.reduce(np.ones(2), root=0)  # noqa: E731
    else:
        call = lambda: mt.all_reduce(np.ones(2))  # noqa: E731
    _expect_mismatch(call, "called all_reduce", f"rank {ctx.size - 1} called reduce")
    still_usable(ctx)


def test_all_gather_other_dimensions(ctx):
    shape = _odd_one_out(ctx, (ctx.rank + 1, 3), (1, 4))
    _expect_mismatch(lambda: mt.all_gather(np.ones(shape)), "Mismatched all_gather tensor shapes", "(?, 3)", "(?, 4)")
    still_usable(ctx)


def test_fused_structures(ctx):
    names = _odd_one_out(ctx, ["a", "b"], ["a", "c"])
    _expect_mismatch(
        lambda: mt.all_reduce({name: np.ones(2) for name in names}),
        "Mismatched fused all_reduce",
        f"rank {ctx.size - 1}",
    )
    still_usable(ctx)


def test_a_mismatch_raised_by_resolve_when_a_rank_is_late():
    config = mt.DistributedConfig(check_grace=0.05)
    with mt.DistributedContext.init(config=config) as ctx:
        if ctx.rank == 0:
            time.sleep(0.5)
        shape = _odd_one_out(ctx, (2,), (3,))
        pending_or_error = None
        try:
            pending_or_error = mt.all_reduce(np.ones(shape))
        except mt.CollectiveMismatchError as exc:
            pending_or_error = exc
        if isinstance(pending_or_error, mt.CollectiveTensor):
            with pytest.raises(mt.CollectiveMismatchError, match="tensor shapes"):
                pending_or_error.resolve()
        still_usable(ctx)


@pytest.mark.mpi(min_size=3)
def test_groups_on_first_use(ctx):
    # Rank 0 thinks the group is [0, 1]; everyone else calls on the whole context.
    devices = [0, 1] if ctx.rank == 0 else None
    seconds = _expect_mismatch(lambda: mt.all_reduce(np.ones(3), devices=devices), "Mismatched groups")
    assert seconds < 10
    still_usable(ctx)
    if ctx.rank in (0, 1):  # the group works once the ranks agree
        assert mt.all_reduce(np.ones(2), devices=[0, 1]).resolve().numpy().tolist() == [2.0, 2.0]
    still_usable(ctx)


@pytest.mark.mpi(min_size=3)
def test_groups_whose_communicators_exist(ctx):
    if ctx.rank in (0, 1):
        mt.all_reduce(np.ones(1), devices=[0, 1]).resolve()
    still_usable(ctx)
    devices = [0, 1] if ctx.rank == 0 else None
    start = time.monotonic()
    with pytest.raises(mt.CollectiveMismatchError) as info:
        mt.all_reduce(np.ones(3), devices=devices).resolve()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "Mismatched groups" in message
    if ctx.rank == 0:
        assert "rank 1 is in all_reduce on group" in message
    else:
        assert "rank 0 is in all_reduce on group [0, 1]" in message
    still_usable(ctx)
    if ctx.rank in (0, 1):
        assert mt.all_reduce(np.ones(2), devices=[0, 1]).resolve().numpy().tolist() == [2.0, 2.0]
    still_usable(ctx)


@pytest.mark.mpi(min_size=3)
def test_a_slow_rank_is_not_mistaken_for_a_mismatch(ctx):
    # Ranks 0 and 1 run a sub-group collective while the others already wait in a world
    # one; nobody disagrees, rank 0 and 1 are just late for the world collective.
    if ctx.rank in (0, 1):
        time.sleep(1.5)  # longer than the diagnosis waits before it speaks
        mt.all_reduce(np.ones(1), devices=[0, 1]).resolve()
        time.sleep(1.0)
    total = mt.all_reduce(np.ones(2)).resolve()
    assert total.numpy().tolist() == [float(ctx.size)] * 2


# -- gather, scatter, scan, exscan and the object collectives -----------------------------------


def test_gather_roots(ctx):
    root = _odd_one_out(ctx, 0, 1)
    _expect_mismatch(lambda: mt.gather(np.ones(2), root), "Mismatched gather roots", "named root 0",
                     f"rank {ctx.size - 1} named root 1")
    still_usable(ctx)


def test_gather_axes(ctx):
    axis = _odd_one_out(ctx, 0, 1)
    _expect_mismatch(lambda: mt.gather(np.ones((2, 2)), axis=axis), "Mismatched gather",
                     "passed argument 0", f"rank {ctx.size - 1} passed argument 1")
    still_usable(ctx)


def test_gather_dtypes_and_other_dimensions(ctx):
    dtype = _odd_one_out(ctx, np.int32, np.int64)
    _expect_mismatch(lambda: mt.gather(np.ones(2, dtype)), "Mismatched gather tensor dtypes", "int32", "int64")
    shape = _odd_one_out(ctx, (2, 3), (2, 4))
    _expect_mismatch(lambda: mt.gather(np.ones(shape)), "Mismatched gather tensor shapes", "(?, 3)", "(?, 4)")
    still_usable(ctx)


def _scatter_input(ctx, shape, dtype=np.float64):
    return np.ones(shape, dtype) if ctx.rank == 0 else None


def test_scatter_roots(ctx):
    root = _odd_one_out(ctx, 0, 1)
    whole = np.ones(2 * ctx.size)
    _expect_mismatch(lambda: mt.scatter(whole, root), "Mismatched scatter roots", "named root 0",
                     f"rank {ctx.size - 1} named root 1")
    still_usable(ctx)


def test_scatter_counts_and_axes(ctx):
    n = ctx.size
    counts = _odd_one_out(ctx, [2] * n, [3] + [2] * (n - 2) + [1])
    _expect_mismatch(
        lambda: mt.scatter(_scatter_input(ctx, (2 * n,)), 0, counts=counts, shape=(2 * n,), dtype=np.float64),
        "Mismatched scatter arguments", f"counts={[2] * n}", f"counts={counts}",
    )
    axis = _odd_one_out(ctx, 0, 1)
    _expect_mismatch(
        lambda: mt.scatter(_scatter_input(ctx, (n, n)), 0, axis=axis, shape=(n, n), dtype=np.float64),
        "Mismatched scatter arguments", "axis=0, counts=equal", "axis=1, counts=equal",
    )
    still_usable(ctx)


def test_scatter_shapes_and_dtypes_described_by_non_roots(ctx):
    n = ctx.size
    shape = _odd_one_out(ctx, (2 * n,), (4 * n,))
    _expect_mismatch(lambda: mt.scatter(_scatter_input(ctx, (2 * n,)), 0, shape=shape, dtype=np.float64),
                     "Mismatched scatter tensor shapes", f"({2 * n},)", f"({4 * n},)")
    dtype = _odd_one_out(ctx, np.float64, np.float32)
    _expect_mismatch(lambda: mt.scatter(_scatter_input(ctx, (n,)), 0, shape=(n,), dtype=dtype),
                     "Mismatched scatter tensor dtypes", "float64", "float32")
    still_usable(ctx)


@pytest.mark.parametrize("kind", ["scan", "exscan"])
def test_scan_ops_shapes_and_kinds(ctx, kind):
    call = getattr(mt, kind)
    op = _odd_one_out(ctx, "sum", "bxor")
    _expect_mismatch(lambda: call(np.ones(3, np.int64), op), f"Mismatched {kind} reduce ops", "asked for SUM",
                     f"rank {ctx.size - 1} asked for BXOR")
    shape = _odd_one_out(ctx, (3,), (4,))
    _expect_mismatch(lambda: call(np.ones(shape)), f"Mismatched {kind} tensor shapes", "(3,)", "(4,)")
    other = mt.exscan if kind == "scan" else mt.scan
    odd = _odd_one_out(ctx, call, other)
    _expect_mismatch(lambda: odd(np.ones(3)), f"called {kind}", f"rank {ctx.size - 1} called")
    still_usable(ctx)


def test_bitwise_ops_in_all_reduce(ctx):
    op = _odd_one_out(ctx, "band", "bor")
    _expect_mismatch(lambda: mt.all_reduce(np.ones(3, np.int32), op), "Mismatched all_reduce reduce ops",
                     "asked for BAND", f"rank {ctx.size - 1} asked for BOR")
    still_usable(ctx)


@pytest.mark.parametrize("kind", ["broadcast_object", "gather_object"])
def test_object_roots(ctx, kind):
    call = getattr(mt, kind)
    root = _odd_one_out(ctx, 0, 1)
    _expect_mismatch(lambda: call({"rank": ctx.rank}, root), f"Mismatched {kind} roots", "named root 0",
                     f"rank {ctx.size - 1} named root 1")
    still_usable(ctx)


def test_object_collectives_against_each_other(ctx):
    odd = _odd_one_out(ctx, mt.all_gather_object, mt.broadcast_object)
    _expect_mismatch(lambda: odd("x"), "called all_gather_object", f"rank {ctx.size - 1} called broadcast_object")
    still_usable(ctx)
