"""Held collectives: MPI's blocking calls on buffers their caller holds.

`broadcast_held`, `all_gather_held`, `all_to_all_held`, `gather_held` and `reduce_held` are
for callers that hold the input and the result buffer themselves until the call returns (a
collective inside a compiled JAX program, run on XLA's own buffers): the input is read where
it is and the result lands in the caller's buffer, with none of the general path's copies,
protections or fresh arrays. Once the consistency check has agreed (every peer is at the same
call), MPI's blocking call moves the data (`_transport.mpi.held`); the check tells these
calls from the general collectives' (option ``held``), whose nonblocking MPI calls must not
pair with blocking ones, so ranks that disagree get `CollectiveMismatchError`. Unchecked
calls (whose peers may not have arrived) post MPI's nonblocking call of the same data.
Off the root, a gather's and a reduce's result is the input, as inside ``jax.jit``.

Repeated checked calls of one kind on the full group go to a compiled held lane
(`native.compiled_held_data_lane`), as `all_reduce_held`'s do: the check and the MPI call in
one C call, which a compiled program's handler can call with no Python around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan
from .._core.mpi import MPI
from .._core.state import open_contexts
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._runtime.entry import collective_entry
from .._runtime.ordering import wait_for_compiled
from .._transport import mpi
from .common import CollectiveTensor, check_record, context_for, group_root, root_rank, start
from .native import compiled_held_data_lane
from .options import make_record, output_tensor

__all__ = [
    "HELD_DATA_LANES", "HELD_KINDS", "all_gather_held", "all_to_all_held", "broadcast_held", "data_lane",
    "gather_held", "held_call", "reduce_held", "reducible",
]

# The check's option that tells these calls from the general collectives'.
_HELD = (("held", 1),)
# Where the compiled lanes are kept (the full group's extra state), by (kind, dtype, shape,
# root argument, op argument): None for a kind that has none.
HELD_DATA_LANES = "held collective lanes"
_MAX_LANES = 256


class _Kind(NamedTuple):
    """How one held collective moves its data.

    Attributes:
        rooted: whether it has a root.
        parts: ``parts(size, at_root)``, the result's size over the input's.
        blocking: its `_transport.mpi.held` function ``(comm, source, out, spec)``.
        nonblocking: ``(group, source, out, spec)`` posting MPI's nonblocking call of the same data.
    """

    rooted: bool
    parts: Callable[[int, bool], int]
    blocking: Callable[..., list[Any]]
    nonblocking: Callable[..., list[Any]]


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _copy_then(post: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """`post` of a rooted call that leaves the input in `out` off the root (MPI does not write it there)."""

    def posted(group: Group, source: np.ndarray, out: np.ndarray, spec: Any) -> list[Any]:
        root = spec[0] if isinstance(spec, tuple) else spec
        if group.comm.Get_rank() != root:
            np.copyto(out, source)
        return post(group, source, out, spec)

    return posted


def _broadcast_posted(group: Group, source: np.ndarray, out: np.ndarray, root: int) -> list[Any]:
    if group.comm.Get_rank() == root:
        np.copyto(out, source)
    return mpi.broadcast(group, _bytes(out), MPI.BYTE, root)


def _gather_posted(group: Group, source: np.ndarray, out: np.ndarray, root: int) -> list[Any]:
    at_root = group.comm.Get_rank() == root
    return mpi.gather(group, _bytes(source), _bytes(out) if at_root else None, MPI.BYTE, root)


def _reduce_posted(group: Group, source: np.ndarray, out: np.ndarray, spec: tuple[int, Any]) -> list[Any]:
    root, plan = spec
    at_root = group.comm.Get_rank() == root
    return mpi.reduce(group, source, out if at_root else None, plan.datatype, plan.mpi_op, root)


_KINDS = {
    "broadcast": _Kind(True, lambda size, at_root: 1, mpi.held_broadcast, _broadcast_posted),
    "all_gather": _Kind(False, lambda size, at_root: size, mpi.held_all_gather,
                        lambda group, source, out, spec: mpi.all_gather(group, _bytes(source), _bytes(out), MPI.BYTE)),
    "all_to_all": _Kind(False, lambda size, at_root: 1, mpi.held_all_to_all,
                        lambda group, source, out, spec: mpi.all_to_all(group, _bytes(source), _bytes(out), MPI.BYTE)),
    "gather": _Kind(True, lambda size, at_root: size if at_root else 1, mpi.held_gather, _copy_then(_gather_posted)),
    "reduce": _Kind(True, lambda size, at_root: 1, mpi.held_reduce, _copy_then(_reduce_posted)),
}
# The collectives that have a held call.
HELD_KINDS = tuple(_KINDS)


def broadcast_held(array: np.ndarray, out: np.ndarray, root: int = 0) -> CollectiveTensor:
    """`broadcast` of the root's host `array` into every rank's `out`, both held by the caller.

    Every rank passes an input of the same shape and dtype (read on the root only) and an
    `out` of that shape and dtype; neither is touched by anyone else until the result is
    resolved. On the full group of the open context (as every held collective).

    Args:
        array: a C-contiguous NumPy array.
        out: a writable C-contiguous NumPy array of `array`'s shape and dtype, not overlapping it.
        root: the sending rank.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError: `array` or `out` is not a NumPy array.
        ValueError: bad buffers (see `all_gather_held`); the root is not a rank of the
            context (on every rank).
        As `broadcast` otherwise.
    """
    return held_call("broadcast", array, out, root, None)


def all_gather_held(array: np.ndarray, out: np.ndarray) -> CollectiveTensor:
    """`all_gather` of every rank's host `array` into every rank's `out`, in rank order, both held by the caller.

    Args:
        array: a C-contiguous NumPy array, of one shape and dtype on every rank.
        out: a writable C-contiguous NumPy array of `array`'s dtype and the group's size
            times its size (rank k's input its k-th part), not overlapping it.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError: `array` or `out` is not a NumPy array.
        ValueError: not contiguous, `out` not writable, of another dtype or size, or overlapping.
        As `all_gather` otherwise.
    """
    return held_call("all_gather", array, out, -1, None)


def all_to_all_held(array: np.ndarray, out: np.ndarray) -> CollectiveTensor:
    """`all_to_all` of equal blocks: block k of every rank's `array` into block (its rank) of rank k's `out`.

    Args:
        array: a C-contiguous NumPy array whose bytes cut into one equal block per rank.
        out: a writable C-contiguous NumPy array of `array`'s shape and dtype, not overlapping it.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError, ValueError: as `all_gather_held`, or an input that does not cut into blocks.
    """
    return held_call("all_to_all", array, out, -1, None)


def gather_held(array: np.ndarray, out: np.ndarray, root: int = 0) -> CollectiveTensor:
    """`gather` of every rank's `array` into the root's `out` in rank order; elsewhere `out` gets `array`.

    Args:
        array: a C-contiguous NumPy array, of one shape and dtype on every rank.
        out: a writable C-contiguous NumPy array of `array`'s dtype: on the root the group's
            size times its size, elsewhere its size; not overlapping it.
        root: the receiving rank.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError, ValueError: as `broadcast_held`.
    """
    return held_call("gather", array, out, root, None)


def reduce_held(array: np.ndarray, out: np.ndarray, op: ReduceOperation | str, root: int = 0) -> CollectiveTensor:
    """`reduce` of every rank's `array` into the root's `out`; elsewhere `out` gets `array`.

    Args:
        array: a C-contiguous NumPy array, of one shape and dtype on every rank, of a kind
            `reducible` says MPI reduces as it is.
        out: a writable C-contiguous NumPy array of `array`'s shape and dtype, not overlapping it.
        op: the reduction.
        root: the receiving rank.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        ValueError: a reduction `reducible` refuses; as `broadcast_held` otherwise.
    """
    return held_call("reduce", array, out, root, op)


def reducible(op: Any, dtype: np.dtype) -> bool:
    """Whether MPI's own reduction gives `op` of arrays of `dtype` (no encoding, no division, no other result dtype)."""
    return _own_reduction(reduce_plan(parse_op(op), np.dtype(dtype)), np.dtype(dtype))


def _own_reduction(plan: Any, dtype: np.dtype) -> bool:
    return plan.codec is None and not plan.divide and dtype.kind != "b" and plan.work_dtype == plan.out_dtype == dtype


def data_lane(ctx: DistributedContext, kind: str, array: np.ndarray, root: int = -1, op: Any = None) -> Any:
    """The compiled lane of `kind`'s held calls of `array`'s dtype and shape (`root`, `op`) on `ctx`, or None.

    Its ``start_held(array, out)`` and ``run_held(array, out)`` (native/lane.c) check each
    call and decline what the general path must take.
    """
    lanes = ctx.full_group.extra.get(HELD_DATA_LANES)
    return None if lanes is None else lanes.get(_lane_key(kind, array, root, op))


def _lane_key(kind: str, array: np.ndarray, root: int, op: Any) -> tuple[Any, ...]:
    return kind, array.dtype, array.shape, root, op


def held_call(kind: str, array: Any, out: Any, root: int = -1, op: Any = None) -> CollectiveTensor:
    """The held call of collective `kind` (one of `HELD_KINDS`): `broadcast_held`'s and the others'.

    On its compiled lane (after the wait for compiled programs), else behind its entry.

    Args:
        kind: the collective's name.
        array: the input, as the kind's function takes it.
        out: the result buffer, as the kind's function takes it.
        root: a rooted call's root (the others': -1).
        op: a reduce's reduction (the others': None).

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        As the kind's function.
    """
    if open_contexts and type(array) is np.ndarray:
        lane = data_lane(open_contexts[-1], kind, array, root, op)
        if lane is not None:
            wait_for_compiled()
            handle = lane.start_held(array, out)
            if handle is not None:
                return handle
    return _ENTRIES[kind](kind, array, out, root, op)


def _held(kind: str, array: np.ndarray, out: np.ndarray, root: int, op: Any,
          devices: DevicesArg = None) -> CollectiveTensor:
    """A held call behind its entry: the general path, and the first call of each kind."""
    ctx = context_for(kind)
    spec, group = _KINDS[kind], ctx.full_group
    root_at = root_rank(ctx, root) if spec.rooted else -1
    _check_buffers(array, out, spec.parts(group.size, root_at == ctx.rank), f"{kind}_held")
    if kind == "all_to_all" and array.nbytes % group.size:
        raise ValueError(f"all_to_all_held: an input of {array.nbytes} bytes does not cut into {group.size} equal "
                         "blocks (one per rank)")
    reduce_op = plan = None
    if kind == "reduce":
        reduce_op = parse_op(op)
        plan = reduce_plan(reduce_op, array.dtype)
        if not _own_reduction(plan, array.dtype):
            raise ValueError(f"reduce_held: {reduce_op.name} of {array.dtype} is not MPI's own reduction (an "
                             "encoding, a division or another result dtype); use reduce")
    record = check_record(ctx, group, make_record(_HELD, kind, reduce_op, array.dtype, array.shape, root_at,
                                                  group.members))
    blocking = record is not None or group.size == 1

    def post() -> list[Any]:
        index = group_root(group, root_at, kind) if spec.rooted else -1
        detail = (index, plan) if kind == "reduce" else index
        if blocking:
            return spec.blocking(group.comm, array, out, detail)
        return spec.nonblocking(group, array, out, detail)

    result = output_tensor(None, out, ctx.cpu_device)
    handle = start(ctx, Op(kind, group, array.nbytes, post, lambda: result, record=record, keep=(array, out)), result)
    if record is not None and (not spec.rooted or root_at in group.members):
        index = group.members.index(root_at) if spec.rooted else -1
        _keep_lane(ctx, _lane_key(kind, array, root, op), array, index, record, plan)
    return handle


# Called as the public collectives are: behind their entry (the thread rule, failed turns).
_ENTRIES = {kind: collective_entry(kind)(_held) for kind in _KINDS}


def _keep_lane(ctx: DistributedContext, key: tuple[Any, ...], array: np.ndarray, root: int, record: Any,
               plan: Any) -> None:
    """Keep the compiled lane of the calls of kind `key` (None where they have none), at most `_MAX_LANES` kinds."""
    lanes = ctx.full_group.extra.setdefault(HELD_DATA_LANES, {})
    if key in lanes:
        return
    if len(lanes) >= _MAX_LANES:
        lanes.clear()
    lanes[key] = compiled_held_data_lane(ctx, ctx.full_group, key[0], array, root, record, plan)


def _check_buffers(array: Any, out: Any, parts: int, what: str) -> None:
    """Refuse buffers the held call cannot move data between.

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
