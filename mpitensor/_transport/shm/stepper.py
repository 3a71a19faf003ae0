"""One shared-memory all-reduce, as a `Stepper` the engine drives: the stages of the module's scheme."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._core.kernels import streaming_add
from ..._core.mpi import MPI
from .arena import Block
from .cma import Remote, can_read, process_vm_readv
from .group_state import GroupState
from .protocol import (
    C_ARRIVE,
    C_DONE,
    C_DONE_OK,
    C_INFO,
    CTL_ID,
    INFO_LEN,
    OK,
    ORDERED_STORES,
    PID,
    RES_ID,
    SEND,
    TAG_AGREED,
    TAG_COPIED,
    TAG_FLAG,
    TAG_GATHER,
    TAG_INFO,
    TAG_READY,
    TAG_SCATTER,
)
from .settings import PIECE_BYTES

__all__ = ["AllReduceStepper", "bounds", "reduce_pieces"]

# The agreement's values (see `AllReduceStepper.flag`).
_WENT_WELL, _CAN_READ = 2, 1

# Stages of `AllReduceStepper`, in order.
(
    _WAIT_TURN,
    _GATHER,
    _AGREE,
    _AGREE_SEND,
    _SCATTER,
    _GATHER_SEGMENTS,
    _READY,
    _COPIED,
    _FALLBACK_SCATTER,
    _FALLBACK_GATHER,
    _DONE,
) = range(11)


def bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    return count * index // parts, count * (index + 1) // parts


class AllReduceStepper:
    """One shared-memory all-reduce, moved along by `advance()` (a `Stepper`)."""

    def __init__(
        self,
        state: GroupState,
        send: np.ndarray,
        out: np.ndarray,
        block: Block | None,
        ufunc: Any,
        plan: Any,
    ) -> None:
        self.state = state
        self.send = send.reshape(-1)
        self.out = out.reshape(-1)
        self.block = block
        self.ufunc = ufunc
        self.plan = plan
        self.stage = _WAIT_TURN
        self.request: Any = None
        self.requests: list[Any] = []
        self.infos: np.ndarray | None = None
        # What this rank says after its reduction: 2 x (it went well) + (it can read its
        # peers' memory); the minimum over the ranks says both for all of them.
        self.flag = np.full(1, _WENT_WELL, np.int64)
        self.agreed = np.full(1, _WENT_WELL, np.int64)
        self.send_address = self.send.ctypes.data if self.send.size else 0
        self.flags_in: np.ndarray | None = None
        self.scratch: list[np.ndarray] = []
        self.in_place = False
        self.seq = 0
        self.flags = False
        self.rank = state.group.rank
        self.node = state.node

    # The engine calls this under its lock until it returns True.
    def advance(self) -> bool:
        """Do what can be done now without waiting; True once the result is complete."""
        while self.stage != _DONE:
            if self.stage == _WAIT_TURN:
                state = self.state
                if state.active[0] is not self:
                    return False
                state.seq += 1
                self.seq = state.seq
                if state.disabled:
                    self._fall_back()
                else:
                    self._start()
                continue
            if self.request is not None:
                if not self.request.Test():
                    return False
                self.request = None
            if self.requests:
                if not MPI.Request.Testall(self.requests):
                    return False
                self.requests = []
            self._step()
        return True

    def _step(self) -> None:
        """Run the stage whose messages have arrived, and start the next stage's."""
        state = self.state
        stage = self.stage
        if stage == _GATHER:
            self._reduce_locally()
        elif stage == _AGREE and not self.flags and self.rank == 0 and state.group.size > 1:
            self._send_agreement()
        elif stage in (_AGREE, _AGREE_SEND):
            self._agreed()
        elif stage == _SCATTER:
            self._exchange_gather(state.leaders, _GATHER_SEGMENTS)
        elif stage == _GATHER_SEGMENTS:
            self._release_node()
        elif stage == _READY:
            self._copy_from_leader()
        elif stage == _FALLBACK_SCATTER:
            self._exchange_gather(tuple(range(state.group.size)), _FALLBACK_GATHER)
        else:  # _COPIED, _FALLBACK_GATHER
            self._finish()

    def _messages(self, stage: int, requests: list[Any]) -> None:
        self.stage = stage
        self.requests = requests

    # -- stage 1: copy in, publish -------------------------------------------------------

    def _start(self) -> None:
        """Copy the input into this rank's block and publish it (stage _GATHER)."""
        state = self.state
        block = self.block
        if block is not None and len(self.node) > 1 and not state.cma:
            self._copy_in()
        self.stage = _GATHER
        if state.flags:
            # Descriptor first, then the sequence number that tells peers it is there.
            self.flags = True
            control = state.own_control
            assert control is not None
            control[C_INFO + OK] = block is not None
            if block is not None:
                control[C_INFO + RES_ID : C_INFO + RES_ID + 4] = block.descriptor
            control[C_INFO + SEND] = self.send_address
            control[C_ARRIVE] = self.seq
            state.arrived.seq = self.seq
            self.request = state.arrived
            return
        infos = state.rows
        infos[:] = 0
        info = infos[self.rank]
        info[PID] = state.pid
        info[OK] = block is not None
        info[SEND] = self.send_address
        if block is not None:
            info[RES_ID : RES_ID + 4] = block.descriptor
            if state.flat:
                control = state.control_block()
                if control is not None:
                    info[CTL_ID : CTL_ID + 4] = control.descriptor
                    state.own_control[C_INFO : C_INFO + INFO_LEN] = info  # type: ignore[index]
        self.infos = infos
        comm = state.comm
        requests = []
        for peer in self.node:
            if peer != self.rank:
                requests.append(comm.Irecv(infos[peer], peer, TAG_INFO))
                requests.append(comm.Isend(info, peer, TAG_INFO))
        self.requests = requests

    def _copy_in(self) -> None:
        """Everything but the slice this rank reduces itself (peers read only theirs)."""
        low, high = bounds(self.send.size, len(self.node), self.state.local_rank)
        np.copyto(self.out[:low], self.send[:low])
        np.copyto(self.out[high:], self.send[high:])

    # -- stage 2: reduce this rank's slice, agree ------------------------------------------

    def _gathered(self) -> np.ndarray:
        """The node's descriptors of this operation, one row per group rank."""
        state = self.state
        if not self.flags:
            assert self.infos is not None
            return self.infos
        rows = state.rows
        peers = iter(state.peer_controls)
        for group_rank in self.node:
            source = state.own_control if group_rank == self.rank else next(peers)
            rows[group_rank] = source[C_INFO : C_INFO + INFO_LEN]  # type: ignore[index]
        self.infos = rows
        return rows

    def _reduce_locally(self) -> None:
        """Reduce this rank's slice over its node; start the agreement (stage _AGREE)."""
        state = self.state
        infos = self._gathered()
        node = state.node_rows
        if not infos[node, OK].all():
            # A node peer has no shared memory: say so; every rank will fall back.
            self.flag[0] = 0
        else:
            try:
                if state.flat and not self.flags and infos[node, CTL_ID + 3].all():
                    state.map_controls(infos)
                self._reduce_slice(infos)
            except (OSError, ValueError):
                self.flag[0] = 0
            else:
                if state.cma or (state.cma is None and self._probe(infos)):
                    self.flag[0] = _WENT_WELL + _CAN_READ
        self.stage = _AGREE
        if self.flags:
            control = state.own_control
            assert control is not None
            control[C_DONE_OK] = self.flag[0]
            control[C_DONE] = self.seq
            state.done.seq = self.seq
            self.request = state.done
            return
        comm, size = state.comm, state.group.size
        if self.rank == 0:
            # The group's first rank collects every flag, then answers with their minimum.
            self.flags_in = np.ones(size, np.int64)
            self.requests = [comm.Irecv(self.flags_in[r : r + 1], r, TAG_FLAG) for r in range(1, size)]
        else:
            self.requests = [comm.Isend(self.flag, 0, TAG_FLAG), comm.Irecv(self.agreed, 0, TAG_AGREED)]

    def _probe(self, infos: np.ndarray) -> bool:
        """Whether this rank may read every node peer's memory directly."""
        return all(
            can_read(int(infos[peer, PID]), int(infos[peer, SEND])) for peer in self.node if peer != self.rank
        )

    def _send_agreement(self) -> None:
        assert self.flags_in is not None
        self.flags_in[0] = self.flag[0]
        self.agreed[0] = self.flags_in.min()
        comm = self.state.comm
        self._messages(_AGREE_SEND, [comm.Isend(self.agreed, r, TAG_AGREED) for r in range(1, self.state.group.size)])

    def _agreed(self) -> None:
        state = self.state
        agreed = int(self.agreed[0])
        if self.flags:
            agreed = min([int(self.flag[0]), *(int(c[C_DONE_OK]) for c in state.peer_controls)])
        if agreed < _WENT_WELL:
            state.disabled = True
            self._fall_back()
            return
        if state.cma is None:
            # Every rank tried reading its peers' memory; all use it from now on, or none.
            state.cma = agreed == _WENT_WELL + _CAN_READ
        if state.flat:
            if not self.flags and ORDERED_STORES and state.peer_controls:
                # Every rank mapped every control block (that is what was agreed): from
                # the next operation on, all synchronize through them.
                state.flags = True
            self._finish()
        elif self.rank == self.node[0]:
            self._exchange_scatter(state.leaders, self.out, _SCATTER)
        else:
            self._messages(_READY, [state.comm.Irecv(self.flag, self.node[0], TAG_READY)])

    def _array(self, mem: np.ndarray) -> np.ndarray:
        return mem[: self.send.nbytes].view(self.send.dtype)

    def _reduce_slice(self, infos: np.ndarray) -> None:
        state = self.state
        node = self.node
        low, high = bounds(self.send.size, len(node), state.local_rank)
        sources: list[Any] = []
        readv = process_vm_readv() if state.cma else None
        for index, group_rank in enumerate(node):
            if group_rank == self.rank:
                sources.append(self.send[low:high])
            elif readv is not None:
                info = infos[group_rank]
                address = int(info[SEND]) + low * self.send.itemsize
                buffer = state.cma_buffer(index, self.send.dtype)
                sources.append(Remote(readv, int(info[PID]), address, high - low, buffer))
            else:
                block = state.peer_block(group_rank, infos[group_rank], RES_ID)
                sources.append(self._array(block)[low:high])
        if state.flat:
            dests = [self.out[low:high]]
            for group_rank in node:
                if group_rank != self.rank:
                    dests.append(self._array(state.peer_block(group_rank, infos[group_rank], RES_ID))[low:high])
        elif self.rank == node[0]:
            dests = [self.out[low:high]]
        else:
            leader = node[0]
            dests = [self._array(state.peer_block(leader, infos[leader], RES_ID))[low:high]]
        reduce_pieces(self.ufunc, sources, dests)

    # -- between nodes, and the fallback: all-reduce by point-to-point messages ----------------

    def _exchange_scatter(self, ranks: tuple[int, ...], source: np.ndarray, stage: int) -> None:
        """Send each of `ranks` its segment of `source`; receive this rank's (then gather).

        Segment i of the message belongs to ``ranks[i]``, which reduces it in the order of
        `ranks`; `source` is this rank's contribution (its node's sum, or its input).
        """
        comm, datatype = self.state.comm, self.plan.datatype
        me = ranks.index(self.rank)
        count = self.out.size
        low, high = bounds(count, len(ranks), me)
        dtype = self.out.dtype
        self.scratch = [source[low:high] if peer == self.rank else np.empty(high - low, dtype) for peer in ranks]
        self.in_place = source is self.out
        requests = []
        for index, peer in enumerate(ranks):
            if peer == self.rank:
                continue
            requests.append(comm.Irecv([self.scratch[index], datatype], peer, TAG_SCATTER))
            seg_low, seg_high = bounds(count, len(ranks), index)
            requests.append(comm.Isend([source[seg_low:seg_high], datatype], peer, TAG_SCATTER))
        self._messages(stage, requests)

    def _exchange_gather(self, ranks: tuple[int, ...], stage: int) -> None:
        """Reduce this rank's segment in the order of `ranks`, and share it with them."""
        comm, datatype = self.state.comm, self.plan.datatype
        me = ranks.index(self.rank)
        count = self.out.size
        low, high = bounds(count, len(ranks), me)
        mine = self.out[low:high]
        parts = self.scratch
        # The first part accumulates: a received copy this rank owns, or for the first of
        # `ranks` its own segment, in place when it is already in `out` (else a copy: the
        # input is read-only).
        if me != 0:
            acc = parts[0]
        else:
            acc = mine if self.in_place else np.array(parts[0])
        for part in parts[1:]:
            self.ufunc(acc, part, out=acc)
        if acc is not mine:
            np.copyto(mine, acc)
        requests = []
        for index, peer in enumerate(ranks):
            if peer == self.rank:
                continue
            seg_low, seg_high = bounds(count, len(ranks), index)
            requests.append(comm.Irecv([self.out[seg_low:seg_high], datatype], peer, TAG_GATHER))
            requests.append(comm.Isend([mine, datatype], peer, TAG_GATHER))
        self.scratch = []
        self._messages(stage, requests)

    def _release_node(self) -> None:
        """The leader has the result: its node's other ranks may copy it (stage _COPIED)."""
        comm = self.state.comm
        requests = []
        copied = np.empty(len(self.node), np.int64)
        for index, peer in enumerate(self.node[1:]):
            requests.append(comm.Isend(self.flag, peer, TAG_READY))
            requests.append(comm.Irecv(copied[index : index + 1], peer, TAG_COPIED))
        self.scratch = [copied]
        self._messages(_COPIED, requests)

    def _copy_from_leader(self) -> None:
        """Copy the result from the leader's block, and tell it (stage _COPIED)."""
        leader = self.node[0]
        assert self.infos is not None
        source = self._array(self.state.peer_block(leader, self.infos[leader], RES_ID))
        np.copyto(self.out, source)
        self._messages(_COPIED, [self.state.comm.Isend(self.flag, leader, TAG_COPIED)])

    def _fall_back(self) -> None:
        """All-reduce `send` by point-to-point messages alone (every rank does the same)."""
        self._exchange_scatter(tuple(range(self.state.group.size)), self.send, _FALLBACK_SCATTER)

    def _finish(self) -> None:
        self.stage = _DONE
        self.scratch = []
        self.infos = None
        active = self.state.active
        if active and active[0] is self:
            active.popleft()



