"""`reduce_scatter`: reduce every rank's tensor, then give each rank one block of it."""

from __future__ import annotations

from typing import Any

from .._core.config import ReduceOperation, parse_op
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
    reduction_buffers,
    reduction_input,
    result_device,
    start,
    take_input,
)

__all__ = ["blocks_or_problem", "reduce_scatter", "split_first_axis"]


def split_first_axis(shape: tuple[int, ...], parts: int, what: str) -> tuple[int, ...]:
    """The shape of one of `parts` equal blocks of `shape` along its first axis.

    Raises:
        ValueError: a 0-d shape, or a first dimension not divisible by `parts`.
    """
    if not shape:
        raise ValueError(f"{what} needs a tensor with at least one dimension, got a 0-d tensor")
    if shape[0] % parts:
        raise ValueError(
            f"{what}: the first dimension ({shape[0]}) must be divisible by the group size ({parts}); "
            f"pad it to {-(-shape[0] // parts) * parts}"
        )
    return (shape[0] // parts, *shape[1:])


def blocks_or_problem(shape: tuple[int, ...], parts: int, what: str) -> tuple[ValueError | None, tuple[int, ...]]:
    """`split_first_axis`, with its error returned instead of raised (to raise in post)."""
    try:
        return None, split_first_axis(shape, parts, what)
    except ValueError as exc:
        return exc, (0,)


def reduce_scatter(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    devices: DevicesArg = None,
) -> CollectiveTensor:
    """Start a reduce-scatter (``MPI_Ireduce_scatter_block``) and return at once.

    The ranks' tensors are reduced element-wise and cut into `size` equal blocks along
    the first axis; the k-th rank of the group gets block k.

    Args:
        input: this rank's tensor; its first dimension must be divisible by the group size.
        op: the reduction; None uses the context's ``config.all_reduce_op``.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to this rank's block.

    Raises:
        TypeError: bad input or dtype.
        ValueError: the first dimension is not divisible by the group size (raised on
            every rank, after the ranks agreed on the shape).
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
    """
    ctx = context_for("reduce_scatter")
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    source = take_input(input, ctx, "reduce_scatter")
    group = ctx.group(devices, "reduce_scatter")
    if source.on_gpu:
        from .gpu_staged import gpu_reduce_scatter

        return follow(gpu_reduce_scatter(ctx, source, reduce_op, group), source.back)
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    # A bad shape is raised when the data is posted, after the check: ranks that
    # disagree on the shape then get the mismatch error instead of some of them leaving.
    problem, block_shape = blocks_or_problem(array.shape, group.size, "reduce_scatter")
    send, protections = reduction_input(ctx, source, plan)
    out, final = reduction_buffers(ctx, block_shape, plan)
    result = Tensor(final, result_device(ctx, source))
    comm, datatype, mpi_op, size = group.comm, plan.datatype, plan.mpi_op, group.size

    def post() -> list[Any]:
        if problem is not None:
            raise problem
        return [comm.Ireduce_scatter_block([send, datatype], [out, datatype], mpi_op)]

    def finish() -> Tensor:
        finish_reduction(out, final, plan, size)
        return result

    record = check_record(ctx, group, Record("reduce_scatter", reduce_op, array.dtype, array.shape, -1, group.members))
    collective = Op("reduce_scatter", group, array.nbytes, post, finish, record=record, keep=(send, out, final),
                    protections=protections)
    return follow(start(ctx, collective, result), source.back)
