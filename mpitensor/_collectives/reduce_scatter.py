"""`reduce_scatter`: reduce every rank's tensor, then give each rank one block of it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan
from .._core.tensor import Tensor
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import CollectiveTensor, Input, check_record, context_for, follow, result_device, start, take_input
from .gpu_host import staged
from .grouped import grouped_reduce_scatter, is_structure
from .options import (
    blocks_or_problem,
    finish_scaled,
    make_record,
    output_tensor,
    prescaled_input,
    protect_output,
    reduction_outputs,
    refuse_on_gpu,
    row_counts,
    scale_factors,
    scale_options,
    split_first_axis,
)

__all__ = ["blocks_or_problem", "reduce_scatter", "split_first_axis"]


def reduce_scatter(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    devices: DevicesArg = None,
    counts: Sequence[int] | None = None,
    out: Any = None,
    prescale_factor: float | None = None,
    postscale_factor: float | None = None,
) -> CollectiveTensor:
    """Start a reduce-scatter (``MPI_Ireduce_scatter_block``) and return at once.

    The ranks' tensors are reduced element-wise and cut along the first axis; the k-th
    rank of the group gets block k: one of `size` equal blocks, or `counts[k]` rows
    (``MPI_Ireduce_scatter``). A list, tuple or dict of tensors is reduced as one fused
    call (see `grouped_reduce_scatter`).

    Args:
        input: this rank's tensor; without `counts`, its first dimension must be
            divisible by the group size.
        op: the reduction; None uses the context's ``config.all_reduce_op``.
        devices: the group; None for every rank of the context.
        counts: rows of the result per member, in group order (non-negative ints
            summing to the first dimension); the same on every rank.
        out: a host Tensor or NumPy array to write this rank's block into (of its
            shape and dtype, writable, C-contiguous, not the input); not to be written
            until the handle resolves.
        prescale_factor: multiplies each rank's input before the reduction (into a
            private copy). Integer tensors take integers only.
        postscale_factor: multiplies the result after the reduction.

    Returns:
        A `CollectiveTensor` resolving to this rank's block (`out` itself when it is a
        Tensor, else a Tensor sharing its memory).

    Raises:
        TypeError: bad input, dtype, counts, factor or `out` dtype.
        ValueError: the first dimension is not divisible by the group size, bad counts
            or a bad `out` (raised on every rank).
        CollectiveMismatchError: the ranks disagree on shape, dtype, op, counts,
            factors or group.
    """
    ctx = context_for("reduce_scatter")
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    if is_structure(input):
        return grouped_reduce_scatter(ctx, input, reduce_op, devices, counts, out, prescale_factor, postscale_factor)
    source = take_input(input, ctx, "reduce_scatter")
    group = ctx.group(devices, "reduce_scatter")
    if source.on_gpu:
        refuse_on_gpu("reduce_scatter", out=out)
        handle = staged(ctx, source, group, lambda host, members: reduce_scatter(
            host, reduce_op, devices=members, counts=counts, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor))
        return follow(handle, source.back)
    handle = _start(ctx, source, reduce_op, group, counts, out, (prescale_factor, postscale_factor))
    return follow(handle, source.back)


def _start(ctx: DistributedContext, source: Input, reduce_op: ReduceOperation, group: Group, counts: Any,
           out: Any, factors: tuple[Any, Any]) -> CollectiveTensor:
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    pre, post_factor = scale_factors(*factors, source.buffer.dtype, "reduce_scatter")
    rows = row_counts(counts, array.shape, group, "reduce_scatter", "counts")
    if rows is None:
        # A bad shape is raised when the data is posted, after the check: ranks that
        # disagree on the shape then get the mismatch error instead of some of them leaving.
        problem, block_shape = blocks_or_problem(array.shape, group.size, "reduce_scatter")
    else:
        problem, block_shape = None, (rows[group.rank], *array.shape[1:])
    work, final = reduction_outputs(ctx, out, block_shape, plan, "reduce_scatter", (array,))
    send, protections = prescaled_input(ctx, source, plan, pre)
    result = output_tensor(out, final, result_device(ctx, source))
    datatype, mpi_op, size = plan.datatype, plan.mpi_op, group.size
    row = math.prod(array.shape[1:])

    def post() -> list[Any]:
        if problem is not None:
            raise problem
        if rows is None:
            requests = mpi.reduce_scatter_block(group, send, work, datatype, mpi_op)
        else:
            recvcounts = [n * row for n in rows]
            requests = mpi.reduce_scatter(group, send, work, recvcounts, datatype, mpi_op)
        protect_output(collective, out, final)
        return requests

    def finish() -> Tensor:
        finish_scaled(work, final, plan, size, post_factor)
        return result

    options = (*scale_options(pre, post_factor), *(() if rows is None else (("counts", rows),)))
    record = check_record(ctx, group, make_record(options, "reduce_scatter", reduce_op, array.dtype, array.shape, -1,
                                                  group.members))
    collective = Op("reduce_scatter", group, array.nbytes, post, finish, record=record, keep=(send, work, final),
                    protections=protections)
    return start(ctx, collective, result)
