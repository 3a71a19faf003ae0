"""A fault on one rank ends the whole job promptly, with a non-zero exit."""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess


def test_an_exception_on_one_rank_aborts_the_job(tmp_path):
    result = run_job(
        """
        import numpy as np
        import mpitensor as mt
        capture_stderr()
        with mt.DistributedContext.init() as ctx:
            if ctx.rank == 1:
                raise ValueError("boom on rank 1")
            mt.all_reduce(np.ones(4)).resolve()  # the others wait here for rank 1
        report("unreachable")
        """,
        3,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < 20, f"took {result.seconds:.1f} s"
    assert result.stderr.count("[rank 1] ValueError: boom on rank 1") == 1
    assert "[rank 1] Traceback (most recent call last):" in result.stderr
    assert not result.reported("unreachable")


def test_an_exception_outside_a_with_block_aborts_too(tmp_path):
    result = run_job(
        """
        import numpy as np
        import mpitensor as mt
        capture_stderr()
        ctx = mt.DistributedContext.init()
        if ctx.rank == 0:
            {}["missing"]
        mt.all_reduce(np.ones(4)).resolve()
        """,
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < 20
    assert "[rank 0] KeyError: 'missing'" in result.stderr


def test_an_exception_caught_outside_the_block_tells_the_peers(tmp_path):
    """A program (a test runner) that catches the exception and goes on: its peers, in the context's
    next collective or closing it, learn that it left instead of waiting for it forever."""
    result = run_job(
        """
        import numpy as np
        import mpitensor as mt
        mt.defer_finalize()  # as under pytest: rank 2's close is not the end of MPI
        try:
            with mt.DistributedContext.init() as ctx:
                mt.all_reduce(np.ones(2)).resolve()
                if ctx.rank == 1:
                    raise AssertionError("a test failed on rank 1")
                if ctx.rank == 0:
                    mt.all_reduce(np.ones(2)).resolve()  # rank 2 closes instead
        except Exception as exc:
            report("left", type(exc).__name__, "a departed rank" if "closed the context" in str(exc) else str(exc))
        with mt.DistributedContext.init() as ctx:
            report("then", mt.all_reduce(np.ones(1)).resolve().item())
        """,
        3,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.seconds < 20, f"took {result.seconds:.1f} s"
    assert sorted(result.reported("left")) == ["left AssertionError a test failed on rank 1",
                                               "left CollectiveMismatchError a departed rank"], result.output
    assert result.reported("then") == ["then 3.0"] * 3


def test_a_rank_killed_by_a_signal_ends_the_job(tmp_path):
    result = run_job(
        """
        import os, signal, time
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            pending = mt.all_reduce(np.ones(1 << 20))
            if ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)
            mt.all_reduce(np.ones(8)).resolve()
            pending.resolve()
        report("unreachable")
        """,
        3,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < 30, f"took {result.seconds:.1f} s"
    assert not result.reported("unreachable")


def test_fail_fast_can_be_turned_off_and_caught_errors_do_not_abort(tmp_path):
    result = run_job(
        """
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            try:
                mt.all_reduce(np.ones(ctx.rank + 1))
            except mt.CollectiveMismatchError:
                pass  # handled: the job goes on
            report("sum", mt.all_reduce(np.ones(1)).resolve().item())
        """,
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("sum") == ["sum 2.0"] * 2
