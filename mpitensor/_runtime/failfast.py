"""Fail-fast: an exception that escapes on one rank ends the whole job.

Without it, one rank's uncaught exception leaves the other ranks waiting forever in a
collective. While a context is open (or one was left by an exception), mpitensor's
``sys.excepthook`` prints the traceback once, each line prefixed with the rank, and calls
``MPI_Abort`` on ``MPI_COMM_WORLD``, which makes the launcher end every rank with a
non-zero exit. Before that it unlinks the MPI library's files of the job that it can name
(`release_job_files`), which MPICH removes only when a job ends normally.

An uncaught `RankFailedError` (raised only with fault tolerance on) ends this rank alone,
with exit status 1 and without ``MPI_Abort``: the program asked that the survivors of a
failure go on, and this rank's end is one more failure they survive.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

from .._core import shm_cleanup as _shm_cleanup
from .._core import state as _state
from .._core.errors import RankFailedError
from .._core.mpi import MPI

__all__ = [
    "abort_job", "arm", "disarm_left_contexts", "forget_abort", "note_left_by_exception", "on_abort",
    "release_job_files",
]

_previous_hook = None
_left_by_exception = 0
_before_abort: list[Callable[[], None]] = []  # the traces' flight recorders


def on_abort(callback: Callable[[], None]) -> None:
    """Call `callback` (which must not raise) before fail-fast or ``ctx.abort()`` ends the job."""
    _before_abort.append(callback)


def forget_abort(callback: Callable[[], None]) -> None:
    """Stop calling `callback` before an abort (its trace was written)."""
    if callback in _before_abort:
        _before_abort.remove(callback)


def run_before_abort() -> None:
    """Run the callbacks `on_abort` registered (each at most once; never raises)."""
    while _before_abort:
        callback = _before_abort.pop()
        try:
            callback()
        except Exception as exc:  # the job is ending: report, and go on aborting
            sys.stderr.write(f"mpitensor: before aborting, {callback!r} failed: {exc}\n")


def arm() -> None:
    """Install the hook (once per process)."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def note_left_by_exception() -> None:
    """A context was left by an exception: keep aborting on uncaught exceptions."""
    global _left_by_exception
    _left_by_exception += 1


def disarm_left_contexts() -> None:
    """Forget contexts left by exceptions (after MPI was finalized cleanly)."""
    global _left_by_exception
    _left_by_exception = 0


def release_job_files() -> None:
    """Unlink this job's MPI shared-memory files: call it just before ``MPI_Abort``.

    MPICH removes ``/dev/shm/mpich_shm_*`` (and Hydra its topology file) only when the job
    ends normally; after ``MPI_Abort`` they would keep their memory until someone removes
    them or the machine restarts. The files this rank maps or holds open, and its Hydra
    proxy's topology file, are unlinked (the other ranks' mappings stay valid while the job
    ends). Never raises.
    """
    _shm_cleanup.unlink_job_files()


def _armed() -> bool:
    if not (_state.open_count() or _left_by_exception):
        return False
    return bool(MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1)


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if not _armed():
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    rank = MPI.COMM_WORLD.Get_rank()
    size = MPI.COMM_WORLD.Get_size()
    prefix = f"[rank {rank}] "
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    lines = [prefix + line for line in text.rstrip("\n").split("\n")]
    if isinstance(exc, RankFailedError):
        _end_rank_alone(lines, prefix, rank, size)
    lines.append(
        f"{prefix}mpitensor: uncaught {exc_type.__name__} on rank {rank} of {size}; "
        "aborting the job (MPI_Abort) so that the other ranks do not wait forever"
    )
    try:
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        run_before_abort()
        release_job_files()
        sys.stderr.flush()
        sys.stdout.flush()
        # MPICH's Hydra kills every rank as soon as one aborts; give its proxy a moment to
        # forward what this rank just wrote, which it otherwise loses now and then.
        time.sleep(0.2)
    finally:
        abort_job(1)


# Seconds MPI_Abort may take before this process ends itself (SIGALRM): Open MPI's launcher under
# --with-ft ulfm has left it waiting after a rank's death.
ABORT_GRACE = 10


def abort_job(errorcode: int) -> None:
    """``MPI_Abort`` on ``MPI_COMM_WORLD``; this process ends whatever MPI does. Never returns."""
    if hasattr(signal, "alarm") and threading.current_thread() is threading.main_thread():
        signal.alarm(ABORT_GRACE)  # its default action ends the process, and then the launcher the job
    try:
        MPI.COMM_WORLD.Abort(errorcode)
    finally:
        os._exit(errorcode)  # MPI_Abort may return before the launcher ends this process


def _end_rank_alone(lines: list[str], prefix: str, rank: int, size: int) -> None:
    """End this rank without ending the job: an uncaught `RankFailedError` under fault tolerance."""
    lines.append(
        f"{prefix}mpitensor: uncaught RankFailedError on rank {rank} of {size}; this rank ends (exit status 1) "
        "without ending the job (on_rank_failure='raise'): the other survivors go on"
    )
    try:
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)
