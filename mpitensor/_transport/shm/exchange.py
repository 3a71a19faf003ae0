"""An all-reduce by point-to-point messages in O(log n) rounds: among node leaders, and the fallback.

Recursive halving, then recursive doubling (Rabenseifner's all-reduce, as MPICH and Open MPI
run it for long messages): with ``p`` the largest power of two up to ``n`` participants, the
first ``2 (n - p)`` pair up and the odd one of each pair hands its whole message to the even
one (a *fold*), leaving ``p``. In round ``k`` of the reduce-scatter each of them swaps half of
its current range with the one whose index differs in bit ``k`` and reduces the half it
keeps; after ``log2 p`` rounds each owns one ``p``-th of the message, reduced over everyone.
The all-gather runs the rounds backwards, and the folded ones get the whole result back.
Each participant sends ``2 log2 p`` messages (plus one for a fold), each sum goes once over
the wire per round in each direction, and no participant talks to more than
``log2 p + 1`` others.

Every element is reduced in exactly one place at each level of a fixed binary tree (the
lower index's operand on the left), so every participant gets the same bits. Flags (one
integer each, e.g. "my node's part went well") travel beside the data through the fold and
the reduce-scatter; their minimum is known to every participant at the end. Where it is
below ``ok``, the result is garbage and the arithmetic is skipped (the messages are not, so
that every rank posts the same ones).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from .protocol import TAG_FOLD, TAG_GATHER, TAG_SCATTER, TAG_VOTE

__all__ = ["Waits", "all_reduce_among", "halving_rounds"]

# What the generator yields: MPI requests to complete before it may go on.
Waits = list[Any]


def halving_rounds(index: int, parties: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The reduce-scatter's rounds for `index` of `parties` (a power of two).

    Returns:
        Per round, (partner, kept blocks, given blocks), blocks as [low, high) of `parties`
        equal blocks of the message: the round swaps the given half of the current range for
        the partner's copy of the kept half. The all-gather runs them backwards. After the
        last round `index` keeps one block, its own share of the result.
    """
    low, high = 0, parties
    rounds = []
    bit = 1
    while bit < parties:
        middle = (low + high) // 2
        lower, upper = (low, middle), (middle, high)
        kept, given = (upper, lower) if index & bit else (lower, upper)
        rounds.append((index ^ bit, kept, given))
        low, high = kept
        bit <<= 1
    return rounds


def all_reduce_among(
    comm: Any,
    ranks: Sequence[int],
    me: int,
    source: np.ndarray,
    out: np.ndarray,
    datatype: Any,
    ufunc: Any,
    flag: int | None = None,
    ok: int = 1,
) -> Generator[Waits, None, int | None]:
    """All-reduce `source` over `ranks` into `out` (a generator of waits; see the module).

    Args:
        comm: the communicator (point-to-point messages only).
        ranks: the participants' ranks in `comm`, in the order of the reduction.
        me: this rank's index in `ranks`.
        source: this rank's contribution (1-d; may be `out` itself, else left unchanged).
        out: where the result lands, on every participant (1-d, as long as `source`).
        datatype: the MPI datatype of the elements.
        ufunc: ``ufunc(a, b, out=...)``, the reduction.
        flag: this rank's flag, or None to send no flags.
        ok: the smallest minimum of the flags for which the data is reduced.

    Returns:
        (when the generator ends) the minimum of every participant's flag, None without flags.
    """
    return _Exchange(comm, ranks, me, out, datatype, ufunc, flag, ok).run(source)


class _Exchange:
    """One participant's part of `all_reduce_among`."""

    def __init__(self, comm: Any, ranks: Sequence[int], me: int, out: np.ndarray, datatype: Any, ufunc: Any,
                 flag: int | None, ok: int) -> None:
        self.comm, self.ranks, self.me, self.out = comm, ranks, me, out
        self.datatype, self.ufunc, self.ok = datatype, ufunc, ok
        self.power = 1 << (len(ranks).bit_length() - 1)
        self.extra = len(ranks) - self.power
        self.vote = None if flag is None else np.full(1, flag, np.int64)
        self.theirs = np.empty(1, np.int64)

    def run(self, source: np.ndarray) -> Generator[Waits, None, int | None]:
        me, out = self.me, self.out
        current = source
        if me < 2 * self.extra:
            partner = self.ranks[me ^ 1]
            if me & 1:
                # Folded: hand everything to the even one, then wait for the result.
                yield self.post(partner, TAG_FOLD, source, None, send_vote=True)
                yield self.post(partner, TAG_FOLD, None, out, receive_vote=True)
                if self.vote is not None:
                    self.vote[0] = self.theirs[0]
                return self.result()
            received = np.empty(out.size, out.dtype)
            yield self.post(partner, TAG_FOLD, None, received, receive_vote=True)
            if self.agreed():
                self.ufunc(current, received, out=out)  # the lower index on the left
            current = out
            index = me // 2
        else:
            index = me - self.extra
        rounds = halving_rounds(index, self.power)
        # The rounds run one after the other: one buffer, as long as the first round's half.
        buffer = np.empty(out.size - out.size // 2, out.dtype)
        for partner, kept, given in rounds:
            keep, give = self.elements(kept), self.elements(given)
            received = buffer[: keep.stop - keep.start]
            yield self.post(self.real(partner), TAG_SCATTER, current[give], received, send_vote=True,
                            receive_vote=True)
            if self.agreed():
                mine = current[keep]
                # The lower index's operand on the left: one fixed order, the same bits everywhere.
                self.ufunc(*((mine, received) if index < partner else (received, mine)), out=out[keep])
            current = out
        if current is not out:
            np.copyto(out, current)  # alone: the result is the contribution
        for partner, kept, given in reversed(rounds):
            yield self.post(self.real(partner), TAG_GATHER, out[self.elements(kept)], out[self.elements(given)])
        if me < 2 * self.extra:
            yield self.post(self.ranks[me + 1], TAG_FOLD, out, None, send_vote=True)
        return self.result()

    def post(self, partner: int, tag: int, send: np.ndarray | None, recv: np.ndarray | None,
             send_vote: bool = False, receive_vote: bool = False) -> Waits:
        """Post the messages of one step with `partner` (and the flags, where there are any)."""
        comm, waits = self.comm, []
        if recv is not None:
            waits.append(comm.Irecv([recv, self.datatype], partner, tag))
        if send is not None:
            waits.append(comm.Isend([send, self.datatype], partner, tag))
        if self.vote is not None:
            if receive_vote:
                waits.append(comm.Irecv(self.theirs, partner, TAG_VOTE))
            if send_vote:
                waits.append(comm.Isend(self.vote, partner, TAG_VOTE))
        return waits

    def agreed(self) -> bool:
        """Fold the partner's flag into this rank's; whether the data is worth reducing."""
        vote = self.vote
        if vote is None:
            return True
        vote[0] = min(int(vote[0]), int(self.theirs[0]))
        return int(vote[0]) >= self.ok

    def result(self) -> int | None:
        return None if self.vote is None else int(self.vote[0])

    def real(self, index: int) -> int:
        """The rank of the participant that takes part in the rounds as `index`."""
        return self.ranks[2 * index if index < self.extra else index + self.extra]

    def elements(self, blocks: tuple[int, int]) -> slice:
        count = self.out.size
        return slice(count * blocks[0] // self.power, count * blocks[1] // self.power)
