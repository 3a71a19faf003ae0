"""gather, scatter, scan, exscan and the object collectives beside raw mpi4py.

For every collective and size, in the same run and interleaved round by round:

- ``raw``: mpi4py on the same buffers (``Igather``, ``Iscatter``, ``Iscan``, ``Iexscan`` +
  ``Wait``; for objects, mpi4py's pickle-based ``bcast``, ``allgather`` and ``gather``);
- ``mt``: the mpitensor call + ``resolve()``, consistency check off;
- ``mt_checked``: the same with the check on (the default configuration).

Sizes are per rank: what each rank sends to a gather, receives from a scatter, reduces in
a scan (float32 sum), or pickles (a ``bytes`` object) in an object collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import (
    DistributedConfig,
    DistributedContext,
    all_gather_object,
    broadcast_object,
    exscan,
    from_numpy,
    gather,
    gather_object,
    scan,
    scatter,
)
from .._core.mpi import MPI
from ._common import Timing, format_size, markdown_table, median, ratio, round_done, text_table, us

__all__ = ["COLLECTIVES", "format_collectives", "run_collectives"]

COLLECTIVES = ("gather", "scatter", "scan", "exscan", "broadcast_object", "all_gather_object", "gather_object")
_VARIANTS = {"mt": DistributedConfig(check=False), "mt_checked": DistributedConfig(check=True)}


def run_collectives(
    sizes: Sequence[int],
    *,
    reps: int = 5,
    target: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time every collective of `COLLECTIVES` at every size, raw and through mpitensor.

    Call it on every rank (MPI must be initialized).

    Args:
        sizes: bytes per rank (multiples of 4: float32 elements).
        reps: rounds; each figure is the median over them.
        target: seconds each timed batch should last.
        progress: called on rank 0 with a line after each round.

    Returns:
        ``{"kind": "collectives", "ranks", "sizes", "reps", "collectives": {name: {variant:
        {"median_s", "samples_s"}}}}``.
    """
    comm = MPI.COMM_WORLD.Dup()
    ranks = comm.Get_size()
    timing = Timing(comm, target, reps)
    buffers = [_Buffers(nbytes, ranks, comm.Get_rank()) for nbytes in sizes]
    variants = ("raw", *_VARIANTS)
    samples = {c: {v: [[] for _ in sizes] for v in variants} for c in COLLECTIVES}
    try:
        for rep in range(reps):
            for index, buf in enumerate(buffers):
                for name in COLLECTIVES:
                    key = (name, "raw", index)
                    samples[name]["raw"][index].append(timing.batch(key, buf.raw(name, comm)))
            for variant, config in _VARIANTS.items():
                with DistributedContext.init(config=config):
                    for index, buf in enumerate(buffers):
                        for name in COLLECTIVES:
                            key = (name, variant, index)
                            samples[name][variant][index].append(timing.batch(key, buf.mt(name)))
            round_done(progress, comm, "collectives", rep, reps)
    finally:
        comm.Free()
    return {
        "kind": "collectives",
        "ranks": ranks,
        "sizes": list(sizes),
        "reps": reps,
        "collectives": {
            c: {v: {"median_s": [median(s) for s in samples[c][v]], "samples_s": samples[c][v]} for v in variants}
            for c in COLLECTIVES
        },
    }


class _Buffers:
    """The arrays and objects of one size, shared by raw and mpitensor calls."""

    def __init__(self, nbytes: int, ranks: int, rank: int) -> None:
        count = max(1, nbytes // 4)
        self.rank = rank
        self.send = np.ones(count, np.float32)
        self.recv = np.empty(count, np.float32)
        self.gathered = np.empty(count * ranks, np.float32)
        self.whole = np.ones(count * ranks, np.float32)
        self.tensor = from_numpy(np.ones(count, np.float32))
        self.whole_tensor = from_numpy(self.whole)
        self.obj = bytes(count * 4)
        self.shape = self.whole.shape

    def raw(self, name: str, comm: Any) -> Callable[[], Any]:
        send, recv, root = self.send, self.recv, self.rank == 0
        gathered, whole, obj = self.gathered if root else None, self.whole if root else None, self.obj
        calls: dict[str, Callable[[], Any]] = {
            "gather": lambda: comm.Igather(send, gathered, root=0).Wait(),
            "scatter": lambda: comm.Iscatter(whole, recv, root=0).Wait(),
            "scan": lambda: comm.Iscan(send, recv, MPI.SUM).Wait(),
            "exscan": lambda: comm.Iexscan(send, recv, MPI.SUM).Wait(),
            "broadcast_object": lambda: comm.bcast(obj if root else None, root=0),
            "all_gather_object": lambda: comm.allgather(obj),
            "gather_object": lambda: comm.gather(obj, root=0),
        }
        return calls[name]

    def mt(self, name: str) -> Callable[[], Any]:
        tensor, obj, root = self.tensor, self.obj, self.rank == 0
        whole, shape = (self.whole_tensor if root else None), self.shape
        calls: dict[str, Callable[[], Any]] = {
            "gather": lambda: gather(tensor).resolve(),
            "scatter": lambda: scatter(whole, shape=shape, dtype=np.float32).resolve(),
            "scan": lambda: scan(tensor, "sum").resolve(),
            "exscan": lambda: exscan(tensor, "sum").resolve(),
            "broadcast_object": lambda: broadcast_object(obj if root else None).resolve(),
            "all_gather_object": lambda: all_gather_object(obj).resolve(),
            "gather_object": lambda: gather_object(obj).resolve(),
        }
        return calls[name]


def _rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["collective", "size", "raw us", "mt us", "mt/raw", "checked us", "checked/raw"]
    rows = []
    for name, variants in result["collectives"].items():
        raw, mt, checked = (variants[v]["median_s"] for v in ("raw", "mt", "mt_checked"))
        for i, nbytes in enumerate(result["sizes"]):
            rows.append([name, format_size(nbytes), us(raw[i]), us(mt[i]), ratio(mt[i] / raw[i] if raw[i] else None),
                         us(checked[i]), ratio(checked[i] / raw[i] if raw[i] else None)])
    return header, rows


def format_collectives(result: dict[str, Any], markdown: bool = True) -> str:
    """The collectives' timings as a table (Markdown, or aligned text), with its legend."""
    header, rows = _rows(result)
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    legend = (
        f"gather, scatter, scan, exscan (float32 sum) and object collectives, {result['ranks']} ranks, sizes per "
        f"rank; median of {result['reps']} rounds of the slowest rank's mean time per call. raw: mpi4py on the "
        "same buffers (Igather/Iscatter/Iscan/Iexscan + Wait; pickle-based bcast/allgather/gather for "
        "objects); mt: mpitensor + resolve(), check off; checked: check on. x/raw: time ratio (lower is better)."
    )
    return legend + "\n\n" + table + "\n"
