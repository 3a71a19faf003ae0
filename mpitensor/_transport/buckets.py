"""The fused all-reduce's packed buckets: each through node peers' shared memory where it applies, else MPI.

A bucket is a private buffer the fused all-reduce packed its tensors into, in the work
dtype. Large buckets take the shared-memory transport, as a single all-reduce of their
size would; the others are one ``MPI_Iallreduce`` each. MAX/MIN of
floats (whose packed buckets MPI reduces as integer keys) and half precision (rounded back
from float32) stay on MPI. Every rank decides from what all of them agree on (the bucket's
size, dtype and op, the group and the configuration), so every rank posts the same
operations in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.mpi import MPI
from .base import Channel, Host, PrivateCopy, ReduceCall, Stepper, select
from .mpi import all_reduce_buckets
from .select import ALL_REDUCE, SHARED_MEMORY

__all__ = ["BucketSteps", "post_buckets", "shared_bucket"]


def shared_bucket(ctx: Host, group: Channel, send: np.ndarray, plan: Any) -> ReduceCall | None:
    """The all-reduce of the packed bucket `send` through shared memory, prepared; None where it does not apply.

    Args:
        ctx: the context.
        group: the group.
        send: the packed bucket (private, contiguous, in the plan's work dtype).
        plan: the bucket's `ReducePlan`.

    Returns:
        The call, its result in ``call.out`` (a leased block of this rank's shared memory,
        or a pooled buffer); None when the bucket goes to MPI.
    """
    if plan.codec is not None or plan.rounds_back:  # packed as MPI's keys, or rounded back here
        return None
    call = ReduceCall(ctx, group, PrivateCopy(send), plan, send.nbytes)
    # The choice a single all-reduce of this size makes (small ones stay on MPI whatever the settings).
    if select(ALL_REDUCE, call) is not SHARED_MEMORY:
        return None
    SHARED_MEMORY.prepare(call)
    return call


def post_buckets(
    comm: Any,
    plans: Sequence[Any],
    sends: Sequence[np.ndarray],
    recvs: Sequence[np.ndarray],
    shared: Sequence[ReduceCall | None],
) -> list[Any] | Stepper:
    """Start every bucket's all-reduce, in bucket order.

    Args:
        comm: the group's data communicator.
        plans: each bucket's `ReducePlan`.
        sends: each bucket's packed input.
        recvs: each bucket's result buffer.
        shared: each bucket's `shared_bucket` call, or None for MPI's.

    Returns:
        The MPI requests, when no bucket goes through shared memory; else one `BucketSteps`.
    """
    if not any(shared):  # the usual case for small buckets
        return all_reduce_buckets(comm, plans, sends, recvs)
    mpi = [index for index, call in enumerate(shared) if call is None]
    requests = all_reduce_buckets(comm, [plans[i] for i in mpi], [sends[i] for i in mpi], [recvs[i] for i in mpi])
    return BucketSteps(requests, [call.start() for call in shared if call is not None])


class BucketSteps:
    """Several buckets' all-reduces as one `Stepper`: MPI's requests and shared-memory steppers.

    Args:
        requests: the MPI buckets' requests.
        steppers: the shared-memory buckets' steppers, in bucket order (each starts once
            the ones before it on the group are done).
    """

    __slots__ = ("requests", "steppers")

    def __init__(self, requests: list[Any], steppers: list[Stepper]) -> None:
        self.requests = requests
        self.steppers = steppers

    def advance(self) -> bool:
        """Advance the steppers in order and test the requests; True once all are done."""
        steppers = self.steppers
        while steppers and steppers[0].advance():
            del steppers[0]
        if self.requests:
            if not MPI.Request.Testall(self.requests):
                return False
            self.requests = []
        return not steppers
