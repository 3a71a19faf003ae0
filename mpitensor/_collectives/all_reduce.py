"""`all_reduce`: every rank gets the element-wise reduction of every rank's tensor."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan
from .._core.interop import refuse_int_overflow
from .._core.state import open_contexts
from .._core.tensor import Tensor, array_of
from .._runtime.check import shared_record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group
from .._runtime.entry import collective_entry
from .._runtime.ordering import wait_for_compiled
from .._transport.base import HeldBuffers, ReduceCall, select
from .._transport.mpi import SMALL_BYTES
from .._transport.select import ALL_REDUCE, ALL_REDUCE_CHECKED, HELD_ALL_REDUCE
from .common import PLAIN_DTYPES, CollectiveTensor, Input, check_record, context_for, follow, result_device, take_input
from .fused import fused_all_reduce
from .gpu_host import staged
from .gpu_staged import gpu_all_reduce
from .lane import keep_lane, start_reduction
from .native import compiled_held_lane
from .options import make_record, refuse_for_structure, refuse_on_gpu
from .reduce_options import all_reduce_with_options

__all__ = ["HELD_LANES", "SMALL_BYTES", "all_reduce", "all_reduce_held", "held_lane"]

# The check's option that tells `all_reduce_held`'s calls apart: in place, or into `out`.
_HELD = (("in_place", 1),)
_HELD_INTO = (("in_place", 0),)
# Where `all_reduce_held`'s compiled lanes are kept (the full group's extra state), by
# (dtype, shape, op argument, into): None for a kind that has none.
HELD_LANES = "all_reduce_held lanes"
_MAX_HELD_LANES = 256


def all_reduce(
    input: Any,  # noqa: A002 - the seed's name
    op: ReduceOperation | str | None = None,
    devices: DevicesArg = None,
    *,
    out: Any = None,
    prescale_factor: Any = None,
    postscale_factor: Any = None,
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

    Returns:
        A `CollectiveTensor`; its `resolve()` gives the result.

    Raises:
        TypeError: `input` is not a tensor or array, or its dtype cannot be reduced.
        ValueError: bad `op` or `devices`.
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
        NoContextError, ContextClosedError, ContextBrokenError: no usable context.
    """
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


def _all_reduce_held(array: np.ndarray, op: ReduceOperation | str | None = None,
                     devices: DevicesArg = None, *, out: np.ndarray | None = None) -> CollectiveTensor:
    """`all_reduce_held` behind its entry: the general path, and the first call of each kind."""
    ctx = context_for("all_reduce")
    into = out is not None and out is not array
    if into:
        _check_held_out(array, out)
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    plan = reduce_plan(reduce_op, array.dtype)
    if not _holdable(array, plan, into):
        return all_reduce(array, reduce_op, devices, out=out if into else None)
    group = ctx.full_group if devices is None else ctx.group(devices, "all_reduce")
    call = ReduceCall(ctx, group, HeldBuffers(array, out if into else array), plan, array.nbytes)
    select(HELD_ALL_REDUCE, call).prepare(call)
    record = check_record(ctx, group, make_record(_HELD_INTO if into else _HELD, "all_reduce", reduce_op, array.dtype,
                                                   array.shape, -1, group.members))
    handle = start_reduction(call, record, ctx.cpu_device)
    key = (array.dtype, array.shape, op, into)
    if devices is None and key not in ctx.full_group.extra.get(HELD_LANES, ()):
        _keep_held_lane(ctx, key, op, array, plan, record, into)
    return handle


# Called as the public collectives are: behind their entry.
_held_entry = collective_entry("all_reduce")(_all_reduce_held)


