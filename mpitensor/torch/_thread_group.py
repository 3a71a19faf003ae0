"""Groups made with ``dist.new_group``: each belongs to the thread that first uses it.

mpitensor's collectives run on the thread that opened the context, so that every rank posts
them in one order. A helper thread's collectives (``dcp.async_save`` plans its checkpoint on
one) cannot join that order. So a group made with ``dist.new_group`` belongs to the thread
that makes its first collective call on it: the context's thread keeps it an ordinary group;
any other thread makes it that thread's, and its calls then run on a communicator of the
group's own (made with the group, collectively), which no other thread posts on.

Each such call first agrees with its peers (`_agreement`: one small all-gather of a row, the
kind of call and a hash of what must agree: operation, dtype, shape, root), then moves its
data. Ranks whose calls differ get ``CollectiveMismatchError`` on every rank, naming each
rank's call; a rank whose own arguments are wrong raises its own error and still posts a row
marking its failure, so that its peers raise a mismatch naming it instead of waiting; the
next call is right on every rank. Every wait polls against the group's timeout.

A call from another thread while the owning thread lives is a ``ThreadMisuseError``; once
that thread has ended, the next thread to call takes the group over (``dcp.async_save`` runs
each save on a thread of its own). Two threads in MPI at once need ``MPI_THREAD_MULTIPLE``.
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

__all__ = ["OWN_GROUP", "ThreadGroup"]

# What a helper thread's collectives need, said where the context's thread's group refuses them.
OWN_GROUP = (
    "A helper thread's collectives (dcp.async_save's) need a group of their own: a group made on every "
    "rank with dist.new_group(...) belongs to the thread that first calls a collective on it (with "
    "MPI_THREAD_MULTIPLE; else dist.new_group(backend='gloo')); pass it as the call's group "
    "(dcp.async_save's process_group=)"
)
# Where a call a thread-owned group does not run can be made.
_ELSEWHERE = "make it on a gloo group (dist.new_group(backend='gloo')) or on a group of the program's thread"

# How long a call from another thread waits for the owning thread to end before it is
# refused: dcp.async_save's next save may start its thread while the last one's is ending.
_HANDOVER_WAIT = 1.0
_PAUSE = 1e-3

# The reductions a thread-owned group runs: mpitensor's operation -> (MPI's, torch's name).
_REDUCTIONS = {
    mt.ReduceOperation.SUM: ("sum", "SUM"),
    mt.ReduceOperation.MEAN: ("sum", "AVG"),
    mt.ReduceOperation.PROD: ("prod", "PRODUCT"),
    mt.ReduceOperation.MIN: ("min", "MIN"),
    mt.ReduceOperation.MAX: ("max", "MAX"),
}
_REDUCED = frozenset({torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


class ThreadGroup:
    """The collectives of a ``dist.new_group`` group once a thread other than the context's owns it.

    Args:
        comm: a communicator of the group's ranks for the owning thread alone (freed by `free`).
        ranks: the group's ranks in the context, in group order (None: every rank).
        timeout: seconds a call may take; None for the context's timeout.
    """

    def __init__(self, comm: SideComm, ranks: Sequence[int] | None, timeout: float | None) -> None:
        self._comm: SideComm | None = comm
        self._ranks = None if ranks is None else list(ranks)
        self._rank = comm.rank
        self._size = comm.size
        self._ctx = mt.current_context()
        self._timeout = timeout
        self._owner: threading.Thread | None = None
        self._lock = threading.Lock()  # claims from two threads at once
        self._turns = 0  # agreements this rank took part in
        self._broken: BaseException | None = None

    def claim(self, kind: str) -> bool:
        """Whether the calling thread owns the group (its calls run here), claiming it at the first call.

        Args:
            kind: torch's name of the call, for messages.

        Returns:
            True for the owning thread's call; False where the context's thread makes the
            group's first call (the group is then an ordinary one, never this thread's).

        Raises:
            ThreadMisuseError: another thread owns the group and did not end within a second.
            MpitensorError: MPI gives no ``MPI_THREAD_MULTIPLE`` (the group stays unclaimed).
        """
        current = threading.current_thread()
        owner = self._owner
        if owner is current:
            return True
        if owner is None:
            with self._lock:
                owner = self._owner
                if owner is None:
                    if current.ident == self._ctx.owner_thread:
                        return False
                    _check_threads(kind, current)
                    self._owner = current
                    return True
        deadline = time.monotonic() + _HANDOVER_WAIT
        while owner.is_alive() and time.monotonic() < deadline:
            time.sleep(_PAUSE)
        with self._lock:
            if self._owner is owner and not owner.is_alive():
                self._owner = current  # its thread ended: nothing of it can interleave with this one
            if self._owner is current:
                return True
        raise mt.ThreadMisuseError(
            f"{kind} on the process group of ranks {self._members()} was called from thread {current.name!r}, "
            f"but the group belongs to thread {owner.name!r}, which made its first collective call: a group made "
            "with dist.new_group runs its collectives on one thread, so that every rank makes them in one order. "
            "Call it from that thread (once that thread has ended, the next thread to call takes the group over), "
            "or give this thread a group of its own (dist.new_group(...))"
        )

    def door(self, kind: str) -> _Turn:
        """The door of a call of `kind` (torch's object collectives enter it around their calls).

        An error inside it before the call's agreement takes the call's turn: this rank posts
        a row marking its failure, so that the peers raise a mismatch naming it.
        """
        return _Turn(self, kind)

    def run(self, kind: str, args: Sequence[Any]) -> list[torch.Tensor]:
        """Make torch's call `kind` with the process group method's `args`, on the owning thread; complete on return.

        Args:
            kind: torch's name of the call (``"all_reduce"``, ``"all_gather_into_tensor"``...).
            args: what torch passed the process group's method.

        Returns:
            The output tensors, written.

        Raises:
            CollectiveMismatchError: the ranks' calls differ, or a peer's failed there.
            NotImplementedError: a call the group does not run (on every rank that makes it).
            ValueError, TypeError, DeviceError: this rank's own arguments (its peers then
                raise a mismatch naming it).
            CollectiveTimeoutError: a peer did not join within the group's timeout (the group
                is then unusable).
            ContextBrokenError: an earlier call of the group timed out.
        """
        self._check_usable(kind)
        with self.door(kind):
            operation = _OPERATIONS.get(kind)
            if operation is None:
                raise NotImplementedError(
                    f"{kind} on a group that a helper thread owns: such a group runs all_reduce, all_gather, "
                    "all_gather_into_tensor, broadcast, gather, scatter and barrier (and the object collectives "
                    f"built on them); {_ELSEWHERE}"
                )
            return operation(self, *args)

    def point_to_point(self, kind: str) -> NotImplementedError:
        """The error of a send or receive on the group (refused on the calling rank alone: only its peer would join)."""
        return NotImplementedError(
            f"{kind} on a group that a helper thread owns: such a group runs collectives only; {_ELSEWHERE}"
        )

    def free(self) -> None:
        """Free the communicator (the group is ending)."""
        with self._lock:
            if self._comm is not None:
                self._comm.free()
            self._comm = None

    # -- the agreement ----------------------------------------------------------------------

    def _agree(self, what: str) -> None:
        """Agree with every peer that its call is `what`; on a mismatch, raise naming each rank's call."""
        mine = call_row(what, False)
        rows = self._timed(what.partition(" ")[0], self._comm.all_gather_row, mine)
        self._turns += 1
        if agreed(rows, mine):
            return
        lines = each_rank(self._comm, what, self._global)  # every rank is here: the rows showed it
        raise mt.CollectiveMismatchError(
            f"the ranks' calls on the group of ranks {self._members()} (owned by a helper thread) differ: {lines}; "
            "every rank's thread must make the same calls on the group, in one order"
        )

    def _fail(self, kind: str, error: Exception) -> None:
        """Take the turn of a call that failed on this rank before its agreement (the peers learn why)."""
        said = f"{kind} failed there: {type(error).__name__}: {error}"
        try:
            self._timed(kind, self._comm.all_gather_row, call_row(said, True))
        except mt.CollectiveTimeoutError:
            return  # this rank's own error goes on; the group is unusable
        self._turns += 1
        each_rank(self._comm, said, self._global)

    def _check_usable(self, kind: str) -> None:
        if self._broken is not None:
            raise mt.ContextBrokenError(
                f"{kind} on a group that a helper thread owns: an earlier call of the group failed "
                f"({self._broken}); make a new group"
            )
        if self._comm is None:
            raise mt.MpitensorError(f"{kind} on a group that was destroyed (dist.destroy_process_group)")

    def _timed(self, kind: str, call: Callable[..., Any], *args: Any) -> Any:
        timeout = self._timeout if self._timeout is not None else self._ctx.timeout
        try:
            return call(*args, timeout)
        except mt.CollectiveTimeoutError as error:
            self._broken = mt.CollectiveTimeoutError(
                f"{kind} on the group of ranks {self._members()} (owned by a helper thread) did not complete "
                f"within {timeout} s: a peer did not make it (did its thread fail, or call from another thread?)"
            )
            raise self._broken from error

    def _global(self, rank: int) -> int:
        return rank if self._ranks is None else self._ranks[rank]

    def _members(self) -> list[int]:
        return list(range(self._size)) if self._ranks is None else self._ranks

    # -- the calls --------------------------------------------------------------------------

    def _all_reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> list[torch.Tensor]:
        tensor = _one(tensors, "all_reduce")
        op, factor = reduce_operation(opts.reduceOp) if opts is not None else (mt.ReduceOperation.SUM, None)
        if factor is not None or op not in _REDUCTIONS:
            name = "PREMUL_SUM" if factor is not None else op.name
            raise NotImplementedError(f"all_reduce {name} on a group that a helper thread owns: it reduces with "
                                      f"SUM, AVG, PRODUCT, MIN and MAX; {_ELSEWHERE}")
        if tensor.dtype not in _REDUCED:
            raise TypeError(f"all_reduce of {tensor.dtype} on a group that a helper thread owns: it reduces "
                            f"float32, float64 and integer tensors (int8 to int64, uint8); {_ELSEWHERE}")
        mpi_op, name = _REDUCTIONS[op]
        self._agree(f"all_reduce {name} of {_described(tensor)}")
        values = _private(tensor)
        array = values.numpy()
        self._timed("all_reduce", self._comm.all_reduce, array.reshape(-1), mpi_op)
        if op is mt.ReduceOperation.MEAN:
            if tensor.is_floating_point():
                array /= self._size
            else:  # truncated toward zero, as the context's thread's groups do
                array[...] = np.trunc(array / self._size)
        _write(tensor, values)
        return [tensor]

    def _all_gather(self, output_lists: Sequence[list[torch.Tensor]], inputs: Sequence[torch.Tensor],
                    opts: Any = None) -> list[torch.Tensor]:
        tensor = _one(inputs, "all_gather")
        outputs = _only(output_lists, "all_gather")
        self._check_blocks(outputs, tensor, "all_gather", "tensor_list")
        self._agree(f"all_gather of {_described(tensor)}")
        received = _empty(tensor, self._size)
        self._timed("all_gather", self._comm.all_gather, _bytes(tensor), _as_bytes(received))
        for output, row in zip(outputs, received):
            _write(output, row)
        return list(outputs)

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - torch's name
                         opts: Any = None) -> list[torch.Tensor]:
        what = "all_gather_into_tensor"
        _cpu(output, what)
        _cpu(input, what)
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: the output is {output.dtype} and the input {input.dtype}; pass one dtype")
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"{what}: the output has {output.numel()} elements, but the input's {input.numel()} "
                             f"times the group's {self._size} ranks is {input.numel() * self._size}")
        self._agree(f"{what} of {_described(input)}")
        received = _empty(input, self._size)
        self._timed(what, self._comm.all_gather, _bytes(input), _as_bytes(received))
        _write(output, received)
        return [output]

    def _broadcast(self, tensors: Sequence[torch.Tensor], opts: Any) -> list[torch.Tensor]:
        tensor = _one(tensors, "broadcast")
        root = self._root(opts, "broadcast")
        self._agree(f"broadcast of {_described(tensor)} from rank {self._global(root)}")
        data = _bytes(tensor)
        self._timed("broadcast", self._comm.broadcast, data, root)
        if self._rank != root:
            _write(tensor, torch.from_numpy(data).view(tensor.dtype))
        return [tensor]

    def _gather(self, output_lists: Sequence[list[torch.Tensor]], inputs: Sequence[torch.Tensor],
                opts: Any) -> list[torch.Tensor]:
        tensor = _one(inputs, "gather")
        root = self._root(opts, "gather")
        outputs = None
        if self._rank == root:
            outputs = _only(output_lists, "gather")
            self._check_blocks(outputs, tensor, "gather", "gather_list")
        self._agree(f"gather of {_described(tensor)} to rank {self._global(root)}")
        received = None if outputs is None else _empty(tensor, self._size)
        self._timed("gather", self._comm.gather, _bytes(tensor), None if received is None else _as_bytes(received),
                    root)
        if outputs is None:
            return []
        for output, row in zip(outputs, received):
            _write(output, row)
        return list(outputs)

    def _scatter(self, outputs: Sequence[torch.Tensor], input_lists: Sequence[list[torch.Tensor]],
                 opts: Any) -> list[torch.Tensor]:
        output = _one(outputs, "scatter")
        root = self._root(opts, "scatter")
        data = None
        if self._rank == root:
            inputs = _only(input_lists, "scatter")
            self._check_blocks(inputs, output, "scatter", "scatter_list")
            data = np.concatenate([_bytes(tensor) for tensor in inputs])
        self._agree(f"scatter of {_described(output)} from rank {self._global(root)}")
        received = _empty(output, 1)
        self._timed("scatter", self._comm.scatter, data, _as_bytes(received), root)
        _write(output, received)
        return [output]

    def _barrier(self, opts: Any = None) -> list[torch.Tensor]:
        self._agree("barrier")  # every rank's row arrived: every rank is here
        return []

    def _root(self, opts: Any, what: str) -> int:
        root = int(opts.rootRank)
        if not 0 <= root < self._size:
            raise ValueError(f"{what}: root rank {root} is not a rank of the group's {self._size}")
        return root

    def _check_blocks(self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str, argument: str) -> None:
        """Check a list of one tensor per rank, each of `like`'s dtype and number of elements."""
        if len(tensors) != self._size:
            raise ValueError(f"{what}: {argument} has {len(tensors)} tensors, but the group has {self._size} ranks")
        for tensor in tensors:
            _cpu(tensor, what)
            if tensor.dtype != like.dtype:
                raise TypeError(f"{what}: {argument} has a tensor of {tensor.dtype}, but the call's tensors are "
                                f"{like.dtype}; pass tensors of one dtype")
            if tensor.numel() != like.numel():
                raise ValueError(f"{what}: {argument} has a tensor of {tensor.numel()} elements, but each must "
                                 f"have {like.numel()} (the size of every rank's tensor)")


