"""MPI's rooted collectives: one rank sends to the group (`broadcast`, `scatter`) or receives from it.

Each function posts one non-blocking MPI call on the group's data communicator and returns its
request in a list, as a transport's ``start`` does. The buffers are given as they are (contiguous
arrays), with the MPI datatype of one element; counts and displacements count elements. `root`
is the root's rank in the group (`Channel.rank` numbering), never its rank in the context. Off
the root, the root-only buffers are None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core.dtypes import mpi_datatype
from ..base import Channel

__all__ = ["broadcast", "broadcast_each", "gather", "gatherv", "reduce", "scatter", "scatterv"]


def broadcast(channel: Channel, buffer: Any, datatype: Any, root: int) -> list[Any]:
    """``MPI_Ibcast``: the root's `buffer` into every other rank's.

    Args:
        channel: the group.
        buffer: on the root the data sent, elsewhere the buffer it lands in (of the same size).
        datatype: the MPI datatype of one element.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    return [channel.comm.Ibcast([buffer, datatype], root=root)]


def broadcast_each(channel: Channel, buffers: Sequence[Any], root: int) -> list[Any]:
    """One ``MPI_Ibcast`` per buffer, each with its own dtype's datatype (packed buckets).

    Args:
        channel: the group.
        buffers: NumPy arrays: the root's data, or the buffers it lands in elsewhere.
        root: the root's rank in the group.

    Returns:
        The requests, one per buffer, in order.
    """
    comm = channel.comm
    return [comm.Ibcast([buffer, mpi_datatype(buffer.dtype)], root=root) for buffer in buffers]


def reduce(channel: Channel, send: Any, recv: Any, datatype: Any, op: Any, root: int) -> list[Any]:
    """``MPI_Ireduce``: the element-wise reduction of every rank's `send` into the root's `recv`.

    Args:
        channel: the group.
        send: this rank's data.
        recv: on the root the buffer the result lands in (as large as `send`); None elsewhere.
        datatype: the MPI datatype of one element.
        op: the MPI reduction op.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    receive = None if recv is None else [recv, datatype]
    return [channel.comm.Ireduce([send, datatype], receive, op, root=root)]


def gather(channel: Channel, send: Any, recv: Any, datatype: Any, root: int) -> list[Any]:
    """``MPI_Igather``: every rank's `send` (all of one size) into the root's `recv`, in group order.

    Args:
        channel: the group.
        send: this rank's data.
        recv: on the root the buffer for every rank's data in turn; None elsewhere.
        datatype: the MPI datatype of one element.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    receive = None if recv is None else [recv, datatype]
    return [channel.comm.Igather([send, datatype], receive, root=root)]


def gatherv(channel: Channel, send: Any, recv: Any, counts: Sequence[int] | None, displs: Sequence[int] | None,
            datatype: Any, root: int) -> list[Any]:
    """``MPI_Igatherv``: every rank's `send` (of its own size) into the root's `recv`.

    Args:
        channel: the group.
        send: this rank's data.
        recv: on the root the buffer it all lands in; None elsewhere.
        counts: on the root each rank's element count, in group order (ignored elsewhere).
        displs: on the root where each rank's elements start in `recv` (ignored elsewhere).
        datatype: the MPI datatype of one element.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    receive = None if recv is None else [recv, counts, displs, datatype]
    return [channel.comm.Igatherv([send, datatype], receive, root=root)]


def scatter(channel: Channel, send: Any, recv: Any, datatype: Any, root: int) -> list[Any]:
    """``MPI_Iscatter``: equal blocks of the root's `send`, block k into rank k's `recv`.

    Args:
        channel: the group.
        send: on the root the blocks of every rank in turn; None elsewhere.
        recv: the buffer this rank's block lands in.
        datatype: the MPI datatype of one element.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    spec = None if send is None else [send, datatype]
    return [channel.comm.Iscatter(spec, [recv, datatype], root=root)]


def scatterv(channel: Channel, send: Any, counts: Sequence[int] | None, displs: Sequence[int] | None, recv: Any,
             datatype: Any, root: int) -> list[Any]:
    """``MPI_Iscatterv``: `counts[k]` elements of the root's `send`, from `displs[k]`, into rank k's `recv`.

    Args:
        channel: the group.
        send: on the root the data to split; None elsewhere.
        counts: on the root each rank's element count, in group order (ignored elsewhere).
        displs: on the root where each rank's elements start in `send` (ignored elsewhere).
        recv: the buffer this rank's block lands in.
        datatype: the MPI datatype of one element.
        root: the root's rank in the group.

    Returns:
        The request.
    """
    spec = None if send is None else [send, counts, displs, datatype]
    return [channel.comm.Iscatterv(spec, [recv, datatype], root=root)]
