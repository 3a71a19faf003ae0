"""`all_reduce`: every rank gets the element-wise reduction of every rank's tensor."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan
from .._core.idle import contested
from .._core.interop import refuse_int_overflow
from .._core.limits import HELD_INTO_BYTES, SMALL_BYTES
from .._core.state import open_contexts
from .._core.tensor import Tensor, array_of
from .._runtime.check import shared_record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group
from .._transport.base import HeldBuffers, ReduceCall, select
from .._transport.select import ALL_REDUCE, ALL_REDUCE_CHECKED, HELD_ALL_REDUCE
from .common import PLAIN_DTYPES, CollectiveTensor, Input, check_record, context_for, follow, result_device, take_input
from .fused import fused_all_reduce
from .gpu_host import staged
from .gpu_staged import gpu_all_reduce
from .lane import CopiedInto, held_key, keep_lane, lane_key, start_reduction, written_into
from .native import compiled_held_lane
from .options import make_record, refuse_for_structure, refuse_on_gpu
from .plans import find_plan, keep_plan
from .reduce_options import all_reduce_with_options

__all__ = ["all_reduce", "held_plan_runner"]

# The check's option that tells held calls apart: in place, or into `out`.
_HELD = (("in_place", 1),)
_HELD_INTO = (("in_place", 0),)


def all_reduce(
    input: Any,  # noqa: A002 - the seed's name
    op: ReduceOperation | str | None = None,
    devices: DevicesArg = None,
    *,
    out: Any = None,
    prescale_factor: Any = None,
    postscale_factor: Any = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start an all-reduce (``MPI_Iallreduce``) and return at once.

    Every rank of the group gets the element-wise reduction of all the ranks' tensors, in
    a fresh tensor on the input's device. A list, tuple or dict of tensors is all-reduced
    as one fused operation (see `DistributedConfig.bucket_bytes`), and the result has the
    same structure.

    Args:
        input: a `Tensor` or NumPy array (or a list/tuple/dict of them). It must not be
            written until the result is resolved (writes raise `TensorInFlightError`).
        op: the reduction; None uses the context's ``config.all_reduce_op``. ``MEAN`` of
            integers gives float64.
        devices: the group (devices from ``ctx.devices``, or their ranks); None for every
            rank of the context.
        out: a host Tensor or NumPy array to write the result into (not for a list).
        prescale_factor, postscale_factor: multiply each rank's input before, and the
            result after, the reduction (Horovod's semantics; integers take integer factors).
        held: the caller holds `input` (a host NumPy array) and `out` until the result is
            resolved: nobody writes the input or reads `out` meanwhile (torch's contract for
            a collective's tensors; XLA's buffers inside a compiled program). MPI then reads
            the input where it is, neither protected nor copied, and the result lands in
            `out`, or in the input itself when `out` is None (in place). Once the check has
            agreed, the data moves in MPI's blocking all-reduce. Not with scale factors.

    Returns:
        A `CollectiveTensor`; its `resolve()` gives the result.

    Raises:
        TypeError: `input` is not a tensor or array, or its dtype cannot be reduced.
        ValueError: bad `op` or `devices`; a held call's `out` of another shape or dtype, or
            overlapping the input.
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
        NoContextError, ContextClosedError, ContextBrokenError: no usable context.
    """
    if held:
        if prescale_factor is not None or postscale_factor is not None:
            raise TypeError("all_reduce(held=True) takes no scale factors: scale the input first, or pass held=False")
        return _held(input, op, devices, out)
    kind = type(input)
    if kind is not np.ndarray and kind is not Tensor and isinstance(input, (list, tuple, dict)):
        refuse_for_structure("all_reduce", out=out)
        return fused_all_reduce(context_for("all_reduce"), input, op, devices,
                                factors=(prescale_factor, postscale_factor))
    ctx, source, group = _take(input, devices)
    if source.back is not None:  # another library's tensor: reduce its array, give the result back
        if kind is int:
            refuse_int_overflow(input, (ctx.config.all_reduce_op if op is None else parse_op(op)).name,
                                group.size, "all_reduce")
        return follow(all_reduce(source.buffer, op, devices, out=out, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor), source.back)
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    if source.on_gpu:
        return _on_gpu(ctx, source, group, reduce_op, out, (prescale_factor, postscale_factor))
    if out is not None or prescale_factor is not None or postscale_factor is not None:
        return all_reduce_with_options(ctx, source, group, reduce_op, out, (prescale_factor, postscale_factor))
    call = ReduceCall(ctx, group, source, reduce_plan(reduce_op, source.buffer.dtype), source.array.nbytes)
    checked = ctx.config.check and group.size > 1
    select(ALL_REDUCE_CHECKED if checked else ALL_REDUCE, call).prepare(call)
    record = shared_record("all_reduce", reduce_op, source.array, group.members) if checked else None
    handle = start_reduction(call, record, result_device(ctx, source))
    if devices is None and source.buffer is source.array and (source.array is input or source.tensor is input):
        keep_lane(call, op, record)  # later calls of this kind skip the planning above
    return handle


