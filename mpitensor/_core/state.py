"""Process-wide state: the stack of open contexts (the innermost is the current one).

The contexts are held as plain objects: this layer knows nothing of what a context is.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import NoContextError

__all__ = ["current", "current_or_none", "open_contexts", "open_count", "pop", "push"]

_lock = threading.Lock()
# The open contexts, innermost last. Collectives read it directly on every call (a
# function call would cost more than the read); only `push` and `pop` change it, in place,
# so a reference to it taken at import stays current.
open_contexts: list[Any] = []


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
    """
    if not open_contexts:
        raise NoContextError(
            "no DistributedContext is open: call mpitensor.DistributedContext.init() first "
            "(or use it as `with mpitensor.DistributedContext.init() as ctx:`)"
        )
    return open_contexts[-1]
