"""Per-call ratios of mpitensor's all-reduce to raw mpi4py, robust on a shared machine.

    mpiexec -n 2 python scripts/percall.py [ROUNDS]

Each round times short batches of every case in turn (raw ``Iallreduce`` + ``Wait`` at 8 B,
1 KiB and 64 KiB and of a packed 1 MiB buffer; mpitensor with the check off at those sizes
and with it on at 8 B, SUM and MAX (raw MAX is MPI's own on the floats, which does not give
NumPy's NaN; mpitensor reduces keys); 8 B given as a CPU torch tensor and as a JAX array (when installed)
and as a Python float, check off; the fused all-reduce of 256 x 4 KiB, check off and on). Each figure
is the 10th percentile of its batches (the slowest rank's clock is not needed: every batch
starts at a barrier), so other programs' bursts on the machine do not move it much. Rank 0
prints one JSON line of ratios and times. To compare two trees, run it alternately with
``PYTHONPATH`` set to each and take the medians of the ratios.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import numpy as np

import mpitensor as mt
from mpitensor._core.mpi import MPI

try:
    import torch
except ImportError:
    torch = None
try:
    import jax.numpy as jnp
except ImportError:
    jnp = None

_SIZES = {8: 200, 1024: 200, 65536: 40}  # bytes: calls per batch


def _timer(comm: MPI.Comm, samples: dict[str, list[float]]) -> Callable[[str, Callable[[], object], int], None]:
    def run(name: str, call: Callable[[], object], count: int) -> None:
        comm.Barrier()
        start = time.perf_counter_ns()
        for _ in range(count):
            call()
        samples.setdefault(name, []).append((time.perf_counter_ns() - start) / count / 1000)

    return run


def main(rounds: int) -> None:
    """Time every case `rounds` times, interleaved, and print the ratios on rank 0."""
    mt.defer_finalize()
    with mt.DistributedContext.init():
        pass
    comm = MPI.COMM_WORLD.Dup()
    samples: dict[str, list[float]] = {}
    run = _timer(comm, samples)
    arrays = {n: (np.ones(n // 4, np.float32), np.empty(n // 4, np.float32)) for n in _SIZES}
    leaves = [np.ones(1024, np.float32) for _ in range(256)]
    packed, packed_out = np.ones(256 * 1024, np.float32), np.empty(256 * 1024, np.float32)
    for _ in range(rounds):
        for n, (send, recv) in arrays.items():
            run(f"raw {n}", lambda s=send, r=recv: comm.Iallreduce(s, r, MPI.SUM).Wait(), _SIZES[n])
            run(f"raw max {n}", lambda s=send, r=recv: comm.Iallreduce(s, r, MPI.MAX).Wait(), _SIZES[n])
        run("raw packed", lambda: comm.Iallreduce(packed, packed_out, MPI.SUM).Wait(), 10)
        for check in (False, True):
            suffix = " on" if check else ""
            with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)):
                for n, (send, _) in arrays.items():
                    if not check or n == 8:
                        tensor = mt.from_numpy(send.copy())
                        run(f"mt{suffix} {n}", lambda t=tensor: mt.all_reduce(t).resolve(), _SIZES[n])
                        run(f"mt max{suffix} {n}", lambda t=tensor: mt.all_reduce(t, "max").resolve(), _SIZES[n])
                if not check:
                    if torch is not None:
                        small = torch.ones(2)
                        run("mt torch 8", lambda t=small: mt.all_reduce(t).resolve(), _SIZES[8])
                    if jnp is not None:
                        small_jax = jnp.ones(2, jnp.float32)
                        run("mt jax 8", lambda t=small_jax: mt.all_reduce(t).resolve(), _SIZES[8])
                    run("mt float 8", lambda: mt.all_reduce(0.5).resolve(), _SIZES[8])
                tensors = [mt.from_numpy(leaf) for leaf in leaves]
                mt.all_reduce(tensors).resolve()  # a new context's first large call sets up shared memory
                run(f"fused{suffix}", lambda ts=tensors: mt.all_reduce(ts).resolve(), 10)
    if comm.Get_rank() == 0:
        low = {name: float(np.percentile(values, 10)) for name, values in samples.items()}
        print(json.dumps({
            "8 B check off": low["mt 8"] / low["raw 8"],
            "1 KiB check off": low["mt 1024"] / low["raw 1024"],
            "64 KiB check off": low["mt 65536"] / low["raw 65536"],
            "8 B check on": low["mt on 8"] / low["raw 8"],
            **{f"MAX {label} check off": low[f"mt max {n}"] / low[f"raw max {n}"]
               for n, label in ((8, "8 B"), (1024, "1 KiB"), (65536, "64 KiB"))},
            "MAX 8 B check on": low["mt max on 8"] / low["raw max 8"],
            **({"8 B torch, check off": low["mt torch 8"] / low["raw 8"]} if torch is not None else {}),
            **({"8 B JAX, check off": low["mt jax 8"] / low["raw 8"],
                "8 B JAX / NumPy, check off": low["mt jax 8"] / low["mt 8"]} if jnp is not None else {}),
            "8 B Python float, check off": low["mt float 8"] / low["raw 8"],
            "fused 256 x 4 KiB / raw packed, check off": low["fused"] / low["raw packed"],
            "fused, check on": low["fused on"] / low["raw packed"],
            "times_us": low,
        }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
