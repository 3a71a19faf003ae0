"""`broadcast`: every rank of the group gets the root's tensor."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype, transfer_dtype
from .._core.interop import numpy_dtype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .common import (
    CollectiveTensor,
    check_record,
    context_for,
    follow,
    group_root,
    result_device,
    root_rank,
    start,
    take_input,
)

__all__ = ["broadcast"]


def broadcast(
    input: Any,  # noqa: A002 - the name every collective uses
    *,
    root: int | Device = 0,
    devices: DevicesArg = None,
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
) -> CollectiveTensor:
    """Start a broadcast (``MPI_Ibcast``) of the root's tensor and return at once.

    Every rank of the group, the root included, gets a fresh tensor equal to the root's.

    Args:
        input: on the root, the tensor to send. Elsewhere, a tensor of the right shape
            and dtype (used only as a template), or None with `shape` and `dtype`.
        root: the sending rank (its rank in the context, a member of the group) or its
            `Device`.
        devices: the group; None for every rank of the context.
        shape: the shape to receive, when `input` is None.
        dtype: the dtype to receive, when `input` is None.

    Returns:
        A `CollectiveTensor` resolving to the broadcast tensor.

    Raises:
        TypeError: the root passes None, or a non-root passes None without shape and dtype.
        ValueError: the root is not a member of the group (raised on every rank).
        CollectiveMismatchError: the ranks disagree on root, shape, dtype or group.
    """
    ctx = context_for("broadcast")
    group = ctx.group(devices, "broadcast")
    root_at = root_rank(ctx, root)
    is_root = root_at == ctx.rank
    if input is None:
        out_shape, out_dtype = _described(is_root, shape, dtype)
        source = None
        device = ctx.cpu_device
        nbytes = int(np.prod(out_shape, dtype=np.int64)) * out_dtype.itemsize
    else:
        source = take_input(input, ctx, "broadcast")
        if source.on_gpu:
            from .gpu_staged import gpu_broadcast

            return follow(gpu_broadcast(ctx, source, group, root_at), source.back)
        out_shape, out_dtype = tuple(source.array.shape), source.buffer.dtype
        device = result_device(ctx, source)
        nbytes = source.array.nbytes
    out = ctx.pool.empty(out_shape, out_dtype)
    if is_root and source is not None:  # a root without a tensor raised above
        np.copyto(out, source.buffer)
    result = Tensor(out, device)
    comm, datatype = group.comm, mpi_datatype(out_dtype)

    def post() -> list[Any]:
        index = group_root(group, root_at, "broadcast")
        return [comm.Ibcast([out, datatype], root=index)]

    record = check_record(ctx, group, Record("broadcast", None, out_dtype, out_shape, root_at, group.members))
    op = Op("broadcast", group, nbytes, post, lambda: result, record=record, keep=(out,))
    return follow(start(ctx, op, result), source.back if source is not None else None)


def _described(is_root: bool, shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a non-root rank that passes no tensor receives.

    Raises:
        TypeError: the root passes None, or `shape` or `dtype` is missing or not a dtype.
    """
    if is_root:
        raise TypeError("broadcast: the root must pass the tensor to send, got None")
    if shape is None or dtype is None:
        raise TypeError(
            "broadcast: a non-root rank passing input=None must give shape= and dtype= "
            "of the tensor it receives"
        )
    out_shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    return out_shape, transfer_dtype(numpy_dtype(dtype))
