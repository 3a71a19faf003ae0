"""A rank dies (SIGKILL or ``os._exit``) during a collective: the survivors go on (Open MPI's ULFM).

Each test is a child job launched with ``scripts/mpirun.sh --fault-tolerant`` whose ranks run
`tests/faults/phases.py`: a collective in a loop until the victim dies right after starting
it, then `RankFailedError` on every survivor (naming the victim, within 10 s, a started
handle failing too), ``ctx.shrink()``, the collective again on the survivors against
NumPy's result over their inputs, and at the end every collective (and a sub-group made
then) against NumPy. Jobs of 4 ranks lose two ranks one after the other (at 4, then at 3
ranks), the second shrink switching the consistency check on or off. Where the MPI has no
fault tolerance (MPICH, Intel MPI, Open MPI launched without it) the context says so at open
and stays fail-fast: `test_refused_where_mpi_has_none`.
"""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap

import pytest

from tests.faults.phases import DETECTION_BOUND, LARGE, SMALL
from tests.helpers import ROOT, ChildResult, run_job

pytestmark = pytest.mark.subprocess

_PREAMBLE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import mpitensor as mt
from tests.faults import phases
phases.report = report
capture_stderr()
CHECKED = mt.DistributedConfig(on_rank_failure="raise")
UNCHECKED = mt.DistributedConfig(on_rank_failure="raise", check=False)
"""


def _open_mpi() -> bool:
    """Whether this venv's MPI is Open MPI (its ``ompi_info`` beside Python), found without initializing MPI."""
    return (pathlib.Path(sys.executable).parent / "ompi_info").exists()


needs_ulfm = pytest.mark.skipif(not _open_mpi(), reason="fault tolerance needs Open MPI's ULFM (see test_refused_...)")


def _job(body: str, nprocs: int, tmp_path, timeout: float = 120, fault_tolerant: bool = True,
         env: dict[str, str] | None = None) -> ChildResult:
    return run_job(_PREAMBLE + textwrap.dedent(body), nprocs, timeout=timeout, tmp_path=tmp_path,
                   fault_tolerant=fault_tolerant, env=env)


def _lines(result: ChildResult, rank: int, word: str) -> list[list[str]]:
    return [line.split() for line in result.reports.get(rank, []) if line.startswith(word + " ")]


def _assert_lost(result: ChildResult, survivors: list[int], victims: list[int], phase: int = 0,
                 named_as: list[int] | None = None) -> None:
    """Every survivor detected the victims' death (phase `phase`) within the bound, named them, and recovered.

    `survivors` and `victims` are world ranks; `named_as`, the victims' ranks in the context they
    died in (the world's when None), which `RankFailedError.ranks` gives.
    """
    died = [float(_lines(result, v, "died")[0][1]) for v in victims]
    context_ranks = victims if named_as is None else named_as
    for rank in survivors:
        detected = _lines(result, rank, "detected")
        assert len(detected) > phase, f"rank {rank} never got RankFailedError\n{result.output}"
        words = detected[phase]
        named = [int(w) for w in words[3:words.index("pending")]]
        assert named and set(named) <= set(context_ranks), f"rank {rank} named {named}\n{result.output}"
        pending = words[words.index("pending") + 1]
        assert pending == "True", f"rank {rank}: a started handle did not fail\n{result.output}"
        message = " ".join(words[words.index("message") + 1:])
        assert re.search(r"ranks? \d+(, \d+)* of this context failed", message), message
        assert "Call ctx.shrink() on every surviving rank" in message, message
        took = float(words[1]) - min(died)
        assert took < DETECTION_BOUND, f"rank {rank} learnt of the death after {took:.1f} s"
        recovered = _lines(result, rank, "recovered")
        assert len(recovered) > phase and recovered[phase][-1] == "True", f"rank {rank}\n{result.output}"


