"""The lane of repeated all-reduces: what a call of one kind needs, kept after its first.

Most all-reduce calls of a program repeat: the same dtype, shape and op on the same
context, with no options (a loss, a metric, a step counter). The first call of a kind takes
the general path (`all_reduce.all_reduce`), which checks the input, plans the reduction,
picks a transport and builds the check's record. Where that transport is MPI's (in place on
a copy, or from the protected input into a pooled buffer) or the check itself (the copy
carried in it), the input is at most `LANE_BYTES`, and the result needs no finishing but
MEAN's division or MAX/MIN keys of floats decoded, the call keeps them in a lane. Later
calls of that kind find the lane and only copy (or protect, or encode) the input, start the
op and wrap the result: at 8 bytes the general path's planning is most of a call's cost.

Each choice a lane keeps depends only on its key and its context: the transports'
``applies`` read the input's size, the plan, the group's size and the configuration. A lane
therefore makes the choice the general path would, and the check still compares every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import Any

import numpy as np

from .._core.config import ReduceOperation
from .._core.dtypes import BoolBytes, OrderedKeys
from .._core.interop import take_quickly
from .._core.limits import LANE_BYTES
from .._core.state import open_contexts
from .._core.tensor import Tensor, array_of, wrap_array
from .._runtime.context import DevicesArg
from .._runtime.engine import Group, Op
from .._runtime.ordering import set_barrier, wait_for_compiled
from .._transport.base import ReduceCall
from .._transport.inline import INLINE_RANKS, carry, reduce_carried, reduce_carried_keys
from .._transport.mpi import SMALL_BYTES, in_place, out_of_place
from .._transport.reduced_check import carry_code, coded
from .._transport.reduction import finish_reduction, needs_decoding, reduction_finisher, reduction_input
from .._transport.select import IN_CHECK, IN_PLACE, PLAIN
from .common import CollectiveTensor, Input, follow
from .native import compiled_lane, front, keep_held, set_before_call
from .plans import find_plan, keep_plan

__all__ = [
    "LANE_BYTES", "CheckLane", "CopiedInto", "CopyLane", "PlainLane", "held_key", "keep_lane", "lane_key",
    "on_held_plan", "start_reduction", "with_lane", "written_into",
]

_UNSET: Any = object()  # no input given: the general path says so
_HELD_OPTIONS = frozenset({"held", "out"})  # the options of held calls that may have a kept plan


def order_after_compiled(barrier: Callable[[], None]) -> None:
    """Have every collective the owner thread calls wait for `barrier()` first, lanes included.

    mpitensor.jax sets JAX's ``effects_barrier`` once it compiles a collective, so that an
    eager call comes after the collectives of the programs dispatched before it (see
    `_runtime.ordering`).
    """
    set_barrier(barrier)
    set_before_call(wait_for_compiled)


def with_lane(general: Callable[..., CollectiveTensor]) -> Callable[..., CollectiveTensor]:
    """`general` (the public `all_reduce`), with repeated calls taking their lane first.

    A call takes its lane when it has no ``devices`` or options, its input is a
    C-contiguous NumPy array of at most `LANE_BYTES` (alone or in a `Tensor`) of a kind
    that has a lane on the current context, and it is made from the context's owner thread
    while the context is usable. A Python number, NumPy scalar or CPU torch tensor takes
    the lane of the array `interop.take_quickly` gives for it (the general path reduces
    that same array), and its result comes back in its own kind, as the general path gives
    it. A held call (``held=True``, with ``out`` or in place) on the full group whose kind
    has a kept compiled plan starts on it (`on_held_plan`). Every other call, and the first
    of each kind, goes to `general`, which also raises the errors of bad calls.

    Args:
        general: `all_reduce` as the public API wraps it (`collective_entry`).

    Where the compiled lane is built, the returned function sits behind its entry
    (`native.front`), which starts calls on their compiled lanes before any of this.

    Returns:
        The public `all_reduce`.
    """

    @functools.wraps(general)
    def all_reduce(
        input: Any = _UNSET,  # noqa: A002 - the seed's name
        op: ReduceOperation | str | None = None,
        devices: DevicesArg = None,
        *more: Any,
        **options: Any,
    ) -> CollectiveTensor:
        if devices is None and open_contexts and not options and not more:
            wait_for_compiled()
            kind = type(input)
            back = None
            if kind is np.ndarray:
                array = input
            elif kind is Tensor:
                array = array_of(input)
            else:  # a number or a CPU torch tensor: its array, and the result given back in its kind
                array, back = take_quickly(input, SMALL_BYTES) or (None, None)
            # Every lane's input fits `LANE_BYTES`: larger calls leave here, before the lookup.
            if type(array) is np.ndarray and array.nbytes <= LANE_BYTES and array.flags.c_contiguous:
                handle = _on_lane(input if kind is Tensor else None, array, op)
                if handle is not None:
                    return handle if back is None else follow(handle, back)
        elif options.get("held") is True and devices is None and not more and options.keys() <= _HELD_OPTIONS:
            handle = on_held_plan(input, op, options.get("out"))
            if handle is not None:
                return handle
        if input is _UNSET:
            # No input: `general` raises inside the entry, which tells the peers that this
            # rank's call failed (as it does for arguments all_reduce does not take).
            return general(op=op, devices=devices, **options)
        if more:
            return general(input, op, devices, *more, **options)
        return general(input, op, devices, **options)

    return front(all_reduce)


def _on_lane(tensor: Tensor | None, array: np.ndarray, op: Any) -> CollectiveTensor | None:
    """Start the call on its lane on the current context; None when it has none (or may not take it now)."""
    ctx = open_contexts[-1]
    if not ctx.usable or ctx.owner_thread != get_ident():
        return None
    lane = find_plan(ctx, lane_key(array, op))
    return None if lane is None else lane.start(tensor, array)


def on_held_plan(array: Any, op: Any, out: Any) -> CollectiveTensor | None:
    """A held call on the full group started on its kept compiled plan, before the Python entry; None without one.

    As the compiled front does for ordinary calls: after the wait for compiled programs, with
    no Python entry around it (inside jax.jit, where the caches are cold after JAX's dispatch,
    that entry cost 7-8 us per call). The compiled lane checks the thread, the context and both
    arrays, and declines (None) what the general path must take.
    """
    if type(array) is not np.ndarray or not open_contexts:
        return None
    into = out is not None and out is not array
    lane = find_plan(open_contexts[-1], held_key(array, op, into))
    if lane is None:
        return None
    wait_for_compiled()
    handle = lane.start_held(array, out if into else array)
    if handle is not None and not into:
        # Its compiled lane takes the next such calls in the compiled entry, as this one was taken.
        compiled = lane.lane.compiled if type(lane) is CopiedInto else lane
        if compiled is not None:
            keep_held(compiled)
    return handle


def held_key(array: np.ndarray, op: Any, into: bool) -> tuple[Any, ...]:
    """The plan cache's key of held all-reduces of `array`'s kind (in place, or `into` another array)."""
    return "all_reduce", array.dtype, array.shape, op, "held", into


class CopiedInto:
    """The plan of held all-reduces that an ordinary one serves: its lane, the result in the caller's buffer.

    For held calls MPI cannot reduce where they are as a held call (small ones in place,
    bool, MAX/MIN of floats) and those into another buffer below `HELD_INTO_BYTES`
    (`all_reduce._copied`). The compiled lane reduces into the caller's buffer itself
    (``start_into``); the Python lane's fresh result is copied in when the call resolves.

    Args:
        lane: the lane of the ordinary calls of the kind.
    """

    __slots__ = ("lane",)

    def __init__(self, lane: _Lane) -> None:
        self.lane = lane

    def start_held(self, array: np.ndarray, out: np.ndarray) -> CollectiveTensor | None:
        """Start the call of `array` on the lane, its result in `out` (`array` itself in place).

        Returns:
            The handle; None where the lane declines the call, or `out` is not a buffer of the
            kind (the general path then takes the call, and says what is wrong).
        """
        compiled = self.lane.compiled
        if compiled is not None:
            return compiled.start_into(array, out)
        ctx = self.lane.ctx
        if not ctx.usable or ctx.owner_thread != get_ident():
            return None
        if out is not array and (type(out) is not np.ndarray or out.shape != array.shape or out.dtype != array.dtype
                                 or not out.flags.c_contiguous or not out.flags.writeable
                                 or np.shares_memory(array, out)):
            return None
        handle = self.lane.start_here(None, array)
        return None if handle is None else follow(handle, partial(written_into, out))


def written_into(target: np.ndarray, result: Any) -> Tensor:
    """An all-reduce's `result` copied into the caller's `target`, as a Tensor over it."""
    np.copyto(target, array_of(result))
    return wrap_array(target, result.device)


def lane_key(array: np.ndarray, op: Any) -> tuple[Any, ...]:
    """The plan cache's key of ``all_reduce(array, op)`` calls (no ``devices`` or options)."""
    return "all_reduce", array.dtype, array.shape, op


