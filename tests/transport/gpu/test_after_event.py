"""A GPU collective starts its MPI operation only once its input is ready, and never blocks.

`AfterEvent` polls a CUDA event's ``done``; here the event is a plain object with that
attribute (no GPU needed) and the MPI operations are real. The engine must post nothing
else on the group's communicator while an `AfterEvent` waits, or ranks whose GPU work ends
at different times would post their MPI operations in different orders.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives.common import check_record, start
from mpitensor._core.mpi import MPI
from mpitensor._runtime.check import Record
from mpitensor._runtime.engine import Op
from mpitensor._transport.gpu.after_event import AfterEvent


class Event:
    """Stands for a CUDA event: the work before it is done once `finish()` is called."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def finish(self) -> None:
        self.done = True


class Steps:
    """A stepper that finishes after `steps` calls of advance()."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def advance(self) -> bool:
        self.left -= 1
        return self.left <= 0


def test_nothing_starts_before_the_event_is_done():
    started = []
    event = Event()
    stepper = AfterEvent(event, lambda: started.append(1) or [])
    for _ in range(3):
        assert stepper.advance() is False
    assert started == [] and stepper.holding
    event.finish()
    assert stepper.advance() is True
    assert started == [1] and not stepper.holding


def test_a_started_stepper_is_driven_to_its_end():
    stepper = AfterEvent(Event(done=True), lambda: Steps(3))
    assert [stepper.advance() for _ in range(3)] == [False, False, True]


def test_a_failed_start_stops_holding_the_group():
    def start() -> list:
        raise RuntimeError("the codec failed")

    stepper = AfterEvent(Event(done=True), start)
    with pytest.raises(RuntimeError, match="the codec failed"):
        stepper.advance()
    assert not stepper.holding


@pytest.mark.mpi(min_size=2)
def test_the_mpi_request_is_posted_once_the_event_is_done_and_then_tested():
    comm = MPI.COMM_WORLD.Dup()
    try:
        data = np.full(4, comm.Get_rank() + 1.0)
        event = Event()
        stepper = AfterEvent(event, lambda: [comm.Iallreduce(MPI.IN_PLACE, data, MPI.SUM)])
        assert stepper.advance() is False
        comm.Barrier()  # every rank has advanced once: no request yet, no rank blocked
        event.finish()
        while not stepper.advance():
            pass
        expected = sum(r + 1.0 for r in range(comm.Get_size()))
        assert data.tolist() == [expected] * 4
    finally:
        comm.Free()


def _held_all_reduce(ctx: mt.DistributedContext, data: np.ndarray, event: Event) -> Op:
    """An all-reduce of `data` whose MPI operation waits for `event`, as a GPU one does."""
    group = ctx.full_group
    comm = group.comm
    record = check_record(ctx, group, Record("all_reduce", mt.ReduceOperation.SUM, data.dtype, data.shape, -1,
                                             group.members))

    def post() -> AfterEvent:
        return AfterEvent(event, lambda: [comm.Iallreduce(MPI.IN_PLACE, data, MPI.SUM)])

    op = Op("all_reduce", group, data.nbytes, post, None, record, (data,), ())
    start(ctx, op, None)
    return op


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [True, False])
def test_later_calls_return_at_once_and_post_after_the_held_one(check):
    # Rank 0's input is ready at once, every other rank's only after its later calls: had
    # those been posted first, the ranks' MPI operations would pair up wrongly.
    config = mt.DistributedConfig(device="cpu", check=check)
    with mt.DistributedContext.init(config=config) as ctx:
        rank, size = ctx.rank, ctx.size
        data = np.full(8, rank + 1.0)
        event = Event(done=rank == 0)
        held = _held_all_reduce(ctx, data, event)
        later = [mt.all_reduce(np.full(8, 10.0 * (rank + 1) + k)) for k in range(3)]
        if rank != 0:
            assert held.stepper is not None and held.stepper.holding
            assert all(not handle.test() for handle in later), "posted before the held operation"
        event.finish()
        results = [handle.resolve().numpy() for handle in later]
        ctx.engine.wait(held, 60)
        assert data.tolist() == [sum(r + 1.0 for r in range(size))] * 8
        for k, result in enumerate(results):
            assert result.tolist() == [sum(10.0 * (r + 1) + k for r in range(size))] * 8


def test_a_bucket_is_ready_once_every_copy_into_it_is_done():
    from mpitensor._transport.gpu.after_event import AllDone

    copies = [Event(), Event(), Event()]
    ready = AllDone(copies)
    copies[2].finish()
    assert not ready.done
    copies[0].finish()
    assert not ready.done
    copies[1].finish()
    assert ready.done and ready.done
    assert AllDone([]).done
