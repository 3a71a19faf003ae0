#!/usr/bin/env python3
"""The GPU smoke test: every GPU code path of mpitensor once, one line per check, and a total.

    mpiexec -n 2 python scripts/gpu_smoke.py        on one GPU (the ranks share it)
    mpiexec -n 2 python scripts/gpu_smoke.py --cpu  the same checks on NumPy arrays and CPU ranks

`scripts/gpu-check.sh` runs it first. Each check opens its own context, compares every
result with a NumPy reference computed from all ranks' inputs (integer-valued, so sums are
exact in every float type), and bounds every wait (``resolve(timeout=...)``, and a time
limit per check); one failing check does not stop the others. Rank 0 prints
``PASS|FAIL|SKIP name (seconds): detail`` per check and a ``TOTAL`` line; the exit status
is 1 if any check failed on any rank. Without CuPy (or a GPU) every GPU check FAILS: it
never passes by skipping. ``--cpu`` checks the references and the checks' logic where
there is no GPU: the GPU-only checks SKIP there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_spin import spin, spin_kernel
from smoke_runner import Skip, run_all

import mpitensor as mt
from mpitensor._core.mpi import MPI, ensure_initialized
from mpitensor._transport.gpu.data_path import data_path
from mpitensor._transport.gpu.pinned import pinned_pool
from mpitensor._transport.gpu.streams import copy_stream

OP = mt.ReduceOperation
RESOLVE_TIMEOUT = float(os.environ.get("GPU_SMOKE_RESOLVE_TIMEOUT", "30"))
CHECK_LIMIT = float(os.environ.get("GPU_SMOKE_CHECK_LIMIT", "60"))

class Env:
    """What the checks share: the mode (GPU or CPU), CuPy, and helpers for contexts and results.

    Args:
        cpu: run the checks on NumPy arrays and CPU ranks (GPU-only checks skip).
    """

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.cupy: Any = None
        self.cupy_error = ""
        if not cpu:
            try:
                import cupy

                self.cupy = cupy
            except Exception as exc:
                self.cupy_error = f"{type(exc).__name__}: {exc}"

    def gpu(self) -> Any:
        """CuPy, or a failure: in GPU mode a check that cannot use CuPy fails, never skips."""
        if self.cupy is None:
            raise RuntimeError(f"CuPy cannot be imported ({self.cupy_error}); set PYTHON to the interpreter holding it")
        return self.cupy

    def gpu_only(self) -> Any:
        """CuPy for a check that needs a GPU; in CPU mode the check skips."""
        if self.cpu:
            raise Skip("needs a GPU (--cpu mode)")
        return self.gpu()

    @contextlib.contextmanager
    def context(self, devices: Any = None, **config: Any) -> Iterator[mt.DistributedContext]:
        """A context of its own for one check, on each rank's GPU (its CPU in CPU mode)."""
        if devices is None:
            config.setdefault("device", "cpu" if self.cpu else "cuda")
        if not self.cpu:
            self.gpu()
        ctx = mt.DistributedContext.init(devices, config=mt.DistributedConfig(**config))
        failed = False
        try:
            yield ctx
        except Skip:
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if not ctx.closed and not ctx.broken:
                if failed:  # the check's own failure is the news, not what closing then says
                    with contextlib.suppress(Exception):
                        ctx.close()
                else:
                    ctx.close()

    def array(self, host: np.ndarray) -> Any:
        """`host` on this rank's GPU (a copy of it in CPU mode)."""
        return host.copy() if self.cpu else self.gpu().asarray(host)

    def expect(self, result: Any, expected: np.ndarray, on_gpu: bool = True) -> None:
        """`result` is a tensor on the GPU (unless `on_gpu` is False) holding exactly `expected`."""
        assert isinstance(result, mt.Tensor), f"result is a {type(result).__name__}, not a Tensor"
        if on_gpu and not self.cpu:
            kind = type(result.array)
            assert isinstance(result.array, self.gpu().ndarray), f"result array is a {kind.__name__}, not CuPy's"
            assert result.device.kind == "cuda", f"result device is {result.device}"
        got = result.numpy()
        assert got.dtype == expected.dtype, f"dtype {got.dtype}, expected {expected.dtype}"
        assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
        if expected.dtype.name == "bfloat16":
            got, expected = got.astype(np.float32), expected.astype(np.float32)
        np.testing.assert_array_equal(got, expected)

    def path(self, ctx: mt.DistributedContext) -> str:
        """This rank's data path, for details."""
        return "host" if self.cpu else data_path(ctx)

    def spin(self, seconds: float, stream: Any = None) -> None:
        """Queue a kernel that keeps the GPU busy for `seconds` on `stream` (default: current)."""
        spin(self.gpu(), seconds, stream)


