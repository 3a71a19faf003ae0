"""Axis arithmetic the gathering and scattering collectives share.

MPI moves blocks of contiguous memory; these collectives concatenate or split along any
axis, so the axis goes to the front first (a copy unless it is the first one already).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from .._runtime.context import DistributedContext

__all__ = ["axis_arg", "displacements", "to_front"]


def axis_arg(axis: Any, ndim: int, what: str) -> int:
    """`axis` as a non-negative axis of a tensor of `ndim` dimensions.

    Raises:
        TypeError: `axis` is not an int.
        ValueError: `axis` is out of range.
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{what}: axis must be an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for a tensor of {ndim} dimension(s)")
    return int(axis) % ndim


def to_front(ctx: DistributedContext, array: np.ndarray, axis: int) -> tuple[np.ndarray, bool]:
    """`array` with `axis` moved to the front, C-contiguous; and whether that took a copy."""
    if not axis:
        return array, False
    moved = np.moveaxis(array, axis, 0)
    buffer = ctx.pool.empty(moved.shape, moved.dtype)
    np.copyto(buffer, moved)
    return buffer, True


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of `counts` elements starts."""
    # Python's accumulate: NumPy's cumsum costs microseconds on a list of a few ints.
    return list(accumulate((int(count) for count in counts[:-1]), initial=0))
