"""Per-call cost of two source trees of mpitensor, alternated within one run, on 2 ranks.

    python scripts/alternate_trees.py BASE_TREE [--this TREE] [--rounds 5] [--venv .venv-openmpi]

Each round runs one job of 2 ranks per tree (``PYTHONPATH`` set to the tree; each tree's
compiled parts built in place, ``python setup.py build_ext --inplace``), this checkout's (or
``--this``'s) and `BASE_TREE`'s in turn (the order
alternating from round to round), and every job times the same calls through public names
only: ``mt.all_reduce`` of 8 B (check on and off), 64 KiB and 1 MiB; the torch backend's
``dist.all_reduce`` of 8 B and 1 MiB; and inside ``jax.jit`` mpitensor.jax's all-reduce,
broadcast and all-gather of 8 B against mpi4jax's (where installed). A figure is the 10th
percentile of a job's batches (each batch starts at a barrier); the table gives, per case, the
median over rounds of each tree's figure and of their ratio within a round (this / base): the
machine's noise moves both trees of a round alike. Each job also times mpi4py's ``Allreduce``
of 8 B, 64 KiB and 1 MiB, and a last column compares the trees with each case divided by MPI's
own time in its job (mpi4py's call of its size; mpi4jax's for mpitensor.jax): where the ranks'
placement on the cores changes from job to job, that moves MPI's own time too, by up to 2x
here. Rank 0 prints the table (Markdown).
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
import json, sys, time
import numpy as np
import mpitensor as mt
from mpi4py import MPI

def timed(call, count, comm, samples, name):
    for _ in range(max(1, count // 10)):
        call()
    for _ in range(9):
        comm.Barrier()
        start = time.perf_counter_ns()
        for _ in range(count):
            call()
        samples.setdefault(name, []).append((time.perf_counter_ns() - start) / count / 1000)

samples = {}
comm = MPI.COMM_WORLD
for n, label, count in ((2, "8 B", 2000), (16384, "64 KiB", 300), (262144, "1 MiB", 60)):
    send, receive = np.ones(n, np.float32), np.empty(n, np.float32)
    timed(lambda s=send, r=receive: comm.Allreduce(s, r), count, comm, samples, f"mpi4py Allreduce {label}")
for check in (False, True):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)):
        small = np.ones(2, np.float32)
        name = f"all_reduce 8 B check {'on' if check else 'off'}"
        timed(lambda: mt.all_reduce(small).resolve(), 2000, comm, samples, name)
        if check:
            for n, label, count in ((16384, "64 KiB", 300), (262144, "1 MiB", 60)):
                x = np.ones(n, np.float32)
                timed(lambda x=x: mt.all_reduce(x).resolve(), count, comm, samples, f"all_reduce {label}")
try:
    import torch, torch.distributed as dist
    import mpitensor.torch  # noqa: F401
    with mt.DistributedContext.init():
        dist.init_process_group("mpitensor")
        for n, label, count in ((2, "8 B", 2000), (262144, "1 MiB", 60)):
            t = torch.zeros(n)
            timed(lambda t=t: dist.all_reduce(t), count, comm, samples, f"torch backend all_reduce {label}")
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
            timed(lambda c=call: c(x).block_until_ready(), 1000, comm, samples, f"jax {name} 8 B in jit")
            if name in theirs:
                timed(lambda c=theirs[name]: c(x).block_until_ready(), 1000, comm, samples,
                      f"mpi4jax {name} 8 B in jit")
except ImportError:
    pass
if comm.Get_rank() == 0:
    print("RESULT " + json.dumps({name: float(np.percentile(v, 10)) for name, v in samples.items()}), flush=True)
'''


def _job(tree: pathlib.Path, venv: pathlib.Path, script: pathlib.Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
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
    args = parser.parse_args()
    script = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"alternate_trees_{os.getpid()}.py"
    script.write_text(_JOB)
    trees = {"this": args.this.resolve(), "base": args.base.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
    for round_ in range(args.rounds):
        for name in (("this", "base") if round_ % 2 == 0 else ("base", "this")):
            runs[name].append(_job(trees[name], args.venv.resolve(), script))
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(_table(runs, args))
    return 0


def _reference(case: str) -> str:
    """The case of the same job that measures MPI's own time for `case` (mpi4py's or mpi4jax's call)."""
    if case.startswith("jax "):
        return "mpi4jax " + case[len("jax "):]
    size = next((label for label in ("8 B", "64 KiB", "1 MiB") if f" {label}" in case), None)
    return f"mpi4py Allreduce {size}" if size is not None and not case.startswith(("mpi4py", "mpi4jax")) else ""


def _table(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    """The table: per case each tree's time, this / base, and this / base each against MPI's own time in its job.

    A job's process placement on the cores moves all its figures alike (MPI's own too, by up
    to 2x on this machine): the last column divides each case by its reference case measured
    in the same job (`_reference`) before comparing the trees.
    """
    every = runs["this"] + runs["base"]
    cases = [case for case in runs["this"][0] if all(case in run for run in every)]
    lines = [f"2 ranks, {args.venv.name}, {args.rounds} rounds, base {args.base}", "",
             "| case | base us | this us | this / base | this / base, each against MPI's own in its job |",
             "|---|---|---|---|---|"]
    for case in cases:
        base = [run[case] for run in runs["base"]]
        this = [run[case] for run in runs["this"]]
        ratio = statistics.median(t / b for t, b in zip(this, base))
        ref = _reference(case)
        against = ""
        if ref in cases:
            pairs = zip(runs["this"], runs["base"])
            against = f"{statistics.median((t[case] / t[ref]) / (b[case] / b[ref]) for t, b in pairs):.3f}"
        lines.append(f"| {case} | {statistics.median(base):.2f} | {statistics.median(this):.2f} | {ratio:.3f} | "
                     f"{against} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
