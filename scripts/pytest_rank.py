"""Run pytest on one MPI rank, keeping the terminal readable.

Rank 0 writes to the terminal; every other rank writes its whole output to
``$MPITENSOR_TEST_LOGS/rank-K.log`` (file descriptors included, so child processes too).
The exit status is pytest's, so ``mpiexec`` fails when any rank fails.
"""

import os
import sys

import pytest


def _rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def main() -> int:
    rank = _rank()
    if rank != 0:
        logs = os.environ.get("MPITENSOR_TEST_LOGS", "logs")
        os.makedirs(logs, exist_ok=True)
        fd = os.open(os.path.join(logs, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return int(pytest.main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
