"""Misuse that would hang a job, run as child jobs under a hard time limit.

Group mismatches that form wait cycles, the swapped-groups case of docs/failures.md, and a rank that
leaves while its peers wait: every rank ends with a result or an `MpitensorError`, in
seconds, and the job exits normally when the program catches the errors.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess

# Each rank runs its list of calls (None: the whole context; a list: that group), catching
# mismatches, then one more whole-context all-reduce, and reports every outcome.
_SEQUENCE = """
import time
import numpy as np
import mpitensor as mt

with mt.DistributedContext.init() as ctx:
    start = time.monotonic()
    for devices in {calls}[ctx.rank]:
        name = str(devices).replace(" ", "")
        try:
            got = mt.all_reduce(np.ones(3), devices=devices).resolve().numpy().tolist()
            report("call", name, "ok", got, round(time.monotonic() - start, 2))
        except mt.MpitensorError as exc:
            text = str(exc).replace("\\n", " | ")
            report("call", name, type(exc).__name__, round(time.monotonic() - start, 2), text)
    try:
        got = mt.all_reduce(np.full(2, float(ctx.rank))).resolve().numpy().tolist()
        report("next", "ok", got)
    except mt.MpitensorError as exc:
        report("next", type(exc).__name__, str(exc).replace("\\n", " | "))
report("closed")
"""


def test_a_wait_cycle_over_three_sub_groups_fails_on_every_rank_and_the_next_call_works(tmp_path):
    calls = {0: [[0, 1], [0, 2]], 1: [[1, 2], [0, 1]], 2: [[0, 2], [1, 2]]}
    result = run_job(_SEQUENCE.format(calls=calls), 3, timeout=60, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    lines = result.reported("call")
    assert len(lines) == 6, result.output
    for line in lines:
        assert "CollectiveMismatchError" in line and "Mismatched groups" in line, line
        assert "Wait cycle: rank" in line, line
        assert float(line.split()[3]) < 5.0, line  # seconds since the first call
    assert result.reported("next") == ["next ok [3.0, 3.0]"] * 3, result.output
    assert len(result.reported("closed")) == 3


def test_the_swapped_groups_case_ends_without_a_hang(tmp_path):
    # Rank 0 calls the whole context then [0, 1]; rank 1 the other way round; rank 2 the
    # whole context. Each disagreement fails the calls involved (calls pair by their order
    # on each group), and a rank that closes while its peers still call collectives tells them.
    calls = {0: [None, [0, 1]], 1: [[0, 1], None], 2: [None]}
    result = run_job(_SEQUENCE.format(calls=calls), 3, timeout=60, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.seconds < 30, result.output
    outcomes = result.reported("call") + result.reported("next")
    assert len(outcomes) == 8, result.output
    for line in outcomes:
        assert " ok " in line or "MismatchError" in line, line
    first = [line for line in result.reported("call") if line.startswith(("call None", "call [0,1]"))][:3]
    assert all("Mismatched groups" in line for line in first), result.output
    assert len(result.reported("closed")) == 3


@pytest.mark.parametrize("how", ["sys.exit(0)", "ctx.close()"])
def test_a_rank_that_leaves_while_its_peers_wait_tells_them(tmp_path, how):
    result = run_job(
        f"""
        import sys, time
        import numpy as np
        import mpitensor as mt

        start = time.monotonic()
        with mt.DistributedContext.init() as ctx:
            if ctx.rank == 1:
                {how}
            else:
                try:
                    mt.all_reduce(np.ones(3)).resolve()
                    report("unexpected result")
                except mt.MpitensorError as exc:
                    report("error", type(exc).__name__, round(time.monotonic() - start, 2), str(exc))
        report("closed")
        """,
        3,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    errors = result.reported("error")
    assert len(errors) == 2, result.output
    for line in errors:
        assert line.startswith("error CollectiveMismatchError"), line
        assert "Rank 1 closed the context (or left the program) while this rank called all_reduce" in line, line
        assert float(line.split()[2]) < 5.0, line
    # sys.exit() leaves the program at once; close() goes on to the end.
    assert len(result.reported("closed")) == (2 if how.startswith("sys") else 3)
    assert not result.reported("unexpected")


def test_with_the_check_off_mpi_errors_still_come_as_mpitensor_errors(tmp_path):
    # Without the check, mismatched calls reach MPI: Open MPI reports a truncation, MPICH
    # may wait; either way the program sees an MpitensorError, never mpi4py's exception.
    result = run_job(
        """
        import numpy as np
        import mpitensor as mt

        config = mt.DistributedConfig(check=False, timeout=3)
        ctx = mt.DistributedContext.init(config=config)
        try:
            if ctx.rank == 0:
                mt.all_gather(np.ones(64)).resolve()
            else:
                mt.all_reduce(np.ones(2)).resolve()
            report("no error")
        except Exception as exc:
            report("error", type(exc).__module__, type(exc).__name__, isinstance(exc, mt.MpitensorError))
        """,
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    lines = result.reported("error") + result.reported("no error")
    assert len(lines) == 2, result.output
    for line in lines:
        assert line.startswith("error mpitensor._core.errors") and line.endswith("True"), line


_BROKEN = """
import numpy as np
import mpitensor as mt

ctx = mt.DistributedContext.init()
for _ in range(2):
    mt.all_reduce(np.ones(3)).resolve()
ctx.mark_broken("broken on purpose")
try:
    mt.all_reduce(np.ones(3))
    report("no error")
except mt.MpitensorError as exc:
    report(type(exc).__name__, str(exc))
"""


def test_a_broken_context_is_refused_on_the_lane(tmp_path):
    """Repeated small all-reduces take a lane that skips the entry: a broken context still refuses them."""
    result = run_job(_BROKEN, 2, timeout=60, tmp_path=tmp_path)
    lines = [result.reports.get(rank, []) for rank in range(2)]
    assert all(len(got) == 1 and got[0].startswith("ContextBrokenError") for got in lines), (lines, result.err)
    assert all("broken on purpose" in got[0] for got in lines), lines
