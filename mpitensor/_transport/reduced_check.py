"""The check of a large group, and a small all-reduce's data reduced inside it: one round trip.

In groups of more than `INLINE_RANKS` ranks every check is one ``MPI_Iallreduce`` of a fixed
record of `CHECK_WORDS` int64, whatever the collective (so two different collectives meet in one
check, never as mismatched MPI calls):

    [h, -h, v, -v, code, payload (8 words)]

reduced by mpitensor's own MPI op: the MIN of the first four words (the agreement hash and the
per-rank value, their least and greatest at once, as before), and, where every rank's `code`
is the same nonzero one, the payloads reduced with the reduction the code names (`carry_code`:
the dtype, MPI's op, the element count); any two codes that differ make it -1 and the payload
meaningless. A checked all-reduce whose work buffer fits the payload (`InCheck` on a large
group) puts its code and input there: once the check has agreed, every rank finds the reduced
input in its result, with no second collective (before, the check was an all-reduce of its
own and the data another, in series: twice MPI's messages and round trips). A member that
carries nothing (a GPU tensor, a result into ``out=``: code 0) makes every member's code -1,
and those that carried their input post MPI's in-place all-reduce instead, as in small groups.

The op's function is compiled where the package is (`native`'s ``check_op``, registered here
at bind with `use_compiled`); without it, a Python function of the same reduction runs.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._core.limits import CARRIED_MAX_BYTES
from .._core.mpi import MPI

__all__ = [
    "CHECK_WORDS", "Coded", "Reduced", "carry_code", "check_reduction", "check_record", "coded", "payload_of",
    "use_compiled",
]

HEADER_WORDS = 4  # h, -h, v, -v
CHECK_WORDS = HEADER_WORDS + 1 + CARRIED_MAX_BYTES // 8  # and the code, and the payload
# The reductions a payload is carried under, by their code in the compiled loops (rows.c).
_NUMPY = {1: np.add, 2: np.multiply, 3: np.maximum, 4: np.minimum, 5: np.bitwise_and, 6: np.bitwise_or,
          7: np.bitwise_xor}
# The dtypes of the payloads this process made codes for, by their NumPy type number.
_DTYPES: dict[int, np.dtype] = {}


def _op_code(mpi_op: Any) -> int | None:
    """The compiled loops' code of MPI's op `mpi_op` (mpi4py's ops compare, but do not hash), or None."""
    for code, known in enumerate((MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN, MPI.BAND, MPI.BOR, MPI.BXOR), 1):
        if mpi_op == known:
            return code
    return None


def carry_code(plan: Any, dtype: np.dtype, count: int) -> int | None:
    """The code of a payload of `count` elements of `dtype` reduced by `plan`, or None where none is carried.

    Carried: integers under every reduction, floats under SUM and PROD, complex numbers under
    SUM (MPI's own op of the plan, MEAN's SUM), with no keys to encode and nothing rounded
    back; the rest take MPI's data path after the check. Every rank computes the same code
    for the same call.
    """
    if plan.codec is not None or plan.rounds_back or dtype != plan.work_dtype:
        return None
    op_code = _op_code(plan.mpi_op)
    if op_code is None:
        return None
    kind = dtype.kind
    if kind in "iu" or (kind == "f" and op_code in (1, 2)) or (kind == "c" and op_code == 1):
        if dtype.itemsize * count > CARRIED_MAX_BYTES:
            return None
        _DTYPES[dtype.num] = dtype
        return 1 + (dtype.num << 16) + (op_code << 8) + count
    return None


class Coded(bytes):
    """A payload of a large group's check (`CARRIED_MAX_BYTES`), with its reduction's code (`carry_code`)."""

    code = 0


def coded(payload: bytes, code: int | None) -> Coded:
    """`payload` with `code` (None: 0, carried by no reduction)."""
    marked = Coded(payload)
    marked.code = code or 0
    return marked


class Reduced(bytes):
    """Every member's payload reduced, as a large group's check gives it (what the gathered rows are in a small one)."""


def check_record(value: int, per_rank: int, payload: bytes | None) -> np.ndarray:
    """The record a rank sends in a large group's check: the header, the payload's code (0: none) and payload."""
    record = np.zeros(CHECK_WORDS, np.int64)
    record[:HEADER_WORDS] = value, -value, per_rank, -per_rank
    if payload is not None:
        record[HEADER_WORDS] = getattr(payload, "code", 0)
        record[HEADER_WORDS + 1:] = np.frombuffer(payload, np.int64)
    return record


def payload_of(received: Any, sent: Any) -> Reduced | None:
    """The reduced payload in a large group's received check record, or None where the members' codes differed.

    Args:
        received: the record the check's all-reduce gave (an int64 array, or its bytes).
        sent: the record this rank sent (`check_record`, or the compiled lane's bytes).
    """
    words, mine = np.frombuffer(received, np.int64), np.frombuffer(sent, np.int64)
    code = int(mine[HEADER_WORDS])
    return Reduced(words[HEADER_WORDS + 1:].tobytes()) if code > 0 and int(words[HEADER_WORDS]) == code else None


class _Reduction:
    """The check's datatype and op, made once per process after MPI is initialized."""

    __slots__ = ("compiled", "datatype", "lock", "op", "python_op")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.datatype: Any = None
        self.op: Any = None
        self.compiled: Any = None
        self.python_op: Any = None


_reduction = _Reduction()


def use_compiled(op: Any) -> None:
    """Use `op` (an mpi4py Op of the compiled reduction) for the checks posted from now on."""
    _reduction.compiled = op


def check_reduction() -> tuple[Any, Any]:
    """The check's MPI datatype (one record of `CHECK_WORDS` int64) and its op (compiled, else Python's)."""
    if _reduction.datatype is None:
        with _reduction.lock:
            if _reduction.datatype is None:
                _reduction.python_op = MPI.Op.Create(_combine, commute=True)
                _reduction.datatype = MPI.INT64_T.Create_contiguous(CHECK_WORDS).Commit()
    op = _reduction.compiled
    return _reduction.datatype, op if op is not None else _reduction.python_op


def _combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    """The reduction of check records, in Python: ``inout = in (op) inout`` for every record of the buffers."""
    ins = np.frombuffer(inbuf, np.int64).reshape(-1, CHECK_WORDS)
    outs = np.frombuffer(inoutbuf, np.int64).reshape(-1, CHECK_WORDS)
    np.minimum(ins[:, :HEADER_WORDS], outs[:, :HEADER_WORDS], out=outs[:, :HEADER_WORDS])
    for a, b in zip(ins, outs):
        b[HEADER_WORDS] = _combined_code(a, b)


def _combined_code(a: np.ndarray, b: np.ndarray) -> int:
    """The code of records `a` and `b` combined, `b`'s payload reduced with `a`'s where they carry the same."""
    code = int(b[HEADER_WORDS])
    if int(a[HEADER_WORDS]) != code:
        return -1
    if code > 0 and not _reduce_payload(code, a[HEADER_WORDS + 1:], b[HEADER_WORDS + 1:]):
        return -1
    return code


def _reduce_payload(code: int, a: np.ndarray, b: np.ndarray) -> bool:
    """``b = a (op) b`` on the payloads of `code`; False for a code this rank never made (its own differs)."""
    value = code - 1
    dtype, op_code, count = _DTYPES.get(value >> 16), (value >> 8) & 0xFF, value & 0xFF
    if dtype is None or op_code not in _NUMPY:
        return False
    x = a.view(np.uint8)[: dtype.itemsize * count].view(dtype)
    y = b.view(np.uint8)[: dtype.itemsize * count].view(dtype)
    with np.errstate(all="ignore"):  # integers wrap, floats overflow to inf: as MPI's own
        _NUMPY[op_code](x, y, out=y)
    return True
