"""The cross-rank consistency check: what ranks must agree on, and the error when they don't.

Each collective describes itself as a `Record`: the operation, the reduce op, dtype,
shape, root, group and a per-rank value (e.g. the first dimension of an `all_gather`
input). Every check of a group is the same small exchange on the group's check
communicator, whatever the collective, which gives the minimum and maximum of the agreement
hash ``h`` and of the per-rank value ``v``: in groups of up to ``INLINE_RANKS`` an
all-gather of one fixed row ``[h, v, payload]`` per rank (the engine's; the payload may
carry a small all-reduce's input), in larger ones an all-reduce, MIN of ``[h, -h, v, -v]``.
Two different collectives therefore always meet as one check, and only when the hashes
differ do ranks exchange their full records (pickled `detail()`), to name what differs, the
ranks and their values.

Three hash values are reserved: `ABANDON` marks a rank that stands in for a check it will
never call (see the diagnosis), `FAILED_CALL` a rank whose own call failed before it could
take part (a bad argument), so that its peers learn of it instead of waiting, and
`CLOSING` a rank that closes the context (its per-rank value is ``-(rank + 1)``, so the
peers learn who left without a further exchange, which a departed rank could not answer).
"""

from __future__ import annotations

import cmath
import functools
import hashlib
import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core.config import ReduceOperation
from .._core.errors import CollectiveMismatchError

__all__ = [
    "Wait",
    "ABANDON",
    "ABANDONED_KIND",
    "CLOSE_KIND",
    "CLOSING",
    "FAILED_CALL",
    "KIND_NAMES",
    "AbandonRecord",
    "Members",
    "OptionsRecord",
    "Record",
    "SharedRecord",
    "Waiting",
    "cycle_text",
    "decode_waiting",
    "dtype_code",
    "dtype_from_code",
    "group_hash",
    "group_id",
    "departure_error",
    "mismatch_error",
    "shared_record",
]

# Hashes are masked to 62 bits so that -h never overflows int64; negative values are reserved.
_MASK = (1 << 62) - 1
ABANDON = -1
FAILED_CALL = -2
CLOSING = -3

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
    10: "close",
    11: "gather",
    12: "scatter",
    13: "scan",
    14: "exscan",
    20: "grouped all_gather",
    21: "grouped reduce_scatter",
    22: "grouped broadcast",
    15: "no collective (abandoned)",
    16: "broadcast_object",
    17: "all_gather_object",
    18: "gather_object",
}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}
ABANDONED_KIND = KIND_NAMES[15]
CLOSE_KIND = KIND_NAMES[10]

# Keyed by the member's id: hashing an Enum member runs Python code, on every checked call.
_OP_CODES = {id(op): i + 1 for i, op in enumerate(ReduceOperation)}

_DTYPE_LIST = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "longdouble", "complex64", "complex128", "bfloat16",
]


@dataclass(frozen=True)
class Wait:
    """One place a rank can be stuck: a group's check number `seq`, or its creation."""

    members: tuple[int, ...]
    seq: int
    creating: bool
    doing: str

    def as_note(self) -> dict[str, Any]:
        """The wait as a picklable dict."""
        return {"members": self.members, "seq": self.seq, "creating": self.creating, "kind": self.doing}

    @staticmethod
    def from_note(note: dict[str, Any]) -> Wait:
        """The wait a note describes."""
        return Wait(tuple(note["members"]), int(note["seq"]), bool(note["creating"]), str(note["kind"]))


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
    # The name too: every 1-byte type of ml_dtypes (the float8 family, int4...) has the str "<V1".
    return (zlib.crc32(f"{dtype.name}|{dtype.str}".encode()) & 0xFFFF) + 1000


def dtype_from_code(code: int) -> np.dtype:
    """The dtype `dtype_code` gave `code`.

    Raises:
        TypeError: the code names no dtype this process knows.
    """
    if 1 <= code <= len(_DTYPE_LIST):
        name = _DTYPE_LIST[code - 1]
        if name == "bfloat16":
            from .._core.halfprec import bfloat16_dtype

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


