"""``python -m mpitensor info``: one table, printed by rank 0, of what every rank runs on."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path
from typing import Any

from .._collectives import native
from .._core import mpi as _mpi
from .._core import mpi_arithmetic
from .._core.kernels import keys as compiled_keys
from .._core.kernels import streaming_add
from .._runtime.context import DistributedContext, local_rank_env_check
from .._transport.mpi.pair import pairs_built

__all__ = ["collect", "format_table", "main"]

_SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")


def _data_path(ctx: DistributedContext) -> str:
    if ctx.device.kind != "cuda":
        return "host"
    from .._transport.gpu.data_path import data_path_name

    return data_path_name(ctx)


def collect(ctx: DistributedContext) -> list[dict[str, Any]]:
    """Every rank's row of the table (gathered on every rank).

    Args:
        ctx: an open context.

    Returns:
        One dict per rank, in rank order.
    """
    name, version = _mpi.vendor()
    slurm = {key: os.environ[key] for key in _SLURM_VARIABLES if key in os.environ}
    row = {
        "rank": ctx.rank,
        "host": ctx.host,
        "local_rank": ctx.local_rank,
        "local_size": ctx.local_size,
        "device": str(ctx.device),
        "mpi": f"{name} {version}",
        "thread_level": ctx.thread_level,
        "path": _data_path(ctx),
        "slurm": slurm,
        "local_rank_note": local_rank_env_check(ctx),
        "pid": os.getpid(),
        "compiled": native.status(bind=True),
        "streaming": streaming_add is not None,
        "keys": compiled_keys is not None,
        "pairs": pairs_built(),
        "jax_handler": _jax_handler_built(),
        "wrong_sums": " ".join(sorted(str(dtype) for dtype in mpi_arithmetic.probe())),
        "check": ctx.config.check,
        "fault_tolerance": _mpi.fault_tolerance(),
    }
    return ctx.comm.allgather(row)


def _jax_handler_built() -> bool:
    """Whether mpitensor.jax's compiled handler is installed (looked up without importing JAX)."""
    folder = Path(__file__).resolve().parent.parent / "jax"
    return any((folder / f"_ffi{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table, with notes below it."""
    columns = [
        ("rank", "rank"),
        ("host", "host"),
        ("local", "local_rank"),
        ("device", "device"),
        ("MPI", "mpi"),
        ("threads", "thread_level"),
        ("path", "path"),
    ]
    if any(row["slurm"] for row in rows):
        columns.append(("slurm proc/local/node", "slurm_ids"))
        for row in rows:
            slurm = row["slurm"]
            row["slurm_ids"] = "/".join(slurm.get(k, "-") for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
    cells = [[str(row[key]) for _, key in columns] for row in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _) in enumerate(columns)]
    lines = ["  ".join(title.ljust(w) for (title, _), w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells)
    hosts = sorted({row["host"] for row in rows})
    lines.append(f"{len(rows)} rank(s) on {len(hosts)} host(s): {', '.join(hosts)}")
    if len(hosts) > 1:
        lines.extend(_per_host(rows))
    if rows and rows[0]["slurm"].get("SLURM_JOB_ID"):
        slurm = rows[0]["slurm"]
        lines.append(f"Slurm job {slurm['SLURM_JOB_ID']}, {slurm.get('SLURM_NTASKS', '?')} task(s)")
    compiled = {row["compiled"] for row in rows}
    if len(compiled) == 1:
        lines.append(f"compiled lane of small all-reduces: {compiled.pop()}")
    else:
        lines.extend(f"compiled lane on rank {row['rank']}: {row['compiled']}" for row in rows)
    lines.append(f"streaming sum of large shared-memory all-reduces: {_on_off(rows, 'streaming')}")
    lines.append(f"compiled MAX/MIN keys of float32 and float64: {_on_off(rows, 'keys')}")
    lines.append(f"shared pairs of 2 ranks on a node (held all-reduces, waits asleep): {_on_off(rows, 'pairs')}")
    handler = {row["jax_handler"] for row in rows}
    lines.append("mpitensor.jax's compiled handler (collectives inside jax.jit): "
                 + ("built" if handler == {True} else "not built (no C compiler at install)" if handler == {False}
                    else "built on some ranks only"))
    wrong = {row["wrong_sums"] for row in rows}
    if wrong != {""}:
        lines.append(f"MPI's own SUM of {' / '.join(sorted(wrong - {''}))} saturates instead of wrapping "
                     "(a local probe found it): mpitensor sums those dtypes in a wider type")
    else:
        lines.append("MPI's integer sums wrap as NumPy's do (a local probe checked every integer dtype)")
    lines.extend(_fault_tolerance(rows))
    if not all(row["check"] for row in rows):
        lines.append("consistency check OFF: ranks that disagree get whatever MPI does, which includes "
                     "wrong data, a hang or a crash of the job")
    for row in rows:
        if row["local_rank_note"]:
            lines.append(f"note: rank {row['rank']}: {row['local_rank_note']}")
    return "\n".join(lines)


def _fault_tolerance(rows: list[dict[str, Any]]) -> list[str]:
    """Whether the job survives the loss of a rank (``on_rank_failure="raise"``): one line, or one per rank."""
    said = {tuple(row["fault_tolerance"]) for row in rows}
    title = "survives the loss of a rank (DistributedConfig(on_rank_failure='raise'))"
    if len(said) == 1:
        supported, why = said.pop()
        return [f"{title}: {'yes' if supported else 'no'}: {why}"]
    return [f"{title} on rank {row['rank']}: {'yes' if row['fault_tolerance'][0] else 'no'}: "
            f"{row['fault_tolerance'][1]}" for row in rows]


def _on_off(rows: list[dict[str, Any]], key: str) -> str:
    """Whether the compiled part `key` of every rank's row is there: on, off, or on some ranks only."""
    found = {row[key] for row in rows}
    return "on" if found == {True} else "off" if found == {False} else "on some ranks only"


def _per_host(rows: list[dict[str, Any]]) -> list[str]:
    """One line per host, in order of its first rank: its ranks, their local ranks and GPUs.

    Across hosts this is the table's point: each host's local ranks must run 0..k-1, and
    the devices show which GPU each local rank drives.
    """
    by_host: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(row)
    lines = []
    for host, members in by_host.items():
        ranks = ", ".join(str(row["rank"]) for row in members)
        local = ", ".join(str(row["local_rank"]) for row in members)
        devices = ", ".join(row["device"].split("@")[0] for row in members)
        lines.append(f"  {host}: rank(s) {ranks}; local rank(s) {local}; device(s) {devices}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the table on rank 0; return the exit status."""
    with DistributedContext.init() as ctx:
        rows = collect(ctx)
        if ctx.rank == 0:
            print(format_table(rows), flush=True)
    return 0