def _held(array: Any, op: ReduceOperation | str | None, devices: DevicesArg, out: Any) -> CollectiveTensor:
    """`all_reduce(array, op, devices, out=out, held=True)`: the input and `out` are the caller's until resolved.

    Where the call can be held (`_holdable`) MPI reduces the caller's buffers once the check
    agreed (`select.HELD_ALL_REDUCE`), and the call keeps its plan (with its compiled held
    lane) for later calls of its kind. Otherwise the call is an ordinary all-reduce whose
    result is written into the caller's buffer when it resolves: into `out` below
    `HELD_INTO_BYTES` (the lane's fresh result copied in), or on the general path's ``out=``,
    in place through a copy back. The check tells held calls from ordinary ones, and in-place
    calls from calls into `out` (option ``in_place`` 1 or 0), so ranks that disagree get
    `CollectiveMismatchError`, never two algorithms.

    Raises:
        TypeError: `array` is not a host NumPy array, or an in-place result of another dtype.
        ValueError: `out` is not of the input's shape and dtype, overlaps it, or (in place)
            the input is read-only.
    """
    ctx = context_for("all_reduce")
    into = out is not None and out is not array
    _check_held_buffers(array, out if into else None)
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    plan = reduce_plan(reduce_op, array.dtype)
    holdable = _holdable(array, plan, into)
    if into and not holdable:
        return all_reduce(array, reduce_op, devices, out=out)
    if not holdable or (into and array.nbytes < HELD_INTO_BYTES):
        if plan.out_dtype != array.dtype:
            raise TypeError(f"all_reduce(held=True): {reduce_op.name} of {array.dtype} gives {plan.out_dtype}, which "
                            f"cannot be written into the input; pass out= a separate array, or held=False")
        return _copied(ctx, array, op, devices, out if into else array, into)
    group = ctx.full_group if devices is None else ctx.group(devices, "all_reduce")
    call = ReduceCall(ctx, group, HeldBuffers(array, out if into else array), plan, array.nbytes)
    select(HELD_ALL_REDUCE, call).prepare(call)
    # In a group of 2 the check says whether this rank's core is contested (`held_all_reduce`).
    pair = group.size == 2
    record = check_record(ctx, group, make_record(_HELD_INTO if into else _HELD, "all_reduce", reduce_op, array.dtype,
                                                   array.shape, -1, group.members, per_rank=int(pair and contested())))
    handle = start_reduction(call, record, ctx.cpu_device, exchange=pair and record is not None)
    key = held_key(array, op, into)
    if devices is None and find_plan(ctx, key) is None:
        keep_plan(ctx, key, compiled_held_lane(ctx, ctx.full_group, op, array, plan, record, into))
    return handle


def _copied(ctx: DistributedContext, array: np.ndarray, op: Any, devices: DevicesArg, target: np.ndarray,
            into: bool) -> CollectiveTensor:
    """A held call that an ordinary all-reduce serves, its result copied into `target` when it resolves.

    Once the ordinary call has kept its lane, the held calls of this kind keep a plan of that
    lane and the copy (`CopiedInto`), which later calls start on before the entry.
    """
    handle = follow(all_reduce(array, op, devices), partial(written_into, target))
    if devices is None:
        key = held_key(array, op, into)
        lane = find_plan(ctx, lane_key(array, op))
        if lane is not None and find_plan(ctx, key) is None:
            keep_plan(ctx, key, CopiedInto(lane))
    return handle


