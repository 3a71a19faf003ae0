"""A picture of the straggler report: who made the others wait, and how late it came over the run."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .chrome import earliest_ns
from .stragglers import TraceSummary

__all__ = ["plot_summary"]


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plotting the trace needs matplotlib: pip install matplotlib (or pip install 'mpitensor[plot]')"
        ) from exc
    # A bare Figure draws with Agg and never touches pyplot's global backend, so it works without a display.
    return Figure(figsize=(11, 4.5), layout="constrained")


def _wait_bars(axes: Any, summary: TraceSummary) -> None:
    ranks = [stats.rank for stats in summary.ranks]
    width = 0.4
    caused = [stats.wait_caused_ns / 1e9 for stats in summary.ranks]
    suffered = [stats.wait_suffered_ns / 1e9 for stats in summary.ranks]
    axes.bar([rank - width / 2 for rank in ranks], caused, width, label="wait caused")
    axes.bar([rank + width / 2 for rank in ranks], suffered, width, label="wait suffered")
    axes.set_xticks(ranks)
    axes.set_xlabel("rank")
    axes.set_ylabel("seconds")
    axes.set_title("wait caused (others waiting for it) vs suffered")
    axes.legend()


def _lateness(axes: Any, summary: TraceSummary, t0_ns: int) -> None:
    for stats in summary.ranks:
        points = summary.lateness_series(stats.rank)
        if points:
            times = [(time - t0_ns) / 1e9 for time, _ in points]
            # Points, not lines: a line joining a straggler's many collectives hides the others'.
            lateness = [late / 1e6 for _, late in points]
            axes.plot(times, lateness, ".", markersize=3, alpha=0.6, label=f"rank {stats.rank}")
    axes.set_xlabel("time since the trace's start (s)")
    axes.set_ylabel("lateness when last (ms)")
    axes.set_title("how late the last rank came")
    if axes.get_legend_handles_labels()[0]:
        axes.legend()


def plot_summary(summary: TraceSummary, dumps: Sequence[Mapping[str, Any]], out_png: str | os.PathLike[str]) -> str:
    """Draw the report as a PNG: per-rank wait caused vs suffered, and the last rank's lateness over time.

    Args:
        summary: `summarize(dumps)`.
        dumps: the dumps it came from (for the trace's start time).
        out_png: the file to write.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    figure = _figure()
    bars, lateness = figure.subplots(1, 2)
    _wait_bars(bars, summary)
    _lateness(lateness, summary, earliest_ns(dumps))
    path = os.fspath(out_png)
    figure.savefig(path, dpi=110)
    return path
