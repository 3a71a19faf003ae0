"""Fused all-reduce of many small tensors against one call per tensor.

``mpitensor.all_reduce([t0, t1, ...])`` packs the tensors into buckets and all-reduces each
bucket once. Beside it, in the same run: one ``all_reduce`` per tensor (all started, then all
resolved), with the consistency check on and off, and two raw mpi4py references: one
``Iallreduce`` per tensor then ``Waitall``, a single ``Iallreduce`` of an already packed
buffer (no packing cost: the floor), and the same after packing the tensors in each call
(``numpy.concatenate``, the work a fused call must do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import DistributedConfig, DistributedContext, all_reduce, from_numpy
from .._core.mpi import MPI
from ._common import Timing, format_size, markdown_table, median, ratio, round_done, text_table, us

__all__ = ["format_fused", "run_fused"]

_LABELS = {
    "raw_separate": "raw mpi4py: one Iallreduce per tensor, then Waitall",
    "raw_packed": "raw mpi4py: one Iallreduce of a packed buffer (no packing)",
    "raw_pack_each": "raw mpi4py: numpy.concatenate into a buffer, then one Iallreduce of it",
    "separate_checked": "mpitensor: one all_reduce per tensor, check on",
    "fused_checked": "mpitensor: all_reduce(list), check on",
    "separate": "mpitensor: one all_reduce per tensor, check off",
    "fused": "mpitensor: all_reduce(list), check off",
}


def run_fused(
    count: int = 256,
    tensor_bytes: int = 4096,
    *,
    reps: int = 5,
    target: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the fused and the one-call-per-tensor all-reduce of `count` float32 tensors.

    Call it on every rank (MPI must be initialized).

    Args:
        count: how many tensors.
        tensor_bytes: each tensor's size in bytes.
        reps: rounds; each figure is the median over them.
        target: seconds each timed batch should last.
        progress: called on rank 0 with a line after each round.

    Returns:
        ``{"kind": "fused", "ranks", "count", "tensor_bytes", "reps", "variants": {name:
        {"label", "median_s", "samples_s"}}, "skipped": {name: reason}}``.
    """
    comm = MPI.COMM_WORLD.Dup()
    ranks = comm.Get_size()
    timing = Timing(comm, target, reps)
    data = _Tensors(count, tensor_bytes)
    samples: dict[str, list[float]] = {name: [] for name in _LABELS}
    skipped: dict[str, str] = {}
    try:
        for rep in range(reps):
            _time_raw(timing, comm, data, samples)
            for suffix, check in (("_checked", True), ("", False)):
                _time_mt(timing, data.tensors, suffix, check, samples, skipped)
            round_done(progress, comm, "fused", rep, reps)
    finally:
        comm.Free()
    return {
        "kind": "fused",
        "ranks": ranks,
        "count": count,
        "tensor_bytes": tensor_bytes,
        "reps": reps,
        "variants": {
            name: {"label": label, "median_s": median(samples[name]), "samples_s": samples[name]}
            for name, label in _LABELS.items()
            if name not in skipped
        },
        "skipped": skipped,
    }


class _Tensors:
    """`count` float32 tensors of `tensor_bytes` each: as arrays, packed, and as mpitensor tensors."""

    def __init__(self, count: int, tensor_bytes: int) -> None:
        elements = max(1, tensor_bytes // 4)
        self.arrays = [np.full(elements, float(i % 7), np.float32) for i in range(count)]
        self.recvs = [np.empty_like(a) for a in self.arrays]
        self.packed = np.concatenate(self.arrays)
        self.packed_out = np.empty_like(self.packed)
        self.refill = np.empty_like(self.packed)
        self.tensors = [from_numpy(a.copy()) for a in self.arrays]


def _time_raw(timing: Timing, comm: Any, data: _Tensors, samples: dict[str, list[float]]) -> None:
    """Time one batch of each raw mpi4py reference: one Iallreduce per tensor, and one packed."""
    arrays, recvs, packed, packed_out = data.arrays, data.recvs, data.packed, data.packed_out
    samples["raw_separate"].append(timing.batch("raw_separate", lambda: MPI.Request.Waitall(
        [comm.Iallreduce(a, b, MPI.SUM) for a, b in zip(arrays, recvs)])))
    samples["raw_packed"].append(timing.batch("raw_packed", lambda: comm.Iallreduce(
        packed, packed_out, MPI.SUM).Wait()))
    refill = data.refill

    def pack_each() -> None:
        np.concatenate(arrays, out=refill)
        comm.Iallreduce(refill, packed_out, MPI.SUM).Wait()

    samples["raw_pack_each"].append(timing.batch("raw_pack_each", pack_each))


def _time_mt(timing: Timing, tensors: list[Any], suffix: str, check: bool, samples: dict[str, list[float]],
             skipped: dict[str, str]) -> None:
    """Time one all_reduce per tensor, then the fused all_reduce (unless skipped), check on or off.

    A fused call that raises TypeError marks ``"fused" + suffix`` skipped, with the reason.
    """
    with DistributedContext.init(config=DistributedConfig(check=check)):
        samples["separate" + suffix].append(timing.batch("separate" + suffix, lambda: [
            h.resolve() for h in [all_reduce(t) for t in tensors]]))
        name = "fused" + suffix
        if name in skipped:
            return
        try:
            all_reduce(tensors).resolve()
        except TypeError as exc:
            skipped[name] = f"all_reduce rejects a list of tensors here ({exc})"
            return
        samples[name].append(timing.batch(name, lambda: all_reduce(tensors).resolve()))


def format_fused(result: dict[str, Any], markdown: bool = True) -> str:
    """The fused benchmark as a table, with the speed-ups of fusing."""
    variants = result["variants"]
    raw = variants["raw_separate"]["median_s"]
    header = ["variant", "time us", "x raw one-per-tensor"]
    rows = [[entry["label"], us(entry["median_s"]), ratio(entry["median_s"] / raw)] for entry in variants.values()]
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    lines = [
        f"{result['count']} float32 tensors of {format_size(result['tensor_bytes'])} each, sum, "
        f"{result['ranks']} ranks; median of {result['reps']} rounds.",
    ]
    for suffix, what in (("", "check off"), ("_checked", "check on")):
        fused, separate = variants.get("fused" + suffix), variants.get("separate" + suffix)
        if fused and separate:
            lines.append(f"Fused is {separate['median_s'] / fused['median_s']:.1f}x faster than one call per "
                         f"tensor ({what}).")
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"{name} skipped: {reason}.")
    return "\n".join(lines) + "\n\n" + table + "\n"
