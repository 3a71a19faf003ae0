"""The compiled lane of repeated small all-reduces: `_lanes`, built from the C files here.

A repeated small all-reduce on its Python lane (`lane.py`) still spends most of its time in
Python: the public wrapper, the op and handle objects, the engine's submit, `resolve()` and
its wait, mpi4py's argument handling. The compiled lane does the same steps in one C call
each way, on the same objects: the op it registers is the engine's `Op` (its MPI request an
mpi4py `Request`), its result a `Tensor`, its handle a `CollectiveTensor` (`LaneTensor`,
whose `resolve()` is compiled for the plain wait of a posted op). So the Python engine can
take over any op the compiled lane starts (reaping a dropped handle, close(), a timeout, a
check that did not agree at once), and every call the compiled lane declines goes to the
Python lane, then the general path.

Two kinds of call have one, when their lane's plan allows it (`compiled_lane`):

- up to 64 KiB (`CopyLane`): MPI's in-place all-reduce on a copy, after the check (when the
  context checks, in groups of 2-8 ranks) has agreed, which it usually does within a spin;
- check on, up to 64 bytes in groups of 2-8 ranks (`CheckLane`): the input carried in the
  check's row, the rows reduced at the call when they all agree (C loops that do what
  NumPy's ufuncs do, in the same order: the same bits as the Python lane's reduction).

A third, `compiled_held_lane`, takes held all-reduces' repeated checked calls (``held=True``;
groups of 2-8 ranks, any size): when the check agrees within the spin, MPI's blocking
all-reduce from the caller's input into the caller's buffer (or in place), the GIL released,
in the same C call. `compiled_held_data_lane` does the same for the held broadcast, all-gather,
all-to-all, gather and reduce (`held.py`) with MPI's blocking call. Every one is a plan the
Python side built and keeps in the context's plan cache (`plans.py`); the C code touches the
runtime's objects through their records only (`_core/records.py`).

MEAN's division is compiled for float32 and float64; other MEAN lanes stay Python. A Python
number, NumPy scalar or CPU torch tensor takes the compiled lane of the array
`interop.take_quickly` gives for it, as on the Python lanes, and its result comes back in its
own kind (a `Convert` on the handle, which the compiled resolve settles as the Python one does).

The C code calls MPI without MPI's headers (one build serves Open MPI, MPICH and their
kin): it finds ``MPI_Iallreduce``, ``MPI_Iallgather``, ``MPI_Test``, ``MPI_Wait``, ``MPI_Allreduce``,
``MPI_Allgather``, ``MPI_Bcast``, ``MPI_Alltoall``, ``MPI_Gather``, ``MPI_Reduce``, ``MPI_Comm_rank`` and
``MPI_Comm_size`` in the library mpi4py loaded, reads handles out of mpi4py's objects through mpi4py's C API, and
casts each call to the handle kind `_core.mpi.pointer_handles` reports. Where the module
was not built (no compiler when installed), cannot bind, or ``MPITENSOR_NATIVE=0`` is set,
the Python lanes take every call: `status()` says which.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._core import state
from ..._core.config import ReduceOperation, compiled_parts_off
from ..._core.dtypes import OrderedKeys
from ..._core.idle import arm_address, blocking_waits, contested_address
from ..._core.interop import take_quickly
from ..._core.limits import GATHERED_CHECK_RANKS
from ..._core.mpi import MPI, launched_fault_tolerant, pointer_handles
from ..._core.mpi import module as mpi_module
from ..._core.records import compiled as _records_compiled
from ..._core.tensor import Tensor
from ..._runtime.engine import AGREE_STAGE, COMPLETE, REAP_AFTER, SPIN_PAUSES, STATES, Op
from ..._transport.inline import CARRIED, HEADER_BYTES, PAYLOAD_BYTES, ROW_BYTES, reduce_carried, reduce_carried_keys
from ..._transport.mpi import (
    EXCHANGE_TAG,
    SMALL_BYTES,
    held_all_gather,
    held_all_reduce,
    held_all_to_all,
    held_broadcast,
    held_gather,
    held_reduce,
    in_place,
)
from ..._transport.mpi.pair import pair_api_address
from ..._transport.reduced_check import CHECK_WORDS, carry_code, check_reduction, use_compiled
from ..common import CollectiveTensor, Convert, Later, settle_later

try:
    from . import _lanes
except ImportError as _error:  # built without a compiler, or for another interpreter
    _lanes = None
    _BUILD_ERROR = str(_error)
try:
    from ..._runtime.tracing._ring import Ring as _Ring  # the ring a traced lane records in
except ImportError:  # not built: the Python lanes record in the Python ring
    _Ring = None

__all__ = [
    "LaneTensor", "built", "compiled_held_data_lane", "compiled_held_lane", "compiled_lane", "find_lane", "forget",
    "front", "keep_held", "leaf_loops", "set_before_call", "status", "wait_at_call",
]

# ReduceOperation to the C loops' op codes (MEAN reduces as SUM, then divides).
_OP_CODES = {
    ReduceOperation.SUM: 1,
    ReduceOperation.MEAN: 1,
    ReduceOperation.PROD: 2,
    ReduceOperation.MAX: 3,
    ReduceOperation.MIN: 4,
    ReduceOperation.BAND: 5,
    ReduceOperation.BOR: 6,
    ReduceOperation.BXOR: 7,
}
_DIVIDES = (np.dtype(np.float32), np.dtype(np.float64))  # MEAN's compiled division
_KEYS = _DIVIDES  # MAX/MIN keys compiled (keys.c)


class LaneTensor(CollectiveTensor):
    """The handle of a call started on a compiled lane.

    A `CollectiveTensor` in every way; its `resolve()` is compiled (installed when the
    module is bound) for the plain wait of a posted op, and is the general one otherwise.
    The compiled lane makes its handles without `__init__`; one made in Python is checked
    here, because the compiled resolve reads its op's record (`Op` derives from `OpRecord`).
    """

    __slots__ = ()

    def __init__(self, op: Op, value: Any, ctx: Any) -> None:
        """A handle of `op`, whose result is `value`, on context `ctx`.

        Raises:
            TypeError: `op` is not the engine's `Op`.
        """
        if not isinstance(op, Op):
            raise TypeError(f"a LaneTensor is the handle of an engine Op, got {type(op).__name__}")
        super().__init__(op, value, ctx)


class _Binding:
    """Whether the module is bound to this process's MPI, and if not, why."""

    __slots__ = ("tried", "why")

    def __init__(self) -> None:
        self.tried = False
        self.why = "not bound yet (no lane made)"