def reduce_pieces(ufunc: Any, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray]) -> None:
    """``dests[i][:] = sources[0] op sources[1] op ...`` (in that order), piece by piece.

    The first destination receives the reduction; the others get a copy of each piece
    while it is still in cache (or, for a sum of two float sources into at most two
    destinations, both are written by `streaming_add`'s stores, which bypass the cache).
    The first destination may be the first source (reduced in place), and the others may be
    sources: a piece is copied there only after it is reduced.
    """
    count = sources[0].size
    if count == 0:
        return
    step = max(1, PIECE_BYTES // sources[0].itemsize)
    first = dests[0]
    rest = dests[1:]
    # Two sources summed into at most two destinations (two ranks of a node): streamed stores,
    # where the kernel takes the arrays (float32 and float64, destinations apart from sources).
    stream = streaming_add if ufunc is np.add and len(sources) == 2 and len(rest) <= 1 else None
    for low in range(0, count, step):
        high = min(count, low + step)
        target = first[low:high]
        if len(sources) == 1:
            np.copyto(target, sources[0][low:high])
        elif stream is not None and stream(sources[0][low:high], sources[1][low:high], target,
                                           rest[0][low:high] if rest else None):
            continue
        else:
            ufunc(sources[0][low:high], sources[1][low:high], out=target)
            for source in sources[2:]:
                ufunc(target, source[low:high], out=target)
        for dest in rest:
            np.copyto(dest[low:high], target)

