"""The limits of mpitensor's paths, each defined once: sizes, rank counts and dtype rules.

A transport's ``applies(call)`` and the lanes read these names; the compiled code gets them
when it is bound; the integrations (mpitensor.torch, mpitensor.jax) never restate them, they
call the public collectives and let them choose. Each figure says where it was measured.
"""

from __future__ import annotations

import os

__all__ = [
    "CARRIED_MAX_BYTES", "CHECK_HEADER_BYTES", "COW_BYTES", "GATHERED_CHECK_RANKS", "HELD_INTO_BYTES", "LANE_BYTES",
    "SHARED_MEMORY_MIN_BYTES", "SMALL_BYTES",
]

# Groups of up to this many ranks gather their checks' rows (beyond, gathering every row to
# every rank costs more than the all-reduce of a fixed record it replaces). The environment's
# MPITENSOR_GATHERED_CHECK_RANKS changes it (the same on every rank: the tests use 1 to run the
# large groups' check on a few ranks).
GATHERED_CHECK_RANKS = int(os.environ.get("MPITENSOR_GATHERED_CHECK_RANKS", "8"))
# A check row: the header (agreement hash, per-rank value), then the payload; all-reduces
# whose work buffer fits the payload travel inside the check.
CHECK_HEADER_BYTES = 16
CARRIED_MAX_BYTES = 64
# Up to this size a copy of the input costs less than write-protecting it in flight (and a
# call of a kind repeated takes its lane). Measured at 64 KiB in one process: 1.4 us for the
# copy against 1.7 us to protect the input and release it, plus a result buffer. Above,
# MPICH's in-place all-reduce got slower (2x at 256 KiB on 2 ranks). A held all-reduce in
# place (its caller holds the input) is MPI's in its own memory above this size only.
SMALL_BYTES = 64 << 10
# The largest input a lane (a kind of call remembered after its first) takes. Beyond, the
# general path's planning (10-12 us) is a few percent of the call; and from 512 KiB node
# peers usually reduce through shared memory.
LANE_BYTES = 1 << 20
# From this size a held all-reduce into another buffer is MPI's from the input straight into
# it; below, the lane's fresh result is copied in. Measured on 2 ranks with the check on, at
# 16 KiB: 11.1 against 15.4 us on Open MPI, 12.6 against 12.3 on MPICH, 6.3 against 6.7 on
# Intel MPI; at 64 KiB 12-23 against 13-38 us; at 256 B Open MPI's held call was already
# faster, MPICH's and Intel MPI's slower.
HELD_INTO_BYTES = 16 << 10
# The shared-memory all-reduce's default threshold: below it, MPI's own all-reduce plus the
# direct path's per-call work was faster in every run of the benchmark (2 and 4 ranks, both
# MPIs, 256 KiB); from 512 KiB it mostly wins.
SHARED_MEMORY_MIN_BYTES = 512 << 10
# From this size a torch CPU tensor is sent through a lazy clone rather than copied: below
# it, a copy costs less than the clone and the view built on it (a few microseconds).
COW_BYTES = 64 << 10
