"""`CollectiveTensor`, the handle every collective returns, and what collectives share.

That is: turning inputs into buffers, protecting them, and starting ops on the engine.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._core import state as _state
from .._core.backend import is_cupy_array
from .._core.device import Device
from .._core.dtypes import transfer_dtype
from .._core.errors import ContextClosedError, DeviceError, ForkedProcessError
from .._core.interop import take as take_foreign
from .._core.mpi import forked_from
from .._core.protect import Protection, foreign, restorable
from .._core.records import HandleRecord
from .._core.state import open_contexts
from .._core.tensor import Tensor, array_of
from .._runtime.check import Record
from .._runtime.context import DistributedContext
from .._runtime.engine import COMPLETE, FAILED, Group, Op
from .._runtime.tracing.ring import RESOLVED
from .._transport.reduction import finish_reduction, reduction_buffers, reduction_input

__all__ = [
    "PLAIN_DTYPES", "CollectiveTensor", "Convert", "Input", "Later", "follow", "refuse_masked", "settle_later",
    "take_input", "timeout_arg",
]


class CollectiveTensor(HandleRecord):
    """The result of a collective that may still be in flight.

    Compute placed between the collective call and `resolve()` overlaps the
    communication. The handle owns nothing MPI needs: dropping it unresolved is safe (the
    context keeps the buffers until MPI is done).
    """

    __slots__ = ()  # _op, _value, _ctx and _resolved: the record's (see _core/records.py)

    # Whether `resolve()` is this class's (or does what it does with a `Later` value), so that
    # `follow` may hang a converter on the handle itself; False for handles that wrap others.
    settles_later = True

    def __init__(self, op: Op, value: Any, ctx: DistributedContext) -> None:
        self._op = op
        self._value = value
        self._ctx = ctx
        self._resolved = False

    def resolve(self, timeout: float | None = None) -> Any:
        """Wait for the collective, finish it, and return its result.

        A second call returns the same result object.

        Args:
            timeout: seconds to wait at most; None uses the context's timeout
                (`DistributedConfig.timeout` or ``MPITENSOR_TIMEOUT``), else waits forever.

        Returns:
            The result: a `Tensor` (``None`` on non-root ranks of `reduce`, and the same
            structure of tensors for a fused all-reduce), or for an input of another
            library, a value of that library (a torch tensor, a JAX array, a Python number).

        Raises:
            CollectiveTimeoutError: the timeout passed (the context is then broken).
            CollectiveMismatchError: the ranks disagreed (found by the check).
            ContextClosedError: the context was closed before this handle was resolved.
            ForkedProcessError: called in a process forked from the rank, for a collective
                not resolved before the fork.
            ValueError: `timeout` is not positive.
        """
        op = self._op
        ctx = self._ctx
        if timeout is not None:  # a bad timeout is refused even when there is nothing left to wait for
            timeout = timeout_arg(timeout, ctx)
        if op.state == COMPLETE and (self._resolved or not ctx.closed):
            self._resolved = True
            if op.trace is not None:
                op.trace.mark(RESOLVED)
            if isinstance(self._value, Later):
                self._value = self._value.settle(op.result)
            return self._value
        if op.state == FAILED:
            assert op.error is not None
            raise op.error
        if ctx.closed:
            forked = forked_from()
            if forked is not None:  # the rank's handle, in a process forked from it: MPI is the rank's
                raise ForkedProcessError(_state.forked_message(forked))
            raise ContextClosedError(
                f"cannot resolve {op.describe()}: its context was closed first "
                "(close() completed it, but results must be resolved before closing)"
            )
        ctx.engine.wait(op, ctx.timeout if timeout is None else timeout)
        self._resolved = True
        if op.trace is not None:
            op.trace.mark(RESOLVED)
        if isinstance(self._value, Later):
            self._value = self._value.settle(op.result)
        return self._value

    def assume_resolved(self) -> Any:
        """Return the result without waiting (unsafe, as Burn's ``assume_resolved``).

        The returned tensor is the one `resolve()` will return, but until the collective
        completes its contents are undefined (and, for MEAN, not yet divided). Writing to
        it before then raises `TensorInFlightError`. Call `resolve()` before using it.

        Raises:
            CollectiveMismatchError: the check already found the ranks disagree.
        """
        op = self._op
        if op.state == FAILED:
            assert op.error is not None
            raise op.error
        value = self._value
        convert = None
        if isinstance(value, Convert):
            convert, value = value, value.inner
        if isinstance(value, Later):
            # The result's shape comes from the other ranks: wait for that exchange only.
            self._ctx.engine.wait_posted(op, self._ctx.timeout)
            if op.state == FAILED:
                assert op.error is not None
                raise op.error
            value = value.value
        if op.state < COMPLETE:
            self._ctx.engine.protect_outputs(op, value)
        return value if convert is None else convert.back(value)

    def test(self) -> bool:
        """Advance communication without blocking; True once the result is ready.

        Raises:
            ThreadMisuseError: called from a signal handler that interrupted this thread
                inside the engine (nothing is changed).
        """
        op = self._op
        if op.state < COMPLETE and not self._ctx.closed:
            engine = self._ctx.engine
            if engine.lock_held_here():
                raise engine.reentered("test()")
            engine.progress()
        return op.state >= COMPLETE

    @property
    def done(self) -> bool:
        """True once the collective is complete (see `test()`; this calls it)."""
        return self.test()

    def __repr__(self) -> str:
        return f"CollectiveTensor({self._op.describe()}, {self._op.state_name})"


def timeout_arg(timeout: float | None, ctx: DistributedContext) -> float | None:
    """The timeout to wait with: `timeout`, else the context's.

    Raises:
        ValueError: `timeout` is not a positive number.
        TypeError: `timeout` is not a number.
    """
    if timeout is None:
        return ctx.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Later:
    """A result that exists only once the op is posted (its shape comes from the peers).

    The op's `post()` sets `value`; `finish()` returns it.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None

    def settle(self, result: Any) -> Any:
        """What `resolve()` returns, given the op's result."""
        return result


def settle_later(later: Later, result: Any) -> Any:
    """``later.settle(result)``, for compiled code, which calls no method by name (`native`'s resolve)."""
    return later.settle(result)


class Convert(Later):
    """A result to be given back in another library's kind once the op completes.

    A `Later` so that `resolve()` needs no check of its own for it.

    Attributes:
        inner: the handle's value (a result, or a `Later`).
        back: the converter (see `_core.interop`).
    """

    __slots__ = ("back", "inner")

    def __init__(self, inner: Any, back: Any) -> None:
        super().__init__()
        self.inner = inner
        self.back = back

    def settle(self, result: Any) -> Any:
        """The op's result (or the value the handle held) converted back."""
        return self.back(result if isinstance(self.inner, Later) else self.inner)


def follow(handle: CollectiveTensor, back: Any) -> CollectiveTensor:
    """`handle`, made to give its result back through `back` (a converter; None: as it is)."""
    if back is None:
        return handle
    if not type(handle).settles_later:  # a handle with a resolve() of its own (GPU staging)
        return _Converted(handle, back)
    # The class is this module's own: its slot is set here, once per foreign input.
    handle._value = Convert(handle._value, back)
    return handle


class _Converted(CollectiveTensor):
    """A handle giving another handle's result back in another library's kind."""

    __slots__ = ("_back", "_inner", "_out")
    settles_later = False

    def __init__(self, inner: CollectiveTensor, back: Any) -> None:
        super().__init__(inner._op, None, inner._ctx)
        self._inner = inner
        self._back = back
        self._out: list[Any] = []

    def resolve(self, timeout: float | None = None) -> Any:
        """As `CollectiveTensor.resolve`, converted back (the same object again)."""
        value = self._inner.resolve(timeout)
        if not self._out:
            self._out.append(self._back(value))
        self._resolved = True
        return self._out[0]

    def assume_resolved(self) -> Any:
        """As `CollectiveTensor.assume_resolved`, converted back."""
        return self._back(self._inner.assume_resolved())


class Input:
    """A collective's input, made ready for MPI.

    Attributes:
        tensor: the Tensor given, or None for a bare array.
        array: the array given (NumPy or CuPy).
        buffer: what MPI reads: `array` itself, or a contiguous native copy of it.
        copied: True when `buffer` is a private copy (needs no protection).
        on_gpu: True for a CuPy input.
        back: for another library's tensor, what turns the result into that library's
            kind (see `_core.interop`); None otherwise.
    """

    __slots__ = ("array", "buffer", "copied", "on_gpu", "tensor")

    # A class attribute, not a slot: inputs of mpitensor's own kinds pay nothing for it.
    back: Any = None

    def __init__(self, tensor: Tensor | None, array: Any, buffer: Any, copied: bool, on_gpu: bool = False) -> None:
        self.tensor = tensor
        self.array = array
        self.buffer = buffer
        self.copied = copied
        self.on_gpu = on_gpu

    def guard(self, ctx: DistributedContext) -> tuple[Protection, ...]:
        """Keep the input from changing while MPI reads it; call before using `buffer`.

        The input is made read-only for the time being, or, where that would not keep it
        unchanged (memory another library owns and can write: torch, ctypes, DLPack) or
        NumPy could not make it writable again afterwards, `buffer` becomes a private copy.
        A copy needs nothing.
        """
        if self.copied:
            return ()
        array = self.array
        if type(array) is np.ndarray and (foreign(array) or (array.flags.writeable and not restorable(array))):
            self.buffer = ctx.pool.empty(array.shape, array.dtype)
            np.copyto(self.buffer, array)
            self.copied = True
            return ()
        return (Protection(self.tensor, array),)


class ForeignInput(Input):
    """An `Input` taken from another library's tensor or a number (its `back` is set)."""

    __slots__ = ("back",)


# The dtypes MPI carries as they are (native byte order); others go through transfer_dtype.
PLAIN_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128)
)


