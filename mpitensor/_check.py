"""The cross-rank consistency check: what ranks must agree on, and the error when they don't.

Each collective describes itself as a fixed-size `Record` of integers: the operation, the
reduce op, dtype, shape, root, group and a per-rank value (e.g. the first dimension of an
`all_gather` input). Ranks compare the hash of the fields that must agree with one small
all-reduce (MIN of ``[h, -h]`` gives the minimum and maximum at once); only when they
differ do they gather the full records, to name what differs, the ranks and their values.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._config import ReduceOperation
from ._errors import CollectiveMismatchError

__all__ = [
    "ABANDON",
    "ABANDONED_KIND",
    "AbandonRecord",
    "Waiting",
    "decode_waiting",
    "MAX_DIMS",
    "dtype_from_code",
    "PER_RANK_SLOT",
    "KIND_NAMES",
    "RECORD_LEN",
    "Record",
    "agreement_hash",
    "dtype_code",
    "group_hash",
    "mismatch_error",
]

MAX_DIMS = 8
# kind, op, dtype, ndim, dims[8], root, group hash, group size, per-rank value, extra
RECORD_LEN = 4 + MAX_DIMS + 5
_KIND, _OP, _DTYPE, _NDIM, _DIMS = 0, 1, 2, 3, 4
_ROOT = _DIMS + MAX_DIMS
_GROUP, _GSIZE, _PER_RANK, _EXTRA = _ROOT + 1, _ROOT + 2, _ROOT + 3, _ROOT + 4
PER_RANK_SLOT = _PER_RANK

# Hashes are masked to 62 bits so that -h never overflows int64; -1 marks a rank that
# abandons a check it cannot take part in (see the deadlock diagnosis).
_MASK = (1 << 62) - 1
ABANDON = -1

KIND_NAMES = {
    1: "all_reduce",
    2: "broadcast",
    3: "reduce",
    4: "all_gather",
    5: "reduce_scatter",
    6: "all_to_all",
    7: "barrier",
    8: "fused all_reduce",
    9: "gradient sync",
    15: "no collective (abandoned)",
}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}
ABANDONED_KIND = KIND_NAMES[15]

_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOperation)}
_OP_NAMES = {code: op.name for op, code in _OP_CODES.items()}

_DTYPE_LIST = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "longdouble", "complex64", "complex128", "bfloat16",
]


@functools.cache
def dtype_code(dtype: np.dtype | None) -> int:
    """A small integer naming `dtype`, equal on every rank (0 for None)."""
    if dtype is None:
        return 0
    if not dtype.isnative:
        dtype = dtype.newbyteorder("=")
    name = "longdouble" if dtype == np.longdouble and dtype != np.float64 else str(dtype)
    if name in _DTYPE_LIST:
        return _DTYPE_LIST.index(name) + 1
    return (zlib.crc32(dtype.str.encode()) & 0xFFFF) + 1000


def dtype_from_code(code: int) -> np.dtype:
    """The dtype `dtype_code` gave `code`.

    Raises:
        TypeError: the code names no dtype this process knows.
    """
    if 1 <= code <= len(_DTYPE_LIST):
        name = _DTYPE_LIST[code - 1]
        if name == "bfloat16":
            from ._halfprec import bfloat16_dtype

            found = bfloat16_dtype()
            if found is None:
                raise TypeError("a peer sent bfloat16 data, but ml_dtypes is not installed here")
            return found
        return np.dtype(np.longdouble if name == "longdouble" else name)
    raise TypeError(f"a peer sent a dtype this rank does not know (code {code})")


def _dtype_name(code: int) -> str:
    if 1 <= code <= len(_DTYPE_LIST):
        return _DTYPE_LIST[code - 1]
    return "none" if code == 0 else f"dtype#{code}"


def group_hash(ranks: Sequence[int]) -> int:
    """A hash of a group's member list, equal on every rank."""
    return hash(tuple(ranks)) & _MASK


