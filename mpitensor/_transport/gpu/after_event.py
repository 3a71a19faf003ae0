"""Start an operation once the GPU work it depends on is done, without blocking anyone.

A GPU collective is called while the kernels that produce its input may still be queued.
Waiting for them at the call (``Event.synchronize()``) would make the call block; instead
its ``post`` returns an `AfterEvent`, which the engine drives with `advance()` like any
`Stepper`: it polls the event (``cupy.cuda.Event.done``) and starts the MPI operation only
once the data is ready. Until then it is `holding`: the engine posts nothing else on the
group's communicator, so every rank still posts its MPI operations in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..._core.mpi import MPI
from ..base import Stepper

__all__ = ["AfterEvent", "AllDone", "Ready"]


class Ready(Protocol):
    """What `AfterEvent` needs of a CUDA event (``cupy.cuda.Event`` has it)."""

    @property
    def done(self) -> bool:
        """True once the work recorded before the event has completed (never blocks)."""


class AfterEvent:
    """A `Stepper`: once `event` is done, `start()` the operation, then drive it to its end.

    Args:
        event: the event after the work the operation reads (``done`` is polled).
        start: starts the operation; returns its MPI requests, or a `Stepper`.

    Attributes:
        holding: True until the operation is started (see the module's docstring).
    """

    __slots__ = ("_event", "_requests", "_start", "_stepper", "holding")

    def __init__(self, event: Ready, start: Callable[[], list[Any] | Stepper]) -> None:
        self._event = event
        self._start: Callable[[], list[Any] | Stepper] | None = start
        self._requests: list[Any] = []
        self._stepper: Stepper | None = None
        self.holding = True

    def advance(self) -> bool:
        """Start the operation if its input is ready, and test it; True once it is complete."""
        if self._start is not None:
            if not self._event.done:
                return False
            start, self._start = self._start, None
            try:
                started = start()
            finally:
                # Started or failed: either way the group's later operations may go.
                self.holding = False
            if isinstance(started, list):
                self._requests = started
            else:
                self._stepper = started
        if self._stepper is not None:
            return self._stepper.advance()
        return not self._requests or bool(MPI.Request.Testall(self._requests))


class AllDone:
    """Done once every one of `events` is done (e.g. the copies into one bucket; never blocks).

    Args:
        events: objects with a ``done`` property (``cupy.cuda.Event``).
    """

    __slots__ = ("_events",)

    def __init__(self, events: list[Any]) -> None:
        self._events = list(events)

    @property
    def done(self) -> bool:
        """True once all the events are done."""
        events = self._events
        while events and events[-1].done:
            events.pop()
        return not events
