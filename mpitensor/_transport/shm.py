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
3. Hierarchical only: the node leaders all-reduce the node sums with point-to-point messages
   (each leader reduces one segment, in leader order, and sends it to the others), then the
   other ranks of each node copy the result from their leader's block.

Where the kernel lets a rank read its node peers' memory (``process_vm_readv``, "cross-memory
attach", as Open MPI's single-copy transfers use it: same user, and no Yama ptrace
restriction or seccomp filter in the way), step 1's copy is skipped: local rank k reads
slice k of each peer's input straight from the peer's own buffer, piece by piece into a
cache-sized buffer, which cuts a third of the memory traffic. The first operation of a
group tries it and every rank agrees whether it works; otherwise the copy stays.
``MPITENSOR_SHM_CMA=0`` turns it off.

Each element is reduced in exactly one place in one fixed order, so every rank gets the same
bits. Each rank's result is a block of its own shared memory, leased to the caller like
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

Ordering between ranks. The first operation of a group (and every operation of the
hierarchical scheme) exchanges small point-to-point messages on the group's communicator,
tested from `advance()` (point-to-point traffic never matches the collectives that the
engine posts on the same communicator, so no ordering between the two is needed, and no
communicator has to be created):

- each rank sends its block descriptors to its node peers after its copy-in (nobody reads a
  block before it is written);
- each rank sends "my part went well" to the group's first rank, which sends back whether
  all went well, after the reduction (nobody returns a result before every slice is in it,
  nor reuses a block someone still reads). Ranks that cannot map a peer's memory (other
  containers, no ``/proc``) say so there; every rank then computes that operation with
  point-to-point messages alone, and the group stops using shared memory (every rank
  decides this from the same values).

Once that first operation has mapped every rank's small *control* block, later operations of
a group whose ranks share one node synchronize through it instead, which costs a few memory
reads rather than MPI round trips: each rank writes its descriptor and then its sequence
number, and polls its peers' from `advance()`. That relies on stores becoming visible in
program order and loads not passing loads (x86's memory model; NumPy's large copies end
with a store fence), so other architectures keep the messages.

Operations of one group run one at a time in the group's data order, so messages of one
kind between two ranks arrive in operation order, and sequence numbers count the same on
every rank.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._core.mpi import MPI

if TYPE_CHECKING:
    from .._core.dtypes import ReducePlan
    from .._runtime.context import DistributedContext
    from .._runtime.engine import Group, Stepper

__all__ = ["SharedMemoryPost", "may_apply", "min_bytes", "node_layout", "shared_memory_post"]

# Below this, MPI's own all-reduce plus the direct path's per-call work was faster in every
# run of the benchmark (2 and 4 ranks, both MPIs, 256 KiB); from 512 KiB this path mostly wins.
_DEFAULT_MIN_BYTES = 512 << 10
# Reduce in pieces that stay in the core's cache, so that copying a reduced piece to the
# peers' result blocks reads it from cache instead of memory.
_PIECE_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE
_MAX_CACHED_BYTES = 512 << 20
# Peers' blocks stay mapped (least recently used dropped first) up to this many bytes: a
# block its owner has freed lives on while mapped here.
_MAX_PEER_MAP_BYTES = 1 << 30
# Tags of the point-to-point messages on the group's communicator (MPI guarantees tags up to
# 32767; nothing else sends point-to-point messages there).
_TAG_INFO, _TAG_FLAG, _TAG_AGREED, _TAG_SCATTER, _TAG_GATHER, _TAG_READY, _TAG_COPIED = range(32700, 32707)
_EXTRA_KEY = "shared_memory"

# MPI op -> NumPy ufunc, for plans that name no ``combine``. A list: MPI.Op objects are not hashable.
_UFUNCS: list[tuple[Any, Any]] = [
    (MPI.SUM, np.add),
    (MPI.PROD, np.multiply),
    (MPI.MAX, np.maximum),
    (MPI.MIN, np.minimum),
    (MPI.LOR, np.logical_or),
    (MPI.LAND, np.logical_and),
]

