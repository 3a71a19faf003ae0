"""`all_gather`: every rank gets all the ranks' tensors, concatenated along an axis."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._core.dtypes import mpi_datatype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import CollectiveTensor, Later, context_for, follow, result_device, start, take_input
from .gpu_host import staged
from .grouped import grouped_all_gather, is_structure
from .held import held_call
from .layout import displacements, to_front
from .options import axis_arg, output_buffer, output_tensor, protect_output, refuse_on_gpu

__all__ = ["all_gather"]


def all_gather(
    input: Any,  # noqa: A002 - the name every collective uses
    *,
    axis: int = 0,
    devices: DevicesArg = None,
    out: Any = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start an all-gather and return at once; every rank gets the concatenation.

    Ranks may differ in the length of `axis` (``MPI_Iallgatherv`` then runs instead of
    ``MPI_Iallgather``); every other dimension must agree. A 0-d tensor counts as one
    element. A list, tuple or dict of tensors is gathered as one fused call.

    Args:
        input: this rank's tensor (a `Tensor` or NumPy array).
        axis: the axis to concatenate along (negative counts from the end).
        devices: the group; None for every rank of the context.
        out: a host Tensor or NumPy array to write the result into (a wrong length
            along `axis` is raised at resolve); see docs/options.md.
        held: the caller holds `input` (a host NumPy array) and `out` until the result is
            resolved: MPI's blocking call moves the data between them once the check agreed
            (see `_collectives/held.py`); `out` is then a writable array of the input's
            dtype and the group's size times its size (rank k's input its k-th part), not
            overlapping the input.

    Returns:
        A `CollectiveTensor` resolving to the concatenated tensor, in group order.

    Raises:
        TypeError: bad input, dtype or `out` dtype.
        ValueError: `axis` is out of range, or a bad `out`.
        CollectiveMismatchError: the ranks disagree on dtype, the other dimensions,
            axis or group.
    """
    if held:
        return held_call("all_gather", input, out, -1, None, devices,
                         lambda: all_gather(input, axis=axis, devices=devices, out=out))
    ctx = context_for("all_gather")
    if is_structure(input):
        return grouped_all_gather(ctx, input, axis, devices, out)
    source = take_input(input, ctx, "all_gather")
    group = ctx.group(devices, "all_gather")
    if source.on_gpu:
        refuse_on_gpu("all_gather", out=out)
        handle = staged(ctx, source, group, lambda host, members: all_gather(host, axis=axis, devices=members))
        return follow(handle, source.back)
    protections = source.guard(ctx)
    array = source.buffer if source.buffer.ndim else source.buffer.reshape(1)
    axis = axis_arg(axis, array.ndim, "all_gather")
    if out is not None:
        _check_out(ctx, out, array, axis, source.array)
    send, copied = to_front(ctx, array, axis)
    source.copied = source.copied or copied
    template = list(array.shape)
    template[axis] = -1
    record = Record("all_gather", None, array.dtype, tuple(template), -1, group.members, per_rank=send.shape[0],
                    extra=axis)
    gather = _Gather(ctx, group, send, axis, out, result_device(ctx, source))
    op = Op("all_gather", group, send.nbytes, gather.post, gather.finish, record=record, keep=(send,),
            protections=protections, exchange=True, compare=ctx.config.check)
    gather.op = op
    return follow(start(ctx, op, gather.later), source.back)


def _check_out(ctx: DistributedContext, out: Any, array: np.ndarray, axis: int, given_input: Any) -> None:
    """Check everything of `out` but its length along `axis`, which comes from the peers."""
    shape = list(array.shape)
    given = tuple(getattr(out, "shape", ()))
    shape[axis] = given[axis] if len(given) == array.ndim else -1
    output_buffer(ctx, out, tuple(shape), array.dtype, "all_gather", (given_input, array))


class _Gather:
    """Posts the gather once every rank's length is known, into `out` where it fits.

    A wrong length of `out` is found only then: the data is still received (elsewhere),
    so the peers are not left waiting, and the error is raised when the op finishes.
    Along an axis other than the first, the data is gathered rank after rank and copied
    into `out` at the end.
    """

    def __init__(self, ctx: DistributedContext, group: Group, send: np.ndarray, axis: int, out: Any,
                 device: Any) -> None:
        self.ctx, self.group, self.send, self.axis, self.out, self.device = ctx, group, send, axis, out, device
        self.later = Later()
        self.op: Op | None = None
        self.error: Exception | None = None
        self.gathered: np.ndarray | None = None

    def post(self, lengths: list[int]) -> list[Any]:
        send, axis, out = self.send, self.axis, self.out
        rest = send.shape[1:]
        shape = (sum(lengths), *rest)
        target = None if out is None else (out.array if isinstance(out, Tensor) else out)
        final_shape = np.moveaxis(np.empty(shape, np.int8), 0, axis).shape if axis else shape
        if target is not None and target.shape != final_shape:
            self.error = ValueError(
                f"all_gather: out= has shape {target.shape}, but the result has shape {final_shape}"
            )
            target = None
        if target is not None and not axis:
            gathered = target
        else:
            gathered = self.ctx.pool.empty(shape, send.dtype)
        self.gathered = gathered
        if target is not None:
            self.later.value = output_tensor(out, target, self.device)
        else:  # the result is a view with the gathered axis moved back
            self.later.value = Tensor(np.moveaxis(gathered, 0, axis) if axis else gathered, self.device)
        datatype = mpi_datatype(send.dtype)
        if len(set(lengths)) == 1:
            requests = mpi.all_gather(self.group, send, gathered, datatype)
        else:
            block = math.prod(rest)
            counts = [n * block for n in lengths]
            offsets = displacements(counts)
            requests = mpi.all_gatherv(self.group, send, gathered, counts, offsets, datatype)
        if target is not None:
            assert self.op is not None
            protect_output(self.op, out, target)
        return requests

    def finish(self) -> Any:
        if self.error is not None:
            raise self.error
        result = self.later.value
        if self.axis and self.out is not None:
            assert self.gathered is not None
            np.copyto(result.array, np.moveaxis(self.gathered, 0, self.axis))
        return result
