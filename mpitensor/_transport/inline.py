"""The all-reduce carried by the consistency check itself: no data operation at all.

In a small group every check is one fixed-size ``MPI_Iallgather`` of a row of `ROW_BYTES` per
rank: the agreement hash and a per-rank value (two int64, `HEADER_BYTES`), then
`PAYLOAD_BYTES` of payload. A checked all-reduce whose
work buffer fits the payload puts its (converted) input there; once the check has shown that
every rank called the same all-reduce, each rank reduces the gathered payloads itself, in
rank order, with the same NumPy code: every rank gets the same bits, and the data costs no
second round trip. The engine builds the rows and calls `InCheck.start` with the gathered
payloads.

A row that carries an input says so (its per-rank value is `CARRIED`). A member may reduce
the same call without carrying it (a GPU tensor staged later, a result written into
``out=``): the hashes then agree but some row carries nothing, every member sees that in the
same rows, and the members that carried their input post MPI's in-place all-reduce on a copy
of it instead, which meets the others' `MPI_Iallreduce` on the data communicator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.limits import CARRIED_MAX_BYTES, CHECK_HEADER_BYTES, GATHERED_CHECK_RANKS
from .base import ReduceCall
from .mpi import in_place
from .reduced_check import Reduced, carry_code, coded

__all__ = [
    "CARRIED", "HEADER_BYTES", "INLINE_RANKS", "PAYLOAD_BYTES", "ROW_BYTES", "InCheck", "carry", "reduce_carried",
    "reduce_carried_keys",
]

INLINE_RANKS = GATHERED_CHECK_RANKS
HEADER_BYTES = CHECK_HEADER_BYTES
PAYLOAD_BYTES = CARRIED_MAX_BYTES
ROW_BYTES = HEADER_BYTES + PAYLOAD_BYTES
# The per-rank value of a row that carries its all-reduce's input (an all-reduce's own is -1).
CARRIED = 1


class InCheck:
    """The all-reduce of a small checked call, reduced locally from the gathered check rows."""

    name = "in-check"

    def applies(self, call: ReduceCall) -> bool:
        """Checked calls in groups of more than one rank whose work buffer fits the payload.

        Half precision (rounded back once) is left to MPI. In groups of more than
        `INLINE_RANKS`, whose check is an all-reduce, only the reductions `carry_code` gives
        a code (exact in any order: integers, float sums and products, complex sums). Every
        input of the decision is agreed on by the ranks (group size, configuration, shape,
        dtype and op), so every rank of a matched call chooses alike; a mismatched call is
        caught by the check first.
        """
        # Only checked calls ask (`select.ALL_REDUCE_CHECKED`); the configuration is asked
        # again all the same, and the input's size cuts most calls short.
        if not call.ctx.config.check or call.nbytes > PAYLOAD_BYTES << 3:
            return False
        plan = call.plan
        size = call.group.size
        count = call.source.array.size
        if count * plan.work_dtype.itemsize > PAYLOAD_BYTES or plan.rounds_back or size < 2:
            return False
        return size <= INLINE_RANKS or carry_code(plan, plan.work_dtype, count) is not None

    def prepare(self, call: ReduceCall) -> None:
        """The payload: the input's bytes in the work dtype, padded; the result: a fresh array.

        MAX and MIN are reduced on the values themselves by the plan's ``combine`` (which
        gives the canonical NaN and the bits MPI's reduction of keys gives), so nothing is
        encoded and nothing decoded.
        """
        buffer = call.source.buffer  # contiguous, native order
        call.send = carry(buffer, call.plan.work_dtype)
        if call.group.size > INLINE_RANKS:  # the check reduces it: its reduction's code goes with it
            call.send = coded(call.send, carry_code(call.plan, call.plan.work_dtype, buffer.size))
        call.out = call.final = np.empty(buffer.shape, call.plan.work_dtype)
        call.decoded = True

    def start(self, call: ReduceCall, rows: bytearray | None = None) -> list[Any]:
        """Reduce every rank's payload into the result, in rank order; no MPI operation is posted.

        Args:
            call: the call.
            rows: the gathered check rows, `ROW_BYTES` per member in group order (in a large
                group, every payload already reduced: a `Reduced`); None when some member's
                row carried no input: MPI then reduces this rank's copy.

        Returns:
            No requests (the result is final), or MPI's in-place all-reduce's.
        """
        if rows is None:
            call.decoded = False  # MPI reduces MAX/MIN keys, which the finish decodes
        return reduce_carried(call.group.comm, call.out, call.send, call.plan, rows)


def carry(buffer: np.ndarray, work_dtype: np.dtype) -> bytes:
    """The payload carrying `buffer` (contiguous, native order): its bytes in `work_dtype`, padded."""
    data = buffer.tobytes() if buffer.dtype == work_dtype else buffer.astype(work_dtype).tobytes()
    return data.ljust(PAYLOAD_BYTES, b"\0")


def reduce_carried(comm: Any, out: np.ndarray, payload: bytes, plan: Any, rows: bytearray | None) -> list[Any]:
    """Reduce every member's carried input into `out`, in rank order; or post MPI's, if one carried none.

    Args:
        comm: the group's data communicator (for MPI's all-reduce).
        out: the result, of the plan's work dtype.
        payload: this rank's payload (`carry`).
        plan: the `ReducePlan`.
        rows: the gathered check rows, `ROW_BYTES` per member in group order; None when
            some member's row carried no input: MPI then reduces a copy of this rank's
            input in `out` in place, in MAX/MIN keys where the plan has a codec.

    Returns:
        No requests (the result is final), or MPI's in-place all-reduce's.
    """
    dtype, count = out.dtype, out.size
    target = out if out.ndim == 1 else out.reshape(-1)
    if isinstance(rows, Reduced):  # a large group's check reduced every payload
        np.copyto(target, np.frombuffer(rows, dtype, count))
        return []
    if rows is None:
        # The copy taken at the call: the input itself may have been written since.
        np.copyto(target, np.frombuffer(payload, dtype, count))
        if plan.codec is not None:
            plan.codec.encode(out, out)
        return in_place(comm, out, plan)
    combine = plan.combine
    # Every member's payload at once, a row each: one view costs less than one per row.
    payloads = np.ndarray((len(rows) // ROW_BYTES, count), dtype, rows, HEADER_BYTES, (ROW_BYTES, dtype.itemsize))
    combine(payloads[0], payloads[1], out=target)
    for index in range(2, len(payloads)):
        combine(target, payloads[index], out=target)
    return []


def reduce_carried_keys(comm: Any, out: np.ndarray, payload: bytes, plan: Any, rows: bytearray | None) -> list[Any]:
    """`reduce_carried` for MAX/MIN of floats, leaving MAX/MIN keys in `out` either way.

    MPI's all-reduce (a member carried nothing) leaves keys; a carried reduction gives the
    floats, whose keys are then written. So the op's finish decodes in both cases, whichever
    the rows turn out to be (the lanes make the finish before the rows are seen).

    Args:
        comm, out, payload, rows: as `reduce_carried`.
        plan: the `ReducePlan`; its codec is an `OrderedKeys`.

    Returns:
        No requests (the keys are final), or MPI's in-place all-reduce's.
    """
    requests = reduce_carried(comm, out, payload, plan, rows)
    if rows is not None:
        plan.codec.encode(out, out)
    return requests
