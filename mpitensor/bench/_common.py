"""What the benchmarks share: sizes, timing, the gloo baseline, and writing results.

Timing follows the OSU micro-benchmarks: a barrier, warm-up calls, then a batch of calls
timed with ``MPI.Wtime``; a batch's time is the slowest rank's, and a figure is the median
over repeated batches. Batch sizes are calibrated once from the warm-up (the slowest rank's
time, so every rank runs the same number of calls).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._core import mpi as _mpi
from .._core.mpi import MPI

__all__ = [
    "Timing",
    "busbw_factor",
    "check_variants",
    "format_size",
    "machine",
    "parse_size",
    "parse_sizes",
    "round_done",
    "start_gloo",
    "stop_gloo",
    "write_json",
    "write_text",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``"8"``, ``"64K"``, ``"16MiB"``, ... (binary units).

    Raises:
        ValueError: not a size.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (expected e.g. 8, 64K, 16M)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """Sizes from ``"8:64M"`` (powers of two from 8 B to 64 MiB) or ``"4K,1M,16M"``.

    Raises:
        ValueError: malformed, or a bound is not positive.
    """
    if ":" in text:
        low_text, high_text = text.split(":", 1)
        low, high = parse_size(low_text), parse_size(high_text)
        if low <= 0 or high < low:
            raise ValueError(f"bad size range {text!r}")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 2
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"bad sizes {text!r}")
    return sizes


def format_size(nbytes: int) -> str:
    """``8 B``, ``64 KiB``, ``16 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def busbw_factor(ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of all-reduce, 2(n-1)/n."""
    return 2 * (ranks - 1) / ranks if ranks > 1 else 1.0


class Timing:
    """Times callables the OSU way on a communicator.

    Args:
        comm: the communicator whose ranks all run the benchmark.
        target: seconds a timed batch should last (the batch size is calibrated to it).
        reps: batches per figure (the figure is their median).
        max_iters: the most calls in a batch.
        min_iters: the fewest calls in a batch.
    """

    def __init__(self, comm: Any, target: float, reps: int, max_iters: int = 5000, min_iters: int = 3) -> None:
        self.comm = comm
        self.target = target
        self.reps = reps
        self.max_iters = max_iters
        self.min_iters = min_iters
        self._iters: dict[Any, int] = {}

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds`."""
        return self.comm.allreduce(seconds, op=MPI.MAX)

    def batch(self, key: Any, call: Callable[[], Any], warmup: int = 2) -> float:
        """Warm up, then time one batch of `call`; seconds per call (the slowest rank's).

        The batch size is calibrated the first time `key` is seen.
        """
        comm = self.comm
        iters = self._iters.get(key)
        if iters is None:
            comm.Barrier()
            start = MPI.Wtime()
            for _ in range(max(1, warmup)):
                call()
            per_call = self.slowest((MPI.Wtime() - start) / max(1, warmup))
            iters = int(min(self.max_iters, max(self.min_iters, self.target / max(per_call, 1e-9))))
            self._iters[key] = iters
        else:
            for _ in range(warmup):
                call()
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iters):
            call()
        return self.slowest((MPI.Wtime() - start) / iters)

    def iterations(self, key: Any) -> int:
        """The calibrated batch size of `key` (0 if not yet timed)."""
        return self._iters.get(key, 0)


def check_variants(variants: Sequence[str], known: Sequence[str]) -> None:
    """Raise ValueError when `variants` names one that is not in `known`."""
    unknown = sorted(set(variants) - set(known))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; expected some of {list(known)}")


def round_done(progress: Callable[[str], None] | None, comm: Any, family: str, rep: int, reps: int) -> None:
    """Tell `progress` (on rank 0 only) that round `rep` of `family` is over."""
    if progress is not None and comm.Get_rank() == 0:
        progress(f"{family}: round {rep + 1}/{reps} done")


def seconds_per_call(call: Callable[[], Any], reps: int, barrier: Callable[[], None]) -> float:
    """This rank's mean seconds per call of `reps` calls, after a warm-up and a barrier."""
    return times_per_call(call, reps, barrier)[0]


