"""`all_reduce`: every rank gets the element-wise reduction of every rank's tensor."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.device import Device
from .._core.dtypes import ReducePlan, reduce_plan
from .._core.mpi import MPI
from .._core.state import open_contexts
from .._core.tensor import Tensor, wrap_array
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport.shm import SharedMemoryPost, may_apply, shared_memory_post
from .common import (
    PLAIN_DTYPES,
    CollectiveTensor,
    Input,
    context_for,
    finish_reduction,
    follow,
    reduction_buffers,
    reduction_input,
    result_device,
    start,
    take_input,
)

__all__ = ["SMALL_BYTES", "all_reduce"]

# Up to this size a copy of the input costs less than write-protecting it in flight.
SMALL_BYTES = 16 << 10


def all_reduce(input: Any, op: ReduceOperation | str | None = None, devices: DevicesArg = None) -> CollectiveTensor:  # noqa: A002 - the seed's name
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

    Returns:
        A `CollectiveTensor`; its `resolve()` gives the result.

    Raises:
        TypeError: `input` is not a tensor or array, or its dtype cannot be reduced.
        ValueError: bad `op` or `devices`.
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
        NoContextError, ContextClosedError, ContextBrokenError: no usable context.
    """
    # The common small call (a contiguous host array or tensor, every rank, a usable
    # context) goes straight to `_small`: at 8 bytes, per-call overhead is the whole cost.
    # A Tensor's `_array` and `_device` are read here directly, not through a property
    # or an accessor function: this path costs a few microseconds, and either would add
    # a call to it.
    kind = type(input)
    if open_contexts and devices is None and (kind is np.ndarray or kind is Tensor):
        ctx = open_contexts[-1]
        array = input if kind is np.ndarray else input._array
        if type(array) is np.ndarray and array.flags.c_contiguous and ctx.usable:
            device = ctx.cpu_device if kind is np.ndarray else input._device
            nbytes = array.nbytes
            if nbytes <= SMALL_BYTES:
                plan = reduce_plan(ctx.config.all_reduce_op if op is None else parse_op(op), array.dtype)
                if not plan.rounds_back:
                    return _small(ctx, array, device, op, plan, ctx.full_group)
            elif array.dtype in PLAIN_DTYPES and not (ctx.config.check and ctx.full_group.size > 1):
                # Larger, unchecked, and too small for (or barred from) shared memory:
                # nothing to agree on or to step through, so it too is posted at once.
                plan = reduce_plan(ctx.config.all_reduce_op if op is None else parse_op(op), array.dtype)
                if plan.work_dtype == array.dtype and not may_apply(ctx.config, nbytes):
                    tensor = input if kind is Tensor else None
                    out = ctx.pool.empty(array.shape, plan.work_dtype)
                    if plan.codec is not None:  # MAX/MIN of floats: MPI reduces a private copy of keys
                        send = ctx.pool.empty(array.shape, plan.work_dtype)
                        plan.codec.encode(array, send)
                        return _post_now(ctx, ctx.full_group, send, (), out, out, plan, device, nbytes)
                    source = Input(tensor, array, array, False)
                    protections = source.guard(ctx)  # may swap in a private copy
                    return _post_now(ctx, ctx.full_group, source.buffer, protections, out, out, plan, device, nbytes)
    ctx = context_for("all_reduce")
    if isinstance(input, (list, tuple, dict)):
        from .fused import fused_all_reduce

        return fused_all_reduce(ctx, input, op, devices)
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    source = take_input(input, ctx, "all_reduce")
    if source.back is not None:  # another library's tensor: reduce its array, give the result back
        return follow(all_reduce(source.buffer, op, devices), source.back)
    group = ctx.full_group if devices is None else ctx.group(devices, "all_reduce")
    if source.on_gpu:
        from .gpu_staged import gpu_all_reduce

        return gpu_all_reduce(ctx, source, reduce_op, group)
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    if array.nbytes <= SMALL_BYTES and not plan.rounds_back:
        return _small(ctx, source.buffer, result_device(ctx, source), reduce_op, plan, group)
    if plan.codec is None:
        send, protections = reduction_input(ctx, source, plan)
        fast = shared_memory_post(ctx, group, send, plan)  # the intra-node fast path, or None
    else:
        send, protections, fast = _extremum_input(ctx, source, plan, group)
    checked = ctx.config.check and group.size > 1
    if fast is None:
        out, final = reduction_buffers(ctx, array.shape, plan)
        if not checked:
            # Nothing to agree on first: post at once, as the small path does.
            device = result_device(ctx, source)
            return _post_now(ctx, group, send, protections, out, final, plan, device, array.nbytes)
    else:
        out = fast.out
        final = ctx.pool.empty(array.shape, plan.out_dtype) if plan.rounds_back else out
    result = wrap_array(final, result_device(ctx, source))
    comm, datatype, mpi_op = group.comm, plan.datatype, plan.mpi_op
    size = group.size
    # The shared-memory path reduces MAX/MIN of floats on the floats: nothing to decode.
    decoded = fast is not None and plan.codec is not None

    def post() -> list[Any]:
        return [comm.Iallreduce([send, datatype], [out, datatype], mpi_op)]

    def finish() -> Tensor:
        if not decoded:
            finish_reduction(out, final, plan, size)
        return result

    record = Record("all_reduce", reduce_op, array.dtype, array.shape, -1, group.members) if checked else None
    collective = Op(
        "all_reduce",
        group,
        array.nbytes,
        post if fast is None else fast.post,
        finish,
        record=record,
        keep=(send, out, final),
        protections=protections,
    )
    return start(ctx, collective, result)


