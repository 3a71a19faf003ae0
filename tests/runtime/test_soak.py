"""Soak: 20,000 mixed collectives of random sizes on 4 ranks, every result checked, memory
flat, and every MPI handle freed at close()."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_job

pytestmark = pytest.mark.subprocess

SOAK = """
import gc
import os
import sys
from collections import deque

import numpy as np

sys.path.insert(0, {root!r})
import mpitensor as mt
from mpitensor._core.mpi import MPI
from tests.helpers import rank_input, reference, tolerance

OPS = {ops}
IN_FLIGHT = 8
KINDS = ["all_reduce", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "fused", "barrier"]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def check(got, expected, op, count) -> None:
    got = np.asarray(got)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, got.dtype, expected.dtype)
    if expected.dtype.kind == "f" and op not in (None, mt.ReduceOperation.MAX, mt.ReduceOperation.MIN):
        tol = max(tolerance(expected.dtype, count), 1e-3 if expected.dtype == np.float16 else 0)
        assert np.allclose(got, expected, rtol=tol, atol=tol)
    else:
        assert np.array_equal(got, expected)


with mt.DistributedContext.init() as ctx:
    rng = np.random.default_rng(20_000)  # the same sequence of operations on every rank
    pending = deque()
    start = None
    for i in range(OPS):
        if i == 1000:
            gc.collect()
            start = resident()
        kind = KINDS[rng.integers(len(KINDS))]
        dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        count = int(rng.integers(1, 2 ** int(rng.integers(1, 17))))
        op = list(mt.ReduceOperation)[rng.integers(5)]
        halves = rng.random() < 0.3 and ctx.size > 1
        members = [r for r in range(ctx.size) if r % 2 == ctx.rank % 2] if halves else list(range(ctx.size))
        n = len(members)
        inputs = {{r: rank_input(i, r, (count,), dtype) for r in members}}
        mine = inputs[ctx.rank]
        root = members[i % n]
        if kind == "all_reduce":
            handle = mt.all_reduce(mine, op, devices=members)
            want = reference(op, [inputs[r] for r in members])
        elif kind == "broadcast":
            handle = mt.broadcast(mine, root=root, devices=members)
            want = inputs[root]
            op = None
        elif kind == "reduce":
            handle = mt.reduce(mine, op, root=root, devices=members)
            want = reference(op, [inputs[r] for r in members]) if ctx.rank == root else None
        elif kind == "all_gather":
            handle = mt.all_gather(mine, devices=members)
            want = np.concatenate([inputs[r] for r in members])
            op = None
        elif kind == "reduce_scatter":
            inputs = {{r: rank_input(i, r, (count * n,), dtype) for r in members}}
            handle = mt.reduce_scatter(inputs[ctx.rank], op, devices=members)
            index = members.index(ctx.rank)
            want = reference(op, [inputs[r] for r in members])[index * count : (index + 1) * count]
        elif kind == "fused":
            extra = {{r: rank_input(i + 7, r, (5,), np.float64) for r in members}}
            handle = mt.all_reduce([mine, extra[ctx.rank]], op, devices=members)
            want = [reference(op, [inputs[r] for r in members]), reference(op, [extra[r] for r in members])]
        else:
            mt.barrier(devices=members)
            continue
        pending.append((handle, want, op, n))
        while len(pending) > IN_FLIGHT or (i == OPS - 1 and pending):
            handle, want, op_, n_ = pending.popleft()
            got = handle.resolve()
            if want is None:
                assert got is None
            elif isinstance(want, list):
                for g, w in zip(got, want):
                    check(g, w, op_, n_)
            else:
                check(got, want, op_, n_)
    gc.collect()
    growth = resident() - start
    engine = ctx.engine
    assert not engine.busy() and not engine.posted
    handles = ctx._mpi_handles()
report("growth_mb", growth / 2**20)
report("intel_mpi", "Intel" in MPI.Get_library_version())
report("freed", all(comm == MPI.COMM_NULL for comm in handles), len(handles))
report("done", OPS)
"""


def test_twenty_thousand_mixed_collectives_on_four_ranks(tmp_path):
    result = run_job(SOAK.format(root=str(ROOT), ops=20_000), 4, timeout=600, tmp_path=tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    assert result.reported("done") == ["done 20000"] * 4
    # Intel MPI keeps memory of its own for the sizes it has seen: raw mpi4py nonblocking
    # all-reduces, broadcasts and all-gathers of random sizes grew its RSS by 26 MB over 40,000
    # calls, flat from the 25,000th (Open MPI's: 0.5 MB), and this soak's by 52-68 MB, flat
    # from the 15,000th, against 14-28 MB under Open MPI. A leak of mpitensor's own of 2.5 KB
    # a call (5 KB under Intel MPI) fails it.
    bound = 100 if result.reported("intel_mpi") == ["intel_mpi True"] * 4 else 50
    for line in result.reported("growth_mb"):
        assert float(line.split()[1]) < bound, line
    for line in result.reported("freed"):
        assert line.startswith("freed True"), line
