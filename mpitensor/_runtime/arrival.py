"""The arrival of every member at a group's creation, before ``MPI_Comm_create_group``.

``MPI_Comm_create_group`` blocks inside MPI until every member calls it: a member that never
does (it is stuck in a collective on another group) would hold the others there forever,
beyond the reach of any diagnosis. So the members first meet in a non-blocking exchange of
their own, and only enter MPI's call once every member has arrived.

The exchange is a binomial tree over the members (in group order, rooted at the first), on
the context's diagnosis communicator: each member sends its subtree's arrival up to its
parent once its children's have come, and the root sends the outcome back down. A member
sends at most 1 + log2(G) notes and receives as many, where greeting every member cost
G - 1 each. A member stuck elsewhere that learns, from the diagnosis, that the creators
wait for it while it waits for them takes its place in the tree with an *abandon* (where it
is stuck instead); the outcome then lists every abandon, and every member raises.

Every note a member is sent is one it receives: a tree completes only once every member
has taken part, and each member receives exactly its children's notes and its parent's.
"""

from __future__ import annotations

from typing import Any

from .check import Members

__all__ = ["Arrival", "Arrivals", "DOWN", "UP"]

UP, DOWN = 12, 13  # tags of the tree's notes on the diagnosis communicator

Abandons = list[tuple[int, dict[str, Any]]]  # (rank, where it is stuck instead)


class Arrival:
    """This rank's place in the tree of one creation attempt of one group.

    Args:
        members: the group's members.
        attempt: the attempt's number (each failed attempt moves every member to the next).
        rank: this rank in the context.
    """

    def __init__(self, members: Members, attempt: int, rank: int) -> None:
        self.members = members
        self.attempt = attempt
        self.key = (members.id, attempt)
        index = members.index(rank)
        size = len(members)
        self.parent = None if index == 0 else members[index - (1 << (index.bit_length() - 1))]
        step = 1 << index.bit_length() if index else 1
        self.children = []
        while index + step < size:
            self.children.append(members[index + step])
            step <<= 1
        self.heard: dict[int, Abandons] = {}  # child -> its subtree's abandons
        self.mine: Abandons | None = None  # this rank's part, once it has taken it
        self.sent_up = False
        self.outcome: Abandons | None = None  # every member's abandons, once known
        self.finished = False  # the outcome has gone down to the children

    def take_part(self, abandon: dict[str, Any] | None, rank: int) -> None:
        """Arrive (`abandon` None) or stand in with an abandon saying where this rank is stuck."""
        if self.mine is None:
            self.mine = [] if abandon is None else [(rank, abandon)]


class Arrivals:
    """The creation trees this rank takes part in, and the notes that came before it did.

    Args:
        comm: the context's diagnosis communicator.
        rank: this rank in the context.
        send: sends a note (``send(dest, tag, payload)``), keeping its request.
    """

    def __init__(self, comm: Any, rank: int, send: Any) -> None:
        self.comm = comm
        self.rank = rank
        self._send = send
        self.open: dict[tuple[int, int], Arrival] = {}
        self._early: dict[tuple[int, int], list[tuple[int, int, Abandons]]] = {}  # notes before the node

    def node(self, members: Members, attempt: int) -> Arrival:
        """This rank's node in the tree of (`members`, `attempt`), made on first use."""
        key = (members.id, attempt)
        node = self.open.get(key)
        if node is None:
            node = self.open[key] = Arrival(members, attempt, self.rank)
            for tag, source, abandons in self._early.pop(key, []):
                self._take(node, tag, source, abandons)
        return node

    def receive(self, tag: int, source: int, note: tuple[int, int, Abandons]) -> None:
        """A tree's note from `source` (received by the diagnosis from the communicator)."""
        group, attempt, abandons = note
        key = (group, attempt)
        node = self.open.get(key)
        if node is None:
            self._early.setdefault(key, []).append((tag, source, abandons))
        else:
            self._take(node, tag, source, abandons)

    def advance(self) -> None:
        """Send what every open node can send now; let go of the finished ones."""
        for key, node in list(self.open.items()):
            self._advance(node)
            if node.finished:
                del self.open[key]

    @property
    def busy(self) -> bool:
        """True while some tree this rank took part in has not finished here."""
        return any(node.mine is not None for node in self.open.values())

    def _take(self, node: Arrival, tag: int, source: int, abandons: Abandons) -> None:
        if tag == UP:
            node.heard[source] = abandons
        else:
            node.outcome = abandons
        self._advance(node)

    def _advance(self, node: Arrival) -> None:
        if node.mine is None or node.finished:
            return
        if not node.sent_up and len(node.heard) == len(node.children):
            subtree = node.mine + [entry for child in node.children for entry in node.heard[child]]
            node.sent_up = True
            if node.parent is None:
                node.outcome = subtree
            else:
                self._send(node.parent, UP, (node.key[0], node.attempt, subtree))
        if node.outcome is not None:
            for child in node.children:
                self._send(child, DOWN, (node.key[0], node.attempt, node.outcome))
            node.finished = True
