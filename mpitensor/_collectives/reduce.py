"""`reduce`: the root gets the element-wise reduction of every rank's tensor."""

from __future__ import annotations

from typing import Any

from .._core.config import ReduceOperation, parse_op
from .._core.device import Device
from .._core.dtypes import reduce_plan
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .common import (
    CollectiveTensor,
    check_record,
    context_for,
    finish_reduction,
    follow,
    group_root,
    reduction_buffers,
    reduction_input,
    result_device,
    root_rank,
    start,
    take_input,
)

__all__ = ["reduce"]


def reduce(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    root: int | Device = 0,
    devices: DevicesArg = None,
) -> CollectiveTensor:
    """Start a reduction to the root (``MPI_Ireduce``) and return at once.

    Args:
        input: this rank's tensor (a `Tensor` or NumPy array).
        op: the reduction; None uses the context's ``config.all_reduce_op``.
        root: the rank (in the context, a member of the group) or `Device` that gets
            the result.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to the result on the root and to None elsewhere.

    Raises:
        TypeError: bad input or dtype.
        ValueError: the root is not a member of the group (raised on every rank).
        CollectiveMismatchError: the ranks disagree on shape, dtype, op, root or group.
    """
    ctx = context_for("reduce")
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    source = take_input(input, ctx, "reduce")
    group = ctx.group(devices, "reduce")
    root_at = root_rank(ctx, root)
    if source.on_gpu:
        from .gpu_staged import gpu_reduce

        return follow(gpu_reduce(ctx, source, reduce_op, group, root_at), source.back)
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    send, protections = reduction_input(ctx, source, plan)
    is_root = root_at == ctx.rank
    out, final = reduction_buffers(ctx, array.shape, plan) if is_root else (None, None)
    result = Tensor(final, result_device(ctx, source)) if final is not None else None
    comm, datatype, mpi_op, size = group.comm, plan.datatype, plan.mpi_op, group.size

    def post() -> list[Any]:
        index = group_root(group, root_at, "reduce")
        recv = [out, datatype] if out is not None else None
        return [comm.Ireduce([send, datatype], recv, mpi_op, root=index)]

    def finish() -> Tensor | None:
        if out is not None:
            finish_reduction(out, final, plan, size)
        return result

    record = check_record(ctx, group, Record("reduce", reduce_op, array.dtype, array.shape, root_at, group.members))
    collective = Op(
        "reduce", group, array.nbytes, post, finish, record=record, keep=(send, out, final),
        protections=protections,
    )
    return follow(start(ctx, collective, result), source.back)
