"""Reading a node peer's memory directly: ``process_vm_readv`` ("cross-memory attach")."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import numpy as np

__all__ = ["Remote", "can_read", "process_vm_readv"]


class Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv: Any = None


def process_vm_readv() -> Any:
    """The C library's ``process_vm_readv``, or None (not Linux, or turned off)."""
    global _readv
    if _readv is None:
        _readv = False
        if os.environ.get("MPITENSOR_SHM_CMA", "1").strip() != "0" and sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).process_vm_readv
            except (OSError, AttributeError):
                return None
            iovec = ctypes.POINTER(Iovec)
            function.argtypes = [ctypes.c_int, iovec, ctypes.c_ulong, iovec, ctypes.c_ulong, ctypes.c_ulong]
            function.restype = ctypes.c_ssize_t
            _readv = function
    return _readv or None


class Remote:
    """A slice of a node peer's input, read piece by piece with ``process_vm_readv``.

    Indexing it with a slice (as `reduce_pieces` does) copies that range of the peer's
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
        self._local = Iovec(buffer.ctypes.data, 0)
        self._remote = Iovec(0, 0)
        self._local_ref = ctypes.byref(self._local)
        self._remote_ref = ctypes.byref(self._remote)

    def aim(self, pid: int, address: int, size: int) -> Remote:
        """Read from another slice from now on (a kept reader's next operation); returns itself.

        Args:
            pid: the peer's process id.
            address: where the slice starts in its memory.
            size: its length in elements.
        """
        self.pid = pid
        self.address = address
        self.size = size
        return self

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


def can_read(pid: int, address: int) -> bool:
    """Whether ``process_vm_readv`` may read a peer's memory (one byte of it)."""
    readv = process_vm_readv()
    if readv is None or not address:
        return False
    probe = np.empty(1, np.uint8)
    try:
        Remote(readv, pid, address, 1, probe)[0:1]
    except OSError:
        return False
    return True