class _Lane:
    """What the lanes keep.

    Args:
        ctx: the context.
        group: the context's full group.
        plan: the `ReducePlan`.
        record: the check's shared record, or None when the context does not check.

    Attributes:
        compiled: the compiled lane of the same kind (`native.compiled_lane`), which calls
            try first, or None.
    """

    __slots__ = ("compiled", "ctx", "group", "plan", "record")

    def __init__(self, ctx: Any, group: Group, plan: Any, record: Any) -> None:
        self.ctx = ctx
        self.group = group
        self.plan = plan
        self.record = record
        self.compiled: Any = None

    def start(self, tensor: Tensor | None, array: np.ndarray) -> CollectiveTensor | None:
        """Start the all-reduce of `array` (the data of `tensor`, if one was given).

        On the compiled lane where there is one and it takes the call, else in Python
        (`start_here`).

        Returns:
            The handle; None if the input could not be copied or protected (the general path
            then takes the call again, and reports the failure to the peers as it does).
        """
        compiled = self.compiled
        if compiled is not None:
            handle = compiled.start(tensor, array)
            if handle is not None:
                return handle
        return self.start_here(tensor, array)

    def start_here(self, tensor: Tensor | None, array: np.ndarray) -> CollectiveTensor | None:
        """`start` in Python: what the lane's transport's ``prepare`` and ``start`` do, without a call object."""
        raise NotImplementedError

    def _finish(self, result: np.ndarray) -> Callable[[], Any] | None:
        """MEAN's division of `result` once it is reduced, or its MAX/MIN keys decoded; None for every other op."""
        plan = self.plan
        if isinstance(plan.codec, OrderedKeys):
            return partial(plan.codec.decode, result)
        if not plan.divide:
            return None
        return partial(finish_reduction, result, result, plan, self.group.size)


