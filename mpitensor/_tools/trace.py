"""``python -m mpitensor trace PATH``: the straggler report of a recorded run, and where to look at its trace."""

from __future__ import annotations

import os
import sys

from .._runtime.tracing.files import part_paths, read_dumps, write_trace
from .._runtime.tracing.plot import plot_summary
from .._runtime.tracing.stragglers import TraceSummary, summarize

__all__ = ["default_plot_path", "main"]


def default_plot_path(path: str) -> str:
    """Where the plot of the trace at `path` goes by default: `path` with its suffix replaced by ``.png``."""
    root, _ = os.path.splitext(path)
    return f"{root}.png"


def _trace_file(path: str, dumps: list[dict]) -> str:
    """The merged file to open; merged from the parts first where only those exist (a run that faulted)."""
    if os.path.exists(path):
        return path
    write_trace(path, dumps)
    print(f"merged {len(part_paths(path))} part(s) {path}.rank*.json into {path}")
    return path


def _one_line(path: str, message: str) -> str:
    """`message` on one line, naming `path` if it does not already."""
    line = " ".join(message.split())
    return line if path in line else f"{path}: {line}"


def _plot(summary: TraceSummary, dumps: list[dict], plot: str) -> None:
    try:
        print(f"plot: {plot_summary(summary, dumps, plot)}")
    except ImportError as exc:
        print(f"no plot: {exc}")


def main(path: str, plot: str | None) -> int:
    """Print the straggler report of the trace at `path`, and draw its plot.

    Args:
        path: the merged trace, or the path whose ``.rank*.json`` parts exist.
        plot: where to write the PNG; None for none.

    Returns:
        The exit status: 0, or 2 when the trace is missing, not an mpitensor trace or damaged
        (one line on stderr says what is wrong).
    """
    try:
        dumps = read_dumps(path)
        summary = summarize(dumps)
        trace = _trace_file(path, dumps)
    except (OSError, ValueError, TypeError) as exc:
        print(f"python -m mpitensor trace: {_one_line(path, str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # any other fault of a damaged file: said in one line, never a traceback
        print(
            f"python -m mpitensor trace: {_one_line(path, f'cannot be read as a trace ({type(exc).__name__}: {exc})')}",
            file=sys.stderr,
        )
        return 2
    print(summary.text())
    print(f"trace: {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if plot is not None:
        _plot(summary, dumps, plot)
    return 0
