"""all_reduce with the consistency check off, above the small-message size.

Such a call is posted at once, without the engine's queue: these tests hold that path to
the same contract as the checked one (NumPy references of every rank's input, inputs
protected in flight, dropped handles safe), with shared memory off and on.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._transport.mpi import SMALL_BYTES
from tests.helpers import OP, assert_matches, rank_input, reference, rejects, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

SHAPES = [(10_000,), (70, 300), (1 << 16,)]  # 80 KiB to 512 KiB of float64
DTYPES = [np.bool_, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64, np.complex128]


@pytest.fixture(scope="module", params=[False, None], ids=["plain", "shared-memory-by-size"])
def unchecked_ctx(request):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False, shared_memory=request.param)) as ctx:
        yield ctx


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_every_op_and_dtype_against_numpy(unchecked_ctx, op, dtype, shape):
    ctx = unchecked_ctx
    seed = seed_of("unchecked", op.name, np.dtype(dtype).name, shape)
    mine = rank_input(seed, ctx.rank, shape, dtype)
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            mt.all_reduce(mt.tensor(mine), op)
        return
    result = mt.all_reduce(mt.tensor(mine), op).resolve()
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    assert result.shape == shape
    assert_matches(result, expected, op, ctx.size)


def test_temporaries_and_dropped_handles_leave_later_results_intact(unchecked_ctx):
    ctx = unchecked_ctx
    inputs = [rank_input(seed_of("dropped", i), ctx.rank, (9000,), np.float64) for i in range(6)]
    for array in inputs[:3]:
        mt.all_reduce(mt.tensor(array.copy()))  # dropped unresolved, input a temporary
    gc.collect()
    kept = [mt.all_reduce(mt.tensor(array.copy())) for array in inputs[3:]]
    gc.collect()
    for index, pending in enumerate(kept, start=3):
        expected = reference(OP.SUM, [rank_input(seed_of("dropped", index), r, (9000,), np.float64)
                                      for r in range(ctx.size)])
        assert_matches(pending.resolve(), expected, OP.SUM, ctx.size)


def test_results_kept_alive_are_not_reused_by_later_calls(unchecked_ctx):
    ctx = unchecked_ctx
    results = [mt.all_reduce(np.full(8192, float(i + ctx.rank))).resolve() for i in range(4)]
    base = sum(range(ctx.size))
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.numpy(), np.full(8192, float(i * ctx.size + base)))


COUNT = 2 * SMALL_BYTES // 8  # float64s above the size small inputs are copied at


@pytest.mark.mpi(min_size=2)
def test_inputs_refuse_writes_in_flight_and_accept_them_after():
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False, shared_memory=False)) as ctx:
        if ctx.rank == 0:
            time.sleep(0.3)  # the others' all-reduces are certainly still in flight
        tensor = mt.arange(COUNT, dtype=np.float64)
        array = np.arange(float(COUNT))
        pending_tensor = mt.all_reduce(tensor)
        pending_array = mt.all_reduce(array, mt.ReduceOperation.MEAN)
        if ctx.rank != 0:
            assert not pending_tensor.done
            with pytest.raises(mt.TensorInFlightError):
                tensor[0] = 1.0
            with pytest.raises(ValueError, match="read-only"):
                array[0] = 1.0
        np.testing.assert_array_equal(pending_tensor.resolve().numpy(), np.arange(float(COUNT)) * ctx.size)
        np.testing.assert_array_equal(pending_array.resolve().numpy(), np.arange(float(COUNT)))
        tensor[0] = 1.0
        array[0] = 1.0


def test_an_input_numpy_cannot_make_writable_again_is_copied(unchecked_ctx):
    ctx = unchecked_ctx
    # A view of memory exposed by __array_interface__ alone: NumPy would refuse to make it
    # writable again, so the collective must read a copy instead of locking it.
    owner = np.full(12_000, float(ctx.rank + 1))

    class Exposed:
        __array_interface__ = owner.__array_interface__

    array = np.asarray(Exposed())
    pending = mt.all_reduce(array)
    array[0] = 100.0  # allowed: the collective reads its own copy
    expected = np.full(12_000, float(sum(range(1, ctx.size + 1))))
    np.testing.assert_array_equal(pending.resolve().numpy(), expected)
    assert array.flags.writeable
