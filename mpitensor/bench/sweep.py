"""The all-reduce sweep: mpitensor beside raw mpi4py, its peers and a memory-copy floor.

For every size (float32 sum), in the same run and interleaved round by round:

- ``raw``: mpi4py ``Iallreduce`` + ``Wait`` on the same buffers (the baseline of every ratio);
- ``raw_written``: the same, its input written (copied from another array) before each call,
  as a program's freshly computed input is: where MPI's peers read it from this rank's memory
  (Open MPI's single-copy transfers), that costs more than reading a buffer nobody writes;
- ``mt``: ``mpitensor.all_reduce(t).resolve()``, consistency check off, default data path
  (the shared-memory fast path where it applies);
- ``mt_checked``: the same with the consistency check on (the default configuration);
- ``mt_plain``: check off and ``shared_memory=False``: the wrapper's cost over the very
  same ``MPI_Iallreduce``;
- ``mt_noprogress``: check off and ``progress=False`` (the other mt variants run the default:
  a progress thread where MPI provides ``MPI_THREAD_MULTIPLE`` and the node has a core to
  spare beyond one per rank);
- ``pickle``: mpi4py's pickle-based ``comm.allreduce`` of the NumPy array;
- ``gloo``: ``torch.distributed.all_reduce`` on the gloo backend (when torch is installed);
- ``memcpy``: one ``numpy.copyto`` of the message on each rank: the memory floor.

Latency is the median over rounds of the slowest rank's mean time per call; algbw = size /
latency and busbw = algbw x 2(n-1)/n (nccl-tests' definitions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import DistributedConfig, DistributedContext, all_reduce, from_numpy
from .._core.mpi import MPI
from ._common import (
    Timing,
    busbw_factor,
    check_variants,
    format_size,
    gbps,
    markdown_table,
    median,
    ratio,
    round_done,
    size_axis,
    start_gloo,
    stop_gloo,
    text_table,
    us,
)

__all__ = ["LABELS", "VARIANTS", "format_sweep", "plot_sweep", "run_sweep"]

VARIANTS = ("raw", "raw_written", "mt", "mt_checked", "mt_plain", "mt_noprogress", "pickle", "gloo", "memcpy")
LABELS = {
    "raw": "raw mpi4py Iallreduce+Wait",
    "raw_written": "raw mpi4py, its input written before each call",
    "mt": "mpitensor all_reduce+resolve (check off)",
    "mt_checked": "mpitensor all_reduce+resolve (check on)",
    "mt_plain": "mpitensor, check off, shared memory off",
    "mt_noprogress": "mpitensor, check off, progress thread off",
    "pickle": "mpi4py pickle allreduce",
    "gloo": "torch.distributed gloo all_reduce",
    "memcpy": "memory copy (floor)",
}
_CONFIGS = {
    "mt": DistributedConfig(check=False),
    "mt_checked": DistributedConfig(check=True),
    "mt_plain": DistributedConfig(check=False, shared_memory=False),
    "mt_noprogress": DistributedConfig(check=False, progress=False),
}


def run_sweep(
    sizes: Sequence[int],
    *,
    reps: int = 5,
    target: float = 0.05,
    variants: Sequence[str] = VARIANTS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time every variant at every size; call it on every rank (MPI must be initialized).

    Args:
        sizes: message sizes in bytes (multiples of 4: float32 elements).
        reps: rounds; each figure is the median over them.
        target: seconds each timed batch should last.
        variants: which of `VARIANTS` to run.
        progress: called on rank 0 with a line after each round.

    Returns:
        ``{"kind": "sweep", "ranks", "sizes", "reps", "variants": {name: {"label",
        "median_s", "samples_s", "iters"}}, "skipped": {name: reason}}``; a skipped variant
        has no entry under ``variants``.
    """
    check_variants(variants, VARIANTS)
    comm = MPI.COMM_WORLD.Dup()
    ranks = comm.Get_size()
    timing = Timing(comm, target, reps)
    dist, skipped = _join_gloo(comm, variants)
    active = [v for v in variants if v not in skipped]
    samples: dict[str, list[list[float]]] = {v: [[] for _ in sizes] for v in active}
    buffers = [_Buffers(nbytes, dist) for nbytes in sizes]
    try:
        for rep in range(reps):
            for variant in active:
                _time_round(timing, comm, variant, buffers, samples[variant])
            round_done(progress, comm, "sweep", rep, reps)
    finally:
        stop_gloo(dist)
        comm.Free()
    return {
        "kind": "sweep",
        "ranks": ranks,
        "sizes": list(sizes),
        "reps": reps,
        "dtype": "float32",
        "op": "sum",
        "variants": {v: _variant_result(v, samples[v], timing) for v in active},
        "skipped": skipped,
    }


