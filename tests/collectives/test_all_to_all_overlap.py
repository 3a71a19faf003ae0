"""all_to_all given its own input as out=: a clear refusal saying what to pass, the input left writable."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt

pytestmark = pytest.mark.mpi(min_size=2)

OVERLAP = ("all_to_all: out= overlaps the input; all_to_all cannot write its result over its own input (a block "
           "would be overwritten before it is sent): pass a separate array of the result's shape and dtype, such as "
           "numpy.empty_like(input), or no out= for a new one")


def _inputs(size: int) -> list[np.ndarray]:
    return [np.arange(2.0 * size) + 100 * r for r in range(size)]


def _expected(inputs: list[np.ndarray], rank: int) -> np.ndarray:
    """What rank `rank` receives: block `rank` (2 elements) of every rank's input, in rank order."""
    return np.concatenate([x[2 * rank:2 * rank + 2] for x in inputs])


def _next_is_right(ctx: mt.DistributedContext) -> None:
    inputs = _inputs(ctx.size)
    out = np.empty_like(inputs[ctx.rank])
    got = mt.all_to_all(inputs[ctx.rank], out=out).resolve()
    np.testing.assert_array_equal(got.numpy(), _expected(inputs, ctx.rank))
    np.testing.assert_array_equal(out, _expected(inputs, ctx.rank))


@pytest.mark.parametrize("how", ["itself", "a-view", "a-tensor", "splits"])
def test_out_that_is_the_input_is_refused_on_every_rank_with_what_to_pass(ctx, how):
    x = _inputs(ctx.size)[ctx.rank].copy()
    before = x.copy()
    kwargs = {"splits": [2] * ctx.size} if how == "splits" else {}
    target = x
    if how == "a-view":
        target = x.reshape(ctx.size, 2)[:].reshape(-1)
    elif how == "a-tensor":
        target = x = mt.from_numpy(x)
    with pytest.raises(ValueError) as info:
        mt.all_to_all(x, out=target, **kwargs).resolve()
    assert str(info.value) == OVERLAP
    array = x.numpy() if isinstance(x, mt.Tensor) else x
    assert array.flags.writeable  # not left protected by the refused call
    np.testing.assert_array_equal(array, before)
    _next_is_right(ctx)


def test_out_that_is_the_input_on_one_rank_fails_its_peers_call_too(ctx):
    inputs = _inputs(ctx.size)
    x = inputs[ctx.rank].copy()
    if ctx.rank == 0:
        with pytest.raises(ValueError) as info:
            mt.all_to_all(x, out=x).resolve()
        assert str(info.value) == OVERLAP
    else:
        with pytest.raises(mt.CollectiveMismatchError) as info:
            mt.all_to_all(x, out=np.empty_like(x)).resolve()
        assert "rank 0" in str(info.value) and "out= overlaps the input" in str(info.value), str(info.value)
    _next_is_right(ctx)


def test_an_out_of_the_wrong_shape_leaves_the_input_writable(ctx):
    x = _inputs(ctx.size)[ctx.rank].copy()
    with pytest.raises(ValueError, match=r"all_to_all: out= has shape \(3,\), but the result has shape"):
        mt.all_to_all(x, out=np.empty(3)).resolve()
    assert x.flags.writeable
    x[0] = x[0]
    _next_is_right(ctx)
