"""Compiled compute kernels: `streaming_add` and `keys`, each None where not built.

`_streaming` (built from ``streaming.c`` by ``pip install`` where a C compiler is found, like
the compiled lane) reduces two inputs into one or two destinations with stores that bypass
the cache, for the shared-memory all-reduce's large slices. `_keys` (``keys.c``) encodes and
decodes MAX/MIN keys of float32 and float64 and combines two arrays as `Extremum` does, in
one pass each. Where they were not built (or ``MPITENSOR_NATIVE=0`` is set) NumPy does the
same, to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import compiled_parts_off

__all__ = ["keys", "streaming_add"]


def _load() -> Callable[..., bool] | None:
    if compiled_parts_off():
        return None
    try:
        from . import _streaming
    except ImportError:
        return None
    return _streaming.add


def _load_keys() -> Any:
    if compiled_parts_off():
        return None
    try:
        from . import _keys
    except ImportError:
        return None
    return _keys


# add(a, b, out, copy=None) -> bool: out[:] = a + b (and copy[:] = out), streamed; False when
# the arrays are not of the kinds it takes (then nothing is written).
streaming_add: Any = _load()

# encode(source, out, maximum), decode(array), extremum(a, b, out, maximum) -> bool: False
# (nothing written) for arrays other than C-contiguous native float32/float64 ones.
keys: Any = _load_keys()
