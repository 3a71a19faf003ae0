"""Options several collectives share: ``out=`` result buffers and Horovod's scale factors.

``out=``: the result is written into a tensor or array the caller owns, so that a loop
allocates nothing. `output_buffer` validates it (shape, dtype, writable, C-contiguous, no
overlap with the call's inputs) and returns the array MPI writes; `output_tensor` gives
the Tensor `resolve()` returns (``out`` itself when it is a Tensor, else a Tensor sharing
its memory); `protect_output` keeps it from being written behind mpitensor's back while
MPI writes it (writes through it raise, as for inputs; reads see undefined data).

Scale factors: ``prescale_factor`` multiplies each rank's input before the reduction
(into the private buffer MPI sends, never the caller's input), ``postscale_factor`` the
result after it. `scale_factors` validates them for a dtype (a factor of 1 becomes None,
which costs nothing); `prescaled_input` and `finish_scaled` apply them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .._core.protect import Protection, claim
from .._core.tensor import Tensor, wrap_array
from .._runtime.check import OptionsRecord, Record
from .._runtime.context import DistributedContext
from .._runtime.engine import Group, Op
from .common import Input, finish_reduction, reduction_input
from .layout import axis_arg

__all__ = [
    "axis_arg",
    "blocks_or_problem",
    "finish_scaled",
    "make_record",
    "output_buffer",
    "output_tensor",
    "prescaled_input",
    "protect_output",
    "refuse_for_structure",
    "refuse_on_gpu",
    "reduction_outputs",
    "row_counts",
    "scale_factors",
    "scale_options",
    "split_first_axis",
]


def output_buffer(
    ctx: DistributedContext,
    out: Any,
    shape: tuple[int, ...],
    dtype: np.dtype,
    what: str,
    inputs: tuple[Any, ...] = (),
) -> np.ndarray:
    """The array a collective writes its result into: `out`'s, checked, or a fresh one.

    Args:
        ctx: the context (its pool gives the fresh array when `out` is None).
        out: None, a host `Tensor` or a NumPy array.
        shape: the result's shape.
        dtype: the result's dtype.
        what: the collective's name, for messages.
        inputs: arrays of the same call that `out` must not overlap (collectives that
            support working in place leave it empty).

    Returns:
        The array to write: `out`'s own memory, or a fresh array when `out` is None.

    Raises:
        TypeError: `out` is not a Tensor or NumPy array, is on a GPU, or has another dtype.
        ValueError: another shape, read-only, not C-contiguous, or overlapping an input.
    """
    if out is None:
        return ctx.pool.empty(shape, dtype)
    array = out.array if isinstance(out, Tensor) else out
    if type(array) is not np.ndarray:
        kind = "a GPU tensor" if hasattr(array, "__cuda_array_interface__") else _type_name(out)
        raise TypeError(
            f"{what}: out= must be a host mpitensor.Tensor or a NumPy array, got {kind}; "
            "pass a NumPy array (for a torch tensor: tensor.numpy(), which shares its memory)"
        )
    if array.dtype != dtype:
        raise TypeError(f"{what}: out= has dtype {array.dtype}, but the result has dtype {dtype}")
    if array.shape != tuple(shape):
        raise ValueError(f"{what}: out= has shape {array.shape}, but the result has shape {tuple(shape)}")
    # Before the writable check: an input in flight is read-only, which an out= over it would report.
    for other in inputs:
        if other is not None and np.may_share_memory(array, other):
            raise ValueError(f"{what}: out= overlaps the input; pass a separate array of the result's shape and "
                             "dtype, or no out= for a new one")
    if not array.flags.writeable:
        raise ValueError(f"{what}: out= is read-only (or in another collective still in flight)")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what}: out= must be C-contiguous; pass a contiguous array (np.ascontiguousarray)")
    return array


def _type_name(value: Any) -> str:
    """A type's name with its library's (``torch.Tensor``), so that it is not read as mpitensor's own."""
    kind = type(value)
    library = kind.__module__.split(".")[0]
    return kind.__qualname__ if library == "builtins" else f"{library}.{kind.__qualname__}"


def output_tensor(out: Any, array: Any, device: Any) -> Tensor:
    """The Tensor `resolve()` returns: `out` if it is one, else a Tensor over `array`."""
    return out if isinstance(out, Tensor) else wrap_array(array, device)


def protect_output(op: Op, out: Any, array: np.ndarray) -> None:
    """Protect a caller's `out` until `op` completes (nothing when `out` is None).

    Writes through `out` then raise, as for inputs in flight. Call it from the op's
    ``post``, after MPI has taken the buffer: MPI needs it writable.
    """
    if out is not None:
        protection = Protection(out if isinstance(out, Tensor) else None, array)
        claim((protection,))  # the op's, posted: lifted when it completes
        op.protections = (*op.protections, protection)


