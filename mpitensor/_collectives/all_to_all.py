"""`all_to_all`: rank i sends its j-th block to rank j and receives everyone's i-th block."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.dtypes import mpi_datatype
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import (
    CollectiveTensor,
    Input,
    Later,
    check_record,
    context_for,
    follow,
    result_device,
    start,
    take_input,
)
from .gpu_host import staged
from .held import held_call
from .layout import displacements
from .options import make_record, output_buffer, output_tensor, protect_output, refuse_on_gpu, row_counts
from .reduce_scatter import blocks_or_problem

__all__ = ["all_to_all"]


def all_to_all(
    input: Any,  # noqa: A002 - the name every collective uses
    *,
    devices: DevicesArg = None,
    splits: Sequence[int] | None = None,
    out: Any = None,
    held: bool = False,
) -> CollectiveTensor:
    """Start an all-to-all exchange (``MPI_Ialltoall``) and return at once.

    The input is cut along its first axis into one block per rank of the group: `size`
    equal blocks, or `splits[k]` rows for the k-th rank (``MPI_Ialltoallv``, after a small
    exchange of counts). The result: the blocks received, concatenated in group order.

    Args:
        input: this rank's tensor; without `splits`, its first dimension must be
            divisible by the group size.
        devices: the group; None for every rank of the context.
        splits: rows sent to each member, in group order (non-negative ints summing to
            the first dimension); ranks may differ in it, but all or none pass it.
        out: a host Tensor or NumPy array to write the result into; see docs/options.md.
        held: the caller holds `input` (a host NumPy array) and `out` until the result is
            resolved: MPI's blocking call moves the data between them once the check agreed
            (see `_collectives/held.py`); `out` is then a writable array of the input's
            shape and dtype, not overlapping it (equal blocks: not with `splits`).

    Returns:
        A `CollectiveTensor` resolving to the received blocks, concatenated (`out`
        itself when it is a Tensor, else a Tensor sharing its memory).

    Raises:
        TypeError: bad input, dtype, splits or `out` dtype.
        ValueError: the first dimension is not divisible by the group size, bad splits,
            or a bad `out` (with splits, a wrong length of `out` is raised at resolve).
        CollectiveMismatchError: the ranks disagree on dtype, the other dimensions,
            passing splits, or group (without splits, on the whole shape).
    """
    if held and splits is None:
        return held_call("all_to_all", input, out, -1, None, devices,
                         lambda: all_to_all(input, devices=devices, out=out))
    ctx = context_for("all_to_all")
    source = take_input(input, ctx, "all_to_all")
    group = ctx.group(devices, "all_to_all")
    if source.on_gpu:
        refuse_on_gpu("all_to_all", out=out)
        handle = staged(ctx, source, group, lambda host, members: all_to_all(host, devices=members, splits=splits))
        return follow(handle, source.back)
    _refuse_overlap(out, source)  # before the input is protected, which would read as "out= is read-only"
    protections = source.guard(ctx)
    if splits is not None:
        return follow(_start_split(ctx, source, group, splits, out, protections), source.back)
    array = source.buffer
    problem, _ = blocks_or_problem(array.shape, group.size, "all_to_all")
    received = output_buffer(ctx, out, array.shape, array.dtype, "all_to_all", (source.array, array))
    result = output_tensor(out, received, result_device(ctx, source))
    datatype = mpi_datatype(array.dtype)

    def post() -> list[Any]:
        if problem is not None:
            raise problem
        requests = mpi.all_to_all(group, array, received, datatype)
        protect_output(op, out, received)
        return requests

    record = check_record(ctx, group, Record("all_to_all", None, array.dtype, array.shape, -1, group.members))
    op = Op("all_to_all", group, array.nbytes, post, lambda: result, record, (array, received), protections)
    return follow(start(ctx, op, result), source.back)


def _start_split(ctx: DistributedContext, source: Input, group: Group, splits: Any, out: Any,
                 protections: tuple[Any, ...]) -> CollectiveTensor:
    """`all_to_all` with splits: swap the counts, then ``MPI_Ialltoallv``."""
    array = source.buffer
    rows = row_counts(splits, array.shape, group, "all_to_all", "splits")
    assert rows is not None
    rest = array.shape[1:]
    if out is not None:  # everything but its length, which comes from the peers
        lead = tuple(getattr(out, "shape", ()))[:1] or (0,)
        output_buffer(ctx, out, (*lead, *rest), array.dtype, "all_to_all", (source.array, array))
    row = math.prod(rest)
    send_counts = [n * row for n in rows]
    send_displs = displacements(send_counts)
    later, device, datatype = Later(), result_device(ctx, source), mpi_datatype(array.dtype)
    failure: list[Exception] = []

    def post(incoming: list[int]) -> list[Any]:
        shape = (sum(incoming), *rest)
        received = _fitting(out, shape, failure)
        if received is None:
            received = ctx.pool.empty(shape, array.dtype)
        later.value = output_tensor(None if failure else out, received, device)
        counts = [n * row for n in incoming]
        displs = displacements(counts)
        requests = mpi.all_to_allv(group, array, send_counts, send_displs, received, counts, displs, datatype)
        if not failure:
            protect_output(op, out, received)
        return requests

    def finish() -> Any:
        if failure:
            raise failure[0]
        return later.value

    record = make_record((("splits", 1),), "all_to_all", None, array.dtype, (-1, *rest), -1, group.members)
    op = Op("all_to_all", group, array.nbytes, post, finish, record=record, keep=(array,),
            protections=protections, exchange=np.array(rows, np.int64), compare=ctx.config.check)
    return start(ctx, op, later)


def _refuse_overlap(out: Any, source: Input) -> None:
    """Refuse an `out` that shares memory with the input: blocks would be overwritten before they are sent.

    Raises:
        ValueError: `out` overlaps the input, saying what to pass instead.
    """
    array = out.array if isinstance(out, Tensor) else out
    if isinstance(array, np.ndarray) and np.may_share_memory(array, source.array):
        raise ValueError(
            "all_to_all: out= overlaps the input; all_to_all cannot write its result over its own input "
            "(a block would be overwritten before it is sent): pass a separate array of the result's "
            "shape and dtype, such as numpy.empty_like(input), or no out= for a new one"
        )


def _fitting(out: Any, shape: tuple[int, ...], failure: list[Exception]) -> np.ndarray | None:
    """`out`'s array when it has `shape`; else None, with the error noted in `failure`.

    Called when the data is posted: a wrong `out` must not keep this rank from taking
    part (its peers would wait), so the data is received elsewhere and the error raised
    when the op finishes.
    """
    if out is None:
        return None
    array = out.array if isinstance(out, Tensor) else out
    if array.shape == shape:
        return array
    failure.append(ValueError(f"all_to_all: out= has shape {array.shape}, but the result has shape {shape}"))
    return None
