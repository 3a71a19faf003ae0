"""Held all-reduces of 2 ranks move their data in one exchange where a rank's core is contested.

Each rank says in the check whether its core is contested (`_core.idle.contested`, what the
waits in Open MPI's blocking calls found); where either says so, both send their whole input
once and reduce rank 0's op rank 1's (`exchange_once`, or the compiled held lane's own), else
MPI's all-reduce moves it; where both ranks run on one node, that exchange goes through their
shared pair (`_transport/mpi/pair.py`). The tests mark one rank, both or neither contested
(`idle.mark_contested`, as late yields would), count the one-exchange calls on each rank (the
Python path's and the compiled lanes' `exchanged`), and compare every result with NumPy's
reduction of both inputs and with the peer's bits. Elsewhere than Open MPI with mpitensor's progress
callback, no core is ever contested and every call takes MPI's algorithm.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives.lane import CopiedInto
from mpitensor._core import idle
from mpitensor._core.mpi import MPI
from mpitensor._transport.mpi import all_reduce as mpi_all_reduce
from mpitensor._transport.mpi.pair import pairs_built
from tests.helpers import OP, assert_matches, kept_plan, rank_input, ranks_outnumber_cores, reference, rejects, seed_of

try:
    from mpitensor._core import _pair as compiled_pair
except ImportError:  # built without a C compiler: MPI's exchange only
    compiled_pair = None

pytestmark = pytest.mark.mpi(min_size=2)

SHAPE = (20_000,)  # larger than 64 KiB at 4 bytes: an in-place call is held
CASES = [(np.float64, OP.SUM), (np.float32, OP.MEAN), (np.int64, OP.PROD), (np.int32, OP.MAX), (np.uint64, OP.BXOR),
         (np.complex128, OP.SUM)]
WHO = {"neither": (), "first": (0,), "second": (1,), "both": (0, 1)}


@pytest.fixture
def exchanges(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The one-exchange calls this rank made on the Python path (the real function runs; each appends the count)."""
    made: list[int] = []
    real = mpi_all_reduce.exchange_once

    def counted(comm, send, out, plan):
        made.append(out.size)
        real(comm, send, out, plan)

    monkeypatch.setattr(mpi_all_reduce, "exchange_once", counted)
    yield made
    idle.mark_contested(0)


def _pair(ctx: mt.DistributedContext) -> list[int] | None:
    """The group of the calls: every rank where there are 2, else ranks 0 and 1."""
    return None if ctx.size == 2 else [0, 1]


def _effective(ctx: mt.DistributedContext) -> bool:
    """Whether this rank's waits can take its core as contested (Open MPI's blocking calls, a core per rank)."""
    return idle.sleeps_when_contested() and not ranks_outnumber_cores(ctx)


@pytest.mark.parametrize("into", [False, True], ids=["in_place", "into_out"])
@pytest.mark.parametrize("who", list(WHO))
def test_a_contested_rank_has_both_reduce_in_one_exchange(exchanges, who, into):
    """Five calls of each kind (the later ones on the compiled lane where it is built), one with a late peer.

    Both ranks make the same number of one-exchange calls; every call where a marked rank's
    waits can take the core as contested. With neither marked, a core the machine really
    contends for may still choose it: then both ranks do alike.
    """
    with mt.DistributedContext.init() as ctx:
        pair, effective = _pair(ctx), _effective(ctx)
        if ctx.rank < 2:
            idle.mark_contested(60 if ctx.rank in WHO[who] else 0)
            assert idle.contested() == (ctx.rank in WHO[who] and effective)
            calls = _reduce_all(ctx, pair, into)
            made = len(exchanges) + _compiled_exchanges(ctx, into)
            counts = mt.all_gather(np.array([made]), devices=pair).resolve().numpy()
            assert counts[0] == counts[1], f"the ranks chose alike: {counts}"
            if WHO[who]:
                assert made == (calls if effective else 0), (who, made, calls)
            if WHO[who] and effective and ctx.size == 2:
                assert _pair_state(ctx) == _expected_pair_state(ctx)
            idle.mark_contested(0)
        mt.barrier()


