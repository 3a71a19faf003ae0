"""Overlap of an all-reduce with compute, as ``osu_iallreduce`` measures it.

For each size and variant: the pure communication time (start, then wait), a compute
kernel calibrated to last that long, and the overall time of start + compute + wait. Then
``overlap = max(0, 100 - 100 x (overall - compute) / pure_comm)``: 100% when the
communication hides entirely behind the compute, 0% when none of it does.

The compute is NumPy work on a cache-resident array (``numpy.sin`` in a loop), which
releases the GIL as real array code does, so a progress thread can run beside it.

Variants: raw mpi4py ``Iallreduce`` (nobody drives MPI during the compute), and mpitensor
with its progress thread off and on (``DistributedConfig.progress``), each with the default
data path and with the shared-memory path off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import DistributedConfig, DistributedContext, all_reduce, from_numpy
from .._core.mpi import MPI
from ._common import (
    Timing,
    check_variants,
    format_size,
    markdown_table,
    median,
    round_done,
    size_axis,
    text_table,
    us,
)

__all__ = ["LABELS", "VARIANTS", "format_overlap", "plot_overlap", "run_overlap"]

VARIANTS = ("raw", "mt_progress_off", "mt_progress_on", "mt_plain_progress_off", "mt_plain_progress_on")
LABELS = {
    "raw": "raw mpi4py Iallreduce (no progress)",
    "mt_progress_off": "mpitensor, progress thread off",
    "mt_progress_on": "mpitensor, progress thread on",
    "mt_plain_progress_off": "mpitensor, shared memory off, progress off",
    "mt_plain_progress_on": "mpitensor, shared memory off, progress on",
}
_CONFIGS = {
    "mt_progress_off": DistributedConfig(check=False, progress=False),
    "mt_progress_on": DistributedConfig(check=False, progress=True),
    "mt_plain_progress_off": DistributedConfig(check=False, progress=False, shared_memory=False),
    "mt_plain_progress_on": DistributedConfig(check=False, progress=True, shared_memory=False),
}
_KERNEL_ELEMENTS = 8192  # 64 KiB of float64: stays in cache


class _Compute:
    """A compute kernel of `units` calls to ``numpy.sin`` on a small array."""

    def __init__(self) -> None:
        self.a = np.linspace(0.0, 1.0, _KERNEL_ELEMENTS)
        self.b = np.empty_like(self.a)

    def run(self, units: int) -> None:
        a, b, sin = self.a, self.b, np.sin
        for _ in range(units):
            sin(a, out=b)


def run_overlap(
    sizes: Sequence[int],
    *,
    reps: int = 5,
    target: float = 0.05,
    variants: Sequence[str] = VARIANTS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure pure communication, compute, overall time and overlap per size and variant.

    Call it on every rank (MPI must be initialized).

    Args:
        sizes: message sizes in bytes (float32 elements).
        reps: rounds; each time is the median over them.
        target: seconds each timed batch should last.
        variants: which of `VARIANTS` to run.
        progress: called on rank 0 with a line after each round.

    Returns:
        ``{"kind": "overlap", "ranks", "sizes", "reps", "unit_s", "variants": {name:
        {"label", "pure_s", "compute_s", "overall_s", "overlap_pct", "progress_thread",
        "config"}}}``.
    """
    check_variants(variants, VARIANTS)
    comm = MPI.COMM_WORLD.Dup()
    ranks = comm.Get_size()
    timing = Timing(comm, target, reps)
    kernel = _Compute()
    unit = median([timing.batch("unit", lambda: kernel.run(1), warmup=20) for _ in range(reps)])
    state = _OverlapRun(comm, timing, kernel, unit, sizes, variants)
    try:
        for rep in range(reps):
            for variant in variants:
                state.time_round(variant)
            round_done(progress, comm, "overlap", rep, reps)
    finally:
        comm.Free()
    return {
        "kind": "overlap",
        "ranks": ranks,
        "sizes": list(sizes),
        "reps": reps,
        "unit_s": unit,
        "variants": {variant: state.result(variant) for variant in variants},
    }


_Start = Callable[[], Any]
_Wait = Callable[[Any], Any]


def _raw_calls(comm: Any, send: np.ndarray, recv: np.ndarray) -> tuple[_Start, _Wait]:
    """Start and wait of raw mpi4py ``Iallreduce`` on `send` and `recv`."""

    def start() -> Any:
        return comm.Iallreduce(send, recv, MPI.SUM)

    def wait(request: Any) -> Any:
        return request.Wait()

    return start, wait


def _mt_calls(tensor: Any) -> tuple[_Start, _Wait]:
    """Start and wait of mpitensor's ``all_reduce`` of `tensor`."""

    def start() -> Any:
        return all_reduce(tensor)

    def wait(handle: Any) -> Any:
        return handle.resolve()

    return start, wait


