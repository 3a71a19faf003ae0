"""What a traced context records, and the dump of it that the timeline is made of.

A `Tracer` keeps the context's ring of collectives (`ring`), the program's own regions
(`region`), and the names behind the ring's small codes (kinds, groups). `dump` turns all
of it into the plain dict that `chrome` and `stragglers` read, one per rank.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..check import dtype_code, dtype_from_code, group_hash
from .ring import (
    CHECK_TRANSPORT,
    LOCAL_TRANSPORT,
    MPI_TRANSPORT,
    SHM_TRANSPORT,
    TRANSPORTS,
    events_of,
    make_ring,
    now,
)

__all__ = ["Tracer", "mark_posted"]

_COLUMNS = ("id", "group", "seq", "nbytes", "called", "agreed", "posted", "complete", "resolved")


class Tracer:
    """The record of one context's collectives and regions on this rank.

    Args:
        events: how many collectives to keep (the last ones); 0 keeps the whole run.
        members: the context's world ranks, in context rank order (groups are recorded
            by their world ranks).
    """

    def __init__(self, events: int, members: tuple[int, ...]) -> None:
        self.ring = make_ring(events or 4096, keep_all=events == 0)
        self._members = members
        self._kinds: dict[str, int] = {}
        self._names: list[str] = []
        self._groups: dict[Any, int] = {}  # Group -> its key in the ring
        self._codes: dict[tuple[Any, ...], tuple[int, int, int]] = {}  # (kind, Group, dtype) -> ring codes
        self._group_members: dict[int, list[int]] = {}
        self._regions: deque[list[Any]] = deque(maxlen=events or None)
        self._depth = threading.local()

    # -- collectives -----------------------------------------------------------------------

    def kind_code(self, name: str) -> int:
        """The ring's code for the collective kind `name` (given out on first use)."""
        code = self._kinds.get(name)
        if code is None:
            code = self._kinds[name] = len(self._names)
            self._names.append(name)
        return code

    def group_key(self, group: Any) -> int:
        """The ring's key of `group` (an engine `Group`): a hash of its world ranks."""
        key = self._groups.get(group)
        if key is None:
            ranks = [self._members[r] for r in group.members]
            key = self._groups[group] = group_hash(ranks)
            self._group_members[key] = ranks
        return key

    def begin(self, op: Any) -> Any:
        """Record `op` (an engine `Op`) as called now; returns its span."""
        record = op.record
        key = (op.name, op.group, None if record is None else record.dtype)
        codes = self._codes.get(key)
        if codes is None:
            dtype = key[2]
            codes = self._codes[key] = (
                self.kind_code(op.name), self.group_key(op.group), 0 if dtype is None else dtype_code(dtype)
            )  # fmt: skip
        return self.ring.begin(codes[0], codes[1], op.nbytes, codes[2])

    # -- regions -----------------------------------------------------------------------------

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Record the program's span `name` around the block it wraps (nested ones too)."""
        depth = getattr(self._depth, "value", 0)
        entry = [name, now(), 0, depth]
        self._regions.append(entry)
        self._depth.value = depth + 1
        try:
            yield
        finally:
            self._depth.value = depth
            entry[2] = now()

    # -- the dump ----------------------------------------------------------------------------

    def dump(self, rank: int, size: int, host: str, offset_ns: int, check: bool,
             every_group: bool = True) -> dict[str, Any]:
        """This rank's record as the plain dict `chrome` and `stragglers` read.

        Args:
            rank: this rank's world rank; size: the context's size; host: its host name.
            offset_ns: what to add to this rank's clock to get the common clock.
            check: whether the context runs the consistency check.
            every_group: list the members of every group this rank recorded (a part, read
                alone); False lists only the groups whose first member this rank is, for a
                merge of every rank's dump (each group once: `read_dumps` and the readers
                take them from the merged table).
        """
        events = events_of(self.ring)
        columns: dict[str, list[Any]] = {name: events[name].tolist() for name in _COLUMNS}
        columns["kind"] = [self._names[k] if 0 <= k < len(self._names) else "?" for k in events["kind"].tolist()]
        columns["dtype"] = [_dtype_name(code) for code in events["dtype"].tolist()]
        columns["transport"] = [_transport_name(code) for code in events["transport"].tolist()]
        regions = list(self._regions)
        return {
            "rank": rank,
            "size": size,
            "host": host,
            "offset_ns": int(offset_ns),
            "check": bool(check),
            "capacity": int(self.ring.capacity),
            "dropped": int(self.ring.recorded - len(events)),
            "groups": {
                str(key): list(ranks) for key, ranks in self._group_members.items() if every_group or ranks[0] == rank
            },
            "events": columns,
            "regions": {
                "name": [r[0] for r in regions],
                "start": [r[1] for r in regions],
                "end": [r[2] for r in regions],
                "depth": [r[3] for r in regions],
            },
        }

    def lane_arguments(self) -> tuple[Any, int, Callable[[Any], int]]:
        """What the compiled lane records with: the ring, the code of ``all_reduce``, `group_key`."""
        return self.ring, self.kind_code("all_reduce"), self.group_key


def mark_posted(op: Any) -> None:
    """Record that `op`'s data (an engine `Op` with a span) was posted now, and how it travels."""
    if op.stepper is not None:
        op.trace.posted(SHM_TRANSPORT)
    elif op.requests:
        op.trace.posted(MPI_TRANSPORT)
    else:
        op.trace.posted(CHECK_TRANSPORT if op.payload is not None else LOCAL_TRANSPORT)


def _dtype_name(code: int) -> str:
    if code == 0:
        return ""
    try:
        return str(dtype_from_code(code))
    except (TypeError, ValueError):
        return "?"


def _transport_name(code: int) -> str:
    return TRANSPORTS[code] if 0 <= code < len(TRANSPORTS) else "?"
