"""Diagnosis of ranks that disagree on the *group* of a collective.

Ranks that disagree on shape, dtype, op or root meet in the same check and learn it there.
Ranks that disagree on the group never meet: each waits on its own communicator for the
other, forever. This module finds that case and turns it into the same
`CollectiveMismatchError` on every rank, with the context left usable.

How: a rank that has waited in a blocking call (``resolve``, ``barrier``, ``close``) for
`DIAG_AFTER` seconds on a check that has not completed sends a small BLOCKED note (which
group, which check in that group's sequence, and how many checks it has posted on each of
its groups) to the members of that group, over the context's own diagnosis communicator.
A blocked rank that holds a note from a peer it waits for, and sees that the peer waits for
it on another group (the peer needs a check this rank has not posted, and this rank needs
one the peer has not posted), knows both are stuck for good: it *fills in* the peer's wait
with an abandon record, a check that says where this rank is stuck instead. That check
completes everywhere as a mismatch; every rank that receives an abandon record fills in the
abandoning rank's wait in turn (the record says exactly which). So every rank involved
raises, and every group's sequence of checks stays aligned for the collectives that follow.
Notes are acted on only while their sender is provably still stuck (it needs a check this
rank has not posted), so a rank that is merely slow is never accused.

First use of a sub-group needs ``MPI_Comm_create_group``, which blocks inside MPI; so
members first exchange HELLO notes (each creation attempt numbered), under the same
diagnosis, and an abandon travels as a HELLO that says where its sender is stuck.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .._core.errors import CollectiveMismatchError, CollectiveTimeoutError
from .._core.mpi import MPI
from .check import AbandonRecord, Wait, Waiting, cycle_text
from .engine import CHECKING, QUEUED, Backoff, Op

__all__ = ["DIAG_AFTER", "Diagnosis", "Wait"]  # Wait: re-exported from check

DIAG_AFTER = 0.5  # seconds blocked before a rank tells its peers what it waits on
_BLOCKED, _HELLO = 11, 12


class Diagnosis:
    """The group-mismatch diagnosis of one context.

    Args:
        ctx: the context; its ``diag_comm`` carries the notes.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.comm = ctx.diag_comm
        self.me = ctx.rank
        self.notes: dict[int, dict[str, Any]] = {}  # peer -> its latest BLOCKED note
        self.hellos: dict[tuple[tuple[int, ...], int], dict[int, dict[str, Any] | None]] = {}
        self.attempts: dict[tuple[int, ...], int] = {}  # sub-group creations attempted
        self.reported: set[tuple[Any, ...]] = set()
        self.cycle: list[tuple[int, dict[str, Any]]] = []  # the last wait cycle found
        self.filled: set[Wait] = set()
        self.sends: list[Any] = []

    # -- notes on the wire -------------------------------------------------------------------

    def _send(self, dest: int, tag: int, note: dict[str, Any]) -> None:
        self.sends.append(self.comm.isend(note, dest, tag))

    def _drain(self) -> None:
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            note = self.comm.recv(source=source, tag=tag)
            if tag == _BLOCKED:
                self.notes[source] = note
            elif tag == _HELLO:
                key = (tuple(note["members"]), int(note["attempt"]))
                self.hellos.setdefault(key, {})[source] = note.get("abandon")
        self.sends = [request for request in self.sends if not request.Test()]

    def _report(self, wait: Wait) -> None:
        """Tell every other rank where this rank is stuck (once per wait and state).

        Every rank, not only the group's members: a wait cycle through several groups
        (0 waits for 1, 1 for 2, 2 for 0) is seen only by combining every rank's wait.
        The note is sent again when what this rank has posted changes (after a fill).
        """
        posted = {members: group.check_seq for members, group in self.ctx.groups.items()}
        key = (wait, tuple(sorted(posted.items())), tuple(sorted(self.attempts.items())))
        if key in self.reported:
            return
        self.reported.add(key)
        note = wait.as_note()
        note["posted"] = posted
        note["attempts"] = dict(self.attempts)
        for rank in range(self.ctx.size):
            if rank != self.me:
                self._send(rank, _BLOCKED, note)

    # -- who waits for whom -----------------------------------------------------------------------

    def _has_posted(self, wait: Wait) -> bool:
        """True if this rank has done its part of `wait` (so it is not what blocks it)."""
        if wait.creating:
            return wait.members in self.ctx.groups or self.attempts.get(wait.members, 0) > wait.seq
        group = self.ctx.groups.get(wait.members)
        return group is not None and group.check_seq > wait.seq

    def _peer_has_posted(self, peer: int, note: dict[str, Any], wait: Wait) -> bool:
        """True if `peer` (whose latest note is `note`) has done its part of `wait`."""
        if wait.creating:
            heard = self.hellos.get((wait.members, wait.seq), {})
            if peer in heard:
                return heard[peer] is None  # an abandon HELLO means "not coming"
            if Wait.from_note(note) == wait:
                return True  # it is creating the same group
            return int(note.get("attempts", {}).get(wait.members, 0)) > wait.seq
        return int(note["posted"].get(wait.members, 0)) > wait.seq

    def _waits_for(self, wait: Wait, other: int) -> bool:
        """True if a rank stuck in `wait` provably waits for rank `other` (blocked too)."""
        if other not in wait.members:
            return False
        if other == self.me:
            return not self._has_posted(wait)
        note = self.notes.get(other)
        return note is not None and not self._peer_has_posted(other, note, wait)

    def _cycle(self, mine: Wait, peer: int) -> list[int] | None:
        """A chain of provable waits from this rank to `peer`, or None.

        Provable because it is checked backwards from a peer that waits for this rank:
        that peer cannot move, so the rank waiting for it cannot either, and so on back
        to this rank. A merely slow rank sends no note, so no chain runs through it.
        """
        waits = {rank: Wait.from_note(note) for rank, note in self.notes.items()}
        waits[self.me] = mine
        paths = {self.me: [self.me]}
        frontier = [self.me]
        while frontier:
            rank = frontier.pop()
            for other in waits[rank].members:
                if other in paths or other not in waits or not self._waits_for(waits[rank], other):
                    continue
                paths[other] = [*paths[rank], other]
                if other == peer:
                    return paths[other]
                frontier.append(other)
        return None

    def _settle(self, mine: Wait) -> None:
        """Fill in the wait of every peer that waits for this rank while this rank waits for it.

        "Waits for it" may go through other ranks: 0 waits for 1, 1 for 2, 2 for 0.
        """
        for peer, note in list(self.notes.items()):
            theirs = Wait.from_note(note)
            if self.me not in theirs.members or self._has_posted(theirs):
                continue  # that peer does not wait for this rank
            chain = self._cycle(mine, peer)
            if chain is not None:
                waits = {rank: Wait.from_note(n) for rank, n in self.notes.items()}
                waits[self.me] = mine
                self.cycle = [(rank, waits[rank].as_note()) for rank in chain]
                self._fill(theirs, mine)

    def _fill(self, theirs: Wait, mine: Wait) -> None:
        """Stand in, with an abandon, for this rank's part of a peer's wait `theirs`."""
        if theirs in self.filled or self._has_posted(theirs):
            return
        self.filled.add(theirs)
        if theirs.creating:
            for member in theirs.members:
                if member != self.me:
                    self._send(member, _HELLO, {"members": theirs.members, "attempt": theirs.seq,
                                                "abandon": {**mine.as_note(), "cycle": self.cycle}})
            self.attempts[theirs.members] = theirs.seq + 1
            return
        group = self.ctx.groups[theirs.members]
        while group.check_seq <= theirs.seq:
            record = AbandonRecord(theirs.members, mine.members, mine.seq, mine.creating, mine.doing, self.cycle)
            self.ctx.engine.post_abandon(group, record)

    def answer(self, peer: int, waiting: Waiting, mine: Wait) -> None:
        """A peer abandoned this rank's check; fill in the wait its record names.

        Args:
            peer: the abandoning rank.
            waiting: where its record says it is stuck.
            mine: this rank's failed wait (what its own abandon records will name).
        """
        if self.me not in waiting.members:
            return
        self.cycle = list(waiting.cycle)
        self._fill(Wait(waiting.members, waiting.seq, waiting.creating, waiting.doing), mine)
        self._fill_predecessor(waiting.cycle, mine)

    def _fill_predecessor(self, cycle: Sequence[tuple[int, dict[str, Any]]], mine: Wait) -> None:
        """In a wait cycle, fill in the wait of the rank that waits for this one.

        Every rank of a cycle then fails, whichever learnt of the cycle first: without
        this, a rank freed early would go on to the call its predecessor waits for.
        """
        ranks = [rank for rank, _ in cycle]
        if self.me not in ranks:
            return
        _, where = cycle[ranks.index(self.me) - 1]
        theirs = Wait.from_note(where)
        if self.me in theirs.members and not self._has_posted(theirs):
            self.cycle = list(cycle)
            self._fill(theirs, mine)

    # -- hooks the engine and context call ------------------------------------------------------

    def _target(self, op: Op | None) -> Op | None:
        """The check this wait depends on: the op's own, or the one ahead of it."""
        candidates = [op] if op is not None else []
        candidates += [g.queue[0] for g in self.ctx.engine.waiting_groups if g.queue]
        for candidate in candidates:
            if candidate.state == CHECKING:
                return candidate
            if candidate.state == QUEUED and candidate.group.queue and candidate.group.queue[0].state == CHECKING:
                return candidate.group.queue[0]
        return None

    def on_wait(self, op: Op | None, waited: float) -> None:
        """Called while this rank blocks; `waited` is how long it has so far."""
        if waited < DIAG_AFTER:
            return
        self._drain()
        target = self._target(op)
        if target is None:
            return
        mine = Wait(target.group.members, target.seq, False, target.name)
        self._report(mine)
        self._settle(mine)

    def before_create(self, members: tuple[int, ...], doing: str = "a collective") -> None:
        """Make sure every member is creating this group before ``MPI_Comm_create_group``.

        Raises:
            CollectiveMismatchError: a member is stuck in a collective on another group.
            CollectiveTimeoutError: the context's timeout passed (the context is broken).
        """
        attempt = self.attempts.get(members, 0)
        mine = Wait(members, attempt, True, doing)
        others = [m for m in members if m != self.me]
        for member in others:
            self._send(member, _HELLO, {"members": members, "attempt": attempt, "abandon": None})
        start = time.monotonic()
        timeout = self.ctx.timeout
        backoff = Backoff(self.ctx.engine.spin_pauses)
        while True:
            self._drain()
            heard = self.hellos.get((members, attempt), {})
            abandoned = {peer: why for peer, why in heard.items() if why is not None}
            if abandoned:
                self.attempts[members] = attempt + 1
                self.hellos.pop((members, attempt), None)
                for why in abandoned.values():
                    theirs = Wait.from_note(why)
                    if self.me in theirs.members:
                        self._fill(theirs, mine)
                    self._fill_predecessor(why.get("cycle", ()), mine)
                peer, why = sorted(abandoned.items())[0]
                raise CollectiveMismatchError(
                    f"Mismatched groups: this rank ({self.me}) called {doing} on group {list(members)}, "
                    f"but rank {peer} is in {why['kind']} on group {list(why['members'])}; every member "
                    "of a group must call its collectives in the same order"
                    + (f"\n{cycle_text(why['cycle'])}" if why.get("cycle") else "")
                )
            if all(member in heard for member in others):
                break
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                message = (
                    f"creating the communicator of group {list(members)} did not complete within "
                    f"{timeout:g} s: not every member called a collective on it"
                )
                self.ctx.mark_broken(message)
                raise CollectiveTimeoutError(message)
            if waited >= DIAG_AFTER:
                self._report(mine)
                self._settle(mine)
            self.ctx.engine.progress()
            backoff.pause()
        self.attempts[members] = attempt + 1
        self.hellos.pop((members, attempt), None)

    def free(self) -> None:
        """Let the notes still being sent go (they are small, sent eagerly)."""
        for request in self.sends:
            request.Test()
        self.sends.clear()
