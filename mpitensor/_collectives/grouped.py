"""Grouped `all_gather`, `reduce_scatter` and `broadcast`: many tensors in one call.

A list, tuple or dict of tensors is packed into one buffer per dtype (per reduce plan for
`reduce_scatter`) and moved with one MPI call per buffer, as the fused all-reduce does;
the result has the input's structure. Every rank passes the same structure: the same
keys, shapes and dtypes (the check compares a hash of them and, on a mismatch, names the
first entry that differs).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from .._core.config import ReduceOperation
from .._core.dtypes import reduce_plan
from .._core.interop import structure_back
from .._core.tensor import wrap_array
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import Input, check_record, follow, group_root, root_rank, start, take_input
from .fused import describe_entries, flatten, plan_buckets, rebuild, structure_hash
from .options import (
    axis_arg,
    finish_scaled,
    make_record,
    refuse_for_structure,
    scale_factors,
    scale_options,
    split_first_axis,
)

__all__ = ["grouped_all_gather", "grouped_broadcast", "grouped_reduce_scatter", "is_structure"]


def is_structure(value: Any) -> bool:
    """True for the containers a grouped call takes: a list, tuple or dict."""
    return isinstance(value, (list, tuple, dict))


def _leaves(ctx: DistributedContext, structure: Any, what: str, unsupported: dict[str, Any]) -> tuple[
        list[Any], list[Input], Any]:
    """The keys and the inputs of a structure's leaves, and the converter back of the result.

    Leaves of other libraries (torch, JAX, numbers) come back in their own kind.

    Raises:
        TypeError: an option grouped calls do not take, a leaf that is not a host
            tensor or array.
    """
    refuse_for_structure(what, **unsupported)
    keys, values = flatten(structure)
    inputs = [take_input(value, ctx, what, f"every tensor of the {type(structure).__name__}") for value in values]
    if any(item.on_gpu for item in inputs):
        raise TypeError(f"{what}: grouped calls take host tensors only; pass GPU tensors one at a time")
    return keys, inputs, structure_back(keys, [item.back for item in inputs], type(structure))


def _record(ctx: DistributedContext, kind: str, op: ReduceOperation | None, root: int, group: Group,
            keys: list[Any], buffers: list[np.ndarray], options: tuple[tuple[str, Any], ...] = ()) -> Record | None:
    checked = ctx.config.check and group.size > 1
    record = make_record(options, kind, op, None, (len(buffers), sum(b.size for b in buffers)), root, group.members,
                         extra=structure_hash(keys, buffers) if checked else 0)
    record.entries = partial(describe_entries, keys, buffers)
    return check_record(ctx, group, record)


def _by_dtype(buffers: Sequence[np.ndarray]) -> dict[np.dtype, list[int]]:
    groups: dict[np.dtype, list[int]] = {}
    for index, buffer in enumerate(buffers):
        groups.setdefault(buffer.dtype, []).append(index)
    return groups


def _pack(ctx: DistributedContext, buffers: Sequence[np.ndarray], members: list[int], dtype: np.dtype) -> np.ndarray:
    packed = ctx.pool.empty((sum(buffers[i].size for i in members),), dtype)
    if members:
        np.concatenate([buffers[i] for i in members], axis=None, out=packed, casting="unsafe")
    return packed


def grouped_all_gather(ctx: DistributedContext, structure: Any, axis: Any, devices: DevicesArg,
                       out: Any) -> Any:
    """All-gather every tensor of `structure` along `axis`, one ``MPI_Iallgather`` per dtype.

    Every rank passes tensors of the same shapes (unequal lengths are for single tensors).

    Returns:
        A `CollectiveTensor` resolving to the same structure of gathered tensors.

    Raises:
        TypeError: a bad leaf, `out=`, or `axis` not an int.
        ValueError: `axis` out of range for some tensor.
    """
    keys, inputs, back = _leaves(ctx, structure, "all_gather", {"out": out})
    group = ctx.group(devices, "all_gather")
    buffers = [item.buffer if item.buffer.ndim else item.buffer.reshape(1) for item in inputs]
    axes = [axis_arg(axis, buffer.ndim, "all_gather") for buffer in buffers]
    n = group.size
    results = []
    for item, buffer, at in zip(inputs, buffers, axes):
        shape = list(buffer.shape)
        shape[at] *= n
        device = item.tensor.device if item.tensor is not None else ctx.cpu_device
        results.append(wrap_array(ctx.pool.empty(tuple(shape), buffer.dtype), device))
    groups = _by_dtype(buffers)
    sends = [_pack(ctx, buffers, members, dtype) for dtype, members in groups.items()]
    recvs = [ctx.pool.empty((n, send.size), send.dtype) for send in sends]

    def post() -> list[Any]:
        return mpi.all_gather_each(group, sends, recvs)

    def finish() -> Any:
        for members, recv in zip(groups.values(), recvs):
            offset = 0
            for index in members:
                buffer, size = buffers[index], buffers[index].size
                blocks = recv[:, offset : offset + size].reshape((n, *buffer.shape))
                np.concatenate(list(blocks), axis=axes[index], out=results[index].array)
                offset += size
        return value

    value = rebuild(structure, keys, results)
    record = _record(ctx, "grouped all_gather", None, -1, group, keys, buffers)
    if record is not None:
        record.extra ^= hash(tuple(axes)) & 0xFFFF
    op = Op("grouped all_gather", group, sum(b.nbytes for b in buffers), post, finish, record=record,
            keep=(*sends, *recvs))
    return start(ctx, op, value, back)


def grouped_broadcast(ctx: DistributedContext, structure: Any, root: Any, devices: DevicesArg, out: Any) -> Any:
    """Broadcast every tensor of `structure` from the root, one ``MPI_Ibcast`` per dtype.

    Non-roots pass a structure of tensors of the right shapes and dtypes (templates).

    Returns:
        A `CollectiveTensor` resolving to the same structure of the root's tensors.

    Raises:
        TypeError: a bad leaf (None included), or `out=`.
    """
    keys, inputs, back = _leaves(ctx, structure, "broadcast", {"out": out})
    group = ctx.group(devices, "broadcast")
    root_at = root_rank(ctx, root)
    buffers = [item.buffer for item in inputs]
    groups = _by_dtype(buffers)
    if root_at == ctx.rank:
        packed = [_pack(ctx, buffers, members, dtype) for dtype, members in groups.items()]
    else:
        packed = [ctx.pool.empty((sum(buffers[i].size for i in members),), dtype) for dtype, members in groups.items()]
    results: list[Any] = [None] * len(buffers)
    for members, buffer in zip(groups.values(), packed):
        offset = 0
        for index in members:
            size = buffers[index].size
            device = inputs[index].tensor.device if inputs[index].tensor is not None else ctx.cpu_device
            results[index] = wrap_array(buffer[offset : offset + size].reshape(buffers[index].shape), device)
            offset += size

    def post() -> list[Any]:
        return mpi.broadcast_each(group, packed, group_root(group, root_at, "broadcast"))

    value = rebuild(structure, keys, results)
    record = _record(ctx, "grouped broadcast", None, root_at, group, keys, buffers)
    op = Op("grouped broadcast", group, sum(b.nbytes for b in buffers), post, lambda: value, record=record,
            keep=tuple(packed))
    return start(ctx, op, value, back)


def grouped_reduce_scatter(ctx: DistributedContext, structure: Any, op: ReduceOperation, devices: DevicesArg,
                           counts: Any, out: Any, prescale: Any, postscale: Any) -> Any:
    """Reduce-scatter every tensor of `structure`, one ``MPI_Ireduce_scatter_block`` per dtype.

    Rank k gets block k of every tensor's first axis; the buffer sent holds, for each
    rank in turn, that rank's block of every tensor.

    Returns:
        A `CollectiveTensor` resolving to the same structure of this rank's blocks.

    Raises:
        TypeError: a bad leaf or factor, `counts=` or `out=`.
        ValueError: a tensor whose first dimension the group size does not divide.
    """
    keys, inputs, back = _leaves(ctx, structure, "reduce_scatter", {"counts": counts, "out": out})
    group = ctx.group(devices, "reduce_scatter")
    n = group.size
    buffers = [item.buffer for item in inputs]
    blocks = [split_first_axis(b.shape, n, "reduce_scatter") for b in buffers]
    plans = [reduce_plan(op, b.dtype) for b in buffers]
    factors = [scale_factors(prescale, postscale, b.dtype, "reduce_scatter") for b in buffers]
    buckets = plan_buckets([b.size // n for b in buffers], plans, sys.maxsize)
    sends, works, finals, results = [], [], [], [None] * len(buffers)
    for bucket in buckets:
        plan = bucket.plan
        send = ctx.pool.empty((n, bucket.elements), plan.work_dtype)
        for index, offset in zip(bucket.members, bucket.offsets):
            size = buffers[index].size // n
            np.copyto(send[:, offset : offset + size], buffers[index].reshape(n, size), casting="unsafe")
        pre = factors[bucket.members[0]][0]
        if pre is not None:
            np.multiply(send, pre, out=send, casting="unsafe")
        if plan.codec is not None:
            plan.codec.encode(send, send)
        work = ctx.pool.empty((bucket.elements,), plan.work_dtype)
        final = ctx.pool.empty((bucket.elements,), plan.out_dtype) if plan.rounds_back else work
        for index, offset in zip(bucket.members, bucket.offsets):
            device = inputs[index].tensor.device if inputs[index].tensor is not None else ctx.cpu_device
            view = final[offset : offset + buffers[index].size // n].reshape(blocks[index])
            results[index] = wrap_array(view, device)
        sends.append(send)
        works.append(work)
        finals.append(final)
    handle = _start_reduce_scatter(ctx, group, structure, keys, buffers, op, buckets, (sends, works, finals),
                                   results, factors)
    return follow(handle, back)


def _start_reduce_scatter(ctx: DistributedContext, group: Group, structure: Any, keys: list[Any],
                          buffers: list[np.ndarray], op: ReduceOperation, buckets: list[Any],
                          arrays: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]], results: list[Any],
                          factors: list[tuple[Any, Any]]) -> Any:
    sends, works, finals = arrays
    n, plans = group.size, [bucket.plan for bucket in buckets]

    def post() -> list[Any]:
        return mpi.reduce_scatter_block_each(group, sends, works, plans)

    def finish() -> Any:
        for bucket, work, final in zip(buckets, works, finals):
            finish_scaled(work, final, bucket.plan, n, factors[bucket.members[0]][1])
        return value

    value = rebuild(structure, keys, results)
    options = scale_options(*factors[0]) if factors else ()
    record = _record(ctx, "grouped reduce_scatter", op, -1, group, keys, buffers, options)
    collective = Op("grouped reduce_scatter", group, sum(b.nbytes for b in buffers), post, finish, record=record,
                    keep=(*sends, *works, *finals))
    return start(ctx, collective, value)
