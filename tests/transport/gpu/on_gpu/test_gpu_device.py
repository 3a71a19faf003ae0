"""Each rank on its GPU: the device init picks, CuPy-backed tensors, interop, the info row."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.device import visible_gpu_count
from mpitensor._tools.info import collect
from mpitensor._transport.gpu.data_path import data_path

pytestmark = pytest.mark.mpi(min_size=1)


def test_each_rank_owns_the_gpu_of_its_local_rank(gpu_ctx, cp):
    ctx = gpu_ctx
    count = visible_gpu_count()
    assert ctx.device.kind == "cuda"
    assert ctx.device.index == ctx.local_rank % count
    assert all(d.kind == "cuda" for d in ctx.devices)
    assert cp.cuda.runtime.getDevice() == ctx.device.index


def test_default_init_picks_the_gpu(cp):
    with mt.DistributedContext.init() as ctx:
        assert ctx.device.kind == "cuda"


def test_cpu_can_be_forced_on_a_gpu_machine():
    with mt.DistributedContext.init(config=mt.DistributedConfig(device="cpu")) as ctx:
        assert ctx.device.kind == "cpu"


def test_a_gpu_this_rank_does_not_have_is_refused(gpu_ctx):
    count = visible_gpu_count()
    rank = gpu_ctx.device.rank
    devices = [mt.Device("cuda", count, d.rank) for d in gpu_ctx.devices]
    with pytest.raises(mt.DeviceError, match=rf"^rank {rank} was given device cuda:{count}, but it sees {count} "):
        mt.DistributedContext.init(devices)


def test_factories_make_cupy_tensors_on_the_rank_gpu(gpu_ctx, cp):
    device = gpu_ctx.device
    for t in (
        mt.zeros((2, 3), dtype=np.float32),
        mt.ones(4, device=device),
        mt.full((2,), 7, device=device),
        mt.arange(5, device=device),
        mt.tensor([[1, 2], [3, 4]], device=device),
    ):
        assert isinstance(t.array, cp.ndarray)
        assert t.device == device
        assert t.array.device.id == device.index


def test_to_moves_between_host_and_gpu(gpu_ctx, cp):
    host = mt.tensor(np.arange(6.0).reshape(2, 3), device="cpu")
    gpu = host.to(gpu_ctx.device)
    assert isinstance(gpu.array, cp.ndarray)
    assert gpu.device == gpu_ctx.device
    assert gpu.to(gpu_ctx.device) is gpu
    back = gpu.to("cpu")
    assert isinstance(back.array, np.ndarray)
    np.testing.assert_array_equal(back.numpy(), host.numpy())
    np.testing.assert_array_equal(np.asarray(gpu), host.numpy())


def test_cuda_array_interface_and_dlpack_share_memory(gpu_ctx, cp):
    t = mt.arange(8, dtype=np.float32, device=gpu_ctx.device)
    ptr = t.array.data.ptr
    assert t.__cuda_array_interface__["data"][0] == ptr
    assert cp.asarray(t).data.ptr == ptr
    shared = cp.from_dlpack(t)
    assert shared.data.ptr == ptr
    shared[0] = 42
    assert float(t[0].item()) == 42.0
    again = mt.as_tensor(cp.from_dlpack(shared))
    assert again.device.kind == "cuda" and again.array.data.ptr == ptr


def test_gpu_tensor_arithmetic_stays_on_the_gpu(gpu_ctx, cp):
    t = mt.ones(4, dtype=np.float32, device=gpu_ctx.device)
    t += 1
    u = (t * 3).sum()
    assert isinstance(u.array, cp.ndarray)
    assert float(u.item()) == 24.0


def test_info_row_names_the_device_and_the_data_path(gpu_ctx):
    rows = collect(gpu_ctx)
    mine = rows[gpu_ctx.rank]
    assert mine["device"] == str(gpu_ctx.device)
    assert mine["path"] == data_path(gpu_ctx)
    assert mine["path"] in ("cuda-aware", "staged")