def values(seed: int, rank: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Rank `rank`'s input: small integers (exact sums in every float type), or bools."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    ints = rng.integers(-3, 4, shape)
    if dtype.kind == "c":
        return (ints + 1j * rng.integers(-3, 4, shape)).astype(dtype)
    return ints.astype(np.float32).astype(dtype) if dtype.name == "bfloat16" else ints.astype(dtype)


def resolve(handle: mt.CollectiveTensor) -> Any:
    """The handle's result, waited for at most `RESOLVE_TIMEOUT` seconds."""
    return handle.resolve(timeout=RESOLVE_TIMEOUT)


CHECKS: list[tuple[str, Callable[[Env], Any]]] = []


def check(name: str) -> Callable[[Callable[[Env], Any]], Callable[[Env], Any]]:
    """Register a check under `name` (run in the order registered)."""

    def register(function: Callable[[Env], Any]) -> Callable[[Env], Any]:
        CHECKS.append((name, function))
        return function

    return register


# -- checks, in the order they run --------------------------------------------------------


@check("cupy: one kernel compiled and run")
def _kernel(env: Env) -> str:
    cupy = env.gpu_only()
    twice = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "mpitensor_gpu_smoke_twice")
    total = float(twice(cupy.arange(4, dtype=cupy.float32)).sum())
    assert total == 12.0, f"2 * (0+1+2+3) gave {total}"
    spin_kernel(cupy)
    runtime = cupy.cuda.runtime
    name = runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    return f"CuPy {cupy.__version__}, CUDA runtime {runtime.runtimeGetVersion()}, {name}; nvrtc and headers found"


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:
            raise Skip(f"ml_dtypes is not installed: {exc}") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32 if name == "empty" else name)


def _all_reduce(dtype_name: str, shared_memory: bool) -> Callable[[Env], str]:
    def run(env: Env) -> str:
        dtype = _dtype(dtype_name)
        shape = (0,) if dtype_name == "empty" else (1000,)
        with env.context(shared_memory=shared_memory) as ctx:
            inputs = [values(7, r, shape, dtype) for r in range(ctx.size)]
            try:
                mine = env.array(inputs[ctx.rank])
            except (TypeError, ValueError) as exc:
                raise Skip(f"CuPy takes no {dtype} array here: {exc}") from exc
            before = pinned_pool().stats()
            result = resolve(mt.all_reduce(mine, OP.SUM))
            expected = functools.reduce(np.add, inputs)
            env.expect(result, expected)
            after = pinned_pool().stats()
            lends = after["hits"] + after["misses"] - before["hits"] - before["misses"]
            return f"{dtype} {shape}, {env.path(ctx)} path, {lends} pinned lends"

    return run


for _variant, _shm in (("mpi-staged", False), ("shared-memory-staged", True)):
    for _name in ("float32", "float16", "bfloat16", "int32", "complex64", "bool", "empty"):
        check(f"all_reduce {_name} {_variant}")(_all_reduce(_name, _shm))


