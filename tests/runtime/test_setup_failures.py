"""A context's setup that fails on some ranks fails on every rank, promptly, naming them: never a hang."""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess

# Every case ends well within this; a setup that left a rank waiting would run into the job's time limit.
PROMPT_S = 30

# What each rank does after the failed init: a new context whose all-reduce is compared with NumPy's
# sum of every rank's input, so nothing of the failed one was left half open.
_NEXT_CONTEXT = """
with mt.DistributedContext.init() as ctx:
    inputs = [np.arange(3.0) * (r + 1) for r in range(ctx.size)]
    total = mt.all_reduce(inputs[ctx.rank]).resolve().numpy()
    report("next", np.array_equal(total, np.sum(inputs, axis=0)))
"""


def _failed_init(setup: str, before_next: str = "") -> str:
    """A job whose ranks open a context after `setup` (which defines `config`), report what init raised, go on.

    `before_next` runs between the failed init and the next context.
    """
    return f"""
import os
import sys
import numpy as np
import mpitensor as mt
rank = int(_rank())  # from the launcher's environment: MPI is not initialized before init
{setup}
try:
    mt.DistributedContext.init(config=config)
    report("opened")
except Exception as exc:
    report("raised", type(exc).__name__, "|", str(exc).replace(chr(10), " "))
{before_next}
{_NEXT_CONTEXT}
"""


def _raised(result, rank: int) -> tuple[str, str]:
    line = next(line for line in result.reports.get(rank, []) if line.startswith("raised "))
    kind, _, message = line[len("raised "):].partition(" | ")
    return kind, message


def test_a_trace_path_that_is_a_directory_fails_on_every_rank_with_what_to_do(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    result = run_job(_failed_init(f"config = mt.DistributedConfig(trace={str(folder)!r})"), 2, timeout=120,
                     tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    own = (f"trace={str(folder)!r} is a directory on rank 0; pass the path of the file to write, "
           f"such as {str(folder / 'trace.json')!r}")
    assert _raised(result, 0) == ("ValueError", own)
    assert _raised(result, 1) == (
        "ValueError", f"DistributedContext.init failed on other ranks, so it fails on this rank too: rank 0: {own}"
    )
    assert not result.reported("opened")
    assert result.reported("next") == ["next True"] * 2
    assert folder.is_dir() and not list(folder.iterdir())  # nothing written into it, nothing removed


def test_an_uncaught_setup_failure_ends_the_job_promptly(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    result = run_job(
        f"""
        import mpitensor as mt
        capture_stderr()
        mt.DistributedContext.init(config=mt.DistributedConfig(trace={str(folder)!r}))
        report("unreachable")
        """,
        2,
        timeout=120,
        tmp_path=tmp_path,
    )
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    assert f"ValueError: trace={str(folder)!r} is a directory on rank 0" in result.stderr, result.output
    assert "ValueError: DistributedContext.init failed on other ranks, so it fails on this rank too: rank 0: " \
        in result.stderr, result.output
    assert not result.reported("unreachable")


def test_a_ring_that_cannot_be_allocated_on_one_rank_fails_every_rank_with_its_size(tmp_path):
    # Rank 1 alone asks for 2**32 events, under an address-space limit that no ring of that size
    # fits (88 bytes an event: 378 GB); rank 0's setup goes well, and it learns of rank 1's failure.
    path = tmp_path / "trace.json"
    setup = f"""
import resource
mt.defer_finalize()
with mt.DistributedContext.init():  # MPI is up before the limit, so that only the ring meets it
    pass
config = mt.DistributedConfig(trace={str(path)!r}, trace_events=2**32 if rank == 1 else 64)
if rank == 1:
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + (4 << 30), resource.RLIM_INFINITY))
"""
    result = run_job(_failed_init(setup), 2, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    own = ("trace_events=4294967296: the ring of 4294967296 events (377957122048 bytes, 88 per event) cannot be "
           "allocated; lower trace_events (the default, 16384, takes 1441792 bytes), or pass 0 to keep every "
           "event in storage that grows with the run")
    assert _raised(result, 1) == ("MemoryError", own)
    assert _raised(result, 0) == (
        "MemoryError", f"DistributedContext.init failed on other ranks, so it fails on this rank too: rank 1: {own}"
    )
    assert result.reported("next") == ["next True"] * 2


def test_a_bad_setting_on_one_rank_and_another_failure_on_the_other_name_both(tmp_path):
    # Rank 1 has a bad MPITENSOR_TIMEOUT, rank 0 a trace folder that does not exist: each rank
    # raises the lowest failing rank's class, its own error first, and names the other's.
    missing = tmp_path / "no" / "trace.json"
    setup = f"""
if rank == 1:
    os.environ["MPITENSOR_TIMEOUT"] = "soon"
config = mt.DistributedConfig(trace={str(missing)!r})
"""
    result = run_job(_failed_init(setup, "os.environ.pop('MPITENSOR_TIMEOUT', None)"), 2, timeout=120,
                     tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    trace = (f"trace={str(missing)!r}: the folder {missing.parent} does not exist on rank 0; create it or trace "
             "elsewhere")
    timeout = "MPITENSOR_TIMEOUT must be a positive number of seconds, got 'soon'"
    assert _raised(result, 0) == ("ValueError", f"{trace} (and rank 1: {timeout})")
    assert _raised(result, 1) == ("ValueError", f"{timeout} (and rank 0: {trace})")
    assert result.reported("next") == ["next True"] * 2


def test_ranks_that_fail_alike_are_named_once_at_three_ranks(tmp_path):
    # progress=True under a thread level that cannot have a progress thread fails ranks 0 and 1;
    # rank 2 fails first on its bad MPITENSOR_TIMEOUT.
    setup = """
if rank == 2:
    os.environ["MPITENSOR_TIMEOUT"] = "-1"
config = mt.DistributedConfig(progress=True)
"""
    result = run_job(_failed_init(setup, "os.environ.pop('MPITENSOR_TIMEOUT', None)"), 3, timeout=120,
                     tmp_path=tmp_path, env={"MPITENSOR_THREAD_LEVEL": "serialized"})
    assert result.returncode == 0, result.output
    assert result.seconds < PROMPT_S, f"took {result.seconds:.1f} s"
    progress = ("DistributedConfig(progress=True) needs MPI_THREAD_MULTIPLE, but MPI provides serialized; unset "
                "MPITENSOR_THREAD_LEVEL or use progress=False")
    timeout = "MPITENSOR_TIMEOUT must be a positive number of seconds, got '-1'"
    assert _raised(result, 0) == ("ValueError", f"{progress} (likewise on rank 1) (and rank 2: {timeout})")
    assert _raised(result, 1) == ("ValueError", f"{progress} (likewise on rank 0) (and rank 2: {timeout})")
    assert _raised(result, 2) == ("ValueError", f"{timeout} (and ranks 0, 1: {progress})")
    assert result.reported("next") == ["next True"] * 3
