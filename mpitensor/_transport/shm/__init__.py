"""The shared-memory all-reduce among the ranks of a node, and the hierarchical scheme across nodes.

For large host messages, MPI's all-reduce moves every byte through its own buffers several
times. Here the ranks of a node share memory instead:

1. Each rank copies its input into its *result* block, a block of shared memory its node
   peers can map (all of it but the slice it reduces itself), and says where the block is.
2. Local rank k reduces slice k of the message over the node's ranks, in rank order, in
   cache-sized pieces, reading slice k of every peer's block, and writes the reduced slice
   back into slice k of every rank's block (flat scheme, all ranks on one node), or of the
   node leader's (hierarchical scheme). Nobody else touches slice k, and each piece is
   read before it is overwritten, so the input copies and the result share one block.
3. Hierarchical only: the node leaders (each node's first rank) all-reduce the node sums
   with point-to-point messages in O(log L) rounds among the L leaders (recursive halving,
   then doubling: `exchange.py`), then the other ranks of each node copy the result from
   their leader's block. Only leaders send messages across nodes, each to log2(L) + 1 other
   leaders at most; no rank talks to every rank.

Where the kernel lets a rank read its node peers' memory (``process_vm_readv``, "cross-memory
attach", as Open MPI's single-copy transfers use it: same user, and no Yama ptrace
restriction or seccomp filter in the way), step 1's copy is skipped: local rank k reads
slice k of each peer's input straight from the peer's own buffer, piece by piece into a
cache-sized buffer, which cuts a third of the memory traffic. The first operation of a
group tries it and every rank agrees whether it works; otherwise the copy stays.
``MPITENSOR_SHM_CMA=0`` turns it off.

Each element is reduced in exactly one place in one fixed order, so every rank gets the same
bits: within a node in local rank order, across nodes along a fixed binary tree of the
leaders (for two nodes, the first node's sum plus the second's).

Each rank's result is a block of its own shared memory, leased to the caller like
the pool's blocks (`_core/pool.py`): it stays valid for as long as the array (or a view) lives, and only
then returns to the rank's pool of blocks. Peers write into it only during an operation
that names it.

Why memory blocks of our own rather than MPI shared windows: ``MPI_Win_allocate_shared`` is
a blocking collective, and there is no point inside a non-blocking operation where a rank
may block until its peers arrive (they may be waiting on it elsewhere). A block here is a
``memfd`` that only its owner creates, grows and frees; peers map it through
``/proc/<pid>/fd/<fd>`` (checked by inode) when an operation names it, and cache the
mapping. Nothing is ever created collectively, so nothing can hang, and a rank never waits
for its peers to agree on a size.

Ordering between ranks. The first operation of a group exchanges small point-to-point
messages among the ranks of each node on the group's communicator, tested from `advance()`
(point-to-point traffic never matches the collectives that the engine posts on the same
communicator, so no ordering between the two is needed, and no communicator has to be
created). The same holds for the leaders' all-reduce: an MPI collective over a leaders'
communicator (as Open MPI's HAN runs it) would need that communicator created collectively,
and a collective started from inside a step could be posted before a later call's
collective on one rank and after it on another.

- each rank sends its block descriptors to its node peers after its copy-in (nobody reads a
  block before it is written);
- each rank sends "my part went well" to its node leader after its reduction; the leaders
  fold their nodes' answers into the all-reduce among them (a flag beside the data in each
  round of the reduce-scatter), and each leader sends its node's ranks what all said once
  the result is in its block; they copy it and say so (nobody returns a result before
  every slice is in it, nor reuses a block someone still reads). Ranks that cannot map a
  peer's memory (other containers, no ``/proc``) say so there; every rank then computes
  that operation with point-to-point messages alone (the same O(log P) rounds, over every
  rank), and the group stops using shared memory (every rank decides this from the same
  values).

Once that first operation has mapped the node's small *control* blocks, the ranks of a node
synchronize through them instead, which costs a few memory reads rather than MPI round
trips: each rank writes its descriptor and then its sequence number, and polls its peers'
from `advance()`; after its reduction it writes what it says and another sequence number; a
leader writes what all said, then "the result is in my block", and waits for its peers'
"copied". Within a node that takes no message at all; across nodes only the leaders'
all-reduce remains. It relies on stores becoming visible in program order and loads not
passing loads (x86's memory model; NumPy's large copies and the streaming kernel end with a
store fence), so other architectures keep the node's messages.

Memory is mapped without keeping a file descriptor (`arena.Mapping`): a rank holds open only
its own blocks (one descriptor each, which its peers open through ``/proc``), whatever the
number of peers whose blocks it maps.

Operations of one group run one at a time in the group's data order, so messages of one
kind between two ranks arrive in operation order, and sequence numbers count the same on
every rank.
"""

from .layout import node_layout
from .settings import may_apply, min_bytes
from .transport import SharedMemory

__all__ = ["SharedMemory", "may_apply", "min_bytes", "node_layout"]
