"""The command line: ``python -m mpitensor info`` (run it under mpiexec)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the subcommand; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mpitensor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print every rank's host, local rank, device, MPI and data path")
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._tools.info import main as info_main

        return info_main()
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
