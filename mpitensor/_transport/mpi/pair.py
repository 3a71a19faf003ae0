"""Two ranks of one node that exchange a held all-reduce's inputs through shared memory.

A held all-reduce of 2 ranks whose core is contested moves its data in one exchange
(`all_reduce.exchange_once`). Through MPI, each rank then waits for the peer's message in
MPI's loop, which can only pause briefly and look again: while the peer waits for a core, the
rank wakes every few microseconds and spends CPU time its own computation then lacks. Where
both ranks run on one node, the exchange goes through a segment both map instead, and a rank
whose peer's input is not there yet sleeps in the kernel (a futex) until the peer wrote it, as
gloo's ranks sleep in a socket's receive (`_core/native/pair.c`; the compiled held lane uses
the same pair).

The first such call of a group sets the pair up: both ranks are in it (their check agreed
on the one exchange), so they can talk. Rank 0 creates the segment (a memfd), rank 1 maps it
through ``/proc/<pid>/fd/<fd>``; a token in its header, and the inode rank 0 then finds behind
rank 1's descriptor, show both mapped the same one. Where that fails (another node, another
container, no ``/proc``, no compiled module or ``MPITENSOR_NATIVE=0``, too many pairs) both
know it and keep MPI's exchange for the group. A call larger than the segment's slots sets up
a larger one; beyond ``MAX_BYTES`` the copies cost more than the waits, and MPI moves it.
The pair is forgotten when the group's communicator is freed (`forget_pair`).
``MPITENSOR_PAIR=0`` keeps MPI's exchange (a rank where it is set says so in the set-up, so
both keep it).
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import numpy as np

from ..._core.config import compiled_parts_off
from ..._core.idle import contested
from ..._core.mpi import MPI

try:
    from ..._core import _pair
except ImportError:  # built without a C compiler: MPI's exchange only
    _pair = None
if compiled_parts_off():  # MPITENSOR_NATIVE=0
    _pair = None

__all__ = [
    "PAIR_TAG", "doze_for_check", "exchange_through_pair", "forget_pair", "pair_api_address", "pairs_built",
    "ring_for_check", "through_pair",
]

# The tag of the set-up's messages, beside EXCHANGE_TAG.
PAIR_TAG = 32_711
# The smallest slot a pair makes (a later, larger call sets up a larger pair).
_SMALLEST_SLOT = 1 << 16
# A late check's sleep on the peer's count of checks lasts at most this long (a check posted
# by a path that does not count it is then found by MPI's test after it).
DOZE_NS = 500_000
_COUNT_MASK = 0xFFFF_FFFF  # the counts are 32-bit words that wrap

# The communicator handles whose pairs are set up (a check's post looks here first), and those
# whose ranks found they cannot share one (kept here too: the compiled registry may be full).
_live: set[int] = set()
_refused: set[int] = set()


def pairs_built() -> bool:
    """Whether the pairs' compiled module is built and in use (not under ``MPITENSOR_NATIVE=0``)."""
    return _pair is not None


def pair_api_address() -> int:
    """The address of the pairs' C interface (``pair.h``) for the compiled lane; 0 where it was not built."""
    return 0 if _pair is None else _pair.api_address()


def through_pair(comm: Any, nbytes: int) -> bool:
    """Whether this call's one exchange of `nbytes` goes through the shared pair of 2-rank `comm`.

    Both ranks call it in the same call (their check agreed on the one exchange), and both get
    the same answer: where no pair carries `nbytes` yet, they set one up now, together.

    Raises:
        MPI.Exception: MPI failed the set-up's messages.
    """
    if _pair is None:
        return False
    handle = comm.handle
    if handle in _refused:
        return False
    state = _pair.state(handle, nbytes)
    if state == 0:
        state = 1 if _set_up(comm, handle, nbytes) else -1
    return state > 0


