"""The consistency check's records and the messages that name mismatches (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._runtime.check import FAILED_CALL, AbandonRecord, Record, dtype_code, dtype_from_code, mismatch_error


def _record(per_rank=0, **changes):
    fields = {"kind": "all_reduce", "op": mt.ReduceOperation.SUM, "dtype": np.dtype(np.float32),
              "shape": (3, 4), "root": -1, "group": (0, 1, 2)}
    fields.update(changes)
    return Record(**fields, per_rank=per_rank)


def test_equal_calls_agree_and_the_per_rank_value_is_ignored():
    a = _record()
    assert a.agreement() == _record().agreement()
    assert a.agreement() == _record(per_rank=99).agreement()
    for change in ({"shape": (3, 5)}, {"dtype": np.dtype(np.float64)}, {"op": mt.ReduceOperation.MAX},
                   {"root": 1}, {"kind": "broadcast"}, {"group": (0, 1)}):
        assert _record(**change).agreement() != a.agreement(), change


def test_a_failed_call_and_an_abandon_never_agree_with_a_real_call():
    failed = _record()
    failed.failure = "TypeError: bad input"
    assert failed.check_value() == FAILED_CALL
    abandon = AbandonRecord((0, 1, 2), (0, 1), 0, False, "all_reduce")
    values = {_record().check_value(), failed.check_value(), abandon.check_value()}
    assert len(values) == 3 and min(values) < 0 <= _record().check_value()


def test_dtype_codes_round_trip_and_ignore_byte_order():
    for name in ("bool", "int8", "uint64", "float16", "float32", "complex128", "longdouble"):
        dtype = np.dtype(name)
        assert dtype_from_code(dtype_code(dtype)) == dtype
    assert dtype_code(np.dtype(">f8")) == dtype_code(np.dtype("<f8"))


def test_shape_mismatch_message_names_ranks_and_values():
    details = [_record().detail(), _record().detail(), _record(shape=(3, 5)).detail()]
    message = str(mismatch_error(details, [0, 1, 2]))
    assert message.startswith(
        "Mismatched all_reduce tensor shapes: one rank (rank 0) sent a tensor of shape (3, 4), "
        "but rank 2 sent a tensor of shape (3, 5)"
    )
    assert "ranks [0, 1]" in message and "ranks [2]" in message


def test_several_differences_are_all_named():
    details = [_record().detail(), _record(dtype=np.dtype(np.int64), op=mt.ReduceOperation.MAX).detail()]
    message = str(mismatch_error(details, [0, 3]))
    assert "Mismatched all_reduce reduce ops: one rank (rank 0) asked for SUM, but rank 3 asked for MAX" in message
    assert "sent a tensor of dtype float32, but rank 3 sent a tensor of dtype int64" in message


def test_different_operations_are_named():
    details = [_record().detail(), _record(kind="broadcast", op=None, root=0).detail()]
    message = str(mismatch_error(details, [0, 1]))
    assert "one rank (rank 0) called all_reduce, but rank 1 called broadcast" in message


def test_a_failure_on_one_rank_is_named_with_its_error():
    failed = _record()
    failed.failure = "TypeError: all_reduce expects input to be an array, got NoneType"
    message = str(mismatch_error([_record().detail(), failed.detail(), _record().detail()], [0, 1, 2]))
    assert "rank 1's all_reduce failed on that rank: TypeError: all_reduce expects input" in message
    assert "ranks [0, 2] called all_reduce" in message


def test_fused_mismatch_names_the_entry_with_both_shapes_and_dtypes():
    def fused(entries):
        record = _record(kind="fused all_reduce", dtype=None, shape=(len(entries), 8), extra=len(entries))
        record.entries = lambda: entries
        return record.detail()

    a = fused([("'w'", (2, 2), "float32"), ("'b'", (4,), "float32")])
    b = fused([("'w'", (2, 2), "float32"), ("'b'", (4,), "float64")])
    message = str(mismatch_error([a, b], [0, 1]))
    assert "entries at index 1: rank 0 passed 'b': shape (4,) float32, but rank 1 passed 'b': shape (4,) float64" in (
        message
    )
    assert "argument" not in message


def test_every_one_byte_type_of_ml_dtypes_has_its_own_code():
    """The float8 family, int4 and their kin all have NumPy's str "<V1": the code tells them apart by name."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    names = [name for name in ("float8_e4m3fn", "float8_e4m3", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                               "float8_e3m4", "float8_e8m0fnu", "int4", "uint4", "int2", "uint2")
             if hasattr(ml_dtypes, name)]
    codes = {name: dtype_code(np.dtype(getattr(ml_dtypes, name))) for name in names}
    assert len(set(codes.values())) == len(codes), codes
