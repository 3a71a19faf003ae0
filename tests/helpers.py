"""Shared test helpers: every rank's inputs from seeds, NumPy references, child jobs."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

import mpitensor as mt

ROOT = pathlib.Path(__file__).resolve().parents[1]
OP = mt.ReduceOperation

SIGNED = [np.int8, np.int16, np.int32, np.int64]
UNSIGNED = [np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]
COMPLEX = [np.complex64, np.complex128]
ALL_DTYPES = [np.bool_, *SIGNED, *UNSIGNED, *FLOATS, *COMPLEX]
SHAPES = [(), (0,), (7,), (3, 4), (2, 3, 5)]

_UFUNCS = {OP.SUM: np.add, OP.PROD: np.multiply, OP.MAX: np.maximum, OP.MIN: np.minimum,
           OP.BAND: np.bitwise_and, OP.BOR: np.bitwise_or, OP.BXOR: np.bitwise_xor}
BITWISE = [OP.BAND, OP.BOR, OP.BXOR]
ARITHMETIC = [op for op in OP if op not in BITWISE]


def rejects(op: mt.ReduceOperation, dtype: np.dtype | type) -> bool:
    """True when reducing `dtype` with `op` raises TypeError: a bitwise op on a non-integer type."""
    return op in BITWISE and np.dtype(dtype).kind not in "biu"


def every_rank_settings(max_examples: int) -> settings:
    """Hypothesis settings under which every rank draws the same examples.

    Derandomized and without a database, so the ranks agree; without shrinking, since a
    rank may not stop early while the others go on.
    """
    return settings(
        derandomize=True,
        database=None,
        max_examples=max_examples,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def seed_of(*parts: object) -> int:
    """A seed from test parameters, equal in every process (str hashes are not)."""
    return zlib.crc32(repr(parts).encode())


def rank_input(seed: int, rank: int, shape: Sequence[int], dtype: np.dtype | type) -> np.ndarray:
    """Rank `rank`'s input for test `seed`: the same on every rank that computes it.

    Values are small (|x| <= 3 for integers) so that PROD over 4 ranks fits int8.
    """
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind == "u":
        return np.asarray(rng.integers(0, 4, shape)).astype(dtype)
    if dtype.kind == "i":
        return np.asarray(rng.integers(-3, 4, shape)).astype(dtype)
    if dtype.kind == "c":
        return np.asarray(rng.uniform(-1, 1, shape) + 1j * rng.uniform(-1, 1, shape)).astype(dtype)
    return np.asarray(rng.uniform(-1, 1, shape)).astype(dtype)


def reference(op: mt.ReduceOperation, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """What reducing `arrays` element-wise with `op` gives, by NumPy's rules."""
    if op is OP.MEAN:
        if arrays[0].dtype.kind in "biu":
            return np.mean(np.stack(arrays).astype(np.float64), axis=0)
        return functools.reduce(np.add, arrays) / np.asarray(len(arrays), dtype=arrays[0].dtype.type(0).real.dtype)
    return functools.reduce(_UFUNCS[op], arrays)


def tolerance(dtype: np.dtype, count: int) -> float:
    """A bound on the rounding difference of two summation orders of `count` values."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fc":
        return 0.0
    eps = float(np.finfo(dtype).eps)
    return 4 * eps * max(count, 2)


def assert_matches(result: mt.Tensor | np.ndarray, expected: np.ndarray, op: mt.ReduceOperation | None = None,
                   count: int = 1) -> None:
    """`result` equals `expected` in shape and dtype, exactly for integers and selections,
    to round-off for float sums and products."""
    got = np.asarray(result)
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype, f"dtype {got.dtype} != {expected.dtype}"
    exact = expected.dtype.kind not in "fc" or op in (OP.MAX, OP.MIN)
    if exact:
        np.testing.assert_array_equal(got, expected)
    else:
        tol = tolerance(expected.dtype, count)
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


@dataclass
class ChildResult:
    """What a child job did: exit status, output, wall time, and each rank's reports.

    Child scripts call ``report(...)`` (defined for them) to record a line; reports go to
    one file per rank, so ranks' lines never interleave as launcher output can.
    """

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    reports: dict[int, list[str]]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr + "".join(f"\n[report {r}] {lines}" for r, lines in self.reports.items())

    def reported(self, prefix: str) -> list[str]:
        """Every rank's report lines that start with `prefix`, in rank order."""
        return [line for rank in sorted(self.reports) for line in self.reports[rank] if line.startswith(prefix)]


_PREAMBLE = """\
import os as _os


def _rank():
    return _os.environ.get("OMPI_COMM_WORLD_RANK") or _os.environ.get("PMI_RANK") or "0"


def report(*parts):
    with open(_os.path.join({directory!r}, "rank" + _rank() + ".txt"), "a") as _file:
        _file.write(" ".join(str(part) for part in parts) + "\\n")


def capture_stderr():
    # A launcher that kills the job may drop what a rank wrote to stderr last; a file keeps it.
    import sys as _sys

    _sys.stderr = open(_os.path.join({directory!r}, "stderr" + _rank() + ".txt"), "w", buffering=1)


"""


def _clean_env(extra: dict[str, str] | None) -> dict[str, str]:
    # A child job must not inherit this process's own MPI launch (pytest may itself run
    # as a singleton MPI process).
    prefixes = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "MPI_LOCAL", "MPIR_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPITENSOR_TIMEOUT", None)
    env.pop("MPITENSOR_FINALIZE", None)
    if extra:
        env.update(extra)
    return env


