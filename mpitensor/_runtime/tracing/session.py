"""A traced context's trace, from its opening to the file written at its close or at a fault.

`TraceSession` measures the clock offsets at open, owns the `Tracer` the engine records
into, and writes the timeline: merged on rank 0 when the context closes cleanly, or as each
rank's own part (``PATH.rank<N>.json``) when it cannot be merged (a broken context, a rank
that left by an exception, fail-fast's abort: the flight recorder). `python -m mpitensor
trace PATH` reads either.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from .clock import measure_offset
from .files import clear_path, write_part, write_trace
from .flight import FlightRecorder
from .ring import EVENT
from .stragglers import TraceSummary, summarize
from .tracer import Tracer

__all__ = ["TraceSession"]


class TraceSession:
    """The trace of one context on this rank.

    Made in two steps, so that a failure on one rank reaches every rank before any of them
    waits in a collective: the constructor does what may fail on this rank alone (rank 0
    clears the path of an earlier run's trace and its parts; every rank allocates its ring),
    before the context's setup exchange; `start`, after it, is collective (the clocks'
    offsets, the flight recorder).

    Args:
        path: the trace file.
        events: collectives kept per rank (`DistributedConfig.trace_events`).
        members: the context's world ranks in rank order.
        rank: this rank in the context.
        host: this rank's host name.
        check: whether the context runs the consistency check.

    Raises:
        ValueError: (on rank 0) the trace file's folder does not exist or is not writable,
            the path is a directory, or an earlier trace there cannot be removed.
        MemoryError: the ring of `events` events cannot be allocated on this rank.
    """

    def __init__(self, path: str, events: int, members: tuple[int, ...], rank: int, host: str, check: bool) -> None:
        if rank == 0:
            clear_path(path)
        self.path = path
        self.tracer = _tracer(events, members)
        self._rank = members[rank]
        self._size = len(members)
        self._host = host
        self._check = check
        self._offset = 0
        self._flight: FlightRecorder | None = None

    def start(self, comm: Any, threads: bool) -> None:
        """Measure the clocks' offsets and start the flight recorder: collective over `comm`.

        Args:
            comm: the context's communicator.
            threads: whether MPI allows calls from several threads (the flight recorder's listener).
        """
        self._offset = measure_offset(comm)
        if threads and self._size > 1:
            self._flight = FlightRecorder(comm, self.write_part)

    def dump(self, every_group: bool = True) -> dict[str, Any]:
        """This rank's record as a dump (see `Tracer.dump`; False: each group listed by its first member only)."""
        return self.tracer.dump(self._rank, self._size, self._host, self._offset, self._check, every_group)

    def write_part(self) -> None:
        """Write this rank's part (``PATH.rank<N>.json``) now; reports a failure on stderr, never raises."""
        try:
            write_part(self.path, self.dump())
        except Exception as exc:  # a fault is being handled: this must not hide it
            sys.stderr.write(f"[rank {self._rank}] mpitensor: could not write the trace's part: {exc}\n")

    def alarm(self) -> None:
        """A fault is about to end the job: write this rank's part and ask the peers for theirs."""
        if self._flight is not None:
            self._flight.alarm()
        else:
            self.write_part()

    def close(self, comm: Any, merge: bool) -> None:
        """Write the trace as the context closes: merged on rank 0 when `merge`, else this rank's part.

        With `merge`, collective over `comm` (every rank is closing: the close's check
        agreed). A file that cannot be written is a warning, not an error: the run is done.
        """
        self.stop()
        if not merge:
            self.write_part()
            return
        # Each group's members come once, from its first member: every rank listing the
        # whole context's would make rank 0 gather P lists of P ranks.
        dumps = comm.gather(self.dump(every_group=False), root=0)
        if dumps is None:
            return
        try:
            write_trace(self.path, dumps)
        except OSError as exc:  # says which file and what to do; nothing half-written is left
            warnings.warn(str(exc), RuntimeWarning, stacklevel=3)

    def stop(self) -> None:
        """Stop the flight recorder's listener (before the context frees its communicators)."""
        if self._flight is not None:
            self._flight.stop()
            self._flight = None

    def summary(self, gather: Callable[[Any], list[Any]]) -> TraceSummary:
        """The straggler summary of every rank's record so far, `gather` exchanging the dumps."""
        return summarize(gather(self.dump(every_group=False)))


_DEFAULT_EVENTS = 16384  # DistributedConfig's default, for the advice below


def _tracer(events: int, members: tuple[int, ...]) -> Tracer:
    """The context's `Tracer`, its ring allocated.

    Raises:
        MemoryError: the ring cannot be allocated: says its size and what to do.
    """
    try:
        return Tracer(events, members)
    except MemoryError as exc:
        count = events or 4096
        raise MemoryError(
            f"trace_events={events}: the ring of {count} events ({count * EVENT.itemsize} bytes, "
            f"{EVENT.itemsize} per event) cannot be allocated; lower trace_events (the default, "
            f"{_DEFAULT_EVENTS}, takes {_DEFAULT_EVENTS * EVENT.itemsize} bytes), or pass 0 to keep every "
            "event in storage that grows with the run"
        ) from exc
