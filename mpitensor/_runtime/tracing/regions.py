"""`trace_region`: the program's own phases, beside its collectives in the timeline."""

from __future__ import annotations

from contextlib import AbstractContextManager, ContextDecorator
from typing import Any

from ..._core import state as _state

__all__ = ["trace_region"]


class trace_region(ContextDecorator):  # noqa: N801 - used as a function: with trace_region("forward")
    """Record the block it wraps (or each call of the function it decorates) as region `name`.

    The region goes on this rank's track of the current context's trace, beside the
    collectives it contains; regions nest. Where the current context does not trace (or
    none is open), it records nothing and costs a few hundred nanoseconds.

    Args:
        name: what the region is (``"forward"``, ``"data loading"``).

    Raises:
        TypeError: `name` is not a string.

    Example::

        with mt.trace_region("forward"):
            loss = model(batch)

        @mt.trace_region("optimizer step")
        def step(): ...
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"trace_region(name): name must be a str, got {type(name).__name__}")
        self.name = name
        self._inner: AbstractContextManager[None] | None = None

    def _recreate_cm(self) -> trace_region:
        # A decorated function may recurse or run in several threads: each call gets its own.
        return trace_region(self.name)

    def __enter__(self) -> trace_region:
        ctx = _state.current_or_none()
        session = getattr(ctx, "trace", None)
        if session is not None:
            self._inner = session.tracer.region(self.name)
            self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.__exit__(*exc)
