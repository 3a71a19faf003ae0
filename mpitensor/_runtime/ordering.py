"""Collectives of compiled programs, run by the compiler's threads, in the program's order.

A context's collectives are called from the thread that opened it (`entry`): ranks run them
in call order. A compiled JAX program is the exception: XLA runs its collectives on one of
its own threads, after the owner thread dispatched the program and went on. Two rules keep
the order every rank sees the same:

- The thread running a compiled program's collective calls it delegated by the owner
  (`run_delegated`): it may call collectives, in the program's order, which
  JAX keeps among programs (mpitensor.jax's effect is ordered).
- Once a program holding collectives has been compiled (`set_barrier`), a collective called
  by the owner thread first waits for every such program dispatched before it
  (`wait_for_compiled`: JAX's ``effects_barrier``), so it comes after their collectives on
  every rank, as it does in the program's text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["is_delegated", "run_delegated", "set_barrier", "wait_for_compiled"]

T = TypeVar("T")

_local = threading.local()
_barrier: Callable[[], None] | None = None


def run_delegated(function: Callable[..., T], *args: Any) -> T:
    """Call `function(*args)`, this thread calling collectives for the owner thread meanwhile (a compiled program's).

    A function rather than a context manager: it runs around every collective of a compiled
    program, and a generator-based ``with`` costs a few microseconds more per call.
    """
    previous = getattr(_local, "delegated", False)
    _local.delegated = True
    try:
        return function(*args)
    finally:
        _local.delegated = previous


def is_delegated() -> bool:
    """Whether this thread is running a compiled program's collective (`run_delegated`)."""
    return getattr(_local, "delegated", False)


def set_barrier(barrier: Callable[[], None]) -> None:
    """Have the owner thread's collectives wait for `barrier` first (every dispatched program done)."""
    global _barrier
    _barrier = barrier


def wait_for_compiled() -> None:
    """Wait for the compiled programs dispatched so far, if any may hold collectives.

    A no-op on a delegated thread: it runs one of those programs.
    """
    barrier = _barrier
    if barrier is not None and not getattr(_local, "delegated", False):
        barrier()
