"""MPI's own all-reduce, as transports: the catch-all ends every all-reduce's list.

`InPlace` takes small messages: the input is copied (cheaper than protecting it) into the
buffer MPI reduces in place. `Plain` takes every other host message: MPI reads the input
(protected from writes, or converted into a private copy) and reduces into a pooled buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._core.idle import idle_call
from ..._core.limits import SMALL_BYTES
from ..._core.mpi import MPI
from ..base import ReduceCall
from ..reduction import reduction_buffers, reduction_input
from .pair import exchange_through_pair, through_pair

__all__ = [
    "EXCHANGE_TAG", "SMALL_BYTES", "Held", "HeldUnchecked", "InPlace", "OnCopy", "Plain", "SmallOnCopy",
    "all_reduce_buckets", "all_reduce_buffers", "exchange_once", "held_all_reduce", "in_place", "is_small",
    "out_of_place",
]


# The tag of `exchange_once`'s messages (the compiled lane's too), apart from the shared-memory
# transport's on the same communicator (shm/protocol.py).
EXCHANGE_TAG = 32_710


def in_place(comm: Any, buffer: np.ndarray, plan: Any) -> list[Any]:
    """Post ``MPI_Iallreduce(MPI_IN_PLACE, ...)`` of `buffer` on `comm` with `plan`'s datatype and op."""
    return [comm.Iallreduce(MPI.IN_PLACE, [buffer, plan.datatype], plan.mpi_op)]


def out_of_place(comm: Any, send: np.ndarray, out: np.ndarray, plan: Any) -> list[Any]:
    """Post ``MPI_Iallreduce`` from `send` into `out` on `comm` with `plan`'s datatype and op."""
    datatype = plan.datatype
    return [comm.Iallreduce([send, datatype], [out, datatype], plan.mpi_op)]


def is_small(call: ReduceCall) -> bool:
    """Whether `call` is small enough for MPI in place whatever the settings (see `InPlace`)."""
    return call.nbytes <= SMALL_BYTES and not call.plan.rounds_back


class InPlace:
    """``MPI_Iallreduce(MPI_IN_PLACE, ...)`` on a private copy of a small input."""

    name = "mpi-in-place"

    def applies(self, call: ReduceCall) -> bool:
        """Messages of up to `SMALL_BYTES` whose result is not rounded back (half precision)."""
        return is_small(call)

    def prepare(self, call: ReduceCall) -> None:
        """Copy the input (encoded into MAX/MIN keys where the plan has a codec) into `out`."""
        plan = call.plan
        array = call.source.buffer
        codec = plan.codec
        if codec is None:
            out = array.astype(plan.work_dtype)  # always a copy
        elif array.dtype == plan.work_dtype:
            out = np.empty(array.shape, plan.work_dtype)
            codec.encode(array, out)
        else:  # byte-swapped: to native order first
            out = array.astype(plan.work_dtype)
            codec.encode(out, out)
        call.send = out
        call.out = call.final = out

    def start(self, call: ReduceCall) -> list[Any]:
        """Post the all-reduce."""
        return in_place(call.group.comm, call.out, call.plan)


class Plain:
    """``MPI_Iallreduce`` from the (protected or converted) input into a pooled buffer."""

    name = "mpi"

    def applies(self, call: ReduceCall) -> bool:
        """Every host message."""
        return True

    def prepare(self, call: ReduceCall) -> None:
        """Protect or convert the input; take the result buffers from the pool."""
        call.send, call.protections = reduction_input(call.ctx, call.source, call.plan)
        call.out, call.final = reduction_buffers(call.ctx, call.source.array.shape, call.plan)

    def start(self, call: ReduceCall) -> list[Any]:
        """Post the all-reduce."""
        return out_of_place(call.group.comm, call.send, call.out, call.plan)


