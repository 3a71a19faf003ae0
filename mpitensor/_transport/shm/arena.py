"""This rank's shared memory: ``memfd`` blocks, leases of them as results, and peers' mappings."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .protocol import PID
from .settings import MAX_CACHED_BYTES, PAGE

__all__ = ["Arena", "Block", "Lease", "Mapping", "map_peer"]


_libc: Any = None


def _mapper() -> Any:
    """The C library's ``mmap`` and ``munmap`` (typed once)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


class Mapping:
    """A file's first `nbytes` mapped shared and writable, unmapped when the last array on it goes.

    Unlike ``mmap.mmap``, which keeps a duplicate of the file descriptor for as long as the
    mapping lives, it keeps none: a mapping needs no descriptor once made. So mapping a
    peer's blocks costs this rank no descriptors however many it keeps mapped, and its own
    blocks one each (the one peers open).

    Args:
        fd: the file (a ``memfd``).
        nbytes: how much of it to map (more than zero).

    Raises:
        OSError: ``mmap`` refused.
    """

    __slots__ = ("__array_interface__", "_munmap", "address", "nbytes")

    def __init__(self, fd: int, nbytes: int) -> None:
        libc = _mapper()
        address = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of {nbytes} bytes: {os.strerror(error)}")
        self.address = address
        self.nbytes = nbytes
        self._munmap = libc.munmap  # kept: module globals may be gone when the last array goes at exit
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self._munmap(self.address, self.nbytes)


class Block:
    """One ``memfd`` of this rank, mapped; peers map it by (pid, fd) and check the inode."""

    __slots__ = ("address", "descriptor", "fd", "id", "ino", "mem", "nbytes")

    def __init__(self, block_id: int, nbytes: int) -> None:
        fd = os.memfd_create(f"mpitensor-{block_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mem = np.asarray(Mapping(fd, nbytes))
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


class Lease:
    """Owns a result block while the caller holds the result; gives it back when dropped.

    NumPy makes it the base of the result and of every view of it (see `_core/pool.py`).
    """

    __slots__ = ("__array_interface__", "_arena", "_block")

    def __init__(self, arena: Arena, block: Block, shape: tuple[int, ...], dtype: np.dtype) -> None:
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


class Arena:
    """This rank's shared blocks of one group: handed out by size class, reused, capped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: OrderedDict[int, list[Block]] = OrderedDict()
        self._cached = 0
        self._next_id = 1
        self._closed = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The block size serving `nbytes`: a power of two of at least a page."""
        return max(PAGE, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> Block:
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
        return Block(block_id, size)

    def give_back(self, block: Block) -> None:
        """Return `block` for reuse (closing the least recently freed beyond the cap)."""
        dropped = []
        with self._lock:
            if self._closed:
                dropped.append(block)
            else:
                self._free.setdefault(block.nbytes, []).append(block)
                self._free.move_to_end(block.nbytes)
                self._cached += block.nbytes
                while self._cached > MAX_CACHED_BYTES:
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


def map_peer(group_rank: int, info: np.ndarray, which: int) -> np.ndarray:
    """Map the block a peer's descriptor names (its pid, then (id, fd, inode, length)).

    Raises:
        OSError: it cannot be opened, or the file there is not the block named.
    """
    fd, ino, nbytes = (int(v) for v in info[which + 1 : which + 4])
    path = f"/proc/{int(info[PID])}/fd/{fd}"
    handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(handle).st_ino != ino:
            raise OSError(f"{path} is not the shared block rank {group_rank} named")
        return np.asarray(Mapping(handle, nbytes))
    finally:
        os.close(handle)  # the mapping lives on without it

