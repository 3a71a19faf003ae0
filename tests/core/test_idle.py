"""MPI's blocking calls give the core back: Open MPI's progress yields around each blocking call mpitensor makes."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core import idle
from mpitensor._core.mpi import vendor


def test_a_blocking_call_yields_while_it_waits_and_the_setting_comes_back():
    with mt.DistributedContext.init() as ctx:
        setter = idle.open_mpi_setter()
        if vendor()[0] != "Open MPI" or "OMPI_MCA_mpi_yield_when_idle" in os.environ:
            assert setter is None
            pytest.skip("not Open MPI (MPICH's progress yields by itself), or the program set Open MPI's choice")
        assert setter is not None, "Open MPI exports its setter"
        before = idle.open_mpi_yields()
        seen = []
        with idle.yielding():
            seen.append(idle.open_mpi_yields())
        assert seen == [True], "Open MPI's progress yields inside"
        assert idle.open_mpi_yields() == before, "and the setting comes back after"
        for _ in range(3):  # held calls: MPI's blocking all-reduce, the first in Python, the later ones compiled
            result = mt.all_reduce(np.ones(20_000), held=True).resolve().numpy()
            np.testing.assert_array_equal(result, np.full(20_000, float(ctx.size)))
        assert idle.open_mpi_yields() == before
