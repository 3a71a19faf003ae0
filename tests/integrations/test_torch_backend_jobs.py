"""The "mpitensor" torch backend as a script meets it: child jobs of 2 ranks under mpiexec.

``init_process_group("mpitensor")`` with nothing set, its timeout, a torchrun-style world
size that is not MPI's, and monitored_barrier naming the rank that never came.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_job

pytest.importorskip("torch")
pytestmark = pytest.mark.subprocess

START = """
import os, time, datetime
import torch
import torch.distributed as dist
import mpitensor.torch
"""


def script(body: str) -> str:
    """A child job's source: the imports, then `body`."""
    return START + textwrap.dedent(body)


def test_init_needs_nothing_but_mpiexec(tmp_path):
    result = run_job(
        script("""
        report("env", [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v in os.environ])
        dist.init_process_group("mpitensor")
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        report("sum", dist.get_rank(), dist.get_world_size(), t.tolist())
        dist.destroy_process_group()
        import mpitensor as mt
        try:
            mt.current_context()
        except mt.NoContextError:
            report("closed", True)
        """),
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("env") == ["env []"] * 2
    assert result.reported("sum") == ["sum 0 2 [3.0, 3.0, 3.0]", "sum 1 2 [3.0, 3.0, 3.0]"], result.output
    # The context opened for the process group closes with it.
    assert result.reported("closed") == ["closed True"] * 2


def test_a_world_size_that_is_not_mpis_is_refused_on_every_rank(tmp_path):
    result = run_job(
        script("""
        try:
            dist.init_process_group("mpitensor")
        except RuntimeError as exc:
            report("refused", "mpiexec or srun" in str(exc), "world_size=5" in str(exc))
        """),
        2,
        env={"WORLD_SIZE": "5"},
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("refused") == ["refused True True"] * 2, result.output


def test_the_init_timeout_ends_a_wait_for_a_rank_that_never_comes(tmp_path):
    result = run_job(
        script("""
        import mpitensor as mt
        dist.init_process_group("mpitensor", timeout=datetime.timedelta(seconds=2))
        if dist.get_rank() == 0:
            began = time.monotonic()
            try:
                dist.all_reduce(torch.ones(2))
            except mt.MpitensorError as exc:
                report("error", type(exc).__name__, round(time.monotonic() - began) <= 5)
            os._exit(0)
        time.sleep(6)
        os._exit(0)
        """),
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.reported("error") == ["error CollectiveTimeoutError True"], result.output


def test_monitored_barrier_names_the_rank_that_did_not_arrive(tmp_path):
    result = run_job(
        script("""
        dist.init_process_group("mpitensor")
        if dist.get_rank() == 0:
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=1))
            except RuntimeError as exc:
                report("error", str(exc))
        else:
            time.sleep(3)
        os._exit(0)
        """),
        2,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.reported("error") == ["error [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"], \
        result.output
