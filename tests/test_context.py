"""DistributedContext: ranks, devices, groups, nesting and state errors."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.mpi import MPI

pytestmark = pytest.mark.mpi(min_size=1)


def test_ranks_and_devices_follow_the_world(ctx):
    world = MPI.COMM_WORLD
    assert (ctx.rank, ctx.size) == (world.Get_rank(), world.Get_size())
    assert ctx.devices == tuple(mt.Device("cpu", 0, r) for r in range(ctx.size))
    assert ctx.device is ctx.devices[ctx.rank]
    assert list(ctx.devices) == sorted(ctx.devices)
    assert len(ctx.hosts) == ctx.size and ctx.host == ctx.hosts[ctx.rank]
    assert 0 <= ctx.local_rank < ctx.local_size <= ctx.size
    assert ctx.thread_level == "multiple"
    assert mt.current_context() is ctx


def test_context_talks_on_its_own_communicator(ctx):
    assert MPI.Comm.Compare(ctx.comm, MPI.COMM_WORLD) == MPI.CONGRUENT


def test_close_is_idempotent_and_later_use_is_a_clear_error(ctx):
    pending = mt.all_reduce(np.ones(3))
    ctx.close()
    ctx.close()
    assert ctx.closed
    with pytest.raises(mt.ContextClosedError, match="context was closed first"):
        pending.resolve()
    with pytest.raises(mt.ContextClosedError, match="this DistributedContext is closed"):
        _ = ctx.comm
    with pytest.raises(mt.NoContextError, match=r"call mpitensor.DistributedContext.init\(\) first"):
        mt.all_reduce(np.ones(3))
    with pytest.raises(mt.NoContextError):
        mt.current_context()


def test_a_handle_resolved_before_close_stays_resolved(ctx):
    pending = mt.all_reduce(np.ones(2))
    result = pending.resolve()
    ctx.close()
    assert pending.resolve() is result


def test_nested_contexts_the_innermost_is_current(ctx):
    with mt.DistributedContext.init(config=mt.DistributedConfig(all_reduce_op="max")) as inner:
        assert mt.current_context() is inner
        assert mt.all_reduce(np.array([float(ctx.rank)])).resolve().item() == ctx.size - 1
    assert mt.current_context() is ctx
    assert mt.all_reduce(np.array([1.0])).resolve().item() == ctx.size


@pytest.mark.mpi(min_size=2)
def test_a_context_over_some_ranks_only():
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    members = list(range(1, size))
    if rank == 0:
        with mt.DistributedContext.init(devices=[0]) as alone:
            assert alone.size == 1
            assert mt.all_reduce(np.array([4.0])).resolve().item() == 4.0
        return
    with mt.DistributedContext.init(devices=members) as ctx:
        assert ctx.size == size - 1
        assert ctx.rank == rank - 1
        assert [d.rank for d in ctx.devices] == members
        total = mt.all_reduce(np.array([float(rank)])).resolve().item()
        assert total == sum(members)


def test_init_with_devices(ctx):
    devices = [mt.Device("cpu", 0, r) for r in range(ctx.size)]
    with mt.DistributedContext.init(devices=devices) as again:
        assert again.devices == tuple(devices)


def test_bad_init_arguments():
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with pytest.raises(TypeError, match="config must be a DistributedConfig"):
        mt.DistributedContext.init(config={"check": False})
    with pytest.raises(TypeError, match="devices must be a list"):
        mt.DistributedContext.init(devices=0)
    with pytest.raises(ValueError, match=rf"rank {size} is out of range"):
        mt.DistributedContext.init(devices=[rank, size])
    with pytest.raises(ValueError, match="names a rank twice"):
        mt.DistributedContext.init(devices=[rank, rank])
    with pytest.raises(ValueError, match="every Device passed to init must name its rank"):
        mt.DistributedContext.init(devices=[mt.Device("cpu")])
    with pytest.raises(TypeError, match=r"use DistributedContext\.init"):
        mt.DistributedContext()


@pytest.mark.mpi(min_size=2)
def test_init_without_this_rank_is_rejected():
    rank = MPI.COMM_WORLD.Get_rank()
    other = (rank + 1) % MPI.COMM_WORLD.Get_size()
    expected = rf"rank {rank} called DistributedContext\.init with devices of ranks \[{other}\]"
    with pytest.raises(ValueError, match=expected):
        mt.DistributedContext.init(devices=[other])


def test_bad_group_arguments(ctx):
    with pytest.raises(ValueError, match="devices is empty"):
        mt.all_reduce(np.ones(1), devices=[])
    with pytest.raises(ValueError, match=rf"rank {ctx.size + 3} is out of range for a context of {ctx.size} ranks"):
        mt.all_reduce(np.ones(1), devices=[ctx.rank, ctx.size + 3])
    with pytest.raises(mt.DeviceError, match=r"device cuda:0@rank0 is not in this context"):
        mt.all_reduce(np.ones(1), devices=[mt.Device("cuda", 0, 0)])
    with pytest.raises(TypeError, match=r"devices must be a list of mpitensor\.Device"):
        mt.all_reduce(np.ones(1), devices=ctx.device)
    if ctx.size > 1:
        other = (ctx.rank + 1) % ctx.size
        with pytest.raises(ValueError, match=rf"this rank \({ctx.rank}\) is not in the group \[{other}\]"):
            mt.all_reduce(np.ones(1), devices=[other])


def test_barrier(ctx):
    mt.barrier()
    mt.barrier(devices=[ctx.rank])


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_cannot_have_its_device_fails_init_on_every_rank():
    size = MPI.COMM_WORLD.Get_size()
    devices = [mt.Device("cuda", 999, r) if r == 1 else mt.Device("cpu", 0, r) for r in range(size)]
    own = MPI.COMM_WORLD.Get_rank() == 1
    expected = "^rank 1 was asked for device cuda:999" if own else "failed on other ranks, .*: rank 1: rank 1 was asked"
    with pytest.raises(mt.DeviceError, match=expected):
        mt.DistributedContext.init(devices=devices)
    with mt.DistributedContext.init() as ctx:  # nothing was left behind
        assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size