def reduction_outputs(
    ctx: DistributedContext, out: Any, shape: tuple[int, ...], plan: Any, what: str, inputs: tuple[Any, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """`reduction_buffers` with `out=`: the buffer MPI reduces into and the result array.

    The result array is `out`'s (checked by `output_buffer` against the plan's result
    dtype); MPI reduces into it too, except for half precision, reduced in float32.
    """
    final = output_buffer(ctx, out, shape, plan.out_dtype, what, inputs)
    return (ctx.pool.empty(shape, plan.work_dtype) if plan.rounds_back else final), final


def make_record(options: tuple[tuple[str, Any], ...], *args: Any, **kwargs: Any) -> Record:
    """A plain `Record` when no option is set, else an `OptionsRecord` (same arguments)."""
    if not options:
        return Record(*args, **kwargs)
    return OptionsRecord(*args, options=options, **kwargs)


def scale_factors(prescale: Any, postscale: Any, dtype: np.dtype, what: str) -> tuple[Any, Any]:
    """Check Horovod-style scale factors for tensors of `dtype`.

    Args:
        prescale: the factor applied to each rank's input (None or 1: none).
        postscale: the factor applied to the result (None or 1: none).
        dtype: the input's dtype.
        what: the collective's name, for messages.

    Returns:
        ``(prescale, postscale)``, each None when it is 1 (or not given), else a
        0-d NumPy array of the factor (int64, float64 or complex128).

    Raises:
        TypeError: a factor that is not a number, a non-integer factor for an integer
            tensor, any factor but 1 for bool, or a complex factor for a real tensor.
    """
    return _factor(prescale, dtype, what, "prescale_factor"), _factor(postscale, dtype, what, "postscale_factor")


def _factor(value: Any, dtype: np.dtype, what: str, name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"{what}: {name} must be a number, got {type(value).__name__}")
    if value == 1:
        return None
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real) and dtype.kind != "c":
        raise TypeError(f"{what}: {name}={value!r} is complex, but the tensor's dtype {dtype} is not")
    if dtype.kind == "b":
        raise TypeError(f"{what}: bool tensors cannot be scaled ({name}={value!r}); only 1 is allowed")
    if dtype.kind in "iu":
        return _integer_factor(value, dtype, what, name)
    return np.asarray(value, np.complex128 if dtype.kind == "c" else np.float64)


def _integer_factor(value: Any, dtype: np.dtype, what: str, name: str) -> np.ndarray:
    """An integer tensor's factor, as a 0-d array of the tensor's own dtype.

    The tensor is multiplied in its dtype, wrapping on overflow, as NumPy's ``x * factor``
    with a Python int is: a factor of another integer dtype would make NumPy promote (uint64
    by int64 gives float64, which rounds large values).

    Raises:
        TypeError: a factor that is not an integer.
        ValueError: an integer the tensor's dtype cannot hold.
    """
    if not isinstance(value, numbers.Integral) and not (math.isfinite(value) and float(value).is_integer()):
        raise TypeError(
            f"{what}: {name}={value!r} is not an integer, but the tensor's dtype is {dtype}; "
            "scale integer tensors by integers, or convert them to a float dtype first"
        )
    integer = int(value)
    info = np.iinfo(dtype)
    if not info.min <= integer <= info.max:
        raise ValueError(
            f"{what}: {name}={integer} is out of the range of the tensor's dtype {dtype} "
            f"([{info.min}, {info.max}]); integer tensors are scaled in their own dtype, as NumPy does"
        )
    return np.asarray(integer, dtype)


def scale_options(prescale: Any, postscale: Any) -> tuple[tuple[str, Any], ...]:
    """The factors as `OptionsRecord` options (empty when both are None)."""
    options = []
    if prescale is not None:
        options.append(("prescale_factor", prescale.item()))
    if postscale is not None:
        options.append(("postscale_factor", postscale.item()))
    return tuple(options)



def prescaled_input(ctx: DistributedContext, source: Input, plan: Any, factor: Any) -> tuple[Any, tuple[Any, ...]]:
    """`reduction_input`, with the input multiplied by `factor` first (None: unscaled).

    The product goes into a private buffer of the plan's work dtype, so the caller's input
    is never changed (and needs no protection).
    """
    if factor is None:
        return reduction_input(ctx, source, plan)
    buffer = ctx.pool.empty(source.buffer.shape, plan.work_dtype)
    # Integer tensors are multiplied in their own dtype, wrapping on overflow, as NumPy's
    # own integer multiply does, also where the reduction works in another dtype (MEAN's
    # float64, a widened sum).
    if factor.dtype.kind in "iu" and buffer.dtype != factor.dtype:
        np.copyto(buffer, np.multiply(source.buffer, factor), casting="unsafe")
    else:
        np.multiply(source.buffer, factor, out=buffer, casting="unsafe")
    if plan.codec is not None:
        plan.codec.encode(buffer, buffer)
    source.buffer = buffer
    source.copied = True
    return buffer, ()


def finish_scaled(work: np.ndarray, final: np.ndarray, plan: Any, size: int, factor: Any) -> None:
    """`finish_reduction`, then the result multiplied by `factor` (None: unscaled).

    Half precision is scaled in the float32 work buffer, before it is rounded back once.
    """
    if factor is None:
        finish_reduction(work, final, plan, size)
        return
    finish_reduction(work, work, plan, size)
    np.multiply(work, factor, out=work, casting="unsafe")
    if final is not work:
        np.copyto(final, work, casting="unsafe")


def refuse_on_gpu(what: str, **options: Any) -> None:
    """Raise for options the GPU path of `what` does not take yet (those not None).

    Raises:
        TypeError: naming the first such option.
    """
    _refuse(what, options, "GPU (CuPy) tensors yet", "pass a host tensor, or call it without {name}=")


def refuse_for_structure(what: str, **options: Any) -> None:
    """Raise for options a call on a list, tuple or dict of tensors does not take (those not None).

    Raises:
        TypeError: naming the first such option.
    """
    _refuse(what, options, "a list, tuple or dict of tensors", "call it on each tensor to use it")


def _refuse(what: str, options: dict[str, Any], case: str, remedy: str) -> None:
    """Raise TypeError for the first option given (not None): not supported for `case`; `remedy`."""
    for name, value in options.items():
        if value is not None:
            raise TypeError(f"{what}: {name}= is not supported for {case}; {remedy.format(name=name)}")


def row_counts(counts: Any, shape: tuple[int, ...], group: Group, what: str, name: str) -> tuple[int, ...] | None:
    """Check a per-member list of row counts along the first axis (None: not given).

    Args:
        counts: one count per group member, in group order (a sequence or NumPy array).
        shape: the input's shape; the counts must sum to its first dimension.
        group: the group.
        what: the collective's name, for messages.
        name: the argument's name, for messages.

    Returns:
        The counts as a tuple of ints, or None when `counts` is None.

    Raises:
        TypeError: not a sequence of ints.
        ValueError: a 0-d input, a length other than the group size, a negative count,
            or a sum other than the first dimension.
    """
    if counts is None:
        return None
    if isinstance(counts, (str, bytes, dict)) or not hasattr(counts, "__len__"):
        raise TypeError(f"{what}: {name} must be a list of ints (one per group member), got {type(counts).__name__}")
    values = list(counts)
    for value in values:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what}: {name} must hold ints, got {value!r} ({type(value).__name__})")
        if value < 0:
            raise ValueError(f"{what}: {name} must be non-negative, got {values}")
    if len(values) != group.size:
        raise ValueError(
            f"{what}: {name} has {len(values)} entries, but the group {group.describe()} has {group.size} members; "
            "give one count per member"
        )
    if not shape:
        raise ValueError(f"{what} needs a tensor with at least one dimension, got a 0-d tensor")
    if sum(values) != shape[0]:
        raise ValueError(
            f"{what}: {name} {values} sum to {sum(values)}, but the input has {shape[0]} rows (first dimension)"
        )
    return tuple(int(value) for value in values)


def split_first_axis(shape: tuple[int, ...], parts: int, what: str) -> tuple[int, ...]:
    """The shape of one of `parts` equal blocks of `shape` along its first axis.

    Raises:
        ValueError: a 0-d shape, or a first dimension not divisible by `parts`.
    """
    if not shape:
        raise ValueError(f"{what} needs a tensor with at least one dimension, got a 0-d tensor")
    if shape[0] % parts:
        raise ValueError(
            f"{what}: the first dimension ({shape[0]}) must be divisible by the group size ({parts}); "
            f"pad it to {-(-shape[0] // parts) * parts}"
        )
    return (shape[0] // parts, *shape[1:])


def blocks_or_problem(shape: tuple[int, ...], parts: int, what: str) -> tuple[ValueError | None, tuple[int, ...]]:
    """`split_first_axis`, with its error returned instead of raised (to raise in post)."""
    try:
        return None, split_first_axis(shape, parts, what)
    except ValueError as exc:
        return exc, (0,)
