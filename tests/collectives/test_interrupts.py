"""Signals and the engine: Ctrl-C in resolve(), handlers that call back in, interrupts inside a call.

A wait in `resolve()` is a loop of tests, never one blocking ``MPI_Wait``: Ctrl-C raises
``KeyboardInterrupt`` there at once, the op stays tracked and a later `resolve()` finishes it;
uncaught, fail-fast ends the job. A signal handler that calls `resolve()` while its own thread
is inside the engine is refused with `ThreadMisuseError`, and nothing of the interrupted call
is changed. An exception raised by a handler while a compiled call waits for its check finds
the call's op queued with its check: the peers' calls still pair with it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import run_job

_REENTERED = (
    "{} was called while this thread was inside mpitensor's engine (posting or completing a collective), "
    "from a signal handler or finalizer that interrupted it: collectives, resolve() and test() may not be "
    "re-entered from there. Set a flag in the handler and act on it after the interrupted call returns"
)

_LANES = [pytest.param(None, id="compiled"), pytest.param({"MPITENSOR_NATIVE": "0"}, id="python")]
_HANDLE = {"compiled": "LaneTensor", "python": "CollectiveTensor"}


def _lane_of(env: dict[str, str] | None) -> str:
    compiled = env is None and os.environ.get("MPITENSOR_NATIVE", "").strip() != "0"
    from mpitensor._collectives import native

    return "compiled" if compiled and native.built() else "python"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True])
def test_a_call_that_finds_the_engine_held_by_its_own_thread_is_refused(check):
    """What a signal handler that interrupted the engine meets: each entry refuses, nothing changes."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        # 128 bytes: more than a check carries, so the data is still in flight after the call.
        mt.all_reduce(np.ones(16)).resolve()
        if ctx.rank == 0:
            pending = mt.all_reduce(np.ones(16))
            with ctx.engine.lock:  # as the interrupted engine holds it
                calls = ((lambda: mt.all_reduce(np.ones(16)), "all_reduce"), (pending.resolve, "resolve()"),
                         (pending.test, "test()"), (mt.barrier, "barrier"))
                for call, what in calls:
                    with pytest.raises(mt.ThreadMisuseError) as caught:
                        call()
                    assert str(caught.value) == _REENTERED.format(what)
        else:
            time.sleep(0.5)  # rank 0's op is still in flight while it is refused
            pending = mt.all_reduce(np.ones(16))
        assert pending.resolve().numpy().tolist() == [float(ctx.size)] * 16
        assert mt.all_reduce(np.full(4, 2.0)).resolve().numpy().tolist() == [2.0 * ctx.size] * 4


# Rank 0 waits in resolve() for a peer that comes 3 s late, and gets SIGINT 0.5 s into the wait.
_CTRL_C = """
import os, signal, threading, time
import numpy as np
import mpitensor as mt

with mt.DistributedContext.init(config=mt.DistributedConfig(check={check})) as ctx:
    for _ in range(3):
        mt.all_reduce(np.ones(4)).resolve()
    if ctx.rank == 0:
        pending = mt.all_reduce(np.ones(4))
        report("handle", type(pending).__name__)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            pending.resolve()
            report("resolved before the peer came")
        except KeyboardInterrupt:
            report("interrupted within 1 s", time.monotonic() - start < 1.5)
        report("then", pending.resolve().numpy().tolist())
        if {uncaught}:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            mt.all_reduce(np.ones(4)).resolve()  # the peer never calls it
    else:
        time.sleep(3)
        report("then", mt.all_reduce(np.ones(4)).resolve().numpy().tolist())
        if {uncaught}:
            time.sleep(120)  # ended by rank 0's abort
    report("next", mt.all_reduce(np.full(4, 2.0)).resolve().numpy().tolist())
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("env", _LANES)
@pytest.mark.parametrize("check", [False, True])
def test_ctrl_c_in_resolve_raises_at_once_and_the_op_stays_tracked(tmp_path, check, env):
    """KeyboardInterrupt 0.5 s into the wait (not when the peer comes, 3 s in); resolve() again gives the sum."""
    result = run_job(_CTRL_C.format(check=check, uncaught=False), 2, timeout=90, env=env, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reports == {
        0: [f"handle {_HANDLE[_lane_of(env)]}", "interrupted within 1 s True", "then [2.0, 2.0, 2.0, 2.0]",
            "next [4.0, 4.0, 4.0, 4.0]"],
        1: ["then [2.0, 2.0, 2.0, 2.0]", "next [4.0, 4.0, 4.0, 4.0]"],
    }, result.output


@pytest.mark.subprocess
@pytest.mark.parametrize("check", [False, True])
def test_an_uncaught_ctrl_c_in_resolve_ends_the_job(tmp_path, check):
    """Fail-fast: the interrupted rank aborts the job, and its peer (asleep for 120 s) goes with it."""
    result = run_job(_CTRL_C.format(check=check, uncaught=True), 2, timeout=90, tmp_path=tmp_path)
    assert result.returncode != 0, result.output
    assert result.seconds < 60, result.output
    assert "[rank 0] mpitensor: uncaught KeyboardInterrupt on rank 0 of 2; aborting the job" in result.output
    assert result.reports[0][1:] == ["interrupted within 1 s True", "then [2.0, 2.0, 2.0, 2.0]"], result.output
    assert result.reports[1] == ["then [2.0, 2.0, 2.0, 2.0]"], result.output


# A handler every 0.5 ms resolves the last handle while the main thread posts calls (rank 0),
# and catches the refusal; rank 1 runs the same calls plainly.
_HANDLER_RESOLVES = """
import signal
import numpy as np
import mpitensor as mt

