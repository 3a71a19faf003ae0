"""The buffers of a reduction on the host: what is sent, what MPI reduces into, and the finish."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

__all__ = [
    "finish_reduction", "needs_decoding", "needs_finish", "reduction_buffers", "reduction_finisher", "reduction_input",
]


def reduction_input(ctx: Any, source: Any, plan: Any) -> tuple[Any, tuple[Any, ...]]:
    """The buffer a reduction sends, and the protections that keep it unchanged meanwhile.

    The buffer is the input, converted to the plan's work dtype where that differs, or
    for MAX/MIN of floats and complex numbers a private copy encoded for MPI (``plan.codec``:
    the integer keys MPI reduces for floats).

    Args:
        ctx: the context (its ``pool``; ``source.guard`` takes it).
        source: the collective's input (``buffer``, ``copied``, ``guard``).
        plan: the `ReducePlan`.

    Returns:
        The buffer to send and the protections to release once MPI is done with it.
    """
    codec = plan.codec
    if codec is not None:
        buffer = ctx.pool.empty(source.buffer.shape, plan.work_dtype)
        codec.encode(source.buffer, buffer)
        source.buffer = buffer
        source.copied = True
        return buffer, ()
    if plan.work_dtype != source.buffer.dtype:
        source.buffer = source.buffer.astype(plan.work_dtype)
        source.copied = True
    # guard() may swap in a private copy: read the buffer after it.
    protections = source.guard(ctx)
    return source.buffer, protections


def reduction_buffers(ctx: Any, shape: tuple[int, ...], plan: Any) -> tuple[np.ndarray, np.ndarray]:
    """The buffer MPI reduces into and the array the result tensor wraps.

    They are the same array, except for half precision, which is reduced in float32 and
    rounded back into the result by `finish_reduction`.

    Args:
        ctx: the context (its ``pool``).
        shape: the result's shape.
        plan: the `ReducePlan`.

    Returns:
        (work, final).
    """
    work = ctx.pool.empty(shape, plan.work_dtype)
    return work, (ctx.pool.empty(shape, plan.out_dtype) if plan.rounds_back else work)


def finish_reduction(work: np.ndarray, final: np.ndarray, plan: Any, size: int, decoded: bool = False) -> None:
    """Apply MEAN's division, turn MAX/MIN keys back into floats, round half precision back; in place.

    Args:
        work: the reduced buffer.
        final: the result array (`work` itself, or the half-precision array it is rounded into).
        plan: the `ReducePlan`.
        size: the group size (MEAN divides by it).
        decoded: `work` holds the values themselves, not MAX/MIN keys (the shared-memory
            path reduces the floats).
    """
    if plan.divide:
        np.true_divide(work, size, out=work)
    elif plan.codec is not None and not decoded:
        plan.codec.decode(work)
    if final is not work:
        np.copyto(final, work, casting="unsafe")


def reduction_finisher(call: Any) -> Callable[[], None] | None:
    """What turns a `ReduceCall`'s reduced buffer into its result, or None where nothing is left to do.

    ``call.decoded`` is read when the finisher runs, not now: a transport may learn only once
    started whether its result holds MAX/MIN keys (the in-check all-reduce that falls back to
    MPI's).
    """
    return partial(_finish_call, call) if needs_finish(call) else None


def needs_finish(call: Any) -> bool:
    """Whether a `ReduceCall`'s reduced buffer is not yet its result (see `reduction_finisher`).

    True for MEAN's division, MAX/MIN keys to decode and half precision to round back.
    """
    return call.plan.divide or needs_decoding(call)


def needs_decoding(call: Any) -> bool:
    """Whether a `ReduceCall`'s result needs more than MEAN's division: MAX/MIN keys or half precision."""
    return call.final is not call.out or call.plan.codec is not None


def _finish_call(call: Any) -> None:
    finish_reduction(call.out, call.final, call.plan, call.group.size, call.decoded)
