"""A job that ends abnormally leaves none of MPI's files behind.

MPICH removes its shared memory (``/dev/shm/mpich_shm_*``) and Hydra its topology file
(``/tmp/hydra_hwloc_xmlfile_*``) only when a job ends normally. Each test ends a job one way
(a rank killed by SIGKILL during an all-reduce, an uncaught exception, ``ctx.abort()``) and
checks that the job ended, non-zero and soon; that the files its ranks had mapped are gone;
and that no file of those kinds (nor of Open MPI's) appeared during the job and stayed with
no live process using it. Files that other jobs running meanwhile use are left out of the
comparison, and their launchers get a few seconds to remove theirs.
"""

from __future__ import annotations

import glob
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

import mpitensor as mt
from mpitensor._core import mpi as _mpi
from mpitensor._core import shm_cleanup as _shm_cleanup
from tests.helpers import _PREAMBLE, ROOT, ChildResult, _clean_env, _kill_group, run_job

pytestmark = pytest.mark.subprocess

# What MPI libraries leave: MPICH's shared memory and Hydra's topology file; Open MPI's
# shared memory (its launcher removes it unless killed outright).
KINDS = (
    "/dev/shm/mpich_shm_*",
    "/dev/shm/mpich_vci_*",
    "/tmp/hydra_hwloc_xmlfile_*",
    "/dev/shm/sm_segment.*",
    "/dev/shm/vader_segment.*",
)

# Each job first reports the files of those kinds that its rank maps or holds open, and the
# topology file of its Hydra proxy; then the job ends as the case says.
_REPORT_FILES = f"""
import os as _os
import fnmatch as _fnmatch


def _mpi_files(pid="self"):
    paths = set()
    with open(f"/proc/{{pid}}/maps") as maps:
        for line in maps:
            fields = line.rstrip("\\n").split(maxsplit=5)
            if len(fields) == 6:
                paths.add(fields[5])
    for fd in _os.listdir(f"/proc/{{pid}}/fd"):
        try:
            paths.add(_os.readlink(f"/proc/{{pid}}/fd/{{fd}}"))
        except OSError:
            pass
    # " (deleted)": mapped still, but unlinked already
    return sorted(p for p in paths if any(_fnmatch.fnmatch(p, k) for k in {KINDS!r}) and not p.endswith(")"))


def report_files():
    for path in _mpi_files() + [p for p in _mpi_files(_os.getppid()) if "hydra_hwloc" in p]:
        report("file", path)
"""

CASES = {
    "rank_killed_in_all_reduce": """
        import os, signal, time
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            mt.all_reduce(np.ones(8)).resolve()
            report_files()
            mt.all_reduce(np.ones(1)).resolve()  # every rank has reported
            pending = mt.all_reduce(np.ones(1 << 20))
            if ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)
            mt.all_reduce(np.ones(8)).resolve()
            pending.resolve()
        report("unreachable")
        """,
    "uncaught_exception": """
        import numpy as np
        import mpitensor as mt
        capture_stderr()
        with mt.DistributedContext.init() as ctx:
            mt.all_reduce(np.ones(8)).resolve()
            report_files()
            mt.all_reduce(np.ones(1)).resolve()  # every rank has reported
            if ctx.rank == 1:
                raise ValueError("boom on rank 1")
            mt.all_reduce(np.ones(4)).resolve()  # the others wait here for rank 1
        report("unreachable")
        """,
    "ctx_abort": """
        import numpy as np
        import mpitensor as mt
        capture_stderr()
        ctx = mt.DistributedContext.init()
        mt.all_reduce(np.ones(8)).resolve()
        report_files()
        mt.all_reduce(np.ones(1)).resolve()  # every rank has reported
        if ctx.rank == 0:
            ctx.abort(3)
        mt.all_reduce(np.ones(4)).resolve()  # the others wait here for rank 0
        report("unreachable")
        """,
}
NPROCS = 3
BOUND = 30.0  # seconds a job may take to end


