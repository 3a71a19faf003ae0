"""``python -m mpitensor.bench [all|sweep|...|torch|jax|tracing|report] ...`` (under mpiexec, but report).

Examples::

    mpiexec -n 2 python -m mpitensor.bench                      # everything, full sweep
    mpiexec -n 2 python -m mpitensor.bench sweep --sizes 8,1M,16M --reps 3
    mpiexec -n 4 python -m mpitensor.bench all --quick          # a short sanity run
    mpiexec -n 2 python -m mpitensor.bench interop              # torch input against NumPy input
    mpiexec -n 2 python -m mpitensor.bench collectives          # gather, scatter, scans, objects
    mpiexec -n 4 python -m mpitensor.bench torch                # DataParallel against torch DDP
    mpiexec -n 2 python -m mpitensor.bench torch --busy         # the backend against gloo, cores busy
    mpiexec -n 2 python -m mpitensor.bench jax                  # mpitensor.jax against mpi4jax
    mpiexec -n 2 python -m mpitensor.bench tracing              # tracing on against off
    python -m mpitensor.bench report bench-results/*.json       # the targets table
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpitensor.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="all",
                        choices=["all", "sweep", "overlap", "fused", "interop", "collectives", "torch", "jax",
                                 "tracing", "report"],
                        help="what to run (default: all; torch's row runs where torch is installed)")
    parser.add_argument("files", nargs="*", help="report: the JSON files of the runs")
    parser.add_argument("--sizes", default="8:64M", help="sweep sizes: 'LOW:HIGH' powers of two or a list (8:64M)")
    parser.add_argument("--overlap-sizes", default="64K:64M", help="overlap sizes (64K:64M)")
    parser.add_argument("--collective-sizes", default="8,64K,1M",
                        help="sizes of gather, scatter, scans and object collectives (8,64K,1M)")
    parser.add_argument("--reps", type=int, default=5, help="rounds per figure; figures are medians (5)")
    parser.add_argument("--target", type=float, default=0.05, help="seconds per timed batch (0.05)")
    parser.add_argument("--variants", default=None, help="sweep variants, comma-separated (default: all)")
    parser.add_argument("--count", type=int, default=256, help="fused: how many tensors (256)")
    parser.add_argument("--tensor-bytes", default="4K", help="fused: bytes per tensor (4K)")
    parser.add_argument("--interop-sizes", default="1M,16M", help="interop: sizes (1M,16M)")
    parser.add_argument("--out", default="bench-results", help="output folder (bench-results)")
    parser.add_argument("--name", default=None, help="file name stem (default: <mpi>-np<ranks>)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch gloo baselines")
    parser.add_argument("--steps", type=int, default=30, help="torch: timed training steps per variant (30)")
    parser.add_argument("--busy", action="store_true",
                        help="torch: instead, the backend's all-reduce and DDP step against gloo's beside a "
                             "CPU hog per core")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--quick", action="store_true",
                        help="a short sanity run: a few sizes, 3 rounds, short batches")
    parser.add_argument("-o", "--output", default=None, help="report: write the Markdown here too")
    parser.add_argument("--full", action="store_true",
                        help="report: every run's machine, tables and plots after the targets")
    parser.add_argument("--plots", default=None,
                        help="report: (re)draw each run's plots from its JSON into this folder and link them")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks (every rank) or the report; return the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    if args.files:
        _parser().error("file arguments belong to 'report'")
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmarks `args` names (on every rank); rank 0 prints and writes the results."""
    from .. import defer_finalize
    from .._core import mpi as _mpi
    from ._common import parse_sizes
    from .sweep import VARIANTS

    if args.quick:
        _shorten(args)
    sizes = parse_sizes(args.sizes)
    overlap_sizes = parse_sizes(args.overlap_sizes)
    variants = _sweep_variants(args, VARIANTS)

    defer_finalize()  # each benchmark opens and closes contexts
    _mpi.ensure_initialized()
    out = _Output(args, _mpi.MPI.COMM_WORLD)
    _run_families(args, out, sizes, overlap_sizes, variants)
    out.finish()
    return 0


def _shorten(args: argparse.Namespace) -> None:
    """--quick: a few sizes (unless given), at most 3 rounds, short batches."""
    args.sizes = "8,64K,1M,16M" if args.sizes == "8:64M" else args.sizes
    args.overlap_sizes = "1M,16M" if args.overlap_sizes == "64K:64M" else args.overlap_sizes
    args.reps = min(args.reps, 3)
    args.target = min(args.target, 0.01)
    args.steps = min(args.steps, 10)


def _sweep_variants(args: argparse.Namespace, known: tuple[str, ...]) -> tuple[str, ...]:
    """The sweep variants --variants names (default: `known`), without gloo under --no-gloo."""
    variants = known if args.variants is None else tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if args.no_gloo:
        variants = tuple(v for v in variants if v != "gloo")
    return variants