class _Turn:
    """A thread-owned group's door: an error before the call's agreement posts a failed row (`ThreadGroup.door`)."""

    def __init__(self, group: ThreadGroup, kind: str) -> None:
        self._group = group
        self._kind = kind
        self._turns = 0

    def __enter__(self) -> _Turn:
        self._turns = self._group._turns
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        group = self._group
        if (isinstance(error, Exception) and group._turns == self._turns and group._broken is None
                and group._comm is not None):
            group._fail(self._kind, error)
        return False


# torch's calls the group runs, by torch's name.
_OPERATIONS: dict[str, Callable[..., list[torch.Tensor]]] = {
    "all_reduce": ThreadGroup._all_reduce,
    "all_gather": ThreadGroup._all_gather,
    "all_gather_into_tensor": ThreadGroup._all_gather_into,
    "broadcast": ThreadGroup._broadcast,
    "gather": ThreadGroup._gather,
    "scatter": ThreadGroup._scatter,
    "barrier": ThreadGroup._barrier,
}


def _check_threads(kind: str, thread: threading.Thread) -> None:
    if not integration.thread_multiple():
        raise mt.MpitensorError(
            f"{kind} from thread {thread.name!r} on a group made with dist.new_group: a thread other than the one "
            "that opened the mpitensor context owns such a group only where MPI runs at MPI_THREAD_MULTIPLE, "
            "which it does not here (MPITENSOR_THREAD_LEVEL, or the MPI library's build); give that thread a "
            "gloo group: dist.new_group(backend='gloo')"
        )


