"""The fused all-reduce of many tensors: packed into buckets, one ``MPI_Iallreduce`` each.

Many small all-reduces cost one latency each; packed into buckets of
`DistributedConfig.bucket_bytes` (PyTorch DDP's idea) they cost a few. Tensors are grouped
by the dtype MPI reduces them in and packed in their given order; a tensor larger than a
bucket gets a bucket of its own. The results are views into the buckets' result buffers,
so unpacking copies nothing.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from operator import attrgetter
from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import ReducePlan, reduce_plan
from .._core.interop import structure_back
from .._core.tensor import unwrap_leaves, wrap_arrays
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport.base import ReduceCall, Stepper
from .._transport.buckets import post_buckets, shared_bucket
from .._transport.gpu.after_event import AfterEvent
from .common import PLAIN_DTYPES, CollectiveTensor, check_record, follow, start, take_input
from .gpu_staged import gpu_fused_all_reduce
from .native import leaf_loops
from .options import make_record, scale_factors, scale_options

__all__ = ["Bucket", "flatten", "fused_all_reduce", "plan_buckets", "rebuild", "start_buckets", "structure_hash"]


@dataclass
class Bucket:
    """Tensors (by index) that travel in one buffer, and where each one sits in it."""

    plan: ReducePlan
    members: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    elements: int = 0

    @property
    def nbytes(self) -> int:
        """The size of the bucket's buffer in bytes."""
        return self.elements * self.plan.work_dtype.itemsize


