"""All-reduce inside ``jax.jit``: mpitensor.jax against mpi4jax, and the eager JAX path.

Per size (8 B, 64 KiB, 1 MiB, 16 MiB of float32) the variants, alternated in rounds:

- ``mpitensor.jax``: ``jax.jit(lambda x: mtj.all_reduce(x))`` (the check on, as by default);
- ``mpi4jax``: ``jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM))`` where mpi4jax is
  installed (``make bench-jax`` installs it);
- ``jit floor``: ``jax.jit(lambda x: x + 0)``, the cost of a jitted call with no communication;
- at 8 B, ``mt.all_reduce`` of a JAX array and of a NumPy array (eager, resolved);
- at 8 B and 64 KiB, where mpi4jax is installed, the other collectives inside jit, each
  against mpi4jax's (``broadcast: mpitensor.jax`` against ``broadcast: mpi4jax``, ...).

Every other round runs the variants in the reverse order.

Each time is the median over rounds of the slowest rank's mean time per call; each ratio the
median over rounds of the ratio within the round (the variants it compares ran one after the
other, so a slower spell of the machine moves both).
Run ``mpiexec -n 2 python -m mpitensor.bench jax``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._core.mpi import MPI
from ._common import markdown_table, seconds_per_call, text_table

__all__ = ["format_jax", "run_jax"]

_SIZES = {"8 B": 2, "64 KiB": 16384, "1 MiB": 262144, "16 MiB": 4194304}


def _reps(elements: int) -> int:
    return max(20, min(3000, 200_000_000 // (elements * 4 * 8 + 50_000)))


def _variants(elements: int) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    import mpitensor as mt
    import mpitensor.jax as mtj

    x = jnp.ones(elements, jnp.float32)
    ours = jax.jit(mtj.all_reduce)
    floor = jax.jit(lambda v: v + 0)
    calls: dict[str, Callable[[], Any]] = {
        "mpitensor.jax": lambda: ours(x).block_until_ready(),
        "jit floor": lambda: floor(x).block_until_ready(),
    }
    mpi4jax = _mpi4jax()
    if mpi4jax is not None:
        theirs = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))
        calls["mpi4jax"] = lambda: theirs(x).block_until_ready()
    if elements <= 2:
        host = np.ones(elements, np.float32)
        calls["mt.all_reduce (JAX)"] = lambda: mt.all_reduce(x).resolve().block_until_ready()
        calls["mt.all_reduce (NumPy)"] = lambda: mt.all_reduce(host).resolve()
    if mpi4jax is not None and elements <= 16384:
        calls.update(_others(mtj, mpi4jax, elements))
    return calls


def _others(mtj: Any, mpi4jax: Any, elements: int) -> dict[str, Callable[[], Any]]:
    """The other collectives inside jit, mpitensor.jax's and mpi4jax's, on `elements` float32 per rank."""
    import jax
    import jax.numpy as jnp

    size = MPI.COMM_WORLD.Get_size()
    peer = (MPI.COMM_WORLD.Get_rank() + 1) % size
    x = jnp.ones(elements * size, jnp.float32)
    pairs = {
        "broadcast": (lambda v: mtj.broadcast(v, 0), lambda v: mpi4jax.bcast(v, 0)),
        "all_gather": (mtj.all_gather, mpi4jax.allgather),
        "all_to_all": (lambda v: mtj.all_to_all(v.reshape(size, -1)), lambda v: mpi4jax.alltoall(v.reshape(size, -1))),
        "gather": (lambda v: mtj.gather(v, 0), lambda v: mpi4jax.gather(v, root=0)),
        "reduce": (lambda v: mtj.reduce(v, "sum", 0), lambda v: mpi4jax.reduce(v, op=MPI.SUM, root=0)),
        "scan": (mtj.scan, lambda v: mpi4jax.scan(v, op=MPI.SUM)),
        "sendrecv": (lambda v: mtj.sendrecv(v, v, source=peer, dest=peer),
                     lambda v: mpi4jax.sendrecv(v, v, source=peer, dest=peer)),
    }
    calls: dict[str, Callable[[], Any]] = {}
    for name, (ours, theirs) in pairs.items():
        for library, function in (("mpitensor.jax", ours), ("mpi4jax", theirs)):
            compiled = jax.jit(function)
            calls[f"{name}: {library}"] = lambda compiled=compiled: jax.block_until_ready(compiled(x))
    return calls


def _mpi4jax() -> Any:
    try:
        import mpi4jax
    except ImportError:
        return None
    return mpi4jax


def run_jax(rounds: int = 15, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time the jitted all-reduces (every rank calls it).

    Returns:
        Per size the median seconds per call of each variant, and the ratios
        mpitensor.jax / mpi4jax (where mpi4jax is installed) and, at 8 B, JAX / NumPy
        of the eager call; ``{"skipped": reason}`` without JAX.
    """
    try:
        import jax  # noqa: F401
    except ImportError:
        return {"skipped": "JAX is not installed (pip install jax)"}
    import mpitensor as mt

    with mt.DistributedContext.init() as ctx:
        variants = {size: _variants(elements) for size, elements in _SIZES.items()}
        times = {size: {name: [] for name in calls} for size, calls in variants.items()}
        for round_ in range(rounds):
            for size, calls in variants.items():
                # Every other round in the reverse order: no variant always runs first.
                for name, call in list(calls.items())[::1 if round_ % 2 == 0 else -1]:
                    took = seconds_per_call(call, _reps(_SIZES[size]), ctx.comm.Barrier)
                    times[size][name].append(ctx.comm.allreduce(took, op=MPI.MAX))
        variants = {}
    if progress is not None and ctx.rank == 0:
        progress("jax: done")
    medians = {size: {name: float(np.median(v)) for name, v in by.items()} for size, by in times.items()}
    ratios = {size: _paired(by["mpitensor.jax"], by["mpi4jax"]) for size, by in times.items() if "mpi4jax" in by}
    others = {size: {name.split(":")[0]: _paired(seconds, by[name.replace("mpitensor.jax", "mpi4jax")])
                     for name, seconds in by.items() if name.endswith(": mpitensor.jax")}
              for size, by in times.items()}
    small = times["8 B"]
    return {"ranks": ctx.size, "rounds": rounds, "seconds": medians, "mpitensor_jax_over_mpi4jax": ratios,
            "others_over_mpi4jax": {size: by for size, by in others.items() if by},
            "eager_jax_over_numpy_8b": _paired(small["mt.all_reduce (JAX)"], small["mt.all_reduce (NumPy)"])}


