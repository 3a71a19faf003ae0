"""The rounds of the wait diagnosis: every rank's wait, gathered by MPI's non-blocking all-reduce.

A rank blocked for a while joins the next round with what it waits on (a snapshot, see
`Snapshot`); a round completes once every rank of the context has joined it, and then
every rank holds the same `Picture` of who waits for whom. A round is up to three
``MPI_Iallreduce`` on the context's diagnosis communicator, each O(log P) messages per
rank (a binomial tree, or reduce-scatter and all-gather, as MPI chooses):

1. the header, two int64 per rank summed: how many joined blocked, how many closing. A
   round with a closing rank stops here (it only keeps the rounds paired at close);
2. the rows, 9 int64 per rank summed (each rank fills its own): the group it waits on (by
   `group_id`), the check's place in the group's sequence, whether it is the group's
   creation, and the operation's name. With fewer than two distinct waits there can be no
   cycle, and the round stops here;
3. the cells, one int64 per rank and distinct wait, their maximum: how far each rank is in
   the group of each wait (0: not a member). The lowest rank creating a group marks its
   members, whom the others may not know yet.

Rounds follow each other: a rank joins round k + 1 only once round k completed (which needs
every rank), so the ranks' counts of joined rounds differ by at most one, and rounds never
cross. A round that a rank joined stays in flight until every rank has joined it: a
straggler's peers post one header and wait; nothing more is sent until the straggler joins
(at its next long wait, or at close).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core.mpi import MPI
from .check import Members, Wait

__all__ = ["CREATED", "Picture", "Round", "Snapshot", "WaitKey"]

_TEXT = 40  # bytes of an operation's name in a row
ROW = 4 + _TEXT // 8  # int64 per rank: state, group id, seq, creating, the name
_BLOCKED, _CLOSING = 1, 2
CREATED = 1 << 40  # a cell's value for a group the rank has created (beyond every attempt count)

WaitKey = tuple[int, int, bool]  # (group id, seq or attempt, creating)


@dataclass
class Snapshot:
    """What one rank says in a round, all taken at the moment it joins.

    Every part must be of one moment: a rank's wait with the checks it had posted then.
    (A later count with an earlier wait could show a rank that has moved on as stuck.)

    Attributes:
        wait: where the rank is stuck; None for a rank that is closing.
        posted: group id -> checks posted on that group, for every group the rank has.
        attempts: group id -> creation attempts, for groups it has tried to create.
        known: group id -> members, for the groups of `attempts` and of `wait`.
    """

    wait: Wait | None
    posted: dict[int, int] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    known: dict[int, Members] = field(default_factory=dict)

    def key(self) -> WaitKey | None:
        """The wait as a `WaitKey` (None when closing)."""
        if self.wait is None:
            return None
        return (_id_of(self.wait.members), self.wait.seq, self.wait.creating)


def _id_of(members: tuple[int, ...]) -> int:
    return members.id if isinstance(members, Members) else Members(members).id


class Picture:
    """Who waits for whom, from one round: the same on every rank.

    Args:
        waits: rank -> its wait's key, for every rank of the round (each joined blocked).
        doing: rank -> the operation it waits in.
        distinct: the distinct waits, in the order of the cells' columns.
        cells: (ranks, distinct waits) -> 0 for a non-member, else 1 + how far the rank is
            (checks posted, or creation attempts; `CREATED` once created). None when the
            round had fewer than two distinct waits.
    """

    def __init__(self, waits: Mapping[int, WaitKey], doing: Mapping[int, str], distinct: list[WaitKey],
                 cells: np.ndarray | None) -> None:
        self.waits = dict(waits)
        self.doing = dict(doing)
        self.distinct = distinct
        self.column = {key: d for d, key in enumerate(distinct)}
        self.cells = cells
        self._members: dict[int, Members] = {}

    def members(self, key: WaitKey) -> Members:
        """The members of the group of wait `key` (requires cells)."""
        assert self.cells is not None
        d = self.column[key]
        if d not in self._members:
            self._members[d] = Members(int(r) for r in np.flatnonzero(self.cells[:, d] >= 1))
        return self._members[d]

    def waited_for(self, key: WaitKey) -> np.ndarray:
        """The ranks a rank stuck in wait `key` provably waits for: members not done with it, themselves stuck."""
        assert self.cells is not None
        d = self.column[key]
        column = self.cells[:, d]
        pending = (column >= 1) & (column - 1 <= key[1])
        if key[2]:  # a member creating the same group (this attempt) has done its part
            pending &= np.array([self.waits.get(rank) != key for rank in range(len(column))])
        stuck = np.zeros(len(column), dtype=bool)
        stuck[list(self.waits)] = True
        return np.flatnonzero(pending & stuck)

    def cycles_through(self, me: int) -> list[list[int]]:
        """Every chain of provable waits from `me` to a rank that waits for `me`: ``[me, ..., peer]``.

        Found backwards from a peer that waits for `me`: that peer cannot move while `me`
        does not, so the rank waiting for it cannot either, and so on back to `me`. Only
        ranks that joined the round stuck are on a chain (a merely slow rank is on none).
        """
        if self.cells is None or me not in self.waits:
            return []
        targets = {key: set(self.waited_for(key).tolist()) for key in self.distinct}
        parent = {me: me}
        frontier = [me]
        expanded: set[WaitKey] = set()  # ranks stuck in one wait all wait for the same ranks
        while frontier:
            rank = frontier.pop()
            key = self.waits[rank]
            if key in expanded:
                continue
            expanded.add(key)
            for other in sorted(targets[key] - {rank}):
                if other not in parent:
                    parent[other] = rank
                    frontier.append(other)
        chains = []
        for peer in sorted(parent):
            if peer != me and me in targets[self.waits[peer]]:
                chain = [peer]
                while chain[-1] != me:
                    chain.append(parent[chain[-1]])
                chains.append(chain[::-1])
        return chains

    def wait_of(self, rank: int) -> Wait:
        """`rank`'s wait, with its group's members (requires cells)."""
        key = self.waits[rank]
        return Wait(self.members(key), key[1], key[2], self.doing[rank])


class Round:
    """One round of the diagnosis on this rank, from joining it to its picture.

    Args:
        comm: the context's diagnosis communicator.
        snapshot: what this rank says.
    """

    def __init__(self, comm: Any, snapshot: Snapshot) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.snapshot = snapshot
        self.picture: Picture | None = None
        self.closing = 0  # ranks that joined closing (known after the header)
        self.done = False
        self._stage = 0
        self._rows: np.ndarray | None = None
        header = np.array([0, 1] if snapshot.wait is None else [1, 0], dtype=np.int64)
        self._post(header, MPI.SUM)

    @property
    def everyone_closing(self) -> bool:
        """True once the round is done and every rank joined it closing."""
        return self.done and self.closing == self.size

    def step(self) -> bool:
        """Test the round's exchange and go on to its next part; True once the round is done."""
        if self.done or not self._request.Test():
            return self.done
        received = self._received
        if self._stage == 1:
            self.closing = int(received[1])
            if self.closing:
                return self._finish(None)
            self._post(self._my_row(), MPI.SUM)
        elif self._stage == 2:
            self._rows = received.reshape(self.size, ROW)
            waits, doing, distinct = _decode(self._rows)
            if len(distinct) < 2:  # every stuck rank waits on the same thing: no cycle
                return self._finish(Picture(waits, doing, distinct, None))
            self._post(self._my_cells(waits, distinct).ravel(), MPI.MAX)
        else:
            assert self._rows is not None
            waits, doing, distinct = _decode(self._rows)
            return self._finish(Picture(waits, doing, distinct, received.reshape(self.size, len(distinct))))
        return False

    def _post(self, send: np.ndarray, op: Any) -> None:
        self._sent = send  # kept alive until MPI is done with it
        self._received = np.zeros_like(send)
        self._request = self.comm.Iallreduce(send, self._received, op)
        self._stage += 1

    def _finish(self, picture: Picture | None) -> bool:
        self.picture = picture
        self.done = True
        self._sent = self._received = None  # type: ignore[assignment]
        return True

    def _my_row(self) -> np.ndarray:
        rows = np.zeros((self.size, ROW), dtype=np.int64)
        wait = self.snapshot.wait
        assert wait is not None
        text = wait.doing.encode("utf-8")[:_TEXT].ljust(_TEXT, b"\0")
        rows[self.rank, :4] = (_BLOCKED, _id_of(wait.members), wait.seq, int(wait.creating))
        rows[self.rank, 4:] = np.frombuffer(text, dtype=np.int64)
        return rows.ravel()

    def _my_cells(self, waits: Mapping[int, WaitKey], distinct: list[WaitKey]) -> np.ndarray:
        cells = np.zeros((self.size, len(distinct)), dtype=np.int64)
        snapshot = self.snapshot
        for d, (group, _, creating) in enumerate(distinct):
            if group in snapshot.posted:
                cells[self.rank, d] = CREATED if creating else 1 + snapshot.posted[group]
            elif group in snapshot.known:
                cells[self.rank, d] = 1 + snapshot.attempts.get(group, 0)
            if creating and min(r for r, key in waits.items() if key == distinct[d]) == self.rank:
                # The lowest rank creating the group names its members (who may not know it yet).
                members = np.asarray(snapshot.known[group], dtype=np.intp)
                cells[members, d] = np.maximum(cells[members, d], 1)
        return cells


def _decode(rows: np.ndarray) -> tuple[dict[int, WaitKey], dict[int, str], list[WaitKey]]:
    """Every rank's wait and operation from the gathered rows, and the distinct waits in order."""
    waits: dict[int, WaitKey] = {}
    doing: dict[int, str] = {}
    for rank in np.flatnonzero(rows[:, 0] == _BLOCKED).tolist():
        row = rows[rank]
        waits[rank] = (int(row[1]), int(row[2]), bool(row[3]))
        doing[rank] = np.ascontiguousarray(row[4:]).tobytes().rstrip(b"\0").decode("utf-8", "replace")
    return waits, doing, sorted(set(waits.values()))
