"""The all-reduce carried by the consistency check itself: no data operation at all.

In a small group every check is one fixed-size ``MPI_Iallgather`` of a row per rank (the
agreement hash, a per-rank value and `PAYLOAD_BYTES` of payload). A checked all-reduce whose
work buffer fits the payload puts its (converted) input there; once the check has shown that
every rank called the same all-reduce, each rank reduces the gathered payloads itself, in
rank order, with the same NumPy code: every rank gets the same bits, and the data costs no
second round trip. The engine builds the rows and calls `InCheck.start` with the gathered
payloads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import ReduceCall

__all__ = ["INLINE_RANKS", "PAYLOAD_BYTES", "PAYLOAD_WORDS", "InCheck"]

# Groups of up to this many ranks gather their checks' rows (beyond, gathering every row to
# every rank costs more than the all-reduce of a fixed record it replaces).
INLINE_RANKS = 8
# Payload of a check row: all-reduces whose work buffer fits travel inside the check.
PAYLOAD_WORDS = 8
PAYLOAD_BYTES = 8 * PAYLOAD_WORDS


class InCheck:
    """The all-reduce of a small checked call, reduced locally from the gathered check rows."""

    name = "in-check"

    def applies(self, call: ReduceCall) -> bool:
        """Checked calls in groups of 2 to `INLINE_RANKS` ranks whose work buffer fits the payload.

        Half precision (rounded back once) is left to MPI. Every input of the decision is
        agreed on by the ranks (group size, configuration, shape, dtype and op), so every
        rank of a matched call chooses alike; a mismatched call is caught by the check first.
        """
        # The configuration first: with the check off this is all the cost.
        if not call.ctx.config.check or call.nbytes > PAYLOAD_BYTES << 3:
            return False
        plan = call.plan
        return (
            call.source.array.size * plan.work_dtype.itemsize <= PAYLOAD_BYTES
            and 1 < call.group.size <= INLINE_RANKS
            and not plan.rounds_back
        )

    def prepare(self, call: ReduceCall) -> None:
        """Copy the input, converted to the work dtype, into a private buffer: the payload.

        MAX and MIN are reduced on the values themselves by the plan's ``combine`` (which
        gives the canonical NaN and the bits MPI's reduction of keys gives), so nothing is
        encoded and nothing decoded.
        """
        work = call.source.buffer.astype(call.plan.work_dtype)  # always a copy, native order
        call.send = work
        call.out = call.final = work
        call.decoded = True

    @staticmethod
    def payload(call: ReduceCall) -> np.ndarray:
        """The bytes this rank puts in its check row."""
        return call.send.reshape(-1).view(np.uint8)

    def start(self, call: ReduceCall, rows: np.ndarray | None = None) -> list[Any]:
        """Reduce every rank's payload into the result; no MPI operation is posted.

        Args:
            call: the call.
            rows: the gathered payloads, one row of `PAYLOAD_WORDS` int64 per member in
                group order.

        Returns:
            No requests: the result is final.
        """
        assert rows is not None, "the in-check all-reduce needs the gathered rows"
        out = call.out
        count = out.size
        values = rows.view(np.uint8)[:, : count * out.itemsize].view(out.dtype)
        flat = out.reshape(-1)
        combine = call.plan.combine
        if type(combine) is np.ufunc:
            combine.reduce(values, axis=0, out=flat)
        else:  # an `Extremum`: pairwise, in rank order
            np.copyto(flat, values[0])
            for row in values[1:]:
                combine(flat, row, out=flat)
        return []
