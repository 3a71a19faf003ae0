"""Pooled host buffers, so that collectives do not pay for fresh memory on every call.

A fresh large array costs a page fault per 4 KiB page the first time it is written, which
at 1 MiB costs more than the all-reduce itself. The pool hands out arrays whose memory
comes from earlier, already-touched blocks. An array handed out stays valid for as long as
anything refers to it (views included); its block returns to the pool only when the last
reference is gone, so a result the user keeps is never reused behind their back.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["HostPool", "Lease", "Private", "end_lease", "leased_array", "make_lease", "size_class"]


class Lease(np.ndarray):
    """A view of one lent block; its end gives the block back to its owner.

    An ndarray subclass, because NumPy stops collapsing chains of views at a subclass: it
    stays the base of the array handed out and of every view of it, so it dies (and the
    block returns) only when the last of them is gone. The arrays handed out are plain
    ndarrays over memory exposed by the buffer protocol (an ndarray or a ctypes array), so
    NumPy lets their write flag be turned off and on again (collectives protect their
    inputs that way); arrays built from an ``__array_interface__`` object would refuse to
    become writable again.

    Attributes:
        owner: what the block goes back to, through ``owner.give_back(token)``; set on the
            lease itself only (views of it have neither attribute).
        token: what identifies the block to its owner.
    """

    def __del__(self) -> None:
        owner = self.__dict__.get("owner")  # only the lease itself, not views of it
        if owner is not None:
            owner.give_back(self.__dict__["token"])


class Private(np.ndarray):
    """The base of a view of memory that no one but mpitensor writes while it is sent.

    A copy-on-write clone of another library's tensor (see `_core.interop`): its owner
    writes to fresh memory of its own, so, like NumPy's and the pool's memory, the view is
    protected, not copied (`protect.foreign` is False for it). The view handed out is a plain
    ndarray whose base is the `Private` array (NumPy keeps a base of another type).
    """


def make_lease(memory: np.ndarray, owner: Any, token: Any) -> Lease:
    """A lease over `memory` (a writable uint8 ndarray over one block, made once per block).

    When the lease and every array made from it are gone, ``owner.give_back(token)`` is
    called; `end_lease` first cancels that (for owners that take blocks back explicitly).
    """
    lease = memory.view(Lease)
    lease.owner = owner
    lease.token = token
    return lease


def end_lease(lease: Lease) -> Any:
    """Cancel the give-back at `lease`'s end, for an owner that takes its block back at once.

    Args:
        lease: a lease from `make_lease`.

    Returns:
        The lease's owner, which the caller then gives the block back to
        (``owner.give_back(token)``); None if the lease was ended already.
    """
    return lease.__dict__.pop("owner", None)


def leased_array(lease: Lease, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A plain ndarray of `shape` and `dtype` over the first `nbytes` of `lease`."""
    # NumPy collapses a new view's chain of bases while the next base has the view's own
    # type: slice the Lease itself (a Lease slice keeps the lease as its base), then view
    # that as a plain ndarray (whose base stops at the Lease slice). Viewing the lease as
    # a plain ndarray first would collapse straight to the block and lose the lease.
    return np.asarray(lease[:nbytes]).view(dtype).reshape(shape)


_new_array = np.ndarray.__new__


_ALIGNMENT = 64


def _new_block(size: int) -> Any:
    """`size` bytes of NumPy-allocated memory, 64-byte aligned, exposed through a ctypes array.

    NumPy's allocator, because MPI reduced into it up to 1.5x faster than into an mmap,
    a bytearray or a ctypes allocation of the same size (16 MiB on 2 ranks: Open MPI for
    all three, MPICH for the mmap); a ctypes array over it, because the lease made on it
    must not have an ndarray as its base (see `Lease`). The array keeps the memory alive.
    Aligned to 64 bytes, because JAX takes a host buffer without a copy only so aligned
    (the C allocator promises 16), and a result over a pooled block is handed to JAX.
    """
    memory = np.empty(size + _ALIGNMENT - 1, np.uint8)
    offset = -memory.ctypes.data % _ALIGNMENT
    block = (ctypes.c_char * size).from_address(memory.ctypes.data + offset)
    block.memory = memory
    return block


def size_class(nbytes: int) -> int:
    """The block size that serves a request of `nbytes`: quarter steps of each power of two.

    Requests of many different sizes then share a few block sizes (at most 25% unused), so
    the blocks of earlier calls serve later ones instead of piling up in the cache.
    """
    if nbytes <= 4:
        return nbytes
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return -(-nbytes // step) * step


class HostPool:
    """A cache of host memory blocks, by size class (`size_class`).

    Args:
        min_bytes: requests smaller than this get plain ``numpy.empty``. Below the C
            allocator's default threshold for mapping fresh memory (128 KiB), NumPy's
            allocations come from the heap, whose pages are already touched: 64 KiB costs
            0.5 us there against 2.5 us through the pool. Larger ones may map fresh pages
            and fault them in on every call: served so, the fused all-reduce's 1 MiB
            buckets took 4x the pool's time per call.
        max_cached_bytes: the most memory kept in free blocks; the least recently freed
            blocks are dropped beyond it.
    """

    def __init__(self, min_bytes: int = 128 << 10, max_cached_bytes: int = 256 << 20) -> None:
        self.min_bytes = min_bytes
        self.max_cached_bytes = max_cached_bytes
        self._free: OrderedDict[int, list[Any]] = OrderedDict()  # size -> free blocks
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array of `shape` and `dtype`, from the pool when large enough."""
        # math.prod, not numpy.prod: this runs on every collective, and numpy.prod of a
        # tuple costs about 2 us.
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or nbytes == 0:
            return np.empty(shape, dtype)
        size = size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                block = blocks.pop()
                self._cached -= size
                self.hits += 1
            else:
                block = None
                self.misses += 1
        if block is None:
            block = _new_block(size)
        # The lease is made straight over the block's memory, in the shape asked for. The
        # block is not an ndarray, so the plain view handed out keeps the lease as its base
        # (see `Lease`), in two C calls where `make_lease` and `leased_array` need five.
        lease = _new_array(Lease, shape, dtype, block)
        lease.owner = self
        lease.token = block
        return lease.view(np.ndarray)

    def give_back(self, block: Any) -> None:
        """Take `block` back into the cache (its `Lease` calls it when the lease ends).

        Args:
            block: the block lent (the lease's ``token``).
        """
        nbytes = len(block)
        with self._lock:
            if nbytes > self.max_cached_bytes:
                return
            self._free.setdefault(nbytes, []).append(block)
            self._free.move_to_end(nbytes)
            self._cached += nbytes
            while self._cached > self.max_cached_bytes:
                size, blocks = next(iter(self._free.items()))
                blocks.pop(0)
                self._cached -= size
                if not blocks:
                    del self._free[size]

    def clear(self) -> None:
        """Drop every free block."""
        with self._lock:
            self._free.clear()
            self._cached = 0

    @property
    def cached_bytes(self) -> int:
        """Bytes held in free blocks."""
        return self._cached

    def stats(self) -> dict[str, Any]:
        """Hits, misses and cached bytes, for benchmarks and tests."""
        return {"hits": self.hits, "misses": self.misses, "cached_bytes": self._cached}