class OnCopy:
    """``MPI_Iallreduce(MPI_IN_PLACE, ...)`` on a private host copy that is filled later.

    The input is a copy nobody else reads (`base.PrivateCopy`: a GPU tensor staged into
    pinned memory), so MPI reduces it in place. Its data may still be arriving at
    `prepare` (the copy from the device is queued), so the encoding of float MAX/MIN into
    keys waits for `start`; the result then holds keys (``call.decoded`` stays False).
    It takes every call: it ends the staged all-reduce's list.
    """

    name = "mpi-on-copy"

    def applies(self, call: ReduceCall) -> bool:
        """Every call."""
        return True

    def prepare(self, call: ReduceCall) -> None:
        """The copy is sent from and reduced into; nothing to protect."""
        call.send = call.out = call.final = call.source.buffer

    def start(self, call: ReduceCall) -> list[Any]:
        """Encode MAX/MIN keys (the copy has arrived) and post the all-reduce."""
        plan = call.plan
        if plan.codec is not None:
            plan.codec.encode(call.out, call.out)
        return in_place(call.group.comm, call.out, plan)


class SmallOnCopy(OnCopy):
    """`OnCopy` for the staged copies a host input of their size would send through `InPlace`.

    It comes first in the staged list: small host inputs never go through shared memory
    (whatever the settings), so neither may small staged ones, or ranks holding host and GPU
    tensors would run different algorithms.
    """

    name = "mpi-on-copy-small"

    def applies(self, call: ReduceCall) -> bool:
        """Calls `InPlace` would take from a host input."""
        return is_small(call)


class HeldUnchecked:
    """``MPI_Iallreduce`` of an input its caller holds unchanged (`base.HeldBuffers`).

    Nothing is copied or protected: MPI reads the caller's input and writes the caller's
    result buffer, or reduces the input in place where the two are one array. Held inputs
    have no MAX/MIN keys (a held all-reduce takes no plan with a codec). It takes every
    call: it ends the held all-reduce's list, for the unchecked calls `Held` leaves.
    """

    name = "mpi-held-unchecked"

    def applies(self, call: ReduceCall) -> bool:
        """Every call."""
        return True

    def prepare(self, call: ReduceCall) -> None:
        """Send from the caller's input, land in the caller's result buffer."""
        call.send = call.source.buffer
        call.out = call.final = call.source.out

    def start(self, call: ReduceCall) -> list[Any]:
        """Post the all-reduce."""
        if call.send is call.out:
            return in_place(call.group.comm, call.out, call.plan)
        return out_of_place(call.group.comm, call.send, call.out, call.plan)


class Held(HeldUnchecked):
    """A blocking ``MPI_Allreduce`` of an input its caller holds unchanged, in place or into its buffer.

    The engine posts a call's data only once its consistency check has agreed, that is once every peer
    has reached the same call, so blocking there waits for nobody who is not coming (a peer
    that dies meanwhile ends the job), and MPI's blocking algorithms are the fast ones: at
    1-16 MiB on 2 ranks of one node Open MPI's blocking in-place all-reduce took 0.32-0.54x
    the time of its nonblocking one, MPICH's and Intel MPI's the same time, and each MPI's
    took 0.27-0.88x the time of mpitensor's shared memory with a copy back into the caller's
    array (`scripts/held_all_reduce.py`). Where the blocking call's wait cannot be made to give
    the core back (MPICH, Intel MPI), the nonblocking one is waited to its end instead
    (`_core.idle.idle_call`). In a group of 2 ranks the check says whether each rank's core is
    contested, and the engine hands that to `start` (see `held_all_reduce`). Unchecked calls
    (whose peers may not have arrived) are left to `HeldUnchecked`.
    """

    name = "mpi-held"

    def applies(self, call: ReduceCall) -> bool:
        """Checked calls, and calls of a group of one rank."""
        return call.group.size == 1 or bool(call.ctx.config.check)

    def start(self, call: ReduceCall, contested: Sequence[int] | None = None) -> list[Any]:
        """Reduce, blocking until done (no request is left to test); `contested` as `held_all_reduce` takes it."""
        return held_all_reduce(call.group.comm, call.send, call.out, call.plan, contested)


