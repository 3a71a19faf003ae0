"""all_reduce of CuPy tensors: values, stream order, overlap, pooling, threads, paths."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._transport.gpu.data_path import cuda_awareness, data_path
from mpitensor._transport.gpu.pinned import pinned_pool
from mpitensor._transport.gpu.streams import copy_stream
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ARITHMETIC, OP, assert_matches, rank_input, reference, seed_of
from tests.transport.gpu.on_gpu.conftest import spin

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = [np.bool_, np.int8, np.int32, np.int64, np.uint8, np.float16, np.float32, np.float64,
          np.complex64, np.complex128]
SHAPES = [(), (0,), (7,), (3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ARITHMETIC, ids=lambda o: o.name)
def test_every_op_dtype_shape(gpu_module_ctx, cp, op, dtype, shape):
    ctx = gpu_module_ctx
    seed = seed_of("gpu", op.name, np.dtype(dtype).name, shape)
    mine = mt.tensor(rank_input(seed, ctx.rank, shape, dtype), device=ctx.device)
    result = mt.all_reduce(mine, op).resolve()
    assert isinstance(result, mt.Tensor)
    assert isinstance(result.array, cp.ndarray)
    assert result.device == ctx.device
    expected = reference(op, [rank_input(seed, r, shape, dtype) for r in range(ctx.size)])
    assert_matches(result, expected, op, ctx.size)


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups(gpu_module_ctx, kind):
    ctx = gpu_module_ctx
    members = group_members(kind, ctx.size, ctx.rank)
    if members is None:
        pytest.skip(f"rank {ctx.rank} is outside the {kind} group")
    seed = seed_of("gpu-group", kind)
    mine = mt.tensor(rank_input(seed, ctx.rank, (5, 3), np.float64), device=ctx.device)
    result = mt.all_reduce(mine, OP.MEAN, devices=[ctx.devices[r] for r in members]).resolve()
    expected = reference(OP.MEAN, [rank_input(seed, r, (5, 3), np.float64) for r in members])
    assert_matches(result, expected, OP.MEAN, len(members))


def test_mean_is_divided_on_the_device_in_the_input_dtype(gpu_ctx, cp):
    ctx = gpu_ctx
    result = mt.all_reduce(mt.full((3,), ctx.rank + 1.0, dtype=np.float32), OP.MEAN).resolve()
    assert result.dtype == np.float32 and isinstance(result.array, cp.ndarray)
    np.testing.assert_allclose(result.numpy(), np.full(3, (ctx.size + 1) / 2, np.float32))
    ints = mt.all_reduce(mt.full((3,), ctx.rank, dtype=np.int32), OP.MEAN).resolve()
    assert ints.dtype == np.float64
    np.testing.assert_allclose(ints.numpy(), np.full(3, (ctx.size - 1) / 2))


def test_non_contiguous_input_and_bare_cupy_arrays(gpu_ctx, cp):
    ctx = gpu_ctx
    base = cp.arange(12, dtype=cp.float32).reshape(3, 4) * (ctx.rank + 1)
    result = mt.all_reduce(base.T).resolve()
    assert result.device == ctx.device
    factor = sum(r + 1 for r in range(ctx.size))
    np.testing.assert_array_equal(result.numpy(), (np.arange(12, dtype=np.float32).reshape(3, 4) * factor).T)


def test_the_input_cannot_be_written_while_in_flight(cp):
    # Without a progress thread nothing completes the op before the next engine call.
    config = mt.DistributedConfig(device="cuda", progress=False)
    with mt.DistributedContext.init(config=config) as ctx:
        x = mt.ones(16, dtype=np.float32, device=ctx.device)
        pending = mt.all_reduce(x)
        with pytest.raises(mt.TensorInFlightError, match=r"call resolve\(\) on its CollectiveTensor"):
            x += 1
        pending.resolve()
        x += 1
        assert float(x.sum().item()) == 32.0


def test_input_produced_late_on_a_side_stream_is_what_gets_reduced(gpu_ctx, cp):
    ctx = gpu_ctx
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.zeros(1 << 20, cp.float32)
        spin(cp, 0.2)  # the values below are written only after 0.2 s of GPU work
        x.fill(ctx.rank + 1)
        y = mt.all_reduce(x).resolve()
        total = float(y.sum().item())
    assert total == float(sum(r + 1 for r in range(ctx.size)) * (1 << 20))


def test_the_call_returns_before_earlier_gpu_work_completes(gpu_ctx, cp):
    ctx = gpu_ctx
    stream = cp.cuda.get_current_stream()
    x = cp.zeros(1 << 20, cp.float32)
    spin(cp, 1.0)  # earlier GPU work: the input is written only after it
    x.fill(ctx.rank + 1)
    before = cp.cuda.Event()
    before.record(stream)
    start = time.monotonic()
    pending = mt.all_reduce(x)
    took = time.monotonic() - start
    assert not before.done, "the call waited for the GPU work queued before it"
    assert took < 0.5, f"the call took {took:.2f} s: it waited for earlier GPU work"
    total = float(pending.resolve(timeout=60).sum().item())
    assert total == float(sum(r + 1 for r in range(ctx.size)) * (1 << 20))


def test_the_result_is_ordered_on_the_caller_stream(gpu_ctx, cp):
    ctx = gpu_ctx
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.full(1 << 20, ctx.rank + 1, cp.float32)
        pending = mt.all_reduce(x)
        # Hold the copy stream up: the copy back is queued behind 0.3 s of other work, so
        # a caller's kernel not ordered after it would read an unfilled result.
        spin(cp, 0.3, copy_stream(ctx.device.index))
        y = pending.resolve()
        doubled = (y * 2).numpy()
    assert (doubled == 2.0 * sum(r + 1 for r in range(ctx.size))).all()


def test_gpu_compute_after_the_call_overlaps_it(gpu_ctx, cp):
    ctx = gpu_ctx
    x = mt.full((1 << 18,), ctx.rank + 1.0, dtype=np.float32, device=ctx.device)
    spin(cp, 0.0)
    pending = mt.all_reduce(x)
    mt.barrier()  # every rank has posted: no rank's copies wait behind another's kernel
    stream = cp.cuda.get_current_stream()
    spin(cp, 2.0)  # GPU work queued between the call and resolve()
    after_spin = cp.cuda.Event()
    after_spin.record(stream)
    start = time.monotonic()
    result = pending.resolve(timeout=60)
    waited = time.monotonic() - start
    assert not after_spin.done, "resolve() waited for the GPU work queued after the all_reduce"
    assert waited < 1.5, f"resolve() took {waited:.2f} s while the GPU computed"
    np.testing.assert_array_equal(result.numpy(), np.full(1 << 18, sum(r + 1.0 for r in range(ctx.size)), np.float32))


def test_finish_may_run_on_another_thread(gpu_ctx, cp):
    ctx = gpu_ctx
    if ctx.thread_level != "multiple":
        pytest.skip(f"MPI provides thread level {ctx.thread_level}, not multiple")
    x = mt.full((4096,), float(ctx.rank), dtype=np.float64, device=ctx.device)
    pending = mt.all_reduce(x, OP.MEAN)
    finished_by: list[str] = []

    def poll() -> None:
        deadline = time.monotonic() + 60
        while not pending.test() and time.monotonic() < deadline:
            time.sleep(0.001)
        finished_by.append(threading.current_thread().name)

    worker = threading.Thread(target=poll, name="poller")
    worker.start()
    worker.join(90)
    assert finished_by == ["poller"]
    result = pending.resolve()
    np.testing.assert_allclose(result.numpy(), np.full(4096, (ctx.size - 1) / 2))


def test_staging_buffers_are_pooled(gpu_ctx, cp):
    if data_path(gpu_ctx) != "staged":
        pytest.skip("the cuda-aware path does not stage")
    pool = pinned_pool()
    x = mt.ones(1 << 18, dtype=np.float32, device=gpu_ctx.device)
    mt.all_reduce(x).resolve()
    cp.cuda.get_current_stream().synchronize()
    before = pool.stats()
    for _ in range(5):
        mt.all_reduce(x).resolve()
        cp.cuda.get_current_stream().synchronize()
    after = pool.stats()
    assert after["misses"] == before["misses"]
    assert after["hits"] == before["hits"] + 5


SIZES = pytest.mark.parametrize("elements", [4, 1 << 20], ids=["small", "shared-memory-size"])


@pytest.mark.mpi(min_size=2)
@SIZES
def test_cpu_and_gpu_ranks_of_one_context(cp, elements):
    # Even ranks on their GPU, odd ranks on their CPU (this is every rank's own device).
    from mpitensor._core.mpi import MPI

    size = MPI.COMM_WORLD.Get_size()
    devices = [mt.Device("cuda", 0, r) if r % 2 == 0 else mt.Device("cpu", 0, r) for r in range(size)]
    with mt.DistributedContext.init(devices) as ctx:
        mine = mt.full((elements,), ctx.rank + 1.0)
        assert mine.device.kind == ("cpu" if ctx.rank % 2 else "cuda")
        result = mt.all_reduce(mine, OP.MEAN).resolve(timeout=60)
        assert result.device == ctx.device
        np.testing.assert_array_equal(result.numpy(), np.full(elements, (ctx.size + 1) / 2))


@pytest.mark.mpi(min_size=2)
@SIZES
def test_host_and_gpu_arrays_in_one_call(gpu_ctx, cp, elements):
    ctx = gpu_ctx
    if elements > 4 and data_path(ctx) == "cuda-aware":
        pytest.skip("on a CUDA-aware MPI, mixed host and GPU inputs of this size need shared_memory=False")
    mine = np.full(elements, ctx.rank + 1.0) if ctx.rank % 2 else cp.full(elements, ctx.rank + 1.0)
    result = mt.all_reduce(mine, OP.MEAN).resolve(timeout=60)
    assert (result.device.kind == "cpu") == bool(ctx.rank % 2)
    np.testing.assert_array_equal(result.numpy(), np.full(elements, (ctx.size + 1) / 2))


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_get_a_clear_error(gpu_ctx):
    ctx = gpu_ctx
    x = mt.zeros(3 + (ctx.rank == 1), dtype=np.float32, device=ctx.device)
    with pytest.raises(mt.CollectiveMismatchError, match=r"Mismatched all_reduce tensor shapes"):
        mt.all_reduce(x).resolve()
    result = mt.all_reduce(mt.ones(2, dtype=np.float32, device=ctx.device)).resolve()
    np.testing.assert_array_equal(result.numpy(), np.full(2, float(ctx.size), np.float32))


def test_the_cuda_aware_path(gpu_ctx, cp):
    decision = cuda_awareness(gpu_ctx)
    if not decision.takes("nonblocking"):
        pytest.skip(f"MPI takes no device buffers in non-blocking collectives here: {decision.path}, {decision.detail}")
    ctx = gpu_ctx
    x = mt.full((1 << 16,), ctx.rank + 1.0, dtype=np.float32, device=ctx.device)
    result = mt.all_reduce(x, OP.MEAN).resolve()
    np.testing.assert_allclose(result.numpy(), np.full(1 << 16, (ctx.size + 1) / 2, np.float32))
