"""A rank that waits for a peer gives its core back, and gets it back soon where others want it.

On a machine whose cores are busy (a laptop running other work, a shared node, a CI box,
oversubscribed test ranks) a rank that spins while it waits keeps its core from the peer it
waits for, and one that yields (``sched_yield``) to a program that wants the core waits that
program's whole time slice under Linux's scheduler: a 332 KiB all-reduce took 10-18 ms where
gloo's, which sleeps in the kernel until its data comes, took 0.5-1.7 ms. So mpitensor's waits
spin briefly, then yield while yields come back at once (the core is free), and sleep briefly
once a few in a row came back late (the core is contested; `native/idle.h`, and the engine's
`Backoff`). Where the node runs more of the job's ranks than it has cores, pauses only yield:
the core goes to a peer of the job, which gives it back as soon as it waits in turn.

MPI's blocking calls wait in MPI's own loop. Open MPI's calls the functions registered with
``opal_progress_register`` on each round: mpitensor registers one (`native/idle.c`) that,
while one of mpitensor's blocking calls is armed (`idling`), follows the rule above, so
the blocking call keeps its speed on a quiet machine and gives the core back on a busy one.
It is registered once MPI is loaded, also where the program imported mpi4py first. Where the
compiled module is missing, Open MPI's own ``opal_progress_set_yield_when_idle`` is set
around the call instead (yields only). A program that set ``OMPI_MCA_mpi_yield_when_idle``
itself keeps its choice. Other MPIs (MPICH, Intel MPI) offer no such hook, and their loops
yield every 1,000 polls: there mpitensor posts the nonblocking form of the call and waits for
it itself (`wait`), as the compiled held calls do in C (`blocking_waits` says which; the
nonblocking forms took the blocking ones' time there, while Open MPI's took up to 2.5 times
as long).

What those waits found also chooses how a held all-reduce of 2 ranks moves its data: each
rank says in the call's check whether its core is contested (`contested`), and where one
does, both exchange their whole input once instead of MPI's two exchanges of half, each of
which waits for the peer to be scheduled again (`_transport.mpi.all_reduce.held_all_reduce`).
Where both run on one node, that exchange goes through memory they share, and a rank whose
peer is late sleeps in the kernel until the peer's input (or its check) is there
(`_transport.mpi.pair`): no wake-ups at all while the peer waits for a core.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

__all__ = [
    "arm_address", "blocking_waits", "contested", "contested_address",
    "idle_call", "idling", "mark_contested", "open_mpi_arm", "pause", "set_oversubscribed",
    "sleeps_when_contested", "wait",
]

# As native/idle.h: a wait spins this long before it pauses; a yield slower than SLOW_YIELD_NS
# gave the core away, LATE_YIELDS of them each within AGAIN_NS of the one before mark it
# contested, and pauses then sleep SLEEP_SECONDS for CONTESTED_NS.
SPIN_NS = 50_000
SLOW_YIELD_NS = 250_000
AGAIN_NS = 100_000_000
LATE_YIELDS = 3
CONTESTED_NS = 1_000_000_000
SLEEP_SECONDS = 20e-6

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_now = time.monotonic_ns


class _Contested:
    """When this process's pauses sleep until, when its last late yield ended, whether ranks outnumber cores."""

    __slots__ = ("late", "oversubscribed", "slow_at", "until")

    def __init__(self) -> None:
        self.until = 0
        self.slow_at = 0
        self.late = 0
        self.oversubscribed = False


_contested = _Contested()


def set_oversubscribed(flag: bool) -> None:
    """Say whether this node runs more of the job's ranks than it has cores (a context says it when it opens).

    There a yield gives the core to a peer of the job, which gives it back as soon as it
    waits in turn, so pauses only yield: a sleep could leave the core idle while a peer could
    run (16 ranks on 2 cores: a held 128 KiB all-reduce took 6.1-6.4x mpi4py's time with
    sleeps, 2.7-2.9x with yields).
    """
    _contested.oversubscribed = flag
    try:
        from ._idle import set_oversubscribed as compiled  # type: ignore[import-not-found]
    except ImportError:
        return
    compiled(flag)


def pause() -> None:
    """One pause of a wait for a peer: a yield, or a short sleep while the core is contested (`native/idle.h`)."""
    if _contested.oversubscribed:
        _yield()
        return
    start = _now()
    if start < _contested.until:
        time.sleep(SLEEP_SECONDS)
        return
    # Not time.sleep(0), which sleeps a timer slack (50 us or more): a yield costs a
    # microsecond when nobody else wants the core.
    _yield()
    end = _now()
    if end - start > SLOW_YIELD_NS:
        _contested.late = _contested.late + 1 if end - _contested.slow_at < AGAIN_NS else 1
        _contested.slow_at = end
        if _contested.late >= LATE_YIELDS:
            _contested.until = end + CONTESTED_NS

_SETTER = "opal_progress_set_yield_when_idle"
_REGISTER = "opal_progress_register"
_LIBRARY = "libopen-pal"


class _Found:
    """What arms Open MPI's blocking calls (a ctypes function, or None), whether held calls block; found once.

    With mpitensor's progress callback registered (`ours`), also its `contested` function and
    that function's compiled address.
    """

    __slots__ = ("blocking", "contested", "contested_at", "function", "library", "looked", "ours")

    def __init__(self) -> None:
        self.looked = False
        self.contested: Any = None
        self.contested_at = 0
        self.function: Any = None
        self.library: Any = None
        self.ours = False
        self.blocking: bool | None = None


