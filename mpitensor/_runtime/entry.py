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

from .._core.errors import DeviceError, MpitensorError, NotAMemberError, ThreadMisuseError, TracedArrayError
from .._core.mpi import MPI
from .._core.protect import CallScope
from .._core.state import open_contexts
from .check import Record
from .ordering import is_delegated, wait_for_compiled

__all__ = ["collective_call", "collective_entry"]

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
            engine = _enter(ctx, kind)
            posted = engine.checks_posted
            scope = CallScope()
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                scope.fail()
                devices = kwargs["devices"] if "devices" in kwargs else (
                    args[position] if len(args) > position else None
                )
                _failed(ctx, kind, devices, posted, exc)
                raise
            finally:
                scope.close()

        return entry  # type: ignore[return-value]

    return wrap


class collective_call:  # noqa: N801 - used as a statement, like a function
    """The door of one collective call made of several steps: its rules over everything inside.

    What a public collective's own entry does, for code that validates or converts its
    arguments before it calls mpitensor's collectives (a framework backend, a traced
    program)::

        with mt.collective_call("all_reduce", devices):
            check_the_arguments()           # an error here still takes the call's turn
            mt.all_reduce(array, devices=devices).resolve()

    On entry: the one-thread rule. On an exception from inside, if no check of any group was
    posted since the entry, this rank takes the call's *failed turn* on the group `devices`
    names (with the consistency check on): its peers, which made the same call, raise
    `CollectiveMismatchError` naming this rank and its error, and the next collective lines
    up on every rank. A rank that is not a member of that group posts nothing (the members
    do not wait for it). MPI's own errors leave as `ContextBrokenError`. Nested doors and
    collectives compose: only the innermost failure takes the turn.

    Args:
        kind: the collective's name, for messages (``"all_reduce"``, ``"broadcast"``...).
        devices: the group, as the collective's ``devices`` (None: every rank).
        before: called on entry; whatever it raises takes the call's turn, an `MpitensorError`
            too (an integration's own finding that this rank cannot make the call: a failure
            of its callbacks' collectives it learned of since its last call).

    Raises:
        ThreadMisuseError: entered from another thread than the one that opened the context.
    """

    __slots__ = ("before", "ctx", "devices", "kind", "posted", "scope")

    def __init__(self, kind: str, devices: Any = None, before: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self.devices = devices
        self.before = before
        self.ctx: Any = None
        self.posted = 0
        self.scope: CallScope | None = None

    def __enter__(self) -> collective_call:
        if open_contexts:
            self.ctx = open_contexts[-1]
            # The collectives inside wait for the compiled programs before them themselves.
            self.posted = _enter(self.ctx, self.kind, wait=False).checks_posted
            self.scope = CallScope()
            if self.before is not None:
                try:
                    self.before()
                except Exception as exc:
                    self.scope.fail()
                    if self.ctx.config.check:
                        _take_failed_turn(self.ctx, self.kind, self.devices, exc)
                    raise
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        scope = self.scope
        if scope is None:
            return False
        if exc is not None and isinstance(exc, Exception):
            scope.fail()
            _failed(self.ctx, self.kind, self.devices, self.posted, exc)
        else:
            scope.close()
        return False


def _enter(ctx: Any, kind: str, wait: bool = True) -> Any:
    """The thread rule and (`wait`) the wait for compiled programs, on entering `kind`; the context's engine."""
    if threading.get_ident() != ctx.owner_thread:
        if not is_delegated():
            raise _thread_error(kind, ctx)
    elif wait:
        wait_for_compiled()
    engine = ctx.engine
    if engine.lock_held_here():
        # A signal handler that interrupted this thread inside the engine: even a
        # failed turn would post a check in the middle of the interrupted call.
        raise engine.reentered(kind)
    return engine


def _failed(ctx: Any, kind: str, devices: Any, posted: int, exc: Exception) -> None:
    """What a call of `kind` on `devices` that raised `exc` owes its peers (`posted`: checks before it).

    Raises:
        ContextBrokenError: `exc` is MPI's own error (from `exc`).
    """
    engine = ctx.engine
    if isinstance(exc, MPI.Exception):
        raise engine.mpi_failed(exc, None, kind) from exc
    if engine.checks_posted == posted and _is_local(exc) and ctx.config.check:
        _take_failed_turn(ctx, kind, devices, exc)


def _is_local(exc: BaseException) -> bool:
    """True for errors of this rank's own arguments (not the outcome of a check or of MPI)."""
    return isinstance(exc, (DeviceError, TracedArrayError)) or not isinstance(exc, MpitensorError)


def _take_failed_turn(ctx: Any, kind: str, devices: Any, exc: BaseException) -> None:
    """Post a check saying this rank's `kind` failed with `exc`, on the group it names.

    When `devices` itself is what was wrong, the turn is taken on the whole context,
    where the peers most likely are. A rank that `devices` leaves out takes no turn: the
    group's members neither wait for nor hear from it, and a turn anywhere else would pair
    with another call.
    """
    if ctx.closed or ctx.broken:
        return
    try:
        group = ctx.group(devices, kind)
    except NotAMemberError:
        return
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
