"""`all_reduce` with ``out=`` or scale factors: MPI's own all-reduce into the caller's buffer."""

from __future__ import annotations

from typing import Any

from .._core.config import ReduceOperation
from .._core.dtypes import reduce_plan
from .._core.tensor import Tensor
from .._runtime.context import DistributedContext
from .._runtime.engine import Group, Op
from .._transport.base import ReduceCall
from .._transport.select import PLAIN
from .common import CollectiveTensor, Input, check_record, result_device, start
from .options import (
    finish_scaled,
    make_record,
    output_tensor,
    prescaled_input,
    protect_output,
    reduction_outputs,
    scale_factors,
    scale_options,
)

__all__ = ["all_reduce_with_options"]


def all_reduce_with_options(ctx: DistributedContext, source: Input, group: Group, reduce_op: ReduceOperation,
                            out: Any, factors: tuple[Any, Any]) -> CollectiveTensor:
    """Start an all-reduce whose result goes into `out` and/or is scaled (Horovod's factors).

    It always runs MPI's own all-reduce (the `Plain` transport): the result must land in
    the caller's buffer, and a prescaled input is a private copy anyway.

    Args:
        ctx: the context.
        source: the host input (`take_input`).
        group: the group.
        reduce_op: the reduction.
        out: None, or the host Tensor or NumPy array to write the result into.
        factors: (prescale_factor, postscale_factor), each None for none.

    Returns:
        The handle; `resolve()` gives `out` (or a Tensor sharing its memory).

    Raises:
        TypeError, ValueError: a bad `out` or factor (see `output_buffer`, `scale_factors`).
    """
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    pre, post_factor = scale_factors(*factors, source.buffer.dtype, "all_reduce")
    work, final = reduction_outputs(ctx, out, array.shape, plan, "all_reduce", (array, source.buffer))
    call = ReduceCall(ctx, group, source, plan, array.nbytes)
    call.send, call.protections = prescaled_input(ctx, source, plan, pre)
    call.out, call.final, call.transport = work, final, PLAIN
    result = output_tensor(out, final, result_device(ctx, source))
    size = group.size

    def post() -> list[Any]:
        requests = call.start()
        protect_output(collective, out, final)
        return requests

    def finish() -> Tensor:
        finish_scaled(work, final, plan, size, post_factor)
        return result

    options = scale_options(pre, post_factor)
    record = check_record(
        ctx, group, make_record(options, "all_reduce", reduce_op, array.dtype, array.shape, -1, group.members)
    )
    collective = Op("all_reduce", group, array.nbytes, post, finish, record, (call, work, final), call.protections)
    return start(ctx, collective, result)