_binding = _Binding()


def front(general: Callable[..., Any]) -> Callable[..., Any]:
    """The public `all_reduce`: `general` behind the compiled entry where the module is built.

    The entry starts calls on their compiled lanes once the module is bound (until then it
    only calls `general`), and takes `general`'s name, docstring and signature.

    Args:
        general: the Python `all_reduce` with its lanes (`lane.with_lane`).

    Returns:
        The entry, or `general` itself where the module was not built.
    """
    if _lanes is None:
        return general
    return functools.update_wrapper(_lanes.Entry(general), general)


def _bind() -> bool:
    """Bind the module once (after MPI is initialized); whether it is bound."""
    if _binding.tried:
        return _binding.why == ""
    _binding.tried = True
    if _lanes is None:
        _binding.why = f"not built ({_BUILD_ERROR})"
        return False
    if compiled_parts_off():
        _binding.why = "switched off (MPITENSOR_NATIVE=0)"
        return False
    if not _records_compiled:
        _binding.why = "the records of the runtime's objects (mpitensor._core._records) were not built"
        return False
    handles = pointer_handles()
    if handles is None:
        _binding.why = "MPI's handles are neither pointers nor ints"
        return False
    try:
        _lanes.bind(
            mpi=mpi_module(), pointer_handles=handles, op_class=Op, tensor_class=Tensor,
            handle_class=LaneTensor, open_contexts=state.open_contexts,
            states=STATES, later=Later, settle=settle_later, base_resolve=CollectiveTensor.resolve,
            agree_stage=AGREE_STAGE,
            header_bytes=HEADER_BYTES, payload_bytes=PAYLOAD_BYTES, row_bytes=ROW_BYTES,
            reap_after=REAP_AFTER, gathered_ranks=GATHERED_CHECK_RANKS,
            spin_pauses=SPIN_PAUSES, take_quickly=take_quickly, small_bytes=SMALL_BYTES,
            convert=Convert, idle_arm=arm_address(), held_blocking=blocking_waits(),
            idle_contested=contested_address(), exchange_tag=EXCHANGE_TAG, pair_api=pair_api_address(),
        )
    except (RuntimeError, TypeError) as exc:
        _binding.why = f"cannot bind to this MPI: {exc}"
        return False
    LaneTensor.resolve = _lanes.resolve_for(LaneTensor)  # the compiled wait of a posted op
    use_compiled(_lanes.check_op(CHECK_WORDS))  # the large groups' checks reduce with the compiled op
    _binding.why = ""
    return True


