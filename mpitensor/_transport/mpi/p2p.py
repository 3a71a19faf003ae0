"""MPI's point-to-point messages, on the channel of a context's point-to-point communicator.

Unlike the collectives, each call returns its one request: a message is a piece of a
protocol (`send` and `recv` pair a header with the data), and the caller tests or gathers
the requests as that protocol needs.
"""

from __future__ import annotations

from typing import Any

from ..._core.mpi import MPI
from ..base import Channel

__all__ = ["any_source", "recv", "send", "status"]


def send(channel: Channel, buffer: Any, datatype: Any | None, dest: int, tag: int) -> Any:
    """``MPI_Isend`` of `buffer` to rank `dest` of the channel.

    Args:
        channel: the point-to-point group.
        buffer: the data; not to be written until the request completes.
        datatype: the MPI datatype of one element; None to take it from the buffer's format.
        dest: the receiving rank.
        tag: the message's tag.

    Returns:
        The request.
    """
    return channel.comm.Isend(buffer if datatype is None else [buffer, datatype], dest, tag)


def recv(channel: Channel, buffer: Any, datatype: Any | None, source: int, tag: int) -> Any:
    """``MPI_Irecv`` into `buffer` from rank `source` of the channel.

    Args:
        channel: the point-to-point group.
        buffer: where the message lands (at least as large as it).
        datatype: the MPI datatype of one element; None to take it from the buffer's format.
        source: the sending rank.
        tag: the message's tag.

    Returns:
        The request.
    """
    return channel.comm.Irecv(buffer if datatype is None else [buffer, datatype], source, tag)


def any_source() -> int:
    """MPI's ``MPI_ANY_SOURCE``: a receive's source that takes the first matching message of any rank."""
    return MPI.ANY_SOURCE


def status() -> Any:
    """A fresh ``MPI_Status`` (whose source a completed receive from any rank fills)."""
    return MPI.Status()
