"""The CUDA-aware all-reduce: MPI reduces the device buffers themselves.

MPI knows no CUDA streams, so the buffers go to it only once the work producing them is
done: ``post`` returns an `after_event.AfterEvent` on the event marking that work, which
the engine polls. MEAN's division, decoding and rounding back then run on the caller's
stream.
"""

from __future__ import annotations

from typing import Any

from ..mpi import all_reduce_buffers
from .after_event import AfterEvent
from .fix_up import FixUp, finish_on_device
from .streams import GpuCall

__all__ = ["DeviceReduce"]


class DeviceReduce:
    """One all-reduce of device buffers: the op's ``post`` and ``finish``.

    Args:
        call: the GPU side of the call.
        comm: the group's data communicator.
        send: the device array reduced from (keys for float MAX/MIN, encoded on the device).
        out: the device array the result lands in.
        plan: the `ReducePlan`.
        ready: the event after the work that produces `send` and allocates `out`.
        fix: what runs on the caller's stream once MPI is done.
    """

    __slots__ = ("call", "comm", "fix", "out", "plan", "ready", "send")

    keep: tuple[Any, ...] = ()

    def __init__(self, call: GpuCall, comm: Any, send: Any, out: Any, plan: Any, ready: Any, fix: FixUp) -> None:
        self.call = call
        self.comm = comm
        self.send = send
        self.out = out
        self.plan = plan
        self.ready = ready
        self.fix = fix

    def post(self) -> AfterEvent:
        """The op's ``post``: hand the buffers to MPI once `ready` is done."""
        return AfterEvent(self.ready, lambda: all_reduce_buffers(self.comm, self.send, self.out, self.plan))

    def finish(self) -> None:
        """The op's ``finish``: the device-side fix-up, on the caller's stream."""
        finish_on_device(self.call, self.out, self.fix)