class CopyLane(_Lane):
    """The lane of calls that MPI reduces in place on a plain copy of the input (`IN_PLACE`).

    Its plan's work dtype is the input's. The copy is encoded where the plan has a codec
    (MAX/MIN keys of floats, bool bytes made 0 and 1); MEAN divides the result once MPI is
    done, and keys are decoded then, as the general path's finish does.
    """

    __slots__ = ()

    def start_here(self, tensor: Tensor | None, array: np.ndarray) -> CollectiveTensor | None:
        """Start the all-reduce of `array` (the data of `tensor`, if one was given).

        What `IN_PLACE`'s ``prepare`` and ``start`` do for such a plan, without a call object.

        Returns:
            The handle; None if the input could not be copied (the general path then takes
            the call again, and reports the failure to the peers as it does).
        """
        ctx = self.ctx
        group = self.group
        codec = self.plan.codec
        try:
            if codec is None:
                buffer = array.copy()
            else:
                buffer = np.empty_like(array)
                codec.encode(array, buffer)
        except Exception:  # nothing is posted yet: the general path takes the call again and reports it
            return None
        post = partial(in_place, group.comm, buffer, self.plan)
        op = Op("all_reduce", group, array.nbytes, post, self._finish(buffer), self.record)
        ctx.engine.submit(op)
        return CollectiveTensor(op, wrap_array(buffer, ctx.cpu_device if tensor is None else tensor.device), ctx)


class CheckLane(_Lane):
    """The lane of calls whose input travels in their check (`IN_CHECK`).

    It has a record. MEAN divides the result, as in `CopyLane`; for MAX/MIN of floats the
    op leaves keys whichever way it is reduced (`reduce_carried_keys`), which its finish
    decodes.
    """

    __slots__ = ()

    def start_here(self, tensor: Tensor | None, array: np.ndarray) -> CollectiveTensor | None:
        """Start the all-reduce of `array` (the data of `tensor`, if one was given).

        What `IN_CHECK`'s ``prepare`` and ``start`` do, without a call object.

        Returns:
            The handle; None if the input could not be copied (as `CopyLane.start`).
        """
        ctx = self.ctx
        group = self.group
        plan = self.plan
        try:
            payload = carry(array, plan.work_dtype)
            if group.size > INLINE_RANKS:  # a large group's check reduces it: its code goes with it
                payload = coded(payload, carry_code(plan, plan.work_dtype, array.size))
            out = np.empty(array.shape, plan.work_dtype)
        except Exception:  # nothing is posted yet: the general path takes the call again and reports it
            return None
        reduce = reduce_carried_keys if isinstance(plan.codec, OrderedKeys) else reduce_carried
        post = partial(reduce, group.comm, out, payload, plan)
        op = Op("all_reduce", group, array.nbytes, post, self._finish(out), self.record, payload=payload)
        ctx.engine.submit(op)
        return CollectiveTensor(op, wrap_array(out, ctx.cpu_device if tensor is None else tensor.device), ctx)


