"""Benchmarks of mpitensor beside raw mpi4py and its peers: ``python -m mpitensor.bench``.

Run under ``mpiexec -n N`` (``make bench`` runs 2 and 4 ranks). Rank 0 prints the tables;
every family returns its figures as data and is written to ``bench-results/`` as Markdown,
a PNG plot (with matplotlib) and one JSON per run, from which
``python -m mpitensor.bench report`` prints the targets. Families, one module each:

- `sweep`: the all-reduce sweep from 8 B to 64 MiB against raw ``Iallreduce``, pickle
  ``allreduce``, torch gloo and a memory-copy floor;
- `overlap`: overlap of an all-reduce with compute (``osu_iallreduce``'s definition), with
  the progress thread on and off;
- `fused`: the fused all-reduce of many small tensors against one call per tensor;
- `report`: the targets, measured against their bounds.
"""

from __future__ import annotations

from .fused import format_fused, run_fused
from .overlap import format_overlap, run_overlap
from .report import evaluate, format_targets
from .sweep import format_sweep, run_sweep

__all__ = [
    "evaluate",
    "format_fused",
    "format_overlap",
    "format_sweep",
    "format_targets",
    "run_fused",
    "run_overlap",
    "run_sweep",
]
