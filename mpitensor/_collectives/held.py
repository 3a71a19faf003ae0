"""Held calls: the buffer mode of the collectives whose caller holds the input and the result buffer.

``broadcast``, ``all_gather``, ``all_to_all``, ``gather`` and ``reduce`` with ``held=True``
(and ``all_reduce``'s own, in `all_reduce.py`) are for callers that hold the input and the
result buffer themselves until the call returns (a collective inside a compiled JAX program,
run on XLA's own buffers; a torch backend's tensors): the input is read where it is and the
result lands in the caller's buffer, with none of the general path's copies, protections or
fresh arrays. Once the consistency check has agreed (every peer is at the same call), MPI's
blocking call moves the data (`_transport.mpi.held`); the check tells these calls from the
general collectives' (option ``held``), whose nonblocking MPI calls must not pair with
blocking ones, so ranks that disagree get `CollectiveMismatchError`. Unchecked calls (whose
peers may not have arrived) post MPI's nonblocking call of the same data. Every rank's buffer
gets a result: off the root, a gather's and a reduce's is the input, as inside ``jax.jit``.

Each call enters through its collective's own entry (the collective's public function). The
first checked call of a kind on the full group keeps its compiled plan in the context's plan
cache (`plans.py`, `native.compiled_held_data_lane`): the check and the MPI call in one C call,
which later calls start on, and which a compiled program's handler can call with no Python
around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._core.config import parse_op
from .._core.dtypes import reduce_plan
from .._core.mpi import MPI
from .._core.tensor import Tensor, array_of, wrap_array
from .._runtime.context import DevicesArg, DistributedContext
from .._runtime.engine import Group, Op
from .._transport import mpi
from .common import CollectiveTensor, check_record, context_for, group_root, root_rank, start
from .native import compiled_held_data_lane
from .options import make_record, output_tensor
from .plans import find_plan, keep_plan

__all__ = ["HELD_KINDS", "data_plan", "filled", "held_call", "reducible"]

# The check's option that tells these calls from the general collectives'.
_HELD = (("held", 1),)


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


def reducible(op: Any, dtype: np.dtype) -> bool:
    """Whether MPI's own reduction gives `op` of arrays of `dtype` (no encoding, no division, no other result dtype)."""
    return _own_reduction(reduce_plan(parse_op(op), np.dtype(dtype)), np.dtype(dtype))


def _own_reduction(plan: Any, dtype: np.dtype) -> bool:
    return plan.codec is None and not plan.divide and dtype.kind != "b" and plan.work_dtype == plan.out_dtype == dtype


def data_plan(ctx: DistributedContext, kind: str, array: np.ndarray, root: int = -1, op: Any = None) -> Any:
    """The kept compiled plan of `kind`'s held calls of `array`'s dtype and shape (`root`, `op`) on `ctx`, or None.

    Its ``start_held(array, out)`` and ``run_held(array, out)`` (native/lane.c) check each
    call and decline what the general path must take.
    """
    return find_plan(ctx, _plan_key(kind, array, root, op))


def _plan_key(kind: str, array: np.ndarray, root: int, op: Any) -> tuple[Any, ...]:
    return kind, array.dtype, array.shape, root, op, "held"


def held_call(kind: str, array: Any, out: Any, root: int = -1, op: Any = None, devices: DevicesArg = None,
              general: Callable[[], CollectiveTensor] | None = None) -> CollectiveTensor:
    """The held call of collective `kind` (one of `HELD_KINDS`): the collective's ``held=True``, behind its entry.

    Every rank's `out` gets a result, as a compiled program's results have one shape on
    every rank: off the root, a gather's and a reduce's is the input. On the full group, a
    kind with a kept compiled plan starts on it; otherwise the general held path, which keeps
    that plan. A call the held path cannot take (a sub-group; a reduce MPI does not reduce as
    it is, `reducible`) runs `general()`, the collective's own path into `out`.

    Args:
        kind: the collective's name.
        array: the input: a C-contiguous NumPy array.
        out: the result buffer (see each collective's ``held``).
        root: a rooted call's root (the others': -1).
        op: a reduce's reduction (the others': None; None: the context's).
        devices: the group (None: every rank).
        general: the collective's call into `out` with the same results, for what is not held.

    Returns:
        A `CollectiveTensor` resolving to a Tensor over `out`.

    Raises:
        TypeError, ValueError: bad buffers (`_check_buffers`).
    """
    ctx = context_for(kind)
    encoded = kind == "reduce" and type(array) is np.ndarray and not reducible(
        ctx.config.all_reduce_op if op is None else op, array.dtype)
    if devices is not None or encoded:
        assert general is not None
        return general()
    if type(array) is np.ndarray:
        lane = data_plan(ctx, kind, array, root, op)
        if lane is not None:
            handle = lane.start_held(array, out)
            if handle is not None:
                return handle
    return _held(ctx, kind, array, out, root, op)


def filled(out: np.ndarray, value: Any, device: Any) -> Tensor:
    """`out` holding `value` (a Tensor or an array of its size), as the Tensor a held call resolves to.

    For the general paths of held calls, whose results are written into the caller's buffer
    when they resolve (a gather's rows, the input off a reduce's root).
    """
    np.copyto(out, (array_of(value) if isinstance(value, Tensor) else value).reshape(out.shape))
    return wrap_array(out, device)


def _held(ctx: DistributedContext, kind: str, array: np.ndarray, out: np.ndarray, root: int,
          op: Any) -> CollectiveTensor:
    """A held call on the full group: the first call of each kind, and what the compiled plan declines."""
    spec, group = _KINDS[kind], ctx.full_group
    root_at = root_rank(ctx, root) if spec.rooted else -1
    _check_buffers(array, out, spec.parts(group.size, root_at == ctx.rank), f"{kind}(held=True)")
    if kind == "all_to_all" and array.nbytes % group.size:
        raise ValueError(f"all_to_all(held=True): an input of {array.nbytes} bytes does not cut into {group.size} "
                         "equal blocks (one per rank)")
    reduce_op = plan = None
    if kind == "reduce":
        reduce_op = ctx.config.all_reduce_op if op is None else parse_op(op)
        plan = reduce_plan(reduce_op, array.dtype)
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
    key = _plan_key(kind, array, root, op)
    if record is not None and (not spec.rooted or root_at in group.members) and find_plan(ctx, key) is None:
        index = group.members.index(root_at) if spec.rooted else -1
        keep_plan(ctx, key, compiled_held_data_lane(ctx, group, kind, array, index, record, plan))
    return handle


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