def group_id(ranks: Sequence[int]) -> int:
    """A group's number, the same on every rank and in every process: 62 bits of a digest of its members.

    Unlike `group_hash` (Python's hash of a tuple of ints, which a collision-seeking input
    could match), a cryptographic digest: two different groups of a run never share one.
    """
    digest = hashlib.blake2b(np.asarray(ranks, dtype="<i8").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


class Members(tuple):  # type: ignore[type-arg]
    """A group's member ranks (sorted context ranks): a tuple whose hash is computed once.

    Every checked call hashes its group's members (in `Record.agreement`, and in the key of
    `shared_record`); a tuple's hash visits every item each time, 30 us at 16,384 ranks,
    where this returns the hash it took when it was made. It equals the plain tuple's
    hash and compares equal to it, so either finds the other in a dict. Pickled, it is a
    plain tuple.
    """

    def __new__(cls, ranks: Iterable[int]) -> Members:
        """Make the members of `ranks` (already sorted, no repeats)."""
        self = super().__new__(cls, ranks)
        self._hash = tuple.__hash__(self)
        self._id: int | None = None
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type, tuple[tuple[int, ...]]]:
        return tuple, (tuple(self),)

    @property
    def id(self) -> int:
        """The group's `group_id` (computed on first use)."""
        if self._id is None:
            self._id = group_id(self)
        return self._id


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
        per_rank: a value ranks may differ in (the gathered length of `all_gather` and
            `gather`, the pickled size of an object collective).
        extra: one more value that must agree (the gathered axis, a structure hash, a hash
            of `scatter`'s axis and counts).

    Attributes:
        failure: for a call that failed on this rank before it could take part, the
            error as text (its check then says `FAILED_CALL`).
        entries: for fused calls, a function listing ``(key, shape, dtype)`` of every
            tensor, called only to explain a mismatch.
    """

    __slots__ = ("dtype", "entries", "extra", "failure", "group", "kind", "op", "per_rank", "root", "shape")

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
        self.failure: str | None = None
        self.entries: Callable[[], list[tuple[str, tuple[int, ...], str]]] | None = None

    def agreement(self) -> int:
        """The hash of what every rank must agree on (all but the per-rank value).

        Equal on every rank for equal calls: it hashes only ints and tuples of ints (the
        hashes of strings, and of None before Python 3.12, differ between processes).
        """
        value = (
            KIND_CODES[self.kind],
            0 if self.op is None else _OP_CODES[id(self.op)],
            dtype_code(self.dtype),
            (-1,) if self.shape is None else self.shape,
            self.root,
            self.group,
            self.extra,
        )
        return hash(value) & _MASK

    def check_value(self) -> int:
        """What this rank contributes to the check: the agreement hash or a reserved value."""
        if self.failure is not None:
            return FAILED_CALL
        return CLOSING if self.kind == CLOSE_KIND else self.agreement()

    def detail(self) -> dict[str, Any]:
        """Everything this record says, as a picklable dict (exchanged on a mismatch)."""
        return {
            "kind": self.kind,
            "op": None if self.op is None else self.op.name,
            "dtype": dtype_code(self.dtype),
            "shape": self.shape,
            "root": self.root,
            "group": tuple(self.group),
            "per_rank": self.per_rank,
            "extra": self.extra,
            "failure": self.failure,
            "entries": None if self.entries is None else self.entries(),
        }


class SharedRecord(Record):
    """A `Record` shared by every equal call (see `shared_record`), its check value computed once.

    Never given a `failure` or `entries`: a call that fails builds a record of its own.
    """

    __slots__ = ("value",)

    def __init__(self, kind: str, op: ReduceOperation | None, dtype: np.dtype | None,
                 shape: tuple[int, ...] | None, group: tuple[int, ...]) -> None:
        super().__init__(kind, op, dtype, shape, -1, group)
        self.value = self.agreement()

    def check_value(self) -> int:
        """The agreement hash, computed when the record was made."""
        return self.value


_SHARED: dict[tuple[Any, ...], SharedRecord] = {}
_SHARED_MAX = 4096  # distinct calls remembered; beyond, the cache starts over


def shared_record(kind: str, op: ReduceOperation | None, array: Any, group: tuple[int, ...]) -> SharedRecord:
    """The record of a call with no root, per-rank value or options, shared by equal calls.

    Small checked calls repeat the same (op, dtype, shape, group) many times: building the
    record and hashing it once saves that on each of them.

    Args:
        kind: the operation (a key of `KIND_CODES`).
        op: the reduce op, or None.
        array: the input (its dtype and shape must agree).
        group: the group's members.
    """
    dtype, shape = array.dtype, array.shape
    key = (kind, None if op is None else id(op), dtype, shape, group)
    record = _SHARED.get(key)
    if record is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        record = _SHARED[key] = SharedRecord(kind, op, dtype, shape, group)
    return record


class OptionsRecord(Record):
    """A `Record` with named options that must agree as well (counts, splits, scale factors).

    A subclass, so that calls without such options build the plain record as before.
    Ranks that pass an option and ranks that leave it at its default (where the call
    builds a plain `Record`) therefore disagree, as they should.

    Args:
        options: ``(name, value)`` pairs, in an order fixed per collective; values are
            ints, floats, complex numbers or tuples of them (their hashes are equal in
            every process, unlike those of strings).
        The other arguments are `Record`'s.
    """

    __slots__ = ("options",)

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
        *,
        options: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        super().__init__(kind, op, dtype, shape, root, group, per_rank, extra)
        self.options = options

    def agreement(self) -> int:
        """`Record.agreement`, with the options' values hashed in."""
        return hash((super().agreement(), tuple(_agreeing(value) for _, value in self.options))) & _MASK

    def detail(self) -> dict[str, Any]:
        """`Record.detail`, with the options."""
        out = super().detail()
        out["options"] = self.options
        return out


# What every NaN hashes as: a float NaN hashes by its object's identity (Python 3.10+),
# which differs between processes, and every NaN means the same factor.
_NAN_KEY = (-1, 0x7FF8)


def _agreeing(value: Any) -> Any:
    """An option's value as the check hashes it: NaNs (in any part, at any depth) as one key."""
    if isinstance(value, float):
        return _NAN_KEY if math.isnan(value) else value
    if isinstance(value, complex):
        return (_agreeing(value.real), _agreeing(value.imag)) if cmath.isnan(value) else value
    if isinstance(value, tuple):
        return tuple(_agreeing(item) for item in value)
    return value


def _options_text(options: tuple[tuple[str, Any], ...] | None) -> str:
    if not options:
        return "no options"
    return "options " + ", ".join(f"{name}={value!r}" for name, value in options)


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
        cycle: the wait cycle found, as (rank, where it waits) pairs, if any.
    """

    __slots__ = ("creating", "cycle", "doing", "waiting_on", "waiting_seq")

    def __init__(self, group: tuple[int, ...], waiting_on: tuple[int, ...], waiting_seq: int, creating: bool,
                 doing: str, cycle: Sequence[tuple[int, dict[str, Any]]] = ()) -> None:
        super().__init__(ABANDONED_KIND, None, None, None, -1, group)
        self.waiting_on = waiting_on
        self.waiting_seq = waiting_seq
        self.creating = creating
        self.doing = doing
        self.cycle = tuple(cycle)

    def check_value(self) -> int:
        """Always `ABANDON`: the check must fail on every member."""
        return ABANDON

    def detail(self) -> dict[str, Any]:
        """The record as a picklable dict, with where this rank waits instead."""
        out = super().detail()
        out["waiting"] = (tuple(self.waiting_on), self.waiting_seq, self.creating, self.doing)
        out["cycle"] = self.cycle
        return out


@dataclass(frozen=True)
class Waiting:
    """Where a rank that abandoned a check is stuck (from its record's detail)."""

    members: tuple[int, ...]
    seq: int
    creating: bool
    doing: str
    cycle: tuple[tuple[int, dict[str, Any]], ...] = field(default=(), hash=False, compare=False)


def decode_waiting(detail: dict[str, Any]) -> Waiting | None:
    """Where the rank of `detail` is stuck, if `detail` is an abandon record's."""
    waiting = detail.get("waiting")
    if waiting is None:
        return None
    members, seq, creating, doing = waiting
    return Waiting(tuple(members), int(seq), bool(creating), str(doing), tuple(detail.get("cycle", ())))


def cycle_text(cycle: Sequence[tuple[int, dict[str, Any]]]) -> str:
    """A wait cycle in words: who waits on which group, for whom.

    Args:
        cycle: (rank, where it waits) pairs; each waits for the next, the last for the first.
    """
    steps = [
        f"rank {rank} waits on group {list(where['members'])} for rank {cycle[(i + 1) % len(cycle)][0]}"
        for i, (rank, where) in enumerate(cycle)
    ]
    return "Wait cycle: " + ", ".join(steps)


def _shape_text(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "none"
    text = ", ".join("?" if d == -1 else str(d) for d in shape)
    return f"({text},)" if len(shape) == 1 else f"({text})"


# (field, what it is called, how one rank "sent" it)
_FIELDS: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    ("kind", "operations", lambda d: f"called {d['kind']}"),
    ("group", "groups", lambda d: f"used group {list(d['group'])}"),
    ("op", "reduce ops", lambda d: f"asked for {d['op'] or 'no op'}"),
    ("dtype", "tensor dtypes", lambda d: f"sent a tensor of dtype {_dtype_name(d['dtype'])}"),
    ("shape", "tensor shapes", lambda d: f"sent a tensor of shape {_shape_text(d['shape'])}"),
    ("root", "roots", lambda d: f"named root {d['root']}"),
    ("options", "options", lambda d: f"passed {_options_text(d.get('options'))}"),
    ("extra", "arguments", lambda d: f"passed argument {d['extra']}"),
]


def _groups_line(details: Sequence[dict[str, Any]], members: Sequence[int]) -> str:
    """Describe ranks that are in a collective on another group (their abandon records)."""
    away = [(m, d) for m, d in zip(members, details) if d["kind"] == ABANDONED_KIND]
    here = [(m, d) for m, d in zip(members, details) if d["kind"] != ABANDONED_KIND]
    m, detail = away[0]
    waiting = decode_waiting(detail)
    assert waiting is not None
    where, doing, group = list(waiting.members), waiting.doing, list(members)
    if here:
        kinds = sorted({d["kind"] for _, d in here})
        return (
            f"Mismatched groups: ranks {[h for h, _ in here]} called {' / '.join(kinds)} on group {group}, "
            f"but rank {m} is in {doing} on group {where} (and waits there for them); every member of a "
            "group must call its collectives in the same order"
        )
    return f"Mismatched groups: rank {m} is in {doing} on group {where} instead of a collective on group {group}"


def _failures_line(details: Sequence[dict[str, Any]], members: Sequence[int]) -> str:
    failed = [(m, d) for m, d in zip(members, details) if d["failure"] is not None]
    fine = [m for m, d in zip(members, details) if d["failure"] is None]
    said = "; ".join(f"rank {m}'s {d['kind']} failed on that rank: {d['failure']}" for m, d in failed)
    return (
        f"Collective failed on another rank: {said}. Nothing was sent; ranks {fine} called "
        f"{' / '.join(sorted({d['kind'] for m, d in zip(members, details) if d['failure'] is None}))} "
        "with it, and the next collective proceeds normally"
    )


def _entries_line(details: Sequence[dict[str, Any]], members: Sequence[int]) -> str | None:
    """For fused calls: the first tensor whose key, shape or dtype differs between ranks."""
    lists = [d["entries"] for d in details]
    if any(entries is None for entries in lists):
        return None
    first, first_rank = lists[0], members[0]
    for entries, rank in zip(lists[1:], members[1:]):
        if entries == first:
            continue
        if len(entries) != len(first):
            return (f"Mismatched {details[0]['kind']} structures: rank {first_rank} passed {len(first)} tensors, "
                    f"but rank {rank} passed {len(entries)}")
        for index, (mine, theirs) in enumerate(zip(first, entries)):
            if mine != theirs:
                return (
                    f"Mismatched {details[0]['kind']} entries at index {index}: rank {first_rank} passed "
                    f"{_entry_text(mine)}, but rank {rank} passed {_entry_text(theirs)}"
                )
    return None


def _entry_text(entry: tuple[str, tuple[int, ...], str]) -> str:
    key, shape, dtype = entry
    return f"{key}: shape {_shape_text(tuple(shape))} {dtype}"


def departure_error(departed: int, members: Sequence[int], doing: str) -> CollectiveMismatchError:
    """The error of a rank whose collective met a peer's close instead.

    Args:
        departed: a rank that closed (the highest, if several did).
        members: the group's members.
        doing: what this rank called.
    """
    return CollectiveMismatchError(
        f"Rank {departed} closed the context (or left the program) while this rank called {doing} on group "
        f"{list(members)}: the departed rank takes part in no more collectives, so this context can run no "
        "more collectives either; close it"
    )


def mismatch_error(
    details: Sequence[dict[str, Any]],
    members: Sequence[int],
    notes: Sequence[str] = (),
) -> CollectiveMismatchError:
    """Build the error that names what differs between ranks' records.

    Args:
        details: one `Record.detail()` per group member, in group order.
        members: the members' context ranks, in group order.
        notes: extra lines (e.g. what an abandoning rank was doing instead).
    """
    details = list(details)
    if any(d["kind"] == ABANDONED_KIND for d in details):
        cycles = [d["cycle"] for d in details if d.get("cycle")]
        lines = [_groups_line(details, members), *([cycle_text(cycles[0])] if cycles else [])]
        return CollectiveMismatchError("\n".join([*lines, *notes]))
    if any(d["failure"] is not None for d in details):
        return CollectiveMismatchError("\n".join([_failures_line(details, members), *notes]))
    first_name = details[0]["kind"]
    lines: list[str] = []
    entries = _entries_line(details, members)
    for name, plural, describe in _FIELDS:
        if entries is not None and name in ("dtype", "shape", "extra"):
            continue  # a fused call's totals and hash: the entries line says what differs instead
        values: dict[Any, list[int]] = {}
        for member, detail in zip(members, details):
            values.setdefault(detail.get(name), []).append(member)
        if len(values) <= 1:
            continue
        groups = list(values.values())
        first_of = {r[0]: details[list(members).index(r[0])] for r in groups}
        ranks_a, ranks_b = groups[0], groups[1]
        summary = "; ".join(f"{describe(first_of[r[0]])}: ranks {r}" for r in groups)
        lines.append(
            f"Mismatched {first_name} {plural}: one rank (rank {ranks_a[0]}) {describe(first_of[ranks_a[0]])}, "
            f"but rank {ranks_b[0]} {describe(first_of[ranks_b[0]])} [{summary}]"
        )
    if entries is not None:
        lines.append(entries)
    if not lines:
        lines.append(f"Mismatched {first_name} arguments across ranks {list(members)}")
    lines.extend(notes)
    return CollectiveMismatchError("\n".join(lines))