class _OverlapRun:
    """One overlap run: the buffers of every size, the compute calibration, the times so far."""

    def __init__(self, comm: Any, timing: Timing, kernel: _Compute, unit: float, sizes: Sequence[int],
                 variants: Sequence[str]) -> None:
        self.comm, self.timing, self.kernel, self.unit = comm, timing, kernel, unit
        self.sends = [np.ones(max(1, n // 4), np.float32) for n in sizes]
        self.recvs = [np.empty_like(s) for s in self.sends]
        self.tensors = [from_numpy(s.copy()) for s in self.sends]
        self.pure: dict[str, list[list[float]]] = {v: [[] for _ in sizes] for v in variants}
        self.overall: dict[str, list[list[float]]] = {v: [[] for _ in sizes] for v in variants}
        self.compute: dict[str, list[list[float]]] = {v: [[] for _ in sizes] for v in variants}
        self.units: dict[tuple[str, int], int] = {}
        self.threads: dict[str, bool | None] = {}

    def time_round(self, variant: str) -> None:
        """One round of `variant` at every size, inside a context of its own (none for raw)."""
        config = _CONFIGS.get(variant)
        ctx = None if config is None else DistributedContext.init(config=config)
        try:
            if ctx is not None:
                self.threads[variant] = _progress_thread_running(ctx)
            for index in range(len(self.sends)):
                if ctx is None:
                    start, wait = _raw_calls(self.comm, self.sends[index], self.recvs[index])
                else:
                    start, wait = _mt_calls(self.tensors[index])
                self._time_size(variant, index, start, wait)
        finally:
            if ctx is not None:
                ctx.close()

    def _time_size(self, variant: str, index: int, start: _Start, wait: _Wait) -> None:
        """Time the pure communication, the compute, then both together, at one size."""
        timing, kernel = self.timing, self.kernel
        key = (variant, index)
        t_pure = timing.batch(("pure", key), lambda: wait(start()))
        self.pure[variant][index].append(t_pure)
        if key not in self.units:
            # Calibrated once, to the first round's communication time.
            self.units[key] = max(1, round(t_pure / self.unit))
        count = self.units[key]
        self.compute[variant][index].append(timing.batch(("compute", key), lambda: kernel.run(count)))

        def both() -> None:
            pending = start()
            kernel.run(count)
            wait(pending)

        self.overall[variant][index].append(timing.batch(("overall", key), both))

    def result(self, variant: str) -> dict[str, Any]:
        """`variant`'s entry in the result: median times per size and the overlap they give."""
        t_pure = [median(x) for x in self.pure[variant]]
        t_compute = [median(x) for x in self.compute[variant]]
        t_overall = [median(x) for x in self.overall[variant]]
        return {
            "label": LABELS[variant],
            "pure_s": t_pure,
            "compute_s": t_compute,
            "overall_s": t_overall,
            "overlap_pct": [_overlap(p, c, o) for p, c, o in zip(t_pure, t_compute, t_overall)],
            "progress_thread": self.threads.get(variant),
            "config": _config_text(variant),
        }


def _overlap(pure: float, compute: float, overall: float) -> float:
    if not pure > 0:
        return float("nan")
    return max(0.0, 100.0 - 100.0 * (overall - compute) / pure)


def _config_text(variant: str) -> str:
    config = _CONFIGS.get(variant)
    if config is None:
        return "mpi4py"
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ", ".join(f"{k}={fields[k]}" for k in ("check", "progress", "shared_memory") if k in fields)


def _progress_thread_running(ctx: DistributedContext) -> bool | None:
    """Whether the context runs a progress thread (None when it cannot tell)."""
    value = getattr(ctx, "progress", None)
    return value if isinstance(value, bool) else None


def format_overlap(result: dict[str, Any], markdown: bool = True) -> str:
    """The overlap table: per size, each variant's pure communication time and overlap."""
    variants = result["variants"]
    header = ["size"]
    for name in variants:
        header += [f"{name} comm us", f"{name} overlap %"]
    rows = []
    for i, nbytes in enumerate(result["sizes"]):
        row = [format_size(nbytes)]
        for entry in variants.values():
            pct = entry["overlap_pct"][i]
            row += [us(entry["pure_s"][i]), "-" if pct is None or pct != pct else f"{pct:.0f}"]
        rows.append(row)
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    lines = [
        f"Overlap of a float32 sum all-reduce with NumPy compute, {result['ranks']} ranks "
        f"(osu_iallreduce: compute calibrated to the pure communication time; overlap = "
        "max(0, 100 - 100 x (overall - compute) / pure_comm)); median of "
        f"{result['reps']} rounds.",
    ]
    for name, entry in variants.items():
        lines.append(f"- {name}: {entry['label']} ({entry['config']}; progress thread reported: "
                     f"{'unknown' if entry['progress_thread'] is None else entry['progress_thread']})")
    return "\n".join(lines) + "\n\n" + table + "\n"


def plot_overlap(result: dict[str, Any], path: str) -> bool:
    """Overlap % against size, one line per variant, as a PNG (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axis = plt.subplots(figsize=(7, 4.5))
    sizes = result["sizes"]
    for entry in result["variants"].values():
        axis.plot(sizes, [p if p is not None else float("nan") for p in entry["overlap_pct"]], marker=".",
                  label=entry["label"])
    axis.set(xlabel="message size", ylabel="overlap (%)", ylim=(-2, 102),
             title=f"all-reduce / compute overlap, {result['ranks']} ranks")
    size_axis(axis, sizes)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
