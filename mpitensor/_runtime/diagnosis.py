"""Diagnosis of ranks that disagree on the *group* of a collective.

Ranks that disagree on shape, dtype, op or root meet in the same check and learn it there.
Ranks that disagree on the group never meet: each waits on its own communicator for the
other, forever. This module finds that case and turns it into the same
`CollectiveMismatchError` on every rank, with the context left usable.

How: a rank that has waited in a blocking call (``resolve``, ``barrier``, ``close``, a
group's creation) for `DIAG_AFTER` seconds joins the next *round* (`rounds.Round`): MPI's
non-blocking all-reduce, on the context's own diagnosis communicator, of where every rank
is stuck (which group, which check in that group's sequence) and how far each is in the
groups of those waits. A round completes once every rank of the context has joined it;
then every rank holds the same picture of who waits for whom, and each looks for a chain of
*provable* waits from itself back to a peer that waits for it (each link a rank that needs
a check the next has not posted; see `Picture.cycles_through`). Finding one, it *fills in*
that peer's wait with an abandon record, a check that says where this rank is stuck
instead. That check completes everywhere as a mismatch; every rank that receives an abandon
record fills in the abandoning rank's wait in turn (the record says exactly which), and in
a cycle its predecessor's too. So every rank of the cycle raises, and every group's
sequence of checks stays aligned for the collectives that follow.

What it costs: nothing while no rank waits long. A rank merely late for a collective makes
each of its peers post one round's first exchange (O(log P) messages per rank, and one
pending request) and nothing more until it joins; the round then ends, at its next long
wait or at close. A rank joins a round at most every `ROUND_PAUSE` seconds. Where a rank
never waits in mpitensor (it computes, or blocks in the program's own MPI calls), rounds
wait for it: the cycle is named once it waits, and the context's timeout bounds the rest.

First use of a sub-group needs ``MPI_Comm_create_group``, which blocks inside MPI; so its
members first meet in a non-blocking tree (`arrival.Arrivals`), under the same diagnosis,
where a member stuck elsewhere stands in with an abandon.

At close (every rank closing together, the close check passed), `finish` joins rounds until
one that every rank joined closing, so that no round is left in flight, and waits for the
trees this rank took part in: every note a rank is sent is received.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from .._core.errors import CollectiveMismatchError, CollectiveTimeoutError
from .._core.mpi import MPI
from .arrival import DOWN, UP, Arrivals
from .check import AbandonRecord, Members, Wait, Waiting, cycle_text
from .engine import CHECKING, QUEUED, Backoff, Op
from .rounds import Picture, Round, Snapshot

__all__ = ["DIAG_AFTER", "ROUND_PAUSE", "Diagnosis", "Wait"]  # Wait: re-exported from check

DIAG_AFTER = 0.5  # seconds blocked before a rank joins a round of the diagnosis
ROUND_PAUSE = 0.5  # seconds from the end of one of a rank's rounds before it joins another
_FINISH_AT_LEAST = 1.0  # seconds finish() waits for the last rounds, at least (else check_grace)


def _members(members: tuple[int, ...]) -> Members:
    return members if isinstance(members, Members) else Members(members)


class Diagnosis:
    """The group-mismatch diagnosis of one context.

    Args:
        ctx: the context; its ``diag_comm`` carries the rounds and the creation trees.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.comm = ctx.diag_comm
        self.me = ctx.rank
        self.attempts: dict[tuple[int, ...], int] = {}  # sub-group creations attempted
        self.cycle: list[tuple[int, dict[str, Any]]] = []  # the last wait cycle found
        self.filled: set[Wait] = set()
        self.sends: list[Any] = []
        self.arrivals = Arrivals(self.comm, self.me, self._send)
        self.round: Round | None = None  # the round this rank has joined, until it is done
        self.last_round: Round | None = None
        self.rounds = 0  # rounds joined
        self._round_ended = -ROUND_PAUSE
        # resolve() may wait on several threads at once; one at a time takes the diagnosis's
        # steps, which post MPI collectives and must not be posted twice.
        self._lock = threading.Lock()

    # -- notes and rounds on the wire -------------------------------------------------------

    def _send(self, dest: int, tag: int, note: Any) -> None:
        self.sends.append(self.comm.isend(note, dest, tag))

    def _drain(self) -> None:
        """Receive the creation trees' notes that came, and take their steps."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            note = self.comm.recv(source=source, tag=tag)
            if tag in (UP, DOWN):
                self.arrivals.receive(tag, source, note)
        self.arrivals.advance()
        self.sends = [request for request in self.sends if not request.Test()]

    def _step_round(self, current: Wait | None) -> None:
        """Take the round's next step; once it is done, act on its picture if still stuck in `current`."""
        if self.round is None or not self.round.step():
            return
        done, self.round = self.round, None
        self.last_round = done
        self._round_ended = time.monotonic()
        if done.picture is not None and current is not None and done.snapshot.wait == current:
            self._settle(done.picture, current)

    def _join(self, mine: Wait) -> None:
        """Join the next round as stuck in `mine`, unless one is in flight or this rank's last ended just now."""
        if self.round is None and time.monotonic() - self._round_ended >= ROUND_PAUSE:
            self.round = Round(self.comm, self._snapshot(mine))
            self.rounds += 1

    def _snapshot(self, mine: Wait | None) -> Snapshot:
        """This rank's wait and how far it is in every group, at this moment."""
        groups = self.ctx.groups
        snapshot = Snapshot(mine, {_members(members).id: group.check_seq for members, group in groups.items()})
        for members, attempts in self.attempts.items():
            key = _members(members)
            snapshot.attempts[key.id] = attempts
            snapshot.known[key.id] = key
        if mine is not None and mine.creating:
            key = _members(mine.members)
            snapshot.known[key.id] = key
        return snapshot

    # -- who waits for whom -----------------------------------------------------------------------

    def _has_posted(self, wait: Wait) -> bool:
        """True if this rank has done its part of `wait` (so it is not what blocks it)."""
        if wait.creating:
            return wait.members in self.ctx.groups or self.attempts.get(wait.members, 0) > wait.seq
        group = self.ctx.groups.get(wait.members)
        return group is not None and group.check_seq > wait.seq

    def _settle(self, picture: Picture, mine: Wait) -> None:
        """Fill in the wait of every peer that waits for this rank while this rank waits for it.

        "Waits for it" may go through other ranks: 0 waits for 1, 1 for 2, 2 for 0.
        """
        for chain in picture.cycles_through(self.me):
            theirs = picture.wait_of(chain[-1])
            self.cycle = [(rank, picture.wait_of(rank).as_note()) for rank in chain]
            self._fill(theirs, mine)

    def _fill(self, theirs: Wait, mine: Wait) -> None:
        """Stand in, with an abandon, for this rank's part of a peer's wait `theirs`."""
        if theirs in self.filled or self._has_posted(theirs):
            return
        self.filled.add(theirs)
        if theirs.creating:
            members = _members(theirs.members)
            node = self.arrivals.node(members, theirs.seq)
            node.take_part({**mine.as_note(), "cycle": self.cycle}, self.me)
            self.attempts[members] = theirs.seq + 1
            self.arrivals.advance()
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
        if waited < DIAG_AFTER and self.round is None and not self.arrivals.open:
            return
        if not self._lock.acquire(blocking=False):
            return  # another thread is taking the diagnosis's steps
        try:
            self._drain()
            mine = None
            if waited >= DIAG_AFTER:
                target = self._target(op)
                if target is not None:
                    mine = Wait(target.group.members, target.seq, False, target.name)
            self._step_round(mine)
            if mine is not None:
                self._join(mine)
        finally:
            self._lock.release()

    def before_create(self, members: tuple[int, ...], doing: str = "a collective") -> None:
        """Make sure every member is creating this group before ``MPI_Comm_create_group``.

        Raises:
            CollectiveMismatchError: a member is stuck in a collective on another group.
            CollectiveTimeoutError: the context's timeout passed (the context is broken).
        """
        members = _members(members)
        with self._lock:
            attempt = self.attempts.get(members, 0)
            node = self.arrivals.node(members, attempt)
            node.take_part(None, self.me)
            self.arrivals.advance()
        mine = Wait(members, attempt, True, doing)
        start = time.monotonic()
        timeout = self.ctx.timeout
        backoff = Backoff(self.ctx.engine.spin_pauses)
        while node.outcome is None:
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                message = (
                    f"creating the communicator of group {list(members)} did not complete within "
                    f"{timeout:g} s: not every member called a collective on it"
                )
                self.ctx.mark_broken(message)
                raise CollectiveTimeoutError(message)
            with self._lock:
                self._drain()
                if waited >= DIAG_AFTER:
                    self._step_round(mine)
                    self._join(mine)
                else:
                    self._step_round(None)
            if node.outcome is None:
                self.ctx.engine.progress()
                backoff.pause()
        self.attempts[members] = attempt + 1
        if node.outcome:
            self._creation_abandoned(mine, node.outcome)

    def _creation_abandoned(self, mine: Wait, abandoned: list[tuple[int, dict[str, Any]]]) -> None:
        """Members stood in for this creation: fill in what they wait on, then raise.

        Raises:
            CollectiveMismatchError: always, naming the lowest abandoning member.
        """
        with self._lock:
            for _, why in abandoned:
                theirs = Wait.from_note(why)
                if self.me in theirs.members:
                    self._fill(theirs, mine)
                self._fill_predecessor(why.get("cycle", ()), mine)
        peer, why = min(abandoned, key=lambda entry: entry[0])
        raise CollectiveMismatchError(
            f"Mismatched groups: this rank ({self.me}) called {mine.doing} on group {list(mine.members)}, "
            f"but rank {peer} is in {why['kind']} on group {list(why['members'])}; every member "
            "of a group must call its collectives in the same order"
            + (f"\n{cycle_text(why['cycle'])}" if why.get("cycle") else "")
        )

    def finish(self) -> None:
        """Leave nothing in flight: called by every rank as the context closes together.

        Joins rounds, as closing, until one that every rank joined closing (the ranks'
        rounds then end paired), and waits for the creation trees this rank took part in.
        Gives up after ``check_grace`` (at least 1 s): a rank that left without closing
        never joins, and its requests are let go.
        """
        deadline = time.monotonic() + max(_FINISH_AT_LEAST, self.ctx.config.check_grace)
        backoff = Backoff(self.ctx.engine.spin_pauses)
        with self._lock:
            while time.monotonic() < deadline:
                self._drain()
                self._step_round(None)
                if self.round is None:
                    if self.last_round is not None and self.last_round.everyone_closing:
                        if not self.arrivals.busy and not self.sends:
                            return
                    else:
                        self.round = Round(self.comm, Snapshot(None))
                        self.rounds += 1
                backoff.pause()

    def free(self) -> None:
        """Let the notes still being sent go (small, sent eagerly), and any round still in flight."""
        for request in self.sends:
            request.Test()
        self.sends.clear()
        self.round = None
