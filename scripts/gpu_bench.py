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
``all_reduce`` and ``resolve`` is hidden behind the communication. The numbers are also
returned (and written as JSON with ``--json``).
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
    """One by-hand staged all-reduce of `x` into `y` through pinned `host`."""
    runtime = cp.cuda.runtime
    nbytes = x.nbytes

    def step() -> None:
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


def run(sizes_mib: list[int]) -> dict[str, Any]:
    """Measure every size; return the results (the same on every rank)."""
    import cupy as cp

    results: dict[str, Any] = {"rows": []}
    # The benchmark is of the staged path: it is declared, whatever MPI could take.
    staged = mt.DistributedConfig(device="cuda", cuda_aware=False)
    mpi_only = mt.DistributedConfig(device="cuda", cuda_aware=False, shared_memory=False)
    with mt.DistributedContext.init(config=staged) as ctx:
        comm = ctx.comm.Dup()
        stream = cp.cuda.Stream(non_blocking=True)
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
            results["rows"].append({"mib": mib, "floor_s": floor, "staged_s": ours})
            del y, host, host_array, check
        results["overlap"] = overlap(cp, comm, ctx, 16 * MIB)
        results["ranks"] = ctx.size
        results["path"] = "staged"
        results["mpi"] = " ".join(_mpi.vendor())
        results["device"] = cp.cuda.runtime.getDeviceProperties(ctx.device.index)["name"].decode()
        comm.Free()
    with mt.DistributedContext.init(config=mpi_only) as ctx:
        comm = ctx.comm.Dup()
        for row in results["rows"]:
            count = row["mib"] * MIB // 4
            x = mt.full((count,), 1.0, dtype=np.float32, device=ctx.device)
            iterations = ITERATIONS.get(row["mib"], 5)
            row["mpi_only_s"] = timed(comm, mpitensor_step(cp, x), iterations, 1 if row["mib"] > 16 else 3)
        comm.Free()
    return results


def format_results(results: dict[str, Any]) -> str:
    """The results as a table with the ratios to the floor."""
    lines = [
        f"staged GPU all-reduce, float32, {results['ranks']} rank(s), {results['mpi']}, {results['device']}",
        f"{'size':>8}  {'floor ms':>9}  {'staged ms':>9}  {'ratio':>6}  {'MPI-only ms':>11}  {'ratio':>6}",
    ]
    for row in results["rows"]:
        floor = row["floor_s"]
        lines.append(
            f"{row['mib']:>4} MiB  {floor * 1e3:>9.3f}  {row['staged_s'] * 1e3:>9.3f}  "
            f"{row['staged_s'] / floor:>6.2f}  {row['mpi_only_s'] * 1e3:>11.3f}  {row['mpi_only_s'] / floor:>6.2f}"
        )
    o = results["overlap"]
    lines.append(
        f"overlap, {o['nbytes'] // MIB} MiB: all-reduce alone {o['all_reduce_s'] * 1e3:.2f} ms, "
        f"{o['matmuls']} matmul(s) alone {o['compute_s'] * 1e3:.2f} ms, both {o['both_s'] * 1e3:.2f} ms: "
        f"{o['hidden_fraction'] * 100:.0f}% of the shorter hidden"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    mt.defer_finalize()  # two contexts, one after the other
    start = time.monotonic()
    results = run(args.sizes_mib)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(format_results(results))
        print(f"(benchmark took {time.monotonic() - start:.1f} s)", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