def _pair_state(ctx: mt.DistributedContext) -> int | None:
    """Whether the 2 ranks' largest case went through their shared pair (1), MPI's exchange (-1); None: not built."""
    nbytes = max(np.dtype(dtype).itemsize for dtype, _ in CASES) * SHAPE[0]
    return _pair_state_of(ctx.full_group.comm, nbytes)


def _expected_pair_state(ctx: mt.DistributedContext) -> int | None:
    """Through the pair where both ranks run on one node and the pair module was built."""
    if not pairs_built():
        return None
    one_node = len(set(ctx.full_group.comm.allgather(socket.gethostname()))) == 1
    return 1 if one_node and os.environ.get("MPITENSOR_PAIR", "1") != "0" else -1


def _compiled_exchanges(ctx: mt.DistributedContext, into: bool) -> int:
    """The one-exchange calls of the compiled held lanes `ctx` keeps for `CASES` (none on sub-groups)."""
    made = 0
    for dtype, op in CASES:
        plan = kept_plan(ctx, "all_reduce", np.dtype(dtype), SHAPE, op, "held", into)
        if plan is not None and not isinstance(plan, CopiedInto):
            made += plan.exchanged
    return made


def _reduce_all(ctx: mt.DistributedContext, pair: list[int] | None, into: bool) -> int:
    """Held all-reduces of every case on the 2 ranks, checked against NumPy and the peer's bits; how many."""
    calls = 0
    for dtype, op in CASES:
        if rejects(op, np.dtype(dtype)):
            continue
        for turn in range(5):
            inputs = [rank_input(seed_of("contested", np.dtype(dtype).name, op.name, into, turn), r, SHAPE, dtype)
                      for r in range(2)]
            if turn == 4 and ctx.rank == 1:
                time.sleep(0.05)  # the peer is late: its check is queued for the engine
            array = inputs[ctx.rank].copy()
            out = np.empty_like(array) if into else None
            result = mt.all_reduce(array, op, pair, out=out, held=True).resolve().numpy()
            assert np.shares_memory(result, out if into else array), "the result is the caller's buffer"
            assert_matches(result, reference(op, inputs), op, 2)
            theirs = mt.all_gather(result.view(np.uint8), devices=pair).resolve().numpy().reshape(2, -1)
            assert np.array_equal(theirs[0], theirs[1]), "both ranks hold the same bits"
            calls += 1
    return calls


def test_the_contested_state_is_never_set_where_waits_cannot_sleep():
    """Where Open MPI's blocking calls do not follow mpitensor's rule, or ranks outnumber cores, marking is idle."""
    with mt.DistributedContext.init() as ctx:
        effective = _effective(ctx)
        idle.mark_contested(60)
        try:
            assert idle.contested() == effective
            assert (idle.contested_address() != 0) == idle.sleeps_when_contested()
        finally:
            idle.mark_contested(0)
        assert not idle.contested()


def test_the_one_exchange_goes_through_the_ranks_shared_pair():
    """`exchange_once` as the engine calls it for a contested core, on every MPI: sizes that grow the pair, in place."""
    with mt.DistributedContext.init() as ctx:
        if ctx.size != 2:
            pytest.skip("the pair's own test runs on a job of 2 ranks (every rank skips alike)")
        comm = ctx.full_group.comm
        for turn, count in enumerate([10, 9_000, 200_000, 9_000, 150_000]):
            inputs = [rank_input(seed_of("pair", turn), r, (count,), np.float64) for r in range(2)]
            send = inputs[ctx.rank].copy()
            out = send if turn % 2 else np.empty_like(send)
            mpi_all_reduce.exchange_once(comm, send, out, SimpleNamespace(datatype=MPI.DOUBLE, mpi_op=MPI.SUM))
            assert_matches(out, reference(OP.SUM, inputs), OP.SUM, 2)
            theirs = comm.allgather(out.tobytes())
            assert theirs[0] == theirs[1], "both ranks hold the same bits"
            assert _pair_state_of(comm, out.nbytes) == _expected_pair_state(ctx)


def _pair_state_of(comm: Any, nbytes: int) -> int | None:
    """The pair's state for a call of `nbytes` on `comm` (1 through it, -1 MPI's, 0 none yet); None: not built."""
    return compiled_pair.state(comm.handle, nbytes) if pairs_built() else None
