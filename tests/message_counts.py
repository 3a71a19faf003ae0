"""Messages each rank sends in a child job, counted by Open MPI's PML monitoring.

Open MPI counts every message its point-to-point layer carries (those of collectives
included) when a job runs with ``--mca pml_monitoring_enable 2``, and writes each rank's
counts to ``FILE.<rank>.prof`` at ``MPI_Finalize`` (``pml_monitoring_enable_output 3``).
No PMPI wrapper and nothing in the program: the job is the program as it is.

What one operation costs is the difference between two jobs that differ only by it: a job
that opens a context, does the operation and closes it, and the same job without the
operation (`count_difference`). Used by tests/runtime/test_scale.py and by
``scripts/message_counts.py``, which prints the table of docs/cluster.md.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from tests.helpers import ChildResult, run_job

# One line of a .prof file's point-to-point part: kind (E: the program's own messages,
# I: those of collectives), source, destination, bytes, messages, then a size histogram.
_LINE = re.compile(r"^([EI])\t(\d+)\t(\d+)\t(\d+) bytes\t(\d+) msgs sent")

_MONITOR = {
    "OMPI_MCA_pml_monitoring_enable": "2",
    "OMPI_MCA_pml_monitoring_enable_output": "3",
}


def monitoring_available(python: str = sys.executable) -> str | None:
    """None where the venv's MPI is Open MPI with PML monitoring; else why not, in words."""
    info = pathlib.Path(python).parent / "ompi_info"
    if not info.exists():
        return "the MPI of this venv is not Open MPI (no ompi_info): PML monitoring is Open MPI's"
    try:
        text = subprocess.run([str(info), "--parsable", "--all"], capture_output=True, text=True, timeout=60,
                              check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ompi_info failed: {exc}"
    if "pml_monitoring_enable" not in text:
        return "this Open MPI has no PML monitoring component (pml_monitoring_enable)"
    return None


@dataclass
class Counts:
    """Messages each rank sent in one job, by rank in ``MPI_COMM_WORLD``.

    Attributes:
        messages: every message (both kinds).
        own: the point-to-point messages the program posted (Open MPI's "E" lines:
            mpitensor's own notes, e.g. the creation tree's).
        bytes: the bytes of every message.
        job: the job's outcome.
    """

    messages: dict[int, int]
    own: dict[int, int]
    bytes: dict[int, int]
    job: ChildResult

    def __sub__(self, other: Counts) -> dict[int, int]:
        """Messages per rank this job sent beyond `other`."""
        return {rank: self.messages[rank] - other.messages.get(rank, 0) for rank in self.messages}

    def own_beyond(self, other: Counts) -> dict[int, int]:
        """Point-to-point messages of the program per rank this job sent beyond `other`."""
        return {rank: self.own[rank] - other.own.get(rank, 0) for rank in self.own}


def parse_prof(text: str) -> tuple[int, int, int]:
    """What a rank's .prof file says it sent: messages, of which the program's own, and bytes."""
    messages = own = sent = 0
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            sent += int(match.group(4))
            messages += int(match.group(5))
            if match.group(1) == "E":
                own += int(match.group(5))
    return messages, own, sent


def count_messages(script: str, nprocs: int, tmp_path: pathlib.Path, timeout: float = 120,
                   env: Mapping[str, str] | None = None) -> Counts:
    """Run `script` as a job of `nprocs` ranks with PML monitoring on; what each rank sent.

    Args:
        script: the job's Python source (``report(...)`` is defined for it, see `run_job`).
        nprocs: how many ranks (oversubscribed where there are fewer cores).
        tmp_path: a directory for the job's files.
        timeout: seconds before the job is killed.
        env: more environment variables for the job.

    Returns:
        The counts of every rank.

    Raises:
        AssertionError: the job failed, or a rank wrote no counts.
    """
    prefix = tmp_path / f"monitor_{nprocs}_{len(list(tmp_path.glob('monitor_*')))}"
    prefix.mkdir()
    variables = {**_MONITOR, "OMPI_MCA_pml_monitoring_filename": str(prefix / "counts"), **(env or {})}
    job = run_job(script, nprocs, timeout=timeout, env=variables, tmp_path=tmp_path)
    assert job.returncode == 0, job.output
    messages, own, sizes = {}, {}, {}
    for rank in range(nprocs):
        path = prefix / f"counts.{rank}.prof"
        assert path.exists(), f"rank {rank} wrote no counts ({path}):\n{job.output}"
        messages[rank], own[rank], sizes[rank] = parse_prof(path.read_text())
    return Counts(messages, own, sizes, job)


def count_difference(script: str, baseline: str, nprocs: int, tmp_path: pathlib.Path, repeats: int = 1,
                     timeout: float = 120, env: Mapping[str, str] | None = None) -> dict[int, int]:
    """Messages per rank that `script` sends beyond `baseline`, divided by `repeats` (rounded up).

    Args:
        script: the job with the operation (done `repeats` times).
        baseline: the same job without it.
        nprocs: how many ranks.
        tmp_path: a directory for the jobs' files.
        repeats: how many times `script` does the operation.
        timeout: seconds before each job is killed.
        env: more environment variables for both jobs.
    """
    extra = count_messages(script, nprocs, tmp_path, timeout, env) - count_messages(baseline, nprocs, tmp_path,
                                                                                     timeout, env)
    return {rank: -(-count // repeats) for rank, count in extra.items()}


# -- the operations of docs/cluster.md's table ---------------------------------------------------

_JOB = """
import time
import numpy as np
import mpitensor as mt

with mt.DistributedContext.init(config=mt.DistributedConfig({config})) as ctx:
    mt.all_reduce(np.ones(1)).resolve()  # warm-up, in the baseline too
{body}
"""


def _job(body: str, config: str = "") -> str:
    return _JOB.format(body="\n".join("    " + line for line in body.strip().splitlines()), config=config)


@dataclass(frozen=True)
class Scenario:
    """One operation to count: its job, the job without it, and how many times the job does it."""

    name: str
    what: str
    script: str
    baseline: str
    repeats: int = 1
    env: Mapping[str, str] | None = None


_CALLS = 10
_ONE_CALL = "mt.all_reduce(np.ones(1)).resolve()"
_LATE_CONFIG = "check_grace=0.1, timeout=300"

SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        Scenario("all_reduce", "a checked 8-byte all-reduce (per call)",
                 _job(f"for _ in range({_CALLS}):\n    {_ONE_CALL}"), _job("pass"), _CALLS),
        Scenario("sub_group", "creating a sub-group (the even ranks)",
                 _job("evens = [d for d in ctx.devices if d.rank % 2 == 0]\n"
                      "if ctx.device in evens:\n    ctx.group(evens)"), _job("pass")),
        # The call waits for its check up to check_grace (1 s by default), then resolve()
        # waits, and the diagnosis of waits speaks after 0.5 s of that: a short grace, so
        # that a rank 1 s late is a wait the diagnosis sees. A timeout, so that resolve()
        # waits in Python, where the diagnosis runs (without one, the compiled lane's
        # resolve waits inside MPI).
        Scenario("late_rank", "one rank 1 s late for a checked all-reduce",
                 _job(f"if ctx.rank == ctx.size - 1:\n    time.sleep(1.0)\n{_ONE_CALL}", _LATE_CONFIG),
                 _job(_ONE_CALL, _LATE_CONFIG)),
    )
}


def scenario_counts(scenario: Scenario, nprocs: int, tmp_path: pathlib.Path, timeout: float = 120,
                    env: Mapping[str, str] | None = None) -> dict[int, int]:
    """Messages per rank that one `scenario` operation sends at `nprocs` ranks."""
    variables = {**(scenario.env or {}), **(env or {})}
    return count_difference(scenario.script, scenario.baseline, nprocs, tmp_path, scenario.repeats, timeout, variables)


# MPI's own cost of what a sub-group's creation does (MPI_Comm_create_group over the even
# ranks, and the two duplicates a group holds beside it), without mpitensor: the reference
# the creation is held to.
MPI_SUB_GROUP = """
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
if comm.Get_rank() % 2 == 0:
    group = comm.Get_group().Incl(list(range(0, comm.Get_size(), 2)))
    sub = comm.Create_group(group, 7)
    group.Free()
    copies = [sub.Dup(), sub.Dup()]
    for made in (*copies, sub):
        made.Free()
comm.Free()
"""
MPI_NOTHING = """
from mpi4py import MPI

MPI.COMM_WORLD.Dup().Free()
"""
