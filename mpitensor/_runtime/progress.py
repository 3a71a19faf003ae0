"""The progress thread: drives communication while the program computes.

Open MPI and MPICH advance a non-blocking collective only while the process calls into
MPI; a program that starts an all-reduce and then computes in NumPy gets no overlap at
large sizes, because the collective's later rounds wait for the next MPI call. This thread
makes those calls: while a large collective is in flight it runs the engine's progress
(``MPI_Testall`` on the requests in flight, the shared-memory steps) every `interval`
seconds, and sleeps otherwise. It needs ``MPI_THREAD_MULTIPLE``; the engine's lock keeps it
and the program's own calls apart (a rank blocked in ``resolve()`` holds the lock inside
``MPI_Waitall``, which progresses everything itself, so the thread then just waits).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any, Protocol

__all__ = ["ProgressThread", "Progressable"]

_PR_SET_TIMERSLACK = 29


def _tighten_timer_slack(nanoseconds: int) -> None:
    """Let this thread's short sleeps end on time (Linux rounds them up by 50 us)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Progressable(Protocol):
    """What the thread drives (the `Engine` is one): its lock, whether work is in flight, a step."""

    lock: Any

    def busy(self) -> bool:
        """Whether operations are in flight."""

    def progress(self) -> None:
        """Advance what is in flight without blocking."""


class ProgressThread:
    """A daemon thread that progresses an engine's collectives while they are in flight.

    Args:
        engine: the engine to drive.
        interval: seconds between two progress calls while work is in flight; short
            enough for the rounds of a large all-reduce to follow each other promptly,
            long enough to leave the CPU to the program's compute.
        min_bytes: collectives smaller than this do not wake the thread: they take about
            as long as waking a thread costs, and complete within their own resolve.
    """

    def __init__(self, engine: Progressable, interval: float = 2e-5, min_bytes: int = 1 << 20) -> None:
        self.engine = engine
        self.interval = interval
        self.min_bytes = min_bytes
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.wakeups = 0

    def wake(self, nbytes: int) -> None:
        """Tell the thread a collective of `nbytes` is in flight (starts it if needed)."""
        if nbytes < self.min_bytes or self._stop:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mpitensor-progress", daemon=True)
            self._thread.start()
        self._wake.set()

    @property
    def running(self) -> bool:
        """True once the thread was started and until it is stopped."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        _tighten_timer_slack(1000)
        engine = self.engine
        try:
            while not self._stop:
                self._wake.wait()
                self._wake.clear()
                self.wakeups += 1
                lock = engine.lock
                while not self._stop and engine.busy():
                    # A rank blocked in resolve() holds the lock inside MPI_Wait, which
                    # progresses everything itself: then there is nothing to do here.
                    if lock.acquire(blocking=False):
                        try:
                            engine.progress()
                        finally:
                            lock.release()
                    time.sleep(self.interval)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
