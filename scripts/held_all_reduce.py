"""How best to all-reduce an input its caller holds unchanged: MPI in place, or mpitensor and a copy back.

    mpiexec -n 2 python scripts/held_all_reduce.py [ROUNDS]

An input its caller holds unchanged (the torch backend's tensors) can be reduced in place by
MPI, blocking (``Allreduce(MPI_IN_PLACE)``) or not (``Iallreduce`` + ``Wait``), or
all-reduced by mpitensor, whose transport for large messages within a node is shared memory,
with its result copied back into the input. This times the three at 1 to 16 MiB of float32,
in alternating rounds, and rank 0 prints the minimum of the rounds for each and the ratios
of the two in-place ones to the transport and copy (below 1, in place is faster). The held
all-reduce's transport (`Held` in ``mpitensor/_transport/mpi/all_reduce.py``) comes from it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

import mpitensor as mt
from mpitensor._core.mpi import MPI

SIZES = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)


def per_call(function: Callable[[], None], calls: int, comm: object) -> float:
    """Microseconds per call of `function` over `calls` calls, after a barrier."""
    for _ in range(3):
        function()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e6


def compare(nbytes: int, rounds: int, comm: object) -> dict[str, float]:
    """The best microseconds per call at `nbytes` of each way, by name."""
    array = np.zeros(nbytes // 4, np.float32)
    calls = max(10, (100 << 20) // nbytes // 4)

    def blocking() -> None:
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

    def nonblocking() -> None:
        comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM).Wait()

    def transport_and_copy() -> None:
        np.copyto(array, mt.all_reduce(array, "sum").resolve().numpy())

    ways = {"blocking": blocking, "nonblocking": nonblocking, "copy": transport_and_copy}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            times[name].append(per_call(way, calls, comm))
    return {name: min(values) for name, values in times.items()}


def main() -> None:
    """Print, on rank 0, one line per size."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with mt.DistributedContext.init() as ctx:
        comm = MPI.COMM_WORLD.Dup()
        for nbytes in SIZES:
            best = compare(nbytes, rounds, comm)
            if ctx.rank == 0:
                copy = best["copy"]
                print(f"{nbytes >> 20:3d} MiB  in place, blocking {best['blocking']:7.0f} us "
                      f"({best['blocking'] / copy:.2f}x)  nonblocking {best['nonblocking']:7.0f} us "
                      f"({best['nonblocking'] / copy:.2f}x)  transport and copy {copy:7.0f} us", flush=True)
        comm.Free()


if __name__ == "__main__":
    main()
