"""`DataParallel.join()`: uneven inputs, as DDP's ``join()`` runs them.

While the block is open, each forward of a rank that still trains starts with one small
all-reduce of every rank's state (joined, training without sync, training with sync); a rank
whose inputs ran out leaves the block's body and, at its end, makes the calls its peers'
steps make: that all-reduce, the buffer broadcast, and one all-reduce of zeros per bucket
(when they sync). Nobody waits for a rank that has stopped. When every rank has joined, the
model of the last rank to join (the largest such rank, as DDP picks) goes to every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

import mpitensor as mt

from ._broadcast import broadcast_tensors
from ._reducer import Reducer

__all__ = ["Joiner"]

JOINED, TRAINING, SYNCING = 0, 1, 2  # a rank's state in the all-reduce that opens each step


class Joiner:
    """One ``join()`` block of a `DataParallel`.

    Args:
        reducer: the model's reducer (None for a model with nothing to train).
        sync_buffers: broadcasts the buffers from the given root (does nothing when the
            model does not broadcast them).
        state: the tensors the last joiner sends to every rank at the end.
        divide_by_initial_world_size: average over every rank (the joined ones sending
            zeros), as DDP by default; False averages over the ranks still training.
        throw_on_early_termination: raise on every rank as soon as one has joined.
    """

    def __init__(self, reducer: Reducer | None, sync_buffers: Callable[[int], None], state: Sequence[torch.Tensor],
                 divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        ctx = mt.current_context()
        self.rank, self.size = ctx.rank, ctx.size
        self.reducer, self.sync_buffers, self.state = reducer, sync_buffers, state
        self.divide_by_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination

    def notify(self) -> int:
        """A training rank's forward: tell the joined ranks; returns the buffers' root.

        Raises:
            RuntimeError: some rank has joined and `throw_on_early_termination` was asked.
        """
        syncing = self.reducer is None or self.reducer.sync
        active = self._states(SYNCING if syncing else TRAINING)[0]
        if self.reducer is not None and not self.divide_by_initial:
            self.reducer.divide_by(len(active))
        return int(active[-1])  # the largest training rank's buffers, as DDP's

    def shadow(self) -> None:
        """A joined rank, at the block's end: make its peers' calls until every rank has joined."""
        last_joiner = True
        while True:
            active, syncing = self._states(JOINED)
            if not len(active):
                break
            last_joiner = False
            self.sync_buffers(int(active[-1]))
            if syncing and self.reducer is not None:
                self.reducer.shadow()
        source = mt.all_reduce(np.array([self.rank if last_joiner else -1]), mt.ReduceOperation.MAX).resolve()
        broadcast_tensors(list(self.state), root=int(source.numpy()[0]))

    def _states(self, mine: int) -> tuple[np.ndarray, bool]:
        """All-reduce every rank's state: the training ranks, and whether they sync."""
        states = np.zeros(self.size, dtype=np.int32)
        states[self.rank] = mine
        states = mt.all_reduce(states, mt.ReduceOperation.MAX).resolve().numpy()
        if self.throw and (states == JOINED).any() and (states != JOINED).any():
            joined = np.flatnonzero(states == JOINED).tolist()
            raise RuntimeError(f"DataParallel.join: rank(s) {joined} ran out of inputs, and "
                               "throw_on_early_termination=True stops every rank")
        return np.flatnonzero(states), bool((states == SYNCING).any())