def _extremum_input(
    ctx: DistributedContext, source: Input, plan: ReducePlan, group: Group
) -> tuple[np.ndarray, tuple[Any, ...], SharedMemoryPost | None]:
    """What a MAX/MIN with a codec sends, its protections, and the shared-memory path if it applies.

    The shared-memory path reduces the floats themselves (with ``plan.combine``), so it
    gets the input as it is, protected; MPI gets a private encoded copy (``plan.codec``).
    """
    if may_apply(ctx.config, source.array.nbytes):
        protections = source.guard(ctx)  # may swap in a private copy: read the buffer after it
        fast = shared_memory_post(ctx, group, source.buffer, plan)
        if fast is not None:
            return source.buffer, protections, fast
        for protection in protections:
            protection.release()
    send, protections = reduction_input(ctx, source, plan)
    return send, protections, None


def _post_now(ctx: DistributedContext, group: Group, send: np.ndarray, protections: tuple[Any, ...],
              out: np.ndarray, final: np.ndarray, plan: ReducePlan, device: Device, nbytes: int) -> CollectiveTensor:
    """Post an unchecked ``MPI_Iallreduce`` of `send` into `out` at once, bypassing the engine's queue.

    `send` is protected by `protections` (or is a private copy) until MPI is done; the
    result is `final` (`out` itself, or the half-precision array it is rounded back into).
    For MAX/MIN of floats, `send` holds keys (``plan.codec``), and `out` is decoded at the end.
    """
    finishes = plan.divide or final is not out or plan.codec is not None
    finish = partial(finish_reduction, out, final, plan, group.size) if finishes else None
    op = Op("all_reduce", group, nbytes, None, finish, None, (send, out, final), protections)
    datatype = plan.datatype
    ctx.engine.post_direct(op, group.comm.Iallreduce, [send, datatype], [out, datatype], plan.mpi_op)
    return CollectiveTensor(op, wrap_array(final, device), ctx)


def _small(ctx: DistributedContext, array: np.ndarray, device: Device, op: ReduceOperation | str | None,
           plan: ReducePlan, group: Group) -> CollectiveTensor:
    """A small all-reduce: the input is copied (cheaper than protecting it) and reduced in place.

    Small messages are where per-call overhead shows, so an unchecked one whose group has
    nothing queued is posted here directly, without the engine's general path.
    """
    codec = plan.codec
    if codec is None:
        out = array.astype(plan.work_dtype)  # always a copy
        finish = partial(np.true_divide, out, group.size, out=out) if plan.divide else None
    else:
        # MAX/MIN of floats: MPI reduces keys, decoded in place at the end.
        if array.dtype == plan.work_dtype:
            out = np.empty(array.shape, plan.work_dtype)
            codec.encode(array, out)
        else:  # byte-swapped: to native order first
            out = array.astype(plan.work_dtype)
            codec.encode(out, out)
        finish = partial(codec.decode, out)
    result = wrap_array(out, device)
    comm, datatype, mpi_op, size = group.comm, plan.datatype, plan.mpi_op, group.size
    if ctx.config.check and size > 1:
        reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
        record = Record("all_reduce", reduce_op, array.dtype, array.shape, -1, group.members)

        def post() -> list[Any]:
            return [comm.Iallreduce(MPI.IN_PLACE, [out, datatype], mpi_op)]

        return start(ctx, Op("all_reduce", group, array.nbytes, post, finish, record=record, keep=(out,)), result)
    op = Op("all_reduce", group, array.nbytes, None, finish, None, (out,))
    ctx.engine.post_direct(op, comm.Iallreduce, MPI.IN_PLACE, [out, datatype], mpi_op)
    return CollectiveTensor(op, result, ctx)
