"""Which transports each operation may use, in the order they are tried.

`base.select` runs the first whose ``applies(call)`` is True, so a list ends with a
transport that takes everything. The smallest checked all-reduces of small groups travel in
their consistency check (`inline`); other small all-reduces stay on MPI whatever the settings
(a copy of the input is cheaper than anything else at that size); large host ones go through
node peers' shared memory where it applies. A GPU tensor staged into pinned memory takes
the path a host input of its size would (MPI for small ones, shared memory where it
applies), so every rank runs the same algorithm; MPI reduces the pinned copy in place.
"""

from __future__ import annotations

from .base import Transport
from .inline import InCheck
from .mpi import Held, HeldUnchecked, InPlace, OnCopy, Plain, SmallOnCopy
from .shm import SharedMemory

__all__ = [
    "ALL_REDUCE", "ALL_REDUCE_CHECKED", "HELD_ALL_REDUCE", "IN_CHECK", "IN_PLACE", "PLAIN", "SHARED_MEMORY",
    "STAGED_ALL_REDUCE",
]

SHARED_MEMORY = SharedMemory()
PLAIN = Plain()
IN_CHECK = InCheck()
IN_PLACE = InPlace()
ALL_REDUCE: tuple[Transport, ...] = (IN_PLACE, SHARED_MEMORY, PLAIN)
# Checked calls (their check can carry the smallest ones): unchecked ones never ask.
ALL_REDUCE_CHECKED: tuple[Transport, ...] = (IN_CHECK, *ALL_REDUCE)
# A staged GPU copy takes the host list, each MPI transport replaced by its counterpart that
# reduces the private copy in place: the two lists cannot choose differently for one size.
_ON_COPY: dict[Transport, Transport] = {IN_PLACE: SmallOnCopy(), PLAIN: OnCopy()}
STAGED_ALL_REDUCE: tuple[Transport, ...] = tuple(_ON_COPY.get(transport, transport) for transport in ALL_REDUCE)
# An input its caller holds unchanged (`all_reduce(..., held=True)`): MPI's all-reduce in place or
# into the caller's buffer, whatever the size; blocking where the check has agreed first.
# Its calls are checked as another kind than plain all-reduces, so the lists never meet.
HELD_ALL_REDUCE: tuple[Transport, ...] = (Held(), HeldUnchecked())
