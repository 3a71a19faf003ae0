"""`gather`: the root gets every rank's tensor, concatenated along an axis."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .._transport import mpi
from .common import (
    CollectiveTensor,
    Later,
    context_for,
    follow,
    group_root,
    result_device,
    root_rank,
    start,
    take_input,
)
from .gpu_host import staged
from .held import filled, held_call
from .layout import axis_arg, displacements, to_front

__all__ = ["gather"]


def gather(
    input: Any,  # noqa: A002 - the name every collective uses
    root: int | Device = 0,
    *,
    axis: int = 0,
    devices: DevicesArg = None,
    out: Any = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start a gather to the root (``MPI_Igather``/``MPI_Igatherv``) and return at once.

    Ranks may differ in the length of `axis` (exchanged with the consistency check, then
    ``MPI_Igatherv`` runs); every other dimension must agree. A 0-d tensor counts as one
    element.

    Args:
        input: this rank's tensor: a `Tensor`, an array of NumPy, CuPy, torch or JAX (or
            any DLPack object), or a number.
        root: the rank (in the context, a member of the group) or `Device` that gets the result.
        axis: the axis to concatenate along (negative counts from the end).
        devices: the group; None for every rank of the context.
        out: with `held` only: the caller's result buffer (see `held`).
        held: the caller holds `input` (a host NumPy array, of one shape and dtype on every
            rank) and `out` until the result is resolved; every rank's `out` gets a result,
            as a compiled program's results have one shape on every rank: on the root the
            group's size times the input's elements (rank k's input its k-th part, stacked
            along a new first axis), elsewhere the input itself. MPI's blocking gather moves
            the data once the check agreed (see `_collectives/held.py`).

    Returns:
        A `CollectiveTensor` resolving on the root to the concatenation in group order, in
        the input's kind (a `Tensor` for NumPy and CuPy arrays, a torch tensor, a JAX array,
        a list for a Python number), and to None elsewhere.

    Raises:
        TypeError: bad input, dtype or axis type.
        ValueError: `axis` is out of range, or the root is not in the group (on every rank).
        CollectiveMismatchError: the ranks disagree on dtype, other dimensions, axis, root or group.
    """
    if held:
        return held_call("gather", input, out, root, None, devices, lambda: _held_general(input, root, devices, out))
    if out is not None:
        raise TypeError("gather takes out= with held=True only (the caller's buffer of every rank's input); "
                        "without it, resolve() gives the gathered tensor")
    ctx = context_for("gather")
    source = take_input(input, ctx, "gather")
    group = ctx.group(devices, "gather")
    root_at = root_rank(ctx, root)
    if source.on_gpu:
        handle = staged(ctx, source, group, lambda host, members: gather(host, root_at, axis=axis, devices=members))
        return follow(handle, source.back)
    protections = source.guard(ctx)
    array = source.buffer if source.buffer.ndim else source.buffer.reshape(1)
    axis = axis_arg(axis, array.ndim, "gather")
    send, copied = to_front(ctx, array, axis)
    source.copied = source.copied or copied
    length, rest = send.shape[0], send.shape[1:]
    template = tuple(-1 if d == axis else n for d, n in enumerate(array.shape))
    record = Record("gather", None, array.dtype, template, root_at, group.members, per_rank=length, extra=axis)
    datatype = mpi_datatype(array.dtype)
    block = math.prod(rest)
    later, device, is_root = Later(), result_device(ctx, source), root_at == ctx.rank

    def post(lengths: list[int]) -> list[Any]:
        index = group_root(group, root_at, "gather")
        uniform = len(set(lengths)) == 1
        gathered = counts = displs = None
        if is_root:  # gathered along the first axis; the result is a view with the axis moved back
            gathered = ctx.pool.empty((sum(lengths), *rest), array.dtype)
            later.value = Tensor(np.moveaxis(gathered, 0, axis) if axis else gathered, device)
            if not uniform:
                counts = [n * block for n in lengths]
                displs = displacements(counts)
        if uniform:
            return mpi.gather(group, send, gathered, datatype, index)
        return mpi.gatherv(group, send, gathered, counts, displs, datatype, index)

    op = Op("gather", group, send.nbytes, post, lambda: later.value, record=record, keep=(send,),
            protections=protections, exchange=True, compare=ctx.config.check)
    return start(ctx, op, later, source.back)


def _held_general(input: Any, root: Any, devices: DevicesArg, out: Any) -> CollectiveTensor:  # noqa: A002
    """A held gather on a sub-group: the rows gathered into the root's `out`, the input into the others'."""
    ctx = context_for("gather")
    rows = input[None] if type(input) is np.ndarray else input
    return follow(gather(rows, root, devices=devices),
                  lambda gathered: filled(out, input if gathered is None else gathered, ctx.cpu_device))
