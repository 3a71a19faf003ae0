"""`scatter`: the root's tensor split along an axis, one block per rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype, transfer_dtype
from .._core.interop import numpy_dtype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op, size_text
from .._transport import mpi
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
from .gpu_host import staged
from .layout import axis_arg, displacements, to_front

__all__ = ["scatter"]

_MASK = (1 << 62) - 1


def scatter(
    input: Any, root: int | Device = 0, *, axis: int = 0, counts: Sequence[int] | None = None,  # noqa: A002
    shape: tuple[int, ...] | None = None, dtype: Any = None, devices: DevicesArg = None,
) -> CollectiveTensor:
    """Start a scatter from the root (``MPI_Iscatter``/``MPI_Iscatterv``) and return at once.

    The root's tensor is split along `axis` into equal blocks, or `counts[k]` slices for
    the group's k-th rank; every rank gets its block as a fresh tensor.

    Args:
        input: on the root, the whole tensor: a `Tensor`, an array of NumPy, CuPy, torch
            or JAX, or any DLPack object. Elsewhere None (with `dtype`, and `shape` where
            `counts` does not give it), or a tensor of the root's whole shape and dtype,
            used only as a template (its kind is the result's).
        root: the sending rank (in the context, a member of the group) or its `Device`.
        axis: the axis to split along (negative counts from the end).
        counts: the length of each rank's block along `axis`, in group order (summing to
            that length); None for equal blocks. Every rank passes the same counts.
        shape: the root's whole shape, on ranks that pass None. With `counts`, it may give
            None as the length along `axis` (the sum of `counts`), and may be left out
            for a 1-D tensor.
        dtype: the root's dtype (NumPy's, torch's or JAX's), on ranks that pass None.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to this rank's block, in the input's kind (a
        `Tensor` for NumPy and CuPy arrays, a torch tensor, a JAX array); on a rank that
        passed None, a CPU `Tensor`.

    Raises:
        TypeError: the root passes None, a non-root passes None without `dtype` (or
            without a `shape` that `counts` cannot stand for), or bad input, dtype,
            shape, axis or counts types.
        ValueError: bad axis, a 0-d tensor, a `shape` with None elsewhere than at `axis`,
            counts that do not fit, a length that does not divide into equal blocks, or
            a root outside the group.
        MemoryError: this rank's block cannot be allocated (a `shape` far beyond the
            root's, say); the message names the shape. Its peers get a
            `CollectiveMismatchError` with that message, as for every error of one rank's call.
        CollectiveMismatchError: the ranks disagree on shape, dtype, axis, counts, root or group.
    """
    ctx = context_for("scatter")
    group = ctx.group(devices, "scatter")
    root_at = root_rank(ctx, root)
    is_root = root_at == ctx.rank
    source = None if input is None else take_input(input, ctx, "scatter")
    if source is not None and source.on_gpu:
        handle = staged(ctx, source, group, lambda host, members: scatter(
            host, root_at, axis=axis, counts=counts, devices=members))
        return follow(handle, source.back)
    given = _counts_arg(counts)
    whole, whole_dtype = _whole(is_root, source, (shape, dtype), axis, given)
    axis = axis_arg(axis, len(whole), "scatter")
    blocks = _blocks(whole[axis], group.size, given)
    out, result = _receive(ctx, source, whole, whole_dtype, axis, blocks[group.rank])
    send, protections = _send_buffer(ctx, source if is_root else None, axis)
    datatype, uniform = mpi_datatype(whole_dtype), counts is None
    row = math.prod(out.shape[1:])
    elements = [n * row for n in blocks]

    def post() -> list[Any]:
        index = group_root(group, root_at, "scatter")
        if uniform:
            return mpi.scatter(group, send, out, datatype, index)
        displs = None if send is None else displacements(elements)
        return mpi.scatterv(group, send, elements, displs, out, datatype, index)

    record = _record(whole_dtype, whole, root_at, group.members, axis, given)
    op = Op("scatter", group, out.nbytes, post, lambda: result, record=check_record(ctx, group, record),
            keep=(send, out), protections=protections)
    return start(ctx, op, result, None if source is None else source.back)


def _receive(ctx: Any, source: Any, whole: tuple[int, ...], dtype: np.dtype, axis: int,
             rows: int) -> tuple[np.ndarray, Tensor]:
    """The buffer this rank receives into (`axis` in front, `rows` long) and the result tensor viewing it.

    Raises:
        MemoryError: the block cannot be allocated; the message names the whole shape and
            where it came from. It stays a MemoryError (an error of this rank's own call),
            so this rank still takes its turn and its peers fail with its message.
    """
    block = (rows, *whole[:axis], *whole[axis + 1:])
    try:
        out = ctx.pool.empty(block, dtype)
    except MemoryError as exc:
        given = "the shape= this rank passed" if source is None else "this rank's input"
        raise MemoryError(
            f"scatter: cannot allocate this rank's block of {size_text(math.prod(block) * dtype.itemsize)} "
            f"({rows} of the {whole[axis]} slices along axis {axis} of a {dtype} tensor of shape {whole}, "
            f"from {given}). A non-root rank's shape= must be the root's whole shape (what the root splits), "
            f"not a size to reserve; check it, or split the tensor over more ranks or with counts="
        ) from exc
    device = ctx.cpu_device if source is None else result_device(ctx, source)
    return out, Tensor(np.moveaxis(out, 0, axis) if axis else out, device)


def _send_buffer(ctx: Any, source: Any, axis: int) -> tuple[Any, tuple[Any, ...]]:
    """The root's tensor with `axis` in front, and its protections; (None, ()) on other ranks."""
    if source is None:
        return None, ()
    protections = source.guard(ctx)
    send, _ = to_front(ctx, source.buffer, axis)
    return send, protections


def _whole(is_root: bool, source: Any, described: tuple[Any, Any], axis: Any,
           counts: list[int] | None) -> tuple[tuple[int, ...], np.dtype]:
    """The root's whole shape and dtype, from the input or from `shape` and `dtype`.

    Args:
        is_root: whether this rank is the root.
        source: the input taken, or None.
        described: the `shape` and `dtype` arguments.
        axis: the `axis` argument.
        counts: the checked counts, or None.

    Raises:
        TypeError: the root passes None, or `dtype` is missing or not a dtype, or `shape`
            is missing where `counts` cannot give it.
        ValueError: the tensor has no dimension to split, or `shape` leaves out another
            length than the one along `axis`.
    """
    if source is not None:
        if not source.buffer.ndim:
            raise ValueError("scatter: the tensor must have at least one dimension to split, got a 0-d one")
        return tuple(source.buffer.shape), source.buffer.dtype
    if is_root:
        raise TypeError("scatter: the root must pass the tensor to split, got None")
    shape, dtype = described
    if dtype is None or (shape is None and counts is None):
        raise TypeError(
            "scatter: a non-root rank passing input=None must give shape= and dtype= of the root's whole "
            "tensor (with counts=, shape= may give None as the length along axis, and a 1-D tensor needs "
            "no shape=)"
        )
    return _described_shape(shape, axis, counts), transfer_dtype(numpy_dtype(dtype))


def _described_shape(shape: Any, axis: Any, counts: list[int] | None) -> tuple[int, ...]:
    """The whole shape a non-root rank describes: `shape`, its None along `axis` the sum of `counts`.

    Raises:
        TypeError: `shape` is not an int or a sequence of ints (and None), or it leaves the
            length out without `counts`.
        ValueError: `shape` leaves out another length than the one along `axis`.
    """
    if shape is None:  # only with counts (checked by the caller): a 1-D tensor
        return (sum(counts or ()),)
    dims = [shape] if isinstance(shape, (int, np.integer)) else shape
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not all(
        d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool)) for d in dims
    ):
        raise TypeError(f"scatter: shape must be a tuple of ints (None for the length along axis), got {shape!r}")
    dims = list(dims)
    if None in dims:
        at = axis_arg(axis, len(dims), "scatter")
        if dims.count(None) > 1 or dims[at] is not None:
            raise ValueError(
                f"scatter: shape may give None only as the length along axis {axis} (the sum of counts), "
                f"got {tuple(dims)}"
            )
        if counts is None:
            raise TypeError(
                f"scatter: shape {tuple(dims)} leaves the length along axis {axis} to counts=, which was not "
                "given; pass counts= or that length"
            )
        dims[at] = sum(counts)
    return tuple(int(d) for d in dims)