def plan_buckets(sizes: Sequence[int], plans: Sequence[ReducePlan], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors into buckets of at most `bucket_bytes`, one dtype per bucket.

    Args:
        sizes: each tensor's number of elements, in the order to pack them.
        plans: each tensor's reduce plan (the dtype MPI reduces it in).
        bucket_bytes: the most bytes a bucket holds (a larger tensor goes alone).

    Returns:
        The buckets, in the order their first tensor appears.
    """
    buckets: list[Bucket] = []
    # One C loop, identity first (plans are cached per op and dtype): the usual case.
    if plans and plans.count(plans[0]) == len(plans):
        return _pack_one_kind(sizes, plans[0], bucket_bytes)
    open_by_kind: dict[tuple[Any, ...], Bucket] = {}
    for index, (size, plan) in enumerate(zip(sizes, plans)):
        # Tensors share a bucket when MPI reduces them alike (MPI ops are unhashable
        # handles, but the predefined ones are singletons).
        key = (plan.work_dtype, id(plan.mpi_op), id(plan.datatype), plan.divide)
        bucket = open_by_kind.get(key)
        nbytes = size * plan.work_dtype.itemsize
        if bucket is None or (bucket.members and bucket.nbytes + nbytes > bucket_bytes):
            bucket = Bucket(plan)
            buckets.append(bucket)
            open_by_kind[key] = bucket
        bucket.members.append(index)
        bucket.offsets.append(bucket.elements)
        bucket.elements += size
    return buckets


def _pack_one_kind(sizes: Sequence[int], plan: ReducePlan, bucket_bytes: int) -> list[Bucket]:
    """`plan_buckets` when every tensor has the same plan (the usual case).

    The same packing, without the bookkeeping by kind.
    """
    limit = bucket_bytes // plan.work_dtype.itemsize
    ends = list(accumulate(sizes))
    if not ends or ends[-1] <= limit:  # the usual case: one bucket holds everything
        return [Bucket(plan, list(range(len(ends))), [0, *ends[:-1]], ends[-1] if ends else 0)]
    buckets = [Bucket(plan)]
    members, offsets = buckets[0].members, buckets[0].offsets
    filled = 0
    for index, size in enumerate(sizes):
        if members and filled + size > limit:
            buckets[-1].elements = filled
            buckets.append(Bucket(plan))
            members, offsets = buckets[-1].members, buckets[-1].offsets
            filled = 0
        members.append(index)
        offsets.append(filled)
        filled += size
    buckets[-1].elements = filled
    return buckets


def structure_hash(keys: Iterable[Any], arrays: Iterable[Any]) -> int:
    """A hash of the names, shapes and dtypes of a structure, equal on every rank.

    Names are hashed as text with CRC-32 (Python's own string hash differs between
    processes); shapes and dtype numbers, as a tuple of ints (whose hash does not).
    """
    names = _positions_crc(len(keys)) if type(keys) is range else zlib.crc32("\0".join(map(repr, keys)).encode())
    arrays = arrays if isinstance(arrays, list) else list(arrays)
    dtypes = list(map(_DTYPE, arrays))
    kinds = set(dtypes)
    # One dtype (the usual case) is hashed once; otherwise each tensor's.
    numbers = kinds.pop().num if len(kinds) == 1 else tuple(d.num for d in dtypes)
    layout = hash((tuple(map(_SHAPE, arrays)), numbers))
    return hash((names, layout)) & ((1 << 56) - 1)


_DTYPE, _SHAPE, _SIZE = attrgetter("dtype"), attrgetter("shape"), attrgetter("size")


@functools.cache
def _positions_crc(count: int) -> int:
    """The names' hash of a list or tuple of `count` tensors (its keys are its positions)."""
    return zlib.crc32("\0".join(map(repr, range(count))).encode())


def describe_entries(keys: Sequence[Any], arrays: Sequence[Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """``(key, shape, dtype)`` of every tensor of a structure, to name a mismatched entry."""
    return [(repr(key), tuple(array.shape), str(array.dtype)) for key, array in zip(keys, arrays)]


def flatten(structure: Any) -> tuple[Sequence[Any], list[Any]]:
    """The keys (dict keys, or positions as a `range`) and the leaves of a list, tuple or dict."""
    if isinstance(structure, dict):
        return list(structure.keys()), list(structure.values())
    return range(len(structure)), list(structure)


def rebuild(structure: Any, keys: Sequence[Any], values: list[Any]) -> Any:
    """A structure of `structure`'s kind with `values` at `keys` (as `flatten` gave them)."""
    if isinstance(structure, dict):
        return dict(zip(keys, values))
    if isinstance(structure, tuple):
        return tuple(values)
    return list(values)


def fused_all_reduce(
    ctx: DistributedContext,
    structure: Any,
    op: ReduceOperation | str | None,
    devices: DevicesArg,
    *,
    bucket_bytes: int | None = None,
    kind: str = "fused all_reduce",
    factors: tuple[Any, Any] = (None, None),
) -> CollectiveTensor:
    """All-reduce a list, tuple or dict of tensors as one fused operation.

    Args:
        ctx: the context.
        structure: the tensors (Tensor or NumPy array leaves).
        op: the reduction; None for the context's default.
        devices: the group; None for every rank of the context.
        bucket_bytes: the bucket size; None for ``ctx.config.bucket_bytes``.
        kind: the operation's name in messages and in the check.
        factors: (prescale_factor, postscale_factor), applied to each packed bucket.

    Returns:
        A `CollectiveTensor` resolving to the same structure of result tensors.

    Raises:
        TypeError: a leaf is not a tensor/array, or a CUDA tensor; a factor that does not
            suit a leaf's dtype.
    """
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    group = ctx.group(devices, kind)
    keys, values = flatten(structure)
    plain = _plain_host_leaves(values, ctx.cpu_device)
    if plain is not None:
        buffers, devices_out = plain
    else:
        what = f"every tensor of the {type(structure).__name__}"
        inputs = [take_input(v, ctx, "all_reduce", what) for v in values]
        # Leaves of other libraries (torch, JAX, numbers) come back in their own kind.
        back = structure_back(keys, [item.back for item in inputs], type(structure))
        if any(item.on_gpu for item in inputs):
            arrays = rebuild(structure, keys, [item.buffer for item in inputs])
            handle = gpu_fused_all_reduce(ctx, arrays, kind, lambda host: fused_all_reduce(
                ctx, host, reduce_op, devices, bucket_bytes=bucket_bytes, kind=kind, factors=factors))
            return follow(handle, back)
        buffers = [item.buffer for item in inputs]  # contiguous, of the input's shape
        devices_out = [item.tensor.device if item.tensor is not None else ctx.cpu_device for item in inputs]
        handle = _start_fused(ctx, group, structure, keys, buffers, devices_out, reduce_op, bucket_bytes, kind,
                              factors)
        return follow(handle, back)
    return _start_fused(ctx, group, structure, keys, buffers, devices_out, reduce_op, bucket_bytes, kind, factors)


def _plain_host_leaves(values: list[Any], host: Any) -> tuple[list[np.ndarray], list[Any]] | None:
    """The leaves' arrays and devices when every leaf is a contiguous host array of a plain dtype.

    That is the usual case (gradients), and it needs neither copies nor `take_input`'s
    checks; anything else returns None and goes the general way.
    """
    loops = leaf_loops()
    found = None if loops is None else loops.plain_leaves(values, host, PLAIN_DTYPES)
    if found is not None:  # one dtype: the compiled loop's usual case
        return found
    # Each test runs over every leaf (hundreds per call) inside one C call.
    arrays, devices = unwrap_leaves(values, host)
    if (
        set(map(type, arrays)) == _NDARRAY
        and all(map(_C_CONTIGUOUS, arrays))
        and set(map(_DTYPE, arrays)) <= PLAIN_DTYPES
    ):
        return arrays, devices
    return None


_NDARRAY = {np.ndarray}
_C_CONTIGUOUS, _NBYTES = attrgetter("flags.c_contiguous"), attrgetter("nbytes")


def _start_fused(
    ctx: DistributedContext,
    group: Group,
    structure: Any,
    keys: list[Any],
    buffers: list[np.ndarray],
    devices: list[Any],
    reduce_op: ReduceOperation,
    bucket_bytes: int | None,
    kind: str,
    factors: tuple[Any, Any] = (None, None),
) -> CollectiveTensor:
    # 256 gradients usually share one or two dtypes: one plan per dtype, not per tensor.
    dtypes = list(map(_DTYPE, buffers))
    by_dtype = {dtype: reduce_plan(reduce_op, dtype) for dtype in set(dtypes)}
    plans = [by_dtype[dtype] for dtype in dtypes] if len(by_dtype) > 1 else [*by_dtype.values()] * len(buffers)
    sizes = list(map(_SIZE, buffers))
    buckets = plan_buckets(sizes, plans, bucket_bytes or ctx.config.bucket_bytes)
    # One bucket of the inputs' own dtype (the usual case): packed and unpacked by compiled loops.
    loops = leaf_loops() if len(buckets) == 1 and len(by_dtype) == 1 and dtypes[0] == plans[0].work_dtype else None
    sends, recvs, shared = _pack(ctx, group, buckets, buffers, loops)
    rounding: list[tuple[np.ndarray, np.ndarray]] = []  # half precision: (float32 view, result)
    if loops is not None:
        tensors = loops.unpack(recvs[0], buffers, devices)
    else:
        views = _views(buckets, recvs, buffers)
        if any(plan.rounds_back for plan in by_dtype.values()):
            for index, plan in enumerate(plans):
                if plan.rounds_back:
                    final = ctx.pool.empty(buffers[index].shape, plan.out_dtype)
                    rounding.append((views[index], final))
                    views[index] = final
        tensors = wrap_arrays(views, devices)
    result = rebuild(structure, keys, tensors)
    # Hashing the structure costs per tensor: only a checked call needs it.
    checked = ctx.config.check and group.size > 1
    scales, options = _bucket_scales(buckets, by_dtype, factors)
    record = make_record(options, kind, reduce_op, None, (len(buffers), sum(sizes)), -1, group.members,
                         extra=structure_hash(keys, buffers) if checked else 0)
    record.entries = partial(describe_entries, keys, buffers)
    nbytes = sum(map(_NBYTES, buffers))
    return start_buckets(ctx, group, buckets, sends, recvs, result, record, nbytes, rounding, scales, shared=shared)


def _pack(
    ctx: DistributedContext, group: Group, buckets: Sequence[Bucket], buffers: list[np.ndarray], loops: Any = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[ReduceCall | None]]:
    """Pack `buffers` into their buckets, and take each bucket's result buffer.

    Args:
        loops: the compiled leaf loops, for one bucket of the inputs' own dtype; None: NumPy packs.

    Returns:
        Each bucket's packed input and result buffer, and its shared-memory call (None: MPI
        reduces it).
    """
    sends, recvs, shared = [], [], []
    whole = len(buckets) == 1  # the usual case: one bucket holds every tensor, in order
    for bucket in buckets:
        dtype = bucket.plan.work_dtype
        send = ctx.pool.empty((bucket.elements,), dtype)
        parts = buffers if whole else [buffers[i] for i in bucket.members]
        if loops is not None:
            loops.pack(parts, send)
        else:  # one C call packs the bucket, flattening each input itself (axis=None)
            np.concatenate(parts, axis=None, out=send, casting="unsafe")
        call = shared_bucket(ctx, group, send, bucket.plan)
        sends.append(send)
        recvs.append(ctx.pool.empty((bucket.elements,), dtype) if call is None else call.out)
        shared.append(call)
    return sends, recvs, shared


def _views(buckets: Sequence[Bucket], recvs: Sequence[np.ndarray], buffers: list[np.ndarray]) -> list[np.ndarray]:
    """Each tensor's view of its bucket's result, in the order of `buffers`."""
    if len(buckets) == 1:
        return _unpack(recvs[0], buffers, buckets[0].offsets)
    views: list[Any] = [None] * len(buffers)
    for bucket, out in zip(buckets, recvs):
        for index, view in zip(bucket.members, _unpack(out, [buffers[i] for i in bucket.members], bucket.offsets)):
            views[index] = view
    return views


def _unpack(out: np.ndarray, parts: list[np.ndarray], offsets: list[int]) -> list[np.ndarray]:
    """Views of `out` (a packed bucket) in the shapes of `parts`, which start at `offsets`."""
    count = len(parts)
    if count > 1 and parts[0].ndim and offsets[1] * count == out.size:
        shapes = set(map(_SHAPE, parts))
        if len(shapes) == 1:
            # Tensors of one shape (a model's equal layers): a view per row, made in C.
            return list(out.reshape(count, *shapes.pop()))
    return [
        out[offset : offset + part.size] if part.ndim == 1 else out[offset : offset + part.size].reshape(part.shape)
        for part, offset in zip(parts, offsets)
    ]


def _bucket_scales(buckets: Sequence[Bucket], plans: dict[np.dtype, ReducePlan],
                   factors: tuple[Any, Any]) -> tuple[list[tuple[Any, Any]] | None, tuple[tuple[str, Any], ...]]:
    """Each bucket's (prescale, postscale), checked against every input dtype, and the check's options.

    Both are empty (None, ()) without factors (or with factors of 1).

    Raises:
        TypeError: a factor that does not suit one of the inputs' dtypes.
    """
    if factors == (None, None):
        return None, ()
    # Every input dtype must take the factors; inputs sharing a bucket share its factors.
    checked = {plan.work_dtype: scale_factors(*factors, dtype, "all_reduce") for dtype, plan in plans.items()}
    first = next(iter(checked.values()), (None, None))
    if first == (None, None):
        return None, ()
    return [checked[bucket.plan.work_dtype] for bucket in buckets], scale_options(*first)


def _ready_sends(buckets: Sequence[Bucket], sends: Sequence[np.ndarray],
                 scales: Sequence[tuple[Any, Any]] | None) -> None:
    """Prescale and encode (MAX/MIN keys) the packed buckets in place."""
    for index, (bucket, send) in enumerate(zip(buckets, sends)):
        if scales and scales[index][0] is not None:
            np.multiply(send, scales[index][0], out=send, casting="unsafe")
        if bucket.plan.codec is not None:
            bucket.plan.codec.encode(send, send)


def _bucket_post(
    comm: Any,
    buckets: Sequence[Bucket],
    sends: Sequence[np.ndarray],
    recvs: Sequence[np.ndarray],
    scales: Sequence[tuple[Any, Any]] | None,
    ready: Any,
    shared: Sequence[ReduceCall | None],
) -> Callable[[], list[Any] | Stepper]:
    """The op's ``post``: each bucket's all-reduce (`post_buckets`), once `ready` (if any) is done.

    The packed buckets are prescaled and encoded (`_ready_sends`) now when they are filled,
    else once `ready` is done, just before posting.
    """
    plans = [bucket.plan for bucket in buckets]
    if not shared:
        shared = [None] * len(buckets)

    def requests() -> list[Any] | Stepper:
        return post_buckets(comm, plans, sends, recvs, shared)

    if ready is None:
        _ready_sends(buckets, sends, scales)
        return requests

    def prepare_and_post() -> list[Any] | Stepper:
        _ready_sends(buckets, sends, scales)
        return requests()

    return lambda: AfterEvent(ready, prepare_and_post)


def start_buckets(
    ctx: DistributedContext,
    group: Group,
    buckets: Sequence[Bucket],
    sends: Sequence[np.ndarray],
    recvs: Sequence[np.ndarray],
    result: Any,
    record: Record,
    nbytes: int,
    rounding: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    scales: Sequence[tuple[Any, Any]] | None = None,
    ready: Any = None,
    shared: Sequence[ReduceCall | None] = (),
) -> CollectiveTensor:
    """All-reduce packed buckets as one op: one ``MPI_Iallreduce`` per bucket, or shared memory.

    For MAX/MIN of floats (plans with a ``codec``) the packed floats are turned into the
    keys MPI reduces here, in place, and the results back into floats when the op finishes.

    Args:
        ctx: the context.
        group: the group.
        buckets: the buckets (their plans give op and dtype).
        sends: each bucket's packed input (a private buffer: it may be changed).
        recvs: each bucket's result buffer (the result's tensors are views of them).
        result: what `resolve()` returns.
        record: what this rank says about the call, for the check.
        nbytes: the bytes of all the tensors, for messages.
        rounding: (float32 view, half-precision result) pairs to round back at the end.
        scales: per bucket, (prescale, postscale) factors (None: unscaled): the packed
            input is multiplied before the reduction, the result after it (and after MEAN's
            division), before half precision is rounded back.
        ready: an event (``done``) after which `sends` are filled (GPU gradients copied
            into them asynchronously), or None when they are filled already. MPI gets
            them only once it is done; the call does not wait for it.
        shared: each bucket's shared-memory call (`buckets.shared_bucket`), or None for
            MPI's; empty: every bucket goes to MPI.

    Returns:
        The handle resolving to `result`.
    """
    size = group.size
    post = _bucket_post(group.comm, buckets, sends, recvs, scales, ready, shared)
    posts = [post_factor for _, post_factor in scales] if scales else [None] * len(buckets)

    def finish() -> Any:
        for bucket, out, post_factor in zip(buckets, recvs, posts):
            if bucket.plan.divide:
                np.true_divide(out, size, out=out)
            elif bucket.plan.codec is not None:
                bucket.plan.codec.decode(out)
            if post_factor is not None:
                np.multiply(out, post_factor, out=out, casting="unsafe")
        for view, final in rounding:
            np.copyto(final, view, casting="unsafe")
        return result

    op = Op(record.kind, group, nbytes, post, finish, record=check_record(ctx, group, record),
            keep=(*sends, *recvs, *(final for _, final in rounding)))
    return start(ctx, op, result)
