"""The consistency check's records and the messages that name mismatches (pure logic)."""

from __future__ import annotations

import numpy as np

import mpitensor as mt
from mpitensor._check import PER_RANK_SLOT, Record, agreement_hash, dtype_code, dtype_from_code, mismatch_error


def _record(**changes):
    fields = {"kind": "all_reduce", "op": mt.ReduceOperation.SUM, "dtype": np.dtype(np.float32),
              "shape": (3, 4), "root": -1, "group": (0, 1, 2)}
    fields.update(changes)
    return Record(**fields).encode()


def test_equal_calls_agree_and_the_per_rank_value_is_ignored():
    assert agreement_hash(_record()) == agreement_hash(_record())
    a, b = _record(), _record()
    b[PER_RANK_SLOT] = 99
    assert agreement_hash(a) == agreement_hash(b)
    for change in ({"shape": (3, 5)}, {"dtype": np.dtype(np.float64)}, {"op": mt.ReduceOperation.MAX},
                   {"root": 1}, {"kind": "broadcast"}, {"group": (0, 1)}):
        assert agreement_hash(_record(**change)) != agreement_hash(a), change


def test_dtype_codes_round_trip_and_ignore_byte_order():
    for name in ("bool", "int8", "uint64", "float16", "float32", "complex128", "longdouble"):
        dtype = np.dtype(name)
        assert dtype_from_code(dtype_code(dtype)) == dtype
    assert dtype_code(np.dtype(">f8")) == dtype_code(np.dtype("<f8"))


def test_shape_mismatch_message_names_ranks_and_values():
    rows = np.stack([_record(), _record(), _record(shape=(3, 5))])
    message = str(mismatch_error(rows, [0, 1, 2]))
    assert message.startswith(
        "Mismatched all_reduce tensor shapes: one rank (rank 0) sent a tensor of shape (3, 4), "
        "but rank 2 sent a tensor of shape (3, 5)"
    )
    assert "ranks [0, 1]" in message and "ranks [2]" in message


def test_several_differences_are_all_named():
    rows = np.stack([_record(), _record(dtype=np.dtype(np.int64), op=mt.ReduceOperation.MAX)])
    message = str(mismatch_error(rows, [0, 3]))
    assert "Mismatched all_reduce reduce ops: one rank (rank 0) asked for SUM, but rank 3 asked for MAX" in message
    assert "sent a tensor of dtype float32, but rank 3 sent a tensor of dtype int64" in message


def test_different_operations_are_named():
    rows = np.stack([_record(), _record(kind="broadcast", op=None, root=0)])
    message = str(mismatch_error(rows, [0, 1]))
    assert "one rank (rank 0) called all_reduce, but rank 1 called broadcast" in message
