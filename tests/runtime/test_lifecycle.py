"""MPI's lifecycle, checked in child jobs launched as a user would launch them."""

from __future__ import annotations

import pytest

from tests.helpers import run_job

pytestmark = pytest.mark.subprocess


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_with_block_initializes_and_finalizes_mpi(tmp_path, nprocs):
    result = run_job(
        """
        import sys
        import numpy as np
        import mpitensor as mt
        assert "mpi4py.MPI" not in sys.modules, "importing mpitensor must not import mpi4py.MPI"
        def mpi():  # not bound in this module: a module holding mpi4py.MPI keeps MPI up
            return sys.modules["mpi4py.MPI"]
        with mt.DistributedContext.init() as ctx:
            assert mpi().Is_initialized() and not mpi().Is_finalized()
            total = mt.all_reduce(np.ones(2)).resolve()
        report("finalized", mpi().Is_finalized(), total.numpy().tolist())
        """,
        nprocs,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("finalized") == [f"finalized True [{float(nprocs)}, {float(nprocs)}]"] * nprocs


def test_a_context_after_finalization_is_a_clear_error(tmp_path):
    result = run_job(
        """
        import mpitensor as mt
        with mt.DistributedContext.init():
            pass
        try:
            mt.DistributedContext.init()
        except mt.MpiFinalizedError as exc:
            report("error:", exc)
        """,
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    errors = result.reported("error:")
    assert len(errors) == 2
    for line in errors:
        assert line.startswith("error: MPI was already finalized in this process")
        assert "mpitensor.defer_finalize()" in line


def test_a_program_that_initialized_mpi_keeps_ownership(tmp_path):
    result = run_job(
        """
        from mpi4py import MPI  # initializes MPI: the program owns it
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init():
            mt.all_reduce(np.ones(1)).resolve()
        report("after", MPI.Is_finalized())
        with mt.DistributedContext.init():
            mt.barrier()
        MPI.Finalize()
        report("done", MPI.Is_finalized())
        """,
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("after") == ["after False"] * 2
    assert result.reported("done") == ["done True"] * 2


@pytest.mark.parametrize("how", ["call", "env"])
def test_deferred_finalization_lets_contexts_reopen(tmp_path, how):
    result = run_job(
        f"""
        import atexit
        import numpy as np
        import mpitensor as mt
        from mpi4py import MPI
        if {how!r} == "call":
            mt.defer_finalize()
        for i in range(3):
            with mt.DistributedContext.init() as ctx:
                mt.all_reduce(np.ones(1)).resolve()
            assert not MPI.Is_finalized()
        atexit.register(lambda: report("at exit finalized:", MPI.Is_finalized()))
        report("reopened")
        """,
        2,
        env={"MPITENSOR_FINALIZE": "exit"} if how == "env" else None,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("reopened") == ["reopened"] * 2
    # The script's exit hook runs before mpitensor's (registered earlier, runs later).
    assert result.reported("at exit") == ["at exit finalized: False"] * 2


def test_import_never_needs_cupy_or_mpi(tmp_path):
    result = run_job(
        """
        import sys
        import mpitensor
        import mpitensor.torch
        report("cupy" in sys.modules, "mpi4py.MPI" in sys.modules)
        """,
        1,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("") == ["False False"]
