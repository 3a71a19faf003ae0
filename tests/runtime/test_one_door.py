"""A failed call takes its turn on its own group only, whichever door it came through.

Each case once gave a silent wrong number: a rank outside a sub-group that called the
group's collective posted its failed turn on the whole context, and the members' next
whole-context call paired with it (every later call one step apart); a shape error raised
while one rank traced an `mpitensor.jax` collective took no turn, and the peer's compiled
call paired with that rank's next batch. Every rank now gets the right result or
`CollectiveMismatchError`, and the next calls are right.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt


def _whole(ctx, step):
    """A whole-context all-reduce of this step's value, checked against NumPy's sum of every rank's."""
    got = mt.all_reduce(np.full(3, 100.0 * step + ctx.rank)).resolve().numpy()
    np.testing.assert_array_equal(got, np.full(3, sum(100.0 * step + r for r in range(ctx.size))))


@pytest.mark.mpi(min_size=3)
def test_a_rank_outside_a_group_that_calls_its_collective_takes_no_turn(ctx):
    members = [0, ctx.size - 1]
    for step in range(3):
        x = np.full(2, 10.0 * step + ctx.rank + 1)
        if ctx.rank in members:
            got = mt.all_reduce(x, devices=members).resolve().numpy()
            np.testing.assert_array_equal(got, np.full(2, sum(10.0 * step + r + 1 for r in members)))
        else:
            with pytest.raises(ValueError, match=rf"this rank \({ctx.rank}\) is not in the group \{members}"):
                mt.all_reduce(x, devices=members)
        _whole(ctx, step)


@pytest.mark.mpi(min_size=3)
def test_a_rank_outside_a_group_that_calls_its_collective_in_a_door_takes_no_turn(ctx):
    members = [0, ctx.size - 1]
    for step in range(2):
        x = np.full(2, float(ctx.rank + step))
        outside = pytest.raises(ValueError, match="not in the group") if ctx.rank not in members else _nothing()
        with outside, mt.collective_call("all_reduce", members):
            got = mt.all_reduce(x, devices=members).resolve().numpy()
            np.testing.assert_array_equal(got, np.full(2, float(sum(members) + 2 * step)))
        _whole(ctx, step)


@pytest.mark.mpi(min_size=2)
def test_an_error_inside_a_door_takes_the_turn_of_its_call(ctx):
    last = ctx.size - 1
    for step in range(2):
        try:
            with mt.collective_call("all_reduce"):
                if ctx.rank == last:
                    raise ValueError("the backend's own check failed here")
                mt.all_reduce(np.ones(4)).resolve()
            outcome = None
        except Exception as exc:
            outcome = exc
        if ctx.rank == last:
            assert type(outcome) is ValueError and "own check failed" in str(outcome)
        else:
            assert isinstance(outcome, mt.CollectiveMismatchError), repr(outcome)
            assert f"rank {last}'s all_reduce failed on that rank: ValueError: the backend's own check" in str(outcome)
        _whole(ctx, step)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- mpitensor.jax ------------------------------------------------------------------------


@pytest.mark.mpi(min_size=3)
def test_a_rank_outside_a_group_in_a_jitted_call_takes_no_turn(ctx):
    jax = pytest.importorskip("jax")
    mtj = pytest.importorskip("mpitensor.jax")
    members = (0, ctx.size - 1)
    step_of = jax.jit(lambda x: mtj.all_reduce(x, devices=members))
    whole_of = jax.jit(mtj.all_reduce)
    for step in range(3):
        x = np.full(2, 10.0 * step + ctx.rank + 1, np.float32)
        if ctx.rank in members:
            got = np.asarray(step_of(x))
            np.testing.assert_array_equal(got, np.full(2, sum(10.0 * step + r + 1 for r in members), np.float32))
        else:
            with pytest.raises(Exception, match="is not in the group"):
                np.asarray(step_of(x))
        got = np.asarray(whole_of(np.full(3, 100.0 * step + ctx.rank, np.float32)))
        np.testing.assert_array_equal(got, np.full(3, sum(100.0 * step + r for r in range(ctx.size)), np.float32))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["all_to_all", "scatter"])
def test_a_shape_error_while_one_rank_traces_takes_its_turn(ctx, kind):
    jax = pytest.importorskip("jax")
    mtj = pytest.importorskip("mpitensor.jax")
    size, last = ctx.size, ctx.size - 1
    call = jax.jit(mtj.all_to_all) if kind == "all_to_all" else jax.jit(lambda x: mtj.scatter(x, 0))
    for step in range(2):
        rows = size * 2 if kind == "all_to_all" else (size if ctx.rank == 0 else 1)
        bad = ctx.rank == last if kind == "all_to_all" else ctx.rank == 0
        # The bad rank's first axis cannot be cut (all_to_all) or is not one row per rank (scatter).
        shape = (rows + 1,) if bad else (rows,)
        if kind == "scatter" and ctx.rank != 0:
            shape = ()
        x = np.full(shape, float(step + 1), np.float32) * (ctx.rank + 1)
        try:
            np.asarray(call(x))
            outcome = None
        except Exception as exc:
            outcome = exc
        culprit = last if kind == "all_to_all" else 0
        if ctx.rank == culprit:
            assert isinstance(outcome, ValueError), repr(outcome)
        else:
            assert outcome is not None and f"rank {culprit}'s {kind} failed on that rank: ValueError" in str(outcome), \
                repr(outcome)
        _whole(ctx, step)
