"""All-reduces that a future's callback starts (PowerSGD's): on a communicator of their own.

A callback runs on the completer thread while the program's thread goes on posting the
group's collectives; both on one communicator would post in an order that differs between
ranks. So a callback's collective goes to a duplicate of the group's communicator, made as
the group is, in the order the completer runs callbacks (the same on every rank). Each such
call first agrees with its peers on what it reduces (operation, dtype, shapes and its place
among the callbacks): ranks that differ get ``CollectiveMismatchError`` on every rank, not
a hang. It needs ``MPI_THREAD_MULTIPLE`` (two threads in MPI at once).

A callback that starts a collective on one rank while its peers' callbacks of that chain
start none would wait for them for good. So a call whose agreement waited a second asks its
peers (a note to each: "I wait at call *slot*, call *i* of chain *c*"); a peer's completer
answers in `serve`: once its own chain *c* has run every callback (and it made no call
*slot* of its own), it gives the agreement a *stand-in* row saying so. The call then
completes on every rank as a mismatch: the caller's callback raises it, and each peer raises
it at its next call on the group (the callbacks' communicator is in step again on every rank).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import mpitensor as mt

from .. import integration
from ..integration import SideComm
from ._agreement import agreed, call_row, each_rank
from ._reduce_ops import reduce_operation

__all__ = ["HookCollectives"]

_OPERATIONS = {"SUM", "MEAN"}
_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64}
# An agreement's row: [kind, hash of the call, problem, chain, call or calls] (int64); kind
# CALL (`_agreement`) or a stand-in's.
_STAND_IN = 2
# How long an agreement waits before it asks its peers whether their callbacks will join.
_ASK_AFTER = 1.0
_PAUSE = 20e-6
# How long the program's thread awaits a stand-in in flight as it enters a call.
_STAND_IN_WAIT = 0.05


class HookCollectives:
    """The collectives of callbacks on one group's own duplicate communicator.

    Args:
        comm: a communicator of the group's ranks for callbacks alone (freed by `free`).
        timeout: seconds a call may take; None for the mpitensor context's timeout.
        finished: whether a chain has run every callback it will ever run on this rank.
    """

    def __init__(self, comm: SideComm, timeout: float | None, finished: Callable[[int], bool]) -> None:
        self._comm: SideComm | None = comm
        self._timeout = timeout
        self._finished = finished
        self._calls: dict[int, int] = {}  # per chain: collectives its callbacks started
        self._slots = 0  # collectives posted on the communicator
        self._asked: dict[int, tuple[int, int, int]] = {}  # per slot: (chain, asking rank, its call)
        self._stand_ins: list[tuple[Any, int]] = []  # stand-in rows in flight, with their slot's chain
        self._broken: BaseException | None = None
        self._lock = threading.Lock()  # the server (completer thread) against free (the program's)
        self.failure: mt.CollectiveMismatchError | None = None  # found by the server, not raised yet

    def free(self) -> None:
        """Free the communicator (the group is ending)."""
        with self._lock:
            if self._comm is not None:
                self._comm.free()
            self._comm = None

    def clear(self) -> bool:
        """Whether the server has nothing for the program's thread (no mismatch found, no stand-in in flight)."""
        return self.failure is None and not self._stand_ins

    def take_failure(self) -> mt.CollectiveMismatchError | None:
        """The mismatch the server found since the last call (to raise on the program's thread), once.

        A stand-in row in flight is awaited a moment: once this rank posted it, the peers'
        rows are usually there (the rank that asked completes its call only with them).
        """
        if self._stand_ins:
            deadline = time.monotonic() + _STAND_IN_WAIT
            with self._lock:
                while self._stand_ins and self._comm is not None and time.monotonic() < deadline:
                    self._settle_stand_ins()
        failure, self.failure = self.failure, None
        return failure

    def all_reduce(self, tensors: Sequence[torch.Tensor], opts: Any, chain: int | None) -> list[torch.Tensor]:
        """Reduce each CPU tensor in place over the group (``SUM``, ``AVG``, ``PREMUL_SUM``).

        Args:
            tensors: contiguous CPU tensors of float32, float64, int32 or int64.
            opts: torch's ``AllreduceOptions`` (None for ``SUM``).
            chain: the chain of the callback that calls (its place in the ranks' order).

        Returns:
            The tensors, reduced.

        Raises:
            CollectiveMismatchError: the ranks disagree, a rank's call is not supported, or a
                peer's callbacks of this chain ended without this call.
            CollectiveTimeoutError: the peers did not join in time (this communicator is then
                unusable).
            MpitensorError: MPI gives no ``MPI_THREAD_MULTIPLE``.
        """
        _check_threads()
        if self._broken is not None:
            raise mt.ContextBrokenError(f"a callback's earlier collective failed: {self._broken}")
        op, factor = reduce_operation(opts.reduceOp) if opts is not None else (mt.ReduceOperation.SUM, None)
        chain = -1 if chain is None else chain
        index = self._calls.get(chain, 0)
        self._calls[chain] = index + 1
        problem = _problem(tensors, op, factor)
        what = (
            f"all_reduce {op.name}{'' if factor is None else f' x{factor}'} of "
            f"{[(str(t.dtype), tuple(t.shape)) for t in tensors]}, callback chain {chain} call {index}"
        )
        self._agree(what, problem, chain, index)
        for tensor in tensors:
            if factor is not None:
                tensor.mul_(factor)
            self._slots += 1
            self._timed(self._comm.all_reduce_sum, tensor.detach().numpy())
            if op is mt.ReduceOperation.MEAN:
                tensor.div_(self._comm.size)
        return list(tensors)

    def serve(self) -> None:
        """Answer peers that wait for a collective this rank's callbacks may never start (completer thread).

        A peer's note names the slot it waits at; once this rank has posted nothing there and
        the peer's chain has run every callback here, this rank posts a stand-in row for the
        slot. A stand-in's rows that show a mismatch become `failure`.
        """
        with self._lock:
            if self._comm is None:
                return
            for sender, (slot, chain, call) in self._comm.notes(3):
                self._asked[int(slot)] = (int(chain), sender, int(call))
            for slot in [slot for slot in self._asked if slot < self._slots]:
                del self._asked[slot]  # this rank posted its own call there
            asked = self._asked.pop(self._slots, None)
            if asked is not None and not self._finished(asked[0]):
                self._asked[self._slots] = asked  # its callbacks may still start it: asked again next time
            elif asked is not None:
                chain = asked[0]
                row = np.array([_STAND_IN, 0, 0, chain, self._calls.get(chain, 0)], np.int64)
                self._stand_ins.append((self._comm.start_gather_row(row), chain))
                self._slots += 1
            self._settle_stand_ins()

    def _settle_stand_ins(self) -> None:
        for pending, chain in list(self._stand_ins):
            rows = pending.test()
            if rows is None:
                continue
            self._stand_ins.remove((pending, chain))
            if (rows[:, 0] != _STAND_IN).any():
                self.failure = mt.CollectiveMismatchError(
                    "a communication hook's callback started a collective that this rank's callbacks "
                    f"did not (chain {chain}): {_rows_text(rows)}; "
                    "every rank's callbacks must start the same collectives"
                )

    def _agree(self, what: str, problem: str | None, chain: int, index: int) -> None:
        mine = call_row(what, problem is not None, chain, index)
        slot = self._slots
        self._slots += 1
        every = self._wait_asking(self._comm.start_gather_row(mine), slot, chain, index)
        if agreed(every, mine):
            return
        if (every[:, 0] == _STAND_IN).any():
            raise mt.CollectiveMismatchError(
                f"a communication hook's callback started a collective its peers' callbacks did not ({what}): "
                f"{_rows_text(every)}; every rank's callbacks must start the same collectives"
            )
        self._slots += 1
        lines = each_rank(self._comm, problem or what)  # every rank is here: the first gather showed it
        raise mt.CollectiveMismatchError(
            "a communication hook's callback started a collective its peers did not match "
            f"(callbacks whose collectives differ between ranks, or one not supported there): {lines}"
        )

    def _wait_asking(self, pending: Any, slot: int, chain: int, index: int) -> np.ndarray:
        """The agreement's rows; after `_ASK_AFTER` s, each peer is asked once whether it will join."""
        timeout = self._timeout if self._timeout is not None else mt.current_context().timeout
        start = time.monotonic()
        asked = False
        while (rows := pending.test()) is None:
            waited = time.monotonic() - start
            if not asked and waited >= _ASK_AFTER:
                asked = True
                note = np.array([slot, chain, index], np.int64)
                for peer in range(self._comm.size):
                    if peer != self._comm.rank:
                        self._comm.note(peer, note)
            if timeout is not None and waited >= timeout:
                self._broken = _timed_out(timeout)
                raise self._broken
            time.sleep(_PAUSE)
        return rows

    def _timed(self, call: Any, array: np.ndarray) -> Any:
        timeout = self._timeout if self._timeout is not None else mt.current_context().timeout
        try:
            return call(array, timeout)
        except mt.CollectiveTimeoutError as error:
            self._broken = _timed_out(timeout)
            raise self._broken from error


def _timed_out(timeout: float) -> mt.CollectiveTimeoutError:
    return mt.CollectiveTimeoutError(
        f"a communication hook's collective did not complete within {timeout} s "
        "(a peer did not start it: is its backward stuck, or did it fail?)"
    )


def _rows_text(rows: np.ndarray) -> str:
    """Each rank's row of an agreement, in words."""
    parts = []
    for rank, (kind, _, _, chain, count) in enumerate(rows.tolist()):
        if kind == _STAND_IN:
            parts.append(f"rank {rank}'s callbacks of chain {chain} had all run, having started {count} collective(s)")
        else:
            parts.append(f"rank {rank}'s callback started call {count} of chain {chain}")
    return "; ".join(parts)


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
