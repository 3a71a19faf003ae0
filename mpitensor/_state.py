"""Process-wide state: the stack of open contexts (the innermost is the current one)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ._errors import NoContextError

if TYPE_CHECKING:
    from ._context import DistributedContext

__all__ = ["current", "current_or_none", "open_count", "pop", "push"]

_lock = threading.Lock()
_open: list[DistributedContext] = []


def push(ctx: DistributedContext) -> None:
    """Record `ctx` as open and current."""
    with _lock:
        _open.append(ctx)


def pop(ctx: DistributedContext) -> int:
    """Forget `ctx`; return how many contexts stay open."""
    with _lock:
        if ctx in _open:
            _open.remove(ctx)
        return len(_open)


def open_count() -> int:
    """How many contexts are open."""
    return len(_open)


def current_or_none() -> DistributedContext | None:
    """The most recently opened context that is still open, or None."""
    return _open[-1] if _open else None


def current() -> DistributedContext:
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
