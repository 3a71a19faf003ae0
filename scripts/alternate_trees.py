"""Per-call cost of two source trees of mpitensor, alternated within one run, on 2 ranks.

    python scripts/alternate_trees.py BASE_TREE [--this TREE] [--rounds 5] [--venv .venv-openmpi] [--case NAME ...]

Each round runs one job of 2 ranks per tree (``PYTHONPATH`` set to the tree; each tree's
compiled parts built in place, ``python setup.py build_ext --inplace``), this checkout's (or
``--this``'s) and `BASE_TREE`'s in turn (the order
alternating from round to round), and every job times the same calls through public names
only: ``mt.all_reduce`` of 8 B (check on and off), 64 KiB and 1 MiB; the torch backend's
``dist.all_reduce`` of 8 B, 332 KiB and 1 MiB; and inside ``jax.jit`` mpitensor.jax's all-reduce,
broadcast and all-gather of 8 B against mpi4jax's (where installed). A figure is the 10th
percentile of a job's batches (each batch starts at a barrier); the table gives, per case, the
median over rounds of each tree's figure and of their ratio within a round (this / base): the
machine's noise moves both trees of a round alike. Each batch of a case is followed by a batch
of MPI's own call (mpi4py's ``Allreduce`` of the size; mpi4jax's call for mpitensor.jax), and a
last column compares the trees' ratios of the case to it (each job's the median of its batch
pairs): the ranks' placement on the cores changes from job to job and moves a job's every
figure, MPI's own by up to 2x here. ``--case`` times only the cases named (more rounds of them
in the same time); the table also gives the range of this / base over the rounds. Rank 0
prints the table (Markdown). Measure two fresh clones (``--this`` one of them): measured as
the working tree itself, a commit took 1.22-1.36x a fresh clone's time (MPICH's 1 MiB
all-reduce), where two fresh clones of one commit took 0.99x each other's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What one job times (run under mpiexec with the tree on PYTHONPATH); prints one JSON line on rank 0.
_JOB = r'''
import json, os, sys, time
import numpy as np
import mpitensor as mt
from mpi4py import MPI

def batch(call, count, comm):
    comm.Barrier()
    start = time.perf_counter_ns()
    for _ in range(count):
        call()
    return (time.perf_counter_ns() - start) / count / 1000

ONLY = set(filter(None, os.environ.get("ALTERNATE_CASES", "").split("|")))

def timed(call, count, comm, samples, name, reference=None):
    # Batches of the case, each followed by one of its reference (MPI's own call) when it has one.
    if ONLY and name not in ONLY:
        return
    for _ in range(max(1, count // 10)):
        call()
        if reference is not None:
            reference()
    for _ in range(9):
        took = batch(call, count, comm)
        samples.setdefault(name, []).append(took)
        if reference is not None:
            samples.setdefault(name + " / MPI", []).append(took / batch(reference, count, comm))

def mpi4py_allreduce(n):
    send, receive = np.ones(n, np.float32), np.empty(n, np.float32)
    return lambda: comm.Allreduce(send, receive)

samples = {}
comm = MPI.COMM_WORLD
SIZES = {"8 B": 2, "64 KiB": 16384, "332 KiB": 84992, "1 MiB": 262144}
for check in (False, True):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)):
        small = np.ones(2, np.float32)
        name = f"all_reduce 8 B check {'on' if check else 'off'}"
        timed(lambda: mt.all_reduce(small).resolve(), 2000, comm, samples, name, mpi4py_allreduce(2))
        if check:
            for label, count in (("64 KiB", 300), ("1 MiB", 60)):
                x = np.ones(SIZES[label], np.float32)
                timed(lambda x=x: mt.all_reduce(x).resolve(), count, comm, samples, f"all_reduce {label}",
                      mpi4py_allreduce(SIZES[label]))
try:
    import torch, torch.distributed as dist
    import mpitensor.torch  # noqa: F401
    with mt.DistributedContext.init():
        dist.init_process_group("mpitensor")
        for label, count in (("8 B", 2000), ("332 KiB", 150), ("1 MiB", 60)):
            t = torch.zeros(SIZES[label])
            timed(lambda t=t: dist.all_reduce(t), count, comm, samples, f"torch backend all_reduce {label}",
                  mpi4py_allreduce(SIZES[label]))
        dist.destroy_process_group()
except ImportError:
    pass
try:
    import jax, jax.numpy as jnp
    import mpitensor.jax as mtj
    with mt.DistributedContext.init():
        x = jnp.ones(2, jnp.float32)
        calls = {"all_reduce": jax.jit(lambda v: mtj.all_reduce(v)),
                 "broadcast": jax.jit(lambda v: mtj.broadcast(v, 0)),
                 "all_gather": jax.jit(lambda v: mtj.all_gather(v))}
        try:
            import mpi4jax
            theirs = {"all_reduce": jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)),
                      "broadcast": jax.jit(lambda v: mpi4jax.bcast(v, 0, comm=comm)),
                      "all_gather": jax.jit(lambda v: mpi4jax.allgather(v, comm=comm))}
        except ImportError:
            theirs = {}
        for name, call in calls.items():
            reference = None if name not in theirs else (lambda c=theirs[name]: c(x).block_until_ready())
            timed(lambda c=call: c(x).block_until_ready(), 1000, comm, samples, f"jax {name} 8 B in jit", reference)
except ImportError:
    pass
if comm.Get_rank() == 0:
    figures = {name: float(np.percentile(v, 10)) for name, v in samples.items() if not name.endswith(" / MPI")}
    figures.update({name: float(np.median(v)) for name, v in samples.items() if name.endswith(" / MPI")})
    print("RESULT " + json.dumps(figures), flush=True)
'''


def _job(tree: pathlib.Path, venv: pathlib.Path, script: pathlib.Path, cases: list[str]) -> dict[str, float]:
    # Every job compiles every module from source, whatever each tree's own __pycache__ holds:
    # a copy of a working tree with its caches (some stale) took 1.21x the time of the same
    # tree fresh for MPICH's 1 MiB all-reduce, and 0.99x once they were removed.
    env = dict(os.environ, PYTHONPATH=str(tree), ALTERNATE_CASES="|".join(cases), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPYCACHEPREFIX=str(script.parent / f"{script.stem}_no_cache"))
    command = [str(ROOT / "scripts" / "mpirun.sh"), "--venv", str(venv), "-n", "2", str(venv / "bin" / "python"),
               str(script)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=900, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the job of {tree} printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def main() -> int:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=pathlib.Path, help="the other tree (its compiled parts built in place)")
    parser.add_argument("--this", type=pathlib.Path, default=ROOT, help="the tree measured against it (default: here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--venv", type=pathlib.Path, default=ROOT / ".venv-openmpi")
    parser.add_argument("--case", action="append", default=[], metavar="NAME",
                        help="time only this case (its name in the table, e.g. 'all_reduce 1 MiB'); repeatable")
    args = parser.parse_args()
    script = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"alternate_trees_{os.getpid()}.py"
    script.write_text(_JOB)
    trees = {"this": args.this.resolve(), "base": args.base.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
    for round_ in range(args.rounds):
        for name in (("this", "base") if round_ % 2 == 0 else ("base", "this")):
            runs[name].append(_job(trees[name], args.venv.resolve(), script, args.case))
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(_table(runs, args))
    return 0


def _table(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    """The table: per case each tree's time, this / base, and this / base each against MPI's own time in its job.

    A job's process placement on the cores moves all its figures alike (MPI's own too, by up
    to 2x on this machine): the last column compares the trees' ratios of each case to MPI's
    own call (mpi4py's all-reduce of the size; mpi4jax's call for mpitensor.jax), each the
    median of the job's batch pairs, one batch of the case then one of MPI's.
    """
    every = runs["this"] + runs["base"]
    cases = [case for case in runs["this"][0]
             if not case.endswith(" / MPI") and all(case in run for run in every)]
    lines = [f"2 ranks, {args.venv.name}, {args.rounds} rounds, base {args.base}", "",
             "| case | base us | this us | this / base | its rounds | this / base, each against MPI's own in its job |",
             "|---|---|---|---|---|---|"]
    for case in cases:
        base = [run[case] for run in runs["base"]]
        this = [run[case] for run in runs["this"]]
        ratios = [t / b for t, b in zip(this, base)]
        ratio = statistics.median(ratios)
        against, ref = "", case + " / MPI"
        if all(ref in run for run in every):
            pairs = zip(runs["this"], runs["base"])
            against = f"{statistics.median(t[ref] / b[ref] for t, b in pairs):.3f}"
        lines.append(f"| {case} | {statistics.median(base):.2f} | {statistics.median(this):.2f} | {ratio:.3f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {against} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
