"""bfloat16 support (through the optional `ml_dtypes` package).

MPI has no bfloat16 datatype, so bfloat16 buffers travel as 16-bit words and are reduced
by a user-defined MPI op that applies NumPy's (ml_dtypes') ufuncs, which compute each
pairwise step in float32 and round back to bfloat16.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ._config import ReduceOperation

__all__ = ["bfloat16_dtype", "bfloat16_plan", "is_bfloat16"]


@functools.lru_cache(maxsize=1)
def bfloat16_dtype() -> np.dtype | None:
    """The bfloat16 dtype from ml_dtypes, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: np.dtype) -> bool:
    """True if `dtype` is ml_dtypes' bfloat16."""
    if dtype.kind != "V" or dtype.itemsize != 2:
        return False
    bf16 = bfloat16_dtype()
    return bf16 is not None and dtype == bf16


def bfloat16_plan(op: ReduceOperation, dtype: np.dtype) -> Any:
    """Plan a bfloat16 reduction: 16-bit words reduced by a NumPy user-defined op."""
    from ._dtypes import ReducePlan, _byte_type, numpy_op

    return ReducePlan(numpy_op(op, dtype), _byte_type(2), dtype, op is ReduceOperation.MEAN)