def take_input(value: Any, ctx: DistributedContext, what: str, argument: str = "input") -> Input:
    """Check a collective's input and make it ready for MPI.

    Non-contiguous or byte-swapped arrays are copied into a contiguous native buffer.
    Tensors of other libraries and numbers are taken through `_core.interop`.

    Raises:
        TypeError: not a tensor, array or number, or a dtype MPI cannot carry.
        DeviceError: a GPU tensor on another GPU than this rank's.
    """
    kind = type(value)
    if kind is Tensor or (kind is not np.ndarray and isinstance(value, Tensor)):
        # `array_of`, not the property: every collective call comes here.
        tensor, array = value, array_of(value)
    elif kind is np.ndarray or is_cupy_array(value):
        tensor, array = None, value
    elif isinstance(value, np.ndarray):
        refuse_masked(value, what, argument)
        tensor, array = None, value
    else:
        return _take_foreign(value, ctx, what, argument)
    dtype = array.dtype
    if dtype not in PLAIN_DTYPES:  # the common dtypes pass without a lookup of their MPI type
        dtype = transfer_dtype(dtype)
    if type(array) is not np.ndarray and is_cupy_array(array):
        _check_gpu(array, ctx, what)
        if array.flags.c_contiguous and dtype == array.dtype:
            return Input(tensor, array, array, False, True)
        import cupy

        return Input(tensor, array, cupy.ascontiguousarray(array, dtype=dtype), True, True)
    if array.flags.c_contiguous and dtype == array.dtype:
        return Input(tensor, array, array, False)
    buffer = ctx.pool.empty(array.shape, dtype)
    np.copyto(buffer, array, casting="no" if dtype == array.dtype else "equiv")
    return Input(tensor, array, buffer, True)


