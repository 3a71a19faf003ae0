"""Print the messages per rank of each operation of docs/cluster.md's table, counted by Open MPI.

    .venv-openmpi/bin/python scripts/message_counts.py [--sizes 4,8,16,32] [--only NAME,...]

Each count is the most any rank sent for one operation (the job with the operation minus
the job without it; see tests/message_counts.py). Needs the Open MPI venv.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.message_counts import SCENARIOS, monitoring_available, scenario_counts


def main() -> int:
    """Run the scenarios at each size and print one row per scenario."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,8,16,32", help="rank counts, comma-separated")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    args = parser.parse_args()
    why = monitoring_available()
    if why is not None:
        print(f"message_counts.py: {why}", file=sys.stderr)
        return 2
    sizes = [int(size) for size in args.sizes.split(",")]
    print("| operation | " + " | ".join(f"N={size}" for size in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    with tempfile.TemporaryDirectory() as directory:
        for name in args.only.split(","):
            scenario = SCENARIOS[name]
            row = []
            for size in sizes:
                counts = scenario_counts(scenario, size, pathlib.Path(directory), timeout=300)
                row.append(f"{max(counts.values())} (min {min(counts.values())})")
            print(f"| {scenario.what} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
