"""Messages per rank of the operations that must scale, counted by Open MPI at 4, 8 and 16 ranks.

Each count is Open MPI's own (PML monitoring, see tests/message_counts.py): the job with
the operation minus the job without it, the most any rank sent. A count per rank that grows
faster than c * log2(N) fails, where a pattern in which ranks talk to every rank grows as N.
The table in docs/cluster.md comes from ``scripts/message_counts.py``.
"""

from __future__ import annotations

import math

import pytest

from tests.message_counts import (
    MPI_NOTHING,
    MPI_SUB_GROUP,
    SCENARIOS,
    count_messages,
    monitoring_available,
)

pytestmark = pytest.mark.subprocess

SIZES = (4, 8, 16)
LATE_SIZE = 16

_why_not = monitoring_available()
if _why_not is not None:
    pytestmark = [pytestmark, pytest.mark.skip(reason=_why_not)]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The job without any operation, at each size (shared by the scenarios)."""
    directory = tmp_path_factory.mktemp("baselines")
    return {size: count_messages(SCENARIOS["all_reduce"].baseline, size, directory) for size in SIZES}


def _most(counts: dict[int, int]) -> int:
    return max(counts.values())


def test_a_checked_small_all_reduce_sends_log_n_messages_per_rank(baselines, tmp_path):
    scenario = SCENARIOS["all_reduce"]
    per_call = {}
    for size in SIZES:
        extra = count_messages(scenario.script, size, tmp_path) - baselines[size]
        per_call[size] = -(-_most(extra) // scenario.repeats)
    # The check and the data: each O(log2 N) at most (an all-gather of rows below 9 ranks).
    for size, count in per_call.items():
        assert count <= 3 * math.log2(size), per_call


def test_creating_a_sub_group_costs_mpi_own_creation_and_log_g_notes(baselines, tmp_path):
    scenario = SCENARIOS["sub_group"]
    for size in SIZES:
        job = count_messages(scenario.script, size, tmp_path)
        extra = job - baselines[size]
        mpi_job = count_messages(MPI_SUB_GROUP, size, tmp_path)
        mpi_nothing = count_messages(MPI_NOTHING, size, tmp_path)
        own = mpi_job - mpi_nothing
        # Point-to-point messages beyond MPI's own (MPI_Comm_create_group sends some too):
        # mpitensor's notes, the creation tree's, at most 1 + log2(G) per member, where
        # greeting every member would be G - 1.
        mpi_point_to_point = mpi_job.own_beyond(mpi_nothing)
        notes = {rank: count - mpi_point_to_point[rank] for rank, count in job.own_beyond(baselines[size]).items()}
        members = size // 2
        assert _most(notes) <= 1 + math.log2(members), (size, notes)
        for rank, count in extra.items():
            assert count <= own[rank] + 1 + math.log2(members), (size, rank, extra, own)
        assert _most(extra) <= 10 * math.log2(size), (size, extra)


def test_a_rank_late_by_one_second_costs_its_peers_log_n_messages(tmp_path):
    scenario = SCENARIOS["late_rank"]
    job = count_messages(scenario.script, LATE_SIZE, tmp_path, env=scenario.env)
    baseline = count_messages(scenario.baseline, LATE_SIZE, tmp_path, env=scenario.env)
    extra = job - baseline
    # No note from rank to rank (the diagnosis's rounds are collectives), where every peer
    # of the late rank sent one to every rank.
    assert _most(job.own_beyond(baseline)) == 0, job.own
    assert _most(extra) <= 2 * math.log2(LATE_SIZE), extra
