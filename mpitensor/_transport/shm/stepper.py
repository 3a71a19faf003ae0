"""One shared-memory all-reduce, as a `Stepper` the engine drives: the stages of the module's scheme."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from ..._core.kernels import streaming_add
from ..._core.mpi import MPI
from .arena import Block
from .cma import can_read, process_vm_readv
from .exchange import all_reduce_among
from .group_state import GroupState
from .protocol import (
    C_ARRIVE,
    C_COPIED,
    C_DONE,
    C_DONE_OK,
    C_INFO,
    C_READY,
    C_READY_OK,
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
    TAG_INFO,
)
from .settings import PIECE_BYTES

__all__ = ["AllReduceStepper", "bounds", "reduce_pieces"]

# What a rank says after its reduction: 2 x (it went well) + (it can read its peers'
# memory); the minimum over the ranks says both for all of them.
_WENT_WELL, _CAN_READ = 2, 1

# What the stages yield: a `FlagWait` on the node peers' control blocks, or MPI requests.
Steps = Generator[Any, None, None]


def bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    return count * index // parts, count * (index + 1) // parts


class AllReduceStepper:
    """One shared-memory all-reduce, moved along by `advance()` (a `Stepper`).

    Its stages are a generator (`_run`): each step yields what it waits for, a `FlagWait`
    or a list of MPI requests, and `advance()` resumes it once that is complete.
    """

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
        self.steps: Steps | None = None
        self.wait: Any = None
        self.finished = False
        self.infos: np.ndarray | None = None
        self.leader_block: np.ndarray | None = None
        self.flag = np.array([_WENT_WELL], np.int64)
        self.agreed = np.array([_WENT_WELL], np.int64)
        self.send_address = self.send.ctypes.data if self.send.size else 0
        self.seq = 0
        self.rank = state.group.rank
        self.node = state.node

    # The engine calls this under its lock until it returns True.
    def advance(self) -> bool:
        """Do what can be done now without waiting; True once the result is complete."""
        if self.finished:
            return True
        if self.steps is None:
            state = self.state
            if state.active[0] is not self:
                return False
            state.seq += 1
            self.seq = state.seq
            self.steps = self._fall_back() if state.disabled else self._run()
        while not self.finished:
            wait = self.wait
            if wait is not None:
                if not (MPI.Request.Testall(wait) if isinstance(wait, list) else wait.Test()):
                    return False
                self.wait = None
            try:
                self.wait = next(self.steps)
            except StopIteration:
                self._finish()
        return True

    def _run(self) -> Steps:
        """The stages: publish, reduce this rank's slice, agree (across nodes: exchange), settle."""
        state = self.state
        by_flags = state.flags  # decided before this operation, the same on the node's ranks
        infos = yield from self._publish(by_flags)
        self._reduce_locally(infos, by_flags)
        if state.flat:
            agreed = yield from self._agree_flat(by_flags)
        elif self.rank == self.node[0]:
            agreed = yield from self._lead(by_flags)
        else:
            agreed = yield from self._follow(by_flags)
        self._settle(agreed, by_flags)
        if agreed < _WENT_WELL:
            yield from self._fall_back()

    # -- stage 1: copy in, publish -------------------------------------------------------

    def _publish(self, by_flags: bool) -> Generator[Any, None, np.ndarray]:
        """Copy the input in where peers read copies; publish where it is; wait for the node's."""
        state = self.state
        block = self.block
        if block is not None and len(self.node) > 1 and not state.cma:
            self._copy_in()
        if by_flags:
            # Descriptor first, then the sequence number that tells peers it is there.
            control = state.own_control
            assert control is not None
            control[C_INFO + OK] = block is not None
            if block is not None:
                control[C_INFO + RES_ID : C_INFO + RES_ID + 4] = block.descriptor
            control[C_INFO + SEND] = self.send_address
            control[C_ARRIVE] = self.seq
            state.arrived.seq = self.seq
            yield state.arrived
            return self._read_descriptors()
        infos = state.rows
        infos[:] = 0
        info = infos[self.rank]
        info[PID] = state.pid
        info[OK] = block is not None
        info[SEND] = self.send_address
        if block is not None:
            info[RES_ID : RES_ID + 4] = block.descriptor
            control = state.control_block()
            if control is not None:
                info[CTL_ID : CTL_ID + 4] = control.descriptor
                state.own_control[C_INFO : C_INFO + INFO_LEN] = info  # type: ignore[index]
        comm = state.comm
        requests = []
        for peer in self.node:
            if peer != self.rank:
                requests.append(comm.Irecv(infos[peer], peer, TAG_INFO))
                requests.append(comm.Isend(info, peer, TAG_INFO))
        yield requests
        return infos

    def _copy_in(self) -> None:
        """Everything but the slice this rank reduces itself (peers read only theirs)."""
        low, high = bounds(self.send.size, len(self.node), self.state.local_rank)
        np.copyto(self.out[:low], self.send[:low])
        np.copyto(self.out[high:], self.send[high:])

    def _read_descriptors(self) -> np.ndarray:
        """The node's descriptors of this operation from the control blocks, one row per group rank."""
        state = self.state
        rows = state.rows
        peers = iter(state.peer_controls)
        for group_rank in self.node:
            source = state.own_control if group_rank == self.rank else next(peers)
            rows[group_rank] = source[C_INFO : C_INFO + INFO_LEN]  # type: ignore[index]
        return rows

    # -- stage 2: reduce this rank's slice ---------------------------------------------------

    def _reduce_locally(self, infos: np.ndarray, by_flags: bool) -> None:
        """Reduce this rank's slice over its node; set what this rank says (`flag`)."""
        state = self.state
        self.infos = infos
        node = state.node_rows
        if not all(infos[node, OK]):  # Python's all: NumPy's costs microseconds on a few rows
            # A node peer has no shared memory: say so; every rank will fall back.
            self.flag[0] = 0
            return
        try:
            if not by_flags and infos[node, CTL_ID + 3].all():
                state.map_controls(infos)
            self._reduce_slice(infos)
        except (OSError, ValueError):
            self.flag[0] = 0
            return
        if state.cma or (state.cma is None and self._probe(infos)):
            self.flag[0] = _WENT_WELL + _CAN_READ

    def _probe(self, infos: np.ndarray) -> bool:
        """Whether this rank may read every node peer's memory directly."""
        return all(
            can_read(int(infos[peer, PID]), int(infos[peer, SEND])) for peer in self.node if peer != self.rank
        )

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
                sources.append(state.reader(index, self.send.dtype, readv).aim(int(info[PID]), address, high - low))
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
            # Kept for the copy of the result: the cache of mappings may drop it meanwhile.
            self.leader_block = self._array(state.peer_block(leader, infos[leader], RES_ID))
            dests = [self.leader_block[low:high]]
        reduce_pieces(self.ufunc, sources, dests)

    # -- stage 3: agree; across nodes, the leaders' all-reduce ---------------------------------

    def _agree_flat(self, by_flags: bool) -> Generator[Any, None, int]:
        """One node: every slice is in every rank's block once every rank is done."""
        state = self.state
        if by_flags:
            control = state.own_control
            assert control is not None
            control[C_DONE_OK] = self.flag[0]
            control[C_DONE] = self.seq
            state.done.seq = self.seq
            yield state.done
            return min([int(self.flag[0]), *(int(c[C_DONE_OK]) for c in state.peer_controls)])
        if self.rank == self.node[0]:
            agreed = yield from self._node_flags(False)
            self.agreed[0] = agreed
            yield [state.comm.Isend(self.agreed, peer, TAG_AGREED) for peer in self.node[1:]]
            return agreed
        comm, leader = state.comm, self.node[0]
        yield [comm.Isend(self.flag, leader, TAG_FLAG), comm.Irecv(self.agreed, leader, TAG_AGREED)]
        return int(self.agreed[0])

    def _node_flags(self, by_flags: bool) -> Generator[Any, None, int]:
        """The node leader's wait for its peers' slices: the minimum of what the node says."""
        state = self.state
        if by_flags:
            state.done.seq = self.seq
            yield state.done
            return min([int(self.flag[0]), *(int(c[C_DONE_OK]) for c in state.peer_controls)])
        said = np.empty(len(self.node) - 1, np.int64)
        yield [state.comm.Irecv(said[i : i + 1], peer, TAG_FLAG) for i, peer in enumerate(self.node[1:])]
        return min([int(self.flag[0]), *(int(v) for v in said)])

    def _lead(self, by_flags: bool) -> Generator[Any, None, int]:
        """A node leader: the node's sum in its block, all-reduced with the other leaders."""
        state = self.state
        node_flag = yield from self._node_flags(by_flags)
        leaders = state.leaders
        agreed = yield from all_reduce_among(
            state.comm, leaders, leaders.index(self.rank), self.out, self.out, self.plan.datatype, self.ufunc,
            node_flag, _WENT_WELL,
        )
        assert agreed is not None
        # The result is in this block: the node's ranks copy it, then it may be returned.
        if by_flags:
            control = state.own_control
            assert control is not None
            control[C_READY_OK] = agreed
            control[C_READY] = self.seq
            state.copied.seq = self.seq
            yield state.copied
            return agreed
        self.agreed[0] = agreed
        comm, peers = state.comm, self.node[1:]
        copied = np.empty(len(peers), np.int64)
        requests = [comm.Isend(self.agreed, peer, TAG_AGREED) for peer in peers]
        yield requests + [comm.Irecv(copied[i : i + 1], peer, TAG_COPIED) for i, peer in enumerate(peers)]
        return agreed

    def _follow(self, by_flags: bool) -> Generator[Any, None, int]:
        """A node leader's peer: once the leader says the result is in, copy it from its block."""
        state, leader = self.state, self.node[0]
        comm = state.comm
        control = state.own_control
        if by_flags:
            assert control is not None
            control[C_DONE_OK] = self.flag[0]
            control[C_DONE] = self.seq
            state.ready.seq = self.seq
            yield state.ready
            agreed = int(state.peer_controls[0][C_READY_OK])
        else:
            yield [comm.Isend(self.flag, leader, TAG_FLAG), comm.Irecv(self.agreed, leader, TAG_AGREED)]
            agreed = int(self.agreed[0])
        if agreed >= _WENT_WELL:
            assert self.leader_block is not None
            np.copyto(self.out, self.leader_block)
        self.leader_block = None
        if by_flags:
            assert control is not None
            control[C_COPIED] = self.seq
        else:
            yield [comm.Isend(self.flag, leader, TAG_COPIED)]
        return agreed

    def _settle(self, agreed: int, by_flags: bool) -> None:
        """What every rank decides alike from the agreement, for the operations to come."""
        state = self.state
        if agreed < _WENT_WELL:
            state.disabled = True
            return
        if state.cma is None:
            # Every rank tried reading its peers' memory; all use it from now on, or none.
            state.cma = agreed == _WENT_WELL + _CAN_READ
        if not by_flags and ORDERED_STORES and state.peer_controls:
            # Every rank of the node mapped its peers' control blocks (that is what was
            # agreed): from the next operation on, the node synchronizes through them.
            state.flags = True

    # -- the fallback: all-reduce by point-to-point messages alone ----------------------------

    def _fall_back(self) -> Steps:
        """All-reduce `send` by point-to-point messages alone (every rank does the same)."""
        state = self.state
        ranks = tuple(range(state.group.size))
        yield from all_reduce_among(state.comm, ranks, self.rank, self.send, self.out, self.plan.datatype, self.ufunc)

    def _finish(self) -> None:
        self.finished = True
        self.steps = None
        self.wait = None
        self.infos = None
        self.leader_block = None
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