def _join_gloo(comm: Any, variants: Sequence[str]) -> tuple[Any, dict[str, str]]:
    """Join the gloo group when `variants` has gloo; the group (or None) and the variants skipped."""
    skipped: dict[str, str] = {}
    dist = None
    if "gloo" in variants:
        dist = start_gloo(comm)
        if dist is None:
            skipped["gloo"] = "torch is not installed (pip install torch for the gloo column)"
    return dist, skipped


def _time_round(timing: Timing, comm: Any, variant: str, buffers: Sequence[_Buffers],
                samples: list[list[float]]) -> None:
    """Time one batch of `variant` at every size (an mt variant inside a context of its own)."""
    config = _CONFIGS.get(variant)
    if config is None:
        for index, buf in enumerate(buffers):
            samples[index].append(timing.batch((variant, index), buf.call(variant, comm)))
        return
    with DistributedContext.init(config=config):
        for index, buf in enumerate(buffers):
            samples[index].append(timing.batch((variant, index), buf.mt_call()))


def _variant_result(variant: str, samples: list[list[float]], timing: Timing) -> dict[str, Any]:
    """One variant's entry in the result: its label, medians, samples and batch sizes."""
    return {
        "label": LABELS[variant],
        "median_s": [median(s) for s in samples],
        "samples_s": samples,
        "iters": [timing.iterations((variant, i)) for i in range(len(samples))],
    }


