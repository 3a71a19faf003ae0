"""The compiled lane's errors and lifetimes: what it raises and keeps is what the Python lanes would.

An error MPI reports inside the compiled resolve reaches the program as the Python lane's
error (the engine's lock is released without losing it); a `LaneTensor` of anything but an
engine `Op` is a TypeError, not a read at Op's slots; a closed context is not kept alive by
the compiled entry's cache of lanes.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.native import LaneTensor
from tests.helpers import run_job

switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
needs_compiled = pytest.mark.skipif(switched_off or not native.built(),
                                    reason="MPITENSOR_NATIVE=0, or built without a C compiler: the Python lanes only")

_NOT_AN_OP = "a LaneTensor is the handle of an engine Op, got int"


@pytest.mark.mpi(min_size=1)
def test_a_lane_tensor_of_something_else_than_an_op_is_a_type_error():
    """Made in Python, a LaneTensor checks its op; the compiled resolve refuses an op replaced later."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        with pytest.raises(TypeError) as caught:
            LaneTensor(12345, mt.from_numpy(np.ones(2)), ctx)
        assert str(caught.value) == _NOT_AN_OP
        for _ in range(3):
            pending = mt.all_reduce(np.ones(2))
            assert pending.resolve().numpy().tolist() == [float(ctx.size)] * 2
        if type(pending) is LaneTensor and native.status() == "on":
            replaced = mt.all_reduce(np.ones(2))
            op = replaced._op
            replaced._op = 12345  # what only a program reaching into the handle can do
            with pytest.raises(TypeError) as caught:
                replaced.resolve()
            assert str(caught.value) == _NOT_AN_OP
            replaced._op = op
            assert replaced.resolve().numpy().tolist() == [float(ctx.size)] * 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("check", [False, True])
def test_a_closed_context_is_not_kept_alive_by_the_lanes(check):
    """After close() and a collection, nothing holds the context: not the lanes, not the compiled entry's cache."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for _ in range(4):
            pending = mt.all_reduce(np.ones(2))
            assert pending.resolve().numpy().tolist() == [float(ctx.size)] * 2
        on_compiled = type(pending) is LaneTensor
    if not switched_off and native.status() == "on" and (not check or 1 < ctx.size <= 8):
        assert on_compiled, "the calls did not take the compiled lane: the cache was not exercised"
    del pending
    closed = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert closed() is None, [type(referrer).__name__ for referrer in gc.get_referrers(closed())]


# Check off, ranks disagreeing on length on lanes both have: MPI sees mismatched counts. Each
# rank reports how its call ended, then leaves at once (a rank MPI left waiting would wait forever).
_MISMATCHED_LENGTHS = """
import os, time
import numpy as np
import mpitensor as mt

with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
    for n in (4, 8):
        for _ in range(3):
            mt.all_reduce(np.ones(n)).resolve()
    pending = mt.all_reduce(np.ones(4 if ctx.rank == 0 else 8))
    report("handle", type(pending).__name__)
    try:
        report("outcome ok", pending.resolve().shape)
    except BaseException as exc:
        report("outcome", type(exc).__name__, str(exc).replace("\\n", " | "))
    time.sleep(2)  # the peer's report, if it has one to make
    os._exit(0)
"""


@pytest.mark.subprocess
@needs_compiled
def test_check_off_mismatched_lengths_give_the_python_lanes_outcome(tmp_path):
    """The compiled resolve's MPI error is the Python lane's (Open MPI: ContextBrokenError, MPI_ERR_TRUNCATE),
    never SystemError; on MPIs that do not notice, both lanes complete alike."""
    outcomes = {}
    for lane, env in (("compiled", None), ("python", {"MPITENSOR_NATIVE": "0"})):
        result = run_job(_MISMATCHED_LENGTHS, 2, timeout=90, env=env, tmp_path=tmp_path)
        handles = result.reported("handle")
        assert handles == [f"handle {'LaneTensor' if lane == 'compiled' else 'CollectiveTensor'}"] * 2, result.output
        # MPI's own words for the failure vary from run to run (MPI_ERR_TRUNCATE, MPI_ERR_OTHER):
        # compared up to them.
        outcomes[lane] = {rank: [line.split(": MPI_ERR")[0] for line in lines if line.startswith("outcome")]
                          for rank, lines in result.reports.items()}
        assert outcomes[lane].get(0), result.output
    assert outcomes["compiled"] == outcomes["python"], outcomes
    for lines in outcomes["compiled"].values():
        for line in lines:
            assert line.startswith("outcome ok") or line in (
                f"outcome ContextBrokenError MPI failed in all_reduce of 32 B on group [0, 1] on rank {rank}"
                for rank in (0, 1)), line
