"""``dist.all_reduce`` on the ``mpitensor`` backend against gloo and against ``mt.all_reduce``.

torch's default group is gloo; the mpitensor group is ``dist.new_group(backend="mpitensor")``
over every rank. For a 1 MiB float32 CPU tensor the backend is timed against gloo; for an
8-byte one against ``mt.all_reduce`` of the same tensor (resolved and copied back, what the
backend does), which is the backend's own cost. The variants of each size alternate in
rounds; each figure is the median over rounds of the slowest rank's mean time per call.

Run ``mpiexec -n 4 python -m mpitensor.bench torch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._core.mpi import MPI
from ._common import markdown_table, seconds_per_call, start_gloo, stop_gloo, text_table

__all__ = ["format_torch_backend", "run_torch_backend"]


def run_torch_backend(rounds: int = 7, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time the backend's all-reduce beside gloo's (1 MiB) and mt.all_reduce's (8 B); every rank calls it.

    Returns:
        Per size the median seconds per call of each variant and their ratio;
        ``{"skipped": reason}`` without torch.
    """
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch)"}
    import mpitensor as mt
    import mpitensor.torch  # registers the backend

    with mt.DistributedContext.init() as ctx:
        dist = start_gloo(ctx.comm)
        group = dist.new_group(backend="mpitensor")
        try:
            # Zeros: sums in place stay exact (ones would grow past float32, to inf, and warn).
            big, small = torch.zeros(262144), torch.zeros(2)
            sum_ = mt.ReduceOperation.SUM
            variants = {
                "1 MiB": {"gloo": (lambda: dist.all_reduce(big), 50),
                          "mpitensor": (lambda: dist.all_reduce(big, group=group), 50)},
                "8 B": {"mt.all_reduce": (lambda: small.copy_(mt.all_reduce(small, sum_).resolve()), 3000),
                        "mpitensor": (lambda: dist.all_reduce(small, group=group), 3000)},
            }
            times = {size: {name: [] for name in calls} for size, calls in variants.items()}
            for _ in range(rounds):
                for size, calls in variants.items():
                    for name, (call, reps) in calls.items():
                        took = seconds_per_call(call, reps, ctx.comm.Barrier)
                        times[size][name].append(ctx.comm.allreduce(took, op=MPI.MAX))
        finally:
            variants = group = None  # the group goes before gloo (see stop_gloo)
            stop_gloo(dist)
    if progress is not None and ctx.rank == 0:
        progress("torch backend: done")
    medians = {size: {name: float(np.median(v)) for name, v in by.items()} for size, by in times.items()}
    return {"ranks": ctx.size, "rounds": rounds, "seconds": medians,
            "gloo_over_backend_1mib": medians["1 MiB"]["gloo"] / medians["1 MiB"]["mpitensor"],
            "backend_over_mt_8b": medians["8 B"]["mpitensor"] / medians["8 B"]["mt.all_reduce"]}


def format_torch_backend(result: dict[str, Any], markdown: bool = True) -> str:
    """The result as a table: per size and variant the time per call."""
    if "skipped" in result:
        return f"torch backend: skipped ({result['skipped']})"
    header = ["size", "variant", "us per call"]
    rows = [[size, name, f"{seconds * 1e6:.1f}"] for size, by in result["seconds"].items()
            for name, seconds in by.items()]
    title = (f"dist.all_reduce on the mpitensor backend, {result['ranks']} ranks, medians of {result['rounds']} "
             f"rounds: gloo / mpitensor at 1 MiB {result['gloo_over_backend_1mib']:.2f}x, "
             f"mpitensor / mt.all_reduce at 8 B {result['backend_over_mt_8b']:.2f}x")
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    return f"{title}\n\n{table}\n" if markdown else f"{title}\n{table}"