def _one(tensors: Sequence[Any], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpitensor backend takes one tensor per call, got {len(tensors)}")
    return _cpu(tensors[0], what)


def _only(lists: Sequence[Any], what: str) -> Any:
    if len(lists) != 1:
        raise ValueError(f"{what}: the mpitensor backend takes one list of tensors per call, got {len(lists)}")
    return lists[0]


def _cpu(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{what}: a group that a helper thread owns takes dense tensors, got one with layout "
                         f"{tensor.layout}")
    if tensor.device.type != "cpu":
        raise mt.DeviceError(f"{what}: a group that a helper thread owns takes CPU tensors, got one on "
                             f"{tensor.device}; move it to the CPU (tensor.cpu()), or {_ELSEWHERE}")
    return tensor


def _described(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor`'s values of its own (what a call sends and receives into)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous().clone()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A copy of `tensor`'s elements as bytes (a copy: the output may be a view of the input)."""
    return _private(tensor).reshape(-1).view(torch.uint8).numpy()


def _empty(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Room for `rows` tensors of `like`'s dtype and size, one per row."""
    return torch.empty((rows, like.numel()), dtype=like.dtype)


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).numpy()


def _write(output: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():  # a parameter is written as gloo writes it
        output.copy_(values.reshape(output.shape))