# The descriptor each rank publishes per operation (int64 fields): its blocks, each as
# (id, fd, inode, length) starting at the field named.
_OK, _PID, _RES_ID, _CTL_ID, _SEND = 0, 1, 2, 6, 10  # _SEND: the input's address
_INFO_LEN = 11
# The control block (int64 fields): sequence number of the last operation whose input this
# rank has published, of the last one whose reduction it has done, whether that went well,
# and the published descriptor.
_C_ARRIVE, _C_DONE, _C_DONE_OK, _C_INFO = 0, 1, 2, 8
_CONTROL_BYTES = _PAGE
# Stores become visible in program order and loads do not pass loads (x86-TSO): polling a
# peer's sequence number then reading what it wrote before it is safe without fences.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class SharedMemoryPost(NamedTuple):
    """What `shared_memory_post` hands the all-reduce.

    Attributes:
        out: the array the result will be written to (shape and dtype of `send`): a block of
            this rank's shared memory leased to the caller, valid for as long as it (or a
            view of it) is referenced; a pooled private array where shared memory could not
            be had (the operation then falls back to ``MPI_Iallreduce``).
        post: the `Op`'s ``post``: starts the operation and returns its `Stepper`.
    """

    out: np.ndarray
    post: Callable[[], Stepper]


_min_bytes: int | None = None


def min_bytes() -> int:
    """The message size from which the fast path is used when ``shared_memory`` is None.

    ``MPITENSOR_SHM_MIN_BYTES`` overrides the default (512 KiB); it is read here, and
    all-reduces use the value read last (the first all-reduce reads it).

    Raises:
        ValueError: the variable is set but not a non-negative integer.
    """
    global _min_bytes
    raw = os.environ.get("MPITENSOR_SHM_MIN_BYTES", "").strip()
    if not raw:
        value = _DEFAULT_MIN_BYTES
    else:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"MPITENSOR_SHM_MIN_BYTES must be a non-negative integer, got {raw!r}")
    _min_bytes = value
    return value


def may_apply(config: Any, nbytes: int) -> bool:
    """Whether a message of `nbytes` may take the fast path under `config` (by size alone).

    Args:
        config: the context's `DistributedConfig` (its ``shared_memory`` setting).
        nbytes: the message size in bytes.

    Returns:
        False when `shared_memory_post` would return None whatever the group and dtype.

    Raises:
        ValueError: ``MPITENSOR_SHM_MIN_BYTES`` is malformed (read on first use).
    """
    setting = config.shared_memory
    if setting is False or nbytes == 0:
        return False
    return setting is True or nbytes >= (_min_bytes if _min_bytes is not None else min_bytes())


def node_layout(ctx: DistributedContext, group: Group) -> tuple[tuple[int, ...], ...]:
    """The group's ranks (ranks in the group) per node, nodes ordered by their first rank.

    Ranks are on one node when they report the same host. ``MPITENSOR_SHM_NODE_SIZE=k``
    splits each host's ranks into pseudo-nodes of k consecutive ranks, which runs the
    hierarchical scheme on one machine (for tests).

    Args:
        ctx: the context (for every rank's host).
        group: the group.

    Returns:
        One tuple of group ranks per node.
    """
    hosts = ctx.hosts
    nodes: dict[str, list[int]] = {}
    for group_rank, member in enumerate(group.members):
        nodes.setdefault(hosts[member], []).append(group_rank)
    raw = os.environ.get("MPITENSOR_SHM_NODE_SIZE", "").strip()
    split = int(raw) if raw.isdigit() and int(raw) > 0 else 0
    layout: list[tuple[int, ...]] = []
    for ranks in nodes.values():
        if split:
            layout.extend(tuple(ranks[i : i + split]) for i in range(0, len(ranks), split))
        else:
            layout.append(tuple(ranks))
    return tuple(layout)


def _cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _ufunc_for(mpi_op: Any) -> Any:
    for candidate, ufunc in _UFUNCS:
        if candidate == mpi_op:
            return ufunc
    return None


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv: Any = None