class _Buffers:
    """The arrays of one message size, shared by every variant."""

    def __init__(self, nbytes: int, dist: Any) -> None:
        count = max(1, nbytes // 4)
        self.send = np.ones(count, np.float32)
        self.recv = np.empty(count, np.float32)
        self.copy = np.empty(count, np.float32)
        self.tensor = from_numpy(np.ones(count, np.float32))
        self.torch_tensor = None
        if dist is not None:
            import torch

            # Zeros, so that summing in place never overflows.
            self.torch_tensor = torch.zeros(count, dtype=torch.float32)
        self.dist = dist

    def call(self, variant: str, comm: Any) -> Callable[[], Any]:
        send, recv = self.send, self.recv
        if variant == "raw":
            return lambda: comm.Iallreduce(send, recv, MPI.SUM).Wait()
        if variant == "raw_written":
            written = self.copy

            def rewritten() -> None:
                np.copyto(written, send)
                comm.Iallreduce(written, recv, MPI.SUM).Wait()

            return rewritten
        if variant == "pickle":
            return lambda: comm.allreduce(send, op=MPI.SUM)
        if variant == "gloo":
            dist, tensor = self.dist, self.torch_tensor
            return lambda: dist.all_reduce(tensor)
        if variant == "memcpy":
            copy = self.copy
            return lambda: np.copyto(copy, send)
        raise ValueError(variant)

    def mt_call(self) -> Callable[[], Any]:
        tensor = self.tensor

        def call() -> None:
            # The result is dropped before the next call, as raw reuses its receive buffer:
            # both then work on the same amount of memory (a result kept alive meanwhile
            # makes the next call use another block).
            all_reduce(tensor).resolve()

        return call


# -- presentation ----------------------------------------------------------------------------


def _column(result: dict[str, Any], name: str) -> list[float] | None:
    entry = result["variants"].get(name)
    return None if entry is None else entry["median_s"]


def _rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    sizes = result["sizes"]
    factor = busbw_factor(result["ranks"])
    raw, mt = _column(result, "raw"), _column(result, "mt")
    checked, plain = _column(result, "mt_checked"), _column(result, "mt_plain")
    noprogress = _column(result, "mt_noprogress")
    pickle, gloo, memcpy = _column(result, "pickle"), _column(result, "gloo"), _column(result, "memcpy")
    header = [
        "size", "raw us", "mt us", "mt/raw", "checked us", "checked/raw", "plain us", "plain/raw",
        "no-progress us", "no-progress/raw", "pickle us", "pickle/mt", "gloo us", "gloo/mt", "memcpy us",
        "raw busbw GB/s", "mt busbw GB/s", "mt/raw busbw",
    ]

    def at(column: list[float] | None, i: int) -> float | None:
        return None if column is None else column[i]

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or not b else a / b

    rows = []
    for i, nbytes in enumerate(sizes):
        t_raw, t_mt = at(raw, i), at(mt, i)
        bus_raw = div(nbytes * factor, t_raw)
        bus_mt = div(nbytes * factor, t_mt)
        rows.append([
            format_size(nbytes),
            us(t_raw),
            us(t_mt),
            ratio(div(t_mt, t_raw)),
            us(at(checked, i)),
            ratio(div(at(checked, i), t_raw)),
            us(at(plain, i)),
            ratio(div(at(plain, i), t_raw)),
            us(at(noprogress, i)),
            ratio(div(at(noprogress, i), t_raw)),
            us(at(pickle, i)),
            ratio(div(at(pickle, i), t_mt)),
            us(at(gloo, i)),
            ratio(div(at(gloo, i), t_mt)),
            us(at(memcpy, i)),
            gbps(bus_raw),
            gbps(bus_mt),
            ratio(div(bus_mt, bus_raw)),
        ])
    return header, rows


def format_sweep(result: dict[str, Any], markdown: bool = True) -> str:
    """The sweep as a table (Markdown, or aligned text for a terminal), with its legend."""
    header, rows = _rows(result)
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    legend = [
        f"All-reduce, float32 sum, {result['ranks']} ranks; median of {result['reps']} rounds of the "
        "slowest rank's mean time per call.",
        "mt: mpitensor check off (shared-memory path where it applies); checked: check on; "
        "plain: check off, shared memory off; no-progress: check off, progress thread off (the "
        "others run the default: a progress thread only where the node has a core to spare). "
        "x/raw: time ratio to raw mpi4py Iallreduce+Wait "
        "(lower is better); pickle/mt and gloo/mt: how many times faster mt is. "
        "busbw = size/time x 2(n-1)/n. Each result is dropped before the next call (raw reuses "
        "its receive buffer).",
    ]
    for name, reason in result.get("skipped", {}).items():
        legend.append(f"{name} skipped: {reason}.")
    return "\n".join(legend) + "\n\n" + table + "\n"


def plot_sweep(result: dict[str, Any], path: str) -> bool:
    """Latency and bus bandwidth against size, one line per variant, as a PNG.

    Returns:
        False when matplotlib is not installed (nothing written).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = result["sizes"]
    factor = busbw_factor(result["ranks"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, entry in result["variants"].items():
        times = entry["median_s"]
        style = "--" if name == "memcpy" else "-"
        left.plot(sizes, [t * 1e6 for t in times], style, marker=".", label=entry["label"])
        scale = 1.0 if name == "memcpy" else factor
        right.plot(sizes, [n * scale / t / 1e9 for n, t in zip(sizes, times)], style, marker=".", label=entry["label"])
    left.set(yscale="log", xlabel="message size", ylabel="latency (us)",
             title=f"all-reduce latency, {result['ranks']} ranks")
    right.set(yscale="log", xlabel="message size", ylabel="busbw (GB/s); memcpy: copy rate (GB/s)",
              title="bus bandwidth (memory copy: the floor)")
    for axis in (left, right):
        size_axis(axis, sizes)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def format_size_list(sizes: Sequence[int]) -> str:
    """``8 B .. 64 MiB (24 sizes)``."""
    return f"{format_size(sizes[0])} .. {format_size(sizes[-1])} ({len(sizes)} sizes)" if sizes else "none"


__all__ += ["format_size_list"]
