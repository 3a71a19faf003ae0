"""How `trace_summary` gathers the ranks' records: through the package's checked all-gather.

The all-gather of Python objects lives in the collectives, above this layer; they hand it
here when they are imported (`set_gatherer`), so that the summary's exchange gets the
consistency check of every collective (a rank that does not call it is named, not waited for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["gatherer", "set_gatherer"]

_gather: Callable[[Any], list[Any]] | None = None


def set_gatherer(gather: Callable[[Any], list[Any]]) -> None:
    """Set the function that gives every rank's object, in rank order, from this rank's."""
    global _gather
    _gather = gather


def gatherer() -> Callable[[Any], list[Any]]:
    """The function `set_gatherer` set.

    Raises:
        RuntimeError: none was set (the collectives were not imported).
    """
    if _gather is None:
        raise RuntimeError("the collectives were not imported: import mpitensor first")
    return _gather