def all_reduce_held(array: np.ndarray, op: ReduceOperation | str | None = None,
                    devices: DevicesArg = None, *, out: np.ndarray | None = None) -> CollectiveTensor:
    """`all_reduce` of a host array that its caller keeps unchanged until the result is resolved.

    For callers that hold the input themselves (the torch backend: in torch's contract a
    tensor handed to a collective is not touched until its work is waited for; XLA's buffers
    inside a compiled program). The array is read where it is, neither write-protected nor
    copied, and MPI reduces it in place, or into `out` (`select.HELD_ALL_REDUCE`: blocking,
    once the check has agreed). The consistency check tells its calls from `all_reduce`'s,
    and in-place calls from calls into `out` (option ``in_place`` 1 or 0: MPI takes
    ``MPI_IN_PLACE`` from every rank or from none), so ranks that disagree get
    `CollectiveMismatchError`, not two algorithms.
    Inputs it cannot reduce this way take `all_reduce` (with `out`): bool, MAX/MIN of
    floats, a result of another dtype, not contiguous or not native; in place also up to
    `SMALL_BYTES` (the lanes are faster there) and read-only arrays.

    Args:
        array: a host NumPy array, not written (by anyone) until the result is resolved.
        op: the reduction, as `all_reduce`'s.
        devices: the group, as `all_reduce`'s.
        out: None (or `array`) to reduce in place; else a writable contiguous array of the
            input's shape and dtype, not overlapping it, that nobody reads until the result
            is resolved.

    Returns:
        A `CollectiveTensor` whose result is the array (reduced) or `out`, or for an input
        it cannot take this way, `all_reduce`'s.

    Raises:
        ValueError: `out` is not of the input's shape and dtype, or overlaps it.
        As `all_reduce` otherwise.
    """
    if devices is None and open_contexts:
        # A kind of call seen before on the full group goes to its compiled lane as the C
        # entry of `all_reduce` sends calls to theirs: after the wait for compiled programs,
        # with no Python entry around it (inside jax.jit, where the caches are cold after
        # JAX's dispatch, that entry cost 7-8 us per call). The lane checks the thread, the
        # context and both arrays, and declines what the general path must take.
        into = out is not None and out is not array
        lane = held_lane(open_contexts[-1], array, op, into)
        if lane is not None:
            wait_for_compiled()
            handle = lane.start_held(array, out if into else array)
            if handle is not None:
                return handle
    return _held_entry(array, op, devices, out=out)


def held_lane(ctx: DistributedContext, array: np.ndarray, op: Any, into: bool) -> Any:
    """The compiled lane of `all_reduce_held`'s calls of `array`'s kind on `ctx`'s full group, or None.

    Its ``start_held(array, out)`` and ``run_held(array, out)`` (native/lane.c) check each call and
    decline what the general path must take.

    Args:
        ctx: an open context.
        array: an input of the kind (dtype and shape).
        op: the op argument as the calls give it.
        into: whether the calls reduce into `out` (else in place).
    """
    lanes = ctx.full_group.extra.get(HELD_LANES)
    return None if lanes is None else lanes.get((array.dtype, array.shape, op, into))


def _keep_held_lane(ctx: DistributedContext, key: tuple[Any, ...], op: Any, array: np.ndarray, plan: Any,
                    record: Any, into: bool) -> None:
    """Keep the compiled lane of `all_reduce_held`'s calls of kind `key`, or None where it has none.

    Kept in the full group's extra state (freed with it), at most `_MAX_HELD_LANES` kinds.
    """
    lanes = ctx.full_group.extra.setdefault(HELD_LANES, {})
    if len(lanes) >= _MAX_HELD_LANES:
        lanes.clear()
    lanes[key] = compiled_held_lane(ctx, ctx.full_group, op, array, plan, record, into)


def _holdable(array: Any, plan: Any, into: bool) -> bool:
    """Whether `array` can be reduced as it is: contiguous, native, its result dtype (in place: large, writable)."""
    return (
        type(array) is np.ndarray and array.flags.c_contiguous and array.dtype in PLAIN_DTYPES
        and array.dtype.kind != "b" and plan.codec is None and plan.work_dtype == array.dtype == plan.out_dtype
        and (into or (array.nbytes > SMALL_BYTES and array.flags.writeable))
    )


def _check_held_out(array: np.ndarray, out: Any) -> None:
    """Refuse an `out` that `all_reduce_held` cannot write the result of `array` into.

    Raises:
        ValueError: not a writable contiguous NumPy array of the input's shape and dtype, or
            overlapping the input.
    """
    if (type(out) is not np.ndarray or out.shape != array.shape or out.dtype != array.dtype
            or not out.flags.c_contiguous or not out.flags.writeable):
        got = f"{type(out).__name__} {getattr(out, 'dtype', '?')}{list(getattr(out, 'shape', ()))}"
        raise ValueError(f"all_reduce_held: out must be a writable contiguous NumPy array of the input's "
                         f"{array.dtype}{list(array.shape)}, got {got}")
    if np.shares_memory(array, out):
        raise ValueError("all_reduce_held: out overlaps the input; pass out=None to reduce the input in place")


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
