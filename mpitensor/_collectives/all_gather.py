"""`all_gather`: every rank gets all the ranks' tensors, concatenated along an axis."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.dtypes import mpi_datatype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .common import CollectiveTensor, Later, context_for, follow, result_device, start, take_input

__all__ = ["all_gather"]


def all_gather(input: Any, *, axis: int = 0, devices: DevicesArg = None) -> CollectiveTensor:  # noqa: A002
    """Start an all-gather and return at once; every rank gets the concatenation.

    Ranks may differ in the length of `axis` (``MPI_Iallgatherv`` then runs instead of
    ``MPI_Iallgather``); every other dimension must agree. A 0-d tensor counts as one
    element, so gathering scalars gives a vector of one value per rank.

    Args:
        input: this rank's tensor (a `Tensor` or NumPy array).
        axis: the axis to concatenate along (negative counts from the end).
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to the concatenated tensor, in group order.

    Raises:
        TypeError: bad input or dtype.
        ValueError: `axis` is out of range.
        CollectiveMismatchError: the ranks disagree on dtype, the other dimensions,
            axis or group.
    """
    ctx = context_for("all_gather")
    source = take_input(input, ctx, "all_gather")
    group = ctx.group(devices, "all_gather")
    if source.on_gpu:
        from .gpu_staged import gpu_all_gather

        return follow(gpu_all_gather(ctx, source, group, axis), source.back)
    protections = source.guard(ctx)
    array = source.buffer if source.buffer.ndim else source.buffer.reshape(1)
    axis = _axis(axis, array.ndim)
    moved = np.moveaxis(array, axis, 0)
    if axis:
        send = ctx.pool.empty(moved.shape, moved.dtype)
        np.copyto(send, moved)
        source.copied = True
    else:
        send = moved
    length, rest = send.shape[0], send.shape[1:]
    template = list(array.shape)
    template[axis] = -1
    record = Record("all_gather", None, array.dtype, tuple(template), -1, group.members, per_rank=length, extra=axis)
    datatype = mpi_datatype(array.dtype)
    block = int(np.prod(rest, dtype=np.int64))
    later, device, comm = Later(), result_device(ctx, source), group.comm

    def post(lengths: list[int]) -> list[Any]:
        gathered = ctx.pool.empty((sum(lengths), *rest), array.dtype)
        # Gathered along the first axis; the result is a view with the axis moved back.
        later.value = Tensor(np.moveaxis(gathered, 0, axis) if axis else gathered, device)
        if len(set(lengths)) == 1:
            return [comm.Iallgather([send, datatype], [gathered, datatype])]
        counts = [n * block for n in lengths]
        displacements = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        return [comm.Iallgatherv([send, datatype], [gathered, counts, displacements, datatype])]

    op = Op("all_gather", group, send.nbytes, post, lambda: later.value, record=record, keep=(send,),
            protections=protections, exchange=True, compare=ctx.config.check)
    return follow(start(ctx, op, later), source.back)


def _axis(axis: Any, ndim: int) -> int:
    """`axis` as a non-negative axis of a tensor of `ndim` dimensions.

    Raises:
        TypeError: `axis` is not an int.
        ValueError: `axis` is out of range.
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"all_gather: axis must be an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"all_gather: axis {axis} is out of range for a tensor of {ndim} dimension(s)")
    return int(axis) % ndim
