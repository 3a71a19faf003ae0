"""The command line: ``python -m mpitensor info`` (run it under mpiexec), ``python -m mpitensor trace PATH``."""

from __future__ import annotations

import argparse
import sys


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="report the stragglers of a recorded trace; print where to open it")
    trace.add_argument("path", metavar="PATH", help="the trace file (or the path of its .rank*.json parts)")
    plot = trace.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="OUT.png", help="where to draw the plot (default: PATH with suffix .png)")
    plot.add_argument("--no-plot", action="store_true", help="draw no plot")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the subcommand; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mpitensor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print every rank's host, local rank, device, MPI and data path")
    _add_trace_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._tools.info import main as info_main

        return info_main()
    if args.command == "trace":
        from ._tools.trace import default_plot_path
        from ._tools.trace import main as trace_main

        plot = None if args.no_plot else (args.plot or default_plot_path(args.path))
        return trace_main(args.path, plot)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