def _assert_finished(result: ChildResult, survivors: list[int], size: int) -> None:
    assert result.returncode != 124, f"the job hung\n{result.output}"
    assert not result.reported("bad"), result.output
    for rank in survivors:
        assert f"verified every call {size}" in result.reports.get(rank, []), f"rank {rank}\n{result.output}"
        assert "done" in result.reports.get(rank, []), f"rank {rank}\n{result.output}"


# Each kind of collective loses a rank once checked and once unchecked, at 4 ranks (first phase)
# or 3 (second), with small and large messages, rank 0 (every rooted call's root) or another
# rank dying, by SIGKILL or os._exit.
_PAIRS = [
    ("all_reduce", "broadcast"),
    ("reduce", "all_gather"),
    ("reduce_scatter", "all_to_all"),
    ("gather", "scatter"),
    ("scan", "barrier"),
    ("broadcast_object", "send_recv"),
    ("held_all_reduce", "fused_all_reduce"),
]


@needs_ulfm
@pytest.mark.parametrize("checked_first", [True, False], ids=["checked-then-unchecked", "unchecked-then-checked"])
@pytest.mark.parametrize(("first", "second"), _PAIRS, ids=[f"{a}-{b}" for a, b in _PAIRS])
def test_a_rank_dies_in_each_collective(first, second, checked_first, tmp_path):
    """4 ranks lose rank 0 or 3 in `first`, shrink to 3, lose their rank 1 in `second`, shrink to 2."""
    victim = 0 if checked_first else 3
    first_size, second_size = (SMALL, LARGE) if checked_first else (LARGE, SMALL)
    result = _job(
        f"""
        ctx = mt.DistributedContext.init(config={"CHECKED" if checked_first else "UNCHECKED"})
        phases.lose_a_rank(ctx, {first!r}, [{victim}], {"'SIGKILL'" if checked_first else "'_exit'"}, 1,
                           {first_size})
        ctx = phases.shrink_and_check(ctx, {first!r}, 2, {first_size},
                                      {"UNCHECKED" if checked_first else "CHECKED"})
        phases.lose_a_rank(ctx, {second!r}, [1], {"'_exit'" if checked_first else "'SIGKILL'"}, 3, {second_size})
        ctx = phases.shrink_and_check(ctx, {second!r}, 4, {second_size})
        phases.check_every_call(ctx, 5, {SMALL})
        ctx.close()
        report("done")
        """,
        4,
        tmp_path,
    )
    # World ranks: the first victim, then the second context's rank 1.
    left = [r for r in range(4) if r != victim]
    second_victim = left[1]
    survivors = [r for r in left if r != second_victim]
    _assert_lost(result, left, [victim], 0)
    _assert_lost(result, survivors, [second_victim], 1, named_as=[1])
    _assert_finished(result, survivors, 2)


@needs_ulfm
def test_a_rank_dies_in_a_sub_group(tmp_path):
    """Rank 3 dies in an all-reduce on [1, 3]; ranks 0 and 2, in theirs on [0, 2], learn it as well."""
    result = _job(
        f"""
        with mt.DistributedContext.init(config=CHECKED) as ctx:
            phases.lose_a_rank(ctx, "all_reduce", [3], "SIGKILL", 1, {LARGE}, members=[1, 3])
            with ctx.shrink() as new:
                if new.rank in (0, 2):  # world ranks 0 and 2: their group goes on
                    report("verified" if phases.check(new, "all_reduce", 2, {LARGE}, [0, 2]) else "bad", "group")
                phases.check_every_call(new, 3, {SMALL})
        report("done")
        """,
        4,
        tmp_path,
    )
    died = float(_lines(result, 3, "died")[0][1])
    for rank in (0, 1, 2):
        words = _lines(result, rank, "detected")[0]
        assert words[3] == "3" and float(words[1]) - died < DETECTION_BOUND, result.output
    _assert_finished(result, [0, 1, 2], 3)