def held_plan_runner(ctx: DistributedContext, array: np.ndarray, out: np.ndarray, op: Any) -> Any:
    """The compiled ``run(array, out)`` of held all-reduces of `array`'s kind into another array on `ctx`, or None.

    The kept plan's own: MPI's from the input into `out` (the held lane's ``run_held``), or
    below `HELD_INTO_BYTES` the lane's result copied into `out` (its ``run_into``).
    """
    plan = find_plan(ctx, held_key(array, op, True))
    if isinstance(plan, CopiedInto):
        compiled = plan.lane.compiled
        return None if compiled is None else compiled.run_into
    return None if plan is None else plan.run_held


def _holdable(array: Any, plan: Any, into: bool) -> bool:
    """Whether `array` can be reduced as it is: contiguous, native, its result dtype (in place: large, writable)."""
    return (
        array.flags.c_contiguous and array.dtype in PLAIN_DTYPES
        and array.dtype.kind != "b" and plan.codec is None and plan.work_dtype == array.dtype == plan.out_dtype
        and (into or (array.nbytes > SMALL_BYTES and array.flags.writeable))
    )


def _check_held_buffers(array: Any, out: Any) -> None:
    """Refuse buffers a held all-reduce cannot take: not NumPy, or an `out` it cannot write.

    Raises:
        TypeError: `array` is not a host NumPy array.
        ValueError: `out` (when given) is not a writable contiguous NumPy array of the input's
            shape and dtype, or overlaps the input; or (in place) the input is read-only.
    """
    if type(array) is not np.ndarray:
        raise TypeError(f"all_reduce(held=True) takes a host NumPy array its caller holds, got {type(array).__name__}; "
                        "pass held=False for other inputs")
    if out is None:
        if not array.flags.writeable:
            raise ValueError("all_reduce(held=True): the input is read-only, so it cannot be reduced in place; pass "
                             "out= a writable array")
        return
    if (type(out) is not np.ndarray or out.shape != array.shape or out.dtype != array.dtype
            or not out.flags.c_contiguous or not out.flags.writeable):
        got = f"{type(out).__name__} {getattr(out, 'dtype', '?')}{list(getattr(out, 'shape', ()))}"
        raise ValueError(f"all_reduce(held=True): out must be a writable contiguous NumPy array of the input's "
                         f"{array.dtype}{list(array.shape)}, got {got}")
    if np.shares_memory(array, out):
        raise ValueError("all_reduce(held=True): out overlaps the input; pass out=None to reduce the input in place")


def _take(input: Any, devices: DevicesArg) -> tuple[DistributedContext, Input, Group]:  # noqa: A002
    """The context, the input made ready for MPI, and the group.

    A contiguous host array of a plain dtype (alone or in a `Tensor`) is used as it is,
    without `take_input`'s checks: at 8 bytes, per-call overhead is the whole cost.
    """
    ctx = open_contexts[-1] if open_contexts else context_for("all_reduce")
    if not ctx.usable:
        ctx.ensure_usable()
    kind = type(input)
    array = input if kind is np.ndarray else array_of(input) if kind is Tensor else None
    if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype in PLAIN_DTYPES:
        source = Input(input if kind is Tensor else None, array, array, False)
    else:
        source = take_input(input, ctx, "all_reduce")
    group = ctx.full_group if devices is None else ctx.group(devices, "all_reduce")
    return ctx, source, group


def _on_gpu(ctx: DistributedContext, source: Input, group: Group, reduce_op: ReduceOperation, out: Any,
            factors: tuple[Any, Any]) -> CollectiveTensor:
    """A CuPy input: the GPU all-reduce, or with scale factors the host one on a staged copy.

    Raises:
        TypeError: `out` is given (not supported for GPU tensors yet).
    """
    refuse_on_gpu("all_reduce", out=out)
    if factors == (None, None):
        return gpu_all_reduce(ctx, source, reduce_op, group)
    pre, post = factors
    return staged(ctx, source, group, lambda host, members: all_reduce(
        host, reduce_op, members, prescale_factor=pre, postscale_factor=post))
