"""Staged GPU all-reduce against its floor, both measured in this run (run under mpiexec).

    mpiexec -n 2 python scripts/gpu_bench.py [--sizes-mib 1 16 256] [--json FILE]

For each size (float32), rank 0 prints the median over iterations of the slowest rank's
time for:

- floor: the same work done by hand with CuPy and mpi4py: copy the device array into
  pinned host memory and wait, ``MPI_Iallreduce`` in place on it and wait, copy back to
  the device and wait;
- staged: ``mt.all_reduce(x).resolve()`` on the staged path, then a wait for the stream
  (the result is on the GPU), with the default settings (large messages within a node
  may take the shared-memory all-reduce);
- staged, MPI only: the same with ``shared_memory=False``, i.e. the floor's algorithm;

and each one's ratio to the floor. Then how much of GPU compute queued between
``all_reduce`` and ``resolve`` is hidden behind the communication. Each row is printed as
soon as it is measured (and the JSON of ``--json`` rewritten), so a failure loses nothing
measured before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpitensor as mt
from mpitensor._core import mpi as _mpi
from mpitensor._core.mpi import MPI

MIB = 1 << 20
ITERATIONS = {1: 40, 16: 15, 256: 5}


def timed(comm: Any, fn: Callable[[], None], iterations: int, warmup: int) -> float:
    """The median over iterations of the slowest rank's seconds for `fn` (barrier first)."""
    for _ in range(warmup):
        fn()
    comm.Barrier()
    times = np.empty(iterations)
    for i in range(iterations):
        comm.Barrier()
        start = MPI.Wtime()
        fn()
        times[i] = MPI.Wtime() - start
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return float(statistics.median(slowest))


