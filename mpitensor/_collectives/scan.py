"""`scan` and `exscan`: inclusive and exclusive prefix reductions in group order.

``MEAN`` is the prefix sum divided by the number of ranks it covers: rank k of the group
gets the mean of ranks 0..k (`scan`) or 0..k-1 (`exscan`). `exscan` gives the group's first
rank, where MPI leaves the result undefined, the identity of the op: 0 for SUM, BOR and
BXOR, 1 for PROD, all ones for BAND, the dtype's lowest value for MAX (-inf for floats) and
highest for MIN; on bool, False for the ors and True for the ands; for MEAN, the mean of
nothing, NaN (as ``numpy.mean`` of an empty array).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan
from .._core.interop import refuse_int_overflow
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Op
from .._transport import mpi
from .common import (
    CollectiveTensor,
    check_record,
    context_for,
    finish_reduction,
    follow,
    reduction_buffers,
    reduction_input,
    result_device,
    start,
    take_input,
)
from .gpu_host import staged

__all__ = ["exscan", "identity", "scan"]


def scan(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    devices: DevicesArg = None,
) -> CollectiveTensor:
    """Start an inclusive prefix reduction (``MPI_Iscan``) and return at once.

    The group's rank k gets the reduction of the tensors of ranks 0..k (group order).

    Args:
        input: this rank's tensor: a `Tensor`, an array of NumPy, CuPy, torch or JAX (or
            any DLPack object), or a number.
        op: the reduction; None uses the context's ``config.all_reduce_op``. MEAN divides
            rank k's prefix sum by k + 1.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to this rank's prefix reduction, in the input's kind
        (a `Tensor` for NumPy and CuPy arrays, a torch tensor, a JAX array, a Python number).

    Raises:
        TypeError: bad input or dtype (or a bitwise op on floats).
        OverflowError: a Python int whose SUM, MEAN or PROD could leave int64's range.
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
    """
    return _prefix("scan", input, op, devices)


def exscan(
    input: Any,  # noqa: A002 - the name every collective uses
    op: ReduceOperation | str | None = None,
    *,
    devices: DevicesArg = None,
) -> CollectiveTensor:
    """Start an exclusive prefix reduction (``MPI_Iexscan``) and return at once.

    The group's rank k gets the reduction of the tensors of ranks 0..k-1; rank 0 gets the
    op's identity (see the module's notes; NaN for MEAN).

    Args:
        input: this rank's tensor, of the kinds `scan` takes.
        op: the reduction; None uses the context's ``config.all_reduce_op``. MEAN divides
            rank k's prefix sum by k.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to this rank's exclusive prefix reduction, in the
        input's kind.

    Raises:
        TypeError: bad input or dtype (or a bitwise op on floats).
        OverflowError: a Python int whose SUM, MEAN or PROD could leave int64's range.
        CollectiveMismatchError: the ranks disagree on shape, dtype, op or group.
    """
    return _prefix("exscan", input, op, devices)


def _prefix(kind: str, input: Any, op: Any, devices: DevicesArg) -> CollectiveTensor:  # noqa: A002
    """Start `scan` or `exscan` (`kind`)."""
    ctx = context_for(kind)
    reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
    source = take_input(input, ctx, kind)
    group = ctx.group(devices, kind)
    if type(input) is int:
        refuse_int_overflow(input, reduce_op.name, group.size, kind)
    if source.on_gpu:
        handle = staged(ctx, source, group, lambda host, members: _prefix(kind, host, reduce_op, members))
        return follow(handle, source.back)
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    array = source.array
    send, protections = reduction_input(ctx, source, plan)
    out, final = reduction_buffers(ctx, array.shape, plan)
    result = Tensor(final, result_device(ctx, source))
    exclusive = kind == "exscan"
    covered = group.rank if exclusive else group.rank + 1  # ranks the prefix reduces
    datatype, mpi_op = plan.datatype, plan.mpi_op

    def post() -> list[Any]:
        if exclusive:
            return mpi.exscan(group, send, out, datatype, mpi_op)
        return mpi.scan(group, send, out, datatype, mpi_op)

    def finish() -> Tensor:
        if covered:
            finish_reduction(out, final, plan, covered)
        else:
            final[...] = identity(reduce_op, final.dtype)
        return result

    record = check_record(ctx, group, Record(kind, reduce_op, array.dtype, array.shape, -1, group.members))
    collective = Op(kind, group, array.nbytes, post, finish, record=record, keep=(send, out, final),
                    protections=protections)
    return start(ctx, collective, result, source.back)


def identity(op: ReduceOperation, dtype: np.dtype) -> np.ndarray:
    """The identity of `op` on `dtype` (the result dtype of the reduction), as a 0-d array.

    MEAN has none: it gives NaN, the mean of nothing.
    """
    if dtype.kind == "b":
        ors = (ReduceOperation.SUM, ReduceOperation.MAX, ReduceOperation.BOR, ReduceOperation.BXOR)
        return np.array(op not in ors, dtype)
    if op is ReduceOperation.MAX or op is ReduceOperation.MIN:
        maximum = op is ReduceOperation.MAX
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            return np.array(info.min if maximum else info.max, dtype)
        bound = -np.inf if maximum else np.inf
        return np.array(complex(bound, bound) if dtype.kind == "c" else bound, dtype)
    value = {ReduceOperation.MEAN: np.nan, ReduceOperation.PROD: 1}.get(op, 0)
    if op is ReduceOperation.BAND:
        return ~np.zeros((), dtype)
    return np.array(value, dtype)
