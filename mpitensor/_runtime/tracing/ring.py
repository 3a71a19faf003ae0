"""The per-rank record of collectives: a ring of fixed-size events, one per call.

Each event holds what the call was (kind, group, bytes, dtype), how its data travelled,
and its moments on this rank's monotonic clock: called, check agreed, data posted,
complete, resolved (0 where a moment did not happen or was not seen). The compiled ring
(`_ring`, C) is written by the Python engine and the compiled lane alike; where it is not
built, `PyRing` keeps the same record in Python (the compiled lane is then not built either).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

__all__ = [
    "AGREED",
    "COMPLETE",
    "EVENT",
    "MOMENT_COMPLETE",
    "POSTED",
    "RESOLVED",
    "TRANSPORTS",
    "PyRing",
    "events_of",
    "make_ring",
    "now",
]

AGREED, POSTED, COMPLETE, RESOLVED = 1, 2, 3, 4
MOMENT_COMPLETE = COMPLETE  # for modules where COMPLETE names an op's state
TRANSPORTS = ("", "mpi", "shm", "check", "local")
MPI_TRANSPORT, SHM_TRANSPORT, CHECK_TRANSPORT, LOCAL_TRANSPORT = 1, 2, 3, 4

# The C struct's layout (ring.c's `Event`).
EVENT = np.dtype(
    [
        ("id", "<i8"), ("called", "<i8"), ("agreed", "<i8"), ("posted", "<i8"), ("complete", "<i8"),
        ("resolved", "<i8"), ("nbytes", "<i8"), ("group", "<i8"), ("seq", "<i8"), ("kind", "<i4"),
        ("dtype", "<i4"), ("transport", "<i4"), ("flags", "<i4"),
    ]
)  # fmt: skip
_MOMENTS = {AGREED: 2, POSTED: 3, COMPLETE: 4, RESOLVED: 5}  # list positions in PyRing's events

now = time.monotonic_ns  # the ring's clock (CLOCK_MONOTONIC, as ring.c reads it)


class _PySpan:
    """One collective of a `PyRing`, whose later moments are written through it."""

    __slots__ = ("_event", "id")

    def __init__(self, event_id: int, event: list[int]) -> None:
        self.id = event_id
        self._event = event

    def mark(self, field: int) -> None:
        """Record moment `field` (`AGREED` .. `RESOLVED`) as now."""
        position = _MOMENTS[field]
        if field != RESOLVED or self._event[position] == 0:
            self._event[position] = now()

    def posted(self, transport: int) -> None:
        """Record that the data was posted now, travelling by `transport` (an index of `TRANSPORTS`)."""
        self._event[3] = now()
        self._event[11] = transport


class PyRing:
    """The record of the last `capacity` collectives, in Python (as `_ring.Ring`).

    Args:
        capacity: events kept at most (the oldest go first).
        keep_all: keep every event instead.
    """

    def __init__(self, capacity: int, keep_all: bool = False) -> None:
        if not 1 <= capacity <= 1 << 32:
            raise ValueError(f"a ring holds 1 to 2**32 events, not {capacity}")
        self._capacity = capacity
        self._keep_all = keep_all
        self._events: deque[list[int]] = deque(maxlen=None if keep_all else capacity)
        self._seqs: dict[int, int] = {}
        self.recorded = 0

    @property
    def capacity(self) -> int:
        """The events kept at most; 0 when every one is kept."""
        return 0 if self._keep_all else self._capacity

    def begin(self, kind: int, group: int, nbytes: int, dtype: int) -> _PySpan:
        """Record a collective called now; returns its span."""
        seq = self._seqs.get(group, 0)
        self._seqs[group] = seq + 1
        event = [self.recorded, now(), 0, 0, 0, 0, nbytes, group, seq, kind, dtype, 0, 0]
        self._events.append(event)
        self.recorded += 1
        return _PySpan(event[0], event)

    def export(self) -> bytes:
        """The events kept, oldest first, as bytes of `EVENT` records."""
        return np.array([tuple(e) for e in self._events], EVENT).tobytes()


def make_ring(capacity: int, keep_all: bool = False) -> Any:
    """The compiled ring where it is built, else a `PyRing`.

    Args:
        capacity: events kept at most (the oldest are overwritten); the first size of the
            storage with `keep_all`.
        keep_all: keep every event of the run.

    Raises:
        ValueError: `capacity` is below 1 or above 2**32.
    """
    try:
        from ._ring import Ring
    except ImportError:
        return PyRing(capacity, keep_all)
    return Ring(capacity, keep_all)


def events_of(ring: Any) -> np.ndarray:
    """The ring's events kept, oldest first, as a structured array of `EVENT`."""
    return np.frombuffer(ring.export(), EVENT)