config = mt.DistributedConfig(check={check}, timeout=30)
with mt.DistributedContext.init(config=config) as ctx:
    latest = [None]
    outcomes = {{"resolved": 0}}

    def handler(signum, frame):
        if latest[0] is None:
            return
        try:
            latest[0].resolve()
            outcomes["resolved"] += 1
        except mt.ThreadMisuseError as exc:
            outcomes[str(exc)] = outcomes.get(str(exc), 0) + 1

    if ctx.rank == 0:
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 5e-4, 5e-4)
    wrong = []
    for i in range(3000):
        pending = mt.all_reduce(np.full(4, float(i)))
        latest[0] = pending
        if i % 3 == 0:
            value = pending.resolve().numpy().tolist()
            if value != [2.0 * i] * 4:
                wrong.append((i, value))
    signal.setitimer(signal.ITIMER_REAL, 0)
    latest[0] = None
    report("wrong", wrong)
    report("refusals", sorted(set(outcomes) - {{"resolved"}}))
    report("handler resolved some", ctx.rank == 1 or outcomes["resolved"] > 0)
    report("next", mt.all_reduce(np.full(2, 1.0)).resolve().numpy().tolist())
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("env", _LANES)
@pytest.mark.parametrize("check", [False, True])
def test_resolve_from_a_signal_handler_while_calls_are_posted_works_or_is_refused(tmp_path, check, env):
    """Never a hang nor a timeout inside an op's data: each handler's resolve() works, or is refused in words."""
    result = run_job(_HANDLER_RESOLVES.format(check=check), 2, timeout=150, env=env, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    refusals = result.reported("refusals")
    assert refusals[1] == "refusals []", result.output
    assert refusals[0] in ("refusals []", f"refusals {[_REENTERED.format('resolve()')]!r}"), result.output
    assert result.reported("wrong") == ["wrong []"] * 2, result.output
    assert result.reported("handler resolved some") == ["handler resolved some True"] * 2, result.output
    assert result.reported("next") == ["next [2.0, 2.0]"] * 2, result.output


# Check on: rank 0's calls often find rank 1 late, so their checks do not agree at once and the
# compiled lane queues the op; a handler every 1 ms raises an exception on rank 0 wherever the
# call then waits for its check (never while the engine's lock is held, nor before the call has
# posted anything). Each interrupted call's op must still be queued with its check, so rank 1's
# calls all pair with rank 0's and give exact sums.
_INTERRUPTED_CALLS = """
import random, signal, time
import numpy as np
import mpitensor as mt

class Interrupt(BaseException):
    pass

WAITS = {{"await_queued_check", "_await_check", "_wait_check", "pause", "queue_checked", "_carried_post",
          "_copy_post"}}
config = mt.DistributedConfig(timeout=30)
with mt.DistributedContext.init(config=config) as ctx:
    engine = ctx.engine

    def handler(signum, frame):
        if frame is not None and frame.f_code.co_name in WAITS and not engine.lock_held_here():
            raise Interrupt()

    random.seed(ctx.rank)
    for _ in range(3):  # the first calls of a kind make its lanes
        warm = mt.all_reduce(np.full({n}, 1.0))
        warm.resolve()
    report("lane", type(warm).__name__)
    wrong, interrupted = [], 0
    if ctx.rank == 0:
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 1e-3, 1e-3)
    for i in range(400):
        if ctx.rank == 1:
            time.sleep(random.random() * 2e-3)
        try:
            pending = mt.all_reduce(np.full({n}, float(i)))
        except Interrupt:
            interrupted += 1
            continue
        while True:
            try:
                value = pending.resolve().numpy().tolist()
                break
            except Interrupt:
                pass
        if value != [2.0 * i] * {n}:
            wrong.append((i, value))
    signal.setitimer(signal.ITIMER_REAL, 0)
    report("wrong", wrong)
    report("interrupted some", ctx.rank == 1 or interrupted > 0)
    report("next", mt.all_reduce(np.full(2, 1.0)).resolve().numpy().tolist())
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("n", [pytest.param(2, id="carried"), pytest.param(16, id="copy")])
def test_an_interrupt_while_a_compiled_call_waits_for_its_check_leaves_its_op_queued(tmp_path, n):
    """Every call rank 1 makes gets its exact sum, though rank 0 lost some calls' handles to an interrupt."""
    result = run_job(_INTERRUPTED_CALLS.format(n=n), 2, timeout=150, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("wrong") == ["wrong []"] * 2, result.output
    assert result.reported("interrupted some") == ["interrupted some True"] * 2, result.output
    if _lane_of(None) == "compiled":
        assert result.reported("lane") == ["lane LaneTensor"] * 2, result.output
    assert result.reported("next") == ["next [2.0, 2.0]"] * 2, result.output