@needs_ulfm
def test_two_ranks_die_at_once(tmp_path):
    result = _job(
        f"""
        ctx = mt.DistributedContext.init(config=CHECKED)
        phases.lose_a_rank(ctx, "all_reduce", [2, 3], "SIGKILL", 1, {SMALL})
        new = phases.shrink_and_check(ctx, "all_reduce", 2, {SMALL})
        phases.check_every_call(new, 3, {SMALL})
        new.close()
        report("done")
        """,
        4,
        tmp_path,
    )
    _assert_lost(result, [0, 1], [2, 3])
    _assert_finished(result, [0, 1], 2)


@needs_ulfm
@pytest.mark.parametrize("delay", [0.0, 0.003], ids=["at-once", "3ms-in"])
def test_a_rank_dies_during_shrink(delay, tmp_path):
    """Rank 3 dies in an all-reduce; rank 2 dies while the survivors shrink: ranks 0 and 1 go on, two of them.

    Open MPI 5.0's own failure handling sometimes crashes here (a segfault inside
    `ompi_comm_set_rank_failed` or `ompi_comm_revoke_local`, in about one job of 40): such a job
    says nothing of mpitensor, so it runs once more, and the assertions hold for a job that ran.
    """
    for attempt in range(2):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        result = _rank_dies_during_shrink(delay, folder)
        if not any(frame in result.output for frame in _OPEN_MPI_CRASH):
            break
    for rank in (0, 1):
        assert "shrunk 2" in result.reports.get(rank, []), result.output
    _assert_finished(result, [0, 1], 2)


# Frames of Open MPI's failure handling seen in the backtraces of its own crashes.
_OPEN_MPI_CRASH = ("ompi_comm_set_rank_failed", "ompi_comm_revoke_local")


def _rank_dies_during_shrink(delay: float, tmp_path) -> ChildResult:
    """The job of `test_a_rank_dies_during_shrink`."""
    return _job(
        f"""
        ctx = mt.DistributedContext.init(config=CHECKED)
        phases.lose_a_rank(ctx, "all_reduce", [3], "SIGKILL", 1, {SMALL})
        if ctx.rank == 2:
            phases.die_soon({delay})
        new = phases.shrink_until_it_holds(ctx)  # the death may also come just after the shrink
        report("shrunk", new.size)
        phases.check_every_call(new, 3, {SMALL})
        new.close()
        report("done")
        """,
        4,
        tmp_path,
    )


@needs_ulfm
def test_a_rank_that_computes_learns_at_its_next_call(tmp_path):
    """Rank 0 computes while rank 2 dies; its next collective, on a sub-group without rank 2, raises."""
    result = _job(
        f"""
        import time
        ctx = mt.DistributedContext.init(config=CHECKED)
        if ctx.rank == 2:
            time.sleep(0.3)
            phases.die("SIGKILL")
        try:
            if ctx.rank == 0:
                time.sleep(1.5)
            while True:
                mt.all_reduce(phases.data(1, ctx.rank, 8), devices=[0, 1]).resolve()
        except mt.RankFailedError as error:
            report("detected", repr(time.time()), "ranks", *error.ranks)
        new = phases.shrink_and_check(ctx, "all_reduce", 2, {SMALL})
        phases.check_every_call(new, 3, {SMALL})
        new.close()
        report("done")
        """,
        3,
        tmp_path,
    )
    for rank in (0, 1):
        assert _lines(result, rank, "detected")[0][3] == "2", result.output
    _assert_finished(result, [0, 1], 2)


