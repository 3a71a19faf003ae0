"""A call that fails on one rank tells its peers even when that rank then blocks elsewhere.

The peers' `CollectiveMismatchError` is built from every member's full record, an exchange
the failing rank takes part in. These tests make the failing rank block right after its
error (in raw MPI, or in a long sleep) and a peer arrive after the grace, so that only
the failing rank's engine, driven without its program, can answer.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpitensor as mt
from tests.helpers import still_usable

pytestmark = pytest.mark.mpi(min_size=2)

LATE = 1.5  # seconds the peers arrive after the failing rank's call: past the 1 s grace
BLOCKED = 6.0  # seconds the failing rank sleeps after its error


def _fail_on_rank_1() -> None:
    with pytest.raises(TypeError, match="cannot be communicated"):
        mt.all_reduce(np.array(["not", "numbers"]))


def test_peers_get_their_error_while_the_failing_rank_sleeps(ctx):
    MPI.COMM_WORLD.Barrier()
    if ctx.rank == 1:
        _fail_on_rank_1()
        time.sleep(BLOCKED)  # a long compute, holding no lock of mpitensor's
    else:
        time.sleep(LATE)
        start = time.monotonic()
        with pytest.raises(mt.CollectiveMismatchError, match="rank 1's all_reduce failed on that rank"):
            mt.all_reduce(np.ones(3)).resolve()
        waited = time.monotonic() - start
        assert waited < BLOCKED - LATE - 1.0, f"the error took {waited:.1f} s: it waited for rank 1's program"
    MPI.COMM_WORLD.Barrier()
    still_usable(ctx)


def test_peers_get_their_error_while_the_failing_rank_is_in_a_raw_barrier(ctx):
    MPI.COMM_WORLD.Barrier()
    if ctx.rank == 1:
        _fail_on_rank_1()
        MPI.COMM_WORLD.Barrier()  # released only once every peer has its error
    else:
        time.sleep(LATE)
        with pytest.raises(mt.CollectiveMismatchError, match="rank 1's all_reduce failed on that rank"):
            mt.all_reduce(np.ones(3)).resolve(timeout=30)
        MPI.COMM_WORLD.Barrier()
    still_usable(ctx)
