"""Beyond 8 ranks a checked small all-reduce is one round trip: its data reduced inside the check.

A group of more than `GATHERED_CHECK_RANKS` ranks checks every call with one ``MPI_Iallreduce``
of a fixed record and mpitensor's own op (`_transport/reduced_check.py`); a checked all-reduce
whose input fits the payload carries it there (integers under every reduction, float sums and
products, complex sums), on the compiled plan as on the Python one. Child jobs run the large
groups' check on a few ranks (``MPITENSOR_GATHERED_CHECK_RANKS=1``) and on 10 ranks as it is:
every result equals NumPy's over every rank's input, a late peer's queued check, a member that
carries nothing (its result into ``out=``), and a mismatch (every rank's error, the next call right).
"""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess

_JOB = """
import time
import numpy as np
import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.plans import find_plan

with mt.DistributedContext.init() as ctx:
    size, rank = ctx.size, ctx.rank
    assert not ctx.full_group.gathers, "the large groups' check"
    kinds = [(np.int32, "sum"), (np.int64, "max"), (np.uint8, "bxor"), (np.float64, "sum"), (np.float32, "mean"),
             (np.float64, "prod"), (np.complex128, "sum"), (np.int16, "min"), (np.float64, "max")]
    numpy_of = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod, "mean": np.mean,
                "bxor": np.bitwise_xor.reduce}
    for dtype, op in kinds:
        for turn in range(4):
            if turn == 3 and rank == size - 1:
                time.sleep(0.05)  # a late peer: the check is queued, then agreed
            every = [((np.arange(3) + 2 * r + turn) % 7 + 1).astype(dtype) for r in range(size)]
            got = mt.all_reduce(every[rank], op).resolve().numpy()
            want = numpy_of[op](np.stack(every), axis=0).astype(got.dtype)
            assert got.dtype == want.dtype and np.allclose(got, want, rtol=1e-6), (dtype, op, got, want)
        lane = find_plan(ctx, ("all_reduce", np.dtype(dtype), (3,), op))
        compiled = None if lane is None else lane.compiled
        report("lane", np.dtype(dtype).name, op, lane is not None, compiled is not None)
    # A member whose result goes into out= carries nothing: the others reduce through MPI with it.
    for turn in range(2):
        x = np.full(4, float(rank + turn))
        out = np.empty(4) if rank == 0 else None
        got = mt.all_reduce(x, "sum", out=out).resolve().numpy()
        assert got.tolist() == [float(sum(range(size)) + size * turn)] * 4, got
    # A mismatch: every rank's error, the next call right.
    shape = (2,) if rank == size - 1 else (3,)
    try:
        mt.all_reduce(np.ones(shape, np.int64)).resolve()
        report("mismatch", "none")
    except mt.CollectiveMismatchError as exc:
        report("mismatch", "CollectiveMismatchError", "shape" in str(exc))
    got = mt.all_reduce(np.full(3, rank, np.int64)).resolve().numpy()
    assert got.tolist() == [sum(range(size))] * 3, got
    report("native", native.status())
"""


def _check(result, size):
    assert result.returncode == 0, result.output
    assert len(result.reported("mismatch")) == size, result.output
    assert all(line == "mismatch CollectiveMismatchError True" for line in result.reported("mismatch")), result.output
    lanes = result.reported("lane")
    assert len(lanes) == 9 * size, result.output
    assert all(" True " in line for line in lanes), "every kind kept its plan: " + "\n".join(lanes)
    if all(line == "native on" for line in result.reported("native")):
        carried = [line for line in lanes if " float64 max " not in line]  # keys: MPI's data path after the check
        assert all(line.endswith("True") for line in carried), "the compiled plan: " + "\n".join(carried)


def test_the_large_groups_check_on_three_ranks(tmp_path):
    result = run_job(_JOB, 3, timeout=120, env={"MPITENSOR_GATHERED_CHECK_RANKS": "1"}, tmp_path=tmp_path)
    _check(result, 3)


def test_the_large_groups_check_on_three_ranks_in_python(tmp_path):
    result = run_job(_JOB, 3, timeout=120, env={"MPITENSOR_GATHERED_CHECK_RANKS": "1", "MPITENSOR_NATIVE": "0"},
                     tmp_path=tmp_path)
    _check(result, 3)


def test_ten_ranks(tmp_path):
    result = run_job(_JOB, 10, timeout=240, tmp_path=tmp_path)
    _check(result, 10)
