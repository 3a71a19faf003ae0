"""The staged all-reduce: a host transport's reduction run on a pinned copy of a device array.

The device array is copied into a pooled pinned buffer on the copy stream (`staging.stage`),
after the event that marks the end of the work producing it. The copy is offered, as a
`base.PrivateCopy`, to the host transports of `select.STAGED_ALL_REDUCE`, which take it
where a host input of the same size would go, so that ranks with host and GPU inputs run
the same algorithm: MPI in place on the copy for small ones whatever the settings, the
shared-memory all-reduce where it applies, else MPI in place. The first that applies is
prepared at the call and started by the engine once the copy is done
(`after_event.AfterEvent`: polled, never waited for). The result is copied back to the
device, divided, decoded and rounded there, and ordered before the caller's later work.
"""

from __future__ import annotations

from typing import Any

from ..base import Channel, Host, PrivateCopy, ReduceCall, select
from ..select import STAGED_ALL_REDUCE
from .after_event import AfterEvent
from .fix_up import FixUp
from .staging import Staged, stage, unstage
from .streams import GpuCall

__all__ = ["StagedReduce", "host_reduction", "result_fix", "staged_all_reduce"]


class StagedReduce:
    """One staged all-reduce: the op's ``post`` and ``finish``, and what it keeps alive.

    Args:
        call: the GPU side of the call.
        staged: the copy of the device input in pinned memory.
        host_call: the host transport's call over that copy (prepared).
        out: the device array the result is copied back into.
        fix: MEAN's division and the rounding back (decoding is decided here: only a
            transport that leaves MAX/MIN keys in its result needs it).
    """

    __slots__ = ("call", "fix", "host_call", "out", "staged")

    def __init__(self, call: GpuCall, staged: Staged, host_call: ReduceCall, out: Any, fix: FixUp) -> None:
        self.call = call
        self.staged = staged
        self.host_call = host_call
        self.out = out
        self.fix = fix

    @property
    def keep(self) -> tuple[Any, ...]:
        """What must live until the op is complete: the pinned copy and the host call."""
        return (self.staged.buffer, self.host_call)

    def post(self) -> AfterEvent:
        """The op's ``post``: start the host transport once the copy to the host is done."""
        return AfterEvent(self.staged.done, self.host_call.start)

    def finish(self) -> None:
        """The op's ``finish``: copy the result back (fixed up on the device); free the copy."""
        done = unstage(self.call, self.host_call.out, self.out, fix=result_fix(self.host_call, self.fix))
        self.staged.buffer.release(done)


def staged_all_reduce(ctx: Host, group: Channel, call: GpuCall, send: Any, ready: Any, plan: Any, nbytes: int,
                      out: Any, fix: FixUp) -> StagedReduce:
    """Stage `send` and prepare the host transport that reduces the copy.

    Args:
        ctx: the context (as a `base.Host`).
        group: the group (as a `base.Channel`).
        call: the GPU side of the call.
        send: the C-contiguous device array to reduce, in the plan's work dtype (float
            MAX/MIN as the floats: transports that reduce keys encode them on the host).
        ready: the event after the work that produces `send` (`GpuCall.mark()`).
        plan: the `ReducePlan`.
        nbytes: the input's size in bytes, which ranks with host inputs decide by too.
        out: the device array the result lands in (from `GpuCall.empty()` before `ready`).
        fix: what runs on the device after the copy back (MEAN, rounding back).

    Returns:
        The staged reduction (its ``post`` and ``finish`` for the engine).
    """
    staged = stage(call, send, after=ready)
    return StagedReduce(call, staged, host_reduction(ctx, group, staged.buffer.array, plan, nbytes), out, fix)


def host_reduction(ctx: Host, group: Channel, copy: Any, plan: Any, nbytes: int) -> ReduceCall:
    """The host transport's call over a staged copy: chosen from `STAGED_ALL_REDUCE`, prepared.

    Its data may still be arriving: the transport reads it only once started.

    Args:
        ctx: the context (as a `base.Host`).
        group: the group (as a `base.Channel`).
        copy: the pinned host copy (C-contiguous, the plan's work dtype).
        plan: the `ReducePlan`.
        nbytes: the input's size in bytes (what ranks with host inputs decide by).

    Returns:
        The call; ``call.start`` starts the reduction, whose result is ``call.out``.
    """
    host_call = ReduceCall(ctx, group, PrivateCopy(copy), plan, nbytes)
    select(STAGED_ALL_REDUCE, host_call).prepare(host_call)
    return host_call


def result_fix(host_call: ReduceCall, fix: FixUp) -> FixUp:
    """What runs on the device after the copy back: `fix`, decoding only a result of MAX/MIN keys.

    The shared-memory all-reduce reduces float MAX/MIN as floats (``decoded``); MPI
    reduces their keys, which the device decodes.
    """
    return FixUp(fix.divide_by, fix.into, None if host_call.decoded else host_call.plan.codec)