class Record:
    """What one rank says about the collective it is calling.

    A plain class rather than a dataclass: one is built for every checked call, and a
    frozen dataclass costs several times more to build.

    Args:
        kind: the operation's name (a key of `KIND_CODES`).
        op: the reduce op, or None.
        dtype: the element type, or None.
        shape: the shape that must agree (for `all_gather`, with the gathered axis
            set to -1), or None.
        root: the root's rank in the group, or -1.
        group: the group's members (context ranks).
        per_rank: a value ranks may differ in (the gathered length of `all_gather`).
        extra: one more value that must agree (the gathered axis, a structure hash).
    """

    __slots__ = ("dtype", "extra", "group", "kind", "op", "per_rank", "root", "shape")

    def __init__(
        self,
        kind: str,
        op: ReduceOperation | None,
        dtype: np.dtype | None,
        shape: tuple[int, ...] | None,
        root: int,
        group: tuple[int, ...],
        per_rank: int = 0,
        extra: int = 0,
    ) -> None:
        self.kind = kind
        self.op = op
        self.dtype = dtype
        self.shape = shape
        self.root = root
        self.group = group
        self.per_rank = per_rank
        self.extra = extra

    def agreement(self) -> int:
        """The hash of what every rank must agree on (all but the per-rank value).

        Equal on every rank for equal calls: it hashes only ints and tuples of ints (the
        hashes of strings, and of None before Python 3.12, differ between processes).
        """
        value = (
            KIND_CODES[self.kind],
            0 if self.op is None else _OP_CODES[self.op],
            dtype_code(self.dtype),
            (-1,) if self.shape is None else self.shape,
            self.root,
            self.group,
            self.extra,
        )
        return hash(value) & _MASK

    def encode(self) -> np.ndarray:
        """The record as ``RECORD_LEN`` int64 values."""
        out = np.zeros(RECORD_LEN, np.int64)
        out[_KIND] = KIND_CODES[self.kind]
        out[_OP] = 0 if self.op is None else _OP_CODES[self.op]
        out[_DTYPE] = dtype_code(self.dtype)
        if self.shape is None:
            out[_NDIM] = -1
        else:
            out[_NDIM] = len(self.shape)
            dims = list(self.shape[:MAX_DIMS])
            if len(self.shape) > MAX_DIMS:
                dims[-1] = hash(self.shape[MAX_DIMS - 1 :]) & _MASK
            out[_DIMS : _DIMS + len(dims)] = dims
        out[_ROOT] = self.root
        out[_GROUP] = group_hash(self.group)
        out[_GSIZE] = len(self.group)
        out[_PER_RANK] = self.per_rank
        out[_EXTRA] = self.extra
        return out


class AbandonRecord(Record):
    """The record of a check this rank posts only to unblock peers (see the diagnosis).

    It says where this rank is stuck instead: the group it waits on, that wait's place in
    the group's sequence, whether it is the group's creation, and the operation.

    Args:
        group: the group of the check it stands in for.
        waiting_on: the group this rank waits on instead.
        waiting_seq: the place of that wait in that group's sequence of checks.
        creating: True if the wait is that group's creation.
        doing: the operation this rank waits in.
    """

    __slots__ = ("creating", "doing", "waiting_on", "waiting_seq")

    def __init__(self, group: tuple[int, ...], waiting_on: tuple[int, ...], waiting_seq: int, creating: bool,
                 doing: str) -> None:
        super().__init__(ABANDONED_KIND, None, None, None, -1, group)
        self.waiting_on = waiting_on
        self.waiting_seq = waiting_seq
        self.creating = creating
        self.doing = doing

    def encode(self) -> np.ndarray:
        """The record as ``RECORD_LEN`` int64 values."""
        out = np.zeros(RECORD_LEN, np.int64)
        out[_KIND] = KIND_CODES[ABANDONED_KIND]
        out[_OP] = int(self.creating)
        out[_NDIM] = len(self.waiting_on)
        shown = self.waiting_on[:MAX_DIMS]
        out[_DIMS : _DIMS + len(shown)] = shown
        out[_ROOT] = self.waiting_seq
        out[_GROUP] = group_hash(self.group)
        out[_GSIZE] = len(self.group)
        out[_PER_RANK] = KIND_CODES.get(self.doing, 0)
        out[_EXTRA] = group_hash(self.waiting_on)
        return out


@dataclass(frozen=True)
class Waiting:
    """Where a rank that abandoned a check is stuck (decoded from its record)."""

    shown: tuple[int, ...]  # the group's first members (all of them up to MAX_DIMS)
    count: int
    hash: int
    seq: int
    creating: bool
    doing: str

    @property
    def complete(self) -> bool:
        """True when `shown` lists every member."""
        return len(self.shown) == self.count


def decode_waiting(row: np.ndarray) -> Waiting | None:
    """Where the rank of `row` is stuck, if `row` is an abandon record."""
    if int(row[_KIND]) != KIND_CODES[ABANDONED_KIND]:
        return None
    count = int(row[_NDIM])
    shown = tuple(int(v) for v in row[_DIMS : _DIMS + min(count, MAX_DIMS)])
    return Waiting(shown, count, int(row[_EXTRA]), int(row[_ROOT]), bool(row[_OP]),
                   KIND_NAMES.get(int(row[_PER_RANK]), "a collective"))


def agreement_hash(encoded: np.ndarray) -> int:
    """The hash of the fields every rank must agree on (all but the per-rank value)."""
    return hash(tuple(int(v) for i, v in enumerate(encoded) if i != _PER_RANK)) & _MASK


