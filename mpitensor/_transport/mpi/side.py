"""A communicator of its own for collectives that a second thread posts beside the program's.

A thread that is not the program's (the torch backend's completer, which runs communication
hooks' callbacks) cannot post on the group's communicator: its calls and the program's would
interleave in an order that differs between ranks. `SideComm` is a duplicate of the group's
communicator, made collectively as the group is; its calls poll their request against a
deadline, so a peer that never joins is a `CollectiveTimeoutError`, not a hang. Two threads
in MPI at once need ``MPI_THREAD_MULTIPLE`` (`has_thread_multiple`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._core.errors import CollectiveTimeoutError
from ..._core.mpi import MPI

__all__ = ["SideComm", "has_thread_multiple"]

# Between tests of a pending request: short against a message's latency, long enough that the
# polling thread leaves the core to the program's thread.
_PAUSE = 20e-6


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

    @property
    def size(self) -> int:
        """The number of ranks of the group."""
        return self._comm.Get_size()

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
        self._wait(self._comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), timeout)

    def all_gather_row(self, row: np.ndarray, timeout: float | None) -> np.ndarray:
        """Every rank's 1-d `row` (same dtype and length on every rank), as rows in rank order.

        Raises:
            CollectiveTimeoutError: a peer did not join within `timeout` seconds.
        """
        every = np.empty((self.size, row.size), row.dtype)
        self._wait(self._comm.Iallgather(row, every), timeout)
        return every

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable `value`, in rank order (blocking: call it when every peer calls)."""
        return self._comm.allgather(value)

    def _wait(self, request: Any, timeout: float | None) -> None:
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