@needs_ulfm
def test_an_uncaught_rank_failure_ends_that_rank_alone(tmp_path):
    """Rank 1 does not catch RankFailedError: it ends (exit status 1, no MPI_Abort); rank 0 goes on alone."""
    result = _job(
        f"""
        ctx = mt.DistributedContext.init(config=CHECKED)
        if ctx.rank == 0:
            phases.lose_a_rank(ctx, "all_reduce", [2], "SIGKILL", 1, {SMALL})
            new = ctx.shrink()
            report("shrunk", new.size)
            phases.check_every_call(new, 3, {SMALL})
            report("done")
        else:
            x = phases.data(1, ctx.rank, {SMALL})
            for step in range(10 ** 6):
                if ctx.rank == 2 and step == 3:
                    phases.die("SIGKILL")
                mt.all_reduce(x).resolve()
        """,
        3,
        tmp_path,
    )
    assert result.returncode != 124, result.output
    assert "shrunk 1" in result.reports.get(0, []), result.output
    assert "done" in result.reports.get(0, []), result.output
    assert "[rank 1] mpitensor: uncaught RankFailedError on rank 1 of 3; this rank ends" in result.stderr, result.output
    assert "MPI_ABORT was invoked" not in result.output


@needs_ulfm
def test_fail_fast_stays_the_default(tmp_path):
    """Launched fault tolerant, a context without on_rank_failure='raise' still ends the job when a rank dies."""
    result = _job(
        """
        import numpy as np
        ctx = mt.DistributedContext.init()
        report("tolerant", ctx.fault_tolerant)
        for step in range(10 ** 6):
            if ctx.rank == 2 and step == 3:
                phases.die("SIGKILL")
            mt.all_reduce(np.ones(8)).resolve()
        report("unreachable")
        """,
        3,
        tmp_path,
        timeout=60,
    )
    # Open MPI's launcher under --with-ft ulfm does not always pass MPI_Abort's status on: the
    # job's end, promptly, and the abort are what fail-fast promises here.
    assert result.returncode != 124, result.output
    assert result.seconds < 30, result.output
    assert result.reported("tolerant") == ["tolerant False"] * 3, result.output
    assert not result.reported("unreachable"), result.output
    assert "ContextBrokenError" in result.stderr, result.output
    assert "aborting the job (MPI_Abort)" in result.stderr, result.output


@needs_ulfm
def test_torch_backend_shrinks_its_group(tmp_path):
    """DDP on the "mpitensor" backend: rank 3 dies in backward; the survivors rebuild the group and train on."""
    pytest.importorskip("torch")
    result = _job(
        """
        import os
        import numpy as np
        import torch
        import torch.distributed as dist
        import mpitensor.torch as mtt

        mt.DistributedContext.init(config=CHECKED)
        dist.init_process_group("mpitensor")
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4).double()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        step = 0
        world_rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        while step < 12:
            try:
                seed = torch.Generator().manual_seed(100 * step + world_rank)
                x = torch.randn(8, 16, dtype=torch.float64, generator=seed)
                loss = ddp(x).pow(2).mean()
                opt.zero_grad()
                if world_rank == 3 and step == 5:
                    phases.die("SIGKILL")
                loss.backward()
                opt.step()
                step += 1
            except mt.RankFailedError as error:
                report("detected", repr(__import__("time").time()), "ranks", *error.ranks, "pending", True,
                       "message", str(error))
                ctx = mtt.shrink_process_group()
                report("shrunk", dist.get_rank(), dist.get_world_size(), ctx.size)
                ddp = torch.nn.parallel.DistributedDataParallel(model)  # rank 0's parameters everywhere
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        report("same weights", all(torch.equal(every[0], w) for w in every))
        total = torch.full((5,), float(world_rank), dtype=torch.float64)
        dist.all_reduce(total)
        report("sum right", bool(torch.equal(total, torch.full((5,), 3.0, dtype=torch.float64))))
        dist.destroy_process_group()
        report("done")
        """,
        4,
        tmp_path,
    )
    assert result.returncode != 124, result.output
    died = float(_lines(result, 3, "died")[0][1])
    for rank in (0, 1, 2):
        reports = result.reports.get(rank, [])
        words = _lines(result, rank, "detected")[0]
        assert words[3] == "3" and float(words[1]) - died < DETECTION_BOUND, result.output
        assert f"shrunk {rank} 3 3" in reports, result.output
        assert "same weights True" in reports and "sum right True" in reports and "done" in reports, result.output


