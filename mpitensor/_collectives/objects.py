"""Collectives of Python objects: `broadcast_object`, `all_gather_object`, `gather_object`.

Each object is pickled; its size in bytes travels with the consistency check's exchange
(every rank learns every rank's size without a call of its own), then the bytes move with
``MPI_Ibcast``, ``MPI_Iallgatherv`` or ``MPI_Igatherv``, and `resolve()` unpickles them.
For configuration and metrics, not for bulk data: tensors go faster through the tensor
collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype
from .._core.errors import ObjectUnpicklingError
from .._runtime.check import Record
from .._runtime.context import DevicesArg
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import CollectiveTensor, Later, context_for, group_root, root_rank, start
from .layout import displacements

__all__ = ["all_gather_object", "broadcast_object", "gather_object"]

_BYTE = np.dtype(np.uint8)


def broadcast_object(obj: Any, root: int | Device = 0, *, devices: DevicesArg = None) -> CollectiveTensor:
    """Start a broadcast of the root's Python object and return at once.

    Args:
        obj: on the root, the object (picklable); ignored elsewhere (pass None).
        root: the sending rank (in the context, a member of the group) or its `Device`.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to a copy of the root's object on every rank (the
        root included: it unpickles its own bytes too, so no rank shares the original).

    Raises:
        TypeError: the root's object cannot be pickled (on the root).
        ObjectUnpicklingError: (also a TypeError) from `resolve()`: the object cannot be
            unpickled on this rank.
        ValueError: the root is not in the group (raised on every rank).
        CollectiveMismatchError: the ranks disagree on root or group.
    """
    ctx = context_for("broadcast_object")
    group = ctx.group(devices, "broadcast_object")
    root_at = root_rank(ctx, root)
    # A writable copy on the root: MPI_Ibcast's buffer is the receive buffer elsewhere.
    payload = _pickled(obj).copy() if root_at == ctx.rank else np.empty(0, _BYTE)
    later, datatype = Later(), mpi_datatype(_BYTE)

    def post(sizes: list[int]) -> list[Any]:
        index = group_root(group, root_at, "broadcast_object")
        buffer = payload if index == group.rank else np.empty(sizes[index], _BYTE)
        later.value = buffer
        return mpi.broadcast(group, buffer, datatype, index)

    return _start(ctx, group, "broadcast_object", payload, root_at, post, lambda: _loaded(later.value, root_at))


def all_gather_object(obj: Any, *, devices: DevicesArg = None) -> CollectiveTensor:
    """Start an all-gather of every rank's Python object and return at once.

    Args:
        obj: this rank's object (picklable).
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving to the list of every rank's object, in group order.

    Raises:
        TypeError: the object cannot be pickled.
        ObjectUnpicklingError: (also a TypeError) from `resolve()`: a peer's object cannot be
            unpickled on this rank.
        CollectiveMismatchError: the ranks disagree on the group.
    """
    ctx = context_for("all_gather_object")
    group = ctx.group(devices, "all_gather_object")
    payload = _pickled(obj)
    later, datatype = Later(), mpi_datatype(_BYTE)

    def post(sizes: list[int]) -> list[Any]:
        later.value = (np.empty(sum(sizes), _BYTE), sizes)
        return mpi.all_gatherv(group, payload, later.value[0], sizes, displacements(sizes), datatype)

    return _start(ctx, group, "all_gather_object", payload, -1, post, lambda: _unpickled(*later.value, group.members))


def gather_object(obj: Any, root: int | Device = 0, *, devices: DevicesArg = None) -> CollectiveTensor:
    """Start a gather of every rank's Python object to the root and return at once.

    Args:
        obj: this rank's object (picklable).
        root: the receiving rank (in the context, a member of the group) or its `Device`.
        devices: the group; None for every rank of the context.

    Returns:
        A `CollectiveTensor` resolving on the root to the list of every rank's object, in
        group order, and to None elsewhere.

    Raises:
        TypeError: the object cannot be pickled.
        ObjectUnpicklingError: (also a TypeError) from `resolve()`: a peer's object cannot be
            unpickled on this rank.
        ValueError: the root is not in the group (raised on every rank).
        CollectiveMismatchError: the ranks disagree on root or group.
    """
    ctx = context_for("gather_object")
    group = ctx.group(devices, "gather_object")
    root_at = root_rank(ctx, root)
    payload = _pickled(obj)
    later, datatype = Later(), mpi_datatype(_BYTE)

    def post(sizes: list[int]) -> list[Any]:
        index = group_root(group, root_at, "gather_object")
        gathered = displs = None
        if index == group.rank:
            gathered = np.empty(sum(sizes), _BYTE)
            later.value = (gathered, sizes)
            displs = displacements(sizes)
        return mpi.gatherv(group, payload, gathered, sizes, displs, datatype, index)

    def finish() -> list[Any] | None:
        return None if later.value is None else _unpickled(*later.value, group.members)

    return _start(ctx, group, "gather_object", payload, root_at, post, finish)


def _start(ctx: Any, group: Group, kind: str, payload: np.ndarray, root: int,
           post: Callable[[list[int]], list[Any]], finish: Callable[[], Any]) -> CollectiveTensor:
    """Submit an object collective whose sizes travel with the check (every rank's `payload` size)."""
    record = Record(kind, None, None, None, root, group.members, per_rank=payload.size)
    op = Op(kind, group, payload.size, post, finish, record=record, keep=(payload,), exchange=True,
            compare=ctx.config.check)
    return start(ctx, op, Later())


def _pickled(obj: Any) -> np.ndarray:
    """`obj` pickled, as a byte array MPI can send.

    Raises:
        TypeError: `obj` cannot be pickled (whatever pickle raised: its own errors, or those of
            the object's ``__reduce__``, a recursion too deep), chained to the original.
    """
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling runs the object's own code, which may raise anything
        # A plain TypeError: an error of this rank's own argument, raised before the call's
        # check, so the call's entry takes its failed turn for it (peers then raise).
        raise TypeError(
            f"the object ({type(obj).__qualname__}) cannot be pickled: {type(exc).__name__}: {exc}; "
            "pass an object pickle can serialize"
        ) from exc
    return np.frombuffer(data, _BYTE)


def _loaded(data: Any, sender: int) -> Any:
    """One pickle unpickled; what fails is said as an `ObjectUnpicklingError` naming the sender.

    Raises:
        ObjectUnpicklingError: (an `MpitensorError` and a `TypeError`) the bytes `sender`
            sent cannot be unpickled here (a class this rank cannot import, an object whose
            unpickling raises), chained to the original error.
    """
    try:
        return pickle.loads(data)
    except Exception as exc:  # unpickling runs the sender's classes' code
        raise ObjectUnpicklingError(
            f"rank {sender}'s object cannot be unpickled on this rank: {type(exc).__name__}: {exc}; "
            "objects must be of classes every rank can import and rebuild"
        ) from exc


def _unpickled(data: np.ndarray, sizes: list[int], members: tuple[int, ...]) -> list[Any]:
    """The objects of consecutive pickles of `sizes` bytes in `data`, sent by `members` in order."""
    view, objects, offset = memoryview(data), [], 0
    for size, member in zip(sizes, members):
        objects.append(_loaded(view[offset:offset + size], member))
        offset += size
    return objects
