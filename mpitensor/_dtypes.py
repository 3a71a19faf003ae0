"""Lookup tables from NumPy dtypes and `ReduceOperation` to MPI datatypes and ops.

A reduction is planned once per (op, dtype) pair and cached: which MPI op, which MPI
datatype, whether the input is first converted (``MEAN`` of integers reduces in float64)
and whether the result is divided by the group size afterwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._config import ReduceOperation
from ._mpi import MPI, on_finalize

__all__ = ["ReducePlan", "mpi_datatype", "reduce_plan", "supported_dtype_names", "transfer_dtype"]

_NATIVE: dict[np.dtype, Any] = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.longdouble): MPI.LONG_DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
# float16 has no name in MPI 3; implementations that know it expose it under several names.
for _name in ("FLOAT16_T", "C_FLOAT16", "SHORT_FLOAT", "REAL2"):
    _dt = getattr(MPI, _name, MPI.DATATYPE_NULL)
    if _dt != MPI.DATATYPE_NULL:
        _NATIVE[np.dtype(np.float16)] = _dt
        break

_ARITHMETIC = {
    ReduceOperation.SUM: MPI.SUM,
    ReduceOperation.MEAN: MPI.SUM,
    ReduceOperation.PROD: MPI.PROD,
    ReduceOperation.MAX: MPI.MAX,
    ReduceOperation.MIN: MPI.MIN,
}
# NumPy's rules for bool: + is or, * is and, max is or, min is and.
_LOGICAL = {
    ReduceOperation.SUM: MPI.LOR,
    ReduceOperation.PROD: MPI.LAND,
    ReduceOperation.MAX: MPI.LOR,
    ReduceOperation.MIN: MPI.LAND,
}


@dataclass(frozen=True)
class ReducePlan:
    """How to run one (op, dtype) reduction through MPI.

    Attributes:
        mpi_op: the MPI op.
        datatype: the MPI datatype of one element of the buffer sent.
        work_dtype: the dtype of the buffers MPI reduces (the input is converted to it
            when it differs from the input's dtype).
        divide: divide the result by the group size afterwards (``MEAN``).
        result_dtype: the dtype of the result (the work dtype, except for half precision,
            which is reduced in float32 and rounded back once at the end).
    """

    mpi_op: Any
    datatype: Any
    work_dtype: np.dtype
    divide: bool
    result_dtype: np.dtype | None = None
    # Derived once (plans are looked up on every call): the result tensor's dtype, and
    # whether the reduced work buffer is rounded back into it.
    out_dtype: np.dtype = field(init=False)
    rounds_back: bool = field(init=False)

    def __post_init__(self) -> None:
        out = self.work_dtype if self.result_dtype is None else self.result_dtype
        object.__setattr__(self, "out_dtype", out)
        object.__setattr__(self, "rounds_back", out != self.work_dtype)


def supported_dtype_names() -> str:
    """The dtypes collectives accept, as a comma-separated list for error messages."""
    return ", ".join(sorted(str(dt) for dt in _NATIVE))


def _native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def transfer_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a buffer of `dtype` travels as (native byte order).

    Raises:
        TypeError: MPI cannot carry `dtype` (object, string, structured, ...).
    """
    native = _native(np.dtype(dtype))
    if native in _NATIVE:
        return native
    from ._halfprec import is_bfloat16

    if is_bfloat16(native):
        return native
    raise TypeError(
        f"dtype {dtype} cannot be communicated: expected one of {supported_dtype_names()} "
        "or bfloat16 (from ml_dtypes)"
    )


def mpi_datatype(dtype: np.dtype) -> Any:
    """The MPI datatype of one element of `dtype` (bytes for types MPI does not know).

    Raises:
        TypeError: `dtype` cannot be communicated.
    """
    native = transfer_dtype(dtype)
    found = _NATIVE.get(native)
    if found is not None:
        return found
    return _byte_type(native.itemsize)


@functools.cache
def _byte_type(itemsize: int) -> Any:
    if itemsize == 2:
        return MPI.UINT16_T
    datatype = MPI.BYTE.Create_contiguous(itemsize).Commit()
    on_finalize(datatype.Free)
    return datatype


_PLANS: dict[tuple[int, np.dtype], ReducePlan] = {}


def reduce_plan(op: ReduceOperation, dtype: np.dtype) -> ReducePlan:
    """Plan the reduction of `dtype` tensors with `op` (cached).

    Raises:
        TypeError: `dtype` cannot be reduced.
    """
    # Keyed by the member's id: hashing an Enum member runs Python code, and this lookup
    # is on the path of every reducing collective.
    key = (id(op), dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(op, dtype)
    return plan


def _plan(op: ReduceOperation, dtype: np.dtype) -> ReducePlan:
    dtype = transfer_dtype(dtype)
    divide = op is ReduceOperation.MEAN
    if dtype.kind in "biu":
        if divide:
            return ReducePlan(MPI.SUM, MPI.DOUBLE, np.dtype(np.float64), True)
        table = _LOGICAL if dtype.kind == "b" else _ARITHMETIC
        return ReducePlan(table[op], _NATIVE[dtype], dtype, False)
    if dtype.kind == "c" and op in (ReduceOperation.MAX, ReduceOperation.MIN):
        return ReducePlan(_numpy_op(op, dtype), _NATIVE[dtype], dtype, False)
    if dtype.itemsize == 2 and dtype.kind in "fV":
        # float16 and bfloat16: reduced in float32, rounded back once (see _halfprec).
        return ReducePlan(_ARITHMETIC[op], MPI.FLOAT, np.dtype(np.float32), divide, dtype)
    return ReducePlan(_ARITHMETIC[op], _NATIVE[dtype], dtype, divide)


_UFUNCS = {
    ReduceOperation.SUM: np.add,
    ReduceOperation.MEAN: np.add,
    ReduceOperation.PROD: np.multiply,
    ReduceOperation.MAX: np.maximum,
    ReduceOperation.MIN: np.minimum,
}


@functools.cache
def _numpy_op(op: ReduceOperation, dtype: np.dtype) -> Any:
    """A user-defined MPI op applying NumPy's ufunc for `op` to `dtype` buffers.

    Used where MPI defines no op (MAX and MIN of complex numbers, which NumPy orders
    lexicographically) and for dtypes MPI does not know. MPI calls it with the GIL taken.
    """
    ufunc = _UFUNCS[op]

    def apply(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(a, b, out=b)

    mpi_op = MPI.Op.Create(apply, commute=True)
    on_finalize(mpi_op.Free)
    return mpi_op


numpy_op = _numpy_op
