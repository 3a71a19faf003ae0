"""all_to_all with splits and reduce_scatter with counts, beside raw mpi4py on the same buffers.

Run: ``mpiexec -n 4 python -m mpitensor.bench.options``. For each size (float32 elements
per rank), ``raw`` is ``Ialltoallv`` / ``Ireduce_scatter`` + ``Wait`` with the counts known
in advance; ``mt`` is the mpitensor call + ``resolve()`` with the check off (it still swaps
the all-to-all's counts, which raw skips); ``mt_checked`` is the default configuration.
Latency is the median over rounds of the slowest rank's mean time per call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import DistributedConfig, DistributedContext, all_to_all, reduce_scatter
from .._core.mpi import MPI

__all__ = ["run_options"]

SIZES = (8, 64 << 10, 1 << 20)


def _time(comm: Any, call: Callable[[], Any], reps: int, rounds: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(reps):
            call()
        times.append(comm.allreduce((MPI.Wtime() - start) / reps, op=MPI.MAX))
    return float(np.median(times))


def _cases(comm: Any, nbytes: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    n = comm.Get_size()
    elements = max(nbytes // 4, n)
    rows = elements - elements % n
    splits = [rows // n] * n
    data = np.ones(rows, np.float32)
    out = np.empty(rows, np.float32)
    displs = np.cumsum([0, *splits[:-1]]).tolist()
    block = np.empty(rows // n, np.float32)
    counts = [rows // n] * n
    return {
        "all_to_all splits": (
            lambda: comm.Ialltoallv([data, splits, displs, MPI.FLOAT], [out, splits, displs, MPI.FLOAT]).Wait(),
            lambda: all_to_all(data, splits=splits, out=out).resolve(),
        ),
        "reduce_scatter counts": (
            lambda: comm.Ireduce_scatter([data, MPI.FLOAT], [block, MPI.FLOAT], counts, MPI.SUM).Wait(),
            lambda: reduce_scatter(data, "sum", counts=counts, out=block).resolve(),
        ),
    }


def run_options(reps: int = 50, rounds: int = 5) -> list[dict[str, Any]]:
    """Time every case at every size; call on every rank. Returns rows (rank 0's are complete)."""
    rows = []
    for check in (False, True):
        with DistributedContext.init(config=DistributedConfig(check=check)) as ctx:
            comm = ctx.comm
            for nbytes in SIZES:
                for name, (raw, mt) in _cases(comm, nbytes).items():
                    base = _time(comm, raw, reps, rounds)
                    took = _time(comm, mt, reps, rounds)
                    rows.append({"case": name, "bytes": nbytes, "check": check, "raw_us": base * 1e6,
                                 "mt_us": took * 1e6, "ratio": took / base})
    return rows


def main() -> None:
    """Print the table on rank 0."""
    from .._core.mpi import defer_finalize

    defer_finalize()
    rows = run_options()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"| case | size | check | raw us | mpitensor us | ratio | ({MPI.COMM_WORLD.Get_size()} ranks)")
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['case']} | {row['bytes']} B | {'on' if row['check'] else 'off'} | {row['raw_us']:.1f} | "
                  f"{row['mt_us']:.1f} | {row['ratio']:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