def refuse_masked(value: Any, what: str, argument: str = "input") -> None:
    """Refuse a NumPy masked array: MPI would send its masked elements' hidden values.

    Raises:
        TypeError: `value` is a ``numpy.ma.MaskedArray``.
    """
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(
            f"{what}: {argument} is a numpy.ma.MaskedArray, whose masked elements would be sent as the "
            "values hidden under the mask; pass value.filled(fill) (for a sum, fill=0) and, if the mask "
            "matters, reduce it too (np.ma.getmaskarray(value))"
        )


def _take_foreign(value: Any, ctx: DistributedContext, what: str, argument: str) -> ForeignInput:
    """`take_input` of another library's tensor or a number: its array, and how to give back."""
    taken = take_foreign(value, ctx.device, what, argument)
    source = take_input(taken.array, ctx, what, argument)
    # An array nobody can write in flight (a JAX array, a torch lazy clone, a number) is
    # read in place, without protection or a copy.
    foreign_input = ForeignInput(None, source.array, source.buffer, source.copied or taken.private, source.on_gpu)
    foreign_input.back = taken.back
    return foreign_input


def _check_gpu(array: Any, ctx: DistributedContext, what: str) -> None:
    device = ctx.device
    if device.kind == "cuda" and int(array.device.id) != device.index:
        raise DeviceError(
            f"{what} got a tensor on cuda:{array.device.id}, but this rank's device is "
            f"{device}; move it with tensor.to(ctx.device)"
        )