def _process_vm_readv() -> Any:
    """The C library's ``process_vm_readv``, or None (not Linux, or turned off)."""
    global _readv
    if _readv is None:
        _readv = False
        if os.environ.get("MPITENSOR_SHM_CMA", "1").strip() != "0" and sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).process_vm_readv
            except (OSError, AttributeError):
                return None
            iovec = ctypes.POINTER(_Iovec)
            function.argtypes = [ctypes.c_int, iovec, ctypes.c_ulong, iovec, ctypes.c_ulong, ctypes.c_ulong]
            function.restype = ctypes.c_ssize_t
            _readv = function
    return _readv or None


class _Remote:
    """A slice of a node peer's input, read piece by piece with ``process_vm_readv``.

    Indexing it with a slice (as `_reduce_pieces` does) copies that range of the peer's
    memory into this rank's cache-sized buffer and returns a view of it.

    Args:
        readv: libc's ``process_vm_readv``.
        pid: the peer's process id.
        address: where the slice starts in the peer's memory.
        size: its length in elements.
        buffer: this rank's buffer (at least one piece long, of the right dtype).
    """

    __slots__ = ("_local", "_local_ref", "_remote", "_remote_ref", "address", "buffer", "itemsize", "pid", "readv",
                 "size")

    def __init__(self, readv: Any, pid: int, address: int, size: int, buffer: np.ndarray) -> None:
        self.readv = readv
        self.pid = pid
        self.address = address
        self.size = size
        self.itemsize = buffer.itemsize
        self.buffer = buffer
        self._local = _Iovec(buffer.ctypes.data, 0)
        self._remote = _Iovec(0, 0)
        self._local_ref = ctypes.byref(self._local)
        self._remote_ref = ctypes.byref(self._remote)

    def __getitem__(self, key: slice) -> np.ndarray:
        low, high = key.start, key.stop
        nbytes = (high - low) * self.itemsize
        self._local.iov_len = nbytes
        self._remote.iov_base = self.address + low * self.itemsize
        self._remote.iov_len = nbytes
        done = self.readv(self.pid, self._local_ref, 1, self._remote_ref, 1, 0)
        if done != nbytes:
            error = ctypes.get_errno()
            raise OSError(error, f"process_vm_readv from process {self.pid}: {os.strerror(error)}")
        return self.buffer[: high - low]


def _can_read(pid: int, address: int) -> bool:
    """Whether ``process_vm_readv`` may read a peer's memory (one byte of it)."""
    readv = _process_vm_readv()
    if readv is None or not address:
        return False
    probe = np.empty(1, np.uint8)
    try:
        _Remote(readv, pid, address, 1, probe)[0:1]
    except OSError:
        return False
    return True


