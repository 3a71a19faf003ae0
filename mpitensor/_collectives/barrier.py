"""`barrier`: block until every rank of the group arrives."""

from __future__ import annotations

from .._runtime.check import Record
from .._runtime.context import DevicesArg, current_context
from .._runtime.engine import Op
from .._transport import mpi
from .common import check_record

__all__ = ["barrier"]


def barrier(devices: DevicesArg = None) -> None:
    """Block until every rank of the group has called `barrier` (``MPI_Ibarrier``).

    Honours the context's timeout and fails fast like any collective.

    Args:
        devices: the group (the whole context when None).

    Raises:
        NoContextError: no context is open.
        CollectiveTimeoutError: the context's timeout passed first.
    """
    ctx = current_context()
    ctx.ensure_usable()
    group = ctx.group(devices, "barrier")
    record = check_record(ctx, group, Record("barrier", None, None, None, -1, group.members))
    op = Op("barrier", group, 0, post=lambda: mpi.barrier(group), record=record)
    # A barrier blocks anyway: its whole wait, check included, counts against the timeout.
    ctx.engine.submit(op, grace=0)
    ctx.engine.wait(op, ctx.timeout)

