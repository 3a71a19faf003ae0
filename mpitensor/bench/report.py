"""The targets: each one's measured ratio from a run's JSON, met or not.

``python -m mpitensor.bench report bench-results/*.json`` prints them as a Markdown table
(no MPI needed); BENCHMARKS.md shows that table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ._common import busbw_factor, format_size, markdown_table

__all__ = ["Target", "evaluate", "format_runs", "format_targets", "load"]

_KIB = 1 << 10
_MIB = 1 << 20


class Target:
    """One target: a measured value, the bound it must meet, and what was measured.

    Args:
        name: what the target is.
        value: the measured value (None when the run has no data for it).
        bound: the bound.
        at_least: True when the value must be >= the bound, False for <=.
        detail: how the value was obtained (sizes, baselines beside it).
    """

    def __init__(self, name: str, value: float | None, bound: float, at_least: bool, detail: str) -> None:
        self.name = name
        self.value = value
        self.bound = bound
        self.at_least = at_least
        self.detail = detail

    @property
    def met(self) -> bool | None:
        """True or False, or None without a value."""
        if self.value is None:
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The runs stored in the JSON files `paths` (as ``python -m mpitensor.bench`` writes them)."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            runs.append(json.load(handle))
    return runs


def _median(result: dict[str, Any], variant: str, nbytes: int) -> float | None:
    entry = result["variants"].get(variant)
    if entry is None or nbytes not in result["sizes"]:
        return None
    return entry["median_s"][result["sizes"].index(nbytes)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def evaluate(run: dict[str, Any]) -> list[Target]:
    """Every target that `run` has data for.

    Args:
        run: one run's JSON (with ``sweep``, ``overlap``, ``fused`` and ``torch`` entries).
    """
    targets: list[Target] = []
    sweep = run.get("sweep")
    if sweep is not None:
        targets += _sweep_targets(sweep)
    overlap = run.get("overlap")
    if overlap is not None:
        targets += _overlap_targets(overlap)
    fused = run.get("fused")
    if fused is not None:
        targets += _fused_targets(fused)
    torch_run = run.get("torch")
    if torch_run is not None and "skipped" not in torch_run:
        targets.append(_torch_target(torch_run))
    return targets


def _torch_target(result: dict[str, Any]) -> Target:
    """DataParallel's training step against torch DDP's on gloo (the same MLP, interleaved)."""
    mt_, ddp = result["variants"]["mt"], result["variants"]["ddp"]
    detail = (f"MLP {result['params'] / 1e6:.1f}M params: step {mt_['step_s'] * 1e3:.1f} ms vs DDP "
              f"{ddp['step_s'] * 1e3:.1f} ms; exposed comm {mt_['exposed_s'] * 1e3:.1f} vs "
              f"{ddp['exposed_s'] * 1e3:.1f} ms")
    return Target("DataParallel step / DDP-gloo step", result["mt_over_ddp"], 0.85, False, detail)


def _sweep_targets(sweep: dict[str, Any]) -> list[Target]:
    """The sweep's targets: overhead at large and small sizes, gloo, pickle, bus bandwidth."""
    targets = [
        target
        for target in (_large_overhead(sweep), _versus_gloo(sweep), _versus_pickle(sweep))
        if target is not None
    ]
    return _per_call(sweep) + targets + _busbw_targets(sweep)


def _large_overhead(sweep: dict[str, Any]) -> Target | None:
    """The target mt / raw at the worst size >= 64 KiB (progress thread off, shared memory off beside it)."""
    large = [n for n in sweep["sizes"] if n >= 64 * _KIB]
    if not large:
        return None
    worst = max(large, key=lambda n: _ratio(_median(sweep, "mt", n), _median(sweep, "raw", n)) or 0)
    details = [f"worst at {format_size(worst)}"]
    for variant, what in (("mt_noprogress", "progress thread off"),
                          ("mt_plain", "shared memory off (the same MPI_Iallreduce)")):
        ratios = [_ratio(_median(sweep, variant, n), _median(sweep, "raw", n)) for n in large]
        known = [(r, n) for r, n in zip(ratios, large) if r is not None]
        if known:
            value, at = max(known)
            details.append(f"{what}: worst {value:.2f}x at {format_size(at)}")
    return Target(
        "overhead >= 64 KiB: mt / raw (worst size)",
        _ratio(_median(sweep, "mt", worst), _median(sweep, "raw", worst)), 1.05, False, "; ".join(details),
    )


# Per-call cost against the raw call it wraps: (size, variant, bound, what).
_PER_CALL = (
    (8, "mt", 2.0, "check off"),
    (_KIB, "mt", 1.5, "check off"),
    (64 * _KIB, "mt", 1.05, "check off"),
    (16 * _MIB, "mt", 0.5, "check off (the memory-copy floor is about 0.3x)"),
    (8, "mt_checked", 3.0, "check on (the default configuration)"),
)
# From `_MANY_RANKS` ranks (oversubscribed here) raw MPI itself is slower, so the bound is tighter.
_MANY_RANKS = 8
_PER_CALL_MANY = (
    (8, "mt", 1.5, "check off"),
    (8, "mt_checked", 3.0, "check on (the default configuration)"),
)