def leaf_loops() -> Any:
    """The fused all-reduce's compiled per-leaf loops (`plain_leaves`, `pack`, `unpack`), or None.

    They build `Tensor`s, whose layout the module learns when bound: None until then, and
    where it cannot be.
    """
    return _lanes if _binding.why == "" or (not _binding.tried and _bind()) else None


def status(bind: bool = False) -> str:
    """The compiled lane's state in a few words: "on", or why the Python lanes take every call.

    Args:
        bind: bind the module first if no lane has yet (MPI must be initialized).
    """
    if _lanes is None:
        return f"not built ({_BUILD_ERROR})"
    if bind:
        _bind()
    if not _binding.tried:
        return "built, not bound yet"
    return "on" if _binding.why == "" else _binding.why


def forget(ctx: Any) -> None:
    """Drop the compiled entry's cached lanes of `ctx`, a context that is closing.

    The cache outlives contexts; without this it would keep a closed context (and what
    the context holds) alive until a newer context's lane displaced it.
    """
    if _lanes is not None:
        _lanes.forget(ctx)


def keep_held(lane: Any) -> None:
    """Have the compiled entry start ``all_reduce(array, op, held=True)`` calls of `lane`'s kind on `lane`.

    `lane` is the compiled lane of the kept plan of held all-reduces in place on the full group
    (``CopiedInto``'s COPY or CHECK lane, or a HELD lane in place) that the Python path just
    started such a call on: the entry then starts the next ones as that path would, without it.

    Raises:
        TypeError: `lane` is not a compiled all-reduce lane that reduces in place.
    """
    if _lanes is not None:
        _lanes.keep_held(lane)


def set_before_call(function: Callable[[], None] | None) -> None:
    """Have every call of the compiled entry run `function()` first (None: nothing more)."""
    if _lanes is not None:
        _lanes.set_before_call(function)


def wait_at_call(flag: bool) -> bool:
    """Have this thread's compiled calls wait for a late peer's check in C (`flag`), yielding the core.

    For a caller that waits for the result at once (a collective inside a compiled program):
    queued, the call would wait in the Python engine's slower steps. Without it a call queues
    a check that has not agreed within the lane's few tests, and returns, so that the caller
    can compute meanwhile.

    Returns:
        The previous setting (False where the module is not built).
    """
    if _lanes is None:
        return False
    return _lanes.wait_at_call(flag)


def find_lane(ctx: Any, array: np.ndarray, op: Any) -> Any:
    """The compiled lane the entry holds for ``all_reduce(array, op)`` calls on `ctx`, or None.

    `op` is the op argument the calls give (the same object). The lane's ``run_into(array,
    out)`` (native/lane.c) runs such a call at once into `out`, and declines what it cannot.
    """
    return None if _lanes is None else _lanes.find_lane(ctx, array, op)


def built() -> bool:
    """Whether the compiled module was built (it may still be switched off, or fail to bind)."""
    return _lanes is not None


