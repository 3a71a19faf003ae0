"""The staged all-reduce's host side: which host transport reduces the staged copy, and its result.

A GPU input is copied into pinned memory and `staged.host_reduction` hands that copy to the
first host transport of `select.STAGED_ALL_REDUCE` that applies. Here the copy is a NumPy
array standing for the pinned buffer, the event the copy ends with is a plain object with
a ``done`` attribute, the MPI operations are real, and the device-side fix-up
(`fix_up.apply`) runs with NumPy in place of CuPy: everything but the copies themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.dtypes import reduce_plan
from mpitensor._transport.base import PrivateCopy, ReduceCall, select
from mpitensor._transport.gpu.after_event import AfterEvent
from mpitensor._transport.gpu.fix_up import FixUp, apply
from mpitensor._transport.gpu.staged import host_reduction, result_fix
from mpitensor._transport.mpi import SMALL_BYTES, OnCopy
from mpitensor._transport.select import ALL_REDUCE
from mpitensor._transport.shm import SharedMemory
from tests.helpers import OP, assert_matches, rank_input, reference, seed_of


class Event:
    """Stands for the CUDA event after the copy to the host: done once `done` is set."""

    def __init__(self) -> None:
        self.done = False


def _reduce_staged_copy(ctx: mt.DistributedContext, op: mt.ReduceOperation, local: np.ndarray):
    """Reduce `local` as the staged path does: a copy in the work dtype, started once 'copied'."""
    plan = reduce_plan(op, local.dtype)
    copy = local.astype(plan.work_dtype)  # what the device sends (converted there)
    call = host_reduction(ctx, ctx.full_group, copy, plan, local.nbytes)
    copied = Event()
    stepper = AfterEvent(copied, call.start)
    # Until the copy has arrived, nothing starts and the group is held.
    assert stepper.advance() is False
    assert stepper.holding
    copied.done = True
    while not stepper.advance():
        pass
    final = np.empty(local.shape, plan.out_dtype)
    fix = result_fix(call, FixUp(ctx.size if plan.divide else None, final, plan.codec))
    result = np.array(call.out)  # the copy back to the device
    apply(np, result, fix)
    return call, final


CASES = [
    (OP.SUM, np.float32), (OP.SUM, np.int32), (OP.SUM, np.complex64), (OP.MAX, np.float32),
    (OP.MIN, np.float64), (OP.MAX, np.complex64), (OP.MEAN, np.float32), (OP.MEAN, np.int32),
    (OP.SUM, np.float16), (OP.MAX, np.float16), (OP.BOR, np.bool_), (OP.PROD, np.int16),
]


@pytest.mark.mpi
@pytest.mark.parametrize("shared_memory", [True, False])
@pytest.mark.parametrize("op,dtype", CASES)
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 700)])
def test_staged_copy_reduces_to_the_reference(shared_memory, op, dtype, shape):
    config = mt.DistributedConfig(shared_memory=shared_memory, device="cpu")
    with mt.DistributedContext.init(config=config) as ctx:
        seed = seed_of("staged", op, dtype, shape)
        local = rank_input(seed, ctx.rank, shape, dtype)
        if op is OP.MAX and np.dtype(dtype).kind == "f" and local.size:
            local.flat[0] = np.nan if ctx.rank == 0 else local.flat[0]  # NaN wins, as in NumPy
        call, result = _reduce_staged_copy(ctx, op, local)
        expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
        if op is OP.MAX and np.dtype(dtype).kind == "f" and local.size:
            expected.flat[0] = np.nan
        assert_matches(result, expected, op, ctx.size)
        # The pinned copy itself is what MPI reduces in place, unless shared memory takes it.
        if isinstance(call.transport, OnCopy):
            assert not call.decoded
            assert call.out is call.source.buffer


@pytest.mark.mpi
@pytest.mark.parametrize("shared_memory", [True, None, False])
@pytest.mark.parametrize("count", [SMALL_BYTES // 4, SMALL_BYTES // 4 + 1, 1 << 18])
def test_staged_copy_takes_the_transport_a_host_input_would(shared_memory, count):
    """A rank with a GPU input runs the algorithm a rank with the host input of that size runs.

    (In place through MPI up to 64 KiB whatever the settings, then shared memory where it
    applies: a mixed group must never have one rank in shared memory and another in MPI.)
    """
    config = mt.DistributedConfig(shared_memory=shared_memory, device="cpu")
    with mt.DistributedContext.init(config=config) as ctx:
        local = np.ones(count, np.float32)
        call, result = _reduce_staged_copy(ctx, OP.SUM, local)
        host = mt.all_reduce(local).resolve()  # the host input of the same size, on the same ranks
        np.testing.assert_array_equal(result, np.asarray(host))
        host_call = ReduceCall(ctx, ctx.full_group, PrivateCopy(local), call.plan, local.nbytes)
        shm = isinstance(select(ALL_REDUCE, host_call), SharedMemory)
        assert isinstance(call.transport, SharedMemory if shm else OnCopy), (call.transport.name, shm)
        assert call.decoded == shm
        if count == SMALL_BYTES // 4 or shared_memory is False:
            assert not shm, "small messages, or shared memory off: MPI on every rank"


def test_result_fix_decodes_only_keys():
    plan = reduce_plan(OP.MAX, np.float32)

    class Call:
        decoded = False

    call = Call()
    call.plan = plan
    fix = FixUp(None, None, None)
    assert result_fix(call, fix).decode is plan.codec
    call.decoded = True
    assert result_fix(call, fix).decode is None
    assert result_fix(call, FixUp(4, "into")).divide_by == 4