def start(ctx: DistributedContext, op: Op, value: Any, back: Any = None) -> CollectiveTensor:
    """Submit `op` to the context's engine and wrap it in a handle.

    Args:
        ctx: the context.
        op: the operation.
        value: what the handle resolves to (a result, or a `Later`).
        back: the converter back of the collective's input (`Input.back`, None for
            mpitensor's own kinds): the handle then gives its result in the input's kind.
            Every collective passes its input's, so that results follow one rule.
    """
    ctx.engine.submit(op)
    return follow(CollectiveTensor(op, value, ctx), back)


def check_record(ctx: DistributedContext, group: Group, record: Record) -> Record | None:
    """`record` if this call is checked (check on, more than one rank), else None."""
    if ctx.config.check and group.size > 1:
        return record
    return None


def context_for(what: str) -> DistributedContext:
    """The current context, checked usable.

    Raises:
        NoContextError, ContextClosedError, ContextBrokenError.
    """
    ctx = open_contexts[-1] if open_contexts else _state.current()
    if not ctx.usable:
        ctx.ensure_usable()
    return ctx


def root_rank(ctx: DistributedContext, root: Any) -> int:
    """The root's context rank, from an int rank or a `Device`.

    Raises:
        TypeError: `root` is neither.
        DeviceError: a Device that is not in the context.
    """
    if type(root) is int:  # the usual case, before the checks of the others
        return root
    if isinstance(root, Device):
        return ctx.rank_of_device(root)
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"root must be a rank (int) or a mpitensor.Device, got {type(root).__name__}")
    return int(root)


def group_root(group: Group, root: int, what: str) -> int:
    """The root's index in `group` (its rank in the group's communicator).

    Called when the data is posted, after the check: ranks that agree on a bad root all
    raise here, at the same point, so none is left waiting.

    Raises:
        ValueError: `root` is negative or not a member of the group.
    """
    if root < 0:
        raise ValueError(f"{what}: root must be a rank >= 0, got {root}")
    try:
        return group.members.index(root)
    except ValueError:
        raise ValueError(
            f"{what}: root {root} is not in the group {group.describe()}; the root must be one of its ranks"
        ) from None


def result_device(ctx: DistributedContext, source: Input) -> Any:
    """The device a host result goes to: the input tensor's, else this rank's CPU."""
    return source.tensor.device if source.tensor is not None else ctx.cpu_device


__all__ += [
    "check_record",
    "context_for",
    "finish_reduction",
    "group_root",
    "reduction_buffers",
    "reduction_input",
    "result_device",
    "root_rank",
    "start",
]
