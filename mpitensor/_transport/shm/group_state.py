"""What the shared-memory all-reduce keeps per group: its arena, peers' mappings, control blocks."""

from __future__ import annotations

import math
import os
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ..._core.idle import pause
from ..base import Channel, Stepper
from .arena import Arena, Block, Lease, map_peer
from .cma import Remote
from .protocol import C_ARRIVE, C_COPIED, C_DONE, C_READY, CONTROL_BYTES, CTL_ID, INFO_LEN
from .settings import MAX_PEER_MAP_BYTES, PIECE_BYTES, cpu_count

__all__ = ["FlagWait", "GroupState"]


class FlagWait:
    """A wait on the node peers' control blocks: complete once each shows `seq` at `field`.

    It quacks like an MPI request (``Test()``), so `AllReduceStepper.advance` waits on either.
    """

    __slots__ = ("controls", "field", "seq", "yield_cpu")

    def __init__(self, controls: list[np.ndarray], field: int, seq: int, yield_cpu: bool = False) -> None:
        self.controls = controls
        self.field = field
        self.seq = seq
        self.yield_cpu = yield_cpu

    def Test(self) -> bool:  # noqa: N802 - the name of MPI.Request.Test
        """True once every peer has reached the sequence number.

        With more ranks than cores, a peer that is behind may be waiting for this very CPU:
        then a miss gives the CPU away at once rather than after the engine's spins.
        """
        field, seq = self.field, self.seq
        if all(control[field] >= seq for control in self.controls):
            return True
        if self.yield_cpu:
            pause()
        return False



class GroupState:
    """What the fast path keeps per group (in ``group.extra``; freed with the context).

    Args:
        group: the group.
        layout: its ranks per node (`node_layout`); the fast path applies when a node
            holds two of them.
    """

    def __init__(self, group: Channel, layout: tuple[tuple[int, ...], ...]) -> None:
        self.group = group
        self.layout = layout
        self.applies = group.size > 1 and any(len(node) > 1 for node in layout) and hasattr(os, "memfd_create")
        rank = group.rank
        self.node = next((node for node in layout if rank in node), (rank,))
        self.local_rank = self.node.index(rank)
        self.leaders = tuple(node[0] for node in layout)
        self.flat = len(layout) == 1
        self.arena = Arena()
        self.comm = group.comm
        self.active: deque[Stepper] = deque()
        self.seq = 0  # operations that have taken their turn
        self.disabled = False
        self.failed_local = False
        self.peer_maps: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.peer_bytes = 0
        self.pid = os.getpid()
        self.control: Block | None = None
        self.own_control: np.ndarray | None = None
        self.peer_controls: list[np.ndarray] = []  # the node peers', in rank order
        self.flags = False  # synchronize through the control blocks
        self.cma: bool | None = None  # read peers' inputs directly (None: not tried yet)
        self.readers: dict[tuple[int, str], Remote] = {}
        # Reused by every operation (they run one at a time): the node's descriptors, and
        # the waits on the peers' control blocks.
        self.rows = np.zeros((group.size, INFO_LEN), np.int64)
        self.node_rows: Any = slice(None) if self.flat else list(self.node)
        self.oversubscribed = len(self.node) >= cpu_count()  # no core left for another thread
        crowded = len(self.node) > cpu_count()
        self.arrived = FlagWait([], C_ARRIVE, 0, crowded)  # the peers' descriptors are out
        self.done = FlagWait([], C_DONE, 0, crowded)  # the peers' slices are reduced
        self.ready = FlagWait([], C_READY, 0, crowded)  # the leader's block holds the result
        self.copied = FlagWait([], C_COPIED, 0, crowded)  # the peers copied it from there

    def lease_result(
        self, shape: tuple[int, ...], dtype: np.dtype, pool: Any
    ) -> tuple[np.ndarray, Block | None]:
        """The result array of a new operation, in shared memory when possible."""
        if not self.failed_local:
            try:
                block = self.arena.take(math.prod(shape) * dtype.itemsize)
            except OSError:
                self.failed_local = True
            else:
                return np.asarray(Lease(self.arena, block, tuple(shape), dtype)), block
        return pool.empty(shape, dtype), None

    def reader(self, index: int, dtype: np.dtype, readv: Any) -> Remote:
        """This rank's reader of node peer number `index`'s input (`Remote`), with its piece-sized buffer.

        Kept per peer and dtype, as the operations of a group run one at a time: each aims it
        at its own slice (`Remote.aim`).
        """
        key = (index, dtype.str)
        reader = self.readers.get(key)
        if reader is None:
            buffer = np.empty(max(1, PIECE_BYTES // dtype.itemsize), dtype)
            reader = self.readers[key] = Remote(readv, 0, 0, 0, buffer)
        return reader

    def control_block(self) -> Block | None:
        """This rank's control block (created on first use), or None without memory."""
        if self.control is None and not self.failed_local:
            try:
                self.control = Block(0, CONTROL_BYTES)
            except OSError:
                self.failed_local = True
                return None
            self.own_control = self.control.mem.view(np.int64)
            self.own_control[:] = 0
        return self.control

    def enqueue(self, op: Stepper) -> None:
        """Queue `op` behind the group's operations in flight (started in data order)."""
        self.active.append(op)

    def peer_block(self, group_rank: int, info: np.ndarray, which: int) -> np.ndarray:
        """The peer's block named in its descriptor `info`, mapped (cached by block id).

        Args:
            group_rank: the peer's rank in the group.
            info: the peer's descriptor.
            which: where the block's fields start (``RES_ID``).

        Raises:
            OSError: the block cannot be opened or is not the one named.
        """
        key = (group_rank, int(info[which]))
        mem = self.peer_maps.get(key)
        if mem is not None:
            self.peer_maps.move_to_end(key)
            return mem
        mem = map_peer(group_rank, info, which)
        self.peer_maps[key] = mem
        self.peer_bytes += mem.nbytes
        while self.peer_bytes > MAX_PEER_MAP_BYTES and len(self.peer_maps) > 1:
            self.peer_bytes -= self.peer_maps.popitem(last=False)[1].nbytes
        return mem

    def map_controls(self, infos: np.ndarray) -> None:
        """Map the node peers' control blocks (once).

        Raises:
            OSError: a control block cannot be opened.
        """
        if not self.peer_controls:
            self.peer_controls = [
                map_peer(r, infos[r], CTL_ID).view(np.int64) for r in self.node if r != self.group.rank
            ]
            self.arrived.controls = self.done.controls = self.copied.controls = self.peer_controls
            # The leader is the node's first rank: first among a peer's peers.
            self.ready.controls = self.peer_controls[:1]

    def free(self) -> None:
        """Drop the blocks and mappings (called when the context closes)."""
        self.comm = None
        self.peer_maps.clear()
        self.peer_bytes = 0
        self.peer_controls = []
        self.arena.close()
        control, self.control = self.control, None
        if control is not None:
            control.close()

