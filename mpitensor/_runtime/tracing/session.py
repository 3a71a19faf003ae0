"""A traced context's trace, from its opening to the file written at its close or at a fault.

`TraceSession` measures the clock offsets at open, owns the `Tracer` the engine records
into, and writes the timeline: merged on rank 0 when the context closes cleanly, or as each
rank's own part (``PATH.rank<N>.json``) when it cannot be merged (a broken context, a rank
that left by an exception, fail-fast's abort: the flight recorder). `python -m mpitensor
trace PATH` reads either.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .clock import measure_offset
from .files import remove_trace, write_part, write_trace
from .flight import FlightRecorder
from .stragglers import TraceSummary, summarize
from .tracer import Tracer

__all__ = ["TraceSession"]


class TraceSession:
    """The trace of one context on this rank.

    Collective at creation (the clock offsets): every rank of the context creates it. Rank 0
    first removes an earlier run's trace at `path` (and its parts).

    Args:
        path: the trace file.
        events: collectives kept per rank (`DistributedConfig.trace_events`).
        comm: the context's communicator.
        members: the context's world ranks in rank order.
        host: this rank's host name.
        check: whether the context runs the consistency check.
        threads: whether MPI allows calls from several threads (the flight recorder's listener).

    Raises:
        ValueError: the trace file's folder does not exist (on every rank: rank 0 checks it).
    """

    def __init__(
        self, path: str, events: int, comm: Any, members: tuple[int, ...], host: str, check: bool, threads: bool
    ) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        problem = None
        if comm.Get_rank() == 0:
            if os.path.isdir(folder):
                remove_trace(path)  # an earlier run's file or parts would be read as this run's
            else:
                problem = folder
        problem = comm.bcast(problem, root=0)
        if problem is not None:
            raise ValueError(
                f"trace={path!r}: the folder {problem} does not exist on rank 0; create it or trace elsewhere"
            )
        self.path = path
        self.tracer = Tracer(events, members)
        self._rank = members[comm.Get_rank()]
        self._size = comm.Get_size()
        self._host = host
        self._check = check
        self._offset = measure_offset(comm)
        self._flight = FlightRecorder(comm, self.write_part) if threads and self._size > 1 else None

    def dump(self) -> dict[str, Any]:
        """This rank's record as a dump (see `Tracer.dump`)."""
        return self.tracer.dump(self._rank, self._size, self._host, self._offset, self._check)

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
        dumps = comm.gather(self.dump(), root=0)
        if dumps is None:
            return
        try:
            write_trace(self.path, dumps)
        except OSError as exc:
            warnings.warn(f"the trace could not be written to {self.path!r}: {exc}", RuntimeWarning, stacklevel=3)

    def stop(self) -> None:
        """Stop the flight recorder's listener (before the context frees its communicators)."""
        if self._flight is not None:
            self._flight.stop()
            self._flight = None

    def summary(self, gather: Callable[[Any], list[Any]]) -> TraceSummary:
        """The straggler summary of every rank's record so far, `gather` exchanging the dumps."""
        return summarize(gather(self.dump()))
