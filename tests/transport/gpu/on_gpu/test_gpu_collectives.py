"""The other collectives on CuPy tensors (staged through their host implementations)."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP

pytestmark = pytest.mark.mpi(min_size=1)


def on_gpu(result: mt.Tensor, ctx: mt.DistributedContext, cp) -> np.ndarray:
    assert isinstance(result.array, cp.ndarray), type(result.array)
    assert result.device == ctx.device
    return result.numpy()


def test_broadcast(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    root = ctx.size - 1
    mine = mt.full((3, 2), float(ctx.rank), dtype=np.float32)
    result = mt.broadcast(mine, root=root).resolve()
    np.testing.assert_array_equal(on_gpu(result, ctx, cp), np.full((3, 2), float(root), np.float32))


def test_reduce(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    result = mt.reduce(mt.full((4,), ctx.rank + 1, dtype=np.int64), OP.SUM, root=0).resolve()
    if ctx.rank == 0:
        np.testing.assert_array_equal(on_gpu(result, ctx, cp), np.full(4, ctx.size * (ctx.size + 1) // 2))
    else:
        assert result is None


def test_all_gather(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    mine = mt.full((ctx.rank + 1, 2), float(ctx.rank), dtype=np.float64)
    result = mt.all_gather(mine).resolve()
    expected = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(ctx.size)])
    np.testing.assert_array_equal(on_gpu(result, ctx, cp), expected)


def test_reduce_scatter(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    mine = mt.arange(2 * ctx.size, dtype=np.float32)
    result = mt.reduce_scatter(mine, OP.SUM).resolve()
    block = np.arange(2 * ctx.size, dtype=np.float32)[2 * ctx.rank : 2 * ctx.rank + 2] * ctx.size
    np.testing.assert_array_equal(on_gpu(result, ctx, cp), block)


def test_all_to_all(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    mine = mt.tensor(np.array([100 * ctx.rank + j for j in range(ctx.size)], np.int32))
    result = mt.all_to_all(mine).resolve()
    np.testing.assert_array_equal(on_gpu(result, ctx, cp), np.array([100 * i + ctx.rank for i in range(ctx.size)]))


@pytest.mark.mpi(min_size=2)
def test_send_and_recv(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    if ctx.rank == 0:
        assert mt.send(mt.arange(5, dtype=np.float32), 1, tag=3).resolve() is None
    elif ctx.rank == 1:
        template = mt.empty(5, dtype=np.float32)
        result = mt.recv(template, 0, tag=3).resolve()
        np.testing.assert_array_equal(on_gpu(result, ctx, cp), np.arange(5, dtype=np.float32))


def test_fused_all_reduce_of_gpu_and_host_tensors(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    grads = {
        "w": mt.full((3, 3), float(ctx.rank), dtype=np.float32),
        "b": mt.full((3,), 1.0, dtype=np.float64),
        "host": mt.tensor(np.full(2, ctx.rank + 1.0), device="cpu"),
    }
    result = mt.all_reduce(grads, OP.MEAN).resolve()
    assert set(result) == {"w", "b", "host"}
    np.testing.assert_allclose(on_gpu(result["w"], ctx, cp), np.full((3, 3), (ctx.size - 1) / 2, np.float32))
    np.testing.assert_allclose(on_gpu(result["b"], ctx, cp), np.ones(3))
    assert result["host"].device.kind == "cpu"
    np.testing.assert_allclose(result["host"].numpy(), np.full(2, (ctx.size + 1) / 2))
    assert mt.all_reduce(grads, OP.MEAN).resolve() is not result


def test_a_staged_result_is_ordered_on_the_caller_stream(gpu_module_ctx, cp):
    ctx = gpu_module_ctx
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        mine = cp.full(1 << 16, float(ctx.rank), cp.float32)
        result = mt.broadcast(mine, root=0).resolve()
        total = float(result.sum().item())
    assert total == 0.0
    handle = mt.broadcast(mt.ones(3, dtype=np.float32), root=0)
    again = handle.resolve()
    assert handle.resolve() is again


def test_gradient_sync_keeps_gpu_gradients_on_the_gpu_and_does_not_wait_at_submit(gpu_ctx, cp):
    import time

    from tests.transport.gpu.on_gpu.conftest import spin

    ctx = gpu_ctx
    params = {"w": ((64, 32), np.float32), "b": ((32,), np.float16), "h": ((8,), np.float64)}
    sync = mt.GradientSync(params, op=OP.MEAN, bucket_bytes=1 << 20, postscale_factor=2.0)
    w = cp.zeros((64, 32), cp.float32)
    spin(cp, 1.0)  # earlier GPU work: the gradient is written only after it
    w.fill(ctx.rank + 1)
    start = time.monotonic()
    sync.submit("w", w)
    sync.submit("b", cp.full(32, ctx.rank + 1, cp.float16))
    sync.submit("h", np.full(8, ctx.rank + 1.0))  # a host gradient in the same bucket
    took = time.monotonic() - start
    assert took < 0.5, f"submit took {took:.2f} s: it waited for the GPU"
    w.fill(-100)  # the caller may reuse its gradient at once
    mean = 2.0 * sum(r + 1.0 for r in range(ctx.size)) / ctx.size
    result = sync.wait(timeout=60)
    np.testing.assert_array_equal(on_gpu(result["w"], ctx, cp), np.full((64, 32), mean, np.float32))
    assert result["b"].dtype == np.float16
    np.testing.assert_array_equal(on_gpu(result["b"], ctx, cp), np.full(32, mean, np.float16))
    assert isinstance(result["h"].array, np.ndarray)
    np.testing.assert_array_equal(result["h"].numpy(), np.full(8, mean))
