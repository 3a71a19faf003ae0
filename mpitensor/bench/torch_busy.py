"""The ``mpitensor`` backend against gloo on a busy machine: a CPU hog per core runs beside the ranks.

A laptop running other work, a shared node, a CI box, oversubscribed test ranks: there a
rank that spins while it waits for a peer burns the time slice the peer needs. This
benchmark makes that machine: before timing, the first rank of each node starts one
process per core that only spins (a ``while True`` loop, at normal priority), and stops
them after. Beside them, in one job and interleaved round by round (the order rotating each
round), it times:

- ``dist.all_reduce`` of a 332 KiB float32 tensor on gloo and on the backend;
- a DDP training step (forward, backward with its one gradient bucket of about 333 KiB,
  SGD) of an MLP of 85k parameters (784-104-32-10), DDP on gloo and DDP on the backend.

Each round times 100 calls (or steps) of each: ten, a few of the hogs' time slices, made one
tree's DDP figure range over 0.82-1.42x gloo's from run to run, a hundred over 0.93-1.17x.
Each figure is the median over rounds of the slowest rank's mean time per call (or step);
beside it, the CPU time a rank's process spent per call (every thread; the median over rounds
of the ranks' mean). A rank shares its core with a hog, so the scheduler gives it about half of
it: what a wait burns polling shows there, and comes back as time the rank's compute waits for
its core.

Run ``mpiexec -n 2 python -m mpitensor.bench torch --busy``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._core.mpi import MPI
from ._common import markdown_table, start_gloo, stop_gloo, text_table, times_per_call

__all__ = ["format_torch_busy", "run_torch_busy"]

ALL_REDUCE_ELEMENTS = 332 * 1024 // 4  # 332 KiB of float32
WIDTHS = (784, 104, 32, 10)  # 85,330 parameters: one bucket of 333 KiB
# The hog: a Python loop that never sleeps, on the core its argument names where it may
# (not the rank's cores: a bound rank's hogs would share its one core). Only `os` is
# imported, so it starts in milliseconds.
_HOG = ("import os, sys\n"
        "try:\n    os.sched_setaffinity(0, {int(sys.argv[1]) % os.cpu_count()})\n"
        "except OSError:\n    pass\n"
        "while True:\n    pass\n")


@contextmanager
def cpu_hogs(count: int) -> Iterator[int]:
    """Run `count` spinning processes until the block ends, hog k on core k of the node; yields how many.

    Pinned, every core has its hog, as on a machine whose cores are all busy; the scheduler left
    alone sometimes put two hogs on one core, and the ranks on the other.
    """
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(k)], stdin=subprocess.DEVNULL) for k in range(count)]
    try:
        yield len(hogs)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for width_in, width_out in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _ddp_step(model: Any, optim: Any, x: Any, y: Any) -> Callable[[], None]:
    import torch

    def step() -> None:
        optim.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optim.step()

    return step


def run_torch_busy(rounds: int = 15, reps: int = 100, steps: int = 100, hogs: int | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time the backend's all-reduce and DDP step against gloo's with a CPU hog per core; every rank calls it.

    Args:
        rounds: rounds of every variant (the figure is the median over them).
        reps: all-reduces per variant and round.
        steps: DDP steps per variant and round.
        hogs: spinning processes per node (None: one per core).
        progress: called with a line on rank 0 when the run is over.

    Returns:
        The settings, the median seconds per call of each variant (``seconds``), the CPU
        seconds per call (``cpu_seconds``) and the backend's ratios to gloo;
        ``{"skipped": reason}`` without torch.
    """
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch)"}
    import mpitensor as mt

    if hogs is None:
        hogs = os.cpu_count() or 1
    with mt.DistributedContext.init() as ctx:
        dist = start_gloo(ctx.comm)
        try:
            import mpitensor.torch  # noqa: F401 - registers the backend

            group = dist.new_group(backend="mpitensor")
            variants = _variants(torch, dist, group, ctx.rank, reps, steps)
            with cpu_hogs(hogs if ctx.local_rank == 0 else 0):
                ctx.comm.Barrier()
                time.sleep(0.5)  # the hogs have started on every node
                times, cpu = _interleaved(variants, rounds, ctx.comm)
        finally:
            variants = group = {}  # DDP goes before its process group (see stop_gloo)
            stop_gloo(dist)
    if progress is not None and ctx.rank == 0:
        progress("torch --busy: done")
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return {"ranks": ctx.size, "rounds": rounds, "hogs_per_node": hogs, "cores": os.cpu_count(),
            "seconds": medians, "cpu_seconds": {name: float(np.median(values)) for name, values in cpu.items()},
            "all_reduce_backend_over_gloo": medians["all_reduce mpitensor"] / medians["all_reduce gloo"],
            "ddp_step_backend_over_gloo": medians["ddp step mpitensor"] / medians["ddp step gloo"]}


