"""The one module that imports mpi4py: MPI's lifecycle, thread level and capabilities.

mpi4py initializes MPI when ``mpi4py.MPI`` is first imported unless told otherwise; this
module tells it not to, so that ``import mpitensor`` never starts MPI. The first
`DistributedContext` calls `ensure_initialized`. mpitensor finalizes MPI only if it
initialized it, exactly once: when the last context closes (the default), or at interpreter
exit after `defer_finalize()` (what test suites and notebooks that open many contexts want;
the bundled pytest plugin calls it). A program that initialized MPI itself keeps ownership.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

import mpi4py

if "mpi4py.MPI" not in sys.modules:
    # Only effective before mpi4py.MPI is first imported; if the program imported it
    # first, MPI is already initialized and belongs to the program.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

from mpi4py import MPI

from . import shm_cleanup as _shm_cleanup
from .errors import MpiFinalizedError

__all__ = [
    "MPI",
    "defer_finalize",
    "ensure_initialized",
    "finalize_policy",
    "is_owner",
    "library_version",
    "note_broken",
    "pointer_handles",
    "release",
    "thread_level",
    "thread_level_name",
    "vendor",
    "world_rank",
]

_lock = threading.Lock()
_owner = False  # mpitensor called Init_thread and so must call Finalize
_finalized_by_us = False
_defer = os.environ.get("MPITENSOR_FINALIZE", "close").strip().lower() == "exit"
_atexit_registered = False
_before_finalize: list[Callable[[], None]] = []
_broken: str | None = None  # why a collective can never complete, once one cannot

_THREAD_NAMES = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def _requested_thread_level() -> int:
    name = os.environ.get("MPITENSOR_THREAD_LEVEL", "multiple").strip().lower()
    for level, level_name in _THREAD_NAMES.items():
        if level_name == name:
            return level
    raise ValueError(
        f"MPITENSOR_THREAD_LEVEL must be one of {', '.join(_THREAD_NAMES.values())}, got {name!r}"
    )


def ensure_initialized() -> int:
    """Initialize MPI if nobody has, and return the thread level it provides.

    Returns:
        The provided thread level (``MPI.THREAD_*``).

    Raises:
        MpiFinalizedError: MPI was already finalized in this process.
    """
    global _owner, _atexit_registered
    with _lock:
        if MPI.Is_finalized():
            raise MpiFinalizedError(
                "MPI was already finalized in this process and cannot be initialized again. "
                "Open every DistributedContext before the last one closes, or call "
                "mpitensor.defer_finalize() (or set MPITENSOR_FINALIZE=exit) so that MPI is "
                "finalized at interpreter exit instead of when the last context closes."
            )
        if not MPI.Is_initialized():
            MPI.Init_thread(_requested_thread_level())
            _owner = True
            # A process started without a launcher leaves Open MPI's segment behind otherwise.
            on_finalize(_shm_cleanup.release_singleton_files)
            if not _atexit_registered:
                atexit.register(_finalize_at_exit)
                _atexit_registered = True
        return MPI.Query_thread()


def on_finalize(callback: Callable[[], None]) -> None:
    """Run `callback` just before mpitensor finalizes MPI (to free MPI handles)."""
    _before_finalize.append(callback)


def defer_finalize(defer: bool = True) -> None:
    """Keep MPI initialized after the last context closes; finalize it at interpreter exit.

    By default, closing the last `DistributedContext` finalizes MPI (when mpitensor
    initialized it), and MPI cannot be initialized again in that process. Test suites and
    notebooks that open and close many contexts call this first (the pytest plugin that
    ships with mpitensor does). ``MPITENSOR_FINALIZE=exit`` does the same.

    Args:
        defer: ``True`` to finalize at exit, ``False`` to restore finalizing on close.
    """
    global _defer
    _defer = bool(defer)


def finalize_policy() -> str:
    """``"exit"`` if finalization is deferred to interpreter exit, else ``"close"``."""
    return "exit" if _defer else "close"


def is_owner() -> bool:
    """True if mpitensor initialized MPI (and therefore finalizes it)."""
    return _owner


def release(open_contexts: int) -> bool:
    """Called when a context closes; finalizes MPI if that is now due.

    Args:
        open_contexts: how many contexts are still open in this process.

    Returns:
        True if MPI was finalized by this call.
    """
    if open_contexts or _defer:
        return False
    return _finalize()


def _finalize() -> bool:
    global _finalized_by_us
    with _lock:
        if not _owner or _finalized_by_us or MPI.Is_finalized() or not MPI.Is_initialized():
            return False
        callbacks = list(_before_finalize)
        _before_finalize.clear()
        for callback in callbacks:
            callback()
        MPI.Finalize()
        _finalized_by_us = True
        return True


FINALIZE_GRACE = 10.0  # seconds MPI_Finalize may take at exit with a collective stuck


def note_broken(reason: str) -> None:
    """Record that a collective can never complete (after a timeout).

    At exit, ``MPI_Finalize`` waits for the other ranks. If they exit too (a test suite
    that provoked the timeout on purpose), it completes; if a peer is stuck for good, it
    would wait forever, so an alarm then ends this process after `FINALIZE_GRACE`
    seconds, and the launcher ends the job.
    """
    global _broken
    if _broken is None:
        _broken = reason


def _finalize_at_exit() -> None:
    if _broken is not None and _owner and MPI.Is_initialized() and not MPI.Is_finalized():
        # MPI_Finalize runs holding the GIL, so no Python code can watch it; the alarm's
        # default action ends the process in the kernel, and a rank killed by a signal
        # makes either launcher end the job.
        sys.stderr.write(
            f"[rank {MPI.COMM_WORLD.Get_rank()}] mpitensor: finalizing MPI with a collective stuck in flight "
            f"({_broken}); if the other ranks do not finalize within {FINALIZE_GRACE:g} s, this process "
            "ends (SIGALRM) and the launcher ends the job\n"
        )
        sys.stderr.flush()
        signal.alarm(int(FINALIZE_GRACE))
        _finalize()
        signal.alarm(0)
        return
    _finalize()


def world_rank() -> int | None:
    """This process's rank in ``MPI_COMM_WORLD``, or None before MPI is initialized."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank()
    return None


def thread_level() -> int:
    """The thread level MPI provides (``MPI.THREAD_*``)."""
    return MPI.Query_thread()


def thread_level_name(level: int | None = None) -> str:
    """The thread level as a word: single, funneled, serialized or multiple."""
    return _THREAD_NAMES.get(MPI.Query_thread() if level is None else level, "unknown")


def vendor() -> tuple[str, str]:
    """The MPI implementation's name and version, e.g. ``("Open MPI", "5.0.11")``."""
    name, version = MPI.get_vendor()
    return name, ".".join(str(part) for part in version)


def library_version() -> str:
    """The first line of ``MPI_Get_library_version``."""
    return MPI.Get_library_version().strip().splitlines()[0]


def pointer_handles() -> bool | None:
    """Whether MPI's handles are pointers (Open MPI, the MPI 5 ABI), ints (MPICH and kin), or neither (None).

    Compiled code that calls MPI without its headers (`_collectives/native`) casts handles
    to one of those two; communicators, datatypes, ops and requests must all be of that size.
    """
    sizes = {MPI._sizeof(kind) for kind in (MPI.Comm, MPI.Datatype, MPI.Op, MPI.Request)}
    if sizes == {ctypes.sizeof(ctypes.c_void_p)}:
        return True
    if sizes == {ctypes.sizeof(ctypes.c_int)}:
        return False
    return None