_found = _Found()


def open_mpi_arm() -> Any:
    """The ``bool (bool)`` function set around a blocking call (it returns the previous setting); None without.

    mpitensor's progress callback's switch where it is registered, else Open MPI's
    ``opal_progress_set_yield_when_idle``; None where MPI is not Open MPI, or the program chose
    (``OMPI_MCA_mpi_yield_when_idle``). Call it once MPI is loaded.
    """
    if not _found.looked:
        _found.looked = True
        if "OMPI_MCA_mpi_yield_when_idle" not in os.environ:
            _found.library = _open_pal()
            if _found.library is not None:
                _found.function, _found.ours = _arm(_found.library)
    return _found.function


def sleeps_when_contested() -> bool:
    """Whether Open MPI's blocking calls follow mpitensor's idle rule (its progress callback is registered)."""
    return open_mpi_arm() is not None and _found.ours


def _open_pal() -> Any:
    """libopen-pal as this process loaded it; None without."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if _LIBRARY in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            getattr(library, _SETTER)
        except (OSError, AttributeError):
            continue
        return library
    return None


def _arm(library: Any) -> tuple[Any, bool]:
    """Register mpitensor's progress callback and return its switch, True; else Open MPI's yield setter, False."""
    switch = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_bool)
    registered = _register(library)
    if registered is not None:
        return switch(registered), True
    return switch(ctypes.cast(getattr(library, _SETTER), ctypes.c_void_p).value), False


def _register(library: Any) -> int | None:
    """Register the compiled progress callback with Open MPI; the address of its switch, or None without."""
    try:
        from ._idle import addresses, contested  # type: ignore[import-not-found]

        progress, arm, _found.contested_at = addresses()
        register = getattr(library, _REGISTER)
    except (ImportError, AttributeError):
        return None
    _found.contested = contested
    register.argtypes = [ctypes.c_void_p]
    register.restype = ctypes.c_int
    return arm if register(progress) == 0 else None


def contested() -> bool:
    """Whether this process's core is contested now, as mpitensor's waits in Open MPI's blocking calls found it.

    False where those waits do not follow mpitensor's rule (`sleeps_when_contested`: other
    MPIs, or a program that chose Open MPI's own setting) and where the job's ranks outnumber
    the node's cores. A held all-reduce of 2 ranks says it in its check, and both ranks then
    move the data in one exchange (`_transport.mpi.all_reduce.held_all_reduce`).
    """
    return sleeps_when_contested() and bool(_found.contested())


def mark_contested(seconds: float) -> None:
    """Have the waits in Open MPI's blocking calls take the core as contested for `seconds` (0: no longer).

    As a few late yields would (`native/idle.h`): their pauses sleep, and `contested` says
    so. For programs and tests that know the core is (or is not) shared; nothing where
    those waits do not follow mpitensor's rule (`sleeps_when_contested`).
    """
    if sleeps_when_contested():
        from ._idle import contest_for  # type: ignore[import-not-found]

        contest_for(seconds)


def contested_address() -> int:
    """The address of `contested`'s compiled ``int (void)`` function, for compiled code (0: none, never contested).

    Call it once MPI is loaded.
    """
    return _found.contested_at if sleeps_when_contested() else 0


def blocking_waits() -> bool:
    """Whether mpitensor's waits for MPI's data are MPI's blocking calls (Open MPI) or its own (`wait`).

    The same on every rank of a job (it depends on the MPI only), so no blocking call ever
    pairs with a nonblocking one. Call it once MPI is loaded.
    """
    if _found.blocking is None:
        from .mpi import vendor

        _found.blocking = vendor()[0] == "Open MPI"
    return _found.blocking


def wait(request: Any) -> None:
    """Test `request` until it completes, pausing once `SPIN_NS` passed; MPI's wait where ranks outnumber cores.

    Raises:
        MPI.Exception: MPI failed the request.
    """
    if _contested.oversubscribed:
        # Ranks outnumber cores: MPI's own wait polls many times between yields, as its
        # blocking calls do (a yield after each test was slower there).
        request.Wait()
        return
    test = request.Test
    start = _now()
    while not test():
        if _now() - start >= SPIN_NS:
            pause()


def idle_call(blocking: Any, nonblocking: Any, *args: Any, **kwargs: Any) -> None:
    """Run an MPI call to its end, giving the core back while it waits for a peer.

    Args:
        blocking: MPI's blocking call (an mpi4py method), run where `blocking_waits` (armed: `idling`).
        nonblocking: its nonblocking form, run elsewhere and waited by `wait`.
        args, kwargs: the call's arguments, the same for both.

    Raises:
        MPI.Exception: MPI failed the call.
    """
    if blocking_waits():
        with idling():
            blocking(*args, **kwargs)
    else:
        wait(nonblocking(*args, **kwargs))


def arm_address() -> int:
    """The address of `open_mpi_arm`'s function, for compiled code that makes blocking calls (0: none, nothing to do).

    Call it once MPI is loaded.
    """
    function = open_mpi_arm()
    return 0 if function is None else ctypes.cast(function, ctypes.c_void_p).value or 0


class idling:  # noqa: N801 - used as a statement, like a function
    """Around one blocking MPI call: while it waits for a peer, Open MPI's progress gives the core back.

    A no-op where MPI is not Open MPI, or the program set ``OMPI_MCA_mpi_yield_when_idle``.
    """

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        arm = open_mpi_arm()
        self.previous = None if arm is None else arm(True)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            open_mpi_arm()(self.previous)
