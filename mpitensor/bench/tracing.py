"""What tracing costs: a checked all-reduce with tracing on against the same call with it off.

Per size (8 B, 64 KiB, 1 MiB of float64) and round, a context without tracing and one with
``DistributedConfig(trace=...)`` (its file in a temporary folder) each time the resolved
all-reduce in short batches, in an order that alternates between rounds; a context's figure
is the 10th percentile of its batches (each the slowest rank's mean time per call), a row's
the median over rounds, and the ratio is traced / untraced. Run
``mpiexec -n 2 python -m mpitensor.bench tracing``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core.mpi import MPI
from ._common import markdown_table, seconds_per_call, text_table

__all__ = ["format_tracing", "run_tracing"]

_SIZES = {"8 B": 1, "64 KiB": 8192, "1 MiB": 131072}


_BATCHES = 12  # short batches per size and context: their 10th percentile is the context's figure


def _reps(elements: int) -> int:
    return max(20, min(2000, 10_000_000 // (elements * 8 * 16 + 20_000)))


def _time(trace: str | None) -> dict[str, float]:
    """Seconds per call at each size in a context traced into `trace` (None: untraced).

    Each figure is the 10th percentile of short batches (each the slowest rank's), so the
    bursts of other programs on the machine move it little.
    """
    import mpitensor as mt

    config = mt.DistributedConfig(trace=trace) if trace is not None else mt.DistributedConfig(trace="")
    times = {}
    with mt.DistributedContext.init(config=config) as ctx:
        for size, elements in _SIZES.items():
            x = np.ones(elements)
            batches = [
                ctx.comm.allreduce(
                    seconds_per_call(lambda x=x: mt.all_reduce(x).resolve(), _reps(elements), ctx.comm.Barrier),
                    op=MPI.MAX,
                )
                for _ in range(_BATCHES)
            ]
            times[size] = float(np.percentile(batches, 10))
    return times


def run_tracing(rounds: int = 15, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time traced against untraced checked all-reduces (every rank calls it).

    Returns:
        Per size the median seconds per call of both, and the ratio traced / untraced.
    """
    comm = MPI.COMM_WORLD
    folder = comm.bcast(tempfile.mkdtemp(prefix="mpitensor-trace-bench-") if comm.Get_rank() == 0 else None)
    path = os.path.join(folder, "bench-trace.json")
    times: dict[str, dict[str, list[float]]] = {size: {"off": [], "on": []} for size in _SIZES}
    for round_ in range(rounds):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        for variant in order:
            for size, seconds in _time(path if variant == "on" else None).items():
                times[size][variant].append(seconds)
    if comm.Get_rank() == 0:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
        if progress is not None:
            progress("tracing: done")
    medians = {size: {v: float(np.median(t)) for v, t in by.items()} for size, by in times.items()}
    return {"ranks": comm.Get_size(), "rounds": rounds, "seconds": medians,
            "traced_over_untraced": {size: by["on"] / by["off"] for size, by in medians.items()}}


def format_tracing(result: dict[str, Any], markdown: bool = True) -> str:
    """The result as a table: per size both times per call and their ratio."""
    header = ["size", "untraced us per call", "traced us per call", "traced / untraced"]
    rows = [[size, f"{by['off'] * 1e6:.2f}", f"{by['on'] * 1e6:.2f}",
             f"{result['traced_over_untraced'][size]:.3f}x"] for size, by in result["seconds"].items()]
    title = (f"checked all-reduce with tracing on against off, {result['ranks']} ranks, "
             f"medians of {result['rounds']} alternated rounds")
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    return f"{title}\n\n{table}\n" if markdown else f"{title}\n{table}"
