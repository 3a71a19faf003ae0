"""MPI's blocking calls give the core back while they wait for a peer.

Open MPI spins in a blocking call until its peers arrive, unless its ``mpi_yield_when_idle``
is set: then its progress loop yields the core whenever a round finds nothing to do. On a
machine whose cores are busy (a laptop running other work, a shared node, a CI box,
oversubscribed test ranks) a rank spinning in ``MPI_Allreduce`` keeps its core while the peer
it waits for needs one: a 332 KiB all-reduce took 13-18 ms where gloo's took 0.5-0.7 ms. The
setting is read when MPI is initialized, which mpitensor does not always do (a program that
imported mpi4py first has MPI initialized already), so mpitensor switches Open MPI's progress
to yield through Open MPI's own exported setter around each blocking call it makes, and back
after it: its nonblocking tests, which are its own loops and yield by themselves
(`engine.Backoff`), keep their speed on a quiet machine. A program that set
``OMPI_MCA_mpi_yield_when_idle`` itself keeps its choice. MPICH's progress loop yields every
1,000 polls already (``MPIR_CVAR_POSIX_POLL_FREQUENCY``), so its blocking calls need nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["open_mpi_setter", "open_mpi_yields", "setter_address", "yielding"]

_SETTER = "opal_progress_set_yield_when_idle"
_LIBRARY = "libopen-pal"


class _Found:
    """Open MPI's setter, looked up once: a ctypes function, or None where there is none (or the user chose)."""

    __slots__ = ("function", "library", "looked")

    def __init__(self) -> None:
        self.looked = False
        self.function: Any = None
        self.library: Any = None


_found = _Found()


def open_mpi_setter() -> Any:
    """Open MPI's ``opal_progress_set_yield_when_idle`` (a ctypes function); None: not Open MPI, or the program chose.

    Call it once MPI is loaded.
    """
    if not _found.looked:
        _found.looked = True
        if "OMPI_MCA_mpi_yield_when_idle" not in os.environ:
            _found.library, _found.function = _load()
    return _found.function


def open_mpi_yields() -> bool | None:
    """Whether Open MPI's progress yields the core when idle now; None where `open_mpi_setter` is None."""
    if open_mpi_setter() is None:
        return None
    return ctypes.c_bool.in_dll(_found.library, "opal_progress_yield_when_idle").value


def _load() -> tuple[Any, Any]:
    """libopen-pal as this process loaded it, and its ``opal_progress_set_yield_when_idle``; (None, None) without."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if _LIBRARY in line and "/" in line}
    except OSError:
        return None, None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            function = getattr(library, _SETTER)
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_bool]
        function.restype = ctypes.c_bool
        return library, function
    return None, None


def setter_address() -> int:
    """The address of Open MPI's setter, for compiled code that makes blocking calls (0: none, nothing to do).

    Call it once MPI is loaded.
    """
    function = open_mpi_setter()
    return 0 if function is None else ctypes.cast(function, ctypes.c_void_p).value or 0


class yielding:  # noqa: N801 - used as a statement, like a function
    """Around one blocking MPI call: Open MPI's progress yields the core while it finds nothing to do.

    A no-op where MPI is not Open MPI, or the program set ``OMPI_MCA_mpi_yield_when_idle``.
    """

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        setter = open_mpi_setter()
        self.previous = None if setter is None else setter(True)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            open_mpi_setter()(self.previous)