def compiled_lane(lane: Any, array: np.ndarray, op: Any, checked: bool) -> Any:
    """The compiled lane beside the Python `lane` (a `CopyLane` or a `CheckLane`), or None.

    Args:
        lane: the Python lane (its ``ctx``, ``group``, ``plan`` and ``record``).
        array: an input of the lane's kind (dtype and shape).
        op: the op argument as the calls give it (part of the lane's key).
        checked: whether `lane` carries its input in the check (a `CheckLane`).

    Returns:
        A `_lanes.Lane`, or None where the plan has no compiled counterpart (a converted work
        dtype, a MEAN of a dtype other than float32 and float64, a loop the C code lacks, an
        input to encode other than MAX/MIN keys of float32 and float64) or the module is not
        bound.
    """
    plan = lane.plan
    record = lane.record
    if plan.work_dtype != array.dtype or (plan.divide and array.dtype not in _DIVIDES) or not _bind():
        return None
    keys = _keys(plan, array.dtype, checked)
    if keys is None:
        return None
    group = lane.group
    # A checked lane's record says its ReduceOperation.
    rows = _lanes.rows_kind(array.dtype.num, _OP_CODES[record.op]) if checked else 0
    if rows < 0:
        return None
    large = record is not None and not group.gathers  # its check all-reduces one record (reduced_check)
    code = carry_code(plan, array.dtype, array.size) if large and checked else None
    if _fault_tolerant(lane.ctx):
        return None
    tracer = lane.ctx.engine.tracer
    trace = None
    if tracer is not None:
        ring, kind, group_key = tracer.lane_arguments()
        if _Ring is None or not isinstance(ring, _Ring):
            return None  # a ring in Python: the Python lanes record into it
        trace = (ring, kind, group_key(group))
    done = Op("all_reduce", group, array.nbytes, lambda: [], record=record)
    done.state = COMPLETE  # the op that calls completed at once share: nothing is left to do
    return _lanes.Lane(
        kind=_lanes.CHECK if checked else _lanes.COPY, ctx=lane.ctx, group=group, op_key=op,
        template=np.empty(array.shape, array.dtype), datatype=plan.datatype, mpi_op=plan.mpi_op,
        divide=plan.divide, record=record, value=0 if record is None else record.check_value(),
        per_rank=CARRIED if checked and not large else 0 if record is None else record.per_rank, rows=rows,
        spins=lane.ctx.engine.check_spins(),
        queued_post=(_carried_post(keys) if checked else in_place, group.comm, plan), done_op=done, trace=trace,
        keys=keys, into=False, collective=_lanes.ALL_REDUCE, root=-1,
        **{**_communicators(lane.ctx, group), "code": code or 0},
    )


def compiled_held_lane(ctx: Any, group: Any, op: Any, array: np.ndarray, plan: Any, record: Any, into: bool) -> Any:
    """The compiled lane of held all-reduces (``held=True``) of one kind, or None.

    Args:
        ctx: the context.
        group: the calls' group.
        op: the op argument as the calls give it (part of the lane's key).
        array: an input of the kind (dtype and shape).
        plan: the calls' `ReducePlan` (no MAX/MIN keys: held calls have none).
        record: the check's record of these calls.
        into: whether the result goes to another array than the input.

    Returns:
        A `_lanes.Lane` of kind ``HELD``, or None where there is none: unchecked calls (their
        peers may not have arrived, so the wait must stay the engine's), groups the check
        gathers no rows for, a MEAN of a dtype other than float32 and float64, a context that
        traces (its records come from the Python engine), more than 2**31 - 1 elements, or the
        module not bound.
    """
    if (record is None or not group.gathers or not 2 <= group.size <= GATHERED_CHECK_RANKS or array.size >= 1 << 31
            or (plan.divide and array.dtype not in _DIVIDES) or ctx.engine.tracer is not None
            or _fault_tolerant(ctx) or not _bind()):
        return None
    done = Op("all_reduce", group, array.nbytes, lambda: [], record=record)
    done.state = COMPLETE  # the op that calls completed at the call share: nothing is left to do
    template = np.broadcast_to(np.empty((), array.dtype), array.shape)  # the dtype and shape, one element's memory
    return _lanes.Lane(
        kind=_lanes.HELD, ctx=ctx, group=group, op_key=op, template=template,
        datatype=plan.datatype, mpi_op=plan.mpi_op, divide=plan.divide, record=record, value=record.check_value(),
        per_rank=record.per_rank, rows=0, spins=ctx.engine.check_spins(),
        queued_post=(held_all_reduce, group.comm, plan), done_op=done, trace=None, keys=0, into=into,
        collective=_lanes.ALL_REDUCE, root=-1, **_communicators(ctx, group),
    )