def _owned(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False


def _listing() -> set[str]:
    """This user's files of the kinds in KINDS."""
    return {path for pattern in KINDS for path in glob.glob(pattern) if _owned(path)}


def _in_use() -> set[str]:
    """Every path that a live process maps or holds open."""
    used: set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc}/maps") as maps:
                for line in maps:
                    fields = line.rstrip("\n").split(maxsplit=5)
                    if len(fields) == 6:
                        used.add(fields[5])
        except OSError:
            pass
        try:
            fds = os.listdir(f"{proc}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                used.add(os.readlink(f"{proc}/fd/{fd}"))
            except OSError:
                pass
    return used


def _left_behind(before: set[str], grace: float = 5.0) -> set[str]:
    """The files that appeared since `before` and that no live process uses.

    Another job that failed meanwhile may have files in that state for a moment, until its
    launcher removes them: they get `grace` seconds.
    """
    deadline = time.monotonic() + grace
    while True:
        left = _listing() - before
        if left:
            left -= _in_use()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def _check(result: ChildResult, before: set[str]) -> None:
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < BOUND, f"took {result.seconds:.1f} s"
    assert not result.reported("unreachable")
    files = result.reported("file ")
    if not files:
        pytest.skip(f"{_mpi.vendor()[0]} keeps no files in /dev/shm here: nothing to leave")
    ranks_with_files = [rank for rank, lines in result.reports.items() if any(x.startswith("file ") for x in lines)]
    assert len(ranks_with_files) == NPROCS, result.output
    mapped = sorted({line.split(" ", 1)[1] for line in files})
    still_there = [path for path in mapped if os.path.exists(path)]
    assert not still_there, f"the job's files stayed: {still_there}\n{result.output}"
    left = _left_behind(before)
    assert not left, f"files appeared during the job and stayed, unused: {sorted(left)}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_abnormal_end_leaves_no_files(case, tmp_path):
    before = _listing()
    result = run_job(_REPORT_FILES + textwrap.dedent(CASES[case]), NPROCS, timeout=60, tmp_path=tmp_path)
    _check(result, before)


def _run_mpiexec(script: str, nprocs: int, tmp_path: pathlib.Path, timeout: float = 60) -> ChildResult:
    """`script` as a job of `nprocs` ranks, started by the venv's mpiexec itself (MPICH's
    Hydra), without scripts/mpirun.sh: what the ranks remove themselves."""
    directory = tmp_path / "job"
    directory.mkdir()
    path = directory / "job.py"
    path.write_text(_PREAMBLE.format(directory=str(directory)) + textwrap.dedent(script))
    mpiexec = pathlib.Path(sys.executable).parent / "mpiexec"
    command = [str(mpiexec), "-n", str(nprocs), sys.executable, str(path)]
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_clean_env(None),
                              start_new_session=True, check=False, cwd=ROOT)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        _kill_group(exc)
        code, out, err = 124, "", ""
    reports = {int(file.stem[4:]): file.read_text().splitlines() for file in directory.glob("rank*.txt")}
    return ChildResult(code, out, err, time.monotonic() - start, reports)


def _needs_hydra() -> None:
    if _mpi.vendor()[0] != "MPICH" or not (pathlib.Path(sys.executable).parent / "mpiexec").exists():
        pytest.skip("only MPICH (Hydra) leaves files that an aborting rank must remove itself; "
                    "Open MPI's launcher removes its own")


@pytest.mark.parametrize("case", ["uncaught_exception", "ctx_abort"])
def test_an_aborting_rank_removes_the_files_itself(case, tmp_path):
    # Without scripts/mpirun.sh to clean up afterwards (mpiexec run directly, srun), the rank
    # that calls MPI_Abort unlinks the node's shared memory and Hydra's topology file first.
    _needs_hydra()
    if case == "ctx_abort" and "release_job_files" not in mt.DistributedContext.abort.__code__.co_names:
        pytest.skip("DistributedContext.abort() does not call _failfast.release_job_files() yet")
    before = _listing()
    result = _run_mpiexec(_REPORT_FILES + textwrap.dedent(CASES[case]), NPROCS, tmp_path)
    _check(result, before)


def test_unlinked_files_keep_the_job_working(tmp_path):
    # What the abort path relies on: once a rank has unlinked the job's files, every rank's
    # mappings still work (all-reduces small and large), and the job ends normally.
    before = _listing()
    result = run_job(
        _REPORT_FILES
        + textwrap.dedent("""
        import numpy as np
        import mpitensor as mt
        from mpitensor._runtime import failfast as _failfast
        with mt.DistributedContext.init() as ctx:
            mt.all_reduce(np.ones(8)).resolve()
            report_files()
            mt.all_reduce(np.ones(1)).resolve()
            if ctx.rank == 1:
                _failfast.release_job_files()
            mt.all_reduce(np.ones(1)).resolve()
            for path in [p for p in _mpi_files() if "mpich_shm" in p or "sm_segment" in p]:
                report("still named", path)
            big = mt.all_reduce(np.full(1 << 20, float(ctx.rank))).resolve()
            small = mt.all_reduce(np.ones(100)).resolve()
            report("sums", float(big[0]), float(big[-1]), float(small[0]))
        """),
        NPROCS,
        timeout=60,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("sums") == ["sums 3.0 3.0 3.0"] * NPROCS, result.output
    assert not result.reported("still named"), result.output
    assert not [line for line in result.reported("file ") if os.path.exists(line.split(" ", 1)[1])]
    assert not _left_behind(before)


def test_which_paths_count_as_mpi_files():
    paths = [
        "/dev/shm/mpich_shm_7336ad3d_0",
        "/dev/shm/mpich_shm_7336ad3d_0",
        "/dev/shm/mpich_vci_1_0",
        "/dev/shm/sm_segment.vm.0.183f0001.2",
        "/dev/shm/vader_segment.vm.3a.1",
        "/dev/shm/ucx_shm_posix_c2e77ca (deleted)",
        "/dev/shm/mpich_shm_0_0 (deleted)",
        "/dev/shm/other",
        "/tmp/hydra_hwloc_xmlfile_gdnxps",
        "/memfd:mpitensor (deleted)",
        "/usr/lib/libmpi.so.12",
    ]
    assert _shm_cleanup.mpi_files_in(paths) == [
        "/dev/shm/mpich_shm_7336ad3d_0",
        "/dev/shm/mpich_vci_1_0",
        "/dev/shm/sm_segment.vm.0.183f0001.2",
        "/dev/shm/vader_segment.vm.3a.1",
    ]