def _counts_arg(counts: Sequence[int] | None) -> list[int] | None:
    """`counts` as a list of ints, or None.

    Raises:
        TypeError: `counts` is not a sequence of ints.
    """
    if counts is None:
        return None
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence) or not all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in counts
    ):
        raise TypeError(f"scatter: counts must be a sequence of ints, one per rank, got {counts!r}")
    return [int(c) for c in counts]


def _blocks(length: int, size: int, counts: list[int] | None) -> list[int]:
    """Each rank's length along the axis: `counts`, checked, or equal blocks.

    Raises:
        ValueError: `counts` has the wrong length, a negative entry or the wrong sum; or,
            without counts, `length` does not divide by `size`.
    """
    if counts is None:
        if length % size:
            raise ValueError(
                f"scatter: the length {length} along the axis does not split into {size} equal blocks; "
                "pass counts= with each rank's length"
            )
        return [length // size] * size
    if len(counts) != size or min(counts, default=0) < 0 or sum(counts) != length:
        raise ValueError(
            f"scatter: counts must give {size} non-negative lengths (one per rank of the group) summing "
            f"to the length {length} along the axis, got {counts}"
        )
    return counts


class _ScatterRecord(Record):
    """The check's record of a scatter: the axis and counts agree too, and are named on a mismatch."""

    __slots__ = ("text",)

    def detail(self) -> dict[str, Any]:
        """The record as a picklable dict, with the axis and counts in words."""
        out = super().detail()
        out["extra"] = self.text
        return out


def _record(dtype: np.dtype, whole: tuple[int, ...], root: int, members: tuple[int, ...], axis: int,
            counts: list[int] | None) -> Record:
    blocks = None if counts is None else tuple(counts)
    record = _ScatterRecord("scatter", None, dtype, whole, root, members,
                            extra=hash((axis, -1 if blocks is None else blocks)) & _MASK)
    record.text = f"axis={axis}, counts={'equal' if blocks is None else list(blocks)}"
    return record