def times_per_call(call: Callable[[], Any], reps: int, barrier: Callable[[], None]) -> tuple[float, float]:
    """This rank's mean seconds per call of `reps` calls, and the CPU seconds its process spent per call.

    The CPU time counts every thread of the process (``time.process_time``): a wait that
    polls shows there, one that sleeps in the kernel does not.
    """
    for _ in range(max(3, reps // 10)):
        call()
    barrier()
    cpu = time.process_time()
    began = time.perf_counter()
    for _ in range(reps):
        call()
    ended = time.perf_counter()
    return (ended - began) / reps, (time.process_time() - cpu) / reps


def median(values: Sequence[float]) -> float:
    """The median (NaN for no values)."""
    return statistics.median(values) if values else float("nan")


def machine(comm: Any) -> dict[str, Any]:
    """What the run ran on: hosts, cores, memory, CPU, MPI, Python and NumPy versions."""
    import numpy

    hosts = comm.allgather(MPI.Get_processor_name() or socket.gethostname())
    name, version = _mpi.vendor()
    info: dict[str, Any] = {
        "ranks": comm.Get_size(),
        "hosts": sorted(set(hosts)),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": _memory_gib(),
        "mpi": f"{name} {version}",
        "mpi_library": _mpi.library_version().replace("\x00", "").strip(),
        "thread_level": _mpi.thread_level_name(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "mpi4py": _mpi_version(),
        "platform": platform.platform(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "mpitensor.bench", *sys.argv[1:]]),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MPITENSOR_")},
        "load_before": load_average(),
        "source": _source_version(),
    }
    return info


def _source_version() -> str | None:
    """The git commit the package was run from, with ``+changes`` for uncommitted edits."""
    import subprocess

    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system does not say)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _mpi_version() -> str:
    import mpi4py

    return str(mpi4py.__version__)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page / (1 << 30), 1)


# -- the torch.distributed (gloo) baseline -----------------------------------------------


def start_gloo(comm: Any) -> Any:
    """Join every rank of `comm` to a torch.distributed gloo group, or None without torch.

    The rendezvous address is rank 0's host (loopback when every rank is on it) and a free
    port rank 0 picks; MPI broadcasts both.

    Returns:
        The ``torch.distributed`` module, initialized; None when torch is not installed.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    from datetime import timedelta

    torch.set_num_threads(1)
    hosts = comm.allgather(socket.gethostname())
    address = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}:{port}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=timedelta(seconds=120),
    )
    return dist


def stop_gloo(dist: Any) -> None:
    """Leave the gloo group `start_gloo` joined; call it once no DDP model of the group is left.

    Whoever drops the last reference to gloo's process group waits there for gloo's worker
    threads, which may need the GIL to free a finished work. DDP's reducer drops its
    reference holding the GIL, so where it drops the last one the rank hangs for good. The
    group's own binding releases the GIL as it ends the group: a reference of it is held
    here while DDP's garbage is collected and the group destroyed, and dropped last.
    """
    if dist is None or not dist.is_initialized():
        return
    group = dist.group.WORLD
    gc.collect()
    dist.destroy_process_group()
    del group  # the last reference: the process group ends here, with the GIL released


# -- output -----------------------------------------------------------------------------------


def write_text(path: str, text: str) -> None:
    """Write `text` to `path`, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_json(path: str, data: Any) -> None:
    """Write `data` as indented JSON to `path` (NaN becomes null)."""
    write_text(path, json.dumps(_clean(data), indent=1, sort_keys=False) + "\n")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and value != value:  # NaN
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (right-aligned columns but the first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table aligned for a terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
    return "\n".join(lines)


def us(seconds: float | None) -> str:
    """Seconds as microseconds with a sensible number of digits (``-`` for none)."""
    if seconds is None or seconds != seconds:
        return "-"
    micro = seconds * 1e6
    return f"{micro:.2f}" if micro < 10 else f"{micro:.1f}" if micro < 1000 else f"{micro:.0f}"


def ratio(value: float | None) -> str:
    """A ratio as ``1.23x`` (``-`` for none)."""
    if value is None or value != value:
        return "-"
    return f"{value:.2f}x"


def gbps(bytes_per_second: float | None) -> str:
    """Bytes per second as GB/s (``-`` for none)."""
    if bytes_per_second is None or bytes_per_second != bytes_per_second:
        return "-"
    return f"{bytes_per_second / 1e9:.2f}"


def size_axis(axis: Any, sizes: Sequence[int]) -> None:
    """A log2 x axis labelled with sizes (8 B, 1 KiB, ...), and a light grid."""
    axis.set_xscale("log", base=2)
    ticks = [n for n in sizes if (n.bit_length() - 1) % 3 == 0] or list(sizes)
    axis.set_xticks(ticks)
    axis.set_xticklabels([format_size(n).replace(" ", "") for n in ticks], fontsize=8)
    axis.grid(True, which="both", alpha=0.3)


__all__ += ["load_average", "markdown_table", "median", "ratio", "seconds_per_call", "size_axis", "text_table",
            "times_per_call", "us", "gbps"]
