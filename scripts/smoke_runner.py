"""Run named checks one by one, each isolated and under a time limit, and report one line each.

The runner of `gpu_smoke.py`, plain Python (no MPI, no CuPy) so that it can be tested
anywhere. A check is a function of one argument (whatever the caller passes, its
environment) that returns a detail string, raises `Skip` when it does not apply, or raises
anything else to fail. An exception fails that check only; a check still running after its
time limit is interrupted (a ``SIGALRM`` in the main thread, which ends Python code and
sleeps, not a call blocked inside C: resolve() timeouts bound those). Under MPI every rank
runs the same checks and `allgather` combines their outcomes: a check fails if it failed on
any rank. Rank 0 prints one line per check and a total; the exit status is 1 if any check
failed, else 0, the same on every rank.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckTimeoutError", "Outcome", "Skip", "combine", "run_all", "run_check", "summary"]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """Raised by a check that does not apply here (with the reason)."""


class CheckTimeoutError(Exception):
    """Raised inside a check that ran past its time limit."""


@dataclass(frozen=True)
class Outcome:
    """One check's result on one rank (or combined over the ranks).

    Attributes:
        name: the check's name.
        status: ``"PASS"``, ``"FAIL"`` or ``"SKIP"``.
        detail: what was checked, or why it failed or was skipped.
        seconds: how long it took.
    """

    name: str
    status: str
    detail: str
    seconds: float

    def line(self) -> str:
        """The check's report line: status, name, time and detail."""
        return f"{self.status} {self.name} ({self.seconds:.2f} s): {self.detail}"


def _failure(exc: BaseException) -> str:
    """A failed check's detail: the exception, and where in the check it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}]" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " | ")


def run_check(name: str, check: Callable[[Any], Any], env: Any, limit: float) -> Outcome:
    """Run one check, turning whatever it raises into its outcome.

    Args:
        name: the check's name.
        check: the check (``check(env)`` returns a detail, raises `Skip` or fails).
        env: passed to the check.
        limit: seconds after which the check is interrupted (in the main thread only).

    Returns:
        The outcome; never raises (KeyboardInterrupt and SystemExit aside).
    """
    start = time.monotonic()
    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    live = [True]  # the alarm interrupts the check only, never the reporting around it
    previous: Any = None
    if timed:
        previous = signal.signal(signal.SIGALRM, _raise_timeout(limit, live))
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        try:
            detail = check(env)
        finally:
            live[0] = False
        status, detail = PASS, "ok" if detail is None else str(detail)
    except Skip as skip:
        status, detail = SKIP, str(skip)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        status, detail = FAIL, _failure(exc)
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return Outcome(name, status, detail, time.monotonic() - start)


def _raise_timeout(limit: float, live: list[bool]) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        if live[0]:
            raise CheckTimeoutError(f"still running after {limit:g} s")

    return handler


def combine(outcomes: Sequence[Outcome]) -> Outcome:
    """One check's outcome over every rank: FAIL if any rank failed, SKIP if every rank skipped.

    Args:
        outcomes: the check's outcome on each rank, in rank order.

    Returns:
        The combined outcome (its time: the slowest rank's).
    """
    first = outcomes[0]
    seconds = max(o.seconds for o in outcomes)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.status == FAIL]
    if failed:
        details = {o.detail for _, o in failed}
        if len(failed) == len(outcomes) and len(details) == 1:
            detail = f"every rank: {failed[0][1].detail}"
        else:
            detail = "; ".join(f"rank {rank}: {o.detail}" for rank, o in failed)
        return Outcome(first.name, FAIL, detail, seconds)
    if all(o.status == SKIP for o in outcomes):
        return Outcome(first.name, SKIP, first.detail, seconds)
    passed = next(o for o in outcomes if o.status == PASS)
    return Outcome(first.name, PASS, passed.detail, seconds)


def summary(outcomes: Sequence[Outcome], seconds: float) -> str:
    """The closing line: how many checks passed, failed and were skipped."""
    counts = {status: sum(o.status == status for o in outcomes) for status in (PASS, FAIL, SKIP)}
    verdict = "FAILED" if counts[FAIL] else "OK"
    return (f"TOTAL {verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped "
            f"of {len(outcomes)} checks in {seconds:.1f} s")


def run_all(
    checks: Sequence[tuple[str, Callable[[Any], Any]]],
    env: Any,
    *,
    limit: float,
    allgather: Callable[[Outcome], list[Outcome]] = lambda outcome: [outcome],
    emit: Callable[[str], None] | None = print,
) -> int:
    """Run every check in order and report; the exit status.

    Args:
        checks: (name, check) pairs, the same on every rank.
        env: passed to each check.
        limit: each check's time limit in seconds.
        allgather: every rank's outcome of a check, in rank order (one process: a list of
            its own); it also keeps the ranks in step between checks.
        emit: prints a line (None on ranks that do not print).

    Returns:
        1 if any check failed, else 0.
    """
    start = time.monotonic()
    combined: list[Outcome] = []
    for name, check in checks:
        outcome = combine(allgather(run_check(name, check, env, limit)))
        combined.append(outcome)
        if emit is not None:
            emit(outcome.line())
    if emit is not None:
        emit(summary(combined, time.monotonic() - start))
    return 1 if any(o.status == FAIL for o in combined) else 0
