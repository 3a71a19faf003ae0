"""The files an MPI library keeps for a job, removed by a rank when the job ends abnormally.

MPICH keeps the shared memory of a node's ranks in ``/dev/shm/mpich_shm_*`` (and
``mpich_vci_*``), and Hydra's proxy writes the node's topology to
``/tmp/hydra_hwloc_xmlfile_*``; both are removed only when the job ends normally, so every
``MPI_Abort`` leaves them behind. Open MPI's shared memory (``/dev/shm/sm_segment.*``,
``vader_segment.*`` in 4.x) is removed by its launcher, except for a process that started
MPI without one (a singleton), which leaves its segment whenever it ends.

A rank about to call ``MPI_Abort`` unlinks the files of those kinds that it maps or holds
open (found in ``/proc/self/maps`` and ``/proc/self/fd``) and the topology file its Hydra
proxy holds open. Unlinking removes only the name: every mapping stays valid until its
process ends, and the job is ending. A launcher script removes the rest (the files of a
rank killed by a signal: scripts/mpirun.sh). Nothing here raises; where ``/proc`` is
missing it does nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

__all__ = ["job_files", "mpi_files_in", "release_singleton_files", "unlink_job_files"]

# The names MPI libraries give their shared memory in /dev/shm.
_SHARED_MEMORY = re.compile(r"^/dev/shm/(mpich_shm_|mpich_vci_|sm_segment\.|vader_segment\.)[^/]+$")
_OPEN_MPI_SHARED_MEMORY = re.compile(r"^/dev/shm/(sm_segment\.|vader_segment\.)[^/]+$")
_HYDRA_TOPOLOGY = re.compile(r"^/tmp/hydra_hwloc_xmlfile_[^/]+$")
_HYDRA_PROXY = "hydra_pmi_proxy"


def mpi_files_in(paths: Iterable[str], pattern: re.Pattern[str] = _SHARED_MEMORY) -> list[str]:
    """The paths among `paths` that name MPI shared memory, each once, in order.

    Args:
        paths: file paths, as ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` show them; a path
            that ends in `` (deleted)`` is already unlinked and is left out.
        pattern: which names count (the shared memory of MPICH and Open MPI by default).

    Returns:
        The matching paths.
    """
    found: dict[str, None] = {}
    for path in paths:
        if not path.endswith(" (deleted)") and pattern.match(path):
            found.setdefault(path)
    return list(found)


def _mapped(pid: str) -> list[str]:
    """The files that process `pid` maps (``/proc/<pid>/maps``: the path is the sixth field)."""
    paths = []
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6:
                    paths.append(fields[5])
    except OSError:
        pass
    return paths


def _open_files(pid: str) -> list[str]:
    """The files that process `pid` holds open (where ``/proc/<pid>/fd`` links point)."""
    paths = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return paths
    for name in names:
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            pass
    return paths


def _hydra_topology_files() -> list[str]:
    """The topology file of this rank's Hydra proxy (its parent), if that is the parent."""
    parent = str(os.getppid())
    try:
        with open(f"/proc/{parent}/comm", encoding="utf-8") as comm:
            if comm.read().strip() != _HYDRA_PROXY:
                return []
    except OSError:
        return []
    return mpi_files_in(_open_files(parent), _HYDRA_TOPOLOGY)


def job_files() -> list[str]:
    """The MPI files of this job that this process can name: the ones to remove on abort.

    Returns:
        The shared-memory files this process maps or holds open, then its Hydra proxy's
        topology file (MPICH under Hydra only).
    """
    return mpi_files_in(_mapped("self") + _open_files("self")) + _hydra_topology_files()


def _unlink(paths: Iterable[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            continue  # gone already (another rank was first), or not ours
        removed.append(path)
    return removed


def unlink_job_files() -> list[str]:
    """Unlink `job_files()`: call it only when the whole job is about to end (``MPI_Abort``).

    The other ranks keep their mappings; a rank that opened such a file by name only after
    this (none does once the job has started) would not find it.

    Returns:
        The paths this call removed.
    """
    try:
        return _unlink(job_files())
    except Exception:
        return []


def release_singleton_files() -> list[str]:
    """Unlink an Open MPI singleton's shared memory, which nothing else would remove.

    Meant to run just before ``MPI_Finalize``. A process that started MPI without a launcher
    (no ``OMPI_COMM_WORLD_SIZE`` nor ``PMIX_RANK`` in its environment) is the only process
    of its job on this node, so nobody else maps its segment. Under a launcher it does
    nothing: the launcher removes the job's files.

    Returns:
        The paths this call removed.
    """
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ:
        return []
    try:
        return _unlink(mpi_files_in(_mapped("self"), _OPEN_MPI_SHARED_MEMORY))
    except Exception:
        return []
