"""The flight recorder: at a fault, every rank that still can writes its last events.

A rank that raises under fail-fast is about to end the job (``MPI_Abort``), and its peers
die with it, most of them waiting inside a collective. Before aborting, that rank asks each
peer to write its part of the trace, and waits a moment for their answers. Each rank's
listener thread waits for such a request beside the program (it tests a posted receive
every `POLL_S` seconds, on a communicator of its own), so a peer answers even while its main
thread waits in a collective. Needs ``MPI_THREAD_MULTIPLE``; without it each rank writes its
own part only when it faults itself.
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._core import mpi as _mpi
from ..._core.mpi import MPI

__all__ = ["POLL_S", "FlightRecorder"]

POLL_S = 0.02
ANSWER_S = 3.0  # how long the faulting rank waits for its peers' parts
_ASK, _ANSWER = 0x7AC4, 0x7AC5
_WRITE, _STOP = 1, 2
_listening: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_hooked = False


def _stop_all() -> None:
    """Stop every listener: MPI is about to be finalized (its Test must not come after)."""
    for recorder in list(_listening):
        recorder.stop()


def _hook_finalize() -> None:
    """Stop the listeners before MPI is finalized, by mpitensor or at exit by mpi4py (once)."""
    global _hooked
    if not _hooked:
        _hooked = True
        _mpi.on_finalize(_stop_all)
        atexit.register(_stop_all)  # runs before mpi4py's finalization, registered at its import


class FlightRecorder:
    """Writes this rank's part of the trace when this rank or a peer faults.

    Args:
        comm: the context's communicator (duplicated here; freed by `stop`).
        write_part: writes this rank's part (never raises).
    """

    def __init__(self, comm: Any, write_part: Callable[[], None]) -> None:
        self._comm = comm.Dup()
        self._write_part = write_part
        self._message = np.zeros(1, np.int64)
        self._request = self._comm.Irecv(self._message, source=MPI.ANY_SOURCE, tag=_ASK)
        self._thread: threading.Thread | None = threading.Thread(
            target=self._listen, name="mpitensor-flight-recorder", daemon=True
        )
        self._stopped = threading.Lock()
        _hook_finalize()
        _listening.add(self)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no thread to be had: this rank's part is then written at its own faults only
            self._thread = None
            warnings.warn(
                f"the trace's flight recorder cannot start its listener ({exc}): this rank writes its part "
                "of the trace at its own faults only, not when a peer faults",
                RuntimeWarning,
                stacklevel=2,
            )

    def _listen(self) -> None:
        status = MPI.Status()
        while True:
            if not self._request.Test(status):
                time.sleep(POLL_S)
                continue
            if int(self._message[0]) == _STOP:
                return
            self._write_part()
            self._comm.Send(np.zeros(1, np.int64), dest=status.Get_source(), tag=_ANSWER)
            self._request = self._comm.Irecv(self._message, source=MPI.ANY_SOURCE, tag=_ASK)

    def alarm(self) -> None:
        """Write this rank's part and ask every peer to write theirs (waits `ANSWER_S` at most)."""
        self._write_part()
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        peers = [p for p in range(size) if p != rank]
        ask = np.array([_WRITE], np.int64)
        answers = [np.zeros(1, np.int64) for _ in peers]
        requests = [self._comm.Isend(ask, dest=p, tag=_ASK) for p in peers]
        requests += [self._comm.Irecv(a, source=p, tag=_ANSWER) for a, p in zip(answers, peers)]
        deadline = time.monotonic() + ANSWER_S
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def stop(self) -> None:
        """End the listener (its receive is matched by a message to itself) and free the communicator.

        Idempotent; a no-op once MPI is finalized, and in a process forked from the rank.
        """
        if not self._stopped.acquire(blocking=False):
            return
        _listening.discard(self)
        # In a process forked from the rank, the communicator is the parent's (and the listener
        # is not there): it is left alone.
        if _mpi.forked_from() is not None or MPI.Is_finalized():
            return
        stop = np.array([_STOP], np.int64)
        self._comm.Send(stop, dest=self._comm.Get_rank(), tag=_ASK)
        if self._thread is not None:
            self._thread.join()
        else:
            self._request.Wait()  # no listener took the stop: complete the receive here
        self._comm.Free()
