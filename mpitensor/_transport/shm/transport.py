"""The shared-memory all-reduce as a transport: when it applies, its buffers, its start."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import ReduceCall, Stepper
from ..reduction import reduction_input
from .group_state import GroupState
from .layout import node_layout
from .protocol import ufunc_for
from .settings import may_apply
from .stepper import AllReduceStepper

__all__ = ["SharedMemory", "state_of"]

_EXTRA_KEY = "shared_memory"


def state_of(call: ReduceCall) -> GroupState:
    """The transport's state of the call's group (made on first use, kept in ``group.extra``)."""
    group = call.group
    state = group.extra.get(_EXTRA_KEY)
    if state is None:
        hosts = call.ctx.hosts
        state = GroupState(group, node_layout([hosts[member] for member in group.members]))
        group.extra[_EXTRA_KEY] = state
    return state


class SharedMemory:
    """The all-reduce through node peers' shared memory (see the package's docstring).

    The result is a block of this rank's shared memory, leased to the caller. It holds the
    reduction with ``plan.combine`` (the bits ``plan.mpi_op`` gives), the same bits on every
    rank; for float MAX/MIN it reduces the floats themselves, so nothing is decoded. MEAN's
    division is left to the collective's finish, as for ``MPI_Iallreduce``.
    """

    name = "shared-memory"

    def applies(self, call: ReduceCall) -> bool:
        """Whether the call may go through shared memory.

        Not when: ``config.shared_memory`` is False; the message is empty, or smaller than
        `min_bytes()` and ``shared_memory`` is None (True forces any size); the group has
        one rank, or no node holds two of its ranks; the input is not a host array; the op
        is user-defined (MAX/MIN of complex numbers) or has no NumPy equivalent, or the
        dtype sent is not a plain number or bool; the platform has no ``memfd``; the config
        asks for fault tolerance (``on_rank_failure="raise"``: a peer that dies mid-call
        would leave the others waiting on its flags, where MPI's transports report it). That
        depends only on what every rank agrees on once the check has passed (size, dtype,
        op, group, config, hosts), so all ranks take the same path.
        """
        # Cheapest tests first.
        config = call.ctx.config
        if not may_apply(config, call.nbytes) or not isinstance(call.source.buffer, np.ndarray):
            return False
        if config.on_rank_failure == "raise":
            return False
        if not state_of(call).applies:
            return False
        plan = call.plan
        sent = call.source.buffer.dtype if plan.codec is not None else plan.work_dtype
        if sent.kind not in "biufc":
            return False
        # User-defined MPI ops (MAX/MIN of complex numbers, of 16-byte long doubles) stay on MPI's path.
        return plan.mpi_op.is_predefined and (plan.combine is not None or ufunc_for(plan.mpi_op) is not None)

    def prepare(self, call: ReduceCall) -> None:
        """Protect the input (converted to the work dtype, not encoded); lease the result block."""
        ctx, plan, source = call.ctx, call.plan, call.source
        if plan.codec is None:
            call.send, call.protections = reduction_input(ctx, source, plan)
        else:
            call.protections = source.guard(ctx)  # may swap in a private copy: read the buffer after it
            call.send = source.buffer
        call.out, call.extra = state_of(call).lease_result(call.send.shape, call.send.dtype, ctx.pool)
        call.final = ctx.pool.empty(call.send.shape, plan.out_dtype) if plan.rounds_back else call.out
        call.decoded = True

    def start(self, call: ReduceCall) -> Stepper:
        """Queue the operation behind the group's others and start what can start."""
        state = state_of(call)
        plan = call.plan
        ufunc: Any = plan.combine if plan.combine is not None else ufunc_for(plan.mpi_op)
        stepper = AllReduceStepper(state, call.send, call.out, call.extra, ufunc, plan)
        state.enqueue(stepper)
        # With a progress thread and a core to spare, the copies and reductions run there,
        # beside the program's compute; otherwise they start at once, in the call.
        if state.oversubscribed or getattr(call.ctx.engine, "progress_thread", None) is None:
            stepper.advance()
        return stepper
