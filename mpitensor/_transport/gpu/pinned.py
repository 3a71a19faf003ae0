"""Pooled page-locked ("pinned") host buffers, for staging GPU data through host memory.

Copies between a GPU and pinned memory run asynchronously on a stream and at full bus
speed; pinning memory (``cudaHostAlloc``) costs far more than a copy, so blocks are kept
and reused, never allocated per call.

A block lent out is a `PinnedBuffer`. It goes back to the pool when `release()` is called
(collectives do this as soon as the last GPU copy from it is queued) or, as a safety net,
when nothing refers to it or to its array any more. GPU work still reading or writing a
block is tracked by an event (`PinnedBuffer.after`); the pool lends a block again only once
that event is done, and allocates another block rather than wait.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..._core.pool import end_lease, leased_array, make_lease

__all__ = ["Allocator", "PinnedBlock", "PinnedBuffer", "PinnedPool", "pinned_pool"]

_PAGE = 4096


class Event(Protocol):
    """What the pool needs of a CUDA event (``cupy.cuda.Event`` has it)."""

    @property
    def done(self) -> bool:
        """True once the work before the event has completed."""

    def synchronize(self) -> None:
        """Block until the work before the event has completed."""


# An allocator takes a size in bytes and returns the address of that much pinned memory
# and the function that frees it (called with the address).
Allocator = Callable[[int], tuple[int, Callable[[int], None]]]


class PinnedBlock:
    """One allocation of pinned memory; frees it when garbage collected.

    Args:
        ptr: the address.
        nbytes: the size in bytes.
        free: frees the memory (called once, with `ptr`).
    """

    __slots__ = ("_free", "_memory", "nbytes", "pending", "ptr")

    def __init__(self, ptr: int, nbytes: int, free: Callable[[int], None]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self._free: Callable[[int], None] | None = free
        self.pending: Event | None = None  # GPU work that still uses the block
        self._memory: np.ndarray | None = None

    @property
    def memory(self) -> np.ndarray:
        """A writable uint8 array over the whole block (made once)."""
        if self._memory is None:
            self._memory = np.frombuffer((ctypes.c_ubyte * self.nbytes).from_address(self.ptr), np.uint8)
        return self._memory

    @property
    def ready(self) -> bool:
        """True when no GPU work uses the block any more."""
        pending = self.pending
        if pending is None:
            return True
        if pending.done:
            self.pending = None
            return True
        return False

    def __del__(self) -> None:
        free, self._free = self._free, None
        if free is None:
            return
        try:
            if self.pending is not None:
                # Freeing memory a copy still uses would corrupt it; wait for the copy.
                self.pending.synchronize()
            free(self.ptr)
        except Exception as exc:
            _warn_not_freed(self.nbytes, exc)


def _warn_not_freed(nbytes: int, exc: BaseException) -> None:
    """Say that a pinned block could not be freed (a CUDA error must not pass unseen)."""
    if sys.is_finalizing():
        # At interpreter exit CUDA may already be torn down; the OS reclaims the memory.
        return
    try:
        warnings.warn(
            f"a pinned staging block of {nbytes} bytes could not be freed and is leaked: "
            f"{type(exc).__name__}: {exc} (an earlier CUDA error may have left the device unusable)",
            ResourceWarning,
            stacklevel=3,
        )
    except Exception:  # a finalizer must not raise, and nothing else can report it
        pass


class PinnedBuffer:
    """A pinned block lent out, with a NumPy array over it.

    Build it with `PinnedPool.empty`. The array refers to the block, so the memory stays
    valid while any view of it lives; when the buffer and every view are gone, the block
    goes back to the pool by itself. After `release()` the pool may lend the block again:
    the array must not be used any more.

    Attributes:
        array: the NumPy array over the pinned memory.
    """

    __slots__ = ("_block", "_lease", "array")

    def __init__(self, pool: PinnedPool, block: PinnedBlock, shape: tuple[int, ...], dtype: np.dtype) -> None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._block = block
        self._lease = make_lease(block.memory, pool, block)
        self.array: np.ndarray = leased_array(self._lease, nbytes, shape, dtype)

    @property
    def ptr(self) -> int:
        """The address of the first byte."""
        return self._block.ptr

    @property
    def nbytes(self) -> int:
        """The size of the array in bytes."""
        return int(self.array.nbytes)

    def after(self, event: Event | None) -> None:
        """Record that GPU work uses the block until `event` (a copy queued on a stream).

        Args:
            event: recorded on the stream right after the last queued work that reads or
                writes the block; None when no GPU work uses it.
        """
        self._block.pending = event

    def release(self, event: Event | None = None) -> None:
        """Give the block back to the pool now (idempotent).

        Args:
            event: as for `after`: GPU work queued on the block ends at this event; the
                pool lends the block again only once it is done.
        """
        if event is not None:
            self._block.pending = event
        owner = end_lease(self._lease)
        if owner is not None:
            owner.give_back(self._block)


class PinnedPool:
    """A cache of pinned host blocks, keyed by size (rounded up to whole pages).

    Args:
        allocate: allocates pinned memory (default: ``cudaHostAlloc`` through CuPy,
            portable to every device of the process).
        max_cached_bytes: the most memory kept in blocks that are not lent out; beyond
            it, blocks of the size least recently returned are freed first.
    """

    def __init__(self, allocate: Allocator | None = None, max_cached_bytes: int = 1 << 30) -> None:
        self._allocate = allocate if allocate is not None else _cuda_host_alloc
        self.max_cached_bytes = max_cached_bytes
        self._free: OrderedDict[int, list[PinnedBlock]] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def block_size(nbytes: int) -> int:
        """The size of the block that holds `nbytes` (whole pages, at least one)."""
        return max(_PAGE, -(-nbytes // _PAGE) * _PAGE)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> PinnedBuffer:
        """Lend an uninitialized pinned array of `shape` and `dtype`.

        A cached block of the right size is reused if no GPU work still uses it;
        otherwise a new block is allocated.

        Args:
            shape: the array's shape.
            dtype: the array's dtype.

        Returns:
            The buffer; its `array` is the array.
        """
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        size = self.block_size(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        block = None
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                for i, candidate in enumerate(blocks):
                    if candidate.ready:
                        block = blocks.pop(i)
                        self._cached -= size
                        if not blocks:
                            del self._free[size]
                        break
            if block is None:
                self.misses += 1
            else:
                self.hits += 1
        if block is None:
            ptr, free = self._allocate(size)
            block = PinnedBlock(ptr, size, free)
        return PinnedBuffer(self, block, shape, dtype)

    def give_back(self, block: PinnedBlock) -> None:
        """Take `block` back into the cache, or free it beyond ``max_cached_bytes``.

        Its lease calls it when the last array over the block is gone, or `PinnedBuffer.release`
        does at once.

        Args:
            block: the block lent.
        """
        dropped: list[PinnedBlock] = []
        with self._lock:
            if block.nbytes > self.max_cached_bytes:
                dropped.append(block)
            else:
                self._free.setdefault(block.nbytes, []).append(block)
                self._free.move_to_end(block.nbytes)
                self._cached += block.nbytes
                while self._cached > self.max_cached_bytes:
                    size, blocks = next(iter(self._free.items()))
                    dropped.append(blocks.pop(0))
                    self._cached -= size
                    if not blocks:
                        del self._free[size]
        # Blocks are freed here, outside the lock (freeing may wait for a pending copy).
        del dropped

    def clear(self) -> None:
        """Free every cached block (blocks lent out are not affected)."""
        with self._lock:
            blocks = [b for bs in self._free.values() for b in bs]
            self._free.clear()
            self._cached = 0
        del blocks

    @property
    def cached_bytes(self) -> int:
        """Bytes held in blocks that are not lent out."""
        return self._cached

    def stats(self) -> dict[str, Any]:
        """Hits, misses and cached bytes, for benchmarks and tests."""
        return {"hits": self.hits, "misses": self.misses, "cached_bytes": self._cached}


def _cuda_host_alloc(nbytes: int) -> tuple[int, Callable[[int], None]]:
    from ..._core.backend import require_cupy

    runtime = require_cupy().cuda.runtime
    # Portable: usable from every device's context, whichever device is current.
    return runtime.hostAlloc(nbytes, runtime.hostAllocPortable), runtime.freeHost


_pool: PinnedPool | None = None
_pool_lock = threading.Lock()


def pinned_pool() -> PinnedPool:
    """The process's pool of pinned staging buffers (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PinnedPool()
        return _pool