@check("all_reduce MEAN (float32 and int32)")
def _mean(env: Env) -> str:
    with env.context() as ctx:
        floats = [values(8, r, (64,), np.float32) for r in range(ctx.size)]
        ints = [values(9, r, (64,), np.int32) for r in range(ctx.size)]
        got = resolve(mt.all_reduce(env.array(floats[ctx.rank]), OP.MEAN))
        env.expect(got, functools.reduce(np.add, floats) / np.float32(ctx.size))
        got = resolve(mt.all_reduce(env.array(ints[ctx.rank]), OP.MEAN))
        env.expect(got, np.mean(np.stack(ints).astype(np.float64), axis=0))
    return "divided on the device in float32; int32 gives float64"


@check("stream: input produced late on a side stream")
def _late_input(env: Env) -> str:
    cupy = env.gpu_only()
    with env.context() as ctx:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.zeros(1 << 20, cupy.float32)
            env.spin(0.2)  # the values are written only after 0.2 s of GPU work on this stream
            x.fill(ctx.rank + 1)
            y = resolve(mt.all_reduce(x))
            total = float(y.array.sum())
    expected = float(sum(r + 1 for r in range(ctx.size)) * (1 << 20))
    assert total == expected, f"sum {total}, expected {expected}: the input was read before it was written"
    return "the reduction saw the late values"


@check("stream: result ordered on the caller's stream")
def _ordered_result(env: Env) -> str:
    cupy = env.gpu_only()
    with env.context() as ctx:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.full(1 << 20, ctx.rank + 1, cupy.float32)
            pending = mt.all_reduce(x)
            # The copy back queues behind 0.3 s of work on the copy stream: a kernel on the
            # caller's stream not ordered after it would read an unfilled result.
            env.spin(0.3, copy_stream(ctx.device.index))
            y = resolve(pending)
            doubled = cupy.asnumpy(y.array * 2, stream=stream)
    expected = 2.0 * sum(r + 1 for r in range(ctx.size))
    assert (doubled == expected).all(), f"caller's kernel read {doubled[:3]}..., expected {expected}"
    return "a kernel after resolve() saw the result without a host sync"


@check("stream: the call does not wait for earlier GPU work")
def _call_returns(env: Env) -> str:
    cupy = env.gpu_only()
    with env.context() as ctx:
        x = cupy.zeros(1 << 20, cupy.float32)
        env.spin(1.0)  # earlier GPU work: the input is written only after it
        x.fill(ctx.rank + 1)
        before = cupy.cuda.Event()
        before.record(cupy.cuda.get_current_stream())
        mt.barrier()  # in step: the call's consistency check does not wait for a late rank
        start = time.monotonic()
        pending = mt.all_reduce(x)
        took = time.monotonic() - start
        busy = not before.done
        total = float(resolve(pending).array.sum())
    assert busy, "the GPU work queued before the call was already done when it returned"
    assert took < 0.5, f"the call took {took:.2f} s: it waited for earlier GPU work"
    assert total == float(sum(r + 1 for r in range(ctx.size)) * (1 << 20)), f"sum {total}"
    return f"returned in {took * 1e3:.1f} ms with 1 s of GPU work queued before it"


@check("stream: resolve() does not wait for later GPU work")
def _resolve_returns(env: Env) -> str:
    cupy = env.gpu_only()
    with env.context() as ctx:
        x = mt.full((1 << 18,), ctx.rank + 1.0, dtype=np.float32, device=ctx.device)
        pending = mt.all_reduce(x)
        mt.barrier()  # every rank has posted: no rank's copies wait behind another's kernel
        env.spin(2.0)  # GPU work queued between the call and resolve()
        after = cupy.cuda.Event()
        after.record(cupy.cuda.get_current_stream())
        start = time.monotonic()
        result = resolve(pending)
        waited = time.monotonic() - start
        busy = not after.done
        env.expect(result, np.full(1 << 18, sum(r + 1.0 for r in range(ctx.size)), np.float32))
    assert busy, "resolve() returned only after the GPU work queued after the call"
    assert waited < 1.5, f"resolve() took {waited:.2f} s while the GPU computed"
    return f"resolve() took {waited * 1e3:.1f} ms with 2 s of GPU work queued after the call"


