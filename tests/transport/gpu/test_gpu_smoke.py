"""The GPU smoke test's runner and its checks' references, where there is no GPU.

The runner (`scripts/smoke_runner.py`) is plain Python: isolation, the time limit, the
combination over ranks, the report lines and the exit status are checked here. The checks
themselves (`scripts/gpu_smoke.py`) run under ``--cpu`` on NumPy arrays and CPU ranks, which
validates their NumPy references against mpitensor's host paths; in normal mode without
CuPy every check must fail, never skip.
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.helpers import ROOT, run_job

sys.path.insert(0, str(ROOT / "scripts"))
from smoke_runner import FAIL, PASS, SKIP, Outcome, Skip, combine, run_all, run_check, summary

SMOKE = ROOT / "scripts" / "gpu_smoke.py"


def _boom(env):
    raise ValueError("bad value\non two lines")


def _skip(env):
    raise Skip("not here")


def _sleep(env):
    time.sleep(30)


def test_a_failing_check_does_not_stop_the_others():
    lines = []
    checks = [("first", lambda env: "fine"), ("second", _boom), ("third", _skip), ("fourth", lambda env: None)]
    code = run_all(checks, None, limit=5, emit=lines.append)
    assert code == 1
    assert lines[0] == lines[0].replace("\n", " ") and lines[0].startswith("PASS first (")
    assert lines[0].endswith("): fine")
    assert lines[1].startswith("FAIL second (")
    assert "ValueError: bad value | on two lines [test_gpu_smoke.py:" in lines[1]
    assert lines[2].startswith("SKIP third (") and lines[2].endswith("): not here")
    assert lines[3].endswith("): ok")
    assert lines[4].startswith("TOTAL FAILED: 2 passed, 1 failed, 1 skipped of 4 checks in ")
    assert len(lines) == 5


def test_all_passing_or_skipped_exits_zero():
    lines = []
    assert run_all([("a", lambda env: env), ("b", _skip)], "x", limit=5, emit=lines.append) == 0
    assert lines[0].endswith("): x")
    assert lines[-1].startswith("TOTAL OK: 1 passed, 0 failed, 1 skipped of 2 checks")


def test_a_check_past_its_limit_fails_and_the_next_runs():
    start = time.monotonic()
    lines = []
    code = run_all([("slow", _sleep), ("after", lambda env: "ran")], None, limit=0.3, emit=lines.append)
    assert time.monotonic() - start < 5
    assert code == 1
    assert lines[0].startswith("FAIL slow (") and "CheckTimeoutError: still running after 0.3 s" in lines[0]
    assert lines[1].startswith("PASS after (")


def test_the_alarm_is_off_after_a_check():
    outcome = run_check("quick", lambda env: "done", None, 0.2)
    assert outcome.status == PASS
    time.sleep(0.4)  # an alarm left armed would raise here


def test_a_check_that_failed_on_any_rank_fails():
    ok = Outcome("c", PASS, "fine", 0.5)
    bad = Outcome("c", FAIL, "ValueError: x", 1.5)
    skipped = Outcome("c", SKIP, "no", 0.1)
    both = combine([ok, bad])
    assert (both.status, both.detail, both.seconds) == (FAIL, "rank 1: ValueError: x", 1.5)
    assert combine([bad, bad]).detail == "every rank: ValueError: x"
    assert combine([skipped, ok]).status == PASS
    assert combine([skipped, skipped]).status == SKIP
    lines = []
    gathered = [[ok, bad]]
    assert run_all([("c", lambda env: None)], None, limit=5, allgather=lambda o: gathered.pop(), emit=lines.append)
    assert lines[0].startswith("FAIL c (1.50 s): rank 1: ValueError: x")


def test_summary_counts():
    outcomes = [Outcome("a", PASS, "", 0), Outcome("b", SKIP, "", 0)]
    assert summary(outcomes, 2.25) == "TOTAL OK: 1 passed, 0 failed, 1 skipped of 2 checks in 2.2 s"


_RUN = """
import runpy, sys
sys.argv = [{path!r}, *{args!r}]
runpy.run_path({path!r}, run_name="__main__")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_cpu_mode_checks_pass_against_their_references(tmp_path, ranks):
    result = run_job(_RUN.format(path=str(SMOKE), args=["--cpu"]), ranks, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("TOTAL OK: ") for line in lines), result.output
    assert not [line for line in lines if line.startswith("FAIL")], result.output
    checks = [line for line in lines if line.startswith(("PASS", "SKIP"))]
    assert len(checks) >= 30, result.output
    if ranks > 1:
        assert any(line.startswith("PASS context mixing CPU and GPU ranks") for line in lines), result.output


@pytest.mark.subprocess
def test_without_cupy_every_gpu_check_fails(tmp_path):
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    result = run_job(_RUN.format(path=str(SMOKE), args=[]), 2, timeout=120, tmp_path=tmp_path)
    assert result.returncode != 0, result.output
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("PASS", "SKIP"))], result.output
    assert any(line.startswith("TOTAL FAILED: 0 passed, ") for line in lines), result.output
    assert "CuPy cannot be imported" in result.stdout


_LOPSIDED = """
import sys, time
sys.path.insert(0, {scripts!r})
import numpy as np
import mpitensor as mt
import gpu_smoke as smoke
from smoke_runner import run_all
from mpitensor._core.mpi import MPI, ensure_initialized

mt.defer_finalize()
ensure_initialized()


def gives_up(env):
    with env.context() as ctx:
        if ctx.rank == 1:
            raise ValueError("rank 1 gives up before the call")
        return mt.all_reduce(np.ones(3)).resolve(timeout=10)


def never_calls(env):
    with env.context() as ctx:
        if ctx.rank == 1:
            time.sleep(3)
            return "slept"
        return mt.all_reduce(np.ones(3)).resolve(timeout=1)


def after(env):
    with env.context() as ctx:
        return str(mt.all_reduce(np.ones(3)).resolve(timeout=10).numpy().tolist())


rank = MPI.COMM_WORLD.Get_rank()
checks = [("gives up", gives_up), ("never calls", never_calls), ("after", after)]
sys.exit(run_all(checks, smoke.Env(cpu=True), limit=20, allgather=MPI.COMM_WORLD.allgather,
                 emit=print if rank == 0 else None))
"""


@pytest.mark.subprocess
def test_a_check_one_rank_leaves_or_never_joins_fails_and_the_next_check_works(tmp_path):
    result = run_job(_LOPSIDED.format(scripts=str(ROOT / "scripts")), 2, timeout=90, tmp_path=tmp_path)
    assert result.returncode != 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP", "TOTAL"))]
    assert len(lines) == 4, result.output
    assert lines[0].startswith("FAIL gives up (") and "rank 1: ValueError: rank 1 gives up" in lines[0], lines[0]
    assert "rank 0: CollectiveMismatchError" in lines[0], lines[0]
    assert lines[1].startswith("FAIL never calls (") and "rank 0: CollectiveTimeoutError" in lines[1], lines[1]
    assert lines[2].startswith("PASS after (") and lines[2].endswith("): [2.0, 2.0, 2.0]"), lines[2]
    assert lines[3].startswith("TOTAL FAILED: 1 passed, 2 failed, 0 skipped of 3 checks")
