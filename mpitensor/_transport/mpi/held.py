"""MPI's collectives on buffers their caller holds, run to their end (`_collectives/held.py`).

Posted by the engine only once the call's consistency check has agreed, so every peer is
at the same call and waiting for the end waits for nobody who is not coming (as
`all_reduce.Held`). What is not reduced moves as ``MPI_BYTE`` (whatever the dtype), the counts
the compiled held lane passes for the same calls. Each call gives the core back while it
waits for a peer (`_core.idle.idle_call`: MPI's blocking call on Open MPI, else its
nonblocking one waited by mpitensor). Each takes ``(comm, source, out, spec)``, as the lane's
queued post calls it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._core.idle import idle_call
from ..._core.mpi import MPI

__all__ = ["held_all_gather", "held_all_to_all", "held_broadcast", "held_gather", "held_reduce"]


def held_broadcast(comm: Any, source: np.ndarray, out: np.ndarray, root: int) -> list[Any]:
    """``MPI_Bcast`` of the root's `source` into every rank's `out` (the root copies it in first).

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
    idle_call(comm.Bcast, comm.Ibcast, [out, out.nbytes, MPI.BYTE], root=root)
    return []


def held_all_gather(comm: Any, source: np.ndarray, out: np.ndarray, plan: Any = None) -> list[Any]:
    """``MPI_Allgather`` of every rank's `source` into every rank's `out`, in rank order.

    Args:
        comm: the group's communicator.
        source: this rank's input.
        out: the result buffer, `comm`'s size times `source`'s; not overlapping it.
        plan: unused (the compiled lane's queued post passes one).

    Returns:
        No request: the all-gather is done.
    """
    idle_call(comm.Allgather, comm.Iallgather, [source, source.nbytes, MPI.BYTE], [out, source.nbytes, MPI.BYTE])
    return []


def held_all_to_all(comm: Any, source: np.ndarray, out: np.ndarray, spec: Any = None) -> list[Any]:
    """``MPI_Alltoall``: block k of every rank's `source` into block (its rank) of rank k's `out`.

    Args:
        comm: the group's communicator.
        source: this rank's input, one equal block per rank.
        out: the result buffer, of `source`'s size; not overlapping it.
        spec: unused.

    Returns:
        No request: the exchange is done.
    """
    block = source.nbytes // comm.Get_size()
    idle_call(comm.Alltoall, comm.Ialltoall, [source, block, MPI.BYTE], [out, block, MPI.BYTE])
    return []


def held_gather(comm: Any, source: np.ndarray, out: np.ndarray, root: int) -> list[Any]:
    """``MPI_Gather`` of every rank's `source` into the root's `out` in rank order; `source` elsewhere.

    Args:
        comm: the group's communicator.
        source: this rank's input.
        out: on the root `comm`'s size times `source`'s size, elsewhere `source`'s; not overlapping it.
        root: the root's rank in `comm`.

    Returns:
        No request: the gather is done.
    """
    at_root = comm.Get_rank() == root
    idle_call(comm.Gather, comm.Igather, [source, source.nbytes, MPI.BYTE],
              [out, source.nbytes, MPI.BYTE] if at_root else None, root=root)
    if not at_root:
        np.copyto(out, source)
    return []


def held_reduce(comm: Any, source: np.ndarray, out: np.ndarray, spec: tuple[int, Any]) -> list[Any]:
    """``MPI_Reduce`` of every rank's `source` into the root's `out`; elsewhere `out` gets `source`.

    Args:
        comm: the group's communicator.
        source: this rank's input.
        out: the result buffer, of `source`'s shape and dtype; not overlapping it.
        spec: the root's rank in `comm` and the `ReducePlan` (its datatype and op; no codec,
            no division).

    Returns:
        No request: the reduction is done.
    """
    root, plan = spec
    at_root = comm.Get_rank() == root
    idle_call(comm.Reduce, comm.Ireduce, [source, plan.datatype], [out, plan.datatype] if at_root else None,
              op=plan.mpi_op, root=root)
    if not at_root:
        np.copyto(out, source)
    return []
