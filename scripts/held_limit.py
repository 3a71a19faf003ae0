"""Where MPI's in-place all-reduce stops beating mpitensor's own transport and a copy back.

    mpiexec -n 2 python scripts/held_limit.py [ROUNDS]

An input its caller holds unchanged (the torch backend's tensors) can be reduced in place by
MPI (``Iallreduce(MPI_IN_PLACE)`` + ``Wait``) or all-reduced by mpitensor, whose transport
for large messages within a node is shared memory, with its result copied back into the
input. This times both at 1 to 16 MiB of float32, in alternating rounds, and rank 0 prints
the minimum of the rounds for each and their ratio (in place / transport and copy): below 1,
in place is faster. `HELD_BYTES` in ``mpitensor/_transport/mpi/all_reduce.py`` comes from it.
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


def compare(nbytes: int, rounds: int, comm: object) -> tuple[float, float]:
    """The best (in place, transport and copy back) microseconds per call at `nbytes`."""
    array = np.zeros(nbytes // 4, np.float32)
    calls = max(10, (100 << 20) // nbytes // 4)

    def in_place() -> None:
        comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM).Wait()

    def transport_and_copy() -> None:
        np.copyto(array, mt.all_reduce(array, "sum").resolve().numpy())

    times: dict[str, list[float]] = {"in_place": [], "copy": []}
    for _ in range(rounds):
        times["in_place"].append(per_call(in_place, calls, comm))
        times["copy"].append(per_call(transport_and_copy, calls, comm))
    return min(times["in_place"]), min(times["copy"])


def main() -> None:
    """Print, on rank 0, one line per size."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with mt.DistributedContext.init() as ctx:
        comm = MPI.COMM_WORLD.Dup()
        for nbytes in SIZES:
            in_place, copy = compare(nbytes, rounds, comm)
            if ctx.rank == 0:
                print(f"{nbytes >> 20:3d} MiB  in place {in_place:8.0f} us  transport and copy {copy:8.0f} us  "
                      f"ratio {in_place / copy:.2f}", flush=True)
        comm.Free()


if __name__ == "__main__":
    main()
