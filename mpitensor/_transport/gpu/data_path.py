"""Which way a rank's GPU buffers reach MPI: handed over as they are, or staged through the host.

The decision (`cuda_aware.detect`) is made once per context, from its ``config.cuda_aware``
declaration, the environment and the MPI library; `device_buffers_ok` then says, per kind
of MPI call and reduction op, whether device buffers may go to MPI.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .cuda_aware import NONBLOCKING, CudaAwareness, detect

__all__ = ["cuda_awareness", "data_path", "data_path_name", "device_buffers_ok"]

_decisions: weakref.WeakKeyDictionary[Any, CudaAwareness] = weakref.WeakKeyDictionary()
_decisions_lock = threading.Lock()


def cuda_awareness(ctx: Any) -> CudaAwareness:
    """Whether MPI takes this rank's device buffers, and why (decided once per context).

    Args:
        ctx: an open context (its ``config.cuda_aware`` is the declaration).

    Returns:
        The decision (see `cuda_aware.detect`).

    Raises:
        ValueError: ``MPITENSOR_CUDA_AWARE`` is set to something other than 0, 1 or auto.
    """
    with _decisions_lock:
        found = _decisions.get(ctx)
        if found is None:
            found = detect(ctx.config.cuda_aware)
            _decisions[ctx] = found
        return found


def data_path(ctx: Any) -> str:
    """How this rank's GPU tensors reach MPI: ``"cuda-aware"``, ``"staged"``, or in which calls.

    Args:
        ctx: an open context.

    Returns:
        ``"cuda-aware"`` when device buffers go to MPI in every kind of call, ``"staged"``
        when in none, else e.g. ``"cuda-aware p2p,blocking"`` (see `CudaAwareness.path`).
    """
    return cuda_awareness(ctx).path


def data_path_name(ctx: Any) -> str:
    """The "path" column of ``python -m mpitensor info`` for a CUDA rank (`data_path`)."""
    return data_path(ctx)


def device_buffers_ok(ctx: Any, mpi_op: Any = None, operation: str = NONBLOCKING) -> bool:
    """Whether an operation may hand device buffers to MPI.

    Args:
        ctx: an open context.
        mpi_op: the reduction's MPI op, or None for data movement. A user-defined op
            (complex MAX/MIN, bfloat16) is NumPy code that MPI calls on the buffers, so it
            can only run on host memory.
        operation: the kind of MPI call (`cuda_aware.OPERATIONS`): mpitensor's collectives
            post non-blocking ones.

    Returns:
        True where this MPI takes device buffers in that kind of call (see
        `cuda_aware.vendor_scope`) and the op is predefined; False means stage.
    """
    if not cuda_awareness(ctx).takes(operation):
        return False
    return mpi_op is None or bool(mpi_op.is_predefined)
