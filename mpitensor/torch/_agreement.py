"""The agreement a collective on a second thread's communicator makes before its data moves.

A collective that a thread other than the program's posts on a communicator of its own
(a communication hook's callback, a group owned by a helper thread) first agrees with its
peers: one small all-gather of a row per rank, ``[kind, hash of what must agree, failed,
...]``. Ranks whose rows differ, or a rank that marks its own call as failed, then tell each
other their calls in words (`each_rank`), so that every rank raises an error naming each
rank's call instead of pairing one rank's data with another call's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from ..integration import SideComm

__all__ = ["CALL", "agreed", "call_row", "each_rank"]

# A row's kind: a call of this rank's (hooks add stand-in rows of their own kind).
CALL = 1


def call_row(what: str, failed: bool, *extra: int) -> np.ndarray:
    """This rank's row of an agreement: ``[CALL, hash of what, failed, *extra]`` (int64).

    Args:
        what: the call in words, everything the ranks must agree on (the same text on every
            rank that makes the same call).
        failed: this rank cannot make the call (its own arguments are wrong): the peers raise
            a mismatch naming it.
        extra: further columns the caller compares itself.

    Returns:
        The row.
    """
    return np.array([CALL, zlib.crc32(what.encode()), failed, *extra], np.int64)


def agreed(rows: np.ndarray, mine: np.ndarray) -> bool:
    """Whether every rank's row is a call like this rank's `mine` and none failed.

    Args:
        rows: every rank's row, in rank order (an all-gather of `mine`).
        mine: this rank's row, from `call_row`.

    Returns:
        True when the data may move.
    """
    return bool((rows[:, 0] == CALL).all() and (rows[:, 1] == mine[1]).all() and not rows[:, 2].any())


def each_rank(comm: SideComm, said: str, name: Callable[[int], int] | None = None) -> str:
    """Every rank's call (or its failure) in words: ``"rank 0: ...; rank 1: ..."``.

    A blocking all-gather of `said`: call it only once every rank's row arrived (each then
    knows the agreement failed and calls it too).

    Args:
        comm: the agreement's communicator.
        said: this rank's call, or what went wrong with it.
        name: a rank's number in messages, from its rank in `comm` (None: that rank).

    Returns:
        The ranks' calls, in rank order.
    """
    calls = comm.all_gather_object(said)
    return "; ".join(f"rank {rank if name is None else name(rank)}: {call}" for rank, call in enumerate(calls))
