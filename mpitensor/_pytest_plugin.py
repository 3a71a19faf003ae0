"""The pytest plugin that ships with mpitensor (registered as a ``pytest11`` entry point).

A test suite opens and closes many contexts in one process, and MPI cannot be initialized
twice, so under pytest MPI is finalized at interpreter exit instead of when the last
context closes. When the tests run under an MPI launcher or with ``--with-mpi``
(pytest-mpi), MPI is initialized at start-up, before pytest-mpi first asks for the size.
"""

from __future__ import annotations

import os

import pytest

_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")


def _launched_by_mpi() -> bool:
    return any(name in os.environ for name in _LAUNCHER_VARIABLES)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Defer finalization to exit; initialize MPI if the run is an MPI run."""
    from ._core import mpi as _mpi

    _mpi.defer_finalize()
    with_mpi = False
    try:
        with_mpi = bool(config.getoption("with_mpi"))
    except ValueError:
        pass
    if with_mpi or _launched_by_mpi():
        _mpi.ensure_initialized()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line naming the MPI library, its thread level and the world size."""
    from ._core import mpi as _mpi

    name, version = _mpi.vendor()
    line = f"mpitensor: {name} {version}"
    if _mpi.MPI.Is_initialized() and not _mpi.MPI.Is_finalized():
        line += f", {_mpi.MPI.COMM_WORLD.Get_size()} rank(s), thread level {_mpi.thread_level_name()}"
    return [line]