def shared_memory_post(
    ctx: DistributedContext, group: Group, send: np.ndarray, plan: ReducePlan
) -> SharedMemoryPost | None:
    """Plan the shared-memory all-reduce of `send` on `group`, or None where it does not apply.

    Contract with the all-reduce: call it where the op is built, in the caller's thread (it
    only decides and takes memory; it communicates nothing). When it returns None, do what
    you would otherwise do. Otherwise use ``.out`` as the result array (instead of a pooled
    one) and ``.post`` as the `Op`'s ``post``: the engine calls it in the group's data order
    after the consistency check passed, and it returns a `Stepper` whose ``advance()``
    never blocks (it only tests requests and does the local copies and reductions that are
    due). When ``advance()`` has returned True, ``out`` holds the reduction of every rank's
    `send` with ``plan.combine`` (the bits ``plan.mpi_op`` gives), the same bits on every
    rank; the division of ``MEAN`` (``plan.divide``) is left to the caller's ``finish``, as
    for ``MPI_Iallreduce``. For float MAX/MIN, `send` holds the floats themselves, not the
    keys MPI would reduce (``plan.codec``): the result needs no decoding. `send` must stay
    alive and unchanged until then (the Op's ``keep`` and protections do that).

    The decision depends only on what every rank agrees on once the check has passed
    (size, dtype, op, group, config, hosts), so all ranks take the same path.

    It returns None when: ``config.shared_memory`` is False; the message is empty, or
    smaller than `min_bytes()` and ``shared_memory`` is None (True forces any size); the
    group has one rank, or no node holds two of its ranks; `send` is not a host array; the
    op is user-defined (MAX/MIN of complex numbers) or has no NumPy equivalent, or the dtype
    is not a plain number or bool (bfloat16 is not; its sums arrive as float32); the
    platform has no ``memfd``.

    Args:
        ctx: the context.
        group: the group the all-reduce runs on.
        send: the contiguous buffer to reduce, of dtype ``plan.work_dtype`` (the floats, for
            float MAX/MIN).
        plan: the reduce plan (MPI op and datatype).

    Returns:
        The result array and the post function, or None.
    """
    # Cheapest tests first: this runs on every all-reduce, small ones included.
    if not may_apply(ctx.config, send.nbytes):
        return None
    state = group.extra.get(_EXTRA_KEY)
    if state is None:
        state = _GroupState(group, node_layout(ctx, group))
        group.extra[_EXTRA_KEY] = state
    if not state.applies or not isinstance(send, np.ndarray):
        return None
    if send.dtype.kind not in "biufc" or not send.flags.c_contiguous:
        return None
    # User-defined MPI ops (MAX/MIN of complex numbers and of 16-byte long doubles) stay on
    # MPI's path.
    ufunc = plan.combine if plan.combine is not None else _ufunc_for(plan.mpi_op)
    if ufunc is None or not plan.mpi_op.is_predefined:
        return None
    out, block = state.lease_result(send.shape, send.dtype, ctx)
    # With a progress thread and a core to spare, the copies and reductions run there,
    # beside the program's compute; otherwise they start at once, in the call.
    start_now = state.oversubscribed or getattr(ctx.engine, "progress_thread", None) is None

    def post() -> Stepper:
        stepper = _AllReduce(state, send, out, block, ufunc, plan)
        state.enqueue(stepper)
        if start_now:
            stepper.advance()
        return stepper

    return SharedMemoryPost(out, post)


# -- this rank's shared memory -----------------------------------------------------------