def _per_call(sweep: dict[str, Any]) -> list[Target]:
    """The per-call ratios mt / raw at the sizes and configurations of `_PER_CALL` that the sweep measured."""
    targets = []
    for nbytes, variant, bound, what in _PER_CALL_MANY if sweep["ranks"] >= _MANY_RANKS else _PER_CALL:
        if nbytes not in sweep["sizes"] or variant not in sweep["variants"]:
            continue
        raw = _median(sweep, "raw", nbytes)
        mt = _median(sweep, variant, nbytes)
        detail = what + (f"; raw {raw * 1e6:.2f} us" if raw else "")
        written = _median(sweep, "raw_written", nbytes) if nbytes >= _KIB else None
        if written and mt:
            detail += f"; raw with its input written first {written * 1e6:.2f} us (mt / that {mt / written:.2f}x)"
        targets.append(Target(
            f"per call at {format_size(nbytes)}, {what.split(' (')[0]}: mt / raw", _ratio(mt, raw), bound, False,
            detail,
        ))
    return targets


def _versus_gloo(sweep: dict[str, Any]) -> Target | None:
    """The target gloo / mt at 1 MiB (when the run has gloo)."""
    if _MIB not in sweep["sizes"] or "gloo" not in sweep["variants"]:
        return None
    gloo = _median(sweep, "gloo", _MIB)
    off = _ratio(gloo, _median(sweep, "mt_noprogress", _MIB))
    return Target(
        "vs gloo at 1 MiB: gloo / mt", _ratio(gloo, _median(sweep, "mt", _MIB)),
        10.0, True, f"gloo {gloo * 1e6:.0f} us" + (f"; progress thread off: {off:.2f}x" if off else ""),
    )


def _versus_pickle(sweep: dict[str, Any]) -> Target | None:
    """The target pickle / mt at the worst size <= 64 KiB (when the run has pickle; raw MPI beside it)."""
    small = [n for n in sweep["sizes"] if n <= 64 * _KIB]
    if not small or "pickle" not in sweep["variants"]:
        return None

    def pickle_ratio(n: int, variant: str) -> float:
        return _ratio(_median(sweep, "pickle", n), _median(sweep, variant, n)) or 0.0

    worst = min(small, key=lambda n: pickle_ratio(n, "mt"))
    details = [f"worst at {format_size(worst)}"]
    if "mt_noprogress" in sweep["variants"]:
        off = min(small, key=lambda n: pickle_ratio(n, "mt_noprogress"))
        details.append(f"progress thread off: worst {pickle_ratio(off, 'mt_noprogress'):.2f}x at "
                       f"{format_size(off)}")
    best_raw = min(small, key=lambda n: pickle_ratio(n, "raw"))
    details.append(f"raw MPI itself: worst {pickle_ratio(best_raw, 'raw'):.2f}x at {format_size(best_raw)}")
    return Target(
        "vs pickle allreduce <= 64 KiB: pickle / mt (worst size)",
        pickle_ratio(worst, "mt"), 5.0, True, "; ".join(details),
    )


def _busbw_targets(sweep: dict[str, Any]) -> list[Target]:
    """The targets busbw mt / raw (the time ratio raw / mt) at 16 and 64 MiB, where the run has them."""
    targets = []
    factor = busbw_factor(sweep["ranks"])
    for nbytes in (16 * _MIB, 64 * _MIB):
        if nbytes not in sweep["sizes"]:
            continue
        raw, mt, copy = (_median(sweep, v, nbytes) for v in ("raw", "mt", "memcpy"))
        bus = [None if t is None else nbytes * factor / t / 1e9 for t in (raw, mt)]
        floor = "-" if copy is None else f"{nbytes / copy / 1e9:.2f} GB/s copy rate"
        off = _ratio(raw, _median(sweep, "mt_noprogress", nbytes))
        targets.append(Target(
            f"busbw at {format_size(nbytes)}: mt / raw", _ratio(raw, mt), 1.3, True,
            f"mt {bus[1] or 0:.2f} GB/s, raw {bus[0] or 0:.2f} GB/s; memcpy floor {floor}"
            + (f"; progress thread off: {off:.2f}x" if off else ""),
        ))
    return targets


