"""The offsets between the ranks' clocks, measured when a traced context opens.

Each rank records on its own monotonic clock, which is not one clock across hosts (nor is
``MPI_Wtime`` on every MPI). Rank 0 exchanges a few round trips with each rank in turn and
keeps, per rank, the estimate of the round trip that took the least time (the one least
disturbed by the network or the scheduler), as NTP does: the offset is then known to within
half that round trip.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .ring import now

__all__ = ["ROUNDS", "measure_offset"]

ROUNDS = 8
_TAG = 0x7AC3


def measure_offset(comm: Any, rounds: int = ROUNDS) -> int:
    """This rank's offset to rank 0's clock, in ns: add it to a local time to get rank 0's.

    Collective over `comm` (every rank calls it; nothing else may use `comm` meanwhile).

    Args:
        comm: an mpi4py communicator.
        rounds: round trips per rank.

    Returns:
        The offset (0 on rank 0).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return 0
    stamp = np.zeros(1, np.int64)
    if rank != 0:
        for _ in range(rounds):
            comm.Recv(stamp, source=0, tag=_TAG)
            stamp[0] = now()
            comm.Send(stamp, dest=0, tag=_TAG)
        offsets = None
    else:
        offsets = [0] + [_offset_of(comm, peer, rounds, stamp) for peer in range(1, size)]
    return int(comm.scatter(offsets, root=0))


def _offset_of(comm: Any, peer: int, rounds: int, stamp: np.ndarray) -> int:
    """Rank 0's side of the round trips with `peer`: the estimate of the shortest."""
    best_trip, best = None, 0
    for _ in range(rounds):
        sent = now()
        comm.Send(stamp, dest=peer, tag=_TAG)
        comm.Recv(stamp, source=peer, tag=_TAG)
        back = now()
        trip = back - sent
        if best_trip is None or trip < best_trip:
            best_trip, best = trip, (sent + back) // 2 - int(stamp[0])
    return best
