"""The all-reduce among node leaders (and the fallback's): `exchange.all_reduce_among` against NumPy.

Every rank runs it over every prefix of the ranks, in rank order and reversed (so that at 3
ranks and more a participant is folded into another), on sizes below and above the number
of participants, and checks its result against NumPy's sum of the participants' inputs:
exactly for small integers, and for arbitrary floats the same bits on every participant.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.mpi import MPI
from mpitensor._transport.shm.exchange import all_reduce_among, halving_rounds

mpi = pytest.mark.mpi(min_size=2)
COUNTS = [0, 1, 3, 1001, (1 << 17) + 3]


def drive(steps):
    """Run the generator to its end, waiting for what each step posted; its value."""
    try:
        waits = next(steps)
        while True:
            MPI.Request.Waitall(waits)
            waits = steps.send(None)
    except StopIteration as stop:
        return stop.value


def participants(size: int):
    """Every prefix of the ranks, in order and reversed."""
    for count in range(1, size + 1):
        yield tuple(range(count))
        if count > 2:
            yield tuple(reversed(range(count)))


def test_halving_rounds_split_the_message_once_per_round():
    for parties in (1, 2, 4, 8, 16):
        owners = {}
        for index in range(parties):
            rounds = halving_rounds(index, parties)
            assert len(rounds) == parties.bit_length() - 1
            for partner, kept, given in rounds:
                # The partner keeps what this one gives, and the other way round.
                assert (index, given, kept) in halving_rounds(partner, parties)
            if rounds:
                owners[rounds[-1][1]] = index
        if parties > 1:
            # Each ends with one block of its own.
            assert sorted(owners) == [(b, b + 1) for b in range(parties)]


@mpi
@pytest.mark.parametrize("count", COUNTS)
def test_sums_over_every_set_of_participants(count):
    with mt.DistributedContext.init() as ctx:
        comm = ctx.comm.Dup()
        try:
            for ranks in participants(ctx.size):
                inputs = [np.random.default_rng([count, r]).integers(-50, 51, count).astype(np.float64)
                          for r in range(ctx.size)]
                expected = np.sum([inputs[r] for r in ranks], axis=0) if count else np.zeros(0)
                if ctx.rank in ranks:
                    source = inputs[ctx.rank].copy()
                    out = np.full(count, np.nan)
                    drive(all_reduce_among(comm, ranks, ranks.index(ctx.rank), source, out, MPI.DOUBLE, np.add))
                    np.testing.assert_array_equal(out, expected)
                    np.testing.assert_array_equal(source, inputs[ctx.rank])  # left as it was
                    in_place = inputs[ctx.rank].copy()
                    drive(all_reduce_among(comm, ranks, ranks.index(ctx.rank), in_place, in_place, MPI.DOUBLE,
                                           np.add))
                    np.testing.assert_array_equal(in_place, expected)
                comm.Barrier()
        finally:
            comm.Free()


@mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_floats_give_the_same_bits_everywhere(dtype):
    with mt.DistributedContext.init() as ctx:
        comm = ctx.comm.Dup()
        try:
            for ranks in participants(ctx.size):
                rng = [np.random.default_rng([7, r]) for r in range(ctx.size)]
                inputs = [g.standard_normal(5003).astype(dtype) * 10.0 ** g.uniform(-3, 3, 5003).astype(dtype)
                          for g in rng]
                digest = ""
                if ctx.rank in ranks:
                    out = inputs[ctx.rank].copy()
                    datatype = MPI.FLOAT if dtype == np.float32 else MPI.DOUBLE
                    drive(all_reduce_among(comm, ranks, ranks.index(ctx.rank), out, out, datatype, np.add))
                    np.testing.assert_allclose(out, np.sum([inputs[r] for r in ranks], axis=0, dtype=np.float64),
                                               rtol=1e-4, atol=1e-2)
                    digest = hashlib.sha256(out.tobytes()).hexdigest()
                digests = {d for d in comm.allgather(digest) if d}
                assert len(digests) == 1, f"participants {ranks} got different bits"
        finally:
            comm.Free()


@mpi
def test_flags_give_their_minimum_to_every_participant():
    with mt.DistributedContext.init() as ctx:
        comm = ctx.comm.Dup()
        try:
            for ranks in participants(ctx.size):
                for low in ranks:
                    inputs = [np.full(1001, float(r + 1)) for r in range(ctx.size)]
                    if ctx.rank not in ranks:
                        continue
                    flag = 1 if ctx.rank == low else 3
                    out = inputs[ctx.rank].copy()
                    agreed = drive(all_reduce_among(comm, ranks, ranks.index(ctx.rank), out, out, MPI.DOUBLE,
                                                    np.add, flag, 2))
                    assert agreed == 1
                    out = inputs[ctx.rank].copy()
                    agreed = drive(all_reduce_among(comm, ranks, ranks.index(ctx.rank), out, out, MPI.DOUBLE,
                                                    np.add, 3, 2))
                    assert agreed == 3
                    np.testing.assert_array_equal(out, np.full(1001, float(sum(r + 1 for r in ranks))))
                comm.Barrier()
        finally:
            comm.Free()