class _Block:
    """One ``memfd`` of this rank, mapped; peers map it by (pid, fd) and check the inode."""

    __slots__ = ("address", "descriptor", "fd", "id", "ino", "mem", "nbytes")

    def __init__(self, block_id: int, nbytes: int) -> None:
        fd = os.memfd_create(f"mpitensor-{block_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mem = np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
        except BaseException:
            os.close(fd)
            raise
        self.address = self.mem.ctypes.data
        self.fd = fd
        self.id = block_id
        self.ino = os.fstat(fd).st_ino
        self.nbytes = nbytes
        self.descriptor = np.array(self.describe(), np.int64)

    def describe(self) -> tuple[int, int, int, int]:
        """(id, fd, inode, length): what a peer needs to map it."""
        return self.id, self.fd, self.ino, self.nbytes

    def close(self) -> None:
        """Close the descriptor; the memory stays mapped while arrays refer to it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Lease:
    """Owns a result block while the caller holds the result; gives it back when dropped.

    NumPy makes it the base of the result and of every view of it (see `_core/pool.py`).
    """

    __slots__ = ("__array_interface__", "_arena", "_block")

    def __init__(self, arena: _Arena, block: _Block, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._arena = arena
        self._block = block
        self.__array_interface__ = {
            "data": (block.address, False),
            "shape": shape,
            "typestr": dtype.str,
            "version": 3,
        }

    def __del__(self) -> None:
        self._arena.give_back(self._block)


class _Arena:
    """This rank's shared blocks of one group: handed out by size class, reused, capped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: OrderedDict[int, list[_Block]] = OrderedDict()
        self._cached = 0
        self._next_id = 1
        self._closed = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The block size serving `nbytes`: a power of two of at least a page."""
        return max(_PAGE, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> _Block:
        """A block of at least `nbytes` (reused when one is free).

        Raises:
            OSError: the memory could not be had.
        """
        size = self.size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                self._cached -= size
                return blocks.pop()
            block_id = self._next_id
            self._next_id += 1
        return _Block(block_id, size)

    def give_back(self, block: _Block) -> None:
        """Return `block` for reuse (closing the least recently freed beyond the cap)."""
        dropped = []
        with self._lock:
            if self._closed:
                dropped.append(block)
            else:
                self._free.setdefault(block.nbytes, []).append(block)
                self._free.move_to_end(block.nbytes)
                self._cached += block.nbytes
                while self._cached > _MAX_CACHED_BYTES:
                    size, blocks = next(iter(self._free.items()))
                    dropped.append(blocks.pop(0))
                    self._cached -= size
                    if not blocks:
                        del self._free[size]
        for old in dropped:
            old.close()

    def close(self) -> None:
        """Close every free block; blocks still leased close when given back."""
        with self._lock:
            self._closed = True
            blocks = [b for bs in self._free.values() for b in bs]
            self._free.clear()
            self._cached = 0
        for block in blocks:
            block.close()


# -- a group's state -----------------------------------------------------------------------


class _GroupState:
    """What the fast path keeps per group (in ``group.extra``; freed with the context).

    Args:
        group: the group.
        layout: its ranks per node (`node_layout`); the fast path applies when a node
            holds two of them.
    """

    def __init__(self, group: Group, layout: tuple[tuple[int, ...], ...]) -> None:
        self.group = group
        self.layout = layout
        self.applies = group.size > 1 and any(len(node) > 1 for node in layout) and hasattr(os, "memfd_create")
        rank = group.rank
        self.node = next((node for node in layout if rank in node), (rank,))
        self.local_rank = self.node.index(rank)
        self.leaders = tuple(node[0] for node in layout)
        self.flat = len(layout) == 1
        self.arena = _Arena()
        self.comm = group.comm
        self.active: deque[_AllReduce] = deque()
        self.seq = 0  # operations that have taken their turn
        self.disabled = False
        self.failed_local = False
        self.peer_maps: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.peer_bytes = 0
        self.pid = os.getpid()
        self.control: _Block | None = None
        self.own_control: np.ndarray | None = None
        self.peer_controls: list[np.ndarray] = []  # the node peers', in rank order
        self.flags = False  # synchronize through the control blocks
        self.cma: bool | None = None  # read peers' inputs directly (None: not tried yet)
        self.cma_buffers: dict[tuple[int, str], np.ndarray] = {}
        # Reused by every operation (they run one at a time): the node's descriptors, and
        # the waits on the peers' control blocks.
        self.rows = np.zeros((group.size, _INFO_LEN), np.int64)
        self.node_rows: Any = slice(None) if self.flat else list(self.node)
        self.oversubscribed = len(self.node) >= _cpu_count()  # no core left for another thread
        self.arrived = _FlagWait([], _C_ARRIVE, 0, len(self.node) > _cpu_count())
        self.done = _FlagWait([], _C_DONE, 0, len(self.node) > _cpu_count())

    def lease_result(
        self, shape: tuple[int, ...], dtype: np.dtype, ctx: DistributedContext
    ) -> tuple[np.ndarray, _Block | None]:
        """The result array of a new operation, in shared memory when possible."""
        if not self.failed_local:
            try:
                block = self.arena.take(math.prod(shape) * dtype.itemsize)
            except OSError:
                self.failed_local = True
            else:
                return np.asarray(_Lease(self.arena, block, tuple(shape), dtype)), block
        return ctx.pool.empty(shape, dtype), None

    def cma_buffer(self, index: int, dtype: np.dtype) -> np.ndarray:
        """This rank's piece-sized buffer for reading node peer number `index`."""
        key = (index, dtype.str)
        buffer = self.cma_buffers.get(key)
        if buffer is None:
            buffer = self.cma_buffers[key] = np.empty(max(1, _PIECE_BYTES // dtype.itemsize), dtype)
        return buffer

    def control_block(self) -> _Block | None:
        """This rank's control block (created on first use), or None without memory."""
        if self.control is None and not self.failed_local:
            try:
                self.control = _Block(0, _CONTROL_BYTES)
            except OSError:
                self.failed_local = True
                return None
            self.own_control = self.control.mem.view(np.int64)
            self.own_control[:] = 0
        return self.control

    def enqueue(self, op: _AllReduce) -> None:
        """Queue `op` behind the group's operations in flight (started in data order)."""
        self.active.append(op)

    def peer_block(self, group_rank: int, info: np.ndarray, which: int) -> np.ndarray:
        """The peer's block named in its descriptor `info`, mapped (cached by block id).

        Args:
            group_rank: the peer's rank in the group.
            info: the peer's descriptor.
            which: where the block's fields start (``_RES_ID``).

        Raises:
            OSError: the block cannot be opened or is not the one named.
        """
        key = (group_rank, int(info[which]))
        mem = self.peer_maps.get(key)
        if mem is not None:
            self.peer_maps.move_to_end(key)
            return mem
        mem = _map_peer(group_rank, info, which)
        self.peer_maps[key] = mem
        self.peer_bytes += mem.nbytes
        while self.peer_bytes > _MAX_PEER_MAP_BYTES and len(self.peer_maps) > 1:
            self.peer_bytes -= self.peer_maps.popitem(last=False)[1].nbytes
        return mem

    def map_controls(self, infos: np.ndarray) -> None:
        """Map the node peers' control blocks (once).

        Raises:
            OSError: a control block cannot be opened.
        """
        if not self.peer_controls:
            self.peer_controls = [
                _map_peer(r, infos[r], _CTL_ID).view(np.int64) for r in self.node if r != self.group.rank
            ]
            self.arrived.controls = self.done.controls = self.peer_controls

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


def _map_peer(group_rank: int, info: np.ndarray, which: int) -> np.ndarray:
    """Map the block a peer's descriptor names (its pid, then (id, fd, inode, length)).

    Raises:
        OSError: it cannot be opened, or the file there is not the block named.
    """
    fd, ino, nbytes = (int(v) for v in info[which + 1 : which + 4])
    path = f"/proc/{int(info[_PID])}/fd/{fd}"
    handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(handle).st_ino != ino:
            raise OSError(f"{path} is not the shared block rank {group_rank} named")
        return np.frombuffer(mmap.mmap(handle, nbytes), np.uint8)
    finally:
        os.close(handle)


# -- the operation --------------------------------------------------------------------------

# The agreement's values (see `_AllReduce.flag`).
_WENT_WELL, _CAN_READ = 2, 1

# Stages of `_AllReduce`, in order.
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


def _bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    return count * index // parts, count * (index + 1) // parts


class _FlagWait:
    """A wait on the node peers' control blocks: complete once each shows `seq` at `field`.

    It quacks like an MPI request (``Test()``), so `_AllReduce.advance` waits on either.
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
            os.sched_yield()
        return False


class _AllReduce:
    """One shared-memory all-reduce, moved along by `advance()` (a `Stepper`)."""

    def __init__(
        self,
        state: _GroupState,
        send: np.ndarray,
        out: np.ndarray,
        block: _Block | None,
        ufunc: Any,
        plan: ReducePlan,
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
            control[_C_INFO + _OK] = block is not None
            if block is not None:
                control[_C_INFO + _RES_ID : _C_INFO + _RES_ID + 4] = block.descriptor
            control[_C_INFO + _SEND] = self.send_address
            control[_C_ARRIVE] = self.seq
            state.arrived.seq = self.seq
            self.request = state.arrived
            return
        infos = state.rows
        infos[:] = 0
        info = infos[self.rank]
        info[_PID] = state.pid
        info[_OK] = block is not None
        info[_SEND] = self.send_address
        if block is not None:
            info[_RES_ID : _RES_ID + 4] = block.descriptor
            if state.flat:
                control = state.control_block()
                if control is not None:
                    info[_CTL_ID : _CTL_ID + 4] = control.descriptor
                    state.own_control[_C_INFO : _C_INFO + _INFO_LEN] = info  # type: ignore[index]
        self.infos = infos
        comm = state.comm
        requests = []
        for peer in self.node:
            if peer != self.rank:
                requests.append(comm.Irecv(infos[peer], peer, _TAG_INFO))
                requests.append(comm.Isend(info, peer, _TAG_INFO))
        self.requests = requests

    def _copy_in(self) -> None:
        """Everything but the slice this rank reduces itself (peers read only theirs)."""
        low, high = _bounds(self.send.size, len(self.node), self.state.local_rank)
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
            rows[group_rank] = source[_C_INFO : _C_INFO + _INFO_LEN]  # type: ignore[index]
        self.infos = rows
        return rows

    def _reduce_locally(self) -> None:
        """Reduce this rank's slice over its node; start the agreement (stage _AGREE)."""
        state = self.state
        infos = self._gathered()
        node = state.node_rows
        if not infos[node, _OK].all():
            # A node peer has no shared memory: say so; every rank will fall back.
            self.flag[0] = 0
        else:
            try:
                if state.flat and not self.flags and infos[node, _CTL_ID + 3].all():
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
            control[_C_DONE_OK] = self.flag[0]
            control[_C_DONE] = self.seq
            state.done.seq = self.seq
            self.request = state.done
            return
        comm, size = state.comm, state.group.size
        if self.rank == 0:
            # The group's first rank collects every flag, then answers with their minimum.
            self.flags_in = np.ones(size, np.int64)
            self.requests = [comm.Irecv(self.flags_in[r : r + 1], r, _TAG_FLAG) for r in range(1, size)]
        else:
            self.requests = [comm.Isend(self.flag, 0, _TAG_FLAG), comm.Irecv(self.agreed, 0, _TAG_AGREED)]

    def _probe(self, infos: np.ndarray) -> bool:
        """Whether this rank may read every node peer's memory directly."""
        return all(
            _can_read(int(infos[peer, _PID]), int(infos[peer, _SEND])) for peer in self.node if peer != self.rank
        )

    def _send_agreement(self) -> None:
        assert self.flags_in is not None
        self.flags_in[0] = self.flag[0]
        self.agreed[0] = self.flags_in.min()
        comm = self.state.comm
        self._messages(_AGREE_SEND, [comm.Isend(self.agreed, r, _TAG_AGREED) for r in range(1, self.state.group.size)])

    def _agreed(self) -> None:
        state = self.state
        agreed = int(self.agreed[0])
        if self.flags:
            agreed = min([int(self.flag[0]), *(int(c[_C_DONE_OK]) for c in state.peer_controls)])
        if agreed < _WENT_WELL:
            state.disabled = True
            self._fall_back()
            return
        if state.cma is None:
            # Every rank tried reading its peers' memory; all use it from now on, or none.
            state.cma = agreed == _WENT_WELL + _CAN_READ
        if state.flat:
            if not self.flags and _ORDERED_STORES and state.peer_controls:
                # Every rank mapped every control block (that is what was agreed): from
                # the next operation on, all synchronize through them.
                state.flags = True
            self._finish()
        elif self.rank == self.node[0]:
            self._exchange_scatter(state.leaders, self.out, _SCATTER)
        else:
            self._messages(_READY, [state.comm.Irecv(self.flag, self.node[0], _TAG_READY)])

    def _array(self, mem: np.ndarray) -> np.ndarray:
        return mem[: self.send.nbytes].view(self.send.dtype)

    def _reduce_slice(self, infos: np.ndarray) -> None:
        state = self.state
        node = self.node
        low, high = _bounds(self.send.size, len(node), state.local_rank)
        sources: list[Any] = []
        readv = _process_vm_readv() if state.cma else None
        for index, group_rank in enumerate(node):
            if group_rank == self.rank:
                sources.append(self.send[low:high])
            elif readv is not None:
                info = infos[group_rank]
                address = int(info[_SEND]) + low * self.send.itemsize
                buffer = state.cma_buffer(index, self.send.dtype)
                sources.append(_Remote(readv, int(info[_PID]), address, high - low, buffer))
            else:
                block = state.peer_block(group_rank, infos[group_rank], _RES_ID)
                sources.append(self._array(block)[low:high])
        if state.flat:
            dests = [self.out[low:high]]
            for group_rank in node:
                if group_rank != self.rank:
                    dests.append(self._array(state.peer_block(group_rank, infos[group_rank], _RES_ID))[low:high])
        elif self.rank == node[0]:
            dests = [self.out[low:high]]
        else:
            leader = node[0]
            dests = [self._array(state.peer_block(leader, infos[leader], _RES_ID))[low:high]]
        _reduce_pieces(self.ufunc, sources, dests)

    # -- between nodes, and the fallback: all-reduce by point-to-point messages ----------------

    def _exchange_scatter(self, ranks: tuple[int, ...], source: np.ndarray, stage: int) -> None:
        """Send each of `ranks` its segment of `source`; receive this rank's (then gather).

        Segment i of the message belongs to ``ranks[i]``, which reduces it in the order of
        `ranks`; `source` is this rank's contribution (its node's sum, or its input).
        """
        comm, datatype = self.state.comm, self.plan.datatype
        me = ranks.index(self.rank)
        count = self.out.size
        low, high = _bounds(count, len(ranks), me)
        dtype = self.out.dtype
        self.scratch = [source[low:high] if peer == self.rank else np.empty(high - low, dtype) for peer in ranks]
        self.in_place = source is self.out
        requests = []
        for index, peer in enumerate(ranks):
            if peer == self.rank:
                continue
            requests.append(comm.Irecv([self.scratch[index], datatype], peer, _TAG_SCATTER))
            seg_low, seg_high = _bounds(count, len(ranks), index)
            requests.append(comm.Isend([source[seg_low:seg_high], datatype], peer, _TAG_SCATTER))
        self._messages(stage, requests)

    def _exchange_gather(self, ranks: tuple[int, ...], stage: int) -> None:
        """Reduce this rank's segment in the order of `ranks`, and share it with them."""
        comm, datatype = self.state.comm, self.plan.datatype
        me = ranks.index(self.rank)
        count = self.out.size
        low, high = _bounds(count, len(ranks), me)
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
            seg_low, seg_high = _bounds(count, len(ranks), index)
            requests.append(comm.Irecv([self.out[seg_low:seg_high], datatype], peer, _TAG_GATHER))
            requests.append(comm.Isend([mine, datatype], peer, _TAG_GATHER))
        self.scratch = []
        self._messages(stage, requests)

    def _release_node(self) -> None:
        """The leader has the result: its node's other ranks may copy it (stage _COPIED)."""
        comm = self.state.comm
        requests = []
        copied = np.empty(len(self.node), np.int64)
        for index, peer in enumerate(self.node[1:]):
            requests.append(comm.Isend(self.flag, peer, _TAG_READY))
            requests.append(comm.Irecv(copied[index : index + 1], peer, _TAG_COPIED))
        self.scratch = [copied]
        self._messages(_COPIED, requests)

    def _copy_from_leader(self) -> None:
        """Copy the result from the leader's block, and tell it (stage _COPIED)."""
        leader = self.node[0]
        assert self.infos is not None
        source = self._array(self.state.peer_block(leader, self.infos[leader], _RES_ID))
        np.copyto(self.out, source)
        self._messages(_COPIED, [self.state.comm.Isend(self.flag, leader, _TAG_COPIED)])

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


def _reduce_pieces(ufunc: Any, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray]) -> None:
    """``dests[i][:] = sources[0] op sources[1] op ...`` (in that order), piece by piece.

    The first destination receives the reduction; the others get a copy of each piece
    while it is still in cache. The first destination may be the first source (reduced in
    place), and the others may be sources: a piece is copied there only after it is reduced.
    """
    count = sources[0].size
    if count == 0:
        return
    step = max(1, _PIECE_BYTES // sources[0].itemsize)
    first = dests[0]
    rest = dests[1:]
    for low in range(0, count, step):
        high = min(count, low + step)
        target = first[low:high]
        if len(sources) == 1:
            np.copyto(target, sources[0][low:high])
        else:
            ufunc(sources[0][low:high], sources[1][low:high], out=target)
            for source in sources[2:]:
                ufunc(target, source[low:high], out=target)
        for dest in rest:
            np.copyto(dest[low:high], target)
