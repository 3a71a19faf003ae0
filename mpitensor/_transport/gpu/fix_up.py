"""What happens to a reduction's result on the device once MPI is done with it.

MEAN's division, the decoding of float MAX/MIN keys (see `_core.dtypes`) and the rounding
back of half precision (reduced in float32) run on the GPU, on whichever stream the caller
of `apply` has made current: the copy stream after a staged result's copy back, the
caller's stream for a result MPI wrote to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .streams import GpuCall

__all__ = ["FixUp", "apply", "finish_on_device"]


@dataclass(frozen=True)
class FixUp:
    """The device-side steps of a result.

    Attributes:
        divide_by: divide the result by this (``MEAN``), or None.
        into: the device array to convert the result into (the final result, rounded back
            from the work dtype), or None / the result itself when nothing is converted.
        decode: the plan's codec when the result holds MAX/MIN keys of floats, else None.
    """

    divide_by: int | None
    into: Any
    decode: Any = None


def apply(cupy: Any, out: Any, fix: FixUp) -> None:
    """Run `fix`'s steps on device array `out`, on the current stream.

    Args:
        cupy: the CuPy module.
        out: the device array the reduction landed in.
        fix: the steps.
    """
    if fix.divide_by is not None:
        cupy.true_divide(out, fix.divide_by, out=out)
    if fix.decode is not None:
        fix.decode.decode(out, xp=cupy)
    if fix.into is not None and fix.into is not out:
        cupy.copyto(fix.into, out, casting="unsafe")


def finish_on_device(call: GpuCall, out: Any, fix: FixUp) -> None:
    """Divide, decode and round a result that MPI wrote to the device, on the caller's stream.

    Args:
        call: the call (its device and the caller's stream).
        out: the device array MPI reduced into.
        fix: the steps.
    """
    with call.scope(), call.stream:
        apply(call.cupy, out, fix)