@needs_ulfm
def test_jax_eager_collective(tmp_path):
    """mpitensor.jax's all_reduce outside jax.jit: the death reaches it as RankFailedError's text in JAX's error."""
    pytest.importorskip("jax")
    result = _job(
        f"""
        import time
        import numpy as np
        import jax.numpy as jnp
        import mpitensor.jax as mtj

        ctx = mt.DistributedContext.init(config=CHECKED)
        x = jnp.asarray(phases.data(1, ctx.rank, {SMALL}))
        try:
            for step in range(10 ** 6):
                if ctx.rank == 2 and step == 3:
                    phases.die("SIGKILL")
                np.asarray(mtj.all_reduce(x, op="sum"))
        except Exception as error:
            report("caught", repr(time.time()), type(error).__name__, "RankFailedError" in str(error))
        new = ctx.shrink()
        got = np.asarray(mtj.all_reduce(x, op="sum"))
        report("sum right", bool(np.array_equal(got, phases.data(1, 0, {SMALL}) + phases.data(1, 1, {SMALL}))))
        new.close()
        report("done")
        """,
        3,
        tmp_path,
    )
    assert result.returncode != 124, result.output
    died = float(_lines(result, 2, "died")[0][1])
    for rank in (0, 1):
        words = _lines(result, rank, "caught")[0]
        assert words[3] == "True" and float(words[1]) - died < DETECTION_BOUND, result.output
        reports = result.reports.get(rank, [])
        assert "sum right True" in reports and "done" in reports, result.output


def test_refused_where_mpi_has_none(tmp_path):
    """No fault tolerance (MPICH, Intel MPI, Open MPI launched without it): a warning at open, fail-fast kept."""
    on_open_mpi = _open_mpi()
    result = _job(
        """
        import numpy as np
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = mt.DistributedContext.init(config=CHECKED)
        warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
        report("tolerant", ctx.fault_tolerant, "warned", warned)
        try:
            ctx.shrink()
        except RuntimeError as error:
            report("shrink refused", str(error))
        for step in range(10 ** 6):
            if ctx.rank == 2 and step == 3:
                phases.die("SIGKILL")
            mt.all_reduce(np.ones(8)).resolve()
        report("unreachable")
        """,
        3,
        tmp_path,
        timeout=60,
        fault_tolerant=not on_open_mpi,  # Open MPI launched without --with-ft ulfm; the others as they can
    )
    assert result.returncode not in (0, 124), result.output
    assert result.seconds < 30, result.output
    assert not result.reported("unreachable"), result.output
    why = "was launched without fault tolerance" if on_open_mpi else "has no fault tolerance that mpitensor can use"
    for rank in range(3):
        [line] = _lines(result, rank, "tolerant")
        text = " ".join(line)
        assert line[1] == "False" and why in text and "this context stays fail-fast" in text, result.output
        [refused] = _lines(result, rank, "shrink")
        assert "shrink() needs a fault-tolerant context, and this one is not" in " ".join(refused), result.output


@needs_ulfm
def test_refused_on_a_shared_memory_transport(tmp_path):
    """A program that lets Open MPI use its shared-memory transport (which hangs survivors) is told so."""
    result = _job(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = mt.DistributedContext.init(config=CHECKED)
        report("tolerant", ctx.fault_tolerant, *[str(w.message) for w in caught])
        ctx.close()
        """,
        2,
        tmp_path,
        env={"OMPI_MCA_btl": "vader,self"},
    )
    assert result.returncode == 0, result.output
    for rank in range(2):
        text = " ".join(_lines(result, rank, "tolerant")[0])
        assert text.startswith("tolerant False") and "lets Open MPI use its 'vader' transport" in text, result.output