class PlainLane(_Lane):
    """The lane of calls MPI reduces from the protected input into a pooled buffer (`PLAIN`).

    Inputs larger than `SMALL_BYTES` that node peers do not reduce through shared memory.
    Its plan's work dtype is the input's, and it has no codec.
    """

    __slots__ = ()

    def start_here(self, tensor: Tensor | None, array: np.ndarray) -> CollectiveTensor | None:
        """Start the all-reduce of `array` (the data of `tensor`, if one was given).

        What `PLAIN`'s ``prepare`` and ``start`` do, without a call object: the input is
        write-protected until MPI is done with it (or copied, where it cannot be), as on
        the general path.

        Returns:
            The handle; None if the result buffer or the input's copy could not be had (as
            `CopyLane.start`).
        """
        ctx = self.ctx
        group = self.group
        plan = self.plan
        try:
            out = ctx.pool.empty(array.shape, plan.work_dtype)
            # Last: once it returns, the input is protected (or copied), and nothing below fails.
            send, protections = reduction_input(ctx, Input(tensor, array, array, False), plan)
        except Exception:  # nothing is posted yet: the general path takes the call again and reports it
            return None
        post = partial(out_of_place, group.comm, send, out, plan)
        op = Op("all_reduce", group, array.nbytes, post, self._finish(out), self.record, (), protections)
        ctx.engine.submit(op)
        return CollectiveTensor(op, wrap_array(out, ctx.cpu_device if tensor is None else tensor.device), ctx)


def keep_lane(call: ReduceCall, op: Any, record: Any) -> None:
    """Keep a lane for the calls of `call`'s kind, if they may take one.

    Args:
        call: a call of the general path, started without ``devices`` or options on a
            C-contiguous host array of MPI's own dtypes, as it was given.
        op: the op argument as given (None, a name or a `ReduceOperation`): part of the key.
        record: the call's shared record, or None.
    """
    transport = call.transport
    if transport is not IN_PLACE and transport is not IN_CHECK and (transport is not PLAIN or call.nbytes > LANE_BYTES):
        return  # larger calls, the usual case here
    ctx = call.ctx
    group = call.group
    plan = call.plan
    # Of what a result may need once reduced, a lane does MEAN's division and decodes MAX/MIN
    # keys (not on a pooled buffer's lane: no half precision rounded back).
    if group is not ctx.full_group or (needs_decoding(call) and not _decodes(call)):
        return
    array = call.source.array
    if plan.combine is np.multiply and array.ndim == 0 and array.dtype == np.int64:
        return  # the lanes take Python ints unchecked: their products go where int64's range is checked
    if transport is IN_CHECK:
        lane: _Lane = CheckLane(ctx, group, plan, record)
        lane.compiled = compiled_lane(lane, array, op, checked=True)
    elif plan.work_dtype != array.dtype:
        return
    elif transport is IN_PLACE:
        lane = CopyLane(ctx, group, plan, record)
        lane.compiled = compiled_lane(lane, array, op, checked=False)
    else:
        lane = PlainLane(ctx, group, plan, record)
    keep_plan(ctx, lane_key(array, op), lane)


def _decodes(call: ReduceCall) -> bool:
    """Whether a lane can finish `call`'s kind: float keys or bool bytes, on a copy or in the check."""
    codec = call.plan.codec
    return call.final is call.out and call.transport is not PLAIN and isinstance(codec, (OrderedKeys, BoolBytes))


def start_reduction(call: ReduceCall, record: Any, device: Any, exchange: bool = False) -> CollectiveTensor:
    """Submit a prepared host all-reduce `call` and return its handle.

    Args:
        call: the call, its transport chosen and prepared.
        record: the check's record, or None.
        device: the result's device.
        exchange: the transport's ``start`` takes every rank's per-rank value of the check
            (a held all-reduce of 2 ranks: whether each rank's core is contested).
    """
    finish = reduction_finisher(call)
    if call.transport is IN_CHECK:
        op = Op("all_reduce", call.group, call.nbytes, call.start_from, finish, record, payload=call.send)
    elif exchange:
        op = Op("all_reduce", call.group, call.nbytes, call.start_from, finish, record, (call,), call.protections,
                exchange=True)
    else:
        op = Op("all_reduce", call.group, call.nbytes, call.start, finish, record, (call,), call.protections)
    ctx = call.ctx
    ctx.engine.submit(op)
    return CollectiveTensor(op, wrap_array(call.final, device), ctx)
