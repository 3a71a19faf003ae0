"""MPI's blocking broadcast and all-gather of buffers their caller holds (`_collectives/held.py`).

Posted by the engine only once the call's consistency check has agreed, so every peer is
at the same call and blocking waits for nobody who is not coming (as `all_reduce.Held`).
The bytes move as ``MPI_BYTE`` (whatever the dtype: nothing is reduced), the count the
compiled held lane passes for the same calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._core.mpi import MPI

__all__ = ["held_all_gather", "held_broadcast"]


def held_broadcast(comm: Any, source: np.ndarray, out: np.ndarray, root: int) -> list[Any]:
    """Blocking ``MPI_Bcast`` of the root's `source` into every rank's `out` (the root copies it in first).

    Args:
        comm: the group's communicator.
        source: this rank's input (read on the root only).
        out: the result buffer, of `source`'s size; not overlapping it.
        root: the root's rank in `comm`.

    Returns:
        No request: the broadcast is done.
    """
    if comm.Get_rank() == root:
        np.copyto(out, source)
    comm.Bcast([out, out.nbytes, MPI.BYTE], root=root)
    return []


def held_all_gather(comm: Any, source: np.ndarray, out: np.ndarray, plan: Any = None) -> list[Any]:
    """Blocking ``MPI_Allgather`` of every rank's `source` into every rank's `out`, in rank order.

    Args:
        comm: the group's communicator.
        source: this rank's input.
        out: the result buffer, `comm`'s size times `source`'s; not overlapping it.
        plan: unused (the compiled lane's queued post passes one).

    Returns:
        No request: the all-gather is done.
    """
    comm.Allgather([source, source.nbytes, MPI.BYTE], [out, source.nbytes, MPI.BYTE])
    return []