def _shape_text(row: np.ndarray) -> str:
    ndim = int(row[_NDIM])
    if ndim < 0:
        return "none"
    dims = [int(d) for d in row[_DIMS : _DIMS + min(ndim, MAX_DIMS)]]
    if ndim > MAX_DIMS:
        dims[-1:] = ["..."]  # type: ignore[list-item]
    text = ", ".join("?" if d == -1 else str(d) for d in dims)
    return f"({text},)" if ndim == 1 else f"({text})"


# (field, what it is called, how one rank "sent" it)
_FIELDS = [
    ("kind", "operations", lambda r: f"called {KIND_NAMES.get(int(r[_KIND]), '?')}"),
    ("group", "groups", lambda r: f"used a group of {int(r[_GSIZE])} ranks (hash {int(r[_GROUP]):x})"),
    ("op", "reduce ops", lambda r: f"asked for {_OP_NAMES.get(int(r[_OP]), 'no op')}"),
    ("dtype", "tensor dtypes", lambda r: f"sent a tensor of dtype {_dtype_name(int(r[_DTYPE]))}"),
    ("shape", "tensor shapes", lambda r: f"sent a tensor of shape {_shape_text(r)}"),
    ("root", "roots", lambda r: f"named root {int(r[_ROOT])}"),
    ("extra", "arguments", lambda r: f"passed argument {int(r[_EXTRA])}"),
]
_FIELD_SLICES = {
    "kind": slice(_KIND, _KIND + 1),
    "group": slice(_GROUP, _GSIZE + 1),
    "op": slice(_OP, _OP + 1),
    "dtype": slice(_DTYPE, _DTYPE + 1),
    "shape": slice(_NDIM, _DIMS + MAX_DIMS),
    "root": slice(_ROOT, _ROOT + 1),
    "extra": slice(_EXTRA, _EXTRA + 1),
}


def _groups_line(rows: Sequence[np.ndarray], members: Sequence[int]) -> str:
    """Describe ranks that are in a collective on another group (their abandon records)."""
    code = KIND_CODES[ABANDONED_KIND]
    away = [(m, row) for m, row in zip(members, rows) if int(row[_KIND]) == code]
    here = [(m, row) for m, row in zip(members, rows) if int(row[_KIND]) != code]
    m, row = away[0]
    waiting = decode_waiting(row)
    assert waiting is not None
    where = str(list(waiting.shown))
    if not waiting.complete:
        where = f"{where[:-1]}, ...] ({waiting.count} ranks)"
    doing = waiting.doing
    group = list(members)
    if here:
        kinds = sorted({KIND_NAMES.get(int(r[_KIND]), "a collective") for _, r in here})
        return (
            f"Mismatched groups: ranks {[h for h, _ in here]} called {' / '.join(kinds)} on group {group}, "
            f"but rank {m} is in {doing} on group {where} (and waits there for them); every member of a "
            "group must call its collectives in the same order"
        )
    return f"Mismatched groups: rank {m} is in {doing} on group {where} instead of a collective on group {group}"


def mismatch_error(
    records: np.ndarray,
    members: Sequence[int],
    notes: Sequence[str] = (),
) -> CollectiveMismatchError:
    """Build the error that names what differs between ranks' records.

    Args:
        records: one encoded record per group member, in group order.
        members: the members' context ranks, in group order.
        notes: extra lines (e.g. what an abandoning rank was doing instead).
    """
    rows = [np.asarray(r) for r in records]
    abandoned = [m for m, row in zip(members, rows) if int(row[_KIND]) == KIND_CODES[ABANDONED_KIND]]
    if abandoned:
        return CollectiveMismatchError("\n".join([_groups_line(rows, members), *notes]))
    first_name = KIND_NAMES.get(int(rows[0][_KIND]), "collective")
    lines: list[str] = []
    for field, plural, describe in _FIELDS:
        key = _FIELD_SLICES[field]
        values: dict[tuple[int, ...], list[int]] = {}
        for member, row in zip(members, rows):
            if int(row[_KIND]) == KIND_CODES["no collective (abandoned)"] and field != "kind":
                continue
            values.setdefault(tuple(int(v) for v in row[key]), []).append(member)
        if len(values) <= 1:
            continue
        groups = list(values.items())
        (value_a, ranks_a), (value_b, ranks_b) = groups[0], groups[1]
        row_a = rows[list(members).index(ranks_a[0])]
        row_b = rows[list(members).index(ranks_b[0])]
        detail = "; ".join(f"{describe(rows[list(members).index(r[0])])}: ranks {r}" for _, r in groups)
        lines.append(
            f"Mismatched {first_name} {plural}: one rank (rank {ranks_a[0]}) {describe(row_a)}, "
            f"but rank {ranks_b[0]} {describe(row_b)} [{detail}]"
        )
        del value_a, value_b
    if not lines:
        lines.append(f"Mismatched {first_name} arguments across ranks {list(members)}")
    lines.extend(notes)
    return CollectiveMismatchError("\n".join(lines))