def _overlap_targets(overlap: dict[str, Any]) -> list[Target]:
    """The target: the worst overlap >= 1 MiB with the progress thread on (other variants beside it)."""
    sizes = [n for n in overlap["sizes"] if n >= _MIB]
    variants = overlap["variants"]
    on = variants.get("mt_progress_on")
    if not sizes or on is None:
        return []
    idx = [overlap["sizes"].index(n) for n in sizes]
    values = [on["overlap_pct"][i] for i in idx]
    known = [v for v in values if v is not None]
    beside = []
    for name in ("raw", "mt_progress_off", "mt_plain_progress_on"):
        entry = variants.get(name)
        if entry is not None:
            others = [entry["overlap_pct"][i] for i in idx if entry["overlap_pct"][i] is not None]
            if others:
                beside.append(f"{name} min {min(others):.0f}%")
    worst = sizes[values.index(min(known))] if known else None
    return [Target(
        "overlap >= 1 MiB, progress on (worst size, %)", min(known) if known else None, 80.0, True,
        (f"worst at {format_size(worst)}; " if worst else "") + "; ".join(beside),
    )]


def _fused_targets(fused: dict[str, Any]) -> list[Target]:
    """The target separate / fused time with the check off (the check on beside it), when the run has both."""
    variants = fused["variants"]
    if "fused" not in variants or "separate" not in variants:
        return []
    checked = ""
    if "fused_checked" in variants and "separate_checked" in variants:
        checked = (f"; check on: "
                   f"{variants['separate_checked']['median_s'] / variants['fused_checked']['median_s']:.1f}x")
    targets = [Target(
        f"fusion, {fused['count']} x {format_size(fused['tensor_bytes'])}: separate / fused",
        variants["separate"]["median_s"] / variants["fused"]["median_s"], 5.0, True, "check off" + checked,
    )]
    if "raw_packed" in variants:
        packed = variants["raw_packed"]["median_s"]
        detail = f"check off; raw packed {packed * 1e6:.0f} us"
        if "raw_pack_each" in variants:
            each = variants["raw_pack_each"]["median_s"]
            detail += (f"; raw packing in each call {each * 1e6:.0f} us "
                       f"(fused / that {variants['fused']['median_s'] / each:.2f}x)")
        targets.append(Target(
            f"fused {fused['count']} x {format_size(fused['tensor_bytes'])} / one raw Iallreduce pre-packed",
            variants["fused"]["median_s"] / packed, 1.5, False, detail,
        ))
    return targets


def format_targets(runs: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of every run's targets."""
    rows = []
    for run in runs:
        machine = run.get("machine", {})
        where = f"{machine.get('mpi', '?')}, {machine.get('ranks', '?')} ranks"
        for target in evaluate(run):
            value = "-" if target.value is None else (
                f"{target.value:.0f}%" if "%" in target.name else f"{target.value:.2f}x")
            bound = f"{'>=' if target.at_least else '<='} {target.bound:g}" + ("%" if "%" in target.name else "x")
            met = {True: "met", False: "**not met**", None: "no data"}[target.met]
            rows.append([target.name, where, value, bound, met, target.detail])
    return markdown_table(["target", "run", "measured", "bound", "", "beside it"], rows) + "\n"


def format_runs(runs: Sequence[dict[str, Any]], plots: str | None = None) -> str:
    """Every run's machine, command and tables (and plots drawn into `plots`), in Markdown.

    Args:
        runs: the runs' JSON.
        plots: a folder to draw the plots into (from the JSON) and link; None for no plots.
    """
    from .collectives import format_collectives
    from .fused import format_fused
    from .overlap import format_overlap, plot_overlap
    from .sweep import format_sweep, plot_sweep

    parts = []
    for run in runs:
        machine = run.get("machine", {})
        name = run.get("name", "run")
        parts.append(f"### {machine.get('mpi', '?')}, {machine.get('ranks', '?')} ranks\n")
        parts.append(
            f"{machine.get('cores', '?')} cores ({machine.get('cpu', '?')}), {machine.get('memory_gib', '?')} GiB, "
            f"hosts {', '.join(machine.get('hosts', []))}; {machine.get('mpi_library', '').replace(chr(0), '')}; "
            f"thread level "
            f"{machine.get('thread_level', '?')}; Python {machine.get('python', '?')}, NumPy "
            f"{machine.get('numpy', '?')}, mpi4py {machine.get('mpi4py', '?')}. Run {run.get('started', '?')} to "
            f"{run.get('finished', '?')}: `mpiexec -n {machine.get('ranks', '?')} {machine.get('command', '')}`; "
            f"load average (1/5/15 min) {machine.get('load_before')} before, {machine.get('load_after')} after; "
            f"source {machine.get('source') or 'unknown'}.\n"
        )
        for kind, formatter, plotter in (
            ("sweep", format_sweep, plot_sweep),
            ("overlap", format_overlap, plot_overlap),
            ("fused", format_fused, None),
            ("collectives", format_collectives, None),
        ):
            result = run.get(kind)
            if result is None:
                continue
            parts.append(f"#### {kind}\n")
            parts.append(formatter(result))
            if plots and plotter is not None:
                os.makedirs(plots, exist_ok=True)
                path = os.path.join(plots, f"{name}-{kind}.png")
                if plotter(result, path):
                    parts.append(f"![{kind}, {machine.get('mpi', '')}, {machine.get('ranks', '')} ranks]({path})\n")
    return "\n".join(parts)
