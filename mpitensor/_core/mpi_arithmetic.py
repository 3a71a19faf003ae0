"""What this process's MPI library computes wrongly, found by a local probe at the first context.

Open MPI's AVX reduction component adds int8, uint8, int16 and uint16 with saturating
instructions: 100 + 100 in int8 gives 127 where NumPy (and C's own wrapping) gives -56,
from 16 elements up on an AVX-512 machine (Open MPI keeps it so: its issue "Incorrect
reduction with op avx and dtype overflow"). ``MPI_Reduce_local`` uses the same op
functions as the collectives, so a few local reductions of vectors that overflow show it
without a message; `dtypes.reduce_plan` then reduces those dtypes in a wider integer type,
whose wrapping sum, cast back, is NumPy's.
"""

from __future__ import annotations

import threading

import numpy as np

from .mpi import MPI

__all__ = ["probe", "wrong_sums"]

# The dtypes probed: every integer type, though only the small ones have been seen wrong.
_INTEGERS = tuple(
    np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
)
_ELEMENTS = 256  # above every vector width's threshold (16 elements on AVX-512)

_lock = threading.Lock()
_found: frozenset[np.dtype] | None = None


def probe() -> frozenset[np.dtype]:
    """The integer dtypes whose MPI SUM is not the wrapping sum (probed once, then cached).

    MPI must be initialized. Costs a few local reductions of 256 elements.

    Returns:
        The dtypes whose sum MPI gets wrong (empty on a correct MPI).
    """
    global _found
    with _lock:
        if _found is None:
            _found = frozenset(dtype for dtype in _INTEGERS if not _sums_wrap(dtype))
        return _found


def wrong_sums() -> frozenset[np.dtype] | None:
    """What `probe` found, or None before it ran."""
    return _found


def _sums_wrap(dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    # Values whose sum overflows both ways (for signed types), beside ones that do not.
    high = np.full(_ELEMENTS, info.max // 2 + 3, dtype)
    low = np.full(_ELEMENTS, info.min // 2 - 3 if info.min else 1, dtype)
    ok = True
    for a in (high, low):
        inout = a.copy()
        MPI.SUM.Reduce_local(a, inout)
        with np.errstate(over="ignore"):
            ok = ok and np.array_equal(inout, a + a)
    return ok
