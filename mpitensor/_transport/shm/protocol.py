"""What the ranks of a node tell each other: message tags, descriptors and control-block fields."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from ..._core.mpi import MPI
from .settings import PAGE

# Tags of the point-to-point messages on the group's communicator (MPI guarantees tags up to
# 32767; nothing else sends point-to-point messages there). Node peers: descriptors (INFO),
# "my part went well" to the node leader (FLAG), the leader's answer once the result is in
# its block (AGREED), "I have copied it" (COPIED). Among the leaders (`exchange.py`): the
# halves of the reduce-scatter (SCATTER) and of the all-gather (GATHER), whole messages to
# and from a leader left over beyond a power of two (FOLD), and the leaders' flags (VOTE).
TAG_INFO, TAG_FLAG, TAG_AGREED, TAG_SCATTER, TAG_GATHER, TAG_COPIED, TAG_FOLD, TAG_VOTE = range(32700, 32708)

# MPI op name -> NumPy ufunc, for plans that name no ``combine`` (by name: importing this
# module must not import mpi4py.MPI, and MPI.Op objects are not hashable).
_UFUNC_NAMES = (("SUM", np.add), ("PROD", np.multiply), ("MAX", np.maximum), ("MIN", np.minimum),
                ("LOR", np.logical_or), ("LAND", np.logical_and))

# The descriptor each rank publishes per operation (int64 fields): its blocks, each as
# (id, fd, inode, length) starting at the field named.
OK, PID, RES_ID, CTL_ID, SEND = 0, 1, 2, 6, 10  # SEND: the input's address
INFO_LEN = 11
# The control block (int64 fields): sequence number of the last operation whose input this
# rank has published, of the last one whose reduction it has done, whether that went well;
# a node leader's: of the last one whose result is in its block, and what every rank of the
# group said (the agreement); a node peer's: of the last one whose result it has copied from
# its leader; and the published descriptor.
C_ARRIVE, C_DONE, C_DONE_OK, C_READY, C_READY_OK, C_COPIED, C_INFO = 0, 1, 2, 3, 4, 5, 8
CONTROL_BYTES = PAGE
# Stores become visible in program order and loads do not pass loads (x86-TSO): polling a
# peer's sequence number then reading what it wrote before it is safe without fences.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def ufunc_for(mpi_op: Any) -> Any:
    """The NumPy ufunc that reduces as predefined `mpi_op` does, or None."""
    for name, ufunc in _UFUNC_NAMES:
        if getattr(MPI, name) == mpi_op:
            return ufunc
    return None
