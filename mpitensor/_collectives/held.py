"""`broadcast_held` and `all_gather_held`: MPI's blocking calls on buffers their caller holds.

For callers that hold the input and the result buffer themselves until the call returns
(a collective inside a compiled JAX program, run on XLA's own buffers): the input is read
where it is and the result lands in the caller's buffer, with none of the general path's
copies, protections or fresh arrays. Once the consistency check has agreed (every peer is
at the same call), MPI's blocking broadcast or all-gather moves the bytes
(`_transport.mpi.held`); the check tells these calls from `broadcast`'s and `all_gather`'s
(option ``held``), whose nonblocking MPI calls must not pair with blocking ones, so ranks
that disagree get `CollectiveMismatchError`. Unchecked calls (their peers may not have
arrived) take the general nonblocking path.

Repeated checked calls of one kind on the full group go to a compiled held lane
(`native.compiled_held_data_lane`), as `all_reduce_held`'s do: the check and the MPI call in
one C call, which a compiled program's handler can call with no Python around it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.state import open_contexts
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Op
from .._runtime.entry import collective_entry
from .._runtime.ordering import wait_for_compiled
from .._transport.mpi import held_all_gather, held_broadcast
from .all_gather import all_gather
from .broadcast import broadcast
from .common import CollectiveTensor, check_record, context_for, group_root, root_rank, start
from .native import compiled_held_data_lane
from .options import make_record, output_tensor

__all__ = ["HELD_DATA_LANES", "all_gather_held", "broadcast_held", "data_lane"]

# The check's option that tells these calls from `broadcast`'s and `all_gather`'s.
_HELD = (("held", 1),)
# Where the compiled lanes are kept (the full group's extra state), by (kind, dtype, shape,
# root argument): None for a kind that has none.
HELD_DATA_LANES = "held broadcast and all-gather lanes"
_MAX_LANES = 256


def broadcast_held(array: np.ndarray, out: np.ndarray, root: int = 0) -> CollectiveTensor:
    """`broadcast` of the root's host `array` into every rank's `out`, both held by the caller.

    Every rank passes an input of the same shape and dtype (read on the root only) and an
    `out` of that shape and dtype; neither is touched by anyone else until the result is
    resolved. On the full group of the open context.

    Args:
        array: a C-contiguous NumPy array.
        out: a writable C-contiguous NumPy array of `array`'s shape and dtype, not
            overlapping it.
        root: the sending rank.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError: `array` or `out` is not a NumPy array.
        ValueError: `out` is not contiguous and writable, of another shape or dtype, or
            overlaps `array`; the root is not a rank of the context (on every rank).
        As `broadcast` otherwise.
    """
    handle = _on_lane("broadcast", array, out, root)
    return handle if handle is not None else _broadcast_entry(array, out, root)


def all_gather_held(array: np.ndarray, out: np.ndarray) -> CollectiveTensor:
    """`all_gather` of every rank's host `array` into every rank's `out`, in rank order, both held by the caller.

    Every rank passes an input of the same shape and dtype; `out` holds the group's size
    times as many elements of that dtype (rank k's input its k-th part), and neither is
    touched by anyone else until the result is resolved. On the full group of the open
    context.

    Args:
        array: a C-contiguous NumPy array.
        out: a writable C-contiguous NumPy array of `array`'s dtype and the group's size
            times its size, not overlapping it.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError: `array` or `out` is not a NumPy array.
        ValueError: `out` is not contiguous and writable, of another dtype or size, or
            overlaps `array`.
        As `all_gather` otherwise.
    """
    handle = _on_lane("all_gather", array, out, -1)
    return handle if handle is not None else _all_gather_entry(array, out)


def data_lane(ctx: DistributedContext, kind: str, array: np.ndarray, root: int) -> Any:
    """The compiled lane of `kind`'s held calls of `array`'s dtype and shape (and `root`) on `ctx`, or None.

    Its ``start_held(array, out)`` and ``run_held(array, out)`` (native/lane.c) check each
    call and decline what the general path must take.
    """
    lanes = ctx.full_group.extra.get(HELD_DATA_LANES)
    return None if lanes is None else lanes.get((kind, array.dtype, array.shape, root))


def _on_lane(kind: str, array: Any, out: Any, root: int) -> CollectiveTensor | None:
    """The call on its compiled lane (after the wait for compiled programs), or None."""
    if not open_contexts or type(array) is not np.ndarray:
        return None
    lane = data_lane(open_contexts[-1], kind, array, root)
    if lane is None:
        return None
    wait_for_compiled()
    return lane.start_held(array, out)


def _broadcast_held(array: np.ndarray, out: np.ndarray, root: int, devices: DevicesArg = None) -> CollectiveTensor:
    ctx = context_for("broadcast")
    _check_buffers(array, out, 1, "broadcast_held")
    group, root_at = ctx.full_group, root_rank(ctx, root)
    record = check_record(ctx, group, make_record(_HELD, "broadcast", None, array.dtype, array.shape, root_at,
                                                  group.members))
    if record is None and group.size > 1:  # unchecked: the general path, nonblocking
        return broadcast(array, root=root_at, out=out)

    def post() -> list[Any]:
        return held_broadcast(group.comm, array, out, group_root(group, root_at, "broadcast"))

    result = output_tensor(None, out, ctx.cpu_device)
    handle = start(ctx, Op("broadcast", group, array.nbytes, post, lambda: result, record=record, keep=(array, out)),
                   result)
    if root_at in group.members:
        _keep_lane(ctx, ("broadcast", array.dtype, array.shape, root), array, group.members.index(root_at), record)
    return handle


def _all_gather_held(array: np.ndarray, out: np.ndarray, devices: DevicesArg = None) -> CollectiveTensor:
    ctx = context_for("all_gather")
    group = ctx.full_group
    _check_buffers(array, out, group.size, "all_gather_held")
    record = check_record(ctx, group, make_record(_HELD, "all_gather", None, array.dtype, array.shape, -1,
                                                  group.members))
    if record is None and group.size > 1:  # unchecked: the general path (concatenated along the first axis)
        gathered = (group.size * array.shape[0], *array.shape[1:]) if array.ndim else (group.size,)
        return all_gather(array, out=out.reshape(gathered))

    def post() -> list[Any]:
        return held_all_gather(group.comm, array, out)

    result = output_tensor(None, out, ctx.cpu_device)
    handle = start(ctx, Op("all_gather", group, array.nbytes, post, lambda: result, record=record, keep=(array, out)),
                   result)
    _keep_lane(ctx, ("all_gather", array.dtype, array.shape, -1), array, -1, record)
    return handle


# Called as the public collectives are: behind their entry.
_broadcast_entry = collective_entry("broadcast")(_broadcast_held)
_all_gather_entry = collective_entry("all_gather")(_all_gather_held)


def _keep_lane(ctx: DistributedContext, key: tuple[Any, ...], array: np.ndarray, root: int, record: Any) -> None:
    """Keep the compiled lane of the calls of kind `key` (None where they have none), at most `_MAX_LANES` kinds."""
    lanes = ctx.full_group.extra.setdefault(HELD_DATA_LANES, {})
    if key in lanes:
        return
    if len(lanes) >= _MAX_LANES:
        lanes.clear()
    lanes[key] = compiled_held_data_lane(ctx, ctx.full_group, key[0], array, root, record)


def _check_buffers(array: Any, out: Any, parts: int, what: str) -> None:
    """Refuse buffers the held call cannot move bytes between.

    Raises:
        TypeError: either is not a NumPy array.
        ValueError: not contiguous, `out` not writable, of another dtype or not `parts`
            times `array`'s size, or overlapping.
    """
    if type(array) is not np.ndarray or type(out) is not np.ndarray:
        raise TypeError(f"{what}: array and out must be NumPy arrays, got {type(array).__name__} and "
                        f"{type(out).__name__}")
    if not (array.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{what}: array and out must be C-contiguous and out writable; pass np.ascontiguousarray "
                         "copies, or use the collective without _held")
    if out.dtype != array.dtype or out.size != parts * array.size:
        raise ValueError(f"{what}: out must hold {parts} x {array.size} elements of {array.dtype}, got "
                         f"{out.size} of {out.dtype}")
    if np.may_share_memory(array, out):
        raise ValueError(f"{what}: out overlaps the input; pass a separate result buffer")
