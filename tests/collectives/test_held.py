"""`all_reduce(..., held=True)`: an input its caller holds unchanged, reduced in its own memory or into its buffer.

The torch backend's all-reduces take it in place, mpitensor.jax's into XLA's result buffer.
Every rank's result is compared with the NumPy reference of every rank's input, with the
check on (MPI's blocking all-reduce, once the check agreed) and off (the nonblocking one),
and the inputs MPI cannot reduce where they are (small ones in place, bool, half precision,
MAX/MIN of floats) are reduced by the ordinary all-reduce, their result written into the
caller's buffer; a result of another dtype (MEAN of integers) cannot land in the input.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP, assert_matches, rank_input, reference, rejects, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

SHAPES = [(12_000,), (300, 1000)]  # 96 KiB to 2.4 MB of float64
DTYPES = [np.bool_, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64, np.complex128]


@pytest.fixture(scope="module", params=[True, False], ids=["checked", "unchecked"])
def held_ctx(request):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=request.param)) as ctx:
        yield ctx


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_every_op_and_dtype_against_numpy(held_ctx, op, dtype, shape):
    ctx = held_ctx
    seed = seed_of("held", op.name, np.dtype(dtype).name, shape)
    array = rank_input(seed, ctx.rank, shape, dtype)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.all_reduce(array, op, held=True)
        return
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    if expected.dtype != array.dtype:  # MEAN of integers: a float64 result cannot land in the input
        with pytest.raises(TypeError, match="cannot be written into the input"):
            mt.all_reduce(array, op, held=True)
        return
    result = mt.all_reduce(array, op, held=True).resolve().numpy()
    assert_matches(result, expected, op, ctx.size)
    assert np.shares_memory(result, array), "the result is the input's memory"
    assert_matches(array, expected, op, ctx.size)


def test_small_inputs_take_all_reduce_and_land_in_the_input(held_ctx):
    ctx = held_ctx
    for turn in range(3):  # the first call of the kind, then its kept plan
        array = np.full(100, float(ctx.rank + 1 + turn))
        result = mt.all_reduce(array, OP.SUM, held=True).resolve().numpy()
        expected = np.full(100, float(sum(range(1 + turn, ctx.size + 1 + turn))))
        np.testing.assert_array_equal(result, expected)
        assert np.shares_memory(result, array), "the result is the input's memory"
        np.testing.assert_array_equal(array, expected)


def test_many_calls_in_flight_complete_in_order(held_ctx):
    ctx = held_ctx
    arrays = [np.full(20_000, float(index + ctx.rank)) for index in range(5)]
    handles = [mt.all_reduce(array, OP.SUM, held=True) for array in arrays]
    base = sum(range(ctx.size))
    for index, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.resolve().numpy(), np.full(20_000, float(index * ctx.size + base)))


@pytest.mark.parametrize("shape", [(2,), (3000,), *SHAPES], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_into_out_every_op_and_dtype_against_numpy(held_ctx, op, dtype, shape):
    ctx = held_ctx
    seed = seed_of("held-into", op.name, np.dtype(dtype).name, shape)
    array = rank_input(seed, ctx.rank, shape, dtype)
    array.flags.writeable = False  # an input read where it is may be read-only (XLA's)
    kept = array.copy()
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.all_reduce(array, op, out=np.empty_like(array), held=True)
        return
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    if expected.dtype != array.dtype:  # MEAN of integers: all_reduce's float64 result, out not taken
        with pytest.raises(TypeError, match="but the result has dtype float64"):
            mt.all_reduce(array, op, out=np.empty_like(array), held=True).resolve()
        return
    out = np.empty_like(array)
    result = mt.all_reduce(array, op, out=out, held=True).resolve().numpy()
    assert np.shares_memory(result, out), "the result is out"
    assert_matches(out, expected, op, ctx.size)
    np.testing.assert_array_equal(array, kept)


def test_into_out_refuses_what_it_cannot_write_on_the_calling_rank(held_ctx):
    memory = np.ones(1001)
    array = memory[:1000]
    for out, message in [(np.ones(999), "out must be"), (np.ones(1000, np.float32), "out must be"),
                         (np.ones(2000)[::2], "out must be"), (memory[1:], "overlaps the input"),
                         (array.tolist(), "out must be")]:
        with pytest.raises(ValueError, match=message):
            mt.all_reduce(array, OP.SUM, out=out, held=True)
    result = mt.all_reduce(array, OP.SUM, out=np.empty(1000), held=True).resolve().numpy()  # nothing was started
    np.testing.assert_array_equal(result, np.full(1000, float(held_ctx.size)))


# A held call in place (rank 0) against a peer's all_reduce, and a held call into out against
# a peer's held call in place: each pair is told apart by the check, never run as two algorithms.
_CALLS = {
    "held in place": lambda array: mt.all_reduce(array, OP.SUM, held=True),
    "held into out": lambda array: mt.all_reduce(array, OP.SUM, out=np.empty_like(array), held=True),
    "all_reduce": lambda array: mt.all_reduce(array, OP.SUM),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("mine", "theirs"), [("held in place", "all_reduce"), ("held into out", "held in place")])
def test_a_held_call_against_a_peers_other_kind_is_a_mismatch_on_every_rank(held_ctx, mine, theirs):
    if not held_ctx.config.check:
        pytest.skip("the check tells the two apart")
    with pytest.raises(mt.CollectiveMismatchError, match="in_place"):
        _CALLS[mine if held_ctx.rank == 0 else theirs](np.ones(20_000)).resolve()
    for kind in (mine, theirs):  # the group is still usable (a fresh input: in place changes it)
        result = _CALLS[kind](np.ones(20_000)).resolve().numpy()
        np.testing.assert_array_equal(result, np.full(20_000, float(held_ctx.size)))
