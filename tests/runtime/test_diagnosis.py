"""The wait diagnosis: late ranks are waited for, never accused, and leave nothing in flight.

The group mismatches it exists for (cycles of ranks waiting on different groups) are tested
in tests/collectives/test_mismatch.py and test_misuse_jobs.py; here, what it must not do.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._runtime.diagnosis import DIAG_AFTER

pytestmark = pytest.mark.mpi(min_size=2)

_LATE = 3 * DIAG_AFTER  # long enough for every waiting peer to join a round


def _sum_of_ranks(size: int, count: int) -> list[float]:
    return [float(sum(range(size)))] * count


@pytest.mark.mpi(min_size=3)
def test_a_member_late_for_a_groups_creation_is_waited_for():
    # Rank 1 comes late to the creation of [0, 1], which rank 0 started; the other ranks
    # wait in a collective of the whole context meanwhile. Nobody disagrees: no error.
    config = mt.DistributedConfig(check_grace=0.05)
    with mt.DistributedContext.init(config=config) as ctx:
        if ctx.rank in (0, 1):
            if ctx.rank == 1:
                time.sleep(_LATE)
            got = mt.all_reduce(np.full(2, float(ctx.rank)), devices=[0, 1]).resolve()
            assert got.numpy().tolist() == [1.0, 1.0]
        total = mt.all_reduce(np.full(3, float(ctx.rank))).resolve()
        assert total.numpy().tolist() == _sum_of_ranks(ctx.size, 3)
        assert ctx.group_count() == (2 if ctx.rank in (0, 1) else 1)


def test_a_late_rank_is_waited_for_and_the_rounds_end_paired_at_close():
    config = mt.DistributedConfig(check_grace=0.05)
    ctx = mt.DistributedContext.init(config=config)
    late = ctx.size - 1
    for step in range(2):
        if ctx.rank == late:
            time.sleep(_LATE)
        got = mt.all_reduce(np.full(2, float(ctx.rank + step)))
        assert got.resolve().numpy().tolist() == [float(sum(range(ctx.size)) + step * ctx.size)] * 2
    diagnosis = ctx.diagnosis
    # The peers joined one round while waiting the first time; the second wait joined none
    # (the first round was still in flight: it waits for the late rank).
    assert diagnosis.rounds == (0 if ctx.rank == late else 1)
    ctx.close()
    # At close every rank joined rounds until one that all joined closing: nothing is left.
    assert diagnosis.round is None
    assert diagnosis.last_round is not None and diagnosis.last_round.everyone_closing
    assert not diagnosis.sends and not diagnosis.arrivals.busy


def test_a_rank_that_never_waits_long_joins_no_round():
    with mt.DistributedContext.init() as ctx:
        for _ in range(3):
            assert mt.all_reduce(np.ones(2)).resolve().numpy().tolist() == [float(ctx.size)] * 2
        diagnosis = ctx.diagnosis
    assert diagnosis.rounds == 1  # the one at close, every rank closing
    assert diagnosis.last_round.everyone_closing