@check("pinned buffers reused")
def _pinned_reuse(env: Env) -> str:
    cupy = env.gpu_only()
    with env.context() as ctx:
        if data_path(ctx) != "staged":
            raise Skip(f"data path {data_path(ctx)}: nothing is staged")
        pool = pinned_pool()
        x = mt.ones(1 << 18, dtype=np.float32, device=ctx.device)
        resolve(mt.all_reduce(x))
        cupy.cuda.get_current_stream().synchronize()
        before = pool.stats()
        for _ in range(5):
            resolve(mt.all_reduce(x))
            cupy.cuda.get_current_stream().synchronize()
        after = pool.stats()
    assert after["misses"] == before["misses"], f"{after['misses'] - before['misses']} new pinned blocks in 5 calls"
    assert after["hits"] == before["hits"] + 5, f"{after['hits'] - before['hits']} reuses in 5 calls"
    return f"5 calls, 5 reuses, no new block ({after['cached_bytes']} B cached)"


@check("finished on another thread")
def _other_thread(env: Env) -> str:
    with env.context() as ctx:
        if ctx.thread_level != "multiple":
            raise Skip(f"MPI provides thread level {ctx.thread_level}, not multiple")
        x = mt.full((4096,), float(ctx.rank), dtype=np.float64, device=ctx.device)
        pending = mt.all_reduce(x, OP.MEAN)
        finished_by: list[str] = []

        def poll() -> None:
            deadline = time.monotonic() + RESOLVE_TIMEOUT
            while not pending.test() and time.monotonic() < deadline:
                time.sleep(0.001)
            finished_by.append(threading.current_thread().name)

        worker = threading.Thread(target=poll, name="poller")
        worker.start()
        worker.join(RESOLVE_TIMEOUT + 5)
        env.expect(resolve(pending), np.full(4096, (ctx.size - 1) / 2))
    assert finished_by == ["poller"], f"finished by {finished_by}"
    return "test() on a second thread completed it; resolve() on the first gave the result"


def _others(env: Env, ctx: mt.DistributedContext, kind: str) -> Any:
    """One collective on GPU input; the result and the expected value (None: no result here)."""
    size, rank = ctx.size, ctx.rank
    dev = ctx.device
    if kind == "broadcast":
        got = resolve(mt.broadcast(mt.full((3, 2), float(rank), dtype=np.float32, device=dev), root=size - 1))
        return got, np.full((3, 2), float(size - 1), np.float32)
    if kind == "reduce":
        got = resolve(mt.reduce(mt.full((4,), rank + 1, dtype=np.int64, device=dev), OP.SUM, root=0))
        return got, np.full(4, size * (size + 1) // 2, np.int64) if rank == 0 else None
    if kind == "all_gather":
        got = resolve(mt.all_gather(mt.full((rank + 1, 2), float(rank), dtype=np.float64, device=dev)))
        return got, np.concatenate([np.full((r + 1, 2), float(r)) for r in range(size)])
    if kind == "reduce_scatter":
        base = np.arange(2 * size, dtype=np.float32)
        got = resolve(mt.reduce_scatter(env.array(base * (rank + 1)), OP.SUM))
        return got, base[2 * rank : 2 * rank + 2] * np.float32(size * (size + 1) / 2)
    if kind == "all_to_all":
        got = resolve(mt.all_to_all(env.array(np.array([100 * rank + j for j in range(size)], np.int32))))
        return got, np.array([100 * i + rank for i in range(size)], np.int32)
    if kind == "gather":
        got = resolve(mt.gather(mt.full((rank + 1, 3), float(rank), dtype=np.float32, device=dev), 0))
        expected = np.concatenate([np.full((r + 1, 3), float(r), np.float32) for r in range(size)])
        return got, expected if rank == 0 else None
    whole = np.arange(2 * size * 3, dtype=np.float32).reshape(2 * size, 3)
    if kind == "scatter":  # the root's whole tensor; elsewhere a GPU template of its shape and dtype
        mine = whole if rank == 0 else np.zeros_like(whole)
        return resolve(mt.scatter(env.array(mine), 0)), whole[2 * rank : 2 * rank + 2]
    inputs = [values(11, r, (5,), np.int32) for r in range(size)]
    if kind == "scan":
        got = resolve(mt.scan(env.array(inputs[rank]), OP.SUM))
        return got, functools.reduce(np.add, inputs[: rank + 1])
    got = resolve(mt.exscan(env.array(inputs[rank]), OP.SUM))  # rank 0: SUM's identity
    return got, functools.reduce(np.add, inputs[:rank], np.zeros(5, np.int32))


def _other(kind: str) -> Callable[[Env], str]:
    def run(env: Env) -> str:
        with env.context() as ctx:
            got, expected = _others(env, ctx, kind)
            if expected is None:
                assert got is None, f"a non-root rank got {type(got).__name__}, not None"
            else:
                env.expect(got, expected)
        return "staged through the host collective; result on the GPU"

    return run


for _kind in ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "scan",
              "exscan"):
    check(f"{_kind} of CuPy input")(_other(_kind))


