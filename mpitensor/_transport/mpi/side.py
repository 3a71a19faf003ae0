"""A communicator of its own for collectives that a second thread posts beside the program's.

A thread that is not the program's (the torch backend's completer, which runs communication
hooks' callbacks, or a helper thread that owns a torch group of its own) cannot post on the
group's communicator: its calls and the program's would interleave in an order that differs
between ranks. `SideComm` is a duplicate of the group's communicator, made collectively as
the group is; its calls poll their request against a deadline, so a peer that never joins is
a `CollectiveTimeoutError`, not a hang. Two threads in MPI at once need
``MPI_THREAD_MULTIPLE`` (`has_thread_multiple`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._core.errors import CollectiveTimeoutError
from ..._core.mpi import MPI

__all__ = ["PendingRows", "SideComm", "has_thread_multiple"]

# Between tests of a pending request: short against a message's latency, long enough that the
# polling thread leaves the core to the program's thread.
_PAUSE = 20e-6

# `SideComm.all_reduce`'s operations, by name: MPI's.
_OPERATIONS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}

# The tag of `SideComm.note`'s messages: apart from any tag a caller's own messages take.
_NOTE_TAG = 32_001  # MPI promises tags up to 32767 everywhere


def has_thread_multiple() -> bool:
    """Whether MPI runs at ``MPI_THREAD_MULTIPLE`` (any thread may call it at any time)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class SideComm:
    """A duplicate of a communicator, or of a group of its ranks, for a second thread's calls.

    Making one is collective over `comm` (every rank of it calls, with the same `ranks`).

    Args:
        comm: the communicator the group's ranks belong to.
        ranks: the group's ranks in `comm`, in group order; None for all of `comm`.
    """

    def __init__(self, comm: Any, ranks: Sequence[int] | None = None) -> None:
        self._comm = comm.Dup() if ranks is None else _create_group(comm, ranks)
        self._sent: list[Any] = []  # the notes whose sends may still be in flight

    @property
    def size(self) -> int:
        """The number of ranks of the group."""
        return self._comm.Get_size()

    @property
    def rank(self) -> int:
        """This rank's number in the group."""
        return self._comm.Get_rank()

    def free(self) -> None:
        """Free the communicator (a no-op once MPI is finalized or after a first call)."""
        if self._comm is not None and not MPI.Is_finalized():
            self._comm.Free()
        self._comm = None

    def all_reduce_sum(self, array: np.ndarray, timeout: float | None) -> None:
        """Sum the contiguous `array` over the group, in place.

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self.all_reduce(array, "sum", timeout)

    def all_reduce(self, array: np.ndarray, op: str, timeout: float | None) -> None:
        """Reduce the contiguous `array` over the group with `op`, in place.

        Args:
            array: a contiguous array of a type MPI reduces (floats, integers), the same dtype
                and length on every rank.
            op: ``"sum"``, ``"prod"``, ``"min"`` or ``"max"``.
            timeout: seconds to wait for the peers (None: no limit).

        Raises:
            KeyError: `op` is none of those.
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self._wait(self._comm.Iallreduce(MPI.IN_PLACE, array, op=getattr(MPI, _OPERATIONS[op])), timeout)

    def all_gather(self, data: np.ndarray, out: np.ndarray, timeout: float | None) -> None:
        """Every rank's bytes `data` (as many on every rank) into `out`, in rank order.

        Args:
            data: this rank's contiguous ``uint8`` array.
            out: a contiguous ``uint8`` array of the group's size times ``data.size``.
            timeout: seconds to wait for the peers (None: no limit).

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self._wait(self._comm.Iallgather(data, out), timeout)

    def broadcast(self, data: np.ndarray, root: int, timeout: float | None) -> None:
        """Group rank `root`'s bytes into every rank's `data`, in place.

        Args:
            data: a contiguous ``uint8`` array, as long on every rank (the root's is sent).
            root: the sending rank's number in the group.
            timeout: seconds to wait for the peers (None: no limit).

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self._wait(self._comm.Ibcast(data, root=root), timeout)

    def gather(self, data: np.ndarray, out: np.ndarray | None, root: int, timeout: float | None) -> None:
        """Every rank's bytes `data` (as many on every rank) into group rank `root`'s `out`, in rank order.

        Args:
            data: this rank's contiguous ``uint8`` array.
            out: on the root, a contiguous ``uint8`` array of the group's size times
                ``data.size``; elsewhere None.
            root: the receiving rank's number in the group.
            timeout: seconds to wait for the peers (None: no limit).

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self._wait(self._comm.Igather(data, out, root=root), timeout)

    def scatter(self, data: np.ndarray | None, out: np.ndarray, root: int, timeout: float | None) -> None:
        """Block k of group rank `root`'s bytes `data` into rank k's `out`.

        Args:
            data: on the root, a contiguous ``uint8`` array of the group's size times
                ``out.size`` (block k for rank k); elsewhere None.
            out: this rank's contiguous ``uint8`` array, as long on every rank.
            root: the sending rank's number in the group.
            timeout: seconds to wait for the peers (None: no limit).

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        self._wait(self._comm.Iscatter(data, out, root=root), timeout)

    def all_gather_row(self, row: np.ndarray, timeout: float | None) -> np.ndarray:
        """Every rank's 1-d `row` (same dtype and length on every rank), as rows in rank order.

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        every = np.empty((self.size, row.size), row.dtype)
        self._wait(self._comm.Iallgather(row, every), timeout)
        return every

    def start_gather_row(self, row: np.ndarray) -> PendingRows:
        """Start gathering every rank's 1-d `row` (as `all_gather_row`); the rows come from its `test`."""
        every = np.empty((self.size, row.size), row.dtype)
        return PendingRows(self._comm.Iallgather(row, every), every)

    def note(self, peer: int, values: np.ndarray) -> None:
        """Send `peer` a short int64 note without waiting (`notes` receives it there)."""
        request = self._comm.Isend(np.ascontiguousarray(values, np.int64), dest=peer, tag=_NOTE_TAG)
        self._sent = [sent for sent in self._sent if not sent.Test()]
        self._sent.append(request)

    def notes(self, length: int) -> list[tuple[int, np.ndarray]]:
        """The notes of `length` int64 that have arrived from any rank, as (sender, values), in arrival order."""
        arrived = []
        status = MPI.Status()
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTE_TAG, status=status):
            values = np.empty(length, np.int64)
            self._comm.Recv(values, source=status.Get_source(), tag=_NOTE_TAG)
            arrived.append((status.Get_source(), values))
        return arrived

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable `value`, in rank order (blocking: call it when every peer calls)."""
        return self._comm.allgather(value)

    def _wait(self, request: Any, timeout: float | None) -> None:
        _wait(request, timeout)


class PendingRows:
    """Rows an all-gather started by `SideComm.start_gather_row` is filling."""

    def __init__(self, request: Any, rows: np.ndarray) -> None:
        self._request = request
        self._rows = rows

    def test(self) -> np.ndarray | None:
        """The rows, one per rank in rank order, once every rank gave its own; else None."""
        return self._rows if self._request.Test() else None

    def wait(self, timeout: float | None) -> np.ndarray:
        """The rows, once every rank gave its own.

        Raises:
            CollectiveTimeoutError: a peer did not give its row within `timeout` seconds.
        """
        _wait(self._request, timeout)
        return self._rows


def _wait(request: Any, timeout: float | None) -> None:
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                f"a collective on a second thread's communicator did not complete within {timeout} s"
            )
        time.sleep(_PAUSE)


def _create_group(comm: Any, ranks: Sequence[int]) -> Any:
    group = comm.Get_group().Incl(list(ranks))
    try:
        return comm.Create_group(group)
    finally:
        group.Free()
