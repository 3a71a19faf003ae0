"""MPI's own data movement: the only place the collectives' data MPI calls are made.

- `all_reduce`: the all-reduce as transports (`InPlace` for small messages, `Plain` the
  catch-all that ends every host all-reduce's list in `select`, `OnCopy` in place on a
  staged GPU copy, `Held` and `HeldUnchecked` on buffers their caller holds),
  `all_reduce_buffers` for device buffers and `all_reduce_buckets` for the fused
  all-reduce's buckets.
- `rooted`: one rank sends to the group or receives from it (broadcast, reduce, gather,
  scatter).
- `symmetric`: every rank sends and receives alike (all-gather, all-to-all, reduce-scatter,
  scan, barrier).
- `held`: the blocking broadcast, all-gather, all-to-all, gather and reduce of buffers
  their caller holds, posted once the check has agreed.
- `p2p`: point-to-point messages.
- `side`: a communicator of its own for a second thread's collectives (the torch backend's
  communication hooks).

The collectives with one way to move their data call these functions from their ``post``
(they take a `Channel`, the buffers, datatypes and counts, and return the MPI requests);
an operation with several ways to move its data has `Transport` objects chosen by `select`.
"""

from __future__ import annotations

from .all_reduce import (
    EXCHANGE_TAG,
    SMALL_BYTES,
    Held,
    HeldUnchecked,
    InPlace,
    OnCopy,
    Plain,
    SmallOnCopy,
    all_reduce_buckets,
    all_reduce_buffers,
    held_all_reduce,
    in_place,
    out_of_place,
)
from .held import held_all_gather, held_all_to_all, held_broadcast, held_gather, held_reduce
from .p2p import any_source, recv, send, status
from .rooted import broadcast, broadcast_each, gather, gatherv, reduce, scatter, scatterv
from .symmetric import (
    all_gather,
    all_gather_each,
    all_gatherv,
    all_to_all,
    all_to_allv,
    barrier,
    exscan,
    reduce_scatter,
    reduce_scatter_block,
    reduce_scatter_block_each,
    scan,
)

__all__ = [
    "EXCHANGE_TAG", "SMALL_BYTES", "Held", "HeldUnchecked", "InPlace", "OnCopy", "Plain", "SmallOnCopy", "all_gather",
    "any_source",
    "all_gather_each", "all_gatherv", "all_reduce_buckets", "all_reduce_buffers", "all_to_all", "all_to_allv",
    "barrier", "broadcast", "broadcast_each", "exscan", "gather", "gatherv", "held_all_gather", "held_all_reduce",
    "held_all_to_all", "held_broadcast", "held_gather", "held_reduce", "in_place",
    "out_of_place", "recv", "reduce", "reduce_scatter", "reduce_scatter_block", "reduce_scatter_block_each", "scan",
    "scatter", "scatterv", "send", "status",
]