@check("send/recv of CuPy tensors")
def _p2p(env: Env) -> str:
    with env.context() as ctx:
        if ctx.size < 2:
            raise Skip("needs 2 ranks")
        if ctx.rank == 0:
            assert resolve(mt.send(env.array(np.arange(5, dtype=np.float32)), 1, tag=3)) is None
        elif ctx.rank == 1:
            template = env.array(np.zeros(5, np.float32))
            env.expect(resolve(mt.recv(template, 0, tag=3)), np.arange(5, dtype=np.float32))
        mt.barrier()
    return "rank 0 to rank 1; received on the GPU"


@check("fused all_reduce of a list of CuPy arrays")
def _fused(env: Env) -> str:
    with env.context() as ctx:
        specs = [((3, 3), np.float32), ((5,), np.float64), ((4,), np.int32), ((2, 2), np.float16)]
        inputs = [[values(12 + i, r, shape, dt) for i, (shape, dt) in enumerate(specs)] for r in range(ctx.size)]
        result = resolve(mt.all_reduce([env.array(a) for a in inputs[ctx.rank]], OP.SUM))
        assert isinstance(result, list) and len(result) == len(specs), f"result {type(result).__name__}"
        for i, got in enumerate(result):
            env.expect(got, functools.reduce(np.add, [inputs[r][i] for r in range(ctx.size)]))
    return f"{len(specs)} arrays of 4 dtypes in one call, results on the GPU"


def _sync_step(env: Env, sync: mt.GradientSync, value: float) -> tuple[float, dict[str, Any]]:
    """One GradientSync step of GPU gradients written after 0.5 s of GPU work; submit's time, results."""
    w = env.array(np.zeros((64, 32), np.float32))
    b = env.array(np.full(32, value, np.float16))
    if not env.cpu:
        env.spin(0.5)  # earlier GPU work: the gradient is written only after it
    w.fill(value)
    mt.barrier()  # in step: a bucket's consistency check does not wait for a late rank
    start = time.monotonic()
    sync.submit("w", w)
    sync.submit("b", b)
    sync.submit("h", np.full(8, value))  # a host gradient in the same bucket
    took = time.monotonic() - start
    w.fill(-100)  # the caller may reuse its gradient at once
    return took, sync.wait(timeout=RESOLVE_TIMEOUT)


@check("GradientSync on GPU gradients")
def _gradient_sync(env: Env) -> str:
    with env.context() as ctx:
        params = {"w": ((64, 32), np.float32), "b": ((32,), np.float16), "h": ((8,), np.float64)}
        sync = mt.GradientSync(params, op=OP.MEAN, bucket_bytes=1 << 20, postscale_factor=2.0)
        mean = 2.0 * sum(r + 1.0 for r in range(ctx.size)) / ctx.size
        for _ in range(2):  # the first step compiles the kernels: the second one is timed
            took, result = _sync_step(env, sync, ctx.rank + 1.0)
            env.expect(result["w"], np.full((64, 32), mean, np.float32))
            env.expect(result["b"], np.full(32, mean, np.float16))
            env.expect(result["h"], np.full(8, mean), on_gpu=False)
            assert isinstance(result["h"].array, np.ndarray), "the host gradient left the host"
    assert env.cpu or took < 0.3, f"submit took {took:.2f} s: it waited for the GPU"
    return f"submit took {took * 1e3:.1f} ms; GPU gradients reduced on their GPU, the host one on the host"


