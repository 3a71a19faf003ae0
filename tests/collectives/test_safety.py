"""Nothing is corrupted: inputs are protected in flight, dropped handles are safe."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP, assert_matches, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)


def _late_rank_zero(config: mt.DistributedConfig) -> mt.DistributedContext:
    """A context in which rank 0 joins the next collective late, so that the other ranks'
    collective is certainly still in flight when they look at it."""
    ctx = mt.DistributedContext.init(config=config)
    if ctx.rank == 0:
        time.sleep(0.3)
    return ctx


BIG = 1 << 16  # 512 KiB of float64: protected in flight, not copied


@pytest.mark.mpi(min_size=2)
def test_a_numpy_input_is_read_only_while_in_flight():
    with _late_rank_zero(mt.DistributedConfig(check=False)) as ctx:
        data = np.arange(float(BIG))
        pending = mt.all_reduce(data)
        if ctx.rank != 0:
            assert not pending.done
            with pytest.raises(ValueError, match="read-only"):
                data[0] = 100.0
        result = pending.resolve()
        np.testing.assert_array_equal(result.numpy(), np.arange(float(BIG)) * ctx.size)
        data[0] = 100.0  # writable again once MPI is done


@pytest.mark.mpi(min_size=2)
def test_a_small_input_is_copied_so_writing_it_cannot_change_the_result():
    with _late_rank_zero(mt.DistributedConfig(check=False)) as ctx:
        data = np.arange(6.0)
        pending = mt.all_reduce(data)
        data[:] = 100.0  # allowed at once: the collective reads its own copy
        np.testing.assert_array_equal(pending.resolve().numpy(), np.arange(6.0) * ctx.size)


@pytest.mark.mpi(min_size=2)
def test_a_tensor_input_refuses_writes_while_in_flight():
    with _late_rank_zero(mt.DistributedConfig(check=False)) as ctx:
        data = mt.arange(BIG, dtype=np.float64)
        pending = mt.all_reduce(data)
        if ctx.rank != 0:
            assert not pending.done
            with pytest.raises(mt.TensorInFlightError, match=r"call resolve\(\) on its CollectiveTensor"):
                data[0] = 5.0
            with pytest.raises(mt.TensorInFlightError):
                data += 1
            with pytest.raises(ValueError, match="read-only"):
                data.numpy()[1] = 7.0
        result = pending.resolve()
        np.testing.assert_array_equal(result.numpy(), np.arange(float(BIG)) * ctx.size)
        data[0] = 5.0
        data += 1
        assert data.numpy()[:4].tolist() == [6.0, 2.0, 3.0, 4.0]


@pytest.mark.mpi(min_size=2)
def test_assume_resolved_output_refuses_writes_until_complete():
    with _late_rank_zero(mt.DistributedConfig(check=False)) as ctx:
        if ctx.rank == 0:
            mt.all_reduce(np.ones(3)).resolve()
            return
        pending = mt.all_reduce(np.ones(3))
        early = pending.assume_resolved()
        with pytest.raises(mt.TensorInFlightError):
            early[0] = 2.0
        assert pending.resolve() is early
        early[0] = 2.0


def test_results_fed_back_as_inputs(ctx):
    # Pooled results are ordinary arrays: protecting them in flight and releasing them works.
    first = mt.all_reduce(np.ones(BIG)).resolve()
    second = mt.all_reduce(first).resolve()
    third = mt.all_reduce(second.numpy(), "max").resolve()
    np.testing.assert_array_equal(third.numpy(), np.full(BIG, float(ctx.size) ** 2))
    first[0] = 0.0
    second.numpy()[0] = 0.0


def test_inputs_over_memory_numpy_cannot_make_writable_again_are_copied(ctx):
    class Foreign:
        def __init__(self, array):
            self.keep = array
            self.__array_interface__ = array.__array_interface__

    backing = np.ones(BIG)
    foreign = np.asarray(Foreign(backing))
    result = mt.all_reduce(foreign).resolve()
    np.testing.assert_array_equal(result.numpy(), np.full(BIG, float(ctx.size)))
    assert foreign.flags.writeable
    foreign[0] = 2.0


def test_an_input_that_was_read_only_stays_read_only(ctx):
    data = np.ones(3)
    data.flags.writeable = False
    mt.all_reduce(data).resolve()
    assert not data.flags.writeable


def test_the_same_input_in_two_collectives_at_once(ctx):
    data = np.ones(5)
    first, second = mt.all_reduce(data), mt.all_reduce(data, "max")
    first.resolve()
    np.testing.assert_array_equal(second.resolve().numpy(), np.ones(5))
    data[0] = 3.0


def test_dropped_handles_and_temporaries_do_not_corrupt_later_results(ctx):
    for i in range(40):
        mt.all_reduce(mt.tensor(rank_input(i, ctx.rank, (1000,), np.float64)))  # dropped unresolved
    gc.collect()
    for i in range(5):
        got = mt.all_reduce(mt.tensor(rank_input(100 + i, ctx.rank, (3000,), np.float32)), "sum").resolve()
        expected = reference(OP.SUM, [rank_input(100 + i, r, (3000,), np.float32) for r in range(ctx.size)])
        assert_matches(got, expected, OP.SUM, ctx.size)


def test_close_completes_everything_in_flight(ctx):
    inputs = [np.full(10_000, float(i)) for i in range(8)]
    handles = [mt.all_reduce(x) for x in inputs]
    del handles
    ctx.close()
    for x in inputs:
        x[0] = -1.0  # every input was released: MPI is done with them
