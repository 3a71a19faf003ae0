"""Pooled host buffers, so that collectives do not pay for fresh memory on every call.

A fresh large array costs a page fault per 4 KiB page the first time it is written, which
at 1 MiB costs more than the all-reduce itself. The pool hands out arrays whose memory
comes from earlier, already-touched blocks. An array handed out stays valid for as long as
anything refers to it (views included); its block returns to the pool only when the last
reference is gone, so a result the user keeps is never reused behind their back.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["HostPool", "size_class"]


class _Lease:
    """The owner of one pooled block while it is out; arrays made from it refer to it.

    Its ``__array_interface__`` describes the array handed out (shape and dtype), so one
    ``numpy.asarray`` builds it; NumPy makes the lease the base of that array and of every
    view of it, so the block comes back only when the last of them is gone.
    """

    __slots__ = ("__array_interface__", "_block", "_pool")

    def __init__(self, pool: HostPool, block: tuple[np.ndarray, int], interface: dict[str, Any]) -> None:
        self._pool = pool
        self._block = block
        self.__array_interface__ = interface

    def __del__(self) -> None:
        pool = self._pool
        if pool is not None:
            pool._give_back(self._block)


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
        min_bytes: requests smaller than this get plain ``numpy.empty`` (cheaper there).
        max_cached_bytes: the most memory kept in free blocks; the least recently freed
            blocks are dropped beyond it.
    """

    def __init__(self, min_bytes: int = 64 << 10, max_cached_bytes: int = 256 << 20) -> None:
        self.min_bytes = min_bytes
        self.max_cached_bytes = max_cached_bytes
        # size -> free blocks, each (array, its address)
        self._free: OrderedDict[int, list[tuple[np.ndarray, int]]] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array of `shape` and `dtype`, from the pool when large enough."""
        # math.prod, not numpy.prod: this runs on every collective, and numpy.prod of a
        # tuple costs about 2 us.
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
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
            array = np.empty(size, np.uint8)
            block = (array, array.ctypes.data)
        address = block[1]
        if dtype.kind in "biufc":
            # Plain numbers: one array-interface read builds the final array.
            interface = {"data": (address, False), "shape": tuple(shape), "typestr": dtype.str, "version": 3}
            return np.asarray(_Lease(self, block, interface))
        # Other dtypes (bfloat16, ...) have no faithful typestr: hand out bytes and view them.
        interface = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        raw: np.ndarray = np.asarray(_Lease(self, block, interface))
        return raw.view(dtype).reshape(shape)

    def _give_back(self, block: tuple[np.ndarray, int]) -> None:
        nbytes = block[0].nbytes
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