def floor_step(cp: Any, comm: Any, x: Any, y: Any, host: np.ndarray, stream: Any) -> Callable[[], None]:
    """One by-hand staged all-reduce of `x` into `y` through pinned `host`.

    The copy runs on `stream`, after the work queued so far on the stream current now (the
    one that produced `x`): an event recorded there is waited for on `stream` first.
    """
    runtime = cp.cuda.runtime
    nbytes = x.nbytes
    producer = cp.cuda.get_current_stream()
    produced = cp.cuda.Event(disable_timing=True)

    def step() -> None:
        produced.record(producer)
        stream.wait_event(produced)
        runtime.memcpyAsync(host.ctypes.data, x.data.ptr, nbytes, runtime.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        comm.Iallreduce(MPI.IN_PLACE, [host, MPI.FLOAT], MPI.SUM).Wait()
        runtime.memcpyAsync(y.data.ptr, host.ctypes.data, nbytes, runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

    return step


def mpitensor_step(cp: Any, x: mt.Tensor) -> Callable[[], None]:
    """One ``mt.all_reduce(x).resolve()`` with the result waited for on the GPU."""

    def step() -> None:
        mt.all_reduce(x).resolve()
        cp.cuda.get_current_stream().synchronize()

    return step


def overlap(cp: Any, comm: Any, ctx: mt.DistributedContext, nbytes: int) -> dict[str, float]:
    """Time an all-reduce alone, matmuls alone, and both with the matmuls in between."""
    x = mt.ones(nbytes // 4, dtype=np.float32, device=ctx.device)
    a = cp.random.random((4096, 4096), dtype=cp.float32)
    b = cp.random.random((4096, 4096), dtype=cp.float32)
    stream = cp.cuda.get_current_stream()

    def one_matmul() -> None:
        _ = a @ b
        stream.synchronize()

    per_matmul = timed(comm, one_matmul, 5, 2)
    comm_alone = timed(comm, mpitensor_step(cp, x), 5, 2)
    count = max(1, round(comm_alone / per_matmul))

    def compute() -> None:
        for _ in range(count):
            _ = a @ b
        stream.synchronize()

    def both() -> None:
        pending = mt.all_reduce(x)
        for _ in range(count):
            _ = a @ b
        pending.resolve()
        stream.synchronize()

    compute_alone = timed(comm, compute, 5, 1)
    together = timed(comm, both, 5, 1)
    hidden = (comm_alone + compute_alone - together) / min(comm_alone, compute_alone)
    return {
        "nbytes": nbytes,
        "all_reduce_s": comm_alone,
        "compute_s": compute_alone,
        "matmuls": count,
        "both_s": together,
        "hidden_fraction": hidden,
    }


class Report:
    """Prints on rank 0 as soon as something is measured, and rewrites the JSON each time,
    so a failure later in the run loses nothing measured before it."""

    def __init__(self, json_path: str | None) -> None:
        self.results: dict[str, Any] = {"rows": []}
        self.json_path = json_path
        self.rank0 = MPI.COMM_WORLD.Get_rank() == 0

    def line(self, text: str) -> None:
        """Print `text` (rank 0) and save the results so far."""
        if not self.rank0:
            return
        print(text, flush=True)
        if self.json_path:
            with open(self.json_path, "w", encoding="utf-8") as out:
                json.dump(self.results, out, indent=2)


def staged_rows(cp: Any, ctx: mt.DistributedContext, comm: Any, sizes_mib: list[int], report: Report) -> None:
    """The floor and the staged all-reduce of each size, a row printed as each is measured."""
    stream = cp.cuda.Stream(non_blocking=True)
    report.line(f"{'size':>8}  {'floor ms':>9}  {'staged ms':>9}  {'ratio':>6}")
    for mib in sizes_mib:
        count = mib * MIB // 4
        iterations = ITERATIONS.get(mib, 10 if mib < 64 else 5)
        warmup = 3 if mib <= 16 else 1
        x = mt.full((count,), ctx.rank + 1.0, dtype=np.float32, device=ctx.device)
        y = cp.empty(count, cp.float32)
        host = cp.cuda.alloc_pinned_memory(count * 4)
        host_array = np.frombuffer(host, np.float32, count)
        floor = timed(comm, floor_step(cp, comm, x.array, y, host_array, stream), iterations, warmup)
        expected = float(sum(r + 1 for r in range(ctx.size)))
        assert float(y[0]) == expected and float(y[-1]) == expected, "the floor computed a wrong sum"
        ours = timed(comm, mpitensor_step(cp, x), iterations, warmup)
        check = mt.all_reduce(x).resolve()
        assert float(check[0].item()) == expected, "mpitensor computed a wrong sum"
        report.results["rows"].append({"mib": mib, "floor_s": floor, "staged_s": ours})
        report.line(f"{mib:>4} MiB  {floor * 1e3:>9.3f}  {ours * 1e3:>9.3f}  {ours / floor:>6.2f}")
        del y, host, host_array, check


def mpi_only_rows(cp: Any, ctx: mt.DistributedContext, comm: Any, report: Report) -> None:
    """The staged all-reduce without the shared-memory transport, against the same floors."""
    report.line(f"{'size':>8}  {'MPI-only ms':>11}  {'ratio':>6}   (shared_memory=False)")
    for row in report.results["rows"]:
        count = row["mib"] * MIB // 4
        x = mt.full((count,), 1.0, dtype=np.float32, device=ctx.device)
        iterations = ITERATIONS.get(row["mib"], 5)
        seconds = timed(comm, mpitensor_step(cp, x), iterations, 1 if row["mib"] > 16 else 3)
        row["mpi_only_s"] = seconds
        report.line(f"{row['mib']:>4} MiB  {seconds * 1e3:>11.3f}  {seconds / row['floor_s']:>6.2f}")


def run(sizes_mib: list[int], report: Report) -> dict[str, Any]:
    """Measure every size, reporting as it goes; return the results (the same on every rank)."""
    import cupy as cp

    results = report.results
    # The benchmark is of the staged path: it is declared, whatever MPI could take.
    staged = mt.DistributedConfig(device="cuda", cuda_aware=False)
    mpi_only = mt.DistributedConfig(device="cuda", cuda_aware=False, shared_memory=False)
    with mt.DistributedContext.init(config=staged) as ctx:
        comm = ctx.comm.Dup()
        results["ranks"] = ctx.size
        results["path"] = "staged"
        results["mpi"] = " ".join(_mpi.vendor())
        name = cp.cuda.runtime.getDeviceProperties(ctx.device.index)["name"]
        results["device"] = name.decode() if isinstance(name, bytes) else name
        report.line(f"staged GPU all-reduce, float32, {ctx.size} rank(s), {results['mpi']}, {results['device']}")
        staged_rows(cp, ctx, comm, sizes_mib, report)
        results["overlap"] = overlap(cp, comm, ctx, 16 * MIB)
        report.line(format_overlap(results["overlap"]))
        comm.Free()
    with mt.DistributedContext.init(config=mpi_only) as ctx:
        comm = ctx.comm.Dup()
        mpi_only_rows(cp, ctx, comm, report)
        comm.Free()
    return results


def format_overlap(o: dict[str, Any]) -> str:
    """The overlap measurement as one line."""
    return (
        f"overlap, {o['nbytes'] // MIB} MiB: all-reduce alone {o['all_reduce_s'] * 1e3:.2f} ms, "
        f"{o['matmuls']} matmul(s) alone {o['compute_s'] * 1e3:.2f} ms, both {o['both_s'] * 1e3:.2f} ms: "
        f"{o['hidden_fraction'] * 100:.0f}% of the shorter hidden"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    mt.defer_finalize()  # two contexts, one after the other
    start = time.monotonic()
    report = Report(args.json)
    run(args.sizes_mib, report)
    report.line(f"(benchmark took {time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
