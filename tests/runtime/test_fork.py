"""A process forked from a rank is not that rank: no collective, no close, no MPI finalize from it."""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess

PROMPT_S = 30

FORKED = ("this process was forked from rank 0 after its context opened; only the rank's own process may call "
          "collectives, use its contexts or open one")

# Rank 0 forks a child that computes, tries what only the rank may do, and leaves as `LEAVE` says;
# the parent waits for it; then every rank all-reduces (compared with NumPy's sum of every rank's
# input) and closes. Each rank reports its result; the child ("forked") reports each refusal.
_JOB = """
import os
import sys
import numpy as np
import mpitensor as mt

def refused(what, call):
    try:
        call()
    except mt.ForkedProcessError as exc:
        report("forked", what, type(exc).__name__, str(exc).startswith(FORKED))
    else:
        report("forked", what, "not refused")

with mt.DistributedContext.init(config=CONFIG) as ctx:
    inputs = [np.arange(4.0) * (r + 1) for r in range(ctx.size)]
    mt.all_reduce(inputs[ctx.rank]).resolve()
    pending = mt.all_reduce(inputs[ctx.rank] * 2)  # not resolved before the fork
    if ctx.rank == 0:
        pid = os.fork()
        if pid == 0:
            report("forked computed", float(np.sum(np.arange(10.0) ** 2)))
            refused("all_reduce", lambda: mt.all_reduce(np.ones(4)).resolve())
            refused("barrier", mt.barrier)
            refused("broadcast_object", lambda: mt.broadcast_object("x").resolve())
            refused("comm", lambda: ctx.comm)
            refused("init", mt.DistributedContext.init)
            refused("abort", ctx.abort)
            refused("resolve", pending.resolve)
            LEAVE
        _, status = os.waitpid(pid, 0)
        report("child status", os.waitstatus_to_exitcode(status))
    report("pending", np.array_equal(pending.resolve().numpy(), 2 * np.sum(inputs, axis=0)))
    total = mt.all_reduce(inputs[ctx.rank]).resolve().numpy()
    report("total", np.array_equal(total, np.sum(inputs, axis=0)))
report("closed")
"""

_REFUSALS = ["all_reduce", "barrier", "broadcast_object", "comm", "init", "abort", "resolve"]


@pytest.mark.parametrize(
    ("leave", "status"),
    [("sys.exit(0)", 0), ("sys.exit(3)", 3), ("raise RuntimeError('the worker failed')", 1)],
    ids=["exit-0", "exit-3", "uncaught"],
)
@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_a_forked_child_leaves_without_touching_the_ranks_mpi(tmp_path, leave, status, traced):
    config = f"mt.DistributedConfig(trace={str(tmp_path / 'trace.json')!r})" if traced else "None"
    script = _JOB.replace("CONFIG", config).replace("LEAVE", leave).replace("FORKED", repr(FORKED))
    result = run_job(script, 2, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    assert result.reported("forked ") == (
        ["forked computed 285.0"] + [f"forked {what} ForkedProcessError True" for what in _REFUSALS]
    ), result.output
    assert result.reported("child status") == [f"child status {status}"]
    # The child's report lines land in rank 0's file too: rank 0 reports once, as rank 1 does.
    assert result.reported("pending") == ["pending True"] * 2, "the parent resolves its handle the child could not"
    assert result.reported("total") == ["total True"] * 2
    assert result.reported("closed") == ["closed"] * 2
    if status == 1:
        assert "RuntimeError: the worker failed" in result.stderr and "MPI_Abort" not in result.stderr
    if traced:
        assert (tmp_path / "trace.json").exists() and not list(tmp_path.glob("trace.json.rank*.json"))


def test_data_loader_workers_forked_by_multiprocessing_leave_the_ranks_working(tmp_path):
    result = run_job(
        """
        import multiprocessing
        import numpy as np
        import mpitensor as mt

        def square(value):
            return value * value

        with mt.DistributedContext.init() as ctx:
            with multiprocessing.get_context("fork").Pool(2) as pool:
                squares = pool.map(square, range(8))
            inputs = [np.asarray(squares, dtype=np.float64) * (r + 1) for r in range(ctx.size)]
            total = mt.all_reduce(inputs[ctx.rank]).resolve().numpy()
            report("total", squares == [v * v for v in range(8)], np.array_equal(total, np.sum(inputs, axis=0)))
        report("closed")
        """,
        2,
        timeout=120,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    assert result.reported("total") == ["total True True"] * 2
    assert result.reported("closed") == ["closed"] * 2