def held_all_reduce(comm: Any, send: np.ndarray, out: np.ndarray, plan: Any,
                    contested: Sequence[int] | None = None) -> list[Any]:
    """``MPI_Allreduce`` from `send` into `out` (``MPI_IN_PLACE`` where they are one array), to its end.

    What `Held` posts, and the compiled held lane's ops queued for the engine. Where some
    rank of the 2 said in the check that its core is contested (`contested`, every rank's
    per-rank value, the same list on both), the data moves in one exchange instead
    (`exchange_once`): MPI's algorithm for 2 ranks exchanges twice (half the buffer
    reduced, then the halves swapped), and on a core that another program contends for
    each exchange waits for the peer to be scheduled again (a DDP step beside a CPU hog
    per core took 0.86-1.17x gloo's time, median 0.99, with this choice against 0.93-1.25x,
    median 1.12, without: BENCHMARKS.md), while on a quiet machine MPI's algorithm is the
    faster (Open MPI's one exchange took 0.15 ms at 332 KiB against its own 0.09-0.12 ms).
    On one node the exchange goes through the ranks' shared pair (`pair.py`).

    Args:
        comm: the group's communicator.
        send: this rank's input (`out` itself: in place).
        out: the result buffer.
        plan: the `ReducePlan` (MPI datatype and op).
        contested: for a group of 2, each rank's contested state as its check said it;
            None or all zero: MPI's all-reduce.

    Returns:
        No request: the reduction is done.
    """
    datatype = plan.datatype
    if contested is not None and any(contested):
        exchange_once(comm, send, out, plan)
        return []
    idle_call(comm.Allreduce, comm.Iallreduce, MPI.IN_PLACE if send is out else [send, datatype], [out, datatype],
              plan.mpi_op)
    return []


def exchange_once(comm: Any, send: np.ndarray, out: np.ndarray, plan: Any) -> None:
    """The all-reduce of 2 ranks in one exchange: each sends its whole input, then reduces rank 0's op rank 1's.

    Both ranks compute the same ``x0 op x1`` from the same two operands, so they get the same
    bits (the order can matter: a sum of two NaNs keeps the first one's payload). `send` may be `out` (in place).
    Where both ranks run on one node, through their shared pair (`pair.py`), where a rank waits
    for the peer's input asleep in the kernel; else in one ``MPI_Sendrecv``.

    Raises:
        MPI.Exception: MPI failed the exchange.
    """
    if through_pair(comm, out.nbytes):  # both ranks on one node: no wait in MPI's loop
        exchange_through_pair(comm, send, out, plan)
        return
    datatype, mpi_op = plan.datatype, plan.mpi_op
    first = comm.Get_rank() == 0
    # Rank 0 receives straight into `out` where its input is elsewhere: x0 op x1 lands there.
    received = out if first and send is not out else np.empty_like(out)
    peer = 1 if first else 0
    idle_call(comm.Sendrecv, comm.Isendrecv, [send, datatype], peer, EXCHANGE_TAG, [received, datatype], peer,
              EXCHANGE_TAG)
    if first:
        mpi_op.Reduce_local([send, datatype], [received, datatype])
        if received is not out:
            np.copyto(out, received)
        return
    if send is not out:
        np.copyto(out, send)
    mpi_op.Reduce_local([received, datatype], [out, datatype])


def all_reduce_buffers(comm: Any, send: Any, out: Any, plan: Any) -> list[Any]:
    """Post ``MPI_Iallreduce`` from `send` into `out` (any buffers MPI takes: device ones too).

    Args:
        comm: the group's data communicator.
        send: the buffer reduced from.
        out: the buffer the result lands in (same shape, the plan's work dtype).
        plan: the `ReducePlan` (MPI datatype and op).

    Returns:
        The request, in a list.
    """
    datatype = plan.datatype
    return [comm.Iallreduce([send, datatype], [out, datatype], plan.mpi_op)]


def all_reduce_buckets(comm: Any, plans: Sequence[Any], sends: Sequence[Any], recvs: Sequence[Any]) -> list[Any]:
    """``MPI_Iallreduce`` of packed buckets (the fused all-reduce's data): one per bucket.

    Args:
        comm: the group's data communicator.
        plans: each bucket's `ReducePlan` (MPI datatype and op).
        sends: each bucket's packed input.
        recvs: each bucket's result buffer.

    Returns:
        The requests, one per bucket.
    """
    return [
        comm.Iallreduce([send, plan.datatype], [out, plan.datatype], plan.mpi_op)
        for plan, send, out in zip(plans, sends, recvs)
    ]
