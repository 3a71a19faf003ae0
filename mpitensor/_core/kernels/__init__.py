"""Compiled compute kernels of the transports: `streaming_add`, or None where not built.

`_streaming` (built from ``streaming.c`` by ``pip install`` where a C compiler is found, like
the compiled lane) reduces two inputs into one or two destinations with stores that bypass
the cache, for the shared-memory all-reduce's large slices. Where it was not built (or
``MPITENSOR_NATIVE=0`` is set) the transports reduce with NumPy, to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import compiled_parts_off

__all__ = ["streaming_add"]


def _load() -> Callable[..., bool] | None:
    if compiled_parts_off():
        return None
    try:
        from . import _streaming
    except ImportError:
        return None
    return _streaming.add


# add(a, b, out, copy=None) -> bool: out[:] = a + b (and copy[:] = out), streamed; False when
# the arrays are not of the kinds it takes (then nothing is written).
streaming_add: Any = _load()
