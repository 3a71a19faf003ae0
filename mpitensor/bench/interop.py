"""All-reduce of a torch tensor against the same data as a NumPy array.

A CPU torch tensor of 64 KiB or more is sent without a copy, through torch's copy-on-write
clone (see `mpitensor._core.interop`), and comes back as a torch tensor over the result
buffer. This times both inputs in interleaved rounds, so that the ratio compares figures
taken under the same load; the target is a torch input within 1.1x of the NumPy input.

A third row separates the memory from the handling: NumPy asks the kernel for transparent
huge pages for large arrays, torch's allocator does not, and with huge pages only on
request (``madvise``) the reduction of the same bytes runs slower on plain pages. The
"NumPy, plain pages" figure is a NumPy input allocated without them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from .. import DistributedConfig, DistributedContext, all_reduce
from .._core.mpi import MPI
from ._common import Timing, format_size, markdown_table, median, ratio, round_done, text_table, us

__all__ = ["format_interop", "run_interop"]


def run_interop(
    sizes: Sequence[int] = (1 << 20, 16 << 20),
    *,
    reps: int = 5,
    target: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the sum all-reduce of float32 data given as NumPy arrays and as torch tensors.

    Call it on every rank (MPI must be initialized). The check is off, as in the sweep's
    rows against raw MPI.

    Returns:
        ``{"kind": "interop", "ranks", "reps", "rows": [{"bytes", "numpy_s", "torch_s",
        "ratio", "numpy_samples_s", "torch_samples_s"}], "skipped": reason or None}``.
    """
    comm = MPI.COMM_WORLD.Dup()
    result: dict[str, Any] = {"kind": "interop", "ranks": comm.Get_size(), "reps": reps, "rows": [],
                              "skipped": None}
    try:
        import torch
    except ImportError:
        comm.Free()
        result["skipped"] = "torch is not installed"
        return result
    timing = Timing(comm, target, reps)
    samples: dict[int, dict[str, list[float]]] = {size: {"numpy": [], "plain": [], "torch": []} for size in sizes}
    try:
        with DistributedContext.init(config=DistributedConfig(check=False)):
            arrays = {size: np.ones(size // 4, np.float32) for size in sizes}
            plain = _without_huge_pages(sizes)
            tensors = {size: torch.ones(size // 4) for size in sizes}
            for rep in range(reps):
                for size in sizes:  # interleaved: each round times both inputs of each size
                    array, tensor = arrays[size], tensors[size]
                    numpy_call = partial(_reduce, array)
                    torch_call = partial(_reduce, tensor)
                    samples[size]["numpy"].append(timing.batch(("numpy", size), numpy_call))
                    samples[size]["torch"].append(timing.batch(("torch", size), torch_call))
                    plain_call = partial(_reduce, plain[size])
                    samples[size]["plain"].append(timing.batch(("plain", size), plain_call))
                round_done(progress, comm, "interop", rep, reps)
    finally:
        comm.Free()
    for size in sizes:
        numpy_s, torch_s = median(samples[size]["numpy"]), median(samples[size]["torch"])
        plain_s = median(samples[size]["plain"])
        result["rows"].append({"bytes": size, "numpy_s": numpy_s, "torch_s": torch_s, "ratio": torch_s / numpy_s,
                               "plain_s": plain_s, "plain_ratio": torch_s / plain_s,
                               "numpy_samples_s": samples[size]["numpy"], "torch_samples_s": samples[size]["torch"]})
    return result


def _without_huge_pages(sizes: Sequence[int]) -> dict[int, np.ndarray]:
    """float32 arrays of ones allocated without NumPy's request for huge pages (as torch allocates)."""
    multiarray = getattr(np, "_core", getattr(np, "core", None)).multiarray
    previous = multiarray._set_madvise_hugepage(False)
    try:
        return {size: np.ones(size // 4, np.float32) for size in sizes}
    finally:
        multiarray._set_madvise_hugepage(previous)


def _reduce(value: Any) -> Any:
    return all_reduce(value).resolve()


def format_interop(result: dict[str, Any], markdown: bool = True) -> str:
    """The torch-input against NumPy-input all-reduce, as a table with the ratio."""
    if result.get("skipped"):
        return f"interop skipped: {result['skipped']}.\n"
    header = ["size", "NumPy input us", "NumPy, plain pages us", "torch input us", "torch / NumPy",
              "torch / NumPy plain pages"]
    rows = [[format_size(row["bytes"]), us(row["numpy_s"]), us(row["plain_s"]), us(row["torch_s"]),
             ratio(row["ratio"]), ratio(row["plain_ratio"])] for row in result["rows"]]
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    intro = (f"float32 sum all-reduce, check off, {result['ranks']} ranks; median of {result['reps']} "
             "interleaved rounds (target: torch input within 1.10x of NumPy input).")
    return intro + "\n\n" + table + "\n"
