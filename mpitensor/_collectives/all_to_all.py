"""`all_to_all`: rank i sends its j-th block to rank j and receives everyone's i-th block."""

from __future__ import annotations

from typing import Any

from .._core.dtypes import mpi_datatype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .common import CollectiveTensor, check_record, context_for, follow, result_device, start, take_input
from .reduce_scatter import blocks_or_problem

__all__ = ["all_to_all"]


def all_to_all(input: Any, *, devices: DevicesArg = None) -> CollectiveTensor:  # noqa: A002
    """Start an all-to-all exchange (``MPI_Ialltoall``) and return at once.

    The input is cut into `size` equal blocks along its first axis; block j goes to the
    j-th rank of the group. The result has the input's shape: block i of it came from
    the i-th rank.

    Args:
        input: this rank's tensor; its first dimension must be divisible by the group size.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to the received blocks, concatenated.

    Raises:
        TypeError: bad input or dtype.
        ValueError: the first dimension is not divisible by the group size.
        CollectiveMismatchError: the ranks disagree on shape, dtype or group.
    """
    ctx = context_for("all_to_all")
    source = take_input(input, ctx, "all_to_all")
    group = ctx.group(devices, "all_to_all")
    if source.on_gpu:
        from .gpu_staged import gpu_all_to_all

        return follow(gpu_all_to_all(ctx, source, group), source.back)
    protections = source.guard(ctx)
    array = source.buffer
    problem, _ = blocks_or_problem(array.shape, group.size, "all_to_all")
    out = ctx.pool.empty(array.shape, array.dtype)
    result = Tensor(out, result_device(ctx, source))
    comm, datatype = group.comm, mpi_datatype(array.dtype)

    def post() -> list[Any]:
        if problem is not None:
            raise problem
        return [comm.Ialltoall([array, datatype], [out, datatype])]

    record = check_record(ctx, group, Record("all_to_all", None, array.dtype, array.shape, -1, group.members))
    op = Op(
        "all_to_all",
        group,
        array.nbytes,
        post,
        lambda: result,
        record=record,
        keep=(array, out),
        protections=protections,
    )
    return follow(start(ctx, op, result), source.back)