def _set_up(comm: Any, handle: int, nbytes: int) -> bool:
    me = comm.Get_rank()
    peer = 1 - me
    capacity = max(_SMALLEST_SLOT, 1 << (nbytes - 1).bit_length())
    size = _pair.HEADER_BYTES + 4 * capacity
    fd, address = -1, None
    token = secrets.randbits(64)
    wanted = os.environ.get("MPITENSOR_PAIR", "1") != "0"
    if me == 0 and wanted:
        try:
            fd, address = _pair.create(size, token)
        except OSError:
            fd = -1

    def swap(value: Any) -> Any:
        return comm.sendrecv(value, dest=peer, sendtag=PAIR_TAG, source=peer, recvtag=PAIR_TAG)

    host = socket.gethostname()
    theirs = swap((host, os.getpid(), fd, token))
    peer_pid = theirs[1]
    held = -1  # rank 1's descriptor of the segment, kept open until rank 0 has looked at it
    if me == 1 and wanted and theirs[0] == host and theirs[2] >= 0:
        address = _pair.attach(theirs[1], theirs[2], size, theirs[3]) or None
        held = _open_quietly(f"/proc/{theirs[1]}/fd/{theirs[2]}") if address is not None else -1
    said = swap(held)
    ok = address is not None and _pair.room(handle) and (me == 1 or _same_file(fd, peer_pid, said))
    usable = bool(swap(ok)) and ok
    for descriptor in (fd, held):
        if descriptor >= 0:
            os.close(descriptor)
    _live.discard(handle)
    _pair.register(handle, address, size, capacity, me, peer_pid, usable)  # has room: it was asked
    (_live if usable else _refused).add(handle)
    return usable


def _open_quietly(path: str) -> int:
    """A read-only descriptor of `path`, or -1 (the set-up then says no, rather than leave the peer waiting)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _same_file(fd: int, pid: int, peer_fd: int) -> bool:
    """Whether process `pid`'s descriptor `peer_fd` is this rank's `fd` (its pid is one this rank sees)."""
    if fd < 0 or peer_fd < 0:
        return False
    try:
        return os.stat(f"/proc/{pid}/fd/{peer_fd}").st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def exchange_through_pair(comm: Any, send: np.ndarray, out: np.ndarray, plan: Any) -> None:
    """The all-reduce of 2 ranks in one exchange through their pair (`through_pair` said yes).

    As `all_reduce.exchange_once`: both reduce rank 0's input op rank 1's, so both get the
    same bits. `send` may be `out` (in place).

    Raises:
        MPI.Exception: the peer's process ended during the exchange (as MPI reports it).
    """
    handle = comm.handle
    peer = _pair.await_peer(handle) if _pair.post(handle, send) else None
    if peer is None:
        _peer_gone(comm)
    datatype = plan.datatype
    theirs = np.frombuffer(peer, out.dtype).reshape(out.shape)
    if comm.Get_rank() == 0:
        mine = np.frombuffer(_pair.own(handle), out.dtype).reshape(out.shape)
        np.copyto(out, theirs)
        plan.mpi_op.Reduce_local([mine, datatype], [out, datatype])
    else:
        if send is not out:
            np.copyto(out, send)
        plan.mpi_op.Reduce_local([theirs, datatype], [out, datatype])
    _pair.done(handle)


def _peer_gone(comm: Any) -> None:
    """The peer's process is gone: MPI's message to it reports its failure as MPI's own exchange would have."""
    peer = 1 - comm.Get_rank()
    comm.Sendrecv(bytearray(0), peer, PAIR_TAG, bytearray(0), peer, PAIR_TAG)
    raise MPI.Exception(MPI.ERR_OTHER)


def forget_pair(comm: Any) -> None:
    """Drop the pair of `comm` (before the communicator is freed: a later one may get its handle)."""
    if _pair is not None and comm is not None:
        handle = comm.handle
        _live.discard(handle)
        _refused.discard(handle)
        _pair.forget(handle)


def ring_for_check(comm: Any, checks: int) -> None:
    """Say in `comm`'s pair, if it has one, that this rank posted the group's first `checks` checks."""
    if _live:
        handle = comm.handle
        if handle in _live:
            _pair.ring(handle, checks & _COUNT_MASK)


def doze_for_check(comm: Any, checks: int) -> bool:
    """Sleep until the peer posted its first `checks` checks, where the core is contested and `comm` has a pair.

    For a late check's wait: rather than a pause that looks again within microseconds, a
    sleep in the kernel that the peer's post ends (at most ``DOZE_NS``). Returns whether it
    slept; False: the caller pauses as it would have (no pair, a core not contested, or the
    peer's check is posted already and MPI's test has yet to find it).
    """
    if not _live or not contested():
        return False
    handle = comm.handle
    return handle in _live and _pair.doze(handle, checks & _COUNT_MASK, DOZE_NS) == 0
