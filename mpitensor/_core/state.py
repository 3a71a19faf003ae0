"""Process-wide state: the stack of open contexts (the innermost is the current one).

The contexts are held as plain objects: this layer knows nothing of what a context is.
A process forked from a rank has no open context: its parent's are forgotten there
(`forget_in_child`), and `current` says why.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import ForkedProcessError, NoContextError

__all__ = [
    "current",
    "current_or_none",
    "forget_in_child",
    "forked_message",
    "open_contexts",
    "open_count",
    "pop",
    "push",
]

_lock = threading.Lock()
# The open contexts, innermost last. Collectives read it directly on every call (a
# function call would cost more than the read); only `push` and `pop` change it, in place,
# so a reference to it taken at import stays current.
open_contexts: list[Any] = []
_forked_from: int | None = None  # in a process forked from a rank: that rank


def push(ctx: Any) -> None:
    """Record `ctx` as open and current."""
    with _lock:
        open_contexts.append(ctx)


def pop(ctx: Any) -> int:
    """Forget `ctx`; return how many contexts stay open."""
    with _lock:
        if ctx in open_contexts:
            open_contexts.remove(ctx)
        return len(open_contexts)


def forget_in_child(rank: int) -> list[Any]:
    """In a process forked from rank `rank`: forget the open contexts, which are the parent's.

    Called right after the fork, with one thread alive (a lock another thread held at the
    fork would never be released here, so the lock is made anew).

    Args:
        rank: the world rank the process was forked from.

    Returns:
        The contexts that were open, innermost last.
    """
    global _lock, _forked_from
    _lock = threading.Lock()
    _forked_from = rank
    forgotten = list(open_contexts)
    open_contexts.clear()
    return forgotten


def open_count() -> int:
    """How many contexts are open."""
    return len(open_contexts)


def current_or_none() -> Any:
    """The most recently opened context that is still open, or None."""
    return open_contexts[-1] if open_contexts else None


def current() -> Any:
    """The current context.

    Raises:
        NoContextError: no context is open.
        ForkedProcessError: this process was forked from a rank (its contexts are the parent's).
    """
    if not open_contexts:
        if _forked_from is not None:
            raise ForkedProcessError(forked_message(_forked_from))
        raise NoContextError(
            "no DistributedContext is open: call mpitensor.DistributedContext.init() first "
            "(or use it as `with mpitensor.DistributedContext.init() as ctx:`)"
        )
    return open_contexts[-1]


def forked_message(rank: int) -> str:
    """What a process forked from rank `rank` is told when it calls a collective or uses a context."""
    return (
        f"this process was forked from rank {rank} after its context opened; only the rank's own process "
        "may call collectives, use its contexts or open one (a forked worker computes and hands its "
        "results back to its parent, e.g. through a pipe or a queue, and the parent calls the collectives)"
    )