def _paired(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of `ours` / `theirs` within each round."""
    return float(np.median(np.asarray(ours) / np.asarray(theirs)))


def format_jax(result: dict[str, Any], markdown: bool = True) -> str:
    """The result as a table: per size and variant the time per call."""
    if "skipped" in result:
        return f"jax: skipped ({result['skipped']})"
    ratios = result["mpitensor_jax_over_mpi4jax"]
    header = ["size", "variant", "us per call"]
    rows = [[size, name, f"{seconds * 1e6:.1f}"] for size, by in result["seconds"].items()
            for name, seconds in by.items()]
    against = ", ".join(f"{size} {ratio:.3f}x" for size, ratio in ratios.items()) or "mpi4jax not installed"
    others = "; ".join(f"{size}: " + ", ".join(f"{name} {ratio:.3f}x" for name, ratio in by.items())
                       for size, by in result.get("others_over_mpi4jax", {}).items())
    title = (f"all-reduce inside jax.jit, {result['ranks']} ranks, medians of {result['rounds']} rounds "
             f"(ratios: of the ratios within each round): "
             f"mpitensor.jax / mpi4jax {against}; eager mt.all_reduce JAX / NumPy at 8 B "
             f"{result['eager_jax_over_numpy_8b']:.2f}x")
    if others:
        title += f"; other collectives / mpi4jax's, {others}"
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    return f"{title}\n\n{table}\n" if markdown else f"{title}\n{table}"