def _mixed_devices(env: Env, size: int) -> list[mt.Device]:
    """Rank 0 (and every even rank) on its CPU, the others on GPU 0 (every rank's CPU in CPU mode)."""
    kind = "cpu" if env.cpu else "cuda"
    return [mt.Device("cpu", 0, r) if r % 2 == 0 else mt.Device(kind, 0, r) for r in range(size)]


@check("context mixing CPU and GPU ranks")
def _mixed(env: Env) -> str:
    size = MPI.COMM_WORLD.Get_size()
    if size < 2:
        raise Skip("needs 2 ranks")
    if not env.cpu:
        env.gpu()
    with env.context(_mixed_devices(env, size)) as ctx:
        for elements in (4, 1 << 20):  # MPI's size, then the shared-memory all-reduce's
            mine = mt.full((elements,), ctx.rank + 1.0)
            result = resolve(mt.all_reduce(mine, OP.MEAN))
            assert result.device == ctx.device, f"result on {result.device}, not {ctx.device}"
            env.expect(result, np.full(elements, (ctx.size + 1) / 2), on_gpu=ctx.device.kind == "cuda")
    return f"rank {ctx.rank} on {ctx.device}; 4 and 2**20 elements"


@check("CUDA-aware path forced, on managed memory")
def _cuda_aware(env: Env) -> str:
    cupy = env.gpu_only()
    # Managed memory is readable by the host, so a host-only MPI can take its pointers.
    with cupy.cuda.using_allocator(cupy.cuda.malloc_managed), env.context(cuda_aware="all") as ctx:
        assert data_path(ctx) == "cuda-aware", f"data path {data_path(ctx)} with cuda_aware='all'"
        inputs = [values(13, r, (1000,), np.float32) for r in range(ctx.size)]
        before = pinned_pool().stats()
        for op, combine in ((OP.SUM, np.add), (OP.MAX, np.maximum)):
            got = resolve(mt.all_reduce(cupy.asarray(inputs[ctx.rank]), op))
            env.expect(got, functools.reduce(combine, inputs))
        got = resolve(mt.all_reduce(cupy.asarray(inputs[ctx.rank]), OP.MEAN))
        env.expect(got, functools.reduce(np.add, inputs) / np.float32(ctx.size))
        after = pinned_pool().stats()
    lends = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    assert lends == 0, f"{lends} pinned buffers lent: the input was staged, not handed to MPI"
    return "SUM, MAX (keys encoded on the device) and MEAN through MPI on device pointers"


def main(argv: list[str] | None = None) -> int:
    """Run the checks; the exit status (1 if any failed on any rank)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="NumPy arrays on CPU ranks; GPU-only checks skip")
    parser.add_argument("--only", help="run only the checks whose name contains this")
    args = parser.parse_args(argv)
    mt.defer_finalize()  # one context per check: MPI must outlive each
    ensure_initialized()
    world = MPI.COMM_WORLD
    env = Env(args.cpu)
    checks = [(n, f) for n, f in CHECKS if args.only is None or args.only in n]
    if world.Get_rank() == 0:
        mode = "cpu" if args.cpu else f"gpu, CuPy {getattr(env.cupy, '__version__', 'missing')}"
        library = MPI.Get_library_version().splitlines()[0]
        print(f"gpu_smoke: {len(checks)} checks on {world.Get_size()} ranks ({mode}), {library}", flush=True)
    emit = functools.partial(print, flush=True) if world.Get_rank() == 0 else None
    return run_all(checks, env, limit=CHECK_LIMIT, allgather=world.allgather, emit=emit)


if __name__ == "__main__":
    sys.exit(main())