def compiled_held_data_lane(ctx: Any, group: Any, kind: str, array: np.ndarray, root: int, record: Any,
                            plan: Any = None) -> Any:
    """The compiled lane of one kind of held broadcast, all-gather, all-to-all, gather or reduce (`held.py`), or None.

    Args:
        ctx: the context.
        group: the calls' group.
        kind: the collective's name.
        array: an input of the kind (dtype and shape).
        root: a rooted call's root, its index in the group (-1 for the others).
        record: the check's record of these calls.
        plan: a reduce's `ReducePlan` (MPI's own reduction: no codec, no division).

    Returns:
        A `_lanes.Lane` of kind ``HELD`` into another array, or None where there is none:
        unchecked calls, groups the check gathers no rows for, a context that traces, more
        than 2**31 - 1 bytes, or the module not bound.
    """
    if (record is None or not group.gathers or not 2 <= group.size <= GATHERED_CHECK_RANKS or array.nbytes >= 1 << 31
            or ctx.engine.tracer is not None or _fault_tolerant(ctx) or not _bind()):
        return None
    done = Op(kind, group, array.nbytes, lambda: [], record=record)
    done.state = COMPLETE  # the op that calls completed at the call share: nothing is left to do
    collective, post = _HELD_DATA[kind]
    return _lanes.Lane(
        kind=_lanes.HELD, ctx=ctx, group=group, op_key=None,
        template=np.broadcast_to(np.empty((), array.dtype), array.shape),
        datatype=MPI.BYTE if plan is None else plan.datatype, mpi_op=MPI.OP_NULL if plan is None else plan.mpi_op,
        divide=False, record=record, value=record.check_value(), per_rank=record.per_rank, rows=0,
        spins=ctx.engine.check_spins(), queued_post=(post, group.comm, (root, plan) if plan is not None else root),
        done_op=done, trace=None, keys=0, into=True, collective=getattr(_lanes, collective), root=root,
        **_communicators(ctx, group),
    )


# Per held collective: its lane's `collective` code and the post of a call whose check is queued.
_HELD_DATA = {
    "broadcast": ("BROADCAST", held_broadcast),
    "all_gather": ("ALL_GATHER", held_all_gather),
    "all_to_all": ("ALL_TO_ALL", held_all_to_all),
    "gather": ("GATHER", held_gather),
    "reduce": ("REDUCE", held_reduce),
}


def _fault_tolerant(ctx: Any) -> bool:
    """Whether a rank's death leaves `ctx`'s ranks running (fault tolerance): its calls then take no compiled lane.

    A compiled lane's check returns to the Python engine when ``MPI_Test`` reports an error,
    and that test has completed (and freed) the request: the engine's own test then finds it
    complete and reads the previous call's rows. Only a dead peer makes that error, and only
    where the launch or the context is fault tolerant (elsewhere the launcher ends the job),
    so the Python lanes, which report it, take those calls.
    """
    return ctx.engine.faults is not None or launched_fault_tolerant()


def _communicators(ctx: Any, group: Any) -> dict[str, Any]:
    """What a lane takes of its group and context beside their records: the communicators, the result's device.

    And, for a checked lane of a large group (whose check all-reduces one record), that record's
    datatype and op, and a carried call's code (set by the caller).
    """
    return {"comm": group.comm, "check_comm": group.check_comm, "device": ctx.cpu_device,
            "check_reduction": None if group.gathers else check_reduction(), "code": 0}


def _keys(plan: Any, dtype: np.dtype, checked: bool) -> int | None:
    """The lane's ``keys`` code for `plan` (0: none, 1: MAX, 2: MIN); None where no compiled lane encodes its input."""
    codec = plan.codec
    if codec is None or (checked and not isinstance(codec, OrderedKeys)):
        return 0  # a carried bool's rows are read as NumPy reads them, whatever their bytes
    if isinstance(codec, OrderedKeys) and dtype in _KEYS:
        return 1 if codec.maximum else 2
    return None


def _carried_post(keys: int) -> Any:
    """What a queued carried op posts: keys left for the finish to decode where the lane has keys."""
    return reduce_carried_keys if keys else reduce_carried