def run_job(script: str, nprocs: int, timeout: float = 60, env: dict[str, str] | None = None,
            tmp_path: pathlib.Path | None = None, fault_tolerant: bool = False) -> ChildResult:
    """Run `script` (Python source) as a job of `nprocs` ranks under this venv's mpiexec.

    The job is killed after `timeout` seconds (the result then has returncode 124).
    `fault_tolerant` launches it to survive the loss of a rank (``scripts/mpirun.sh
    --fault-tolerant``: Open MPI's ``--with-ft ulfm``; other MPIs launch as usual).
    """
    base = tmp_path if tmp_path is not None else pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    directory = base / f"job_{os.getpid()}_{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    path = directory / "job.py"
    path.write_text(_PREAMBLE.format(directory=str(directory)) + textwrap.dedent(script))
    venv = pathlib.Path(sys.executable).parent.parent
    launch = ["--fault-tolerant"] if fault_tolerant else []
    command = [str(ROOT / "scripts" / "mpirun.sh"), "--venv", str(venv), *launch, "-n", str(nprocs), sys.executable,
               str(path)]
    start = time.monotonic()
    code, out, err = _launch(command, timeout, env)
    if code != 0 and _LAUNCHER_FAILED in err and not any(directory.glob("*.txt")):
        # Open MPI's launcher now and then fails to start its PMIx server (no rank ran): once more.
        code, out, err = _launch(command, timeout, env)
    reports = {
        int(file.stem[4:]): file.read_text().splitlines() for file in directory.glob("rank*.txt")
    }
    captured = "".join(file.read_text() for file in sorted(directory.glob("stderr*.txt")))
    return ChildResult(code, out, err + captured, time.monotonic() - start, reports)


# What Open MPI's launcher says when it could not start, before any rank ran.
_LAUNCHER_FAILED = "The PMIx server's listener thread failed to start"


def _launch(command: list[str], timeout: float, env: dict[str, str] | None) -> tuple[int, str, str]:
    """Run a job's launch command: its status (124 past `timeout`), stdout and stderr."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_clean_env(env),
                              start_new_session=True, check=False)
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        _kill_group(exc)
        return 124, out, err


def _kill_group(exc: subprocess.TimeoutExpired) -> None:
    # subprocess.run killed mpiexec itself; make sure no rank outlives it.
    subprocess.run(["pkill", "-9", "-f", str(exc.cmd[-1])], check=False)


def with_bfloat16(dtypes: Sequence[type]) -> list[np.dtype]:
    """`dtypes` as NumPy dtypes, with bfloat16 added where ml_dtypes is installed."""
    out = [np.dtype(d) for d in dtypes]
    try:
        import ml_dtypes
    except ImportError:
        return out
    return [*out, np.dtype(ml_dtypes.bfloat16)]


def agree(ok: bool, what: str) -> None:
    """Fail on every rank of the context when `ok` is False on any (a collective verdict).

    Hypothesis examples end this way: no rank may stop early while the others go on.
    """
    verdict = mt.all_reduce(np.array(ok), "min").resolve().item()
    assert verdict, f"{what}: failed on {'this rank' if not ok else 'another rank'}"


def same(got: object, expected: np.ndarray) -> bool:
    """`got` (a Tensor or array) has `expected`'s shape and dtype and the same bits."""
    array = np.ascontiguousarray(np.asarray(got))
    expected = np.ascontiguousarray(expected)
    if array.shape != expected.shape or array.dtype != expected.dtype:
        return False
    return bool(np.array_equal(array.reshape(-1).view(np.uint8), expected.reshape(-1).view(np.uint8)))


def kept_plan(ctx: mt.DistributedContext, *key: object) -> object:
    """The plan `ctx` keeps for calls of kind `key` (its plan cache's key), or None."""
    from mpitensor._collectives.plans import find_plan

    return find_plan(ctx, key)


def ranks_outnumber_cores(ctx: mt.DistributedContext) -> bool:
    """Whether `ctx`'s node runs more of its ranks than the cores they may run on (every rank calls it)."""
    from mpitensor._core.mpi import MPI

    node = ctx.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = set().union(*node.allgather(sorted(os.sched_getaffinity(0))))
        return ctx.size > 1 and node.Get_size() > len(cores)
    finally:
        node.Free()


def still_usable(ctx: mt.DistributedContext) -> None:
    """Assert that a small all-reduce over the whole context still gives the right sum (after a misuse)."""
    assert mt.all_reduce(np.ones(3)).resolve().numpy().tolist() == [float(ctx.size)] * 3


def expect_mismatch(call: Callable[[], mt.CollectiveTensor], *fragments: str) -> None:
    """`call` (or resolving it) raises CollectiveMismatchError naming every fragment."""
    with pytest.raises(mt.CollectiveMismatchError) as info:
        call().resolve()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def in_shared_memory(result: object) -> bool:
    """Whether `result` (a Tensor or an array) lives in a block of this rank's shared memory."""
    from mpitensor._transport.shm.arena import Lease

    array = result.numpy() if isinstance(result, mt.Tensor) else result
    while array is not None:
        if isinstance(array, Lease):
            return True
        array = getattr(array, "base", None)
    return False
