"""What every public collective does on entry: the thread rule and failed turns.

Two rules keep one rank's mistake from desynchronizing the group:

- **One thread per context.** Collectives run in call order on every rank; two threads
  calling collectives of one context interleave differently on each rank, which pairs one
  thread's data with another's. A call from any thread but the one that opened the context
  raises `ThreadMisuseError`. (`resolve()` and `test()` may be called from any thread; a
  compiled JAX program's collectives run on XLA's threads, in an order `ordering` keeps.)
- **A call that fails on its own rank still takes its turn.** A bad argument on one rank
  raises there, before anything is posted; its peers, which called the same collective,
  would otherwise pair their call with that rank's *next* one. So, with the consistency
  check on, the failing rank posts a check that says "failed" (and why) in the group's
  sequence: its peers raise `CollectiveMismatchError` naming it, and the next collective
  lines up on every rank.

MPI's own errors never escape as ``mpi4py.MPI.Exception``: they become `ContextBrokenError`
naming the operation, group and rank.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .._core.errors import DeviceError, MpitensorError, ThreadMisuseError, TracedArrayError
from .._core.mpi import MPI
from .._core.state import open_contexts
from .check import Record
from .ordering import is_delegated, wait_for_compiled

__all__ = ["collective_entry"]

F = TypeVar("F", bound=Callable[..., Any])


def collective_entry(kind: str) -> Callable[[F], F]:
    """Wrap a public collective with the thread rule and failed turns.

    Args:
        kind: the collective's name in the check (``"all_reduce"``, ...).

    Returns:
        A decorator for a function with a ``devices`` parameter.
    """

    def wrap(function: F) -> F:
        position = list(inspect.signature(function).parameters).index("devices")

        @functools.wraps(function)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not open_contexts:
                return function(*args, **kwargs)
            ctx = open_contexts[-1]
            if threading.get_ident() != ctx.owner_thread:
                if not is_delegated():
                    raise _thread_error(kind, ctx)
            else:
                wait_for_compiled()
            engine = ctx.engine
            if engine.lock_held_here():
                # A signal handler that interrupted this thread inside the engine: even a
                # failed turn would post a check in the middle of the interrupted call.
                raise engine.reentered(kind)
            posted = engine.checks_posted
            try:
                return function(*args, **kwargs)
            except MPI.Exception as exc:
                raise engine.mpi_failed(exc, None, kind) from exc
            except Exception as exc:
                if engine.checks_posted == posted and _is_local(exc) and ctx.config.check:
                    devices = kwargs["devices"] if "devices" in kwargs else (
                        args[position] if len(args) > position else None
                    )
                    _take_failed_turn(ctx, kind, devices, exc)
                raise

        return entry  # type: ignore[return-value]

    return wrap


def _is_local(exc: BaseException) -> bool:
    """True for errors of this rank's own arguments (not the outcome of a check or of MPI)."""
    return isinstance(exc, (DeviceError, TracedArrayError)) or not isinstance(exc, MpitensorError)


def _take_failed_turn(ctx: Any, kind: str, devices: Any, exc: BaseException) -> None:
    """Post a check saying this rank's `kind` failed with `exc`, on the group it names.

    When `devices` itself is what was wrong, the turn is taken on the whole context,
    where the peers most likely are.
    """
    if ctx.closed or ctx.broken:
        return
    try:
        group = ctx.group(devices, kind)
    except Exception as lookup_error:
        if not _is_local(lookup_error):
            return  # the group could not be created with the peers: they learnt of it there
        group = ctx.group(None, kind)
    if group.size < 2:
        return
    record = Record(kind, None, None, None, -1, group.members)
    record.failure = f"{type(exc).__name__}: {exc}"
    engine = ctx.engine
    engine.see_stand_in_through(engine.post_stand_in(f"failed {kind}", group, record), ctx.config.check_grace)


def _thread_error(kind: str, ctx: Any) -> ThreadMisuseError:
    current = threading.current_thread()
    return ThreadMisuseError(
        f"{kind} was called from thread {current.name!r}, but this context's collectives must be "
        f"called from the thread that opened it ({ctx.owner_thread_name!r}): ranks run collectives "
        "in call order, and two threads would interleave differently on each rank, pairing one "
        "thread's data with another's. Call collectives from that one thread (resolve() and test() "
        "may be called from any thread)"
    )
