"""MPI's collectives in which every rank sends and receives alike: gathers, exchanges, reductions, barrier.

Each function posts non-blocking MPI calls on the group's data communicator and returns their
requests, as a transport's ``start`` does. The buffers are given as they are (contiguous
arrays), with the MPI datatype of one element; counts and displacements count elements, in
group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core.dtypes import mpi_datatype
from ..base import Channel

__all__ = [
    "all_gather", "all_gather_each", "all_gatherv", "all_to_all", "all_to_allv", "barrier", "exscan",
    "reduce_scatter", "reduce_scatter_block", "reduce_scatter_block_each", "scan",
]


def all_gather(channel: Channel, send: Any, recv: Any, datatype: Any) -> list[Any]:
    """``MPI_Iallgather``: every rank's `send` (all of one size) into every rank's `recv`, in group order.

    Args:
        channel: the group.
        send: this rank's data.
        recv: the buffer for every rank's data in turn (`channel.size` times `send`).
        datatype: the MPI datatype of one element.

    Returns:
        The request.
    """
    return [channel.comm.Iallgather([send, datatype], [recv, datatype])]


def all_gather_each(channel: Channel, sends: Sequence[Any], recvs: Sequence[Any]) -> list[Any]:
    """One ``MPI_Iallgather`` per pair of buffers, each with its dtype's datatype (packed buckets).

    Args:
        channel: the group.
        sends: this rank's NumPy arrays.
        recvs: for each, the array every rank's copy lands in.

    Returns:
        The requests, one per pair, in order.
    """
    comm = channel.comm
    return [comm.Iallgather([send, mpi_datatype(send.dtype)], [recv, mpi_datatype(send.dtype)])
            for send, recv in zip(sends, recvs)]


def all_gatherv(channel: Channel, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int],
                datatype: Any) -> list[Any]:
    """``MPI_Iallgatherv``: every rank's `send` (of its own size) into every rank's `recv`.

    Args:
        channel: the group.
        send: this rank's data.
        recv: the buffer it all lands in.
        counts: each rank's element count.
        displs: where each rank's elements start in `recv`.
        datatype: the MPI datatype of one element.

    Returns:
        The request.
    """
    return [channel.comm.Iallgatherv([send, datatype], [recv, counts, displs, datatype])]


def all_to_all(channel: Channel, send: Any, recv: Any, datatype: Any) -> list[Any]:
    """``MPI_Ialltoall``: block k of `send` to rank k; rank k's block lands in block k of `recv`.

    Args:
        channel: the group.
        send: `channel.size` equal blocks, one per rank.
        recv: as large as `send`.
        datatype: the MPI datatype of one element.

    Returns:
        The request.
    """
    return [channel.comm.Ialltoall([send, datatype], [recv, datatype])]


def all_to_allv(channel: Channel, send: Any, send_counts: Sequence[int], send_displs: Sequence[int], recv: Any,
                recv_counts: Sequence[int], recv_displs: Sequence[int], datatype: Any) -> list[Any]:
    """``MPI_Ialltoallv``: blocks of any size, `send_counts[k]` elements to rank k.

    Args:
        channel: the group.
        send: this rank's data.
        send_counts: elements sent to each rank.
        send_displs: where each rank's elements start in `send`.
        recv: the buffer what arrives lands in.
        recv_counts: elements received from each rank.
        recv_displs: where each rank's elements start in `recv`.
        datatype: the MPI datatype of one element.

    Returns:
        The request.
    """
    return [channel.comm.Ialltoallv([send, send_counts, send_displs, datatype],
                                    [recv, recv_counts, recv_displs, datatype])]


def reduce_scatter_block(channel: Channel, send: Any, recv: Any, datatype: Any, op: Any) -> list[Any]:
    """``MPI_Ireduce_scatter_block``: block k of the reduction of every rank's `send` into rank k's `recv`.

    Args:
        channel: the group.
        send: `channel.size` equal blocks.
        recv: one block.
        datatype: the MPI datatype of one element.
        op: the MPI reduction op.

    Returns:
        The request.
    """
    return [channel.comm.Ireduce_scatter_block([send, datatype], [recv, datatype], op)]


def reduce_scatter_block_each(channel: Channel, sends: Sequence[Any], recvs: Sequence[Any],
                              plans: Sequence[Any]) -> list[Any]:
    """One ``MPI_Ireduce_scatter_block`` per bucket (packed buckets of their own reduce plans).

    Args:
        channel: the group.
        sends: each bucket's `channel.size` equal blocks.
        recvs: each bucket's block of the result.
        plans: each bucket's `ReducePlan` (its ``datatype`` and ``mpi_op``).

    Returns:
        The requests, one per bucket, in order.
    """
    comm = channel.comm
    return [comm.Ireduce_scatter_block([send, plan.datatype], [recv, plan.datatype], plan.mpi_op)
            for send, recv, plan in zip(sends, recvs, plans)]


def reduce_scatter(channel: Channel, send: Any, recv: Any, recv_counts: Sequence[int], datatype: Any,
                   op: Any) -> list[Any]:
    """``MPI_Ireduce_scatter``: the reduction of every rank's `send`, `recv_counts[k]` elements to rank k.

    Args:
        channel: the group.
        send: this rank's data (the sum of `recv_counts` elements).
        recv: this rank's part of the result.
        recv_counts: each rank's element count, in group order.
        datatype: the MPI datatype of one element.
        op: the MPI reduction op.

    Returns:
        The request.
    """
    return [channel.comm.Ireduce_scatter([send, datatype], [recv, datatype], recv_counts, op)]


def scan(channel: Channel, send: Any, recv: Any, datatype: Any, op: Any) -> list[Any]:
    """``MPI_Iscan``: the reduction of the `send` of ranks 0..k into rank k's `recv`.

    Args:
        channel: the group.
        send: this rank's data.
        recv: the buffer its prefix lands in (as large as `send`).
        datatype: the MPI datatype of one element.
        op: the MPI reduction op.

    Returns:
        The request.
    """
    return [channel.comm.Iscan([send, datatype], [recv, datatype], op)]


def exscan(channel: Channel, send: Any, recv: Any, datatype: Any, op: Any) -> list[Any]:
    """``MPI_Iexscan``: the reduction of the `send` of ranks 0..k-1 into rank k's `recv` (undefined on rank 0).

    Args:
        channel: the group.
        send: this rank's data.
        recv: the buffer its prefix lands in (as large as `send`).
        datatype: the MPI datatype of one element.
        op: the MPI reduction op.

    Returns:
        The request.
    """
    return [channel.comm.Iexscan([send, datatype], [recv, datatype], op)]


def barrier(channel: Channel) -> list[Any]:
    """``MPI_Ibarrier``: completes once every rank of the group has posted it.

    Args:
        channel: the group.

    Returns:
        The request.
    """
    return [channel.comm.Ibarrier()]
