"""`broadcast`: every rank of the group gets the root's tensor."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype, transfer_dtype
from .._core.interop import numpy_dtype
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import (
    CollectiveTensor,
    Input,
    check_record,
    context_for,
    follow,
    group_root,
    result_device,
    root_rank,
    start,
    take_input,
)
from .gpu_host import staged
from .grouped import grouped_broadcast, is_structure
from .held import held_call
from .options import output_buffer, output_tensor, protect_output, refuse_on_gpu

__all__ = ["broadcast"]


def broadcast(
    input: Any,  # noqa: A002 - the name every collective uses
    *,
    root: int | Device = 0,
    devices: DevicesArg = None,
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
    out: Any = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start a broadcast (``MPI_Ibcast``) of the root's tensor and return at once.

    Every rank of the group, the root included, gets a fresh tensor equal to the root's
    (or `out`, filled with it). A list, tuple or dict of tensors is broadcast as one
    fused call (see `grouped_broadcast`).

    Args:
        input: on the root, the tensor to send. Elsewhere, a tensor of the right shape
            and dtype (used only as a template), or None with `shape` and `dtype`.
        root: the sending rank (its rank in the context, a member of the group) or its
            `Device`.
        devices: the group; None for every rank of the context.
        shape: the shape to receive, when `input` is None.
        dtype: the dtype to receive, when `input` is None.
        out: a host Tensor or NumPy array to write the result into (of its shape and
            dtype, writable, C-contiguous); it may be the input itself (an in-place
            broadcast). With `input` None, it also gives the shape and dtype. Not to be
            written until the handle resolves.
        held: the caller holds `input` (a host NumPy array, of one shape and dtype on every
            rank) and `out` (a writable array of its shape and dtype, not overlapping it)
            until the result is resolved: MPI's blocking broadcast moves the data between
            them once the check agreed (see `_collectives/held.py`).

    Returns:
        A `CollectiveTensor` resolving to the broadcast tensor (`out` itself when it is
        a Tensor, else a Tensor sharing its memory).

    Raises:
        TypeError: the root passes None, or a non-root passes None without shape and
            dtype (or `out`), or `out` has another dtype.
        ValueError: the root is not a member of the group (raised on every rank), or a
            bad `out`.
        CollectiveMismatchError: the ranks disagree on root, shape, dtype or group.
    """
    if held:
        return held_call("broadcast", input, out, root, None, devices,
                         lambda: broadcast(input, root=root, devices=devices, out=out))
    ctx = context_for("broadcast")
    if is_structure(input):
        return grouped_broadcast(ctx, input, root, devices, out)
    group = ctx.group(devices, "broadcast")
    root_at = root_rank(ctx, root)
    is_root = root_at == ctx.rank
    if input is None:
        source = None
        out_shape, out_dtype = _described(is_root, *_from_out(out, shape, dtype))
        device, nbytes = ctx.cpu_device, math.prod(out_shape) * out_dtype.itemsize
    else:
        source = take_input(input, ctx, "broadcast")
        if source.on_gpu:
            refuse_on_gpu("broadcast", out=out)
            handle = staged(ctx, source, group, lambda host, members: broadcast(host, root=root_at, devices=members))
            return follow(handle, source.back)
        out_shape, out_dtype = tuple(source.array.shape), source.buffer.dtype
        device, nbytes = result_device(ctx, source), source.array.nbytes
    handle = _start(ctx, group, source, root_at, out, (out_shape, out_dtype), device, nbytes)
    return follow(handle, source.back if source is not None else None)


def _start(ctx: DistributedContext, group: Group, source: Input | None, root_at: int, out: Any,
           spec: tuple[tuple[int, ...], np.dtype], device: Any, nbytes: int) -> CollectiveTensor:
    out_shape, out_dtype = spec
    is_root = root_at == ctx.rank
    # No overlap check: copyto handles overlapping memory, so out may be the input.
    received = output_buffer(ctx, out, out_shape, out_dtype, "broadcast")
    if is_root and source is not None and source.buffer is not received:  # a root without a tensor raised above
        np.copyto(received, source.buffer)
    result = output_tensor(out, received, device)
    datatype = mpi_datatype(out_dtype)

    def post() -> list[Any]:
        index = group_root(group, root_at, "broadcast")
        requests = mpi.broadcast(group, received, datatype, index)
        protect_output(op, out, received)
        return requests

    record = check_record(ctx, group, Record("broadcast", None, out_dtype, out_shape, root_at, group.members))
    op = Op("broadcast", group, nbytes, post, lambda: result, record=record, keep=(received,))
    return start(ctx, op, result)


def _from_out(out: Any, shape: Any, dtype: Any) -> tuple[Any, Any]:
    """`shape` and `dtype`, or `out`'s when neither is given."""
    if out is not None and shape is None and dtype is None:
        return tuple(getattr(out, "shape", ())), getattr(out, "dtype", None)
    return shape, dtype


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
