"""All-reduces that a future's callback starts (PowerSGD's): on a communicator of their own.

A callback runs on the completer thread while the program's thread goes on posting the
group's collectives; both on one communicator would post in an order that differs between
ranks. So a callback's collective goes to a duplicate of the group's communicator, made as
the group is, in the order the completer runs callbacks (the same on every rank). Each such
call first agrees with its peers on what it reduces (operation, dtype, shapes and its place
among the callbacks): ranks that differ get ``CollectiveMismatchError`` on every rank, not
a hang. It needs ``MPI_THREAD_MULTIPLE`` (two threads in MPI at once).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import mpitensor as mt

from .. import integration
from ..integration import SideComm
from ._reduce_ops import reduce_operation

__all__ = ["HookCollectives"]

_OPERATIONS = {"SUM", "MEAN"}
_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64}


class HookCollectives:
    """The collectives of callbacks on one group's own duplicate communicator.

    Args:
        comm: a communicator of the group's ranks for callbacks alone (freed by `free`).
        timeout: seconds a call may take; None for the mpitensor context's timeout.
    """

    def __init__(self, comm: SideComm, timeout: float | None) -> None:
        self._comm = comm
        self._timeout = timeout
        self._calls: dict[int | None, int] = {}
        self._broken: BaseException | None = None

    def free(self) -> None:
        """Free the communicator (the group is ending)."""
        self._comm.free()

    def all_reduce(self, tensors: Sequence[torch.Tensor], opts: Any, chain: int | None) -> list[torch.Tensor]:
        """Reduce each CPU tensor in place over the group (``SUM``, ``AVG``, ``PREMUL_SUM``).

        Args:
            tensors: contiguous CPU tensors of float32, float64, int32 or int64.
            opts: torch's ``AllreduceOptions`` (None for ``SUM``).
            chain: the chain of the callback that calls (its place in the ranks' order).

        Returns:
            The tensors, reduced.

        Raises:
            CollectiveMismatchError: the ranks disagree, or a rank's call is not supported.
            CollectiveTimeoutError: the peers did not join in time (this communicator is then
                unusable).
            MpitensorError: MPI gives no ``MPI_THREAD_MULTIPLE``.
        """
        _check_threads()
        if self._broken is not None:
            raise mt.ContextBrokenError(f"a callback's earlier collective failed: {self._broken}")
        op, factor = reduce_operation(opts.reduceOp) if opts is not None else (mt.ReduceOperation.SUM, None)
        index = self._calls.get(chain, 0)
        self._calls[chain] = index + 1
        problem = _problem(tensors, op, factor)
        what = (
            f"all_reduce {op.name}{'' if factor is None else f' x{factor}'} of "
            f"{[(str(t.dtype), tuple(t.shape)) for t in tensors]}, callback chain {chain} call {index}"
        )
        self._agree(what, problem)
        for tensor in tensors:
            if factor is not None:
                tensor.mul_(factor)
            self._timed(self._comm.all_reduce_sum, tensor.detach().numpy())
            if op is mt.ReduceOperation.MEAN:
                tensor.div_(self._comm.size)
        return list(tensors)

    def _agree(self, what: str, problem: str | None) -> None:
        mine = np.array([zlib.crc32(what.encode()), problem is not None], np.int64)
        every = self._timed(self._comm.all_gather_row, mine)
        if (every[:, 0] == mine[0]).all() and not every[:, 1].any():
            return
        calls = self._comm.all_gather_object(problem or what)  # every rank is here: the first gather showed it
        lines = "; ".join(f"rank {rank}: {call}" for rank, call in enumerate(calls))
        raise mt.CollectiveMismatchError(
            "a communication hook's callback started a collective its peers did not match "
            f"(callbacks whose collectives differ between ranks, or one not supported there): {lines}"
        )

    def _timed(self, call: Any, array: np.ndarray) -> Any:
        timeout = self._timeout if self._timeout is not None else mt.current_context().timeout
        try:
            return call(array, timeout)
        except mt.CollectiveTimeoutError as error:
            self._broken = mt.CollectiveTimeoutError(
                f"a communication hook's collective did not complete within {timeout} s "
                "(a peer did not start it: is its backward stuck, or did it fail?)"
            )
            raise self._broken from error


def _check_threads() -> None:
    if not integration.thread_multiple():
        raise mt.MpitensorError(
            "a collective inside a future's callback (PowerSGD's hook) needs MPI_THREAD_MULTIPLE, "
            "which this MPI does not provide; use a hook whose callbacks start no collectives"
        )


def _problem(tensors: Sequence[torch.Tensor], op: mt.ReduceOperation, factor: float | None) -> str | None:
    """Why this rank cannot take part, or None."""
    if op.name not in _OPERATIONS:
        return f"{op.name} is not supported inside a callback (SUM, AVG and PREMUL_SUM are)"
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype not in _DTYPES or not tensor.is_contiguous():
            return (
                f"a {tensor.device.type} tensor of {tensor.dtype} is not supported inside a callback "
                "(contiguous CPU tensors of float32, float64, int32 and int64 are)"
            )
        if (op is mt.ReduceOperation.MEAN or factor is not None) and not tensor.is_floating_point():
            return f"AVG and PREMUL_SUM of {tensor.dtype} are not supported inside a callback (floats only)"
    return None
