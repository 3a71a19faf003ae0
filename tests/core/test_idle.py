"""Waits give the core back: yields while they are cheap, short sleeps once the core is contested.

Open MPI's blocking calls pause through mpitensor's progress callback while armed; other
MPIs' held calls are their nonblocking forms waited by mpitensor (`idle.blocking_waits`).
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core import idle
from mpitensor._core.mpi import MPI, vendor
from tests.helpers import ranks_outnumber_cores


def test_late_yields_in_a_row_mark_the_core_contested_and_pauses_then_sleep(monkeypatch):
    late = idle.SLOW_YIELD_NS / 1e9 * 1.5
    monkeypatch.setattr(idle, "_contested", idle._Contested())
    monkeypatch.setattr(idle, "_yield", lambda: None)
    idle.pause()
    assert idle._contested.until == 0, "a yield that came back at once marks nothing"
    monkeypatch.setattr(idle, "_yield", lambda: time.sleep(late))
    for _ in range(idle.LATE_YIELDS - 1):
        idle.pause()
    assert idle._contested.until == 0, "a late yield now and then happens on a quiet machine"
    idle.pause()
    assert idle._contested.until > time.monotonic_ns(), "a few, each soon after the one before, mark it contested"
    yields = []
    monkeypatch.setattr(idle, "_yield", lambda: yields.append(1))
    idle.pause()
    assert yields == [], "while contested, a pause sleeps instead of yielding"


def test_a_late_yield_long_after_the_last_marks_nothing(monkeypatch):
    monkeypatch.setattr(idle, "_contested", idle._Contested())
    monkeypatch.setattr(idle, "_yield", lambda: time.sleep(idle.SLOW_YIELD_NS / 1e9 * 1.5))
    for _ in range(idle.LATE_YIELDS - 1):
        idle.pause()
    idle._contested.slow_at -= idle.AGAIN_NS
    idle.pause()
    assert idle._contested.until == 0


def test_where_ranks_outnumber_cores_pauses_only_yield(monkeypatch):
    monkeypatch.setattr(idle, "_contested", idle._Contested())
    idle._contested.until = time.monotonic_ns() + idle.CONTESTED_NS  # contested: pauses would sleep
    yields = []
    monkeypatch.setattr(idle, "_yield", lambda: yields.append(1))
    idle._contested.oversubscribed = True
    idle.pause()
    assert yields == [1], "a peer of the job takes the core and gives it back: a yield, never a sleep"
    idle._contested.oversubscribed = False
    idle.pause()
    assert yields == [1]


def test_a_context_says_whether_ranks_outnumber_cores():
    with mt.DistributedContext.init() as ctx:
        assert idle._contested.oversubscribed == ranks_outnumber_cores(ctx)


def test_held_calls_wait_the_way_their_mpi_allows_and_give_right_results():
    with mt.DistributedContext.init() as ctx:
        assert idle.blocking_waits() == (vendor()[0] == "Open MPI")
        arm = idle.open_mpi_arm()
        if vendor()[0] != "Open MPI" or "OMPI_MCA_mpi_yield_when_idle" in os.environ:
            assert arm is None, "nothing to arm: not Open MPI, or the program chose Open MPI's setting"
        else:
            assert arm is not None, "Open MPI exports what the arm needs"
            if importlib.util.find_spec("mpitensor._core._idle") is not None:
                assert idle.sleeps_when_contested(), "the compiled progress callback is registered"
            assert arm(True) is False, "nothing is armed between calls"
            assert arm(False) is True, "the arm says what it was"
        for _ in range(3):  # held calls: the first in Python, the later ones compiled where built
            result = mt.all_reduce(np.ones(20_000), held=True).resolve().numpy()
            np.testing.assert_array_equal(result, np.full(20_000, float(ctx.size)))
            source, gathered = np.full(5_000, float(ctx.rank)), np.empty(5_000 * ctx.size)
            mt.all_gather(source, out=gathered, held=True).resolve()
            np.testing.assert_array_equal(gathered, np.repeat(np.arange(ctx.size, dtype=float), 5_000))
        if arm is not None:
            assert arm(False) is False, "every call disarmed after itself"


def test_wait_completes_a_request():
    with mt.DistributedContext.init() as ctx:
        value = np.array([float(ctx.rank + 1)])
        out = np.empty(1)
        idle.wait(ctx.comm.Iallreduce(value, out, MPI.SUM))
        assert out[0] == ctx.size * (ctx.size + 1) / 2


@pytest.mark.parametrize("blocking", [True, False])
def test_idle_call_runs_the_call_to_its_end(monkeypatch, blocking):
    monkeypatch.setattr(idle, "blocking_waits", lambda: blocking)
    with mt.DistributedContext.init() as ctx:
        value = np.full(3, float(ctx.rank))
        out = np.empty(3)
        idle.idle_call(ctx.comm.Allreduce, ctx.comm.Iallreduce, value, out, MPI.SUM)
        np.testing.assert_array_equal(out, np.full(3, float(sum(range(ctx.size)))))
