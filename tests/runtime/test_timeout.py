"""Timeouts: a rank that never joins gives a timeout error, then a broken context."""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess


def test_a_rank_that_never_joins(tmp_path):
    result = run_job(
        """
        import time
        import numpy as np
        import mpitensor as mt
        ctx = mt.DistributedContext.init()
        if ctx.rank == 0:
            time.sleep(12)  # never joins the collective the others start
            ctx.abort(3)
        pending = mt.all_reduce(np.ones(1000, np.float32))
        start = time.monotonic()
        try:
            pending.resolve(timeout=2)
        except mt.CollectiveTimeoutError as exc:
            report(f"timeout after {time.monotonic() - start:.2f} s: {exc}")
        try:
            mt.all_reduce(np.ones(2))
        except mt.ContextBrokenError as exc:
            report("broken:", exc)
        time.sleep(2)  # let the other waiting rank report too
        ctx.abort(3)
        """,
        3,
        timeout=60,
        tmp_path=tmp_path,
    )
    lines = result.reported("timeout after")
    assert len(lines) == 2, result.output
    for line in lines:
        seconds = float(line.split()[2])
        assert 2.0 <= seconds <= 4.0, line
        assert "all_reduce of 3.9 KiB on group [0, 1, 2] did not complete within 2 s" in line
        assert "call ctx.abort() to end the job" in line
    broken = result.reported("broken:")
    assert len(broken) == 2 and all("this DistributedContext is broken" in line for line in broken)
    assert result.returncode != 0
    assert result.seconds < 30


def test_the_config_and_environment_timeouts(tmp_path):
    result = run_job(
        """
        import time
        import mpitensor as mt
        for config, own in ((mt.DistributedConfig(timeout=1.0), None), (mt.DistributedConfig(), None),
                            (mt.DistributedConfig(timeout=30.0), 0.8)):
            ctx = mt.DistributedContext.init(config=config)  # the second: MPITENSOR_TIMEOUT
            if ctx.rank == 1:
                continue  # joins no barrier
            start = time.monotonic()
            try:
                mt.barrier(timeout=own)  # the third: the call's own timeout, not the context's
            except mt.CollectiveTimeoutError:
                report(f"barrier timeout {time.monotonic() - start:.2f}")
        if ctx.rank == 1:
            time.sleep(20)  # rank 0 aborts the job first
        ctx.abort(3)
        """,
        2,
        env={"MPITENSOR_TIMEOUT": "1.5"},
        timeout=60,
        tmp_path=tmp_path,
    )
    lines = result.reported("barrier timeout")
    assert len(lines) == 3, result.output
    assert 1.0 <= float(lines[0].split()[-1]) <= 1.9
    assert 1.5 <= float(lines[1].split()[-1]) <= 2.4
    assert 0.8 <= float(lines[2].split()[-1]) <= 1.7
    assert result.returncode != 0


def test_exiting_with_a_collective_stuck_ends_the_job_instead_of_hanging_in_finalize(tmp_path):
    result = run_job(
        """
        import time
        import numpy as np
        import mpitensor as mt
        capture_stderr()
        with mt.DistributedContext.init() as ctx:
            if ctx.rank == 0:
                time.sleep(30)  # never joins
            else:
                try:
                    mt.all_reduce(np.ones(4)).resolve(timeout=1)
                except mt.CollectiveTimeoutError:
                    report("caught")
        """,
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.reported("caught") == ["caught"]
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < 20, result.seconds
    assert "[rank 1] mpitensor: finalizing MPI with a collective stuck in flight" in result.stderr


def test_a_provoked_timeout_does_not_spoil_a_clean_exit(tmp_path):
    # As in a test suite: the late rank does join later, and everyone exits normally.
    # (Rank 0 is late rather than absent: a rank that closes tells the peers waiting for it.
    # Late by more than rank 1's check grace (1 s) and timeout (1 s) together.)
    result = run_job(
        """
        import time
        import numpy as np
        import mpitensor as mt
        mt.defer_finalize()
        with mt.DistributedContext.init() as ctx:
            if ctx.rank == 1:
                try:
                    mt.all_reduce(np.ones(4)).resolve(timeout=1)
                except mt.CollectiveTimeoutError:
                    report("caught")
            else:
                time.sleep(5)
        with mt.DistributedContext.init() as ctx:
            report("sum", mt.all_reduce(np.ones(2)).resolve().numpy().tolist())
        """,
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.reported("caught") == ["caught"]
    assert result.reported("sum") == ["sum [2.0, 2.0]"] * 2
    assert result.returncode == 0, result.output