def _run_families(args: argparse.Namespace, out: _Output, sizes: list[int], overlap_sizes: list[int],
                  variants: tuple[str, ...]) -> None:
    """Run the benchmark families `args.command` selects, in order, and publish each result."""
    from ._common import format_size, parse_size, parse_sizes
    from .fused import format_fused, run_fused
    from .overlap import format_overlap, plot_overlap, run_overlap
    from .sweep import format_size_list, format_sweep, plot_sweep, run_sweep

    say = out.say
    if args.command in ("all", "sweep"):
        say(f"sweep: {format_size_list(sizes)}, variants {', '.join(variants)}")
        result = run_sweep(sizes, reps=args.reps, target=args.target, variants=variants, progress=say)
        out.publish("sweep", result, format_sweep, plot_sweep)
    if args.command in ("all", "overlap"):
        say(f"overlap: {format_size_list(overlap_sizes)}")
        result = run_overlap(overlap_sizes, reps=args.reps, target=args.target, progress=say)
        out.publish("overlap", result, format_overlap, plot_overlap)
    if args.command in ("all", "fused"):
        tensor_bytes = parse_size(args.tensor_bytes)
        say(f"fused: {args.count} tensors of {format_size(tensor_bytes)}")
        result = run_fused(args.count, tensor_bytes, reps=args.reps, target=args.target, progress=say)
        out.publish("fused", result, format_fused)
    if args.command in ("all", "interop"):
        from .interop import format_interop, run_interop

        say("interop: torch input against NumPy input")
        result = run_interop(parse_sizes(args.interop_sizes), reps=args.reps, target=args.target, progress=say)
        out.publish("interop", result, format_interop)
    if args.command in ("all", "collectives"):
        from .collectives import format_collectives, run_collectives

        collective_sizes = parse_sizes(args.collective_sizes)
        say(f"collectives: {format_size_list(collective_sizes)}")
        result = run_collectives(collective_sizes, reps=args.reps, target=args.target, progress=say)
        out.publish("collectives", result, format_collectives)
    if args.command == "torch" and args.busy:
        from .torch_busy import format_torch_busy, run_torch_busy

        say("torch --busy: the backend against gloo beside a CPU hog per core")
        out.publish("torch_busy", run_torch_busy(progress=say), format_torch_busy)
    elif args.command == "torch" or (args.command == "all" and not args.no_gloo and _has_torch()):
        from .torch_ddp import format_torch_ddp, run_torch_ddp

        say("torch: DataParallel and DDP on mpitensor against DDP on gloo")
        result = run_torch_ddp(steps=args.steps, progress=say)
        out.publish("torch", result, format_torch_ddp)
        result = run_torch_ddp(steps=args.steps, progress=say, model="cnn", batch=4)
        out.publish("torch_cnn", result, format_torch_ddp)
        from .torch_backend import format_torch_backend, run_torch_backend

        say("torch backend: dist.all_reduce against gloo and mt.all_reduce")
        out.publish("torch_backend", run_torch_backend(progress=say), format_torch_backend)
    if args.command == "jax":
        from .jax_collectives import format_jax, run_jax

        say("jax: mpitensor.jax inside jax.jit against mpi4jax")
        out.publish("jax", run_jax(progress=say), format_jax)
    if args.command == "tracing":
        from .tracing import format_tracing, run_tracing

        say("tracing: a checked all-reduce traced against untraced")
        out.publish("tracing", run_tracing(progress=say), format_tracing)


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


class _Output:
    """The run's record and files: every rank keeps the results, rank 0 prints and writes them.

    Creating it gathers the machine's description (a collective call) and prints the banner.
    """

    def __init__(self, args: argparse.Namespace, comm: Any) -> None:
        from .._core import mpi as _mpi
        from ._common import machine

        self.rank, ranks = comm.Get_rank(), comm.Get_size()
        vendor = _mpi.vendor()[0].lower().replace(" ", "")
        self.name = args.name or f"{vendor}-np{ranks}"
        self.args = args
        self.info = machine(comm)
        self.run: dict[str, Any] = {"name": self.name, "machine": self.info,
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self.written: list[str] = []
        self.say(f"mpitensor.bench: {self.info['mpi']}, {ranks} ranks on {', '.join(self.info['hosts'])} "
                 f"({self.info['cores']} cores, {self.info['cpu']}); results in {args.out}/{self.name}*")

    def say(self, line: str) -> None:
        """Print `line` on rank 0."""
        if self.rank == 0:
            print(line, flush=True)

    def publish(self, kind: str, result: dict[str, Any], fmt: Callable[..., str],
                plot: Callable[[dict[str, Any], str], bool] | None = None) -> None:
        """Keep `result` in the run; on rank 0 print it and write <name>-<kind>.md (and .png)."""
        self.run[kind] = result
        if self.rank != 0:
            return
        from ._common import write_text

        print(fmt(result, markdown=False), flush=True)
        stem = os.path.join(self.args.out, f"{self.name}-{kind}")
        write_text(stem + ".md", fmt(result))
        self.written.append(stem + ".md")
        if plot is not None and not self.args.no_plot and plot(result, stem + ".png"):
            self.written.append(stem + ".png")

    def finish(self) -> None:
        """On rank 0: write the run's JSON, print its targets and the files written."""
        if self.rank != 0:
            return
        from ._common import load_average, write_json
        from .report import format_targets

        self.run["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.info["load_after"] = load_average()
        path = os.path.join(self.args.out, f"{self.name}.json")
        write_json(path, self.run)
        self.written.append(path)
        print(format_targets([self.run]), flush=True)
        print("wrote " + ", ".join(self.written), flush=True)


def _report(args: argparse.Namespace) -> int:
    from ._common import write_text
    from .report import format_runs, format_targets, load

    if not args.files:
        _parser().error("report needs the JSON files of the runs")
    runs = load(args.files)
    text = format_targets(runs)
    if args.full or args.plots:
        text += "\n" + format_runs(runs, args.plots)
    print(text, end="")
    if args.output:
        write_text(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
