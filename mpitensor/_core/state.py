"""Process-wide state: the stack of open contexts (the innermost is the current one).

The contexts are held as plain objects: this layer knows nothing of what a context is.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import NoContextError

__all__ = ["current", "current_or_none", "open_count", "pop", "push"]

_lock = threading.Lock()
_open: list[Any] = []


def push(ctx: Any) -> None:
    """Record `ctx` as open and current."""
    with _lock:
        _open.append(ctx)


def pop(ctx: Any) -> int:
    """Forget `ctx`; return how many contexts stay open."""
    with _lock:
        if ctx in _open:
            _open.remove(ctx)
        return len(_open)


def open_count() -> int:
    """How many contexts are open."""
    return len(_open)


def current_or_none() -> Any:
    """The most recently opened context that is still open, or None."""
    return _open[-1] if _open else None


def current() -> Any:
    """The current context.

    Raises:
        NoContextError: no context is open.
    """
    if not _open:
        raise NoContextError(
            "no DistributedContext is open: call mpitensor.DistributedContext.init() first "
            "(or use it as `with mpitensor.DistributedContext.init() as ctx:`)"
        )
    return _open[-1]
