"""`reduce`: the root gets the element-wise reduction of every rank's tensor."""

from __future__ import annotations

from typing import Any

from .._core.config import ReduceOperation, parse_op
from .._core.device import Device
from .._core.dtypes import reduce_plan
from .._core.interop import refuse_int_overflow
from .._core.tensor import Tensor
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
from .held import filled, held_call
from .options import (
    finish_scaled,
    make_record,
    output_tensor,
    prescaled_input,
    protect_output,
    reduction_outputs,
    refuse_on_gpu,
    scale_factors,
    scale_options,
)

__all__ = ["reduce"]


def reduce(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    root: int | Device = 0,
    devices: DevicesArg = None,
    out: Any = None,
    prescale_factor: float | None = None,
    postscale_factor: float | None = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start a reduction to the root (``MPI_Ireduce``) and return at once.

    Args:
        input: this rank's tensor (a `Tensor` or NumPy array).
        op: the reduction; None uses the context's ``config.all_reduce_op``.
        root: the rank (in the context, a member of the group) or `Device` that gets
            the result.
        devices: the group; None for every rank of the context.
        out: a host Tensor or NumPy array to write the result into (of the result's
            shape and dtype, writable, C-contiguous, not the input); checked on every
            rank, written on the root only. Not to be written until the handle resolves.
        prescale_factor: multiplies each rank's input before the reduction (into a
            private copy: the input is not changed). Integer tensors take integers only.
        postscale_factor: multiplies the result after the reduction (after MEAN's division).
        held: the caller holds `input` (a host NumPy array) and `out` (a writable array of
            its shape and dtype, not overlapping it, on every rank) until the result is
            resolved: MPI's blocking reduce moves the data once the check agreed (see
            `_collectives/held.py`); off the root `out` gets the input. Not with factors.

    Returns:
        A `CollectiveTensor` resolving to the result on the root (`out` itself when it
        is a Tensor, else a Tensor sharing its memory) and to None elsewhere.

    Raises:
        TypeError: bad input, dtype, factor or `out` dtype.
        ValueError: the root is not a member of the group (raised on every rank), or a
            bad `out` (shape, read-only, not contiguous, overlapping the input).
        CollectiveMismatchError: the ranks disagree on shape, dtype, op, root, factors
            or group.
    """
    if held:
        if prescale_factor is not None or postscale_factor is not None:
            raise TypeError("reduce(held=True) takes no scale factors: scale the input first, or pass held=False")
        return held_call("reduce", input, out, root, op, devices, lambda: _held_general(input, op, root, devices, out))
    ctx = context_for("reduce")
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    source = take_input(input, ctx, "reduce")
    group = ctx.group(devices, "reduce")
    if type(input) is int:
        refuse_int_overflow(input, reduce_op.name, group.size, "reduce")
    root_at = root_rank(ctx, root)
    if source.on_gpu:
        refuse_on_gpu("reduce", out=out)
        handle = staged(ctx, source, group, lambda host, members: reduce(
            host, reduce_op, root=root_at, devices=members, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor))
        return follow(handle, source.back)
    handle = _start(ctx, source, reduce_op, group, root_at, out, (prescale_factor, postscale_factor))
    return follow(handle, source.back)


def _held_general(input: Any, op: Any, root: Any, devices: DevicesArg, out: Any) -> CollectiveTensor:  # noqa: A002
    """A held reduce MPI cannot run as it is (a sub-group, an encoded reduction): into `out`; elsewhere the input."""
    ctx = context_for("reduce")
    if root_rank(ctx, root) == ctx.rank:
        return reduce(input, op, root=root, devices=devices, out=out)
    return follow(reduce(input, op, root=root, devices=devices), lambda _: filled(out, input, ctx.cpu_device))


def _start(ctx: DistributedContext, source: Input, reduce_op: ReduceOperation, group: Group, root_at: int,
           out: Any, factors: tuple[Any, Any]) -> CollectiveTensor:
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    pre, post_factor = scale_factors(*factors, source.buffer.dtype, "reduce")
    is_root = root_at == ctx.rank
    # Checked on every rank, so that a bad out= raises alike everywhere; used on the root only.
    work, final = reduction_outputs(ctx, out, array.shape, plan, "reduce", (array,))
    if not is_root:
        out, work, final = None, None, None
    send, protections = prescaled_input(ctx, source, plan, pre)
    result = output_tensor(out, final, result_device(ctx, source)) if final is not None else None
    datatype, mpi_op, size = plan.datatype, plan.mpi_op, group.size

    def post() -> list[Any]:
        index = group_root(group, root_at, "reduce")
        requests = mpi.reduce(group, send, work, datatype, mpi_op, index)
        protect_output(collective, out, final)
        return requests

    def finish() -> Tensor | None:
        if work is not None:
            finish_scaled(work, final, plan, size, post_factor)
        return result

    options = scale_options(pre, post_factor)
    record = check_record(
        ctx, group, make_record(options, "reduce", reduce_op, array.dtype, array.shape, root_at, group.members)
    )
    collective = Op(
        "reduce", group, array.nbytes, post, finish, record=record, keep=(send, work, final),
        protections=protections,
    )
    return start(ctx, collective, result)