def _variants(torch: Any, dist: Any, group: Any, rank: int, reps: int, steps: int) -> dict[str, tuple[Any, int]]:
    """Each variant's call and how many calls a round times."""
    tensor = torch.zeros(ALL_REDUCE_ELEMENTS)  # zeros: sums in place stay exact
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, WIDTHS[0], generator=gen), torch.randint(0, WIDTHS[-1], (32,), generator=gen)
    models = {name: torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=pg)
              for name, pg in (("gloo", None), ("mpitensor", group))}
    optims = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in models.items()}
    return {
        "all_reduce gloo": (lambda: dist.all_reduce(tensor), reps),
        "all_reduce mpitensor": (lambda: dist.all_reduce(tensor, group=group), reps),
        "ddp step gloo": (_ddp_step(models["gloo"], optims["gloo"], x, y), steps),
        "ddp step mpitensor": (_ddp_step(models["mpitensor"], optims["mpitensor"], x, y), steps),
    }


def _interleaved(variants: dict[str, tuple[Any, int]], rounds: int,
                 comm: Any) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant and round (the order rotating): the slowest rank's seconds per call, the ranks' mean CPU seconds."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for turn in range(len(names)):
            name = names[(turn + round_) % len(names)]
            call, reps = variants[name]
            took, spent = times_per_call(call, reps, comm.Barrier)
            times[name].append(comm.allreduce(took, op=MPI.MAX))
            cpu[name].append(comm.allreduce(spent) / comm.Get_size())
    return times, cpu


def format_torch_busy(result: dict[str, Any], markdown: bool = True) -> str:
    """The result as a table: per measurement gloo's time, the backend's, their ratio, and their CPU per call."""
    if "skipped" in result:
        return f"torch --busy: skipped ({result['skipped']})"
    seconds, cpu = result["seconds"], result["cpu_seconds"]
    header = ["measurement", "gloo ms", "mpitensor ms", "mpitensor / gloo", "gloo CPU ms", "mpitensor CPU ms"]
    rows = [[what, f"{seconds[f'{what} gloo'] * 1e3:.2f}", f"{seconds[f'{what} mpitensor'] * 1e3:.2f}",
             f"{seconds[f'{what} mpitensor'] / seconds[f'{what} gloo']:.2f}",
             f"{cpu[f'{what} gloo'] * 1e3:.2f}", f"{cpu[f'{what} mpitensor'] * 1e3:.2f}"]
            for what in ("all_reduce", "ddp step")]
    title = (f"The mpitensor backend against gloo beside {result['hogs_per_node']} CPU hogs per node "
             f"({result['cores']} cores), {result['ranks']} ranks, medians of {result['rounds']} interleaved "
             "rounds: a 332 KiB all_reduce, a DDP step of an 85k-parameter MLP; CPU: a rank's process, "
             "every thread")
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    return f"{title}\n\n{table}\n" if markdown else f"{title}\n{table}"
