"""The progress thread: communication advances while the program computes."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._runtime.engine import COMPLETE
from tests.helpers import ARITHMETIC, assert_matches, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=2)

BIG = (1 << 20,)  # 4 MiB of float32: several rounds of the all-reduce algorithm


@pytest.mark.parametrize("progress", [True, False])
def test_results_are_the_same_with_and_without_the_thread(progress):
    with mt.DistributedContext.init(config=mt.DistributedConfig(progress=progress)) as ctx:
        assert ctx.progress is progress
        pending = [mt.all_reduce(rank_input(i, ctx.rank, BIG, np.float32), op) for i, op in enumerate(ARITHMETIC)]
        time.sleep(0.05)
        for (i, op), handle in zip(enumerate(ARITHMETIC), pending):
            expected = reference(op, [rank_input(i, r, BIG, np.float32) for r in range(ctx.size)])
            assert_matches(handle.resolve(), expected, op, ctx.size)


def test_a_large_collective_completes_while_the_program_computes():
    # MPI's own algorithm (not the shared-memory one), which advances only inside MPI calls.
    config = mt.DistributedConfig(progress=True, shared_memory=False)
    with mt.DistributedContext.init(config=config) as ctx:
        mt.barrier()
        pending = mt.all_reduce(np.ones(BIG, np.float32))
        # No mpitensor or MPI call from this thread until the check below.
        deadline = time.monotonic() + 10
        while pending._op.state != COMPLETE and time.monotonic() < deadline:
            np.sin(np.arange(20_000.0))  # compute (releases the GIL)
        assert pending._op.state == COMPLETE, "the collective did not advance during compute"
        assert ctx.engine.progress_thread.running
        np.testing.assert_array_equal(pending.resolve().numpy(), np.full(BIG, float(ctx.size), np.float32))


def test_small_collectives_do_not_wake_the_thread():
    with mt.DistributedContext.init(config=mt.DistributedConfig(progress=True)) as ctx:
        for _ in range(20):
            mt.all_reduce(np.ones(16)).resolve()
        assert not ctx.engine.progress_thread.running
