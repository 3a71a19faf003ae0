"""`barrier`: block until every rank of the group arrives."""

from __future__ import annotations

from .._runtime.check import Record
from .._runtime.context import DevicesArg, current_context
from .._runtime.engine import Op
from .._transport import mpi
from .common import check_record, timeout_arg

__all__ = ["barrier"]


def barrier(devices: DevicesArg = None, *, timeout: float | None = None) -> None:
    """Block until every rank of the group has called `barrier` (``MPI_Ibarrier``).

    Fails fast like any collective.

    Args:
        devices: the group (the whole context when None).
        timeout: seconds to wait at most, the check included; None uses the context's timeout
            (`DistributedConfig.timeout` or ``MPITENSOR_TIMEOUT``), else waits forever.

    Raises:
        NoContextError: no context is open.
        CollectiveTimeoutError: the timeout passed first (the context is then broken: MPI
            cannot cancel a started barrier).
        ValueError: `timeout` is not a positive number of seconds.
    """
    ctx = current_context()
    ctx.ensure_usable()
    wait = timeout_arg(timeout, ctx)
    group = ctx.group(devices, "barrier")
    record = check_record(ctx, group, Record("barrier", None, None, None, -1, group.members))
    op = Op("barrier", group, 0, post=lambda: mpi.barrier(group), record=record)
    # A barrier blocks anyway: its whole wait, check included, counts against the timeout.
    ctx.engine.submit(op, grace=0)
    ctx.engine.wait(op, wait)

